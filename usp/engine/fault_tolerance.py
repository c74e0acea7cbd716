"""fault_tolerance=torchft (docs/fault_tolerance.md): one replica group's side of a run.

The plan's dp_replicate ranks are replica groups. Each group is a job of its own (a torchrun launch
locally, an array task on Slurm) that trains the rest of the layout (dp_shard x cp x tp x pp) on its
own process group; torchft's Manager joins it to the other live groups every step:

1. `start_quorum` (synchronous): the lighthouse forms a quorum of the groups that ask; a group behind
   the others (restarted, or new) first receives a live group's state (model, optimizer, schedule:
   torchft's HTTP transport, rank by rank) and continues from the quorum's step.
2. forward and backward as usual inside the group (its FSDP reduce-scatters, TP, PP), then every local
   gradient averaged over the quorum's groups in one all-reduce (torchft's fault-tolerant gloo group:
   a lost peer makes it fail fast instead of hanging).
3. `should_commit`: the optimizer steps only when every rank of the group got through; a step that
   failed (a group died in it) is dropped and retried with the next quorum, on the same data.

A step with fewer groups is a smaller global batch: each group always reads its own slice of the
configured global batch (usp's sampler with the global data-parallel rank, which is torchft's
DistributedSampler split: group g's rank r reads slice g x group ranks + r), and the gradient is
the mean over the groups present. metrics.jsonl says how many took part (`participants`).

Checkpoints are written by the quorum's first group alone (replica rank 0); every group resumes
from the same checkpoint, with any number of groups. This module is imported only when the plan
says fault_tolerance=torchft; worker.py calls its three hooks (group_plan, group_context,
ReplicaGroupTrainer)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from usp.contract.run_plan import RunPlan
from usp.engine.observe.metrics import MetricsWriter, read_metrics
from usp.engine.parallel.mesh import DistContext, all_reduce_mean
from usp.engine.trainer import Trainer, finite_or_null
from usp.errors import UspError
from usp.run.files import (
    FT_ATTEMPT_ENV,
    FT_LAUNCH_ENV,
    FT_LIGHTHOUSE_ENV,
    FT_REPLICA_GROUP_ENV,
    METRICS,
    SUMMARY,
    ft_start_dir,
    write_text_atomic,
)


class _Dropped(Exception):
    """A step that didn't commit (ReplicaGroupTrainer.train_step): nothing after it in the step runs."""


class FaultToleranceError(UspError):
    """A replica group that can't take part (no lighthouse, no group number): one message, its fix."""


def replica_group(plan: RunPlan) -> int:
    """This process's replica group, from its launcher (usp/launch/ft_local.py, the Slurm array task)."""
    value = os.environ.get(FT_REPLICA_GROUP_ENV, "")
    groups = plan.fault_tolerance.replica_groups
    if not value.isdigit() or int(value) >= groups:
        raise FaultToleranceError(f"{FT_REPLICA_GROUP_ENV}={value!r}: a replica group of a fault_tolerance=torchft "
                                  f"run needs its number, 0 .. {groups - 1}",
                                  fix="start the run with `usp train` / `usp submit`, which start every group")
    return int(value)


def group_plan(plan: RunPlan) -> RunPlan:
    """The plan as one replica group runs it: its ranks, its nodes and its layout (dp_replicate 1), as the
    planner recorded them in plan.fault_tolerance. The batch stays the run's (the sampler splits it over
    every group's ranks: group_context)."""
    ft = plan.fault_tolerance
    degrees = dict(ft.group_degrees)
    return dataclasses.replace(plan, world_size=ft.group_world_size, nodes=ft.group_nodes,
                               procs_per_node=ft.group_procs_per_node, degrees=degrees,
                               mesh_shape=[degrees[d] for d in plan.mesh_dims],
                               decisions=dataclasses.replace(plan.decisions, dp_kind=ft.group_dp_kind))


