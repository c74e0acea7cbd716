"""A rank as the worker (usp/engine/worker.py) has it just before it builds its model: the worker's
imports (torch, usp's engine), its plan read back, its process group and device mesh
(usp.engine.parallel.mesh.setup), then a barrier and the worker's teardown: nothing of a model. Run
under torchrun by tests/e2e/test_memory_promise.py, which reads each rank's peak resident set from
outside: what the planner's fixed CPU allowance (usp/perf/memory.py FIXED_OVERHEAD_GIB) stands for."""
import sys

import torch

from usp.contract.plan_file import read_plan
from usp.engine.parallel import mesh
from usp.engine.worker import run_worker  # noqa: F401 - every import a rank makes before it builds

if __name__ == "__main__":
    plan = read_plan(sys.argv[1])
    torch.manual_seed(int(plan.config.train.seed))
    mesh.setup(plan)
    mesh.teardown(clean=True)
