"""Several sources mixed by weight (Megatron / nanotron style blends), deterministic and resumable.

The sources' tokens lie back to back in one train.bin (meta["blend"]: offset and length of each).
Global samples are dealt in blocks of BLOCK: block b holds round(BLOCK * w_i) samples of source i
(largest remainders, so the counts add up to BLOCK), in an order shuffled by (seed, b). Source i's
j-th sample is window perm_{i,e}[j % n_i] of that source (epoch e = j // n_i, a fresh permutation
per epoch, as BatchSampler). Every sample is a pure function of its global index, so a step sees
the same tokens under any data-parallel layout and after any restart (the state is the number of
samples consumed, as for one source); the token shares match the weights to within 1 / BLOCK."""
from __future__ import annotations

from typing import Any

import numpy as np

from usp.data.sampler import BatchSampler, n_windows

BLOCK = 1 << 12
BLEND_STREAM = 0xB1E  # keeps the block shuffles apart from the window permutations' seeds


def block_counts(weights: list[float], block: int = BLOCK) -> np.ndarray:
    share = np.asarray(weights, dtype=np.float64) / sum(weights) * block
    counts = np.floor(share).astype(np.int64)
    order = np.argsort(-(share - counts), kind="stable")  # largest remainders first
    counts[order[: block - int(counts.sum())]] += 1
    return counts


class BlendedSampler(BatchSampler):
    def __init__(self, parts: list[dict[str, Any]], seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0) -> None:
        total = sum(int(p["n_train_tokens"]) for p in parts)
        super().__init__(total, seq_len, global_batch, micro_batch, dp_rank, dp_size, seed)
        self.parts = parts
        self.source_windows = np.array([n_windows(int(p["n_train_tokens"]), seq_len) for p in parts])
        empty = [p["name"] for p, n in zip(parts, self.source_windows) if n < 1]
        if empty:
            raise ValueError(f"blend sources {empty} hold no window of seq_len={seq_len} (+1 target)")
        self.offsets = np.array([int(p["train_offset"]) for p in parts], dtype=np.int64)
        self.counts = block_counts([float(p["weight"]) for p in parts])
        self._block: tuple[int, np.ndarray, np.ndarray] = (-1, np.empty(0, np.int64), np.empty(0, np.int64))
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _deal(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Source of each sample in the block, and its index among that source's samples."""
        if self._block[0] != block:
            labels = np.repeat(np.arange(len(self.counts)), self.counts)
            labels = np.random.default_rng([self.seed, BLEND_STREAM, block]).permutation(labels)
            rank = np.empty(len(labels), dtype=np.int64)
            for i, count in enumerate(self.counts):
                rank[labels == i] = block * count + np.arange(count)
            self._block = (block, labels, rank)
        return self._block[1], self._block[2]

    def _source_window(self, source: int, j: int) -> int:
        n = int(self.source_windows[source])
        key = (source, j // n)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.counts):  # a step touches at most a few epochs
                self._perms.clear()
            self._perms[key] = np.random.default_rng([self.seed, source, j // n]).permutation(n)
        return int(self._perms[key][j % n])

    def _starts(self, first: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        for n, k in enumerate(range(first, first + count)):
            labels, rank = self._deal(k // BLOCK)
            source = int(labels[k % BLOCK])
            out[n] = self.offsets[source] + self._source_window(source, int(rank[k % BLOCK])) * self.seq_len
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "blend": [[p["name"], float(p["weight"])] for p in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = [[p["name"], float(p["weight"])] for p in self.parts]
        if state.get("blend") != mine:
            raise ValueError(f"sampler state has blend {state.get('blend')} but this run has {mine}:"
                             " resuming would not continue the same data order")
        super().load_state_dict(state)
        self._block = (-1, np.empty(0, np.int64), np.empty(0, np.int64))
        self._perms.clear()


def make_sampler(meta: dict[str, Any], seq_len: int, global_batch: int, micro_batch: int, dp_rank: int,
                 dp_size: int, seed: int) -> BatchSampler:
    """One source (or a dataset prepared before blends): BatchSampler; several: BlendedSampler."""
    parts = meta.get("blend") or []
    if len(parts) > 1:
        return BlendedSampler(parts, seq_len, global_batch, micro_batch, dp_rank, dp_size, seed)
    return BatchSampler(int(meta["n_train_tokens"]), seq_len, global_batch, micro_batch, dp_rank, dp_size, seed)
