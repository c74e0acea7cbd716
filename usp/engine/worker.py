"""Worker entry point: `python -m usp.engine.worker --plan runs/<name>/plan.yaml`, started by
torchrun once per rank (or called in-process for a single rank). Reads only plan.yaml."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from usp.engine import dist as udist
from usp.engine.trainer import Trainer
from usp.plan.io import read_plan


@record  # on failure torchrun reports this rank's traceback in its summary
def run_worker(plan_path: str) -> int:
    plan = read_plan(Path(plan_path))
    cfg = plan["config"]["train"]
    torch.manual_seed(int(cfg["seed"]))
    if cfg["deterministic"]:
        torch.use_deterministic_algorithms(True, warn_only=True)
    ctx = udist.setup(plan)
    clean = False
    try:
        trainer = Trainer(plan, ctx)
        summary = trainer.fit()
        if ctx.is_main:
            _final_report(trainer, summary)
        # Free DDP (its Reducer holds the process group) while the group is still alive:
        # otherwise gloo's destructor runs inside the Reducer's dealloc with the GIL held and
        # deadlocks joining its worker thread.
        del trainer
        clean = True
    finally:
        udist.teardown(clean)
    return 0


def _final_report(trainer: Trainer, summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="summary", show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column()
    val = summary["final_val_loss"]
    rows = [("steps", f"{summary['steps']}"), ("tokens", f"{summary['tokens']:,}"),
            ("time", f"{summary['time_s']:.1f} s"), ("tokens/s", f"{summary['tokens_per_s']:,.0f}"),
            ("train loss", f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"),
            ("val loss", f"{val:.4f}" if val is not None else "-"),
            ("metrics", str(trainer.run_dir / "metrics.jsonl"))]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    text = _sample_text(trainer)
    if text is not None:
        console.print(f"[bold]sample[/] (prompt {trainer.cfg.train.sample_prompt!r}):")
        console.print(text, markup=False, highlight=False)


def _sample_text(trainer: Trainer) -> str | None:
    from usp.data.tokenizer import load_tokenizer
    from usp.engine.sample import generate

    train = trainer.cfg.train
    if train.sample_tokens <= 0 or trainer.meta.get("tokenizer") in (None, "none"):
        return None
    tok = load_tokenizer(Path(trainer.plan["dataset_dir"]))
    prompt = tok.encode(train.sample_prompt)
    out = generate(trainer.raw_model, prompt, int(train.sample_tokens), trainer.seq_len, int(train.seed))
    text = train.sample_prompt + tok.decode(out)
    (trainer.run_dir / "sample.txt").write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="usp.engine.worker")
    parser.add_argument("--plan", required=True, help="path to plan.yaml")
    sys.exit(run_worker(parser.parse_args(argv).plan))


if __name__ == "__main__":
    main()
