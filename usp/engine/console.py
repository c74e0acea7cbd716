"""What rank 0 shows while training: a rich progress bar on a terminal, plain lines in a
batch log (auto-detected), or nothing (quiet). Every rank also writes logs/rank_<N>.log."""
from __future__ import annotations

import logging
import sys
from pathlib import Path


def rank_logger(run_dir: Path, rank: int) -> logging.Logger:
    log = logging.getLogger(f"usp.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    # Appended, not truncated: a restarted or resumed run keeps the history of earlier attempts.
    handler = logging.FileHandler(run_dir / "logs" / f"rank_{rank}.log", mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s rank%(rank)s %(message)s".replace("%(rank)s", str(rank))))
    log.handlers[:] = [handler]
    return log


class Console:
    """Progress display for rank 0. mode: auto | rich | plain | quiet."""

    def __init__(self, mode: str, total_steps: int, enabled: bool):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "quiet"
        self.total = total_steps
        self._progress = self._task = None
        if self.mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[stats]}"), TimeRemainingColumn())
            self._task = self._progress.add_task("train", total=total_steps, stats="")
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
            print(f"step {step}/{self.total} {_stats(record)}", flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _stats(r: dict) -> str:
    parts = [f"loss {r['loss']:.4f}"]
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.4f}")
    parts += [f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.2f}", f"{r['tokens_per_s']:,.0f} tok/s"]
    return " | ".join(parts)
