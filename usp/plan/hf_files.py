"""A `model.init_from` directory's weight files, checked at plan time (no torch): every shard the
index lists is there, and every safetensors file's header reads and covers the file exactly. A
missing shard, a file cut short or a clobbered header is refused before launch, naming the file, where
it used to pass the plan and stop every rank after launch with a Python error.

The header is read here, not with safetensors' `safe_open`: `usp plan` imports neither safetensors
nor numpy (an optional extra; tests/e2e/test_import_boundary.py), and the format is an 8-byte length, a
JSON header and the tensors' bytes, whose offsets must cover the rest of the file exactly, as
safetensors itself checks ("incomplete metadata, file not fully covered"). No tensor is read."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from usp.errors import PlanError

INDEX = "model.safetensors.index.json"  # huggingface_hub's and transformers' names (save_pretrained)
SINGLE = "model.safetensors"
FIX = "save the checkpoint again (save_pretrained(..., safe_serialization=True)) or copy it again"


def check_hf_files(path: str | Path) -> int:
    """Raise a PlanError naming the first weight file of the HF directory `path` that can't be read;
    returns the number of tensors its files hold."""
    root = Path(path).expanduser()
    files = _listed_files(root, str(path))
    tensors = 0
    for name, expected in files.items():
        keys = _header_keys(root / name, str(path))
        missing = sorted(expected - keys)
        if missing:
            raise _refuse(f"{INDEX} places {missing[0]!r} (and {len(missing) - 1} more) in {name}, whose header "
                          "does not hold it", str(path))
        tensors += len(keys)
    return tensors


def _listed_files(root: Path, path: str) -> dict[str, set[str]]:
    """Each weight file -> the tensor names the index places in it (empty for a lone model.safetensors)."""
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _refuse(f"{index} is not a readable index ({type(exc).__name__}: {exc})", path) from None
        files: dict[str, set[str]] = {}
        for tensor, name in dict(weight_map).items():
            files.setdefault(str(name), set()).add(str(tensor))
        absent = sorted(n for n in files if not (root / n).is_file())
        if absent:
            raise _refuse(f"{INDEX} lists {len(absent)} shard(s) that are not in the directory: "
                          f"{', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''}", path)
        return files
    if (root / SINGLE).is_file():
        return {SINGLE: set()}
    raise _refuse(f"no {SINGLE} or {INDEX} in {path}", path)


MAX_HEADER = 100 * 2**20  # safetensors' own limit on the header's size


def _header_keys(file: Path, path: str) -> set[str]:
    """The tensor names of one safetensors file, after checking its header covers the file exactly."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            prefix = f.read(8)
            n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise ValueError(f"its header length {n} does not fit its {size:,} bytes")
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, struct.error) as exc:
        raise _refuse(f"{file.name} can't be read ({exc}): cut short, or its header overwritten", path) from None
    if 8 + n + max(ends, default=0) != size:
        raise _refuse(f"{file.name} holds {size:,} bytes, its header describes {8 + n + max(ends, default=0):,}: "
                      "cut short or grown since it was written", path)
    return set(header) - {"__metadata__"}


def _refuse(why: str, path: str) -> PlanError:
    return PlanError(f"the Hugging Face checkpoint's weights: {why}", key="model.init_from", value=path, fix=FIX)
