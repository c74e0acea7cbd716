"""The model's tensors of a usp DCP checkpoint, one at a time, in a single process (`usp export`).

The checkpoint's metadata (`FileSystemReader.read_metadata()`: every saved key with its whole
shape and dtype) names the model's tensors without reading any; a tensor's values are read by
`dcp.load` of a state dict holding just that one key, into a whole tensor of its shape: DCP reads the
pieces every rank saved (whatever layout saved them) and nothing else. One tensor is in memory at
a time; the optimizer's state is never read. The metadata is read once (`MetadataOnce`), not at
every dcp.load."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from usp.engine.tensor_stream import TensorStream
from usp.models.llama import WRAPPER_PREFIXES

MODEL = "model"  # the model's part of the saved state dict (usp/engine/checkpoint.py), keys "model.<FQN>"


def checkpoint_tensors(ckpt: Path) -> TensorStream:
    """The model's tensors of DCP checkpoint directory `ckpt` by FQN (recompute's and compile's wrapper
    prefixes removed), in the order they were saved; empty when it holds no model state."""
    reader = MetadataOnce(str(ckpt))
    saved = reader.read_metadata().state_dict_metadata
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
            dcp.load({MODEL: {keys[name]: value}}, storage_reader=reader, no_dist=True)
        return value

    return TensorStream(shapes, read)


class MetadataOnce(dcp.FileSystemReader):
    """A FileSystemReader that unpickles the checkpoint's metadata (every saved chunk of model and
    optimizer: 1.7 MB for the 0.5 B model) once: dcp.load reads it again at every call, which took
    3.6 s of a tensor's 5.3 s read on the loaded dev machine (5 reads: 26.6 s, then 5.0 s)."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if args or kwargs:  # a rank's own metadata file: not cached
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


def _unwrapped(key: str) -> str:
    for part in WRAPPER_PREFIXES:
        key = key.replace(part, "")
    return key
