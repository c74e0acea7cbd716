"""Checkpoints with torch.distributed.checkpoint (DCP): save, publish atomically, resume.

A checkpoint is <dir>/step_<N:08d>/: the DCP files of {"model", "optim"} (FQN keys, the
optimizer state flattened by FQN too, so a checkpoint loads under any other layout: DCP
reshards), one rng_rank<R>.pt per rank, and from rank 0 trainer_state.json (step, LR
schedule, data position), plan.yaml (the layout it was saved under) and manifest.json
(every file with its size and checksum, usp/run/checksums.py) written last. It is written under
.tmp-step_<N> and renamed into place once complete, so a reader never sees half a checkpoint; a
checkpoint whose files don't match its manifest (truncated, missing, other bytes) is skipped with a
message, and the previous one used, before any tensor is read. A load that fails all the same
(whatever the exception class: DCP's CheckpointException is a BaseException) is classified: corrupt
or missing falls back to the previous checkpoint; a shape or architecture mismatch stops with
CheckpointLoadError naming the fixes (`usp train` refuses that case before launch:
usp.launch.checkpoints.check_resume)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from usp.contract.dims import describe
from usp.contract.run_plan import RunPlan
from usp.engine.checkpoint_tensors import MetadataOnce
from usp.engine.diskfull import disk_full_error, is_disk_full
from usp.engine.parallel.expert import global_expert_state
from usp.engine.parallel.tied import canonical_state, head_copy_state, is_head_copy
from usp.engine.rope_upgrade import LAYOUT_KEY, checkpoint_rope_layout, upgrade_rope_rows
from usp.errors import UspError
from usp.models.rope_layout import ROPE_LAYOUT
from usp.run import checksums
from usp.run.files import (
    CHECKPOINT_EVENT,
    MANIFEST,
    PLAN,
    TRAINER_STATE,
    append_event,
    check_manifest,
    list_checkpoints,
    plan_path,
    step_dir_name,
    write_text_atomic,
)

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def own_partition(optimizer):
    """The optimizer whose state this rank saves and loads: plain-DDP ZeRO-1's ZeroRedundancyOptimizer
    holds its states in a local optimizer over this rank's partition of the parameters, and its own
    state_dict() needs them consolidated on one rank first (a whole copy there). Saved by FQN (the
    flattened optimizer state dict), the ranks' partitions are disjoint keys of one checkpoint, which
    loads under any partition (another dp degree, another layout)."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


@contextlib.contextmanager
def groups_with_parameters(optimizer):
    """`optimizer` with only its param groups that hold parameters, while a state dict is loaded into
    it: torch's set_state_dict reads each group's first parameter (pytorch/pytorch#143828), and a
    ZeRO-1 partition can hold none of a group's (the no-decay group's few small norm weights, all on
    another rank). The empty groups come back in place afterwards: ZeroRedundancyOptimizer pairs its
    groups with its local optimizer's by position."""
    groups = optimizer.param_groups
    if all(g["params"] for g in groups):
        yield optimizer
        return
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield optimizer
    finally:
        loaded = iter(optimizer.param_groups)  # load_state_dict replaced them with the loaded groups
        optimizer.param_groups = [next(loaded) if g["params"] else g for g in groups]


