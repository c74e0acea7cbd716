"""Token id storage: the dtype of a token file (uint16 when the vocabulary fits, else uint32),
recorded in the dataset's meta.json, and the checks that keep a file from being read with the
wrong one. Pure Python (numpy is imported only where files are read)."""
from __future__ import annotations

from pathlib import Path

from usp.data.data_error import DataError

LEGACY_DTYPE = "uint16"  # datasets prepared before meta.json recorded a dtype
ITEMSIZE = {"uint16": 2, "uint32": 4}
UINT16_VOCAB = 1 << 16  # ids 0 .. 65535


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest dtype that holds every id of a vocabulary of this size."""
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


def meta_dtype(meta: dict) -> str:
    dtype = str(meta.get("dtype", LEGACY_DTYPE))
    if dtype not in ITEMSIZE:
        raise DataError(f"meta.json dtype={dtype!r} is not a token dtype; expected one of {', '.join(ITEMSIZE)}")
    return dtype


def check_file_size(path: str | Path, dtype: str, key: str = "data.train_bin", n_tokens: int | None = None) -> int:
    """The number of tokens in a token file of this dtype; refuses a size that isn't a whole
    number of tokens, or that differs from what meta.json recorded (a file read with the wrong
    dtype: a uint32 file read as uint16 shows twice its tokens)."""
    size = Path(path).stat().st_size
    itemsize = ITEMSIZE[dtype]
    if size == 0 or size % itemsize:
        raise DataError(f"{key}={str(path)!r}: {size} bytes is not a whole, non-empty number of {dtype} tokens"
                        f" ({itemsize} bytes each): is it a token file of another dtype?")
    count = size // itemsize
    if n_tokens is not None and count != n_tokens:
        raise DataError(f"{key}={str(path)!r}: {count:,} {dtype} tokens, but meta.json records {n_tokens:,}:"
                        " the file was changed or is read with the wrong dtype; prepare the data again")
    return count


def looks_like_uint32(path: str | Path, sample: int = 1 << 16) -> bool:
    """True when a file opened as uint16 has a zero in every odd slot of its first `sample` ids
    while the even slots are not all zero: little-endian uint32 ids below 65,536."""
    import numpy as np

    head = np.fromfile(path, dtype=np.uint16, count=sample)
    head = head[: len(head) // 2 * 2]
    return len(head) >= 64 and not head[1::2].any() and bool(head[0::2].any())
