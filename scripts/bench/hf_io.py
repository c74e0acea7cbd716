#!/usr/bin/env python
"""Hugging Face checkpoints in and out at 0.5 B parameters, memory measured outside the engine.

In: a transformers LlamaForCausalLM of issue 27's 0.5 B shape (dim 1024, 32 layers, 16/8 heads,
ffn 4096, tied, the default dataset's vocabulary; random, fp32) is made on the fly with
save_pretrained, and `usp train model.init_from=<dir>` (no other model key) trains 2 steps from it on
8 processes (SGD, seq_len 64, global batch 8, micro batch 1) under each layout. Each rank's VmHWM,
minus the same layout's `model=tiny` run, is set against the planner's per-rank peak, exactly as
build_memory.py does (its sampling, baseline and table), and the run's first loss against
transformers' loss on the same batch.

Out: `usp export --format hf` of the first layout's checkpoint, in a process of its own that reports
its VmHWM above the one it had once its imports were done (the process's baseline), for each
--shard-mb; the same export of the `model=tiny` run's checkpoint is the other baseline. Then
transformers loads the export and its logits are set against usp's model built from the checkpoint.

    python scripts/bench/hf_io.py --malloc-mmap-threshold 131072
    python scripts/bench/hf_io.py --layouts tp2_fsdp4 --shard-mb 500 --json
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import build_memory as bm  # noqa: E402

LAYOUTS = {"tp2_fsdp4": ["parallelism.tp=2", "parallelism.dp_shard=4"],
           "pp2_tp2_fsdp2": ["parallelism.pp=2", "parallelism.tp=2", "parallelism.dp_shard=2"]}
HF_SHAPE = dict(hidden_size=1024, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=8,
                intermediate_size=4096, tie_word_embeddings=True)
MAKE_HF = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(**json.loads(sys.argv[2]))).save_pretrained(sys.argv[1])
"""
FIRST_LOSS = """
import sys, numpy as np, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from usp.data.sampler import BatchSampler, TokenFile, get_batch
from usp.contract.plan_file import read_plan
plan = read_plan(Path(sys.argv[1]) / "plan.yaml")
seq, batch = int(plan.batch.seq_len), int(plan.batch.global_batch)
tokens = TokenFile(Path(plan.dataset_dir) / plan.data_meta["train_bin"])
starts = BatchSampler(len(tokens), seq, batch, batch, 0, 1, int(plan.config.train.seed)).micro_batches(0)
x, y = (torch.from_numpy(a) for a in get_batch(tokens, np.concatenate(starts), seq))
with torch.no_grad():
    logits = AutoModelForCausalLM.from_pretrained(sys.argv[2])(x).logits
print(float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())))
"""
# `usp export` in a process of its own that prints its VmHWM above the one it had after its imports
MEASURED_EXPORT = """
import json, sys
from pathlib import Path
import huggingface_hub, safetensors.torch, torch.distributed.checkpoint  # noqa: F401
from usp.cli import app
def vm_hwm():
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                if l.startswith("VmHWM:"))
Path("/proc/self/clear_refs").write_text("5")
base = vm_hwm()
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print(json.dumps({"base": base, "peak": vm_hwm()}))
"""
LOGITS = """
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from usp.engine.export import load_model_state
from usp.models.llama import Llama, LlamaArgs
from usp.contract.plan_file import read_plan
from usp.run.files import list_checkpoints
run = Path(sys.argv[1])
plan = read_plan(run / "plan.yaml")
ckpt = [c for c in list_checkpoints(run / "checkpoints") if c.complete][-1].path
args = LlamaArgs.from_config(plan.config.model, int(plan.model.vocab_size))
with torch.device("meta"):  # the checkpoint's tensors become the parameters (assign): one copy of the model
    ours = Llama(args, max_seq_len=64)
ours.load_state_dict(load_model_state(ckpt), strict=False, assign=True)
if args.tie_embeddings:  # stored once
    ours.output.weight = ours.tok_embeddings.weight
ours.rope_cos, ours.rope_sin = args.rope_tables(64)
tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(4))
with torch.no_grad():
    a = ours(tokens)
    del ours
    b = AutoModelForCausalLM.from_pretrained(sys.argv[2])(tokens).logits
print(float((a - b).abs().max()), float(a.abs().max()))
"""


def python(code: str, *args: str, timeout: float = 3600) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{code.strip().splitlines()[0]} ...: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def make_hf(directory: Path, runs: str) -> Path:
    if (directory / "config.json").is_file():  # made by an earlier call with the same --work
        return directory
    vocab = int(_common.plan_for(["model=tiny", "optimizer=sgd"], bm.WORLD, runs).model.vocab_size)
    python(MAKE_HF, str(directory), json.dumps({**HF_SHAPE, "vocab_size": vocab}))
    return directory


