"""Writing plan.yaml (atomically: a crash never leaves a half-written plan for the engine)."""
from __future__ import annotations

from pathlib import Path

import yaml

from usp.run.files import plan_path, write_text_atomic


def write_plan(plan, path: Path | None = None) -> Path:
    path = Path(path or plan_path(plan.run_dir))
    header = "# usp run plan: derived from the config below; the engine reads only this file.\n"
    write_text_atomic(path, header + yaml.safe_dump(plan.to_dict(), sort_keys=False, width=110))
    return path
