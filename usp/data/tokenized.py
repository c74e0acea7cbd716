"""Turn a data config into a ready dataset directory: train.bin / val.bin (uint16 or uint32
token ids, as meta["dtype"] says), the tokenizer's files and meta.json, cached under a
fingerprint of everything that shapes the tokens.

Steps: resolve the tokenizer (a pretrained file; the trained BPE, cached under
<cache>/tokenizers and trained once per corpus; bytes) -> tokenize every input file into a cached
shard (usp/data/shards.py: parallel, resumable, only changed files) -> per source (one, or the
components of a blend), split validation off by whole documents at the tail and copy the shards
into train.bin / val.bin a chunk at a time (bounded memory).

Publishing is atomic (build in a temp dir, then os.replace), so a reader never sees a half-written
dataset: a directory is ready exactly when its meta.json exists; the temp dir is removed on any
failure (`usp prepare-data --clean` removes what a killed process left)."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from usp.data.corpus import Unit, source_units
from usp.data.data_error import DataError
from usp.data.tokenizer import PRETRAINED, TOKENIZER_CONFIG, check_tokenizer_config, tokenizer_path
from usp.data.tokens import ITEMSIZE, UINT16_VOCAB, check_file_size, dtype_for_vocab, looks_like_uint32, meta_dtype

FORMAT_VERSION = 3  # bump when the corpus cleaning, encoding or file layout changes
META_FILE = "meta.json"
TRAIN_BIN, VAL_BIN = "train.bin", "val.bin"
MIN_SPLIT_TOKENS = 2 * 4096  # a handful of windows even at long sequence lengths
COPY_BYTES = 4 << 20  # shards are copied into train.bin / val.bin this much at a time

Progress = Callable[[str], None] | None


@dataclass
class Component:
    """One source of a dataset (a blend has several): its input files and its sampling weight."""

    name: str
    weight: float
    units: list[Unit]


def cache_base(data_cfg: Any) -> Path:
    root = getattr(data_cfg, "cache_dir", None) or os.environ.get("USP_CACHE_DIR") or "~/.cache/usp"
    return Path(root).expanduser().resolve()


def cache_root(data_cfg: Any) -> Path:
    return cache_base(data_cfg) / "datasets"


def components(data_cfg: Any) -> list[Component]:
    source = getattr(data_cfg, "source", "shakespeare")
    if source != "blend":
        return [Component(str(source), 1.0, source_units(data_cfg))]
    blend = list(getattr(data_cfg, "blend", None) or [])
    if not blend:
        raise DataError("data.source=blend needs data.blend: a list of {paths, weight, text_field} entries")
    out = []
    for i, entry in enumerate(blend):
        get = entry.get if isinstance(entry, dict) else lambda k, d=None, e=entry: getattr(e, k, d)
        weight = float(get("weight", 1.0))
        if not weight > 0:
            raise DataError(f"data.blend[{i}].weight={weight} must be > 0")
        units = source_units(data_cfg, list(get("paths", None) or []), get("text_field", None),
                             key=f"data.blend[{i}].paths")
        out.append(Component(str(get("name", None) or f"source{i}"), weight, units))
    return out


def _bpe_key(data_cfg: Any, comps: list[Component]) -> str:
    """What the trained BPE depends on: the corpus's files by name (not their mtimes: touching or
    editing one file re-tokenizes that file, it does not retrain the tokenizer), the vocabulary,
    the `tokenizers` release (a new one may learn different merges)."""
    import importlib.metadata

    key = {"files": [(u.path, u.text_field) for c in comps for u in c.units],
           "vocab_size": int(getattr(data_cfg, "vocab_size", 4096)),
           "tokenizers": importlib.metadata.version("tokenizers"), "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def _tokenizer_identity(data_cfg: Any, comps: list[Component]) -> dict[str, Any]:
    kind = getattr(data_cfg, "tokenizer", "bpe")
    add_bos = bool(getattr(data_cfg, "add_bos", False))
    if kind in PRETRAINED:  # the file's bytes and how documents are framed
        path = tokenizer_path(data_cfg)
        config = path.parent / TOKENIZER_CONFIG
        parts = [path.read_bytes(), config.read_bytes() if kind == "hf" and config.is_file() else b""]
        return {"kind": kind, "sha256": hashlib.sha256(b"\0".join(parts)).hexdigest(), "add_bos": add_bos,
                "bos": getattr(data_cfg, "bos_token", None), "eos": getattr(data_cfg, "eos_token", None)}
    check_tokenizer_config(kind, int(getattr(data_cfg, "vocab_size", 4096)))
    if kind == "bytes":  # bytes ignores vocab_size
        return {"kind": kind}
    return {"kind": kind, "bpe": _bpe_key(data_cfg, comps)}


def fingerprint(data_cfg: Any) -> str:
    comps = components(data_cfg)
    key = {
        "source": getattr(data_cfg, "source", "shakespeare"),
        "components": [(c.name, c.weight, [u.identity() for u in c.units]) for c in comps],
        "tokenizer": _tokenizer_identity(data_cfg, comps),
        "val_fraction": float(getattr(data_cfg, "val_fraction", 0.05)),
        "format_version": FORMAT_VERSION,
    }
    text_check = str(getattr(data_cfg, "text_check", "strict") or "strict")
    if text_check != "strict":  # skip may leave files out, off may read garbage: not strict's dataset
        key["text_check"] = text_check
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def dataset_name(data_cfg: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(getattr(data_cfg, "name", None) or "data"))


def dataset_dir(data_cfg: Any, fp: str | None = None) -> Path:
    if getattr(data_cfg, "source", None) == "token_files":  # the user's files: nothing is cached
        train_bin = getattr(data_cfg, "train_bin", None)
        return Path(train_bin).expanduser().resolve().parent if train_bin else cache_root(data_cfg)
    return cache_root(data_cfg) / f"{dataset_name(data_cfg)}-{fp or fingerprint(data_cfg)}"


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


def plan_data_meta(plan) -> dict[str, Any]:
    """The dataset meta a plan's ranks train on: the one `usp train` wrote into plan.yaml, or, for a
    plan saved by `usp plan --save` and started by hand, the prepared dataset's (`usp prepare-data`)."""
    return plan.data_meta or prepared_meta(plan.config.data, plan.dataset_dir)


