"""torch's flight recorder of a rank's collectives, dumped when the rank hangs (docs/hangs.md).

torch records every collective of a process group (its name, sequence number, group, sizes, and
whether it completed) in a ring buffer of TORCH_FR_BUFFER_SIZE entries: for gloo since torch 2.8 and
for NCCL (TORCH_NCCL_TRACE_BUFFER_SIZE before). usp's launchers set it (usp/launch/local.py
rank_env). The dump is torch's own JSON, the format torch's flight recorder analyser reads
(`python -m torch.distributed.flight_recorder.fr_trace <dir>` over every rank's file), so a hang
shows which collective each live rank waits in, and that every live rank waits in the same one."""
from __future__ import annotations

import json
from pathlib import Path

from usp.run.files import write_text_atomic


def dump_flight_recorder(path: Path, backend: str) -> str | None:
    """Write this process's flight recorder to `path`; the collective it waits in, in words
    (pending_collective). None when torch records none here (the buffer is off, or this torch has no
    dump for the backend)."""
    raw = _dump(backend)
    if raw is None:
        return None
    try:
        trace = json.loads(raw)
    except ValueError:
        return None
    entries = trace.get("entries") or []
    if not entries:
        return None
    write_text_atomic(path, json.dumps(trace, indent=1) + "\n")
    return pending_collective(trace)


def _dump(backend: str) -> bytes | str | None:
    """torch's JSON dump: NCCL's own where this is NCCL and torch has it, else the generic one."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    names = ("_dump_nccl_trace_json", "_dump_fr_trace_json") if "nccl" in backend else ("_dump_fr_trace_json",)
    for name in names:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            return dump(includeCollectives=True, onlyActive=False)
        except (RuntimeError, TypeError):
            continue
    return None


def pending_collective(trace: dict) -> str | None:
    """The oldest collective of the dump that has not completed, in words ("gloo:all_reduce #58 of process
    group 0 (default_pg), sizes [[1]]"); None if all completed."""
    pending = [e for e in trace.get("entries") or [] if not e.get("retired", True)]
    if not pending:
        return None
    e = min(pending, key=lambda e: e.get("time_created_ns", 0))
    group_id, desc = (list(e.get("process_group") or []) + ["?", "?"])[:2]
    named = f" ({desc})" if desc and desc != "undefined" else ""
    return (f"{e.get('profiling_name', '?')} #{e.get('collective_seq_id', '?')} of process group {group_id}{named}, "
            f"sizes {e.get('input_sizes')}")