@dataclasses.dataclass
class ReplicaGroupContext(DistContext):
    """A rank's context inside its replica group; the data-parallel rank and size are the run's (every
    group's ranks), so each group reads its own slice of the global batch."""

    replica_group: int = 0
    replica_groups: int = 1

    @property
    def dp_size(self) -> int:
        return self.replica_groups * self.degrees["dp_shard"]

    @property
    def dp_rank(self) -> int:
        return self.replica_group * self.degrees["dp_shard"] + self.coords["dp_shard"]


def group_context(ctx: DistContext, plan: RunPlan, group: int) -> ReplicaGroupContext:
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(DistContext)}
    return ReplicaGroupContext(**fields, replica_group=group, replica_groups=plan.fault_tolerance.replica_groups)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class ReplicaSync:
    """torchft's Manager for this rank: quorum, the all-reduce between groups, commit, healing."""

    def __init__(self, trainer: ReplicaGroupTrainer, group: int):
        import torchft
        from torchft.process_group import ProcessGroupGloo

        ft, ctx = trainer.plan.fault_tolerance, trainer.ctx
        lighthouse = os.environ.get(FT_LIGHTHOUSE_ENV)
        if not lighthouse:
            raise FaultToleranceError(f"{FT_LIGHTHOUSE_ENV} is not set: a replica group needs the lighthouse's address",
                                      fix="start the run with `usp train` / `usp submit`, which start the lighthouse")
        if ctx.device.type != "cpu":
            from torchft.process_group import ProcessGroupNCCL as GroupClass
        else:
            GroupClass = ProcessGroupGloo
        self.trainer = trainer
        _quiet_torchft(trainer.log)
        timeout = timedelta(seconds=ft.timeout_s)
        self.manager = torchft.Manager(
            pg=GroupClass(timeout=timeout), load_state_dict=self._load_state, state_dict=self._state,
            min_replica_size=int(ft.min_replicas), use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=timeout,
            rank=ctx.rank, world_size=ctx.world_size, lighthouse_addr=lighthouse,
            replica_id=f"usp_replica_{group}", hostname=socket.gethostname(), init_sync=False)
        self.healed_at: int | None = None

    # -- the state a group behind the others receives ------------------------------------------
    def _state(self) -> dict:
        t = self.trainer
        return {"modules": [{k: _local(v) for k, v in m.state_dict().items()} for m in t.parts.modules],
                "optimizers": [_local_optimizer_state(o) for o in t.optimizers],
                "schedulers": [s.state_dict() for s in t.schedulers]}

    def _load_state(self, state: dict) -> None:
        """Copy a live group's state into this group's tensors, in place (parameters keep their
        identity: the optimizer and FSDP hold them)."""
        t = self.trainer
        with torch.no_grad():
            for module, saved in zip(t.parts.modules, state["modules"]):
                for key, value in module.state_dict().items():
                    _local(value).copy_(saved[key])
            for optimizer, saved in zip(t.optimizers, state["optimizers"]):
                _load_optimizer_state(optimizer, saved)
        for scheduler, saved in zip(t.schedulers, state["schedulers"]):
            scheduler.load_state_dict(saved)
        self.healed_at = self.manager.current_step()

    # -- one step -------------------------------------------------------------------------------
    def start_step(self) -> int:
        """Join this step's quorum (healing first when behind); the step to train."""
        self.healed_at = None
        self.manager.start_quorum()
        return self.manager.current_step()

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    @property
    def is_writer(self) -> bool:
        """This group is the quorum's first (replica rank 0): it writes checkpoints and metrics."""
        return self.manager.participating_rank() == 0

    def average(self, tensors: list[torch.Tensor]) -> bool:
        """Average `tensors` in place over the quorum's groups (one all-reduce per dtype); False when the
        all-reduce failed (a group was lost in it): the step must not commit."""
        ok = True
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            ok = self.manager.allreduce(flat).wait() and ok
            if self.manager.errored():
                return False
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return ok and self.manager.errored() is None

    def should_commit(self) -> bool:
        return bool(self.manager.should_commit())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _quiet_torchft(log) -> None:
    """torchft's Python loggers into this rank's log file instead of the console (a warning per quorum
    change about NCCL's flight recorder, which gloo has not), and torch's note on the read-only buffers
    a heal's state arrives in."""
    import logging
    import warnings

    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logger = logging.getLogger(name)
        logger.handlers[:] = list(log.handlers)
        logger.propagate = False
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _local_optimizer_state(optimizer) -> dict:
    sd = optimizer.state_dict()
    return {"state": {i: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for i, s in sd["state"].items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]}


