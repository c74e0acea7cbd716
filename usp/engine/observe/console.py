"""What rank 0 shows while training: a rich progress bar on a terminal, plain lines in a
batch log (auto-detected), or nothing (quiet). Every rank also writes logs/rank_<N>.log."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from usp.run.files import rank_log


def rank_logger(run_dir: Path, rank: int) -> logging.Logger:
    log = logging.getLogger(f"usp.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    path = rank_log(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Appended, not truncated: a restarted or resumed run keeps the history of earlier attempts.
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s rank%(rank)s %(message)s".replace("%(rank)s", str(rank))))
    log.handlers[:] = [handler]
    return log


class Console:
    """Progress display for rank 0. mode: auto | rich | plain | quiet. Plain prints one line per
    logged step (what a Slurm log gets); rich shows the same fields beside a progress bar."""

    def __init__(self, mode: str, total_steps: int, enabled: bool, start_step: int = 0):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "quiet"
        self.total, self.start = total_steps, start_step
        self._progress = self._task = None
        if self.mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            from rich.table import Column

            # the stats fold onto more lines on a narrow terminal instead of being cut off
            self._progress = Progress(TextColumn("[bold]train"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                      TimeRemainingColumn(),
                                      TextColumn("{task.fields[stats]}", table_column=Column(overflow="fold")))
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self._progress.start()

    def print(self, text: str) -> None:
        if self.mode == "rich":
            self._progress.console.print(text)
        elif self.mode == "plain":
            print(text, flush=True)

    def step(self, step: int, record: dict | None) -> None:
        """Called after every optimizer step; record is set on logged steps."""
        if self.mode == "rich":
            stats = _stats(record) if record else None
            self._progress.update(self._task, completed=step, **({"stats": stats} if stats else {}))
        elif self.mode == "plain" and record:
            print(f"step {step}/{self.total} eta {self._eta(step, record)} | {_stats(record)}", flush=True)
        if record and record.get("expert_load"):
            self.print(f"step {step} {expert_load_line(record['expert_load'])}")

    def _eta(self, step: int, record: dict) -> str:
        """Remaining steps at the mean pace of this attempt so far (evaluations included)."""
        done, elapsed = step - self.start, record.get("elapsed_s")
        if not done or elapsed is None:
            return "?"
        return _duration(elapsed / done * (self.total - step))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _stats(r: dict) -> str:
    """loss, lr, grad norm, throughput, MFU, memory and data wait: the fields a record has."""
    parts = [f"loss {r['loss']:.4f}"]
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.4f}")
    parts += [f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.2f}", f"{r['tokens_per_s']:,.0f} tok/s"]
    if "tokens_per_s_per_device" in r:
        parts.append(f"{r['tokens_per_s_per_device']:,.0f} tok/s/dev")
    if r.get("mfu") is not None:
        parts.append(f"mfu {100 * r['mfu']:.1f}%")
    memory = r.get("memory_peak_gib", r.get("memory_measured_max_gib"))
    if memory is not None:
        parts.append(f"mem {memory:.2f} GiB")
    if r.get("data_wait_s") is not None:
        parts.append(f"data {1e3 * r['data_wait_s']:.1f} ms")
    return " | ".join(parts)


def expert_load_line(load: dict[str, dict]) -> str:
    """MoE expert load of a logged step: the worst layer's imbalance (max / mean tokens per expert)
    and token range, and the mean imbalance over the layers."""
    worst = max(load, key=lambda layer: load[layer]["imbalance"])
    w = load[worst]
    mean = sum(v["imbalance"] for v in load.values()) / len(load)
    return (f"moe load: imbalance max/mean {w['imbalance']:.2f} in layer {worst} (tokens per expert "
            f"{w['tokens_min']:,}-{w['tokens_max']:,}), mean over {len(load)} layers {mean:.2f}")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"
