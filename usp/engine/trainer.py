"""The training loop: micro batches with gradient accumulation (no gradient sync on inner
micro batches), or a pipeline schedule; clipping, AdamW + schedule, periodic validation,
metrics (usp/engine/observe/), the optional profiler, final summary. The model and its
parallel wrappers come from usp/engine/parallel/build.py, the pipeline step from
usp/engine/parallel/pipeline.py."""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from usp.contract.run_plan import RunPlan
from usp.data.blend import make_sampler
from usp.data.sampler import EvalBatches, TokenFile, get_batch
from usp.data.tokenized import plan_data_meta
from usp.data.tokens import meta_dtype
from usp.engine import signals
from usp.engine.accel import autocast_context
from usp.engine.checkpoint import Checkpointer
from usp.engine.grad_norm import clip_grad_norm
from usp.engine.loss import training_loss
from usp.engine.observe.console import Console, rank_logger
from usp.engine.observe.memory_probe import GIB, MemoryProbe
from usp.engine.observe.profiler import StepProfiler
from usp.engine.observe.tracking import build_trackers
from usp.engine.observe.watch import RankWatch
from usp.engine.optim import build_optimizer, build_scheduler
from usp.engine.parallel.build import build_model
from usp.engine.parallel.data import gradient_sync
from usp.engine.parallel.expert import expert_clip_args
from usp.engine.parallel.mesh import DistContext, all_reduce_mean
from usp.engine.parallel.tied import sum_tied_grads
from usp.errors import UspError
from usp.run import allocator
from usp.run.files import (
    ATTEMPT_EVENT,
    HANG_STOP,
    SPAN_BACKWARD,
    SPAN_FORWARD,
    SPAN_OPTIMIZER,
    SPAN_PIPELINE,
    SUMMARY,
    append_event,
    step_dir_name,
    write_text_atomic,
)


