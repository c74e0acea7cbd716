"""Which rank a hang is about, from what every rank recorded (docs/hangs.md). No torch: the watchdog
(usp/engine/observe/hang.py) calls it on the live rank that writes the verdict, the unit tests on
heartbeat records.

A heartbeat (logs/heartbeat_rank<R>.json, one per rank, rewritten in place at every phase change)
says where a rank is: {"rank", "pid", "pid_start", "host", "launch", "step", "phase", "since",
"allowance_s"}. "launch" names torchrun's run and restart, so a record left by an earlier attempt is
no beat of this one. A rank's watchdog adds "detected" once the rank saw no progress for its phase's
allowance: the rank is alive (its watchdog ran) and says where its main thread was.

The stuck rank is the one the others wait for: first the ranks that did not respond (stopped,
frozen, dead: nothing in them runs); else those a step behind the others; else those that were in
no collective while the others waited in one (a data loader stuck on a file system, say). A SIGSTOPped or frozen
process can't dump its own stack: a live rank on its host reads its state from /proc instead."""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from usp.run.lock import pid_start as lock_pid_start

SILENT = ("did not respond: its watchdog could not run, so the process is stopped (SIGSTOP, a debugger), "
          "frozen in the kernel or dead")
PHASES = {"step": "in step {step}", "eval": "evaluating after step {step}",
          "checkpoint": "saving the checkpoint of step {step}", "start": "before its first step"}
LISTED_RANKS = 64  # hang.json lists the stuck ranks and at most this many others in full


def read_heartbeat(path: Path) -> dict | None:
    """A heartbeat record, or None (no file, or unreadable after a few tries: it is rewritten in
    place, so a read may meet a write)."""
    for _ in range(3):
        try:
            record = json.loads(path.read_text())
            return record if isinstance(record, dict) else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            time.sleep(0.01)
    return None


def where_text(record: dict) -> str:
    """A rank's place in the loop: "in step 6", "saving the checkpoint of step 4", ..."""
    return PHASES.get(record.get("phase", ""), "{phase} of step {step}").format(**{"step": "?", "phase": "?",
                                                                                   **record})


def process_state(pid: int, pid_start: str | None) -> str | None:
    """What this host's kernel says about a process: "T (stopped), wchan do_signal_stop, 14 threads";
    "gone" when it has exited (or the pid is another process now); None when /proc can't tell."""
    proc = Path(f"/proc/{pid}")
    try:
        if pid_start is not None and lock_pid_start(pid) != pid_start:
            return "gone"
        fields = dict(line.split(":\t", 1) for line in (proc / "status").read_text().splitlines() if ":\t" in line)
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    state, threads = fields.get("State", "?").strip(), fields.get("Threads", "?").strip()
    try:
        wchan = (proc / "wchan").read_text().strip() or "-"
    except OSError:
        wchan = "?"
    return f"{state}, wchan {wchan}, {threads} threads"


def waits_for_peers(entry: dict) -> bool:
    """A rank that responded waits for its peers: torch's flight recorder has a collective of it that has
    not completed, or its main thread's innermost frame (file:line function) is in torch.distributed."""
    frames = entry.get("frames") or []
    return bool(entry.get("collective")) or any("torch/distributed/" in f for f in frames[-1:])


def entries(beats: dict[int, dict | None], launch: str, since: float) -> list[dict]:
    """One entry per rank: its heartbeat of this launch, and whether it responded to this hang (a
    detection at or after `since`, when the writer's own stall began: an earlier detection was
    another hang)."""
    out = []
    for rank in sorted(beats):
        beat = beats[rank] if (beats[rank] or {}).get("launch") == launch else None
        detected = (beat or {}).get("detected") or {}
        responded = bool(detected) and float(detected.get("time", 0)) >= since
        entry = {"rank": rank, "responded": responded, "beat": beat is not None}
        if beat is not None:
            entry.update({k: beat.get(k) for k in ("host", "pid", "pid_start", "step", "phase", "since")})
            entry["where"] = where_text(beat)
        if responded:
            entry.update({"frames": detected.get("frames", []), "collective": detected.get("collective"),
                          "stalled_s": detected.get("stalled_s"), "peers": detected.get("peers", {})})
        out.append(entry)
    return out


def classify(found: list[dict]) -> tuple[list[int], str]:
    """The stuck rank(s) and why (module docstring); ([], why) when no rank stands out."""
    silent = [e["rank"] for e in found if not e["responded"]]
    if silent:
        return silent, SILENT
    steps = {e["rank"]: int(e.get("step") or 0) for e in found}
    low, high = min(steps.values()), max(steps.values())
    if low < high:
        return [r for r, s in steps.items() if s == low], f"still in step {low} while the others were in step {high}"
    outside = [e["rank"] for e in found if not waits_for_peers(e)]
    if 0 < len(outside) < len(found):
        return outside, "it was not in a collective (see its stack) while the others waited in one"
    return [], "no rank stood out: every rank responded, in the same step; compare their stacks"


def add_process_states(found: list[dict]) -> None:
    """Each silent rank's process state, as a live rank on its host saw it at its detection."""
    seen: dict[str, str] = {}
    for e in found:
        for rank, state in (e.get("peers") or {}).items():
            seen.setdefault(str(rank), state)
    for e in found:
        if not e["responded"]:
            e["process"] = seen.get(str(e["rank"]), "unknown: no live rank on its host" if e["beat"] else
                                    "unknown: it wrote no heartbeat in this launch")


def verdict(beats: dict[int, dict | None], launch: str, since: float, writer: dict) -> dict:
    """hang.json: `writer` is the verdict writer's own detection ({"rank", "time", "step", "phase",
    "stalled_s", "window_s"})."""
    found = entries(beats, launch, since)
    add_process_states(found)
    stuck, why = classify(found)
    live = [e for e in found if e["responded"]]
    waits = Counter(e.get("collective") or (e["frames"][-1] if e.get("frames") else "?") for e in live)
    listed = [e for e in found if e["rank"] in stuck] + [e for e in found if e["rank"] not in stuck][:LISTED_RANKS]
    return {"launch": launch, "detected_by": writer["rank"], "detected_at": writer["time"],
            "step": writer["step"], "phase": writer["phase"], "stalled_s": writer["stalled_s"],
            "window_s": writer["window_s"], "stuck": stuck, "reason": why, "responded": len(live),
            "world_size": len(found), "live_waiting_in": [[w, n] for w, n in waits.most_common(3)],
            "ranks": [{k: v for k, v in e.items() if k != "peers"} for e in listed], "outcome": "pending"}


def silent_stacks_text(entry: dict, hang: dict) -> str:
    """logs/stacks_rank<R>.txt of a rank that did not respond: what is known about it instead of its stack."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(hang["detected_at"]))
    lines = [f"usp hang watchdog: rank {entry['rank']} did not respond, so no Python stack of it could be taken",
             f"detected by rank {hang['detected_by']} at {when}, after {hang['stalled_s']:.1f} s without progress",
             f"process: pid {entry.get('pid', '?')} on {entry.get('host', '?')}: {entry.get('process')}",
             f"last heartbeat: {entry.get('where', 'none in this launch')}"
             + (f", since {time.strftime('%H:%M:%S', time.localtime(entry['since']))}" if entry.get("since") else ""),
             "",
             "A stopped (T), frozen (D) or dead process runs none of its own code, faulthandler included. If it is",
             f"still there and running: `py-spy dump --pid {entry.get('pid', '<pid>')}` (ptrace) reads its stack;",
             "after a SIGCONT its own watchdog replaces this file with its stacks."]
    return "\n".join(lines) + "\n"
