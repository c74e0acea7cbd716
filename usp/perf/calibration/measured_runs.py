"""Measured training runs as planner inputs: each run's model shape, layout, hardware, stack and what
was measured (MFU or tokens/s, peak memory), read from a runs CSV (the format below; the Ultra-Scale
Playbook's calibration/playbook_h100/playbook_sweep_calibration.csv is one) or from a directory of usp
run directories (plan.yaml + metrics.jsonl). The one place a measured row becomes the planner's Arch /
Layout / Precision / cluster group / profile: `usp calibrate` fits the time constants to them,
usp.perf.calibration.memory_check and scripts/bench/calibration_sweep.py score the memory model on
them, the memory and time tests compare the planner with them. Pure Python, no torch.

A runs CSV (docs/planner.md "usp calibrate"): one row per run; a column may be left out (its default
in brackets), a value left empty takes the default too.

  model shape   model (looked up in the archs CSV: --archs, or playbook_model_archs.csv beside it), or the
                columns layers, hidden, heads, kv_heads, ffn, vocab [+ tied (false), mlp: swiglu | gelu]
  sequence      seq (or seq_len) [the archs CSV's seq_len, else 4096]
  hardware      cluster: a cluster group (a name in conf/cluster or a YAML path) [--cluster]; nodes, or
                gpus (nodes = gpus / the group's procs_per_node)
  stack         profile (or stack): a planner profile [--profile]
  layout        tp, pp [1], cp [1], vp (virtual stages per pp rank) [1], pp_schedule [interleaved_1f1b when
                vp > 1, else 1f1b]; dp (or dp_replicate / dp_shard); zero (0 | 1) or dp_kind: ddp | zero1 |
                distopt (Megatron's distributed optimizer = zero1) | fsdp | fsdp_noreshard | hsdp; mbs (micro
                batch, sequences) [pp = 1: the largest of 4, 2, 1 dividing the sequences per replica, a
                whole step in one micro batch where it fits; pp > 1: 1]; gas (micro batches per step) or
                gbs_seqs (sequences per step); recompute: none | selective | full [none]
  precision     precision: bf16 | fp8 (FP8 tensorwise linears) | fp8_rowwise [bf16]; compile (true | false)
                [true]; async_tp, fp8_all_gather (true | false) [false]
  measured      status (ok | anything else) [ok]; mfu_pct (6N + 12Lhs per token against the group's bf16
                peak), or tok_s_gpu (the MFU is then computed with the planner's FLOPs per token); mem_gb
  bookkeeping   id, use (fit | eval | excluded | ...): kept, not interpreted here

The Ultra-Scale Playbook's sweep (model, nodes, dp, tp, pp, gas, mbs, zero, status, mfu_pct, tok_s_gpu,
mem_gb; its archs CSV beside it) is a file of this format: dp -> dp_replicate, zero=1 -> ZeRO-1, 1F1B,
no recomputation, bf16, its global batch dp x mbs x gas sequences."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from usp.contract.config_schema import ClusterConfig
from usp.contract.run_plan import RunPlan
from usp.contract.typed import rebuild
from usp.errors import UspError
from usp.perf.calibration.csv_rows import read_rows
from usp.perf.specs import Arch, Hardware, Layout, Precision

SEQ_LEN = 4096  # the playbook's sequence length: an archs CSV without a seq_len column
# default paths only: nothing here reads them unless asked (an installed package has no calibration/)
REPO = Path(__file__).resolve().parents[3]
PLAYBOOK_DIR = REPO / "calibration" / "playbook_h100"
SWEEP_CSV = PLAYBOOK_DIR / "playbook_sweep_calibration.csv"
ARCHS_FILE = "playbook_model_archs.csv"
PLAYBOOK_CLUSTER = "slurm_h100"  # the cluster group of the playbook's nodes (memory checks)
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
    profile: str = ""  # the planner profile of the stack it ran ("": the command's --profile)
    cluster: str = ""  # the cluster group it ran on ("": the command's --cluster)
    precision: str = "bf16"  # bf16 | fp8 | fp8_rowwise
    compiled: bool = True
    fp8_all_gather: bool = False
    run_id: str = ""
    use: str = ""

    @property
    def cell(self) -> tuple[str, int]:
        return self.model, self.nodes

    @property
    def fp8(self) -> str:
        return {"fp8": "tensorwise", "fp8_rowwise": "rowwise"}.get(self.precision, "off")


def arch_from_row(row: dict) -> Arch:
    """One row of an archs CSV (model, layers, hidden, heads, kv_heads, ffn, vocab, tie_word_embeddings[,
    mlp]) or a runs CSV's inline shape (tied for tie_word_embeddings)."""
    tied = row.get("tie_word_embeddings", row.get("tied", "false")) or "false"
    return Arch(name=row.get("model") or f"{row['layers']}x{row['hidden']}", dim=int(row["hidden"]),
                n_layers=int(row["layers"]), n_heads=int(row["heads"]), n_kv_heads=int(row["kv_heads"]),
                ffn_dim=int(row["ffn"]), vocab_size=int(row["vocab"]), tie_embeddings=tied.strip().lower() == "true",
                gated=(row.get("mlp") or "swiglu").strip().lower() != "gelu")