class Trainer:
    def __init__(self, plan: RunPlan, ctx: DistContext, write_outputs: bool = True):
        building = time.perf_counter()
        self.plan, self.ctx = plan, ctx
        self.cfg = plan.config
        self.run_dir = Path(plan.run_dir)
        self.log = rank_logger(self.run_dir, ctx.rank)
        train, batch = self.cfg.train, plan.batch
        self.steps, self.seq_len = int(train.steps), int(batch.seq_len)
        self.micro, self.accum = int(batch.micro_batch), int(batch.grad_accum)
        self.global_tokens = int(batch.global_batch) * self.seq_len
        self.autocast = autocast_context(plan, ctx.device)  # bf16 on GPU: autocast, or FSDP2's policy
        deg = ctx.degrees
        self.cp, self.cp_rank = deg["cp"], ctx.coords["cp"]
        self.loss_parallel = deg["tp"] > 1
        self._loss = training_loss(plan)  # compiled with the blocks (usp/engine/loss.py)

        self._open_data(plan, ctx)
        self.parts = build_model(plan, ctx)
        self.raw_model = self.parts.raw
        self.experts = expert_clip_args(self.parts.modules, ctx, int(self.cfg.parallelism.ep))
        self.moe = plan.decisions.moe
        self.step_load: dict = {}  # MoE: the last step's tokens per expert of this rank's layers
        # One optimizer (and LR schedule) per model part: pipeline ranks may hold several stages,
        # and checkpoints map each optimizer's state to its part's parameter names.
        # plain-DDP ZeRO-1 (ZeroRedundancyOptimizer); with TP/PP, FSDP2 already shards the states
        zero1 = ctx.group("dp_replicate") if plan.decisions.dp_kind == "zero1" else None
        settings = plan.decisions.optimizer
        self.optimizers = [build_optimizer(list(m.parameters()), settings, ctx.device, zero1_group=zero1)
                           for m in self.parts.modules]
        self.schedulers = [build_scheduler(o, settings) for o in self.optimizers]
        self.scheduler = self.schedulers[0]
        self.checkpointer = Checkpointer(plan, ctx, self.parts, self.optimizers, self.schedulers, self.sampler,
                                         self.log)
        loading = time.perf_counter()
        self.start_step = self.checkpointer.resume()
        # this launch's start-up phases, logged with its first step (ATTEMPT_EVENT; the worker adds its own)
        self.startup: dict = {"build_s": loading - building, "load_s": time.perf_counter() - loading,
                              "loaded_bytes": self.checkpointer.resumed_bytes}
        self.last_completed_step = self.start_step
        self.console = Console(self.cfg.logging.console, self.steps, enabled=ctx.is_main, start_step=self.start_step)
        # metrics.jsonl (+ W&B, TensorBoard): rank 0 only
        self.trackers = build_trackers(plan, self.run_dir, self.start_step, warn=self.warn) \
            if ctx.is_main and write_outputs else None
        if self.trackers is not None:
            self.startup["previous_progress"] = self.trackers.jsonl.previous_progress
        if allocator.enter_training():  # built and loaded: a step's buffers reused, not mapped again each step
            self.log.info("glibc mmap threshold %s B while training (%s B while building)",
                          os.environ[allocator.TRAIN_ENV], os.environ.get(allocator.GLIBC_ENV))
        self.probe = MemoryProbe.create(self)  # None unless train.measure_memory
        self.profiler = StepProfiler.create(self) if write_outputs else None  # None unless profile.enabled
        self.data_wait_s = 0.0  # time spent getting this step's batches (reading tokens, copying to device)
        restarts = os.environ.get("SLURM_RESTART_COUNT")  # set by Slurm on a requeued job
        self.slurm_restart_count = int(restarts) if restarts and restarts.isdigit() else None
        # Hangs and stragglers (docs/hangs.md): evaluations and checkpoints get their own allowance
        self.watch = RankWatch.create(self)
        self.evaluate = self.watch.allow("eval", self.evaluate)  # type: ignore[method-assign]
        self.checkpointer.save = self.watch.allow("checkpoint", self.checkpointer.save)  # type: ignore[method-assign]

    def _open_data(self, plan: RunPlan, ctx: DistContext) -> None:
        """The token files, this data-parallel rank's sampler and the validation batches."""
        train, batch = self.cfg.train, plan.batch
        dataset, self.meta = Path(plan.dataset_dir), plan_data_meta(plan)  # a saved plan: the prepared data's
        dtype = meta_dtype(self.meta)  # uint16 for datasets prepared before the dtype was recorded
        self.train_tokens = TokenFile(dataset / self.meta["train_bin"], dtype,  # absolute for token_files
                                      self.meta.get("n_train_tokens"), "data.train_bin")
        self.val_tokens = TokenFile(dataset / self.meta["val_bin"], dtype, self.meta.get("n_val_tokens"),
                                    "data.val_bin")
        self.sampler = make_sampler(self.meta, self.seq_len, int(batch.global_batch), self.micro,  # or a blend
                                    ctx.dp_rank, ctx.dp_size, int(train.seed))
        # Validation uses global-batch-sized batches so every layout evaluates the same sequences.
        self.eval_batches = EvalBatches(len(self.val_tokens), self.seq_len, int(batch.global_batch),
                                        int(train.eval_batches), ctx.dp_rank, ctx.dp_size)

    # -- one optimizer step ------------------------------------------------------------
    def train_step(self, step: int) -> tuple[float, float]:
        for m in self.parts.modules:
            m.train()
        if self.parts.schedule is not None:
            loss = self._pipeline_step(step)
        else:
            loss = self._accumulate(step)
        loss = all_reduce_mean(loss, self.ctx)
        if not math.isfinite(loss):
            return self._non_finite(step, loss, what="loss", value=loss)
        tied = self.parts.tied  # tied embeddings over pipeline stages: sum the two copies' gradients
        if tied is not None:
            sum_tied_grads(tied)
        clip = float(self.cfg.optimizer.grad_clip)
        with self._region(SPAN_OPTIMIZER):
            grad_norm = clip_grad_norm(list(self.parts.parameters()), clip, self.ctx.group("pp"), *self.experts,
                                       duplicate=tied.head_copy if tied is not None else None)
            if not math.isfinite(grad_norm):  # the update would poison the weights: same policy as a bad loss
                return self._non_finite(step, loss, what="gradient norm", value=grad_norm)
            self._optimizer_step()
            self._finish_moe_step()
        return loss, grad_norm

    def _finish_moe_step(self, update_bias: bool = True) -> None:
        """MoE: the step's tokens per expert (for the metrics) and the aux-loss-free bias update."""
        if self.moe:
            from usp.engine.parallel.balance import finish_step

            self.step_load = finish_step(self.parts.modules, update_bias)

    def _optimizer_step(self, apply: bool = True) -> None:
        with self.watch.optimizer_section():  # a straggler's own work (usp/engine/observe/stragglers.py)
            for optimizer, scheduler in zip(self.optimizers, self.schedulers):
                if apply:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()


    def _non_finite(self, step: int, loss: float, what: str, value: float) -> tuple[float, float]:
        """NaN/inf loss or gradient norm (the same on every rank: both are reduced over all
        ranks), found before the optimizer step. train.nan_policy=skip drops the step; stop keeps
        the weights of the last good step, checkpoints them and stops."""
        message = f"non-finite {what} {value} at step {step + 1}"
        if self.cfg.train.nan_policy == "skip":  # else stop: the field rules allow no other (usp.plan.rules)
            self.log.info("%s: step skipped (train.nan_policy=skip)", message)
            self.console.print(f"usp: {message}: step skipped")
            self._optimizer_step(apply=False)
            self._finish_moe_step(update_bias=False)
            return loss, float("nan")
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.checkpointer.save(self.last_completed_step, blocking=True, retain=False)
        resumed = self.checkpointer.resumed_from
        first = (f"first check the checkpoint this run resumed from ({resumed.name}, step {self.start_step}, "
                 f"{step + 1 - self.start_step} step(s) before): `usp checkpoints verify {self.run_dir}`; then "
                 if resumed is not None else "")
        raise NonFiniteLoss(f"{message}; stopped with a checkpoint of step {self.last_completed_step} "
                            "(train.nan_policy=stop); no checkpoint was deleted",
                            fix=f"{first}lower optimizer.lr, or train.nan_policy=skip")

    def _accumulate(self, step: int) -> torch.Tensor:
        """Mean loss of this rank's micro batches (before the all-reduce over data-parallel ranks),
        still on the device: all_reduce_mean reads it once."""
        model, total = self.parts.modules[0], 0.0
        micro_batches = self.sampler.micro_batches(step)
        # Summed on the device: a .item() per micro batch would stall the GPU's queue.
        for i, starts in enumerate(micro_batches):
            x, y, positions = self._batch(self.train_tokens, starts)
            # all-reduce / reduce-scatter gradients only after the last micro batch of the step
            with gradient_sync(model, i == len(micro_batches) - 1), self._loss_context():
                with self.autocast, self._region(SPAN_FORWARD):
                    loss = self._loss(model(x, positions), y)
                with self._region(SPAN_BACKWARD):  # a MoE layer's aux loss joins through its output
                    (loss / self.accum).backward()
            total = total + loss.detach().to(torch.float64)
            allocator.release_free_pages()
        return total / len(micro_batches)

    def _pipeline_step(self, step: int) -> float:
        from usp.engine.parallel.pipeline import pipeline_step  # only pipelined runs pay its import (build.py)

        starts = [s for mb in self.sampler.micro_batches(step) for s in mb]  # the rank's whole batch
        x, y, _ = self._batch(self.train_tokens, starts)
        with self._loss_context(), self.autocast, self._region(SPAN_PIPELINE):
            return pipeline_step(self.parts, self.ctx, x, y)

    @torch.no_grad()
    def evaluate(self) -> float:
        for m in self.parts.modules:
            m.eval()
        losses = []
        for rank_starts in self.eval_batches:
            if self.parts.schedule is not None:
                from usp.engine.parallel.pipeline import pipeline_eval

                x, y, _ = self._batch(self.val_tokens, rank_starts)
                with self._loss_context(), self.autocast:
                    losses.append(pipeline_eval(self.parts, self.ctx, x, y))
                continue
            for first in range(0, len(rank_starts), self.micro):  # micro-batch sized forwards
                x, y, positions = self._batch(self.val_tokens, rank_starts[first:first + self.micro])
                with self._loss_context(), self.autocast:
                    losses.append(_item(self._loss(self.parts.modules[0](x, positions), y)))
        return all_reduce_mean(sum(losses) / max(1, len(losses)), self.ctx)

    # -- the loop ----------------------------------------------------------------------
    def fit(self) -> dict | None:
        """Train from start_step to train.steps; returns the summary (rank 0 also writes summary.json),
        or None when the checkpoint resumed is at train.steps already (nothing trained or rewritten)."""
        self.log.info("start: %d steps, %d tokens/step, world %d, device %s, layout %s", self.steps,
                      self.global_tokens, self.ctx.world_size, self.ctx.device, self.ctx.degrees)
        started = time.perf_counter()
        loss, val_loss, first_loss, self.history = float("nan"), None, None, []
        if self.start_step >= self.steps:  # `usp train` says so before launch; torchrun by hand gets here
            self.log.info("nothing to do: resumed at step %d of %d", self.start_step, self.steps)
            self.console.print(f"usp: already at step {self.start_step} >= train.steps={self.steps}: nothing to do")
            self._close_outputs()
            return None
        try:
            for step in range(self.start_step, self.steps):
                self.watch.step(step)
                self._stop_if_signalled(step)
                loss, val_loss = self._fit_step(step, started)
                if first_loss is None:
                    first_loss = loss
                    self._log_attempt(time.perf_counter() - started)
            self.checkpointer.save(self.steps, blocking=True)
        finally:
            self.watch.close()
            self._close_outputs()
        return self._summary(time.perf_counter() - started, first_loss, loss, val_loss)

    def _fit_step(self, step: int, started: float) -> tuple[float, float | None]:
        """One optimizer step, then validation, logging and checkpointing as due: (loss, val loss)."""
        t0, self.data_wait_s = time.perf_counter(), 0.0
        with self.probe.step(step) if self.probe else contextlib.nullcontext(), \
                self.profiler.step(step) if self.profiler else contextlib.nullcontext():
            loss, grad_norm = self.train_step(step)
        self.watch.step_applied(step + 1)
        dt, data_wait = time.perf_counter() - t0, self.data_wait_s
        self.watch.step_done(data_wait)
        done, train = step + 1, self.cfg.train
        is_eval = done == self.steps or (train.eval_interval and done % train.eval_interval == 0)
        val_loss = self.evaluate() if is_eval else None
        record = None
        measured = self.probe is not None and self.probe.is_measured(step)
        if is_eval or done == 1 or done % max(1, train.log_interval) == 0 or measured:
            record = {"step": done, "loss": loss, "val_loss": val_loss,
                      "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                      "tokens": done * self.global_tokens, "step_time_s": dt,
                      "tokens_per_s": self.global_tokens / dt,
                      "tokens_per_s_per_device": self.global_tokens / dt / self.ctx.world_size,
                      "elapsed_s": time.perf_counter() - started, "time": time.time(),
                      **self._performance(dt, data_wait),
                      **self._expert_load(), **self.watch.record(done)}
            self._log_record(step, record)
        self.console.step(done, record)
        self.last_completed_step = done
        if self.checkpointer.due(done):
            self.checkpointer.save(done)
        return loss, val_loss

    def _log_attempt(self, first_step_s: float) -> None:
        """Rank 0: this launch's start-up phases and its first step, in logs/events.jsonl."""
        if self.ctx.is_main:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or "0"
            append_event(self.run_dir, ATTEMPT_EVENT, attempt=int(attempt), resumed_from_step=self.start_step,
                         first_step_s=first_step_s, **self.startup)

    def _log_record(self, step: int, record: dict) -> None:
        """A logged step: the memory probe's fields, the history, the rank log, the trackers."""
        if self.probe:
            record.update(self.probe.record(step))
        self.history.append(record)
        self.log.info("step %d loss %.6f val %s lr %.3e gnorm %.4f", record["step"], record["loss"],
                      record["val_loss"], record["lr"], record["grad_norm"])
        if self.trackers:
            self.trackers.log(record["step"], record)

    def _close_outputs(self) -> None:
        """The profiler, the console and the trackers; also after an error or a stop signal."""
        if self.profiler:
            self.profiler.stop()
        self.console.close()
        if self.trackers:
            self.trackers.close()

    def _summary(self, elapsed: float, first_loss: float | None, loss: float, val_loss: float | None) -> dict:
        ran = self.steps - self.start_step  # a resumed attempt's speed counts only its own steps
        summary = {"steps": self.steps, "tokens": self.steps * self.global_tokens, "time_s": elapsed,
                   "tokens_per_s": ran * self.global_tokens / elapsed if ran > 0 else None,
                   "resumed_from_step": self.start_step, "first_loss": first_loss,
                   "final_loss": loss, "final_val_loss": val_loss, "world_size": self.ctx.world_size}
        if self.probe:
            summary.update(self.probe.summary(self.history))
        summary = finite_or_null(summary)
        self.log.info("done: %s", json.dumps(summary))
        if self.trackers:
            write_text_atomic(self.run_dir / SUMMARY, json.dumps(summary, indent=2, allow_nan=False) + "\n")
        return summary

    def _stop_if_signalled(self, step: int) -> None:
        """At a step boundary: when any rank got a stop signal (usp/engine/signals.py), every rank
        writes a checkpoint of the steps done so far and raises Stopped. A signal may reach the
        ranks at different steps, so they agree first (max over all ranks): every rank stops
        before the same step. Nothing is saved before the first step of this launch: the
        checkpoint it resumed from (if any) holds that state already."""
        flag = torch.tensor([float(signals.requested())], device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signals.reached_a_boundary()  # a stop from here on waits for a step boundary, however long
        signum = int(flag.item())
        if not signum:
            return
        if step > self.start_step:
            self.checkpointer.save(step, blocking=True)
        raise Stopped(step, signals.signal_name(signum), self._saved_text(step))

    def _saved_text(self, step: int) -> str | None:
        """Where the state after `step` is kept, for the stop message (None: nowhere)."""
        if step > self.start_step and self.checkpointer.last_saved == step:
            return f"a checkpoint ({self.checkpointer.dir / step_dir_name(step)})"
        if step == self.start_step and step > 0:
            return f"the checkpoint it resumed from (step {step})"
        return None

    # -- helpers -----------------------------------------------------------------------
    def _performance(self, dt: float, data_wait: float) -> dict:
        """Measured MFU (the plan's model FLOPs per step over the step time and the cluster's peak:
        cluster.peak_tflops_*, a placeholder on CPU), peak device memory since the last record (max
        over ranks; CUDA/XPU allocator), data-loader wait, and the Slurm requeue count."""
        out = {"data_wait_s": data_wait}
        timing = self.plan.timing
        if timing is not None and timing.peak_tflops:
            flops = timing.model_flops_per_step or self.plan.model.flops_per_step
            out["mfu"] = flops / (dt * self.ctx.world_size * timing.peak_tflops * 1e12)
        accel = getattr(torch, self.ctx.device.type, None) if self.ctx.device.type in ("cuda", "xpu") else None
        if accel is not None:
            peak = torch.tensor([float(accel.max_memory_allocated(self.ctx.device))], device=self.ctx.device)
            if self.ctx.world_size > 1:  # every rank logs the same steps, so this collective matches up
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out["memory_peak_gib"] = peak.item() / GIB
            accel.reset_peak_memory_stats(self.ctx.device)
        if self.slurm_restart_count is not None:
            out["slurm_restart_count"] = self.slurm_restart_count
        return out

    def _expert_load(self) -> dict:
        """MoE: {"expert_load": {layer: tokens per expert min / max / mean, imbalance}} of the
        step just taken (every rank calls it: pipeline ranks gather their layers)."""
        if not self.moe:
            return {}
        from usp.engine.parallel.balance import expert_load

        load = expert_load(self.step_load, self.ctx, int(self.cfg.model.n_layers), int(self.cfg.model.n_experts))
        return {"expert_load": load} if load else {}

    def warn(self, message: str) -> None:
        """A warning for the user: rank log and rank 0's console."""
        self.log.warning("%s", message)
        self.console.print(f"usp: warning: {message}")

    def _region(self, name: str):
        """A named span in the profiler trace (nothing when not profiling)."""
        return self.profiler.region(name) if self.profiler else contextlib.nullcontext()

    def _batch(self, tokens: TokenFile, starts):
        """Inputs, targets and RoPE positions of this rank's tokens (its zigzag shard under CP)."""
        t0 = time.perf_counter()
        x, y = get_batch(tokens, starts, self.seq_len)
        x, y = torch.from_numpy(x).to(self.ctx.device), torch.from_numpy(y).to(self.ctx.device)
        self.data_wait_s += time.perf_counter() - t0
        if self.cp == 1:
            return x, y, None
        from usp.engine.parallel.context_parallel import zigzag_indices

        idx = zigzag_indices(self.seq_len, self.cp, self.cp_rank).to(self.ctx.device)
        return x[:, idx], y[:, idx], idx

    def _loss_context(self):
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()  # cross entropy on vocab-sharded logits; must wrap backward too


class Stopped(Exception):
    """Every rank stopped at a step boundary on a stop signal (usp/engine/signals.py); `kept_in`:
    the checkpoint that holds the state after `step` (written now, or the one this launch resumed
    from), None if there is none."""

    def __init__(self, step: int, signal: str, kept_in: str | None):
        self.step, self.signal, self.saved = step, signal, kept_in is not None
        if signal == HANG_STOP:
            signal = "the hang watchdog (a stall that cleared, docs/hangs.md)"
        if kept_in:
            what = f"after step {step}, kept in {kept_in}; the same command resumes from it"
        elif step == 0:
            what = "before the first step: nothing to save; the same command starts the run"
        else:
            what = f"after step {step} without a checkpoint (checkpoint.enabled=false): the same command starts over"
        super().__init__(f"stopped by {signal} {what}")


class NonFiniteLoss(UspError):
    """train.nan_policy=stop met a NaN/inf: one message and its fix, never a traceback."""


def finite_or_null(summary: dict) -> dict:
    """JSON has no NaN or Infinity: a non-finite value (the loss of a skipped step) becomes null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}


def _item(loss) -> float:
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

