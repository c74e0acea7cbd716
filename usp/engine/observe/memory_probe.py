"""Measured peak memory of one training step, next to the planner's prediction.

One optimizer step (forward + backward + optimizer step, by default the second one, when the
AdamW states already exist) runs under a probe:

- CUDA: the caching allocator's statistics (`reset_peak_memory_stats` before the step,
  `max_memory_allocated` after): the peak of live tensor bytes, rounded to allocator blocks.
- CPU (no allocator statistics: `torch.cuda.max_memory_allocated()` is 0 there): PyTorch's
  `MemTracker` (torch.distributed._tools.mem_tracker), a TorchDispatchMode that follows every
  tensor storage by identity from the op that creates it until it is freed, plus the storages
  that existed before the step (parameters, optimizer states, given to `track_external`). It
  works through DDP, ZeroRedundancyOptimizer, FSDP2 (it follows `storage.resize_`, which FSDP2
  uses to free unsharded parameters) and DTensor (it sees the local tensors).
  DDP's gradient buckets are allocated by the C++ reducer when DDP is built, outside any
  tracker: their size comes from the reducer's own logging data (`bucket_sizes`) and is added
  (DDP's one-time bucket rebuild is triggered just before the measured step, not inside it).
  Micro batches and pipeline schedules run a module several times per step, which MemTracker
  refuses: a subclass restarts that module's statistics instead. The zero-bubble schedules'
  split backward breaks MemTracker's module hooks: there it runs without them (same total,
  coarser categories).

On a CPU rank the measured step runs under the build's glibc mmap threshold (usp/run/allocator.py
`build_threshold`): under the training threshold the tracker's own Python objects split the freed
activations kept in the heap, and the step's peak resident set rose by ~0.1 GiB per rank.

Both count tensor bytes only: no allocator fragmentation, no CUDA context / NCCL workspaces, no
Python or gloo memory. So the prediction they are compared with is the planner's tensor
memory, its per-rank total WITHOUT the `overhead` term (the fixed framework allowance + the
fragmentation margin), `memory_predicted_gib`; the full prediction is `memory_predicted_total_gib`.

The trainer calls `MemoryProbe.create(trainer)` (None when train.measure_memory is false),
`probe.step(step)` around every train_step (a no-op except on the measured one), and
`probe.record(step)` / `probe.summary(history)` for metrics.jsonl and summary.json.
"""
from __future__ import annotations

import contextlib
import statistics
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook  # not an attribute of torch.optim on torch 2.11

from usp.contract.predictions import StageMemory
from usp.contract.run_plan import RunPlan
from usp.run import allocator

GIB = 1024 ** 3
CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers")


def predicted_stage(plan: RunPlan, pp_rank: int) -> StageMemory | None:
    """The planner's breakdown for this rank's pipeline stage (plan.memory.stages[pp rank])."""
    memory = plan.memory
    if memory is None:
        return None
    return memory.stages[pp_rank] if pp_rank < len(memory.stages) else memory.peak


