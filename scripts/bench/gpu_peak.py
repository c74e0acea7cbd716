"""What the GPU's allocator holds at its peak, by the code that allocated it: a replay of
torch.cuda.memory's recorded history (`_record_memory_history`), for a row whose measured peak and
the planner's disagree. mfu.measure records the history when USP_BENCH_MEMORY_HISTORY=1 (from
before the model is built, so every live block has its stack) and adds `peak_breakdown` to its row.
Not a benchmark of its own: a diagnosis, printed with the row."""
from __future__ import annotations

from collections import Counter

GIB = 2**30
USP_ROOTS = ("/usp/", "/torch/")


def start(torch) -> None:
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")


def breakdown(torch, top: int = 25) -> dict:
    """Replay the allocations and frees in order; at the largest allocated total, the live blocks
    grouped by their innermost usp frame (file:line function) and the torch op beneath it."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][0]:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups: Counter = Counter()
    for size, where in at_peak.values():
        groups[where] += size
    return {"replayed_peak_gib": peak / GIB, "blocks_at_peak": len(at_peak),
            "by_site_gib": {k: round(v / GIB, 3) for k, v in groups.most_common(top)}}


def _where(frames: list) -> str:
    usp = next((f for f in frames if "/usp/" in f["filename"]), None)
    op = next((f for f in frames if "/usp/" not in f["filename"]), None)
    usp_s = f"{usp['filename'].rsplit('/usp/', 1)[1]}:{usp['line']} {usp['name']}" if usp else "?"
    return usp_s + (f" < {op['name']}" if op else "")
