"""Where rank 0's metrics records go, behind one small interface (Tracker: log, close):
metrics.jsonl always, plus Weights & Biases (logging.wandb) and TensorBoard
(logging.tensorboard). Their libraries are imported only when enabled (wandb costs ~1 s)."""
from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from usp.contract.run_plan import RunPlan
from usp.contract.typed import plain
from usp.engine.observe.metrics import MetricsWriter
from usp.run.files import METRICS

WANDB_ID_FILE = "wandb_run_id"  # in the run dir: a resumed run appends to the same W&B run


class Tracker(Protocol):
    def log(self, step: int, record: dict) -> None: ...

    def close(self) -> None: ...


def build_trackers(plan: RunPlan, run_dir: Path, resume_step: int = 0,
                   warn: Callable[[str], None] = print) -> Trackers:
    """The backends logging.* asks for. resume_step > 0: a resumed run (records after it from a
    crashed attempt are dropped, the W&B run id is reused)."""
    cfg = plan.config.logging
    extras: list[Tracker] = []
    if cfg.wandb:
        extras.append(WandbTracker(plan, run_dir, resumed=resume_step > 0, warn=warn))
    if cfg.tensorboard:
        extras.append(TensorBoardTracker(run_dir / "tensorboard", plan, resume_step))
    return Trackers(MetricsWriter(run_dir / METRICS, keep_until=resume_step), extras, warn)


class Trackers:
    """Fans a record out to every backend. A dashboard backend that fails is dropped with a
    warning rather than killing a long run; metrics.jsonl must not fail."""

    def __init__(self, jsonl: MetricsWriter, extras: list, warn: Callable[[str], None]):
        self.jsonl, self.extras, self._warn = jsonl, extras, warn

    @property
    def trackers(self) -> list:
        return [self.jsonl, *self.extras]

    def log(self, step: int, record: dict) -> None:
        self.jsonl.log(step, record)
        for tracker in list(self.extras):
            try:
                tracker.log(step, record)
            except Exception as exc:  # noqa: BLE001 - any backend error
                self._warn(f"{type(tracker).__name__} failed ({exc}); it logs nothing more in this run")
                self.extras.remove(tracker)
                try:  # e.g. finish the W&B run so its files are complete up to here
                    tracker.close()
                except Exception:  # noqa: BLE001 - already broken; the warning above says so
                    pass

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001
                self._warn(f"closing {type(tracker).__name__} failed: {exc}")


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numeric, finite fields of a record, nested dicts flattened as a/b (strings, None and
    NaN are left out: dashboards plot numbers)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if name == "step":  # the x axis, passed separately
            continue
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = value
    return out


_WANDB_MODE_ALIASES = {"run": "online", "dryrun": "offline"}  # W&B's older names for its modes


def wandb_mode(configured: str | None, env: dict | None = None) -> str:
    """logging.wandb_mode when set; else WANDB_MODE; else online when WANDB_API_KEY is set (the
    user asked W&B to upload); else offline: no network needed by default."""
    env = os.environ if env is None else env
    mode = configured or env.get("WANDB_MODE") or ("online" if env.get("WANDB_API_KEY") else "offline")
    return _WANDB_MODE_ALIASES.get(mode, mode)


class WandbTracker:
    """W&B run with the resolved plan as its config. Offline by default (files under
    <run_dir>/wandb, uploaded later by `wandb sync`); online only when asked (wandb_mode above),
    and then an init that can't reach the server falls back to offline after
    logging.wandb_init_timeout_s."""

    def __init__(self, plan: RunPlan, run_dir: Path, resumed: bool, warn: Callable[[str], None]):
        import wandb

        cfg = plan.config.logging
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resumed and id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        mode = wandb_mode(str(cfg.wandb_mode) if cfg.wandb_mode else None)
        kwargs = dict(project=cfg.wandb_project, entity=cfg.wandb_entity, name=plan.name,
                      id=run_id, resume="allow", dir=str(run_dir), config=plan.to_dict(),
                      tags=[str(t) for t in cfg.wandb_tags], job_type="train")
        # console="off": our own console prints the progress; W&B would otherwise wrap stdout.
        settings = wandb.Settings(init_timeout=float(cfg.wandb_init_timeout_s), console="off")
        try:
            self.run = wandb.init(mode=mode, settings=settings, **kwargs)
        except Exception as exc:  # noqa: BLE001 - no network, no API key, timeout: all fall back
            if mode != "online":
                raise
            warn(f"W&B online init failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                 f"logging offline to {run_dir / 'wandb'} instead "
                 f"(upload later: wandb sync {run_dir / 'wandb'}/offline-run-*)")
            wandb.teardown()  # the failed attempt still holds the run id in W&B's service process
            self.run = wandb.init(mode="offline", settings=settings, **kwargs)

    def log(self, step: int, record: dict) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """Event files in <run_dir>/tensorboard, one scalar per record field (tag = field name)."""

    def __init__(self, log_dir: Path, plan: RunPlan, resume_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run hides the events a crashed attempt wrote after the checkpoint.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=resume_step + 1 if resume_step else None,
                                    flush_secs=10)
        if not resume_step:
            self.writer.add_text("config", "```\n" + json.dumps(plain(plan.config), indent=1) + "\n```")

    def log(self, step: int, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()