@contextlib.contextmanager
def single_process_is_intended():
    """DCP warns on every save and load without a process group ("torch.distributed is disabled,
    unavailable or uninitialized, assuming the intent is to save in a single process"): one rank
    runs without one on purpose, so that warning only is kept off the console."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class Checkpointer:
    def __init__(self, plan: RunPlan, ctx, parts, optimizers: list, schedulers: list, sampler, log):
        cfg = plan.config.checkpoint
        self.plan, self.ctx, self.parts, self.optimizers = plan, ctx, parts, optimizers
        self.schedulers, self.sampler, self.log = schedulers, sampler, log
        self.enabled, self.interval = bool(cfg.enabled), int(cfg.interval)
        self.keep_last, self.async_mode, self.resume_mode = int(cfg.keep_last), str(cfg.async_mode), str(cfg.resume)
        self.dir = Path(plan.decisions.checkpoint_dir)
        self.last_saved: int | None = None
        self._pending = None  # (future, tmp dir, step) of an async save
        self.retain = True  # False once a save must delete nothing (a non-finite loss's stop)
        self.resumed_from: Path | None = None
        self._blocked_s = 0.0  # how long the last save() stopped training (an async save's write is later)
        self._published: tuple = ()  # rank 0: (bytes, seconds in all, checksum seconds) of the last publish
        self.tie = bool(plan.config.model.tie_embeddings)
        self.ep = plan.parallel.ep
        self._async_group = self._background_group()

    def _background_group(self):
        """An async save's collectives (DCP's plan exchange) run in a background thread while
        training goes on: on a process group of their own (as torchtitan), because a mesh dim that
        spans every rank reuses the default group, and two threads' collectives on one gloo group
        mix their messages (measured: 'Received data size doesn't match expected size', an abort at
        the first async save of any 2-rank FSDP run). Every rank creates it, here (a collective)."""
        if self.async_mode != "async" or not (self.enabled and dist.is_initialized() and dist.get_world_size() > 1):
            return None
        return dist.new_group(backend="gloo")

    # -- what goes in ------------------------------------------------------------------
    def _state(self) -> dict:
        """{"model", "optim"} of every part, by FQN; a tied embedding stored once (under
        tok_embeddings.weight: parallel/tied.py), so every layout saves and loads the same keys."""
        model, optim = {}, {}
        for module, optimizer in zip(self.parts.modules, self.optimizers):
            m, o = canonical_state(*get_state_dict(module, own_partition(optimizer), options=OPTIONS), self.tie)
            model.update(m)
            optim.update(o)
        return {"model": model, "optim": optim}

    def _saved_state(self, state: dict) -> dict:
        """`state` as DCP stores it: expert-parallel weights as the whole tensors they are slices
        of (parallel/expert.py: global_expert_state), sharing the model's storage."""
        return global_expert_state(state, self.ctx, self.ep)

    # -- save ----------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.enabled and self.interval > 0 and step % self.interval == 0

    def save(self, step: int, blocking: bool = False, retain: bool = True) -> None:
        """Save `step`; blocking=True also finishes (publishes) any async save in flight.
        retain=False deletes no older checkpoint (a stop for a non-finite loss)."""
        self.retain = self.retain and retain
        if not self.enabled:
            return
        if self.last_saved == step:  # already saved, maybe still being written in the background
            if blocking:
                self.wait()
            return
        entered = time.perf_counter()
        self.wait()
        tmp = self.dir / f".tmp-{step_dir_name(step)}"
        with self._disk_full_says_so(tmp, step):
            if self.ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            self._barrier()
            torch.save(torch.get_rng_state(), tmp / f"rng_rank{self.ctx.rank}.pt")
            if self.ctx.is_main:  # now, as the tensors: an async save publishes a step or more later
                self._write_trainer_state(tmp, step)
                if plan_path(self.plan.run_dir).exists():
                    shutil.copyfile(plan_path(self.plan.run_dir), tmp / PLAN)
            started = time.perf_counter()
            if self.async_mode == "async" and not blocking:
                with single_process_is_intended():
                    self._pending = (dcp.async_save(self._saved_state(self._state()), checkpoint_id=str(tmp),
                                                    process_group=self._async_group), tmp, step, started)
            else:
                with single_process_is_intended():
                    dcp.save(self._saved_state(self._state()), checkpoint_id=str(tmp))
                self._publish(tmp, step, started)
        self.last_saved = step
        self._blocked_s = time.perf_counter() - entered
        if self._pending is None:
            self._record(step)

    def wait(self) -> None:
        """Finish a pending async save (its files, then the atomic publish)."""
        if self._pending is not None:
            future, tmp, step, started = self._pending
            self._pending = None
            with self._disk_full_says_so(tmp, step):
                future.result()
                self._publish(tmp, step, started)
            self._record(step)

    @contextlib.contextmanager
    def _disk_full_says_so(self, tmp: Path, step: int):
        """A full disk during a save: remove the partial checkpoint (its space lets the failure record
        be written; the previous checkpoint stays) and raise one clear DiskFullError naming the path.
        DCP reports a rank's ENOSPC inside a CheckpointException, which is not an Exception."""
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) or not is_disk_full(exc, tmp):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_full_error(f"writing checkpoint step {step} to", self.dir, key="checkpoint.dir",
                                  value=self.plan.config.checkpoint.dir,
                                  fix="free up space there, or checkpoint.dir=<a disk with room> / "
                                      "checkpoint.keep_last=1; then run the same command: it resumes from "
                                      "the last complete checkpoint") from None

    def _publish(self, tmp: Path, step: int, started: float) -> None:
        """Every rank's files are written: each rank hashes the files it wrote, rank 0 writes the
        manifest (sizes and checksums) last and renames the checkpoint into place."""
        self._barrier()
        hashed = time.perf_counter()
        world, rank = self.ctx.world_size, self.ctx.rank
        mine = [p.name for p in tmp.iterdir() if p.is_file() and checksums.owner(p.name, world) == rank]
        sums = self._gather(checksums.digests(tmp, mine))
        hashed = time.perf_counter() - hashed
        if self.ctx.is_main:
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            merged = dict(sorted((name, digest) for part in sums for name, digest in part.items()))
            write_text_atomic(tmp / MANIFEST, json.dumps(checksums.manifest(step, files, merged), indent=1))
            final = self.dir / step_dir_name(step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            if self.retain:
                self._retain()
            self._published = (sum(files.values()), time.perf_counter() - started, hashed)
            self.log.info("checkpoint step %d saved to %s in %.2f s (checksums %.2f s)", step, final,
                          self._published[1], hashed)
        self._barrier()

    def alone_why_not(self) -> str | None:
        """Why no live rank can save without its peers (None: it can). Under plain DDP every rank holds
        the whole model and optimizer state, so one rank's copy is the checkpoint; a sharded layout
        (FSDP, ZeRO-1, TP, PP, experts) needs every rank's part (docs/hangs.md)."""
        if not self.enabled:
            return "checkpoint.enabled=false"
        if self.plan.fault_tolerance is not None:
            return "under torchft a live replica group saves the checkpoints"
        kind = self.plan.decisions.dp_kind
        if kind != "ddp":
            return f"the state is sharded ({kind}: each rank holds a part of it), so a checkpoint needs every rank"
        return None

    def save_alone(self, step: int) -> Path:
        """Save the state after `step` from this rank alone, with no collective (a peer is stuck: the
        hang watchdog's thread calls this while the training loop waits in a collective). Only where
        alone_why_not() is None. The same files, manifest and checksums as save() writes, but one DCP
        shard (`__0_0.distcp`, no_dist) and this rank's RNG only; a resume reads it as any other."""
        final = self.dir / step_dir_name(step)
        if final.is_dir() and check_manifest(final) is None:
            return final  # published before the stall (the loop stalled in the save's last barrier)
        tmp = self.dir / f".tmp-{step_dir_name(step)}.alone"  # not the save in flight's directory
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(torch.get_rng_state(), tmp / f"rng_rank{self.ctx.rank}.pt")
        self._write_trainer_state(tmp, step)
        if plan_path(self.plan.run_dir).exists():
            shutil.copyfile(plan_path(self.plan.run_dir), tmp / PLAN)
        with single_process_is_intended():
            dcp.save(self._saved_state(self._state()), checkpoint_id=str(tmp), no_dist=True)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        write_text_atomic(tmp / MANIFEST, json.dumps(checksums.manifest(step, files, checksums.digests(tmp, files)),
                                                     indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        if self.retain:
            self._retain()
        self.log.info("checkpoint step %d saved by rank %d alone to %s", step, self.ctx.rank, final)
        return final

    def _record(self, step: int) -> None:
        """Rank 0: the published save in logs/events.jsonl (the goodput model's save cost)."""
        if self.ctx.is_main and self._published:
            size, total, hashed = self._published
            append_event(self.plan.run_dir, CHECKPOINT_EVENT, step=step, bytes=size, blocking_s=self._blocked_s,
                         total_s=total, checksums_s=hashed, mode=self.async_mode)

    @property
    def resumed_bytes(self) -> int:
        """Bytes of the checkpoint this launch resumed from, every rank's files (0: none)."""
        if self.resumed_from is None:
            return 0
        return sum(p.stat().st_size for p in self.resumed_from.iterdir() if p.is_file())

    def _gather(self, value) -> list:
        """`value` of every rank, in rank order (every rank gets the list)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [value]
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out

    def _write_trainer_state(self, tmp: Path, step: int) -> None:
        """The step's LR schedule and data position, written when the save starts: an async save is
        published at the next save or at the end, after the scheduler has moved on (measured: a
        checkpoint of step 4 saved async every 2 steps recorded step 6's schedule, and a run resumed
        from it trained at another learning rate)."""
        state = {"step": step, "scheduler": self.schedulers[0].state_dict(), "sampler": self.sampler.state_dict(),
                 "world_size": self.ctx.world_size, "degrees": self.ctx.degrees, "time": time.time(),
                 LAYOUT_KEY: ROPE_LAYOUT}  # the q/k row order (usp/models/rope_layout.py)
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1))

    def _retain(self) -> None:
        for path in checksums.retired(list_checkpoints(self.dir), self.keep_last):
            shutil.rmtree(path, ignore_errors=True)

    # -- resume --------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the checkpoint that checkpoint.resume asks for; return the step to start at."""
        if not self.enabled or self.resume_mode == "never":
            return 0
        if self.resume_mode == "auto":
            return self._resume_newest_good()
        path = Path(self.resume_mode).expanduser()
        entry = [c for c in list_checkpoints(path.parent) if c[1].resolve() == path.resolve()]
        if not entry or not entry[0][2]:
            raise CheckpointLoadError(path, MISSING, f"checkpoint.resume={self.resume_mode!r} is not a complete "
                                      f"checkpoint ({entry[0][3] if entry else 'no manifest.json'})")
        damaged = self._verify(path)
        if damaged:
            raise CheckpointLoadError(path, DAMAGED, "; ".join(damaged))
        try:
            return self._load(path)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            raise CheckpointLoadError(path, *classify_load_error(exc)) from None

    def _resume_newest_good(self) -> int:
        """The newest checkpoint that is complete, verifies against its checksums and loads; each one
        skipped is named. Checkpoints that exist but none of which can be used stop the run: training
        from scratch would replace them."""
        found, failed = list_checkpoints(self.dir), []
        for _step, path, complete, problem in reversed(found):
            if not complete:
                self._say(f"checkpoint {path.name} is incomplete ({problem}); using an older one")
                continue
            damaged = self._verify(path)
            if damaged:
                failed.append(path.name)
                self._say(f"checkpoint {path.name} is damaged ({'; '.join(damaged)}); using an older one")
                continue
            try:
                return self._load(path)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # torch's CheckpointException is not an Exception
                kind, detail = classify_load_error(exc)
                if kind == MISMATCH:  # every checkpoint of the run has the same shape: no fallback
                    raise CheckpointLoadError(path, kind, detail) from None
                failed.append(path.name)
                self._say(f"checkpoint {path.name} is {kind} ({detail}); using an older one")
        if failed:  # a failed load may have filled some tensors, and a fresh start would replace them
            raise CheckpointLoadError(self.dir, CORRUPT, f"no intact checkpoint ({', '.join(failed)} failed)")
        return 0

    def _verify(self, path: Path) -> list[str]:
        """What is wrong with `path`'s files against its manifest's checksums, the same list on every
        rank (each rank checks its share, usp/run/checksums.py); [] when they all match. A checkpoint
        saved without checksums loads unverified, with a note."""
        expected = checksums.recorded(path)
        if expected is None:
            self._say(f"checkpoint {path.name} has no checksums (saved by an earlier usp): loading it unverified")
            return []
        started = time.perf_counter()
        mine = [n for n in expected if checksums.owner(n, self.ctx.world_size) == self.ctx.rank]
        problems = sorted(p for part in self._gather(checksums.mismatches(path, expected, mine)) for p in part)
        self.log.info("checkpoint %s: %d files checked against their checksums in %.2f s: %s", path.name,
                      len(expected), time.perf_counter() - started, "; ".join(problems) or "all match")
        return problems

    def _load(self, path: Path) -> int:
        planned = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in self.optimizers]
        state = self._state()
        reader = MetadataOnce(str(path))  # _present's read of the metadata is dcp.load's as well
        loaded = _present(self._saved_state(state), reader.read_metadata().state_dict_metadata)
        with single_process_is_intended():
            dcp.load(loaded, storage_reader=reader)  # tensors in place, into `state`'s storage
        state = _with_loaded_values(state, loaded)
        if checkpoint_rope_layout(path) != ROPE_LAYOUT:  # written before usp's RoPE layout change
            model = self.plan.config.model
            converted = upgrade_rope_rows(state["model"], model.n_heads, model.n_kv_heads)
            converted += upgrade_rope_rows(state["optim"], model.n_heads, model.n_kv_heads)
            self._say(f"{path.name} predates usp's RoPE layout change: {len(converted)} q/k tensors "
                      "(weights and optimizer states) converted to the rotate-half layout")
        for module, optimizer in zip(self.parts.modules, self.optimizers):
            model_sd, optim_sd = state["model"], state["optim"]
            if is_head_copy(module, self.tie):  # a last stage's copy of the tied embedding
                model_sd, optim_sd = head_copy_state(model_sd, optim_sd)
            with groups_with_parameters(own_partition(optimizer)) as local:
                set_state_dict(module, local, model_state_dict=model_sd, optim_state_dict=optim_sd,
                               options=StateDictOptions(flatten_optimizer_state_dict=True, strict=False))
        trainer_state = json.loads((path / TRAINER_STATE).read_text())
        for scheduler in self.schedulers:  # one per model part, all on the same schedule
            scheduler.load_state_dict(trainer_state["scheduler"])
        self._apply_planned_hyperparameters(planned, trainer_state["scheduler"].get("base_lrs"))
        self.sampler.load_state_dict(trainer_state["sampler"])
        rng = path / f"rng_rank{self.ctx.rank}.pt"
        if rng.exists():  # same rank count: restore this rank's RNG; else keep the seeded one
            torch.set_rng_state(torch.load(rng))
        self.last_saved = int(trainer_state["step"])
        self.resumed_from = path
        self._say(f"resumed from {path} (step {trainer_state['step']}, saved under "
                  f"{describe(trainer_state['degrees'])}, now {describe(self.ctx.degrees)})")
        return int(trainer_state["step"])

    def _apply_planned_hyperparameters(self, planned: list, saved_base_lrs) -> None:
        """The plan's optimizer settings (learning rate, betas, weight decay, ...) over the ones the
        checkpoint's param groups and LR schedule carried: the checkpoint gives the state (moments, step,
        the schedule's position), the plan what to train with. Without this a resume with a lower
        optimizer.lr, the fix a non-finite loss's stop names, trained on at the saved one (measured)."""
        for optimizer, scheduler, groups in zip(self.optimizers, self.schedulers, planned):
            for group, settings in zip(optimizer.param_groups, groups):
                group.update(settings)
            scheduler.base_lrs = [settings["initial_lr"] for settings in groups]
            for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
                group["lr"] = base * factor(scheduler.last_epoch)
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        now = self.schedulers[0].base_lrs if self.schedulers else []
        if saved_base_lrs and [float(x) for x in saved_base_lrs] != [float(x) for x in now]:
            self._say(f"optimizer.lr is now {now[0]:g} (the checkpoint was saved at {float(saved_base_lrs[0]):g}): "
                      "the plan's learning rate applies from here, on the same schedule")

    def _say(self, message: str) -> None:
        self.log.info(message)
        if self.ctx.is_main:
            print(f"usp: {message}", flush=True)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()


MISMATCH, CORRUPT, MISSING = "a shape/architecture mismatch", "corrupt", "missing"
DAMAGED = "damaged (its files don't match their checksums)"
_MISMATCH_TEXT = ("size mismatch", "missing key", "unexpected key", "shape mismatch")


class CheckpointLoadError(UspError):
    """A checkpoint that can't be loaded: which, why (MISMATCH, CORRUPT or MISSING) and the fixes. A
    UspError: one message, no traceback (`usp train` refuses the missing and mismatched cases first)."""

    def __init__(self, path: Path, kind: str, detail: str):
        self.path, self.kind = path, kind
        fix = ("train.name=<a new name> (a new run), checkpoint.resume=never (train from scratch here), or the "
               "model settings it was saved with (its plan.yaml)" if kind == MISMATCH else
               "checkpoint.resume=never (train from scratch here), or checkpoint.resume=<an intact step_N directory>")
        super().__init__(f"checkpoint {path} can't be loaded: {kind}: {detail}", fix=fix)


def classify_load_error(exc: BaseException) -> tuple[str, str]:
    """(MISMATCH | CORRUPT | MISSING, the first cause's message) of a failed load. DCP's
    CheckpointException carries each rank's exception in .failures: {rank: (exception, stack)}."""
    failures = getattr(exc, "failures", None)
    causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else []
    causes = causes or [exc]
    detail = "; ".join(sorted({f"{type(c).__name__}: {str(c).strip().splitlines()[0][:200] if str(c).strip() else ''}"
                               for c in causes}))
    if any(t in str(c).lower() for c in causes for t in _MISMATCH_TEXT):
        return MISMATCH, detail
    if any(isinstance(c, FileNotFoundError) for c in causes):
        return MISSING, detail
    return CORRUPT, detail


def _present(state: dict, saved: dict) -> dict:
    """`state` less the aux-loss-free balancing biases the checkpoint (`saved`: its metadata's keys)
    doesn't have (saved before model.router_bias_update_rate was turned on): they keep their initial
    zeros."""
    model = {k: v for k, v in state["model"].items() if not k.endswith("expert_bias") or f"model.{k}" in saved}
    return {**state, "model": model}


def _with_loaded_values(state: dict, loaded: dict) -> dict:
    """`state` with the values DCP replaced rather than filled in place (the optimizer's lr,
    betas, ...: not tensors) taken from `loaded`, a copy of it (_saved_state, _present)."""
    return {part: {k: v if isinstance(v, torch.Tensor) else loaded[part].get(k, v) for k, v in sd.items()}
            for part, sd in state.items()}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