def ensure_dataset(data_cfg: Any, progress: Progress = None, show_progress: bool = False,
                   warn: Progress = None) -> tuple[Path, dict[str, Any]]:
    """The ready dataset directory and its meta, preparing it on a cache miss. `warn`: what the
    user should read (files that aren't text: usp/data/text_check.py); default: stderr.

    Token files live wherever the user put them: meta["train_bin"] / meta["val_bin"] are paths
    relative to the returned directory (absolute for token_files), so `directory / meta[...]` works."""
    if getattr(data_cfg, "source", None) == "token_files":
        return token_files_meta(data_cfg)
    target = dataset_dir(data_cfg)
    meta = load_meta(target)
    if meta is None:
        meta = prepare_dataset(data_cfg, progress, show_progress, warn)
    check_dataset_files(target, meta)
    return target, meta


def check_dataset_files(directory: Path, meta: dict[str, Any]) -> None:
    """The token files hold exactly the tokens meta.json records, in its dtype (a stat, no read)."""
    dtype = meta_dtype(meta)
    for key, count in (("train_bin", "n_train_tokens"), ("val_bin", "n_val_tokens")):
        check_file_size(directory / meta[key], dtype, f"{directory / meta[key]} ({key})", meta.get(count))


def prepare_dataset(data_cfg: Any, progress: Progress = None, show_progress: bool = False,
                    warn: Progress = None) -> dict[str, Any]:
    """Build the dataset in a temp dir next to the target, then publish it atomically."""
    say = progress or (lambda message: None)
    warn = warn or _warn_on_stderr
    fp = fingerprint(data_cfg)
    target = dataset_dir(data_cfg, fp)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        meta = {**_build(data_cfg, tmp, say, show_progress, warn), "fingerprint": fp}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")  # last: marks it ready
        return _publish(tmp, target, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _workers(data_cfg: Any) -> int:
    """data.workers, or one per core this process may run on."""
    workers = int(getattr(data_cfg, "workers", 0) or 0)
    if workers > 0:
        return workers
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _warn_on_stderr(message: str) -> None:
    print(f"usp: warning: {message}", file=sys.stderr, flush=True)


def _text_components(data_cfg: Any, warn: Callable[[str], None]) -> list[Component]:
    """The components, each with its files checked to be text (usp/data/text_check.py)."""
    from usp.data.text_check import check_units

    comps = components(data_cfg)
    blend = getattr(data_cfg, "source", None) == "blend"
    return [replace(c, units=check_units(data_cfg, c.units, f"data.blend[{i}].paths" if blend else "data.paths", warn))
            for i, c in enumerate(comps)]


def _build(data_cfg: Any, out: Path, say: Callable[[str], None], show_progress: bool,
           warn: Callable[[str], None]) -> dict[str, Any]:
    from usp.data.shards import shard_key, tokenize_units
    from usp.data.tokenizer_cache import resolve_tokenizer

    start = time.perf_counter()
    val_fraction = float(getattr(data_cfg, "val_fraction", 0.05))
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be between 0 and 1 (e.g. 0.05)")
    comps = _text_components(data_cfg, warn)  # before the BPE is trained on them or anything is tokenized
    identity = _tokenizer_identity(data_cfg, comps)
    tokenizer = resolve_tokenizer(data_cfg, comps, identity, cache_base(data_cfg), say)
    tokenizer.save(out)  # the dataset keeps its tokenizer; the workers load it from here
    tokenizer_seconds = time.perf_counter() - start
    tokenizer_sha = _files_sha(out)
    add_bos = bool(getattr(data_cfg, "add_bos", False)) and tokenizer.bos_id is not None
    dtype = dtype_for_vocab(tokenizer.vocab_size)

    shard_dir = cache_base(data_cfg) / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    keys = [[shard_key(u, tokenizer_sha, add_bos) for u in c.units] for c in comps]
    jobs = [(u, k) for c, ks in zip(comps, keys) for u, k in zip(c.units, ks)]
    tokenize_units(jobs, out, shard_dir, dtype, add_bos, _workers(data_cfg), show_progress, say)

    parts = _assemble(comps, keys, shard_dir, out, dtype, val_fraction)
    n_train, n_val = sum(p["n_train_tokens"] for p in parts), sum(p["n_val_tokens"] for p in parts)
    if min(n_train, n_val) < MIN_SPLIT_TOKENS:
        raise DataError(
            f"data.val_fraction={val_fraction} splits {n_train + n_val} tokens into {n_train} train"
            f" / {n_val} val; each split needs at least {MIN_SPLIT_TOKENS}: adjust data.val_fraction or"
            " use a larger corpus"
        )
    say(f"wrote {n_train:,} train / {n_val:,} val tokens")
    shards = [_shard_meta(shard_dir, k) for k in (k for ks in keys for k in ks)]
    return {
        "source": getattr(data_cfg, "source", "shakespeare"),
        "tokenizer": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "n_train_tokens": n_train,
        "n_val_tokens": n_val,
        "n_chars": sum(s["n_chars"] for s in shards),
        "n_bytes": sum(s["n_bytes"] for s in shards),
        "n_documents": sum(s["n_documents"] for s in shards),
        "n_files": len(shards),
        "dtype": dtype,
        **tokenizer.special_tokens(),
        "add_bos": add_bos,
        "train_bin": TRAIN_BIN,
        "val_bin": VAL_BIN,
        "blend": parts,
        "shards": [k for ks in keys for k in ks],
        "bpe_tokenizer": identity.get("bpe"),
        "format_version": FORMAT_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "tokenizer_seconds": round(tokenizer_seconds, 3),
        "prepare_seconds": round(time.perf_counter() - start, 3),
    }


def _files_sha(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _shard_meta(shard_dir: Path, key: str) -> dict[str, Any]:
    from usp.data.shards import load_shard

    meta = load_shard(shard_dir, key)
    if meta is None:  # removed by a concurrent `--clean`
        raise DataError(f"shard {key} vanished from {shard_dir} while preparing: run usp prepare-data again")
    return meta


def val_split(lengths: Any, val_fraction: float) -> tuple[int, str]:
    """Where validation starts (a token offset) in a source of documents of these lengths: at a
    document boundary, the fewest whole tail documents holding val_fraction of the tokens; inside
    the last document only when whole documents can't (one document, or a tail one over twice the
    share)."""
    import numpy as np

    total = int(lengths.sum())
    want = max(1, int(total * val_fraction))
    tail = np.cumsum(lengths[::-1])
    k = int(np.searchsorted(tail, want)) + 1  # tail documents needed
    if k < len(lengths) and int(tail[k - 1]) <= 2 * want:
        return total - int(tail[k - 1]), "documents"
    return total - want, "tokens"


def _assemble(comps: list[Component], keys: list[list[str]], shard_dir: Path, out: Path, dtype: str,
              val_fraction: float) -> list[dict[str, Any]]:
    """Copy each source's shards into train.bin / val.bin (its val part at its tail documents)."""
    import numpy as np

    from usp.data.shards import shard_paths

    parts: list[dict[str, Any]] = []
    with open(out / TRAIN_BIN, "wb") as train, open(out / VAL_BIN, "wb") as val:
        for comp, ks in zip(comps, keys):
            lengths = np.concatenate([np.load(shard_paths(shard_dir, k)[1]) for k in ks] or [np.zeros(0, np.int64)])
            if not lengths.sum():
                raise DataError(f"data.paths: the files of {comp.name} hold no text")
            boundary, how = val_split(lengths, val_fraction)
            part = {"name": comp.name, "weight": comp.weight, "train_offset": train.tell() // ITEMSIZE[dtype],
                    "val_offset": val.tell() // ITEMSIZE[dtype], "n_train_tokens": boundary,
                    "n_val_tokens": int(lengths.sum()) - boundary, "n_documents": len(lengths), "val_split": how}
            cut = boundary * ITEMSIZE[dtype]  # in bytes: the shards already hold this dtype
            position = 0
            for k in ks:
                with open(shard_paths(shard_dir, k)[0], "rb") as shard:
                    while chunk := shard.read(COPY_BYTES):  # plain reads: no file pages held in RSS
                        split = min(max(cut - position, 0), len(chunk))
                        train.write(chunk[:split])
                        val.write(chunk[split:])
                        position += len(chunk)
            parts.append(part)
    return parts


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
    """Pre-tokenized uint16/uint32 files: nothing to prepare, only checks. No tokenizer, so no decoding."""
    vocab_size = int(getattr(data_cfg, "vocab_size", 4096))
    if vocab_size < 1:
        raise DataError(f"data.vocab_size={vocab_size} must be at least 1: set it to your tokenizer's vocabulary")
    dtype = token_files_dtype(data_cfg, vocab_size)
    paths, counts = {}, {}
    for key in ("train_bin", "val_bin"):
        value = getattr(data_cfg, key, None)
        if not value:
            raise DataError(f"data.{key} is not set: data.source=token_files needs data.{key}=/path/to/file.bin")
        path = Path(value).expanduser().resolve()
        if not path.is_file():
            raise DataError(f"data.{key}={value!r}: no such file ({path}); point it at a {dtype} token file")
        counts[key] = check_file_size(path, dtype, f"data.{key}")
        if dtype == "uint16" and looks_like_uint32(path):
            raise DataError(f"data.{key}={value!r} reads as uint16 ids with a zero in every other slot: it holds"
                            " uint32 ids; set data.token_dtype=uint32")
        paths[key] = path
    for key, path in paths.items():
        check_token_ids(path, key, vocab_size, dtype)
    meta = {
        "source": "token_files",
        "tokenizer": "none",
        "vocab_size": vocab_size,
        "n_train_tokens": counts["train_bin"],
        "n_val_tokens": counts["val_bin"],
        "dtype": dtype,
        "train_bin": str(paths["train_bin"]),
        "val_bin": str(paths["val_bin"]),
        "format_version": FORMAT_VERSION,
    }
    return paths["train_bin"].parent, meta


def token_files_dtype(data_cfg: Any, vocab_size: int) -> str:
    """data.token_dtype, or (auto) the smallest dtype that holds the vocabulary."""
    dtype = str(getattr(data_cfg, "token_dtype", "auto"))
    if dtype == "auto":
        return dtype_for_vocab(vocab_size)
    if dtype not in ITEMSIZE:
        raise DataError(f"data.token_dtype={dtype!r} is unknown; choose auto, {', '.join(ITEMSIZE)}")
    if dtype == "uint16" and vocab_size > UINT16_VOCAB:
        raise DataError(f"data.token_dtype=uint16 can't hold the ids of data.vocab_size={vocab_size}:"
                        " use data.token_dtype=uint32 (or auto)")
    return dtype


CHECK_CHUNK = 1 << 24  # tokens per read: 32-64 MiB


def check_token_ids(path: Path, key: str, vocab_size: int, dtype: str) -> None:
    """Every id must index the embedding: the largest, read through a memmap a chunk at a time."""
    import numpy as np

    tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    top = max(int(tokens[i:i + CHECK_CHUNK].max()) for i in range(0, len(tokens), CHECK_CHUNK))
    if top >= vocab_size:
        raise DataError(f"data.{key}={str(path)!r} holds token id {top}, but data.vocab_size={vocab_size} "
                        f"(ids must be < vocab_size): set data.vocab_size={top + 1} or more (your tokenizer's "
                        "vocabulary), or point it at the right file")
