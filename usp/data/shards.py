"""Tokenize input files into cached shards, in parallel processes, with a progress bar.

A shard is one input file's tokens (every document framed as [BOS] ids [EOS]) and its documents'
lengths, cached under <cache>/shards/<key>.* where the key covers the file (path, size, mtime),
the tokenizer's files and the framing: a changed file is tokenized again, an unchanged one never,
and an interrupted prepare continues with the files it had not finished. A shard is published
atomically: its .json (written last, by os.replace) marks it complete.

Memory is bounded: a file is read a batch of pieces / records at a time and its tokens are
appended to the shard as they come."""
from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from usp.data.corpus import Unit, unit_pieces

SHARD_VERSION = 1  # bump when the framing or the file layout of a shard changes
# Text per encode_batch call: enough pieces for the tokenizer's threads, little enough that the
# ids (Python ints until written) stay small: bounded memory whatever the file's size.
BATCH_PIECES, BATCH_CHARS = 256, 2 << 20


def shard_key(unit: Unit, tokenizer_sha: str, add_bos: bool) -> str:
    key = {"unit": unit.identity(), "tokenizer": tokenizer_sha, "add_bos": add_bos, "version": SHARD_VERSION}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def shard_paths(shard_dir: Path, key: str) -> tuple[Path, Path, Path]:
    """tokens, document lengths (int64 .npy), meta (.json, written last)."""
    return shard_dir / f"{key}.bin", shard_dir / f"{key}.docs.npy", shard_dir / f"{key}.json"


def load_shard(shard_dir: Path, key: str) -> dict[str, Any] | None:
    meta = shard_paths(shard_dir, key)[2]
    return json.loads(meta.read_text()) if meta.is_file() else None


def tokenize_unit(unit: Unit, tokenizer_dir: str, shard_dir: str, key: str, dtype: str,
                  add_bos: bool) -> dict[str, Any]:
    """Tokenize one file into its shard (run in a worker process); returns the shard's meta."""
    import numpy as np

    tok = _tokenizer(tokenizer_dir)
    tokens_path, docs_path, meta_path = shard_paths(Path(shard_dir), key)
    suffix = f".tmp-{os.getpid()}"
    tmp_tokens, tmp_docs = Path(f"{tokens_path}{suffix}"), Path(f"{docs_path}{suffix}.npy")
    try:
        with open(tmp_tokens, "wb") as out:
            lengths, n_chars, n_bytes = _write_documents(unit, tok, add_bos, out, dtype)
        np.save(tmp_docs, np.asarray(lengths, dtype=np.int64))
        meta = {"path": unit.path, "n_tokens": int(sum(lengths)), "n_documents": len(lengths),
                "n_chars": n_chars, "n_bytes": n_bytes, "dtype": dtype}
        os.replace(tmp_tokens, tokens_path)
        os.replace(tmp_docs, docs_path)
        tmp_meta = Path(f"{meta_path}{suffix}")
        tmp_meta.write_text(json.dumps(meta) + "\n")
        os.replace(tmp_meta, meta_path)  # last: the shard is complete
        return meta
    finally:
        for leftover in (tmp_tokens, tmp_docs):
            leftover.unlink(missing_ok=True)


@functools.lru_cache(maxsize=2)
def _tokenizer(tokenizer_dir: str) -> Any:
    """One tokenizer per process for all its files: BPE keeps a cache of encoded words (warm, it
    encodes the Shakespeare corpus ~1.6x faster than cold)."""
    from usp.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)


def _write_documents(unit: Unit, tok: Any, add_bos: bool, out: Any, dtype: str) -> tuple[list[int], int, int]:
    """Encode the unit's pieces a batch at a time, framing each document as [BOS] ids [EOS], and
    append the ids to `out`; returns the documents' lengths and the characters and bytes read."""
    import numpy as np

    bos = [tok.bos_id] if add_bos and tok.bos_id is not None else []
    end = tok.doc_end()
    lengths: list[int] = []
    batch: list[tuple[int, str]] = []
    state = {"doc": None, "chars": 0, "n_chars": 0, "n_bytes": 0}

    def flush() -> None:
        ids_out: list[int] = []
        for (doc, _), ids in zip(batch, tok.encode_batch([p for _, p in batch])):
            if doc != state["doc"]:  # a new document: close the previous one
                if state["doc"] is not None:
                    ids_out += end
                    lengths[-1] += len(end)
                ids_out += bos
                lengths.append(len(bos))
                state["doc"] = doc
            ids_out += ids
            lengths[-1] += len(ids)
        np.asarray(ids_out, dtype=dtype).tofile(out)
        batch.clear()
        state["chars"] = 0

    for doc, piece in unit_pieces(unit):
        batch.append((doc, piece))
        state["chars"] += len(piece)
        state["n_chars"] += len(piece)
        state["n_bytes"] += len(piece.encode("utf-8"))
        if len(batch) >= BATCH_PIECES or state["chars"] >= BATCH_CHARS:
            flush()
    if batch:
        flush()
    if state["doc"] is not None:
        np.asarray(end, dtype=dtype).tofile(out)
        lengths[-1] += len(end)
    return lengths, int(state["n_chars"] or 0), int(state["n_bytes"] or 0)


def _init_worker() -> None:
    # One process per core already: the tokenizer's own thread pool would oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


def tokenize_units(jobs: list[tuple[Unit, str]], tokenizer_dir: Path, shard_dir: Path, dtype: str, add_bos: bool,
                   workers: int, show_progress: bool, say: Callable[[str], None]) -> None:
    """Tokenize every (unit, key) whose shard is missing: in `workers` processes (one file each at a
    time; in this process when there is one file or one worker), with a rich progress bar."""
    todo = [(unit, key) for unit, key in jobs if load_shard(shard_dir, key) is None]
    if not todo:
        return
    total = sum(os.stat(unit.path).st_size for unit, _ in todo)
    say(f"tokenizing {len(todo)} of {len(jobs)} files ({total / 1e6:.1f} MB) in {min(workers, len(todo))} processes")
    args = (str(tokenizer_dir), str(shard_dir))
    with _progress(show_progress, total) as advance:
        if workers <= 1 or len(todo) == 1:
            for unit, key in todo:
                tokenize_unit(unit, *args, key, dtype, add_bos)
                advance(os.stat(unit.path).st_size)
            return
        # fork, where there is one: spawn re-imports the caller's __main__ (a user's script without a
        # main guard would run again). The workers turn the tokenizer's threads off (_init_worker).
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=context, initializer=_init_worker) as pool:
            pending = {pool.submit(tokenize_unit, unit, *args, key, dtype, add_bos): unit for unit, key in todo}
            try:
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        unit = pending.pop(future)
                        future.result()  # a worker's error (a DataError naming the key) stops the prepare
                        advance(os.stat(unit.path).st_size)
            except BaseException:
                for future in pending:
                    future.cancel()
                raise


class _progress:
    """A rich progress bar over the bytes of the files to tokenize (nothing when not shown)."""

    def __init__(self, show: bool, total: int) -> None:
        self.show, self.total = show, total

    def __enter__(self) -> Callable[[int], None]:
        if not self.show:
            return lambda n: None
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.bar = Progress("tokenizing", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                            transient=True)
        self.bar.start()
        task = self.bar.add_task("tokenizing", total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self.show:
            self.bar.stop()