def layout_from_row(row: dict) -> Layout:
    """The playbook's columns (dp, tp, pp, zero, mbs, gas) as a layout."""
    return Layout(pp=int(row["pp"]), dp_replicate=int(row["dp"]), tp=int(row["tp"]), zero1=row["zero"] == "1",
                  micro_batch=int(row["mbs"]), grad_accum=int(row["gas"]), pp_schedule="1f1b")


@cache
def cluster_hardware(cluster: str) -> Hardware:
    """A cluster group (a name in conf/cluster or a YAML path) as the planner's Hardware (its file, not a
    composed config: composing one per run costs seconds)."""
    import yaml

    from usp.config.paths import conf_dir

    path = Path(cluster) if cluster.endswith((".yaml", ".yml")) else conf_dir() / "cluster" / f"{cluster}.yaml"
    if not path.is_file():
        raise UspError(f"cluster group not found: {path}", key="cluster", value=cluster,
                       fix="a name in conf/cluster or a YAML path (the runs CSV's cluster column, or --cluster)")
    return Hardware.from_cluster(cluster_group(yaml.safe_load(path.read_text()), path))


def h100_nodes(nodes: int) -> Hardware:
    """The playbook's hardware: conf/cluster/slurm_h100.yaml with the run's node count."""
    return cluster_hardware(PLAYBOOK_CLUSTER).with_nodes(nodes)


def cluster_group(values: dict, path: Path) -> ClusterConfig:
    """A cluster group's YAML values as the schema's ClusterConfig (the keys it leaves out: their
    defaults); a key the schema lacks or a value of the wrong type names the file."""
    return rebuild(ClusterConfig, values, source=str(path))


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


# columns: the playbook's (each required group named by its first spelling), then every optional one
REQUIRED = {"model": ("model", "layers"), "nodes": ("nodes", "gpus"), "dp": ("dp", "dp_replicate", "dp_shard"),
            "tp": ("tp",), "pp": ("pp",), "gas": ("gas", "gbs_seqs"), "mbs": ("mbs",), "zero": ("zero", "dp_kind")}
KINDS = {"model": "text", "nodes": "count", "gpus": "count", "dp": "count", "dp_replicate": "optional_count",
         "dp_shard": "optional_count", "tp": "count", "pp": "count", "cp": "optional_count", "vp": "optional_count",
         "gas": "count", "gbs_seqs": "count", "mbs": "optional_count", "zero": "flag", "status": "text",
         "mfu_pct": "percent", "tok_s_gpu": "number", "mem_gb": "number", "seq": "optional_count",
         "seq_len": "optional_count", "layers": "count", "hidden": "count", "heads": "count", "kv_heads": "count",
         "ffn": "count", "vocab": "count"}
CHOICES = {"dp_kind": ("ddp", "zero1", "distopt", "fsdp", "fsdp_noreshard", "hsdp"),
           "recompute": ("none", "selective", "full"), "precision": ("bf16", "fp8", "fp8_rowwise"),
           "pp_schedule": ("1f1b", "afab", "interleaved_1f1b", "interleaved_zb", "zbv"),
           "compile": ("true", "false"), "async_tp": ("true", "false"), "fp8_all_gather": ("true", "false"),
           "tied": ("true", "false"), "mlp": ("swiglu", "gelu")}
ARCH_COLUMNS = {"model": "text", "layers": "count", "hidden": "count", "heads": "count", "kv_heads": "count",
                "ffn": "count", "vocab": "count", "tie_word_embeddings": "bool"}
ARCH_OPTIONAL = {"seq_len": "optional_count", "mlp": "text"}
EXAMPLE = "calibration/playbook_h100/playbook_sweep_calibration.csv"
SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


def archs_csv(measured: Path, archs: str | Path | None = None) -> Path:
    """The model shapes CSV a runs CSV is read with: `archs`, or playbook_model_archs.csv beside it."""
    return Path(archs) if archs else Path(measured).with_name(ARCHS_FILE)


