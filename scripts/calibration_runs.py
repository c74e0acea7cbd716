"""Write calibration/at_scale/{llmfoundry,torchtitan}_runs.csv, the runs CSVs `usp calibrate` reads
(usp/perf/calibration/measured_runs.py: the format), from the verbatim tables beside them
(mosaic_llmfoundry_perf.csv, torchtitan_2024_12.csv; their sources: calibration/README.md).
tests/unit/test_calibration_time.py checks the committed files are this script's output.

    python scripts/calibration_runs.py          # rewrite both
    python scripts/calibration_runs.py --check  # exit 1 if a committed file differs
"""
from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

AT_SCALE = Path(__file__).resolve().parents[1] / "calibration" / "at_scale"
COLUMNS = ["id", "model", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tied", "mlp", "seq", "gpus",
           "cluster", "profile", "tp", "pp", "vp", "cp", "dp", "dp_kind", "pp_schedule", "gbs_seqs", "mbs", "gas",
           "recompute", "precision", "compile", "async_tp", "fp8_all_gather", "status", "mfu_pct", "tok_s_gpu", "use"]
# MPT shapes: llm-foundry scripts/train/yamls/pretrain/mpt-<size>.yaml @8c8dd48f (d_model, n_heads, n_layers);
# ffn 4 x d_model (GeLU), vocabulary 50,368, tied embeddings, MHA
MPT = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
       "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
# Llama 3.1 (Meta's config.json): layers, hidden, heads, kv heads, ffn, vocabulary; SwiGLU, untied
LLAMA = {"Llama 3.1 8B": (32, 4096, 32, 8, 14336, 128256), "Llama 3.1 70B": (80, 8192, 64, 8, 28672, 128256),
         "Llama 3.1 405B": (126, 16384, 128, 8, 53248, 128256)}
GPUS = {"h100_80gb": "slurm_h100", "a100_80gb": "a100_80gb", "a100_40gb": "a100_40gb"}


def llmfoundry() -> list[dict]:
    """MosaicML's MPT benchmark tables: FSDP FULL_SHARD over every GPU; MFU recomputed by usp calibrate from
    the tokens/s (its convention, 6N + 12Lhs, is llm-foundry's)."""
    out = []
    for i, r in enumerate(csv.DictReader(open(AT_SCALE / "mosaic_llmfoundry_perf.csv", encoding="utf-8"))):
        h, heads, layers = MPT[r["Model"]]
        fp8 = "fp8" in r["Precision"]
        out.append(dict(id=f"llmfoundry_{i}_{r['Model']}_{r['GPU']}_{r['# GPUs']}", model=f"mpt-{r['Model']}",
                        layers=layers, hidden=h, heads=heads, kv_heads=heads, ffn=4 * h, vocab=50368, tied="true",
                        mlp="gelu", seq=r["SeqLen (T)"], gpus=r["# GPUs"], cluster=GPUS[r["GPU"]], profile="llmfoundry",
                        tp=1, pp=1, cp=1, dp=r["# GPUs"], dp_kind="fsdp", gbs_seqs=r["GlobalBatchSize"],
                        mbs=r["MicroBatchSize"], gas=r["GradAccum"],
                        recompute="full" if r["Activation Checkpointing"] == "True" else "none",
                        precision="fp8" if fp8 else "bf16", status="ok", tok_s_gpu=r["Throughput (T/s/GPU)"],
                        use="eval_fp8" if fp8 else "fit"))
    return out


def torchtitan() -> list[dict]:
    """torchtitan's December 2024 H100 tables 1, 3, 4, 5: FSDP (no resharding under PP), selective = op-level
    SAC, Float8 with its FP8 all-gather under PP, one sequence per micro batch under PP; sequence 8,192 (the
    train_configs' default at 9dec370, not in the tables)."""
    out = []
    for i, r in enumerate(csv.DictReader(open(AT_SCALE / "torchtitan_2024_12.csv", encoding="utf-8"))):
        layers, h, heads, kv, ffn, vocab = LLAMA[r["model"]]
        tech, pp = r["techniques"], int(r["pp"])
        dp, gbs = int(r["fsdp"]), int(r["global_batch"])
        mbs = 1 if pp > 1 else gbs // dp
        out.append(dict(id=f"torchtitan_2024_12_{i}", model=r["model"], layers=layers, hidden=h, heads=heads,
                        kv_heads=kv, ffn=ffn, vocab=vocab, tied="false", mlp="swiglu", seq=r["seq_len"].split()[0],
                        gpus=r["gpus"], cluster="h100_500w", profile="torchtitan", tp=r["tp"], pp=pp,
                        vp=2 if "Interleaved" in r["pp_schedule"] else 1, cp=r["cp"], dp=dp,
                        dp_kind="fsdp_noreshard" if pp > 1 else "fsdp",
                        pp_schedule="interleaved_1f1b" if "Interleaved" in r["pp_schedule"] else "1f1b",
                        gbs_seqs=gbs, mbs=mbs, recompute=r["ac"], precision="fp8" if "Float8" in tech else "bf16",
                        compile="true" if "compile" in tech else "false",
                        async_tp="true" if "AsyncTP" in tech else "false",
                        fp8_all_gather="true" if "Float8" in tech and pp > 1 else "false", status="ok",
                        tok_s_gpu=r["tps_per_gpu"], use="fit"))
    return out


def render(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n", restval="")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


FILES = {"llmfoundry_runs.csv": llmfoundry, "torchtitan_runs.csv": torchtitan}


def main() -> int:
    stale = []
    for name, make in FILES.items():
        text, path = render(make()), AT_SCALE / name
        if "--check" in sys.argv:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path} ({text.count(chr(10)) - 1} runs)")
    if stale:
        print(f"out of date: {', '.join(stale)} (python scripts/calibration_runs.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
