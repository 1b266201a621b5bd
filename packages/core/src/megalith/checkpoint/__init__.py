"""Atomic checkpoints: HF safetensors model dirs, resharding optimizer pieces, training state (layer 4)."""

from megalith.checkpoint.atomic import commit, fresh_staging, fsync_dir, fsync_tree, resolve, staging_path
from megalith.checkpoint.model_io import (
    check_shapes,
    read_model_into,
    unique_state,
    unique_tensors,
    weight_files,
    write_model,
)
from megalith.checkpoint.optimizer_io import OptimPiece, PieceReader, write_meta, write_pieces
from megalith.checkpoint.state_io import read_json, read_rng, restore_rng, write_json, write_rng

__all__ = [
    "check_shapes",
    "unique_state",
    "unique_tensors",
    "OptimPiece",
    "PieceReader",
    "commit",
    "fresh_staging",
    "fsync_dir",
    "fsync_tree",
    "read_json",
    "read_model_into",
    "read_rng",
    "resolve",
    "restore_rng",
    "staging_path",
    "weight_files",
    "write_json",
    "write_meta",
    "write_model",
    "write_pieces",
    "write_rng",
]

from megalith.checkpoint.dcp import (
    DCPModelReader,
    DCPReader,
    FlatPiece,
    is_dcp,
    iter_full_tensors,
    save_pieces,
    split_for_rank,
)
from megalith.checkpoint.sharded import (
    ModelReader,
    export_hf,
    is_sharded_model,
    write_hf_streamed,
    write_model_pieces,
)

__all__ += ["ModelReader", "export_hf", "is_sharded_model", "write_hf_streamed", "write_model_pieces"]

__all__ += [
    "DCPModelReader",
    "DCPReader",
    "FlatPiece",
    "is_dcp",
    "iter_full_tensors",
    "save_pieces",
    "split_for_rank",
]
