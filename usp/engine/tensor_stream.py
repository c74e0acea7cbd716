"""A model's tensors one at a time, and writing them as files of bounded size (`usp export`).

A TensorStream knows every tensor's name, shape and dtype up front (meta tensors: nothing
allocated) and reads one tensor's values when asked. `write_shards` writes a stream into files of at
most `max_shard_mb` each: huggingface_hub's `split_torch_state_dict_into_shards` groups the names
(in order; a tensor bigger than the limit gets a file of its own) and names the files
(`model.safetensors`, or `model-00001-of-00003.safetensors` + `model.safetensors.index.json`, the
layout transformers reads); each file's tensors are read, saved, and released before the next
file's are read. The memory it needs is one file's tensors plus what a read holds while it
converts, never the model."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TensorStream:
    shapes: dict[str, torch.Tensor]  # name -> a meta tensor of its shape and dtype, in the order to write
    read: Callable[[str], torch.Tensor]  # name -> its values (a new tensor: the caller may keep it)

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> TensorStream:
        """A stream over tensors already in memory."""
        return cls({k: meta_like(v) for k, v in state.items()}, state.__getitem__)

    def numel(self) -> int:
        return sum(t.numel() for t in self.shapes.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shapes.values())


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `t`'s shape and dtype with a storage of its own (a view's size is its own, not
    its base's: huggingface_hub sizes a tensor by its storage)."""
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


def write_shards(stream: TensorStream, directory: Path, pattern: str, max_shard_mb: float,
                 save: Callable[[dict[str, torch.Tensor], Path], None], *, always_index: bool = False,
                 aliases: dict[str, str] | None = None) -> list[str]:
    """Write `stream` into `directory` as files named by `pattern` ("model{suffix}.safetensors"), each
    of at most max_shard_mb MiB (a bigger tensor alone), with `save(tensors, path)`; an index
    (`<pattern without suffix>.index.json`: metadata.total_size and weight_map, name -> file) when
    there are several files, or always. `aliases` (name -> the name it shares its tensor with, e.g.
    torch's tied head) are saved in their target's file, as the same tensor. Returns the files."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(stream.shapes, filename_pattern=pattern,
                                               max_shard_size=max(1, int(max_shard_mb * 2 ** 20)))
    weight_map: dict[str, str] = {}
    for file, names in split.filename_to_tensors.items():
        shard = {name: stream.read(name) for name in names}
        shard.update({alias: shard[target] for alias, target in (aliases or {}).items() if target in shard})
        save(shard, directory / file)
        weight_map.update(dict.fromkeys(shard, file))
        del shard  # before the next file's tensors are read: one file in memory at a time
    if split.is_sharded or always_index:
        index = {"metadata": split.metadata, "weight_map": weight_map}
        (directory / f"{pattern.format(suffix='')}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return list(split.filename_to_tensors)
