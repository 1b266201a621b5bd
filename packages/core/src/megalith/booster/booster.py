"""`Booster`: one object that applies a parallelism plugin and precision, and owns checkpoints.

booster = Booster(plugin=ZeroPlugin(stage=2), precision="bf16")
model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(model, optimizer, ...)
booster.backward(loss, optimizer); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from megalith.booster.checkpointing import (
    AsyncCheckpoint,
    checkpoint_group,
    load_optimizer_dcp,
    model_reader,
    model_shapes,
    save_model_dcp,
    state_job,
)
from megalith.booster.optim_state import load_optimizer_state, save_optimizer_state
from megalith.booster.plugins.base import Plugin
from megalith.booster.plugins.ddp import DDPPlugin
from megalith.booster.precision import Precision
from megalith.booster.state_files import StateFiles, agreed, check_optimizer, read_state_files
from megalith.checkpoint import (
    DCPModelReader,
    DCPReader,
    ModelReader,
    PieceReader,
    check_shapes,
    commit,
    fresh_staging,
    is_dcp,
    is_sharded_model,
    read_model_into,
    resolve,
    restore_rng,
    staging_path,
    write_hf_streamed,
    write_json,
    write_model,
    write_rng,
)
from megalith.common.errors import ConfigError
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
    def __init__(
        self,
        plugin: Plugin | None = None,
        precision: str | Precision = "fp32",
        kernels: bool | Iterable[str] = False,
        compile: bool = False,
        compile_options: Mapping[str, Any] | None = None,
    ) -> None:
        """`precision`: "fp32", "bf16" / "fp16" (fp32 master weights; fp16 with loss scaling) or
        "bf16-true" (everything in bf16, no masters; DDPPlugin and ZeroPlugin stages 1-2).
        `kernels=True` swaps megalith's fused kernels into HF Llama/Qwen2/Mistral models
        (`megalith.policies.kernels`), a collection of names (`KERNELS`: "rms_norm", "rope",
        "swiglu", "cross_entropy", "qkv") only those; `compile=True` runs `torch.compile` on the boosted model
        and leaves plain causal masks of HF models to SDPA's `is_causal` (`megalith.policies.sdpa`);
        `compile_options` go to it as Inductor options (`torch.compile(options=...)`, e.g.
        ``{"coordinate_descent_tuning": True}``)."""
        if plugin is not None and not isinstance(plugin, Plugin):
            raise ConfigError(
                f"Booster(plugin=...) needs a Plugin instance (e.g. ZeroPlugin(stage=2)), got {plugin!r}"
            )
        self.plugin = plugin or DDPPlugin()
        # boosted model → its optimizer, so `load_model` refreshes the fp32 masters even when the
        # caller does not pass the optimizer (a later step would copy the old masters back)
        self._optimizer_of: weakref.WeakKeyDictionary[nn.Module, BoostedOptimizer] = (
            weakref.WeakKeyDictionary()
        )
        self.precision = precision if isinstance(precision, Precision) else Precision(precision)
        if self.precision.name == "bf16-true" and not self.plugin.supports_bf16_true:
            raise ConfigError(
                f"precision 'bf16-true' is implemented for DDPPlugin and ZeroPlugin stages 1-2, "
                f"not {self.plugin.name}; use precision='bf16' (fp32 masters)"
            )
        self.kernels: frozenset[str] = frozenset()
        if kernels:
            from megalith.policies.kernels import kernel_set

            self.kernels = kernel_set(None if kernels is True else kernels)
        if compile_options is not None and not (compile and isinstance(compile_options, Mapping)):
            raise ConfigError(
                f"Booster(compile_options={compile_options!r}) needs compile=True and a mapping of "
                "Inductor option names to values"
            )
        self.compile = compile
        self.compile_options = dict(compile_options or {})

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
        if self.kernels:
            _apply_kernels(self.plugin, model, self.kernels)
        if self.compile:
            from megalith.policies.sdpa import use_mask_free_causal_sdpa

            use_mask_free_causal_sdpa(model)  # no-op unless an HF model on "sdpa"
        boosted = self.plugin.configure(model, optimizer, self.precision)
        if self.compile:
            options = self.compile_options or None
            boosted.model.compile(options=options)  # in place: parameter names and state_dict keys unchanged
        if boosted.optimizer is not None:
            self._optimizer_of[boosted.model] = boosted.optimizer
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

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Callable[..., torch.Tensor] | None = None,
        optimizer: BoostedOptimizer | None = None,
        return_loss: bool = True,
    ) -> dict[str, Any]:
        """ColossalAI's verb: forward + backward of `next(data_iter)` split into microbatches and run
        by the plugin's pipeline schedule; `criterion(outputs, microbatch)` on the last stage (None:
        the model's own causal-LM loss). Returns {"loss": mean loss on every rank or None, "outputs": None}."""
        run = getattr(self.plugin, "execute_pipeline", None)
        if run is None:
            raise ConfigError(f"plugin {self.plugin.name} has no pipeline: use HybridPlugin(pp_size=...)")
        return dict(run(data_iter, model, criterion, optimizer, return_loss))

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.plugin.unwrap(model)

    # -- model checkpoints ------------------------------------------------------------------------------
    def save_model(
        self,
        model: nn.Module,
        path: str | Path,
        shard: bool = True,
        max_shard_size_mb: int = 2048,
        format: str = "hf",
    ) -> Path:
        """HF-loadable safetensors directory (plus config.json for HF models), written atomically.
        `format="dcp"`: the sharded DCP directory of `save_state` instead (every rank writes its
        pieces, nothing is gathered; `load_model` reads it, `export_hf` converts it)."""
        path = Path(path)
        if format == "dcp":
            return save_model_dcp(self.plugin, model, path)
        if format != "hf":
            raise ConfigError(f"save_model format must be 'hf' or 'dcp', got {format!r}")
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
        """Load weights into a boosted model; the fp32 masters of its optimizer follow (the one
        `boost` returned with it when `optimizer` is not passed).

        Reads an HF directory or a sharded model checkpoint (`save_state` of a sharded plugin);
        sharded plugins read only the ranges this rank holds. Every saved shape is compared with
        the model's first: a mismatch is a CheckpointError naming the first such key."""
        root = resolve(path)
        if optimizer is None:
            optimizer = self._optimizer_of.get(model)
        reader: DCPModelReader | ModelReader
        if is_dcp(root):
            reader = model_reader(self.plugin, model, root)
        elif self.plugin.sharded_params or is_sharded_model(root):
            reader = ModelReader(root)
        else:
            read_model_into(self.unwrap(model), root, strict=strict)  # checks shapes before copying
            if optimizer is not None:
                optimizer.load_masters_from_model()
            return
        check_shapes(reader.shapes, model_shapes(self.plugin, model), root)  # before anything is read
        self.plugin.load_model_pieces(model, optimizer, reader)

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
        else:  # the per-rank piece format, which every plugin reads (save_state writes DCP)
            save_optimizer_state(optimizer, directory, _rank())

    def _load_optim(
        self, optimizer: BoostedOptimizer, directory: Path, reader: DCPReader | PieceReader | None = None
    ) -> None:
        """`reader`: one already opened on `directory` (load_state checks it before the model)."""
        custom = getattr(self.plugin, "load_optimizer_state", None)
        if custom is not None:
            custom(optimizer, directory)
        elif isinstance(reader, DCPReader) or (reader is None and is_dcp(directory)):
            load_optimizer_dcp(optimizer, directory, reader)
        else:  # a checkpoint of the earlier per-rank piece format
            load_optimizer_state(optimizer, directory, reader)

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
        async_save: bool = False,
    ) -> Path | AsyncCheckpoint:
        """Everything needed for exact resume: model, optimizer, scheduler, sampler, every rank's RNG, step.

        Model and optimizer are sharded DCP checkpoints that any plugin / world size loads
        (booster/checkpointing.py). `async_save=True` returns an `AsyncCheckpoint` as soon as the
        pieces are copied to CPU; writing and the atomic commit go on in the background, and the
        next save / load or `wait_for_checkpoint()` waits for them."""
        path = Path(path)
        self.wait_for_checkpoint()
        if _rank() == 0:
            staging = fresh_staging(path)
        barrier()
        staging = staging_path(path)
        group = checkpoint_group(self, async_save)
        job = state_job(self.plugin, model, optimizer, staging, group)
        if async_save:
            job = job.snapshot()
        if _rank() == 0:
            _save_config(self.unwrap(model), staging / SHARDED_MODEL)
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
        write_rng(staging / "rng", _rank())
        if async_save:
            self._pending = AsyncCheckpoint(path, job, group, commit)
            return self._pending
        job.write(group)
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
        """Restore what `save_state` wrote; returns state.json (with "step" and "extra").

        Every file is checked first (present, parseable; the optimizer's metadata against the
        optimizer): a damaged or mismatched directory is a CheckpointError naming the file, raised
        on every rank before the model or optimizer change (`megalith.booster.state_files`)."""
        self.wait_for_checkpoint()
        root = resolve(path)
        files = agreed(lambda: self._checked_state_files(root, optimizer))
        meta, trainer = files.meta, files.trainer
        self.load_model(model, files.model_dir)
        self._load_optim(optimizer, files.optim_dir, files.optim_reader)
        if lr_scheduler is not None and trainer["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(trainer["lr_scheduler"])
        if (
            dataloader is not None
            and trainer["dataloader"] is not None
            and hasattr(dataloader, "load_state_dict")
        ):
            dataloader.load_state_dict(trainer["dataloader"])
        if meta["world_size"] != _world():
            logger.warning(
                "checkpoint written at world size %d, now %d: RNG streams restart from rank 0's",
                meta["world_size"],
                _world(),
            )
        restore_rng(files.rng)  # this rank's, or rank 0's at another world size (read_state_files)
        return meta

    def _checked_state_files(self, root: Path, optimizer: BoostedOptimizer) -> StateFiles:
        files = read_state_files(root, _rank(), _world(), STATE_FORMAT)
        if getattr(self.plugin, "load_optimizer_state", None) is None:  # plugins' own loaders check later
            check_optimizer(optimizer, files)
        return files

    _pending: AsyncCheckpoint | None = None  # the last async save_state, until waited for

    def wait_for_checkpoint(self) -> Path | None:
        """Wait until the last `save_state(..., async_save=True)` is committed (every rank calls
        it); its path, or None when none is pending. Raises its CheckpointError if it failed."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None


def _apply_kernels(plugin: Plugin, model: nn.Module, chosen: frozenset[str]) -> None:
    from megalith.policies.kernels import apply_kernels

    tp = getattr(getattr(plugin, "config", None), "tp_size", 1)
    if tp != 1:
        raise ConfigError(f"kernels=True needs tp_size 1 (the fused MLP/LM head are not tp-aware), got {tp}")
    apply_kernels(model, only=chosen)


def _save_config(model: nn.Module, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(directory))


def _shapes(plugin: Plugin, model: nn.Module) -> dict[str, tuple[list[int], str]]:
    """Shape and dtype per state-dict entry as the checkpoint records them: the *full* shapes (a
    plugin that holds blocks of the tensors, e.g. tensor parallelism, says so via `model_shapes`)."""
    full = getattr(plugin, "model_shapes", None)
    if full is not None:
        return dict(full(model))
    return {n: (list(t.shape), str(t.dtype)) for n, t in model.state_dict(keep_vars=True).items()}


def _save_sharded_export(plugin: Plugin, model: nn.Module, path: Path, max_shard_bytes: int) -> None:
    """HF export under a sharded plugin: every rank drives the (collective) export, rank 0 writes."""
    staging = fresh_staging(path) if _rank() == 0 else None
    write_hf_streamed(plugin.export_state(model), staging, max_shard_bytes)
    if staging is not None:
        _save_config(plugin.unwrap(model), staging)
        commit(path)
    barrier()
