"""Measured training runs as planner inputs: each run's model shape, layout, node count and what was
measured (MFU, tokens/s, peak memory), read from a CSV shaped like
calibration/playbook_h100/playbook_sweep_calibration.csv (with its archs CSV beside it) or from a
directory of usp run directories (plan.yaml + metrics.jsonl). The one place a measured row becomes
the planner's Arch / Layout / Hardware: `usp calibrate` fits the cluster's time constants to them,
usp.perf.calibration.memory_check and scripts/bench/calibration_sweep.py score the memory model on them, the
memory and time tests compare the planner with them. Pure Python, no torch.

Row -> planner inputs (the Ultra-Scale Playbook's nanotron runs): the model shape from the archs CSV
(hidden, layers, heads, kv_heads, ffn, vocab, tie_word_embeddings, seq_len, default 4096);
dp -> dp_replicate, zero=1 -> parallelism.zero1, tp, pp with 1F1B, mbs -> micro batch, gas ->
gradient accumulation, no recomputation; the global batch is dp x mbs x gas sequences; bf16 on
cluster slurm_h100 (8 x H100 80GB per node) with the run's node count."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from usp.contract.config_schema import ClusterConfig
from usp.contract.run_plan import RunPlan
from usp.contract.typed import rebuild
from usp.errors import UspError
from usp.perf.calibration.csv_rows import read_rows
from usp.perf.specs import Arch, Hardware, Layout, Precision

SEQ_LEN = 4096  # the playbook's sequence length: an archs CSV without a seq_len column
# default paths only: nothing here reads them unless asked (an installed package has no calibration/)
PLAYBOOK_DIR = Path(__file__).resolve().parents[3] / "calibration" / "playbook_h100"
SWEEP_CSV = PLAYBOOK_DIR / "playbook_sweep_calibration.csv"
ARCHS_FILE = "playbook_model_archs.csv"
PLAYBOOK_CLUSTER = "slurm_h100"  # the cluster group of the playbook's nodes
BF16 = Precision.resolve("bf16", "cuda")  # the playbook's runs: bf16 mixed precision


@dataclass(frozen=True)
class MeasuredRun:
    model: str
    arch: Arch
    layout: Layout
    nodes: int
    seq_len: int
    global_batch: int  # sequences per optimizer step
    ok: bool
    mfu: float | None  # fraction (0.4 = 40 %), None when not measured
    tokens_per_s_per_device: float | None
    mem_gib: float | None = None  # peak allocated memory on rank 0 (pp rank 0), GiB (the CSV's mem_gb); None if failed
    source: str = ""

    @property
    def cell(self) -> tuple[str, int]:
        return self.model, self.nodes


def arch_from_row(row: dict) -> Arch:
    """One row of an archs CSV (model, layers, hidden, heads, kv_heads, ffn, vocab, tie_word_embeddings)."""
    return Arch(name=row["model"], dim=int(row["hidden"]), n_layers=int(row["layers"]), n_heads=int(row["heads"]),
                n_kv_heads=int(row["kv_heads"]), ffn_dim=int(row["ffn"]), vocab_size=int(row["vocab"]),
                tie_embeddings=row["tie_word_embeddings"].strip().lower() == "true")


def layout_from_row(row: dict) -> Layout:
    return Layout(pp=int(row["pp"]), dp_replicate=int(row["dp"]), tp=int(row["tp"]), zero1=row["zero"] == "1",
                  micro_batch=int(row["mbs"]), grad_accum=int(row["gas"]), pp_schedule="1f1b")


@cache
def h100_nodes(nodes: int) -> Hardware:
    """The playbook's hardware: conf/cluster/slurm_h100.yaml with the run's node count (the group's
    YAML file itself: composing a config per node count costs seconds)."""
    import yaml

    from usp.config.paths import conf_dir

    path = conf_dir() / "cluster" / f"{PLAYBOOK_CLUSTER}.yaml"
    return Hardware.from_cluster(cluster_group(yaml.safe_load(path.read_text()), path)).with_nodes(nodes)


def cluster_group(values: dict, path: Path) -> ClusterConfig:
    """A cluster group's YAML values as the schema's ClusterConfig (the keys it leaves out: their
    defaults); a key the schema lacks or a value of the wrong type names the file."""
    return rebuild(ClusterConfig, values, source=str(path))


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


RUN_COLUMNS = {"model": "text", "nodes": "count", "dp": "count", "tp": "count", "pp": "count", "gas": "count",
               "mbs": "count", "zero": "flag"}
RUN_OPTIONAL = {"status": "text", "mfu_pct": "percent", "tok_s_gpu": "number", "mem_gb": "number"}
ARCH_COLUMNS = {"model": "text", "layers": "count", "hidden": "count", "heads": "count", "kv_heads": "count",
                "ffn": "count", "vocab": "count", "tie_word_embeddings": "bool"}
ARCH_OPTIONAL = {"seq_len": "optional_count"}
EXAMPLE = "calibration/playbook_h100/playbook_sweep_calibration.csv"


def archs_csv(measured: Path, archs: str | Path | None = None) -> Path:
    """The model shapes CSV a sweep CSV is read with: `archs`, or playbook_model_archs.csv beside it."""
    return Path(archs) if archs else Path(measured).with_name(ARCHS_FILE)


def read_sweep_csv(path: Path = SWEEP_CSV, archs: Path | None = None, key: str = "RUNS") -> list[MeasuredRun]:
    """Every row of a sweep CSV (columns: model, nodes, dp, tp, pp, gas, mbs, zero, status, mfu_pct,
    tok_s_gpu[, mem_gb]); model shapes from `archs` (default: playbook_model_archs.csv beside it). A
    malformed file is one UspError naming the file, line and column (usp.perf.calibration.csv_rows)."""
    archs = archs_csv(path, archs)
    for p, what, option in ((path, "runs CSV", key), (archs, "archs CSV", "--archs")):
        if not p.is_file():
            raise UspError(f"{what} not found: {p}", key=option, value=str(p),
                           fix=f"pass an existing file (see calibration/playbook_h100/; --archs names the model "
                               f"shapes, default {ARCHS_FILE} beside the runs CSV)")
    arch_rows = [row for _, row in read_rows(archs, ARCH_COLUMNS, ARCH_OPTIONAL, "--archs",
                                             f"calibration/playbook_h100/{ARCHS_FILE}")]
    shapes = {r["model"]: arch_from_row(r) for r in arch_rows}
    seq = {r["model"]: int(r.get("seq_len") or SEQ_LEN) for r in arch_rows}
    out = []
    for i, row in read_rows(path, RUN_COLUMNS, RUN_OPTIONAL, key, EXAMPLE):
        if row["model"] not in shapes:
            raise UspError(f"{path}:{i}: model {row['model']!r} is not in {archs}", key=key, value=str(path),
                           fix="add its shape to the archs CSV (--archs)")
        lay = layout_from_row(row)
        ok = row.get("status", "ok") == "ok"
        mfu = _float(row.get("mfu_pct"))
        out.append(MeasuredRun(row["model"], shapes[row["model"]], lay, int(row["nodes"]), seq[row["model"]],
                               lay.dp * lay.micro_batch * lay.grad_accum, ok,
                               None if mfu is None else mfu / 100, _float(row.get("tok_s_gpu")),
                               _float(row.get("mem_gb")) if ok else None, f"{path.name}:{i}"))
    return out


def read_run_dirs(root: Path) -> list[MeasuredRun]:
    """usp run directories under `root` (each with plan.yaml and metrics.jsonl): the layout from the
    plan, the measured MFU and tokens/s the median of the logged steps after the first (warm-up)."""
    from usp.contract.plan_file import read_plan

    out = []
    for plan_path in sorted(root.rglob("plan.yaml")):
        metrics = plan_path.with_name("metrics.jsonl")
        if not metrics.is_file():
            continue
        try:
            rows = [_record(line) for line in metrics.read_text(encoding="utf-8").splitlines()]
            steps = [r for r in rows if isinstance(r.get("mfu"), (int, float))][1:]
            if steps:
                out.append(_run_from_plan(read_plan(plan_path), steps, str(plan_path.parent)))
        except (OSError, UnicodeDecodeError, UspError) as exc:
            raise UspError(f"{plan_path.parent} is not a readable usp run ({type(exc).__name__}: {exc})", key="RUNS",
                           value=str(root), fix=f"move {plan_path.parent} out of {root}, or point at a CSV") from None
    return out


def _record(line: str) -> dict:
    """One metrics.jsonl line; {} for a line that isn't a whole JSON object (a run killed mid-write)."""
    try:
        record = json.loads(line)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _run_from_plan(plan: RunPlan, steps: list[dict], source: str) -> MeasuredRun:
    cfg, batch = plan.config, plan.batch
    arch = Arch.from_model(cfg.model, plan.model.vocab_size)
    lay = Layout.from_config(plan.degrees, cfg.parallelism, batch, str(cfg.train.recompute))
    tok = [r["tokens_per_s_per_device"] for r in steps if isinstance(r.get("tokens_per_s_per_device"), (int, float))]
    return MeasuredRun(cfg.model.name, arch, lay, plan.nodes, batch.seq_len, batch.global_batch, True,
                       _median([r["mfu"] for r in steps]), _median(tok) if tok else None, None, source)
