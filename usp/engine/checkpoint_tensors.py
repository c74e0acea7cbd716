"""The model's tensors of a usp DCP checkpoint, one at a time, in a single process (`usp export`).

The checkpoint's metadata (`FileSystemReader.read_metadata()`: every saved key with its whole
shape and dtype) names the model's tensors without reading any; a tensor's values are read by
`dcp.load` of a state dict holding just that one key, into a whole tensor of its shape: DCP reads the
pieces every rank saved (whatever layout saved them) and nothing else. One tensor is in memory at
a time; the optimizer's state is never read."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from usp.engine.tensor_stream import TensorStream
from usp.models.llama import WRAPPER_PREFIXES

MODEL = "model"  # the model's part of the saved state dict (usp/engine/checkpoint.py), keys "model.<FQN>"


def checkpoint_tensors(ckpt: Path) -> TensorStream:
    """The model's tensors of DCP checkpoint directory `ckpt` by FQN (recompute's and compile's wrapper
    prefixes removed), in the order they were saved; empty when it holds no model state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    shapes, keys = {}, {}
    for key, md in saved.items():
        if key.startswith(MODEL + ".") and isinstance(md, TensorStorageMetadata):
            name = _unwrapped(key[len(MODEL) + 1:])
            shapes[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")
            keys[name] = key[len(MODEL) + 1:]

    def read(name: str) -> torch.Tensor:
        value = torch.empty(tuple(shapes[name].shape), dtype=shapes[name].dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notes on loading without a process group: intended
            dcp.load({MODEL: {keys[name]: value}}, checkpoint_id=str(ckpt), no_dist=True)
        return value

    return TensorStream(shapes, read)


def _unwrapped(key: str) -> str:
    for part in WRAPPER_PREFIXES:
        key = key.replace(part, "")
    return key
