"""Rank-aware logging: libraries log through `get_logger`; `log_rank0` for messages every rank repeats."""

from __future__ import annotations

import logging
import os


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def log_rank0(logger: logging.Logger, msg: str, *args: object, level: int = logging.INFO) -> None:
    """Log `msg` only on global rank 0 (for messages every rank would otherwise repeat)."""
    if _rank() == 0:
        logger.log(level, msg, *args)


def configure_logging(level: int = logging.INFO) -> None:
    """For entrypoints only: a compact handler that prefixes the rank."""
    fmt = f"[rank{_rank()}] %(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S")
