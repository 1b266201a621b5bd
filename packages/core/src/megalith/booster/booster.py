"""`Booster`: one object that applies a parallelism plugin and precision, and owns checkpoints.

booster = Booster(plugin=ZeroPlugin(stage=2), precision="bf16")
model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(model, optimizer, ...)
booster.backward(loss, optimizer); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from megalith.booster.optim_state import load_optimizer_state, save_optimizer_state
from megalith.booster.plugins.base import Plugin
from megalith.booster.plugins.ddp import DDPPlugin
from megalith.booster.precision import Precision
from megalith.checkpoint import (
    ModelReader,
    commit,
    fresh_staging,
    is_sharded_model,
    read_json,
    read_model_into,
    read_rng,
    resolve,
    restore_rng,
    staging_path,
    write_hf_streamed,
    write_json,
    write_model,
    write_model_pieces,
    write_rng,
)
from megalith.common.errors import CheckpointError, ConfigError
from megalith.distributed import StatefulDataLoader, StatefulDistributedSampler, barrier
from megalith.optim import BoostedOptimizer

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
SHARDED_MODEL = "model_sharded"  # save_state's model part under a sharded plugin (ZeRO-3, FSDP)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class Booster:
    def __init__(self, plugin: Plugin | None = None, precision: str | Precision = "fp32") -> None:
        self.plugin = plugin or DDPPlugin()
        self.precision = precision if isinstance(precision, Precision) else Precision(precision)

    # -- setup ------------------------------------------------------------------------------------
    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[nn.Module, BoostedOptimizer | None, Any, Any, Any]:
        """Wrap model and optimizer for the plugin and precision. The optimizer object you pass is
        updated in place (its param_groups point at the masters), so an LR scheduler built on it works."""
        if not isinstance(model, nn.Module):
            raise ConfigError(f"boost() needs an nn.Module, got {type(model).__name__}")
        boosted = self.plugin.configure(model, optimizer, self.precision)
        return boosted.model, boosted.optimizer, criterion, dataloader, lr_scheduler

    def prepare_dataloader(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        **kwargs: Any,
    ) -> StatefulDataLoader:
        """A DataLoader sharded over dp whose position is saved by `save_state`."""
        sampler = StatefulDistributedSampler(
            dataset,  # type: ignore[arg-type]
            num_replicas=self.plugin.dp_size(),
            rank=self.plugin.dp_rank(),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        # A private generator: creating an iterator must not draw from the global torch RNG, or a
        # resumed run (which creates its iterator after restoring the RNG) would diverge.
        kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        return StatefulDataLoader(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs
        )

    # -- training verbs -------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: BoostedOptimizer | None) -> None:
        if optimizer is None:
            loss.backward()
            return
        optimizer.backward(loss)

    @contextmanager
    def no_sync(
        self, model: nn.Module | None = None, optimizer: BoostedOptimizer | None = None
    ) -> Iterator[None]:
        """Gradient accumulation: backward passes inside skip gradient reduction."""
        with self.plugin.no_sync(model, optimizer):
            yield

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.plugin.unwrap(model)

    # -- model checkpoints ------------------------------------------------------------------------------
    def save_model(
        self, model: nn.Module, path: str | Path, shard: bool = True, max_shard_size_mb: int = 2048
    ) -> Path:
        """HF-loadable safetensors directory (plus config.json for HF models), written atomically."""
        path = Path(path)
        if self.plugin.sharded_params:  # every rank gathers one piece at a time; rank 0 writes
            _save_sharded_export(self.plugin, model, path, max_shard_size_mb * 2**20 if shard else 2**62)
            return path
        if _rank() == 0:
            staging = fresh_staging(path)
            write_model(self.unwrap(model), staging, max_shard_size_mb * 2**20, shard)
            commit(path)
        barrier()
        return path

    def load_model(
        self,
        model: nn.Module,
        path: str | Path,
        optimizer: BoostedOptimizer | None = None,
        strict: bool = True,
    ) -> None:
        """Load weights into a boosted model; pass the optimizer so its fp32 masters follow.

        Reads an HF directory or a sharded model checkpoint (`save_state` of a sharded plugin);
        sharded plugins read only the ranges this rank holds."""
        root = resolve(path)
        if self.plugin.sharded_params or is_sharded_model(root):
            self.plugin.load_model_pieces(model, optimizer, ModelReader(root))
            return
        read_model_into(self.unwrap(model), root, strict=strict)
        if optimizer is not None:
            optimizer.load_masters_from_model()

    # -- optimizer checkpoints ------------------------------------------------------------------------------
    def save_optimizer(self, optimizer: BoostedOptimizer, path: str | Path) -> Path:
        """Per-rank shards plus meta.json; loadable at another dp size or under another plugin."""
        path = Path(path)
        if _rank() == 0:
            fresh_staging(path)
        barrier()
        self._save_optim(optimizer, staging_path(path))
        barrier()
        if _rank() == 0:
            commit(path)
        barrier()
        return path

    def _save_optim(self, optimizer: BoostedOptimizer, directory: Path) -> None:
        """Plugins whose shards are not ranges of the flattened parameters (tensor parallelism)
        write their own pieces; everything else uses the generic per-rank piece writer."""
        custom = getattr(self.plugin, "save_optimizer_state", None)
        if custom is not None:
            custom(optimizer, directory)
        else:
            save_optimizer_state(optimizer, directory, _rank())

    def _load_optim(self, optimizer: BoostedOptimizer, directory: Path) -> None:
        custom = getattr(self.plugin, "load_optimizer_state", None)
        if custom is not None:
            custom(optimizer, directory)
        else:
            load_optimizer_state(optimizer, directory)

    def load_optimizer(self, optimizer: BoostedOptimizer, path: str | Path) -> None:
        self._load_optim(optimizer, resolve(path))

    # -- full training state ------------------------------------------------------------------------------
    def save_state(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: BoostedOptimizer,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        step: int = 0,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Everything needed for exact resume: model, optimizer, scheduler, sampler, every rank's RNG, step."""
        path = Path(path)
        if _rank() == 0:
            staging = fresh_staging(path)
        barrier()
        staging = staging_path(path)
        if self.plugin.sharded_params:  # every rank writes the pieces it holds
            write_model_pieces(
                staging / SHARDED_MODEL, _rank(), _world(), self.plugin.model_pieces(model), _shapes(model)
            )
        if _rank() == 0:
            if not self.plugin.sharded_params:
                write_model(self.unwrap(model), staging / "model")
            _save_config(
                self.unwrap(model), staging / (SHARDED_MODEL if self.plugin.sharded_params else "model")
            )
            trainer = {
                "format": STATE_FORMAT,
                "step": step,
                "world_size": _world(),
                "plugin": self.plugin.name,
                "precision": self.precision.name,
                "extra": extra or {},
            }
            write_json(staging / "state.json", trainer)
            torch.save(
                {
                    "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                    "dataloader": dataloader.state_dict() if hasattr(dataloader, "state_dict") else None,
                },
                staging / "trainer.pt",
            )
        self._save_optim(optimizer, staging / "optimizer")
        write_rng(staging / "rng", _rank())
        barrier()
        if _rank() == 0:
            commit(path)
        barrier()
        return path

    def load_state(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: BoostedOptimizer,
        lr_scheduler: Any = None,
        dataloader: Any = None,
    ) -> dict[str, Any]:
        """Restore what `save_state` wrote; returns state.json (with "step" and "extra")."""
        root = resolve(path)
        meta = read_json(root / "state.json")
        if meta.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{root} has state format {meta.get('format')}, expected {STATE_FORMAT}")
        self.load_model(model, root / SHARDED_MODEL if (root / SHARDED_MODEL).exists() else root / "model")
        self._load_optim(optimizer, root / "optimizer")
        trainer = torch.load(root / "trainer.pt", weights_only=False)
        if lr_scheduler is not None and trainer["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(trainer["lr_scheduler"])
        if (
            dataloader is not None
            and trainer["dataloader"] is not None
            and hasattr(dataloader, "load_state_dict")
        ):
            dataloader.load_state_dict(trainer["dataloader"])
        saved_world = int(meta["world_size"])
        if saved_world == _world():
            restore_rng(read_rng(root / "rng", _rank()))
        else:
            logger.warning(
                "checkpoint written at world size %d, now %d: RNG streams restart from rank 0's",
                saved_world,
                _world(),
            )
            restore_rng(read_rng(root / "rng", 0))
        return meta


def _save_config(model: nn.Module, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(directory))


def _shapes(model: nn.Module) -> dict[str, tuple[list[int], str]]:
    return {n: (list(t.shape), str(t.dtype)) for n, t in model.state_dict(keep_vars=True).items()}


def _save_sharded_export(plugin: Plugin, model: nn.Module, path: Path, max_shard_bytes: int) -> None:
    """HF export under a sharded plugin: every rank drives the (collective) export, rank 0 writes."""
    staging = fresh_staging(path) if _rank() == 0 else None
    write_hf_streamed(plugin.export_state(model), staging, max_shard_bytes)
    if staging is not None:
        _save_config(plugin.unwrap(model), staging)
        commit(path)
    barrier()
