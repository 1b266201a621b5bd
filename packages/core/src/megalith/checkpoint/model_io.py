"""Model weights as HF-loadable sharded safetensors (`model-0000k-of-0000n.safetensors` + index json)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from megalith.checkpoint.state_io import read_json
from megalith.common.errors import CheckpointError


def unique_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the later names of tensors it holds more than once (tied parameters)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict(keep_vars=True)` without the later names of tied tensors."""
    return unique_tensors(model.state_dict(keep_vars=True))


WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def dedup_tied(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop later names of tensors sharing storage (tied weights); returns (unique, alias → kept name)."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(int(d) for d in t.shape))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        unique[name] = t
    return unique, aliases


def write_model(
    model: nn.Module, directory: Path, max_shard_bytes: int = 2 * 2**30, shard: bool = True
) -> None:
    """Write `model`'s state dict (and its HF config, when it has one) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    state, _ = dedup_tied(model.state_dict())
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shard and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / WEIGHTS_NAME), metadata=metadata)
    else:
        weight_map: dict[str, str] = {}
        for i, part in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(part, str(directory / fname), metadata=metadata)
            weight_map.update(dict.fromkeys(part, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(directory))
        gen = getattr(model, "generation_config", None)
        if gen is not None and hasattr(gen, "save_pretrained"):
            gen.save_pretrained(str(directory))


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name → file holding it."""
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        return {k: directory / v for k, v in weight_map.items()}
    single = directory / WEIGHTS_NAME
    if not single.exists():
        raise CheckpointError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {directory}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def read_model_into(model: nn.Module, directory: Path, strict: bool = True) -> list[str]:
    """Copy tensors from `directory` into `model` in place; returns the names that were loaded.

    Raises `CheckpointError` naming the first mismatched key (sorted) or a shape mismatch.
    """
    files = weight_files(directory)
    state, aliases = dedup_tied(model.state_dict())
    expected, found = set(state), set(files)
    missing = sorted(expected - found - set(aliases))
    unexpected = sorted(found - expected - set(aliases))
    if strict and (missing or unexpected):
        first = missing[0] if missing else unexpected[0]
        kind = "missing from the checkpoint" if missing else "not in the model"
        raise CheckpointError(
            f"checkpoint {directory} does not match the model: first mismatched key {first!r} is {kind} "
            f"({len(missing)} missing, {len(unexpected)} unexpected)"
        )
    by_file: dict[Path, list[str]] = {}
    for name in sorted(expected & found):
        by_file.setdefault(files[name], []).append(name)
    saved: dict[str, tuple[int, ...]] = {}
    for path, names in by_file.items():  # headers only: nothing is copied before every shape fits
        with safe_open(str(path), framework="pt") as f:
            saved.update({name: tuple(f.get_slice(name).get_shape()) for name in names})
    check_shapes(saved, {n: tuple(t.shape) for n, t in state.items()}, directory)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    _copy_checked(state[name], f.get_tensor(name), name, path)
    return sorted(expected & found)


def check_shapes(
    saved: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], where: Any
) -> None:
    """CheckpointError naming the first entry (sorted by name) whose saved shape differs from
    the model's full shape. A larger checkpoint would otherwise load its prefix, and a same-numel
    reshape ([7, 5] vs [5, 7]) would load scrambled, because reads only need [0, numel) to exist."""
    for name, shape in sorted(expected.items()):
        if name in saved and tuple(saved[name]) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {where} does not match the model: shape mismatch for {name!r}: "
                f"model has {tuple(shape)}, checkpoint has {tuple(saved[name])}"
            )


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str, path: Any) -> None:
    if dst.shape != src.shape:
        raise CheckpointError(
            f"shape mismatch for {name!r}: model has {tuple(dst.shape)}, checkpoint {path} has {tuple(src.shape)}"
        )
    dst.copy_(src.to(dst.dtype))
