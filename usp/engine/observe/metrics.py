"""runs/<name>/metrics.jsonl: one JSON object per logged step, flushed as it is written so
a crash loses nothing that was logged. Written by rank 0 only, always (W&B and TensorBoard
are optional extras beside it: usp/engine/observe/tracking.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    def __init__(self, path: Path, keep_until: int = 0):
        """A fresh run (keep_until=0) starts a fresh file; a resumed run keeps the records up to
        the step it resumed from and drops those a crashed attempt logged after it (the time of
        the last one read kept as previous_progress)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        found = read_metrics(path) if keep_until and path.exists() else []
        kept = [r for r in found if r.get("step", 0) <= keep_until]
        # the crashed attempt's last logged progress: about when it failed (its restart's cost counts from there)
        self.previous_progress = max((r["time"] for r in found if isinstance(r.get("time"), float)), default=None)
        self._file = open(path, "w")
        for record in kept:
            self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log(self, step: int, record: dict) -> None:  # the Tracker interface (usp/engine/observe/tracking.py)
        self.write(record)

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
