"""Helpers of the training recipe: metrics log, checkpoints on disk, FLOPs and MFU, the loss plot,
and the cached preparation of the built-in corpus."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from megalith.checkpoint import atomic

logger = logging.getLogger(__name__)


class MetricsLog:
    """Append-only jsonl of metrics (rank 0). On resume, lines past the resumed step are dropped so the
    file describes exactly one trajectory."""

    def __init__(self, path: Path, enabled: bool, truncate_after: int | None = None) -> None:
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_after is not None and truncate_after > 0 and path.exists():
            kept = [line for step, line in _records(path) if step <= truncate_after]
            atomic.write_text(path, "".join(line + "\n" for line in kept))
        elif not truncate_after and path.exists():
            path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({**record, "time": time.time()}) + "\n")


def _records(path: Path) -> list[tuple[int, str]]:
    """(step, line) of every record. A run killed while appending leaves a partial last line: it is
    skipped with a warning; an undecodable line anywhere else is a `DataError` naming it."""
    from megalith.common.errors import DataError

    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    records = []
    for i, (lineno, line) in enumerate(lines):
        try:
            records.append((int(json.loads(line)["step"]), line))
        except (ValueError, KeyError, TypeError) as exc:
            if i < len(lines) - 1:
                raise DataError(f"{path}:{lineno}: not a metrics record ({exc})") from exc
            logger.warning("%s:%d: dropping a partial last line (%r)", path, lineno, line[:80])
    return records


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record (a partial last line skipped, as on resume)."""
    return [json.loads(line) for _, line in _records(path)]


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete `step_*` checkpoint under `root` (staging dirs are hidden and ignored)."""
    steps = [p for p in checkpoint_dirs(root) if (p / "state.json").exists()]
    return steps[-1] if steps else None


def checkpoint_dirs(root: Path) -> list[Path]:
    """Every `step_<N>` directory under `root`, complete or not, in step order."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def prune_checkpoints(root: Path, keep: int, newest: Path | None = None) -> None:
    """Delete all but the `keep` (>= 1) newest checkpoints up to `newest`, the one just written,
    which is never deleted. Checkpoints with a higher step than `newest` are not this trajectory's
    (a resume from an earlier one); they are left alone."""
    from megalith.common.errors import ConfigError

    if keep < 1:
        raise ConfigError(f"keep_checkpoints must be >= 1, got {keep}")
    steps = checkpoint_dirs(root)
    if newest is not None:
        newest_step = int(newest.name[5:])
        steps = [p for p in steps if int(p.name[5:]) <= newest_step and p.name != newest.name]
        keep -= 1  # `newest` itself is one of the kept
    for old in steps[: max(0, len(steps) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


class _LanguageModel(Protocol):
    """What `flops_per_token` reads of an HF causal LM (a `PreTrainedModel`, PEFT-wrapped or not)."""

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def get_input_embeddings(self) -> torch.nn.Module | None: ...


def flops_per_token(model: _LanguageModel, config: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6N (matmuls, forward + backward) + 12·L·d·S (attention scores),
    the PaLM appendix-B estimate; N excludes the input embedding (a lookup, no FLOPs)."""
    n = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings()
    if emb is not None and not getattr(config, "tie_word_embeddings", False):
        weight = emb.weight
        assert isinstance(weight, torch.Tensor)  # an embedding's weight is a parameter, never a module
        n -= weight.numel()
    return 6.0 * n + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


_PEAK_CACHE: dict[tuple[str, str], float] = {}
# Dense peak FLOP/s of well-known accelerators (vendor datasheets).
_GPU_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The denominator of MFU: a datasheet figure for known GPUs; on CPU, the rate of a 1-second fp32
    GEMM probe on this process's threads (so MFU on CPU means "fraction of achievable GEMM speed")."""
    key = (str(device), precision)
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    peak: float | None = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in _GPU_PEAKS.items() if k in name), None)
        if peak is not None and precision == "fp32":
            peak /= 2  # TF32 tensor-core rate
    else:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        torch.mm(a, b)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            torch.mm(a, b)
            n += 1
        peak = n * 2 * 512**3 / (time.perf_counter() - t0)
    if peak is not None:
        _PEAK_CACHE[key] = peak
    return peak


def plot_curve(metrics: Path, out: Path) -> Path:
    """Training loss per step and held-out loss at the eval points, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if val:
        ax.plot(*zip(*val, strict=True), "o--", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("llama-pretrain")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def prepared_builtin(tokenizer: Any, seq_len: int, data_dir: str | None, rank: int) -> Path:
    """The built-in corpus's train split prepared for this tokenizer and seq_len, cached in the data
    directory (prepared once by rank 0; other ranks wait at the caller's barrier)."""
    from megalith_llama.data import InputSpec, PrepareConfig, prepare
    from megalith_llama.encoding import tokenizer_hash
    from megalith_llama.paths import data_dir as resolve_data_dir

    out = (
        resolve_data_dir(data_dir) / "prepared" / f"builtin-train-{tokenizer_hash(tokenizer)[:12]}-{seq_len}"
    )
    if rank == 0 and not (out / "manifest.json").exists():
        logger.info("preparing the built-in corpus into %s", out)
        config = PrepareConfig(inputs=(InputSpec.parse("builtin:train"),), seq_len=seq_len)
        prepare(config, tokenizer, out, overwrite=True)
    return out
