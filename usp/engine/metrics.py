"""runs/<name>/metrics.jsonl: one JSON object per logged step, flushed as it is written so
a crash loses nothing that was logged. Written by rank 0 only."""
from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w")  # a fresh run starts a fresh file

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