def _header(path: Path) -> list[str]:
    import csv
    import io

    from usp.perf.calibration.csv_rows import _text

    text = _text(path, "RUNS", EXAMPLE)
    return [h.strip() for h in next(csv.reader(io.StringIO(text)), [])]


def read_sweep_csv(path: Path = SWEEP_CSV, archs: Path | None = None, key: str = "RUNS", cluster: str = "",
                   profile: str = "") -> list[MeasuredRun]:
    """Every row of a runs CSV (the format in this module's docstring); model shapes from the row or from
    `archs` (default: playbook_model_archs.csv beside it). A malformed file is one UspError naming the
    file, line and column (usp.perf.calibration.csv_rows). cluster / profile: the defaults of rows
    without those columns."""
    if not path.is_file():
        raise UspError(f"runs CSV not found: {path}", key=key, value=str(path),
                       fix=f"pass an existing file (see calibration/; --archs names the model shapes, default "
                           f"{ARCHS_FILE} beside the runs CSV)")
    header = _header(path)
    missing = [name for name, spellings in REQUIRED.items() if not any(s in header for s in spellings)]
    if missing:
        raise UspError(f"{path} is not a CSV of this kind: its header lacks the column(s) {', '.join(missing)} "
                       f"(it has: {', '.join(header) or 'nothing'})", key=key, value=str(path),
                       fix=f"a header line {','.join(REQUIRED)}[,status,mfu_pct,tok_s_gpu,mem_gb,...] (like "
                           f"{EXAMPLE}; every column: docs/planner.md, usp calibrate)")
    inline = "model" not in header or all(c in header for c in SHAPE)
    shapes, seqs = ({}, {}) if inline else _archs(path, archs)
    kinds = {c: k for c, k in KINDS.items() if c in header}
    for group, spellings in REQUIRED.items():  # a group spelled twice: each value may be empty, not both
        if group == "model":
            continue
        present = [c for c in spellings if c in header]
        for c in present[1:]:
            kinds[present[0]] = kinds[c] = "optional_count" if kinds.get(c) == "count" else kinds.get(c, "text")
    if "mbs" in kinds and "zero" in header and "dp" in header and "gas" in header:
        kinds["mbs"] = "count"  # the playbook's format: every run names its micro batch
    strict = {c: k for c, k in kinds.items() if k not in ("optional_count", "percent", "number")
              and c in ("model", "nodes", "gpus", "dp", "tp", "pp", "gas", "gbs_seqs", "zero", "mbs")}
    out = []
    for i, row in read_rows(path, strict, kinds, key, EXAMPLE):
        where = f"{path}:{i}"
        for column, allowed in CHOICES.items():
            value = (row.get(column) or "").strip().lower().rstrip("?")
            if value and value not in allowed:
                raise UspError(f"{where}: column {column} is {row[column]!r}, not one of {', '.join(allowed)}",
                               key=key, value=str(path), fix=f"fix line {i} of {path.name} (or drop the row)")
        if inline:
            arch, seq = arch_from_row(row), int(row.get("seq") or row.get("seq_len") or SEQ_LEN)
        else:
            if row["model"] not in shapes:
                raise UspError(f"{where}: model {row['model']!r} is not in {archs_csv(path, archs)}", key=key,
                               value=str(path), fix="add its shape to the archs CSV (--archs)")
            arch, seq = shapes[row["model"]], int(row.get("seq") or row.get("seq_len") or seqs[row["model"]])
        out.append(_run(row, arch, seq, f"{path.name}:{i}", where, key, cluster, profile))
    return out


def _archs(path: Path, archs: Path | None) -> tuple[dict, dict]:
    archs = archs_csv(path, archs)
    if not archs.is_file():
        raise UspError(f"archs CSV not found: {archs}", key="--archs", value=str(archs),
                       fix=f"pass an existing file (see calibration/playbook_h100/; --archs names the model "
                           f"shapes, default {ARCHS_FILE} beside the runs CSV), or give the shape in the runs CSV "
                           f"({', '.join(SHAPE)})")
    rows = [row for _, row in read_rows(archs, ARCH_COLUMNS, ARCH_OPTIONAL, "--archs",
                                        f"calibration/playbook_h100/{ARCHS_FILE}")]
    return {r["model"]: arch_from_row(r) for r in rows}, {r["model"]: int(r.get("seq_len") or SEQ_LEN) for r in rows}


def _choice(row: dict, column: str, default: str) -> str:
    return (row.get(column) or "").strip().lower().rstrip("?") or default


