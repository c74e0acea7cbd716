"""What the trainer tells the hang watchdog (usp/engine/observe/hang.py) and the straggler detector
(usp/engine/observe/stragglers.py), in one place, so the loop calls a few hooks and nothing else
(docs/hangs.md). On one process, or with both off, every hook does nothing."""
from __future__ import annotations

import contextlib
import functools

from usp.run.files import STRAGGLER_EVENT, append_event


class RankWatch:
    def __init__(self, hang=None, stragglers=None):
        self.hang, self.stragglers = hang, stragglers
        self.step_number = 0

    @classmethod
    def create(cls, trainer) -> RankWatch:
        plan, ctx = trainer.plan, trainer.ctx
        if ctx.world_size < 2:
            return cls()
        hang = stragglers = None
        if plan.decisions.hang is not None:
            from usp.engine.observe.hang import HangWatch

            hang = HangWatch(plan, ctx.rank, trainer.log, trainer.checkpointer, trainer.start_step,
                             getattr(ctx, "replica_group", None))  # torchft: ranks are numbered per group
            trainer.log.info("hang watchdog: %.3g s without progress in a step (%s); first step %.3g s, evaluation "
                             "%.3g s, checkpoint %.3g s, then %.3g s of grace", plan.decisions.hang.step_s,
                             plan.decisions.hang.source, plan.decisions.hang.first_step_s, plan.decisions.hang.eval_s,
                             plan.decisions.hang.checkpoint_s, plan.decisions.hang.grace_s)
        if plan.decisions.straggler_measure:
            from usp.engine.observe.stragglers import Stragglers

            stragglers = Stragglers(plan, ctx, trainer.warn,
                                    functools.partial(append_event, plan.run_dir, STRAGGLER_EVENT))
        return cls(hang, stragglers)

    def step(self, step: int) -> None:
        """Step `step` + 1 begins (the loop's index: the steps done so far)."""
        self.step_number = step + 1
        if self.hang is not None:
            self.hang.beat("step", self.step_number)
        if self.stragglers is not None:
            self.stragglers.step_begins()

    def step_applied(self, step: int) -> None:
        """Step `step`'s update is in the weights (what a save without a stuck peer would hold)."""
        if self.hang is not None:
            self.hang.step_applied(step)

    def allow(self, phase: str, fn):
        """`fn` (an evaluation, a checkpoint save) under its own allowance; the step's clock restarts after."""
        if self.hang is None:
            return fn

        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            step = args[0] if args and isinstance(args[0], int) else self.step_number  # save(step, ...)
            self.hang.beat(phase, step)
            try:
                return fn(*args, **kwargs)
            finally:
                self.hang.beat("step", self.step_number)
        return guarded

    def optimizer_section(self):
        """Around the optimizer step: timed per rank for the straggler detector."""
        return self.stragglers.optimizer_section() if self.stragglers is not None else contextlib.nullcontext()

    def step_done(self, data_s: float) -> None:
        """The step's own work is done; `data_s`: the time it spent reading its batch."""
        if self.stragglers is not None:
            self.stragglers.step_done(data_s)

    def record(self, step: int) -> dict:
        """The fields a logged step adds to metrics.jsonl; every rank calls it on the same steps."""
        return self.stragglers.record(step) if self.stragglers is not None else {}

    def close(self) -> None:
        """The loop ended (or failed): the watchdog stops watching."""
        if self.hang is not None:
            self.hang.stop()
