"""`usp verify` worker: `python -m usp.engine.verify_worker --plan P --reference R --out F`,
under torchrun (or in-process for one rank). Trains the reference on rank 0, then the layout on
every rank, and writes the step-by-step comparison to F (rank 0, atomically)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from usp.engine import dist as udist
from usp.engine.accel import apply_determinism
from usp.engine.parity import verify_plans
from usp.rundir import read_plan, write_text_atomic


def run_verify(plan_path: str, reference_path: str, out: str) -> int:
    plan, reference = read_plan(Path(plan_path)), read_plan(Path(reference_path))
    apply_determinism(plan)
    udist.init_process_group(plan)
    clean = False
    try:
        result = verify_plans(plan, reference)
        if result:
            write_text_atomic(Path(out), json.dumps(result, indent=1))
        clean = True
    finally:
        udist.teardown(clean)
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="usp.engine.verify_worker")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--reference", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    sys.exit(run_verify(args.plan, args.reference, args.out))


if __name__ == "__main__":
    main()
