"""Sharded checkpoints that reshard on load (any world size or plan), saved atomically."""

from recshard.checkpoint.io import latest_checkpoint, load, read_checkpoint, save
from recshard.distributed.sharded_state import load_model_state_dict, model_state_dict

__all__ = [
    "latest_checkpoint",
    "load",
    "load_model_state_dict",
    "model_state_dict",
    "read_checkpoint",
    "save",
]
