"""Run many distributed checks in one torchrun launch (launches cost 5-14 s each on this
machine, see docs/parallelism.md, "PyTorch distributed on CPU").

A case script calls `run_cases(CASES)`: every rank runs every case in order; each case
returns a dict of results (or raises); rank 0 writes one JSON line per case to the file
named by USP_CASE_RESULTS. The pytest side calls `launch(script, nproc)` and gets
{case name: result}. A launch that dies from an infrastructure error (gloo connection
reset, rendezvous failure) is retried once, and says so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

INFRA_ERRORS = ("Connection reset by peer", "Connection closed by peer", "RendezvousConnectionError",
                "Address already in use", "Gloo connectFullMesh failed")


def launch(script: Path, nproc: int, *args: str, timeout: float = 600, only: str | None = None) -> dict:
    """Run `script` under torchrun with nproc CPU processes; return {case: result dict}."""
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            results = Path(tmp) / "results.jsonl"
            env = dict(os.environ, USP_CASE_RESULTS=str(results), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            if only:
                env["USP_CASE_ONLY"] = only
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   str(script), *args]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            out = {}
            if results.exists():  # rank 0's numbers; a failure on any rank fails the case
                for line in results.read_text().splitlines():
                    record = json.loads(line)
                    name, rank = record.pop("case"), record.pop("rank")
                    if rank == 0:
                        out[name] = {**out.get(name, {}), **record}
                    elif not record["ok"]:
                        out[name] = {**out.get(name, {}), "ok": False, f"rank{rank}": record}
        if proc.returncode == 0:
            return out
        log = proc.stdout[-4000:] + proc.stderr[-8000:]
        if attempt == 1 and any(marker in log for marker in INFRA_ERRORS):
            print(f"harness: retrying {script.name} once after an infrastructure error:\n{log[-1500:]}",
                  file=sys.stderr)
            continue
        raise AssertionError(f"torchrun {script.name} (nproc {nproc}) exited {proc.returncode}; "
                             f"cases finished: {list(out)}\n{log}")
    raise AssertionError("unreachable")


def run_cases(cases: dict) -> None:
    """Worker side: run each case on every rank. Rank 0 records its results, every rank its
    failures. A failing case is recorded with its error and the launch goes on (a failure on
    one rank usually makes the others fail the case too, at their next collective: keep the
    process group's timeout short in case scripts)."""
    from usp.engine.parallel.mesh import teardown
    from usp.engine.startup_gc import freeze_imports

    freeze_imports()  # the case script paused the collector for its imports (usp/engine/startup_gc.py)
    rank = int(os.environ.get("RANK", "0"))
    only = os.environ.get("USP_CASE_ONLY")
    path = os.environ.get("USP_CASE_RESULTS")
    for name, fn in cases.items():
        if only and only not in name:
            continue
        start = time.perf_counter()
        try:
            result = {"ok": True, **(fn() or {})}
        except Exception as exc:  # report and go on with the next case
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - start, 2)  # where a launch's time goes
        if path and (rank == 0 or not result["ok"]):
            with open(path, "a") as f:
                f.write(json.dumps({"case": name, "rank": rank, **result}, default=float) + "\n")
    # the engine's own teardown: garbage collected first, so no pipeline schedule's send/recv work is
    # left for interpreter shutdown to free (a rank aborted at exit, after its cases, once in CI)
    teardown(clean=True)
