"""`expand-vocab` orchestration: expand a tokenizer file, resize and initialise a model, save both.

Tokenizer input: a `tokenizer.json` (BPE), a SentencePiece `.model`, or a directory holding one
(`tokenizer.json` is preferred when both are present). The output directory gets the expanded
tokenizer file under the same name, the other tokenizer files of the source directory
(config, special tokens, chat template; for SentencePiece any stale `tokenizer.json` is left out),
and, when a model is given, the resized model (`save_pretrained`).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalith.common.errors import CheckpointError, ConfigError
from megalith_llama.io import atomic_directory, check_output_free
from megalith_llama.tokenizer import (
    Expansion,
    chars_per_token,
    expand_bpe,
    expand_sentencepiece,
    init_new_embeddings,
)

logger = logging.getLogger(__name__)

_NOT_TOKENIZER_FILES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "megalith_source.json",
)


@dataclass(frozen=True)
class VocabReport:
    """What an expansion did, including the compression rate (characters per token) on a text."""

    kind: str
    output: str
    vocab_before: int
    vocab_after: int
    requested_added: int
    intermediate_added: int
    existing: tuple[str, ...]
    unreachable: tuple[str, ...]
    chars_per_token_before: float
    chars_per_token_after: float
    model_resized: bool


def locate_tokenizer_file(path: Path) -> tuple[str, Path]:
    """("bpe" | "sentencepiece", file) for a tokenizer file or a directory that holds one."""
    if path.is_dir():
        for name, kind in (("tokenizer.json", "bpe"), ("tokenizer.model", "sentencepiece")):
            if (path / name).is_file():
                return kind, path / name
        raise CheckpointError(f"no tokenizer.json or tokenizer.model in {path}")
    if not path.is_file():
        raise CheckpointError(f"tokenizer file not found: {path}")
    if path.suffix == ".json":
        return "bpe", path
    if path.suffix == ".model":
        return "sentencepiece", path
    raise ConfigError(f"unsupported tokenizer file {path}: expected tokenizer.json or a SentencePiece .model")


def _expand_file(
    kind: str, file: Path, tokens: list[str]
) -> tuple[bytes, Expansion, Callable, Callable, int, int]:
    if kind == "bpe":
        from tokenizers import Tokenizer

        old = Tokenizer.from_file(str(file))
        new, exp = expand_bpe(old, tokens)
        return (new.to_str(pretty=True).encode(), exp, lambda s: old.encode(s).ids, lambda s: new.encode(s).ids,
                old.get_vocab_size(), new.get_vocab_size())  # fmt: skip
    import sentencepiece as spm

    old_bytes = file.read_bytes()
    new_bytes, exp = expand_sentencepiece(old_bytes, tokens)
    old_sp = spm.SentencePieceProcessor(model_proto=old_bytes)
    new_sp = spm.SentencePieceProcessor(model_proto=new_bytes)
    return new_bytes, exp, old_sp.encode, new_sp.encode, old_sp.get_piece_size(), new_sp.get_piece_size()


def _copy_tokenizer_files(src: Path, dst: Path, kind: str) -> None:
    for f in sorted(src.iterdir()):
        skip = f.suffix in _NOT_TOKENIZER_FILES or f.name in _MODEL_FILES or not f.is_file()
        if skip or (kind == "sentencepiece" and f.name == "tokenizer.json"):
            continue
        shutil.copy2(f, dst / f.name)


def expand_vocabulary(
    tokenizer_path: str | os.PathLike[str],
    tokens: list[str],
    output: str | os.PathLike[str],
    model: Any = None,
    text: str = "",
    overwrite: bool = False,
) -> VocabReport:
    """Expand the tokenizer at `tokenizer_path` with `tokens`, resize `model` (if given), save to `output`."""
    check_output_free(output, overwrite)  # before the expansion work, not after it
    path = Path(tokenizer_path)
    kind, file = locate_tokenizer_file(path)
    data, exp, old_encode, new_encode, before, after = _expand_file(kind, file, tokens)
    if model is not None:
        init_new_embeddings(model, exp.new_tokens)
    with atomic_directory(output, overwrite=overwrite) as tmp:
        if path.is_dir():
            _copy_tokenizer_files(path, tmp, kind)
        (tmp / file.name).write_bytes(data)
        if model is not None:
            model.save_pretrained(tmp)
    if exp.unreachable:
        logger.warning(
            "%d new token(s) are not produced by the tokenizer: %s", len(exp.unreachable), exp.unreachable
        )
    return VocabReport(
        kind=kind,
        output=str(output),
        vocab_before=before,
        vocab_after=after,
        requested_added=sum(t.requested for t in exp.new_tokens),
        intermediate_added=sum(not t.requested for t in exp.new_tokens),
        existing=exp.existing,
        unreachable=exp.unreachable,
        chars_per_token_before=chars_per_token(old_encode, text) if text else float("nan"),
        chars_per_token_after=chars_per_token(new_encode, text) if text else float("nan"),
        model_resized=model is not None,
    )
