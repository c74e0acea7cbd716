"""A checkpoint's checksums: every file of a checkpoint directory gets an xxh3-128 digest in its
manifest.json, taken from the file as it is on disk once the save is complete, and checked again
before a run resumes from it. A damaged file (same size, other bytes) is found before any tensor
is read, instead of training on from it. No torch: the engine, `usp status` and
`usp checkpoints verify` all use it.

Who hashes what: the rank that wrote a file (DCP names a rank's shards `__<rank>_<n>.distcp`, and
each rank writes `rng_rank<rank>.pt`), rank 0 the rest; at load, a rank of a run with fewer ranks
takes the files of rank mod its world size. So every file is read by one rank, in parallel.

xxh3-128 (the `xxhash` package) over hashlib's: measured on this project's 2-core VM, 28.6 GB/s on
a 256 MiB buffer against blake2b 1.29, sha256 1.92, crc32 (zlib) 6.2; at that speed the cost is
reading the file (docs/checkpoints.md)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from usp.run.files import MANIFEST

ALGORITHM = "xxh3_128"
CHUNK = 8 << 20  # bytes read at a time: large enough that the hash, not the loop, sets the speed
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng_rank(\d+)\.pt)$")


def file_digest(path: Path) -> str:
    import xxhash  # only where a checkpoint is hashed: `usp status` and `usp plan` never need it

    digest = xxhash.xxh3_128()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def owner(name: str, world_size: int) -> int:
    """The rank that hashes (at save) or checks (at load) the file `name` of a checkpoint."""
    match = _RANK_FILE.match(name)
    rank = int(match.group(1) or match.group(2)) if match else 0
    return rank % max(1, world_size)


def digests(directory: Path, names) -> dict[str, str]:
    """{name: digest} of the files `names` in `directory`."""
    return {name: file_digest(Path(directory) / name) for name in sorted(names)}


def mismatches(directory: Path, expected: dict[str, str], names) -> list[str]:
    """What is wrong with the files `names` of `directory` against `expected` ({name: digest}),
    one line each; [] when every one matches."""
    problems = []
    for name in sorted(names):
        path = Path(directory) / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif file_digest(path) != expected[name]:
            problems.append(f"{name} does not match its checksum (other bytes than were saved)")
    return problems


def manifest(step: int, sizes: dict[str, int], sums: dict[str, str]) -> dict:
    """manifest.json's content: the step, every file's size (what usp.run.files.check_manifest reads,
    as earlier usp versions wrote it) and every file's checksum."""
    return {"step": step, "files": sizes, "checksum_algorithm": ALGORITHM, "checksums": sums}


def recorded(checkpoint: Path) -> dict[str, str] | None:
    """The checkpoint's recorded checksums, or None for a checkpoint saved without them (an
    earlier usp) or whose manifest doesn't name the algorithm this module checks."""
    try:
        data = json.loads((Path(checkpoint) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    sums = data.get("checksums") if isinstance(data, dict) else None
    if not isinstance(sums, dict) or data.get("checksum_algorithm") != ALGORITHM:
        return None
    return {str(k): str(v) for k, v in sums.items()}


def verify_checkpoint(checkpoint: Path, progress=None) -> tuple[str, list[str]]:
    """Check every file of one complete checkpoint in this process: ("verified", []),
    ("unverified", []) for one saved without checksums, or ("damaged", [what is wrong]).
    `progress(name, nbytes)` is called after each file (a progress bar's hook)."""
    expected = recorded(checkpoint)
    if expected is None:
        return "unverified", []
    problems = []
    for name in sorted(expected):
        problems += mismatches(checkpoint, expected, [name])
        if progress is not None:
            path = Path(checkpoint) / name
            progress(name, path.stat().st_size if path.is_file() else 0)
    return ("damaged", problems) if problems else ("verified", [])


def retired(found, keep_last: int) -> list[Path]:
    """The checkpoints retention deletes, of `found` (usp.run.files.list_checkpoints, oldest first):
    complete ones beyond the keep_last newest, but never the newest one with checksums (verified
    when it was written), so checkpoints an earlier usp saved without them never push it out.
    keep_last <= 0 keeps everything."""
    complete = [c for c in found if c.complete]
    if keep_last <= 0 or len(complete) <= keep_last:
        return []
    verified = [c.path for c in complete if recorded(c.path) is not None]
    keep = {c.path for c in complete[-keep_last:]} | set(verified[-1:])
    return [c.path for c in complete if c.path not in keep]
