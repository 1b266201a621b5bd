"""Dropout randomness under tensor and sequence parallelism: the RNG tracker of Megatron-LM
(Shoeybi et al. 2019, §3: "a separate random number generator ... for dropout within model-parallel
regions").

Every rank of a tp group uses two streams:

    default stream   torch's global generator, made IDENTICAL on the ranks of a tp group when the
                     model is sharded (tp rank 0's state is broadcast; other tp groups, i.e. other dp
                     ranks, keep their own). Dropout on activations every tp rank holds in full —
                     hidden states [b, s, h] under sp_mode="none", NEFTune noise on the embeddings —
                     then draws the same mask everywhere, so the replicas stay equal and the
                     replicated weights (norms) get identical gradients.
    rank stream      seeded with base + 2718 + tp_rank (base: tp rank 0's `torch.initial_seed()`),
                     entered by `TensorParallelRNG.fork()`. Dropout on activations whose layout
                     differs by tp rank draws independent masks: attention probabilities of this
                     rank's heads [b, H/tp, s, s] (Megatron TP and Ulysses), and under sequence
                     parallelism the sequence shards [b, s/tp, h] of the decoder layers and norms.
                     With one shared stream, head r on rank 0 and head r on rank 1 (different heads
                     of the full model) would drop exactly the same positions: correlated dropout.

Which modules run on the rank stream is data in the plan (`rank_rng_patterns`); `attach_rank_rng`
wraps those modules with a forward pre-hook (enter) and an always-called forward hook (exit).
Forks nest (an attention module inside a forked decoder layer stays on the rank stream).

Limits: the rank stream is not part of `booster.save_state` (resume with dropout > 0 under tp is
statistically, not bitwise, identical). Activation recomputation (gradient checkpointing) of a
forked module would replay a later part of the stream, i.e. a different dropout mask than its
forward drew, and silently wrong gradients: a forked module with dropout that runs again inside a
backward (a recomputation) raises `ConfigError` instead (`HybridPlugin` also refuses gradient
checkpointing enabled before `boost` on such a model).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.common.errors import ConfigError
from megalith.tensor_parallel.comm import Group, group_rank, group_size

RANK_SEED_OFFSET = 2718  # Megatron's model-parallel seed offset
_State = tuple[torch.Tensor, torch.Tensor | None]


def _cuda_index(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _get_state(device: torch.device) -> _State:
    index = _cuda_index(device)
    return torch.get_rng_state(), (torch.cuda.get_rng_state(index) if index is not None else None)


def _set_state(device: torch.device, state: _State) -> None:
    torch.set_rng_state(state[0])
    index = _cuda_index(device)
    if index is not None and state[1] is not None:
        torch.cuda.set_rng_state(state[1], index)


class TensorParallelRNG:
    """The rank stream of one rank: `fork()` runs a block on it and leaves the default stream as it
    was (the rank stream continues where the last fork stopped)."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed = int(seed)
        self.device = torch.device(device)
        cuda = None
        if _cuda_index(self.device) is not None:
            cuda = torch.Generator(device=self.device).manual_seed(self.seed).get_state()
        self._state: _State = (torch.Generator().manual_seed(self.seed).get_state(), cuda)
        self._saved: list[_State | None] = []

    def enter(self) -> None:
        """Switch to the rank stream (nested calls keep it)."""
        if self._saved:
            self._saved.append(None)
            return
        self._saved.append(_get_state(self.device))
        _set_state(self.device, self._state)

    def exit(self) -> None:
        """Back to the default stream when the outermost fork ends."""
        saved = self._saved.pop()
        if saved is not None:
            self._state = _get_state(self.device)
            _set_state(self.device, saved)

    @contextmanager
    def fork(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "cpu": self._state[0].clone(), "cuda": self._state[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._state = (state["cpu"].clone(), state["cuda"])


def seed_tensor_parallel_rng(group: Group, device: torch.device | str = "cpu") -> TensorParallelRNG:
    """Collective over `group`: copy tp rank 0's default-stream state to every rank of the group
    and return this rank's rank stream (seed = tp rank 0's initial seed + 2718 + tp rank)."""
    device = torch.device(device)
    size = group_size(group)
    payload: list[Any] = [torch.initial_seed(), _get_state(device)]
    if size > 1 and dist.is_initialized():
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(payload, src=src, group=group)
        _set_state(device, payload[1])
    return TensorParallelRNG(int(payload[0]) + RANK_SEED_OFFSET + group_rank(group), device)


def dropout_rate(module: nn.Module) -> float:
    """The largest dropout probability in `module`: `nn.Dropout` modules and float attributes
    named like ``*dropout*`` (HF attention keeps ``attention_dropout`` as a float)."""
    rates = [m.p for m in module.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    rates += [
        v for m in module.modules() for k, v in vars(m).items() if "dropout" in k and isinstance(v, float)
    ]
    return max(rates, default=0.0)


def recompute_error(name: str) -> str:
    return (
        f"module {name!r} uses dropout on the tensor-parallel rank stream and is recomputed (gradient "
        "checkpointing): the recomputation would draw a different mask than its forward. Set dropout to "
        "0 or turn activation recomputation off under tp > 1"
    )


def attach_rank_rng(model: nn.Module, patterns: tuple[str, ...], rng: TensorParallelRNG) -> list[str]:
    """Run the forward of every module whose name matches one of `patterns` on the rank stream;
    returns the module names. A module with dropout that runs inside a backward (a recomputation)
    raises `ConfigError` (see the module doc)."""
    names = [n for n, _ in model.named_modules() if n and any(fnmatchcase(n, p) for p in patterns if p)]
    for name in names:
        module = model.get_submodule(name)
        drops = dropout_rate(module) > 0

        def enter(mod: nn.Module, _args: Any, name: str = name, drops: bool = drops) -> None:
            rng.enter()  # first, so that the always-called exit below stays paired
            if drops and mod.training and torch._C._current_graph_task_id() != -1:
                raise ConfigError(recompute_error(name))

        module.register_forward_pre_hook(enter, prepend=True)
        module.register_forward_hook(lambda *_: rng.exit(), always_call=True)
    return names
