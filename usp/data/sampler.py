"""Deterministic, data-parallel-sharded batches of token windows (numpy only).

The token stream is cut into non-overlapping windows of seq_len + 1 tokens (input + shifted
target). Global sample k is window perm_{k // n}[k % n], a fresh permutation per epoch. Step i
consumes global samples [i*B, (i+1)*B), cut into A = grad_accum contiguous micro-batch steps of
B/A samples; rank r's micro batch j is the r-th slice of D of micro-batch step j. The union over
ranks of a step is therefore independent of the number of ranks D, which is what lets a DDP run
match a single-process run exactly; and so is the union of a micro-batch step, which the MoE
load-balancing statistics (summed over the ranks per micro-batch step) need to match one
process with the same grad_accum."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from usp.data.data_error import DataError
from usp.data.tokens import LEGACY_DTYPE, check_file_size


class TokenFile:
    """A uint16 or uint32 token file, memory-mapped read-only (pages load lazily, shared between
    processes). `dtype` and `n_tokens` come from the dataset's meta.json: a file whose size doesn't
    match them is refused, never read as something else."""

    def __init__(self, path: str | Path, dtype: str = LEGACY_DTYPE, n_tokens: int | None = None,
                 key: str = "token file") -> None:
        self.path = Path(path)
        check_file_size(self.path, dtype, key, n_tokens)
        self.dtype = dtype
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r")

    def __len__(self) -> int:
        return len(self.tokens)

    def window(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start : start + length]


def get_batch(token_file: TokenFile, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets, int64 arrays of shape (len(starts), seq_len)."""
    rows = np.stack([token_file.window(int(s), seq_len + 1) for s in starts]).astype(np.int64)
    # Contiguous copies, not strided views: torch < 2.13's pipeline stages refuse inputs whose
    # strides differ from their (contiguous) shape metadata, and strided host tensors copy to a GPU slower.
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])


def n_windows(n_tokens: int, seq_len: int) -> int:
    # -1: every window needs one more token for its last target.
    return (n_tokens - 1) // seq_len


def _rank_slice(batch: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if batch % dp_size:
        raise ValueError(f"batch of {batch} sequences does not split evenly over dp_size={dp_size} ranks")
    per_rank = batch // dp_size
    return dp_rank * per_rank, per_rank


class BatchSampler:
    def __init__(
        self, n_tokens: int, seq_len: int, global_batch: int, micro_batch: int,
        dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
    ) -> None:
        self.n_windows = n_windows(n_tokens, seq_len)
        if self.n_windows < 1:
            raise ValueError(f"{n_tokens} tokens hold no window of seq_len={seq_len} (+1 target)")
        if seed < 0:
            raise DataError("must be >= 0", key="train.seed", value=seed, fix="train.seed=1234")
        self.offset, self.per_rank = _rank_slice(global_batch, dp_rank, dp_size)
        if micro_batch < 1 or self.per_rank % micro_batch:
            raise ValueError(
                f"global_batch={global_batch} / dp_size={dp_size} = {self.per_rank} sequences per rank is not"
                f" a multiple of micro_batch={micro_batch}"
            )
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.seed = seed
        self.step = 0  # optimizer steps consumed through next()
        self._cached: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    @property
    def grad_accum(self) -> int:
        return self.per_rank // self.micro_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._cached[0] != epoch:  # one epoch at a time: a step touches at most a few
            self._cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return self._cached[1]

    def _windows(self, first: int, count: int) -> np.ndarray:
        """Window indices of global samples first .. first + count - 1."""
        k = np.arange(first, first + count)
        epochs = k // self.n_windows
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._permutation(int(epoch))[k[mask] % self.n_windows]
        return out

    def _starts(self, first: int, count: int) -> np.ndarray:
        """Token offsets of the windows of global samples first .. first + count - 1."""
        return self._windows(first, count) * self.seq_len

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This rank's micro batches for optimizer step `step`, as window start offsets: micro batch j
        is this rank's slice of the step's j-th contiguous chunk of global_batch / grad_accum samples."""
        chunk = self.global_batch // self.grad_accum  # one micro-batch step of every rank
        first = step * self.global_batch + self.offset // self.grad_accum  # offset / A = rank x micro
        return [self._starts(first + j * chunk, self.micro_batch) for j in range(self.grad_accum)]

    def next(self) -> list[np.ndarray]:
        batches = self.micro_batches(self.step)
        self.step += 1
        return batches

    def state_dict(self) -> dict[str, Any]:
        # Global quantities only: a run may resume with a different dp_size and see the same data.
        return {
            "samples_consumed": self.step * self.global_batch,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "n_windows": self.n_windows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("global_batch", "seq_len", "n_windows"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this run has {getattr(self, key)}:"
                    " resuming would not continue the same data order"
                )
        self.seed = state["seed"]  # the checkpoint's order wins
        self.step = state["samples_consumed"] // self.global_batch
        self._cached = (-1, np.empty(0, np.int64))


class EvalBatches:
    """Fixed validation batches: the first n_batches * batch windows in file order, each batch
    sharded over ranks like training batches. Fewer batches if the file is short."""

    def __init__(self, n_tokens: int, seq_len: int, batch: int, n_batches: int,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        self.offset, self.per_rank = _rank_slice(batch, dp_rank, dp_size)
        self.n_batches = min(n_batches, n_windows(n_tokens, seq_len) // batch)
        if self.n_batches < 1:
            raise ValueError(
                f"validation split of {n_tokens} tokens holds less than one batch of {batch}"
                f" windows of seq_len={seq_len}"
            )
        self.seq_len, self.batch = seq_len, batch

    def __len__(self) -> int:
        return self.n_batches

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self.n_batches):
            first = i * self.batch + self.offset
            yield np.arange(first, first + self.per_rank, dtype=np.int64) * self.seq_len