def predicted_tensor_bytes(stage: StageMemory) -> float:
    """The planner's tensor memory of a stage: its total without the overhead allowance."""
    return float(stage.total) - float(stage.overhead)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shard; a tied
    weight counts once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        key = (st.data_ptr(), local.device)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def optimizer_state_tensors(optimizers) -> list:
    out = []
    for optimizer in optimizers:
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's states in .optim
        out += [v for state in inner.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def ddp_bucket_bytes(modules) -> int:
    """Bytes of DDP's flat gradient buckets (0 when the gradients are views into them)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    total = 0
    for m in modules:
        if isinstance(m, DDP):
            info = m._get_ddp_logging_data()
            if not int(info.get("gradient_as_bucket_view", 0)):
                total += sum(int(x) for x in str(info.get("bucket_sizes", "")).split(",") if x.strip())
    return total


def rebuild_ddp_buckets(modules) -> None:
    """DDP rebuilds its buckets once, in the order the first backward produced the gradients, at
    the start of the next forward (allocating the new ones before freeing the old). Do it now, as
    DDP's forward would, so a tracker entered next sees neither: the buckets are added from the
    reducer's logging data. Every rank calls this at the same step (it broadcasts the bucket order)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    for m in modules:
        if isinstance(m, DDP) and torch.is_grad_enabled() and m.reducer._rebuild_buckets():
            m._has_rebuilt_buckets = True


def _step_tracker(base):
    """MemTracker that accepts several forwards of the same top-level module in one step (micro
    batches of gradient accumulation, pipeline schedules): MemTracker refuses them because it
    keeps per-module statistics per iteration; the probe needs only the global peak, so the
    module's statistics start afresh at each micro batch."""

    class StepTracker(base):
        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return StepTracker


class _NoModuleHooks:
    """Stands in for MemTracker's ModTracker: no module hooks at all. The zero-bubble pipeline
    schedules split each backward into an input and a weight pass (autograd.grad on part of the
    graph), which ModTracker's backward hooks break; without them every storage is still followed
    (the total is the same), only the categories are coarser (gradients count as activations)."""

    is_bw = False
    parents = {"Global"}

    def register_user_hooks(self, *hooks):
        pass

    def clear_user_hooks(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args):
        pass


class MemTrackerProbe:
    """Peak of live tensor bytes on CPU with torch's MemTracker (categories at the peak)."""

    name = "MemTracker"

    def __init__(self, modules, optimizers, module_hooks: bool = True):
        self.modules, self.optimizers, self.module_hooks = modules, optimizers, module_hooks
        self.result: dict[str, Any] = {}
        if not module_hooks:
            self.name = "MemTracker (no module hooks)"

    @contextlib.contextmanager
    def measure(self):
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

        rebuild_ddp_buckets(self.modules)
        tracker = _step_tracker(MemTracker)()
        if not self.module_hooks:
            tracker._mod_tracker = _NoModuleHooks()
        tracker.track_external(*self.modules, *self.optimizers)
        tracker.track_external(*(o.optim for o in self.optimizers if hasattr(o, "optim")))  # ZeRO-1's local one
        # MemTracker's module hooks are global: torch.compile'd blocks warn that such hooks fire once more for
        # their wrapper. The probe counts storages, not hook calls, so the extra call changes nothing it reports.
        with tracker, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
            yield
        snap = tracker.get_tracker_snapshot("peak")
        dev = next(iter(snap.values()), {})
        buckets = ddp_bucket_bytes(self.modules)
        by = {
            "params": dev.get(_MemRefType.PARAM, 0),
            "grads": dev.get(_MemRefType.GRAD, 0),
            "optimizer": dev.get(_MemRefType.OPT, 0),
            "activations": sum(dev.get(k, 0) for k in (_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.BUFFER,
                                                      _MemRefType.OTH)),
            "comm_buffers": buckets,
        }
        self.result = {"peak": dev.get(_TOTAL_KEY, 0) + buckets, "breakdown": by}


class CudaAllocatorProbe:
    """Peak of allocated bytes from the CUDA caching allocator (categories from storage sizes)."""

    name = "cuda allocator"

    def __init__(self, modules, optimizers, device):
        self.modules, self.optimizers, self.device = modules, optimizers, device
        self.result: dict[str, Any] = {}

    @contextlib.contextmanager
    def measure(self):
        grads = {}

        def before_step(opt, args, kwargs):  # gradients are complete just before the (first) step
            grads.setdefault("bytes", storage_bytes(p.grad for m in self.modules for p in m.parameters()))

        handle = register_optimizer_step_pre_hook(before_step)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            handle.remove()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        params = storage_bytes(p for m in self.modules for p in m.parameters())
        optim = storage_bytes(optimizer_state_tensors(self.optimizers))
        g, buckets = grads.get("bytes", 0), ddp_bucket_bytes(self.modules)
        by = {"params": params, "grads": g, "optimizer": optim, "comm_buffers": buckets,
              "activations": max(0, peak - params - g - optim - buckets)}  # the rest, an upper bound
        self.result = {"peak": peak, "breakdown": by}


class MemoryProbe:
    def __init__(self, trainer, step: int):
        self.trainer, self.at = trainer, step
        ctx = trainer.ctx
        self.pp_rank = int(ctx.coords.get("pp", 0))
        self.stage = predicted_stage(trainer.plan, self.pp_rank)
        timing = trainer.plan.timing
        self.step_predicted = timing.step_s if timing is not None else None
        self.measured: dict[str, Any] | None = None

    @classmethod
    def create(cls, trainer) -> MemoryProbe | None:
        train = trainer.cfg.train
        if not bool(train.measure_memory) or trainer.steps < 1:
            return None
        start = int(getattr(trainer, "start_step", 0))
        if start >= trainer.steps:
            return None
        # Pipeline schedules and gradient accumulation run a module's forward several times per
        # step: PyTorch's MemTracker refuses that, the probe's subclass (_step_tracker) handles it.
        return cls(trainer, step=min(start + 1, trainer.steps - 1))  # the second step: AdamW states exist

    def _backend(self):
        t = self.trainer
        modules = list(t.parts.modules)
        optimizers = list(getattr(t, "optimizers", None) or [t.optimizer])
        if t.ctx.device.type == "cuda":
            return CudaAllocatorProbe(modules, optimizers, t.ctx.device)
        par = t.plan.config.parallelism
        split_backward = t.ctx.degrees["pp"] > 1 and par.pp_schedule in ("interleaved_zb", "zbv")
        return MemTrackerProbe(modules, optimizers, module_hooks=not split_backward)

    def is_measured(self, step: int) -> bool:
        return step == self.at

    @contextlib.contextmanager
    def step(self, step: int):
        """Around trainer.train_step(step): measures the chosen step, passes the others."""
        if step != self.at:
            yield
            return
        backend = self._backend()
        with allocator.build_threshold(), backend.measure():
            yield
        peak = float(backend.result["peak"])
        world_max = peak
        if dist.is_initialized() and self.trainer.ctx.world_size > 1:
            t = torch.tensor([peak], dtype=torch.float64, device=self.trainer.ctx.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            world_max = float(t.item())
        self.measured = {"by": backend.name, "peak": peak, "max_over_ranks": world_max,
                         "breakdown": backend.result["breakdown"]}
        self.trainer.log.info("memory: measured peak %.4f GiB (%s), max over ranks %.4f GiB, predicted %s GiB",
                              peak / GIB, backend.name, world_max / GIB,
                              None if self.stage is None else round(predicted_tensor_bytes(self.stage) / GIB, 4))

    # -- what goes into metrics.jsonl / summary.json ----------------------------------------
    def predicted(self) -> dict:
        if self.stage is None:
            return {}
        s = self.stage
        # the probe's "activations" holds the logits and autocast's weight copies too
        acts = float(s.activations) + float(s.logits) + float(s.copies)
        return {"memory_predicted_gib": predicted_tensor_bytes(s) / GIB,
                "memory_predicted_total_gib": float(s.total) / GIB,
                "memory_predicted_breakdown_gib": {
                    "params": (float(s.parameters) + float(s.gathered)) / GIB,
                    "grads": float(s.gradients) / GIB, "optimizer": float(s.optimizer) / GIB,
                    "activations": acts / GIB, "comm_buffers": float(s.comm_buffers) / GIB}}

    def record(self, step: int) -> dict:
        """Fields for the metrics record of `step` (every logged step: the predicted step time;
        the measured step: the memory, measured and predicted)."""
        out = {} if self.step_predicted is None else {"step_time_predicted_s": float(self.step_predicted)}
        if step != self.at or self.measured is None:
            return out
        m = self.measured
        out.update({"memory_measured_gib": m["peak"] / GIB, "memory_measured_max_gib": m["max_over_ranks"] / GIB,
                    "memory_measured_by": m["by"],
                    "memory_measured_breakdown_gib": {k: v / GIB for k, v in m["breakdown"].items()}})
        out.update(self.predicted())
        if "memory_predicted_gib" in out:
            measured = out["memory_measured_gib"]
            out["memory_error"] = (out["memory_predicted_gib"] - measured) / measured
        return out

    def summary(self, history: list[dict]) -> dict:
        """Measured (max over ranks) vs predicted peak, and the measured step time (median of the
        logged steps other than the first and the measured one) vs the predicted one."""
        out: dict[str, Any] = {}
        if self.measured is not None:
            out["memory_measured_peak_gib"] = self.measured["max_over_ranks"] / GIB
            out["memory_measured_by"] = self.measured["by"]
            memory = self.trainer.plan.memory
            if memory is not None:
                out["memory_predicted_peak_gib"] = max(predicted_tensor_bytes(s) for s in memory.stages) / GIB
                out["memory_predicted_peak_total_gib"] = float(memory.peak_gib)
        times = [r["step_time_s"] for r in history if r["step"] not in (1, self.at + 1)] or \
            [r["step_time_s"] for r in history]
        if times:
            out["step_time_measured_s"] = statistics.median(times)
        if self.step_predicted is not None:
            out["step_time_predicted_s"] = float(self.step_predicted)
        return out