def _run(row: dict, arch: Arch, seq: int, source: str, where: str, key: str, default_cluster: str,
         default_profile: str) -> MeasuredRun:
    """One row as a MeasuredRun (the layout resolved as the module docstring says)."""
    cluster = row.get("cluster") or default_cluster
    profile = row.get("profile") or row.get("stack") or default_profile
    per_node = cluster_hardware(cluster).procs_per_node if cluster and "nodes" not in row else 8
    nodes = int(row["nodes"]) if row.get("nodes") else max(1, -(-int(row["gpus"]) // per_node))
    tp, pp, cp, vp = (int(row.get(k) or 1) for k in ("tp", "pp", "cp", "vp"))
    kind = _choice(row, "dp_kind", "zero1" if row.get("zero") == "1" else "ddp")
    dp = int(row.get("dp") or row.get("dp_replicate") or row.get("dp_shard") or 1)
    degrees: dict[str, Any]
    if row.get("dp_replicate") and row.get("dp_shard"):
        degrees = dict(dp_replicate=int(row["dp_replicate"]), dp_shard=int(row["dp_shard"]))
    elif kind in ("fsdp", "fsdp_noreshard", "hsdp"):
        degrees = dict(dp_replicate=1, dp_shard=dp)
    else:
        degrees = dict(dp_replicate=dp, dp_shard=1)
    sequences = int(row["gbs_seqs"]) if row.get("gbs_seqs") and not row.get("gas") else None  # gas: dp x mbs x gas
    replicas = degrees["dp_replicate"] * degrees["dp_shard"]
    mbs = int(row["mbs"]) if row.get("mbs") else _default_micro_batch(sequences, replicas, pp)
    gas = int(row["gas"]) if row.get("gas") else max(1, (sequences or mbs * replicas) // (mbs * replicas))
    if sequences is not None and gas * mbs * replicas != sequences:
        raise UspError(f"{where}: gbs_seqs {sequences} is not dp {replicas} x mbs {mbs} x a whole number of micro "
                       "batches", key=key, value=source, fix="fix the row's gbs_seqs, dp or mbs")
    schedule = _choice(row, "pp_schedule", "interleaved_1f1b" if vp > 1 else "1f1b")
    layout = Layout(pp=pp, tp=tp, cp=cp, **degrees, zero1=kind in ("zero1", "distopt"),
                    reshard_after_forward=kind != "fsdp_noreshard", pp_schedule=schedule,
                    pp_virtual_stages=vp if pp > 1 else 1, micro_batch=mbs, grad_accum=gas,
                    recompute=_choice(row, "recompute", "none"), async_tp=_choice(row, "async_tp", "false") == "true")
    ok = (row.get("status") or "ok") == "ok"
    mfu, tok = _float(row.get("mfu_pct")), _float(row.get("tok_s_gpu"))
    if mfu is None and tok is not None and cluster:
        mfu = 100 * tok * arch.flops_per_token(seq) / (1e12 * cluster_hardware(cluster).peak_tflops_bf16)
    return MeasuredRun(row.get("model") or arch.name, arch, layout, nodes, seq, mbs * gas * replicas, ok,
                       None if mfu is None else mfu / 100, tok, _float(row.get("mem_gb")) if ok else None, source,
                       profile=profile, cluster=cluster, precision=_choice(row, "precision", "bf16"),
                       compiled=_choice(row, "compile", "true") == "true",
                       fp8_all_gather=_choice(row, "fp8_all_gather", "false") == "true", run_id=row.get("id", ""),
                       use=row.get("use", ""))


def _default_micro_batch(sequences: int | None, replicas: int, pp: int) -> int:
    """An unstated micro batch: 1 under pp; else the largest of 4, 2, 1 dividing the sequences per replica
    (a whole step in one micro batch where it holds at most 4 sequences)."""
    if pp > 1 or sequences is None:
        return 1
    per = max(1, sequences // replicas)
    return max(k for k in (1, 2, 4) if per % k == 0)


def with_defaults(run: MeasuredRun, cluster: str, profile: str) -> MeasuredRun:
    """The run with the command's cluster group and profile where its row named none."""
    return replace(run, cluster=run.cluster or cluster, profile=run.profile or profile)


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
    d = plan.decisions
    return MeasuredRun(cfg.model.name, arch, lay, plan.nodes, batch.seq_len, batch.global_batch, True,
                       _median([r["mfu"] for r in steps]), _median(tok) if tok else None, None, source,
                       profile=str(cfg.planner.profile),
                       precision={"tensorwise": "fp8", "rowwise": "fp8_rowwise"}.get(d.fp8, "bf16"), compiled=d.compile)