def _load_optimizer_state(optimizer, saved: dict) -> None:
    """A live group's optimizer state, copied into this one's tensors (created first when this group
    has not stepped yet: a zero-learning-rate step on zero gradients makes them, then they are
    overwritten)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(not optimizer.state.get(p) for p in params) and saved["state"]:
        lrs = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
    for index, p in enumerate(params):
        for key, value in saved["state"].get(index, {}).items():
            mine = optimizer.state[p].get(key)
            if isinstance(mine, torch.Tensor):
                _local(mine).copy_(value)
            else:
                optimizer.state[p][key] = value
    for group, settings in zip(optimizer.param_groups, saved["param_groups"]):
        group.update(settings)


class _WriterOnly:
    """The trainer's Checkpointer, whose saves only the quorum's first group makes."""

    def __init__(self, inner, is_writer):
        self._inner, self._is_writer = inner, is_writer

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, step: int, blocking: bool = False, retain: bool = True) -> None:
        if self._is_writer():
            self._inner.save(step, blocking=blocking, retain=retain)


class ReplicaGroupTrainer(Trainer):
    """Trainer (usp/engine/trainer.py) for one replica group: the step runs through torchft's quorum
    and commit, the gradients are averaged over the live groups, checkpoints and metrics come from
    the quorum's first group."""

    def __init__(self, plan: RunPlan, ctx: ReplicaGroupContext):
        super().__init__(plan, ctx, write_outputs=False)  # metrics: _MetricsAppender, by the writer group only
        self.group, self.groups = ctx.replica_group, ctx.replica_groups
        for handler in self.log.handlers:  # every group's rank r logs to logs/rank_<r>.log: say whose line it is
            handler.setFormatter(_formatter(f"replica{self.group} rank{ctx.rank}"))
        self.sync = ReplicaSync(self, self.group)
        self.sync.manager.load_state_dict({"step": self.start_step, "batches_committed": 0})
        self.checkpointer = _WriterOnly(self.checkpointer, lambda: self.sync.is_writer)
        self.attempt = int(os.environ.get(FT_ATTEMPT_ENV, "0") or 0)
        self.metrics = _MetricsAppender(self.run_dir / METRICS, self.start_step,
                                        fresh=self.attempt == 0 and self.group == 0) if ctx.is_main else None
        self.participants = self.groups
        self._console_mode = self.console.mode
        self.log.info("replica group %d of %d: %d ranks, layout %s, lighthouse %s, attempt %d", self.group,
                      self.groups, ctx.world_size, ctx.degrees, os.environ.get(FT_LIGHTHOUSE_ENV), self.attempt)

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict | None:
        if self._run_completed():
            self.log.info("the run completed while this group restarted: nothing to do")
            self.watch.close()
            self.sync.shutdown()
            return None
        self._wait_for_every_group()
        started = time.perf_counter()
        loss, val_loss, first_loss, self.history = float("nan"), None, None, []
        try:
            step = self.sync.start_step()
            while step < self.steps:
                self.watch.step(step)  # the hang watchdog, its files named by replica group (docs/hangs.md)
                self._stop_if_signalled(step)
                result = self._fit_step(step, started)
                if result is not None:
                    loss, val_loss = result
                    first_loss = loss if first_loss is None else first_loss
                step = self.sync.start_step()
            self.checkpointer.save(self.steps, blocking=True)
            writer = self.sync.is_writer
        finally:
            self.watch.close()
            self._close_outputs()
            self.sync.shutdown()
        summary = self._summary(time.perf_counter() - started, first_loss, loss, val_loss)
        if writer and self.ctx.is_main:
            write_text_atomic(self.run_dir / SUMMARY, json.dumps(summary, indent=2, allow_nan=False) + "\n")
        return summary if writer else None

    def _fit_step(self, step: int, started: float):
        healed = self.sync.healed_at
        if healed is not None:
            self.warn(f"replica group {self.group} healed from a live group at step {healed}")
            self.last_completed_step = healed
        self.participants = self.sync.participants
        self.console.mode = self._console_mode if self.sync.is_writer else "quiet"  # one group prints the steps
        try:
            return super()._fit_step(step, started)
        except _Dropped:
            return None

    def train_step(self, step: int) -> tuple[float, float]:
        """Trainer.train_step with the gradients averaged over the quorum's groups before clipping, and
        the optimizer step only when torchft commits it."""
        from usp.engine.grad_norm import clip_grad_norm
        from usp.engine.parallel.tied import sum_tied_grads

        for m in self.parts.modules:
            m.train()
        loss = self._pipeline_step(step) if self.parts.schedule is not None else self._accumulate(step)
        loss = all_reduce_mean(loss, self.ctx)
        tied = self.parts.tied
        if tied is not None:
            sum_tied_grads(tied)
        params = list(self.parts.parameters())
        for p in params:  # every group all-reduces the same tensors
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        carried = torch.tensor([loss], dtype=torch.float64, device=self.ctx.device)
        ok = self.sync.average([_local(p.grad) for p in params]) and self.sync.average([carried])
        loss = float(carried.item())
        # Every rank of the group clips and asks to commit, whatever its own all-reduce did: they are
        # collectives inside the group, and should_commit is false on every rank when one failed.
        grad_norm = clip_grad_norm(params, float(self.cfg.optimizer.grad_clip), self.ctx.group("pp"), *self.experts,
                                   duplicate=tied.head_copy if tied is not None else None)
        if not self.sync.should_commit() or not ok:
            self._drop(step)
            raise _Dropped
        if not math.isfinite(loss):
            return self._non_finite(step, loss, what="loss", value=loss)
        if not math.isfinite(grad_norm):
            return self._non_finite(step, loss, what="gradient norm", value=grad_norm)
        self._optimizer_step()
        return loss, grad_norm

    def _drop(self, step: int) -> None:
        """A step a group was lost in: no update; the next quorum trains it again, on the same data."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.log.info("step %d dropped (a replica group was lost in it): retried with the next quorum", step + 1)
        if self.ctx.is_main:
            self.console.print(f"usp: replica group {self.group}: step {step + 1} dropped (a group was lost in "
                               "it), retried with the groups still there")

    def evaluate(self) -> float:
        value = torch.tensor([super().evaluate()], dtype=torch.float64, device=self.ctx.device)
        return float(value.item()) if self.sync.average([value]) else float("nan")

    def _log_record(self, step: int, record: dict) -> None:
        """The step's record with who took part; written to metrics.jsonl by the quorum's first group."""
        share = self.participants / self.groups
        devices = self.participants * self.ctx.world_size
        record.update(participants=self.participants, replica_groups=self.groups,
                      step_sequences=int(round(self.plan.batch.global_batch * share)),
                      tokens_per_s=record["tokens_per_s"] * share, replica_group=self.group,
                      replica_spread=self._replica_spread())
        record["tokens_per_s_per_device"] = record["tokens_per_s"] / devices
        if "mfu" in record:  # the trainer divides by one group's devices and counts the whole global batch
            record["mfu"] = record["mfu"] / self.groups
        self.history.append(record)
        self.log.info("step %d loss %.6f val %s lr %.3e gnorm %.4f participants %d/%d", record["step"],
                      record["loss"], record["val_loss"], record["lr"], record["grad_norm"], self.participants,
                      self.groups)
        if self.metrics is not None and self.sync.is_writer:
            self.metrics.write(record)

    def _replica_spread(self) -> float | None:
        """How far the replica groups' parameters are apart: every rank's fingerprint of its part (sum,
        sum of squares, sum of |x|, over its local parameter shards, float64) against the mean of the
        same rank's over the quorum's groups; the largest relative difference over the group's ranks.
        0 (to float64 rounding) when every group holds the same parameters, as after a heal; None
        when the all-reduce failed (a group lost in it)."""
        with torch.no_grad():
            local = [_local(p.detach()).double() for p in self.parts.parameters()]
            mine = torch.stack([sum(t.sum() for t in local), sum((t * t).sum() for t in local),
                                sum(t.abs().sum() for t in local)]).to(self.ctx.device)
        mean = mine.clone()
        ok = self.sync.average([mean])
        gap = float(((mine - mean).abs() / mean.abs().clamp_min(1e-30)).max()) if ok else math.inf
        spread = torch.tensor([gap], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.world_size > 1:  # every rank of the group, whatever its own all-reduce did
            dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        value = float(spread.item())
        return value if math.isfinite(value) else None

    def _close_outputs(self) -> None:
        super()._close_outputs()
        if self.metrics is not None:
            self.metrics.close()

    def _summary(self, elapsed: float, first_loss, loss, val_loss) -> dict:
        summary = {"steps": self.steps, "tokens": self.steps * self.global_tokens, "time_s": elapsed,
                   "resumed_from_step": self.start_step, "first_loss": first_loss, "final_loss": loss,
                   "final_val_loss": val_loss, "world_size": self.plan.fault_tolerance.group_world_size * self.groups,
                   "replica_groups": self.groups, "replica_group": self.group,
                   "tokens_per_s": None}
        logged = [r for r in self.history if r.get("step_time_s")]
        if logged:
            summary["tokens_per_s"] = sum(r["tokens_per_s"] * r["step_time_s"] for r in logged) / elapsed
        summary = finite_or_null(summary)
        self.log.info("done: %s", json.dumps(summary))
        return summary

    def _run_completed(self) -> bool:
        """A restarted group whose run finished meanwhile (summary.json newer than the launch's start)."""
        launch = os.environ.get(FT_LAUNCH_ENV)
        if not self.attempt or not launch:
            return False
        start, summary = ft_start_dir(self.run_dir, launch), self.run_dir / SUMMARY
        return start.is_dir() and summary.is_file() and summary.stat().st_mtime > start.stat().st_mtime

    # -- a fresh start waits for every group ---------------------------------------------------------
    def _wait_for_every_group(self) -> None:
        """The first attempt of a launch: every group's ranks wait (fault_tolerance.start_timeout_s at
        most) until every group is built and has joined the lighthouse, so the first step is the whole
        global batch, as the same run without torchft. A restarted group doesn't wait: it heals."""
        launch = os.environ.get(FT_LAUNCH_ENV)
        if self.attempt or not launch:
            return
        where = ft_start_dir(self.run_dir, launch)
        where.mkdir(parents=True, exist_ok=True)
        if self.ctx.is_main:
            (where / f"group_{self.group}").write_text(str(os.getpid()))
        deadline = time.monotonic() + int(self.plan.fault_tolerance.start_timeout_s)
        while time.monotonic() < deadline:
            ready = sum((where / f"group_{g}").exists() for g in range(self.groups))
            if ready == self.groups:
                return
            time.sleep(0.1)
        self.warn(f"started with {ready} of {self.groups} replica groups after waiting "
                  f"fault_tolerance.start_timeout_s={self.plan.fault_tolerance.start_timeout_s} s; the others join "
                  "when they are up")


def _formatter(who: str):
    import logging

    return logging.Formatter(f"%(asctime)s {who} %(message)s")


class _MetricsAppender(MetricsWriter):
    """metrics.jsonl under torchft: the quorum's first group writes each step, and that group may change,
    so every group appends. The first attempt of group 0 starts the file as the trainer does (records up to
    the step resumed from kept, before any group trains)."""

    def __init__(self, path: Path, start_step: int, fresh: bool):
        path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= start_step] if start_step and path.exists() \
                else []
            write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(path, "a")  # MetricsWriter's write and close; only where the file starts differs
        self.previous_progress = None

