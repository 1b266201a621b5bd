"""Ingestion: loaders per file type, language-aware splitting, the built-in knowledge base."""

from megalith_qa.ingest.builtin import builtin_documents
from megalith_qa.ingest.loaders import (
    SUPPORTED_TYPES,
    UnsafeNameError,
    UnsupportedTypeError,
    file_kind,
    load_bytes,
    sanitize_filename,
)
from megalith_qa.ingest.splitter import TextSplitter

__all__ = [
    "SUPPORTED_TYPES",
    "TextSplitter",
    "UnsafeNameError",
    "UnsupportedTypeError",
    "builtin_documents",
    "file_kind",
    "load_bytes",
    "sanitize_filename",
]