def measure_load(name: str, hf_dir: Path, runs: Path, opts) -> dict:
    """build_memory.measure for an init_from run (its run directories kept in `runs`)."""
    model, layout = [f"model.init_from={hf_dir}", "optimizer=sgd"], LAYOUTS[name]
    planned = bm.planned_per_rank(model + layout + bm.RUN, str(runs / "plans"))
    skip = bm._skip(max(planned.values()), opts.need_gib)
    if skip:
        return {"layout": f"hf_{name}", "skipped": skip}
    base = bm.train_and_sample(opts.usp, bm.BASELINE + ["optimizer=sgd"] + layout + bm.RUN, runs, f"{name}-baseline",
                               opts)
    big = bm.train_and_sample(opts.usp, model + layout + bm.RUN, runs, name, opts)
    if "stopped" in base or "stopped" in big:
        return {"layout": f"hf_{name}", "skipped": f"stopped ({base.get('stopped') or big.get('stopped')})"}
    rows = bm.rank_rows(big, base, planned)
    from usp.run.files import metrics_path, read_jsonl

    first = next(r["loss"] for r in read_jsonl(metrics_path(runs / name)) if r.get("step") == 1 and "loss" in r)
    theirs = float(python(FIRST_LOSS, str(runs / name), str(hf_dir)))
    return {"layout": f"hf_{name}", "overrides": model + layout + bm.RUN, "ranks": rows, "stopped": None,
            "malloc_mmap_threshold": opts.malloc_mmap_threshold, "max_ratio": max(r["ratio"] for r in rows),
            "max_net_gib": max(r["net_gib"] for r in rows), "planned_peak_gib": max(planned.values()),
            "first_loss": first, "transformers_loss": theirs, "loss_rel_diff": abs(first - theirs) / theirs}


def measure_export(run: Path, baseline_run: Path, work: Path, shard_mb: float) -> dict:
    out: dict = {"shard_mb": shard_mb}
    sources = {"export": run, "baseline_export": baseline_run}
    targets = {key: work / f"export_{key}_{shard_mb:g}" for key in sources}
    for key, source in sources.items():
        target = targets[key]
        started = time.perf_counter()
        m = json.loads(python(MEASURED_EXPORT, "export", str(source), "--format", "hf", "--shard-mb", str(shard_mb),
                              "--out", str(target), "--force"))
        out[key] = {"peak_gib": m["peak"] / bm.GIB, "growth_gib": (m["peak"] - m["base"]) / bm.GIB,
                    "files": len(list(target.glob("*.safetensors"))), "seconds": time.perf_counter() - started}
    out["peak_above_baseline_export_gib"] = out["export"]["peak_gib"] - out["baseline_export"]["peak_gib"]
    diff, scale = python(LOGITS, str(run), str(targets["export"])).split()
    out["logits_max_abs_diff"], out["logits_max_abs"] = float(diff), float(scale)
    return out


def lines_for(results: list[dict], exports: list[dict]) -> list[str]:
    lines = [line for r in results for line in bm.lines_for(r)]
    for r in results:
        if "first_loss" in r:
            lines.append(f"{r['layout']}: first loss {r['first_loss']:.6f}, transformers {r['transformers_loss']:.6f} "
                         f"(relative difference {r['loss_rel_diff']:.1e})")
    for e in exports:
        lines.append(f"export --format hf --shard-mb {e['shard_mb']:g}: peak {e['export']['peak_gib']:.2f} GiB, "
                     f"{e['export']['growth_gib']:.2f} GiB above its baseline after imports, "
                     f"{e['peak_above_baseline_export_gib']:.2f} GiB above the model=tiny export's peak "
                     f"({e['baseline_export']['peak_gib']:.2f} GiB); {e['export']['files']} files "
                     f"in {e['export']['seconds']:.0f} s; "
                     f"transformers' logits vs usp's: max |diff| {e['logits_max_abs_diff']:.1e} "
                     f"(max |logit| {e['logits_max_abs']:.2f})")
    return lines


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--shard-mb", nargs="+", type=float, default=[500, 5000], help="export file sizes to measure")
    p.add_argument("--usp", default=str(Path(sys.executable).parent / "usp"))
    p.add_argument("--need-gib", type=float, default=None, help="MemAvailable required before each layout")
    p.add_argument("--min-available-gib", type=float, default=1.5)
    p.add_argument("--malloc-mmap-threshold", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per `usp train`")
    p.add_argument("--work", default=None, help="keep the checkpoint, runs and exports here (default: a temporary "
                                                 "directory, removed); an HF checkpoint already there is reused")
    opts = p.parse_args()
    with (contextlib.nullcontext(opts.work) if opts.work else tempfile.TemporaryDirectory(prefix="usp-hf-io-")) as tmp:
        work = Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        hf_dir = make_hf(work / "hf_llama_0.5b", str(work / "plans"))
        results = [measure_load(name, hf_dir, work, opts) for name in opts.layouts]
        measured = [r for r in results if "first_loss" in r]
        exports = []
        if measured:
            name = measured[0]["layout"].removeprefix("hf_")
            exports = [measure_export(work / name, work / f"{name}-baseline", work, mb) for mb in opts.shard_mb]
    _common.emit({"machine": _common.machine(), "results": results, "exports": exports}, opts,
                 lines_for(results, exports))


if __name__ == "__main__":
    main()
