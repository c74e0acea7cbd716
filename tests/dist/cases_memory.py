"""Planner memory calibration worker: each layout of MEMORY_LAYOUTS trains the tiny model (default
config: seq_len 128, global batch 16) for 2 steps with train.measure_memory on; the second step
runs under the memory probe (usp/engine/observe/memory_probe.py). Rank 0 records, per layout, the
planner's tensor memory (its total without the overhead allowance) for the peak stage and the
measured peak (max over ranks). Single-process layouts run on rank 0 only, in the same launch.
Launched by tests/e2e/test_memory_calibration.py and scripts/bench/memory.py."""
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from usp.engine.startup_gc import pause  # noqa: E402

pause()  # the imports below run without collections; run_cases freezes what they made

import torch.distributed as dist  # noqa: E402

from tests.dist.harness import run_cases  # noqa: E402

STEPS = ["train.steps=2", "optimizer.warmup_steps=1", "train.eval_batches=1", "train.measure_memory=true"]
SINGLE = ["parallelism.dp_replicate=1"]
# name -> (world size, overrides)
MEMORY_LAYOUTS = {
    "single": (1, SINGLE),
    "recompute_full": (1, SINGLE + ["train.recompute=full"]),
    "recompute_selective": (1, SINGLE + ["train.recompute=selective"]),
    "ddp": (2, ["parallelism.dp_replicate=2"]),
    "zero1": (2, ["parallelism.dp_replicate=2", "parallelism.zero1=true"]),
    "fsdp_zero3": (2, ["parallelism.dp_replicate=1", "parallelism.dp_shard=2"]),
    "fsdp_zero2": (2, ["parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                       "parallelism.reshard_after_forward=false"]),
    "tp": (2, ["parallelism.dp_replicate=1", "parallelism.tp=2"]),
}

# More layouts for scripts/bench/memory.py --extra (not asserted by the test): a byte vocabulary
# (V = 256) moves the peak from the loss backward to a layer's backward; accumulation, MoE, PP.
BYTES = ["data.tokenizer=bytes"]
PP = ["model.tie_embeddings=false", "model.n_layers=4", "parallelism.dp_replicate=1", "parallelism.pp=2",
      "train.micro_batch=4"]
EXTRA_LAYOUTS = {
    "single_V256": (1, SINGLE + BYTES),
    "recompute_full_V256": (1, SINGLE + BYTES + ["train.recompute=full"]),
    "recompute_selective_V256": (1, SINGLE + BYTES + ["train.recompute=selective"]),
    "moe_single": (1, SINGLE + ["model=moe_tiny"]),
    "ddp_grad_accum": (2, ["parallelism.dp_replicate=2", "train.micro_batch=4"]),
    "ddp_V256": (2, ["parallelism.dp_replicate=2"] + BYTES),
    "fsdp_zero3_V256": (2, ["parallelism.dp_replicate=1", "parallelism.dp_shard=2"] + BYTES),
    "fsdp_zero2_V256": (2, ["parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                            "parallelism.reshard_after_forward=false"] + BYTES),
    "fsdp_zero3_grad_accum": (2, ["parallelism.dp_replicate=1", "parallelism.dp_shard=2", "train.micro_batch=4"]),
    "tp_V256": (2, ["parallelism.dp_replicate=1", "parallelism.tp=2"] + BYTES),
    "tp_recompute_selective": (2, ["parallelism.dp_replicate=1", "parallelism.tp=2", "train.recompute=selective"]),
    "pp_1f1b": (2, PP + ["parallelism.pp_schedule=1f1b"]),
    "pp_afab": (2, PP + ["parallelism.pp_schedule=afab"]),
    "pp_zbv": (2, PP + ["parallelism.pp_schedule=zbv", "parallelism.pp_virtual_stages=2"]),
    # tied embeddings under pp: the last stage holds the embedding's copy (+ gradient, AdamW states)
    "tied_pp_1f1b": (2, ["model.tie_embeddings=true", *PP[1:], "parallelism.pp_schedule=1f1b"]),
    "tied_pp_zbv": (2, ["model.tie_embeddings=true", *PP[1:], "parallelism.pp_schedule=zbv",
                        "parallelism.pp_virtual_stages=2"]),
    "cp": (2, ["parallelism.dp_replicate=1", "parallelism.cp=2"]),
}

# CP inside a pipeline and ZeRO-3 with a zero-bubble schedule (4 ranks; scripts/bench/memory.py
# --cp-pp launches them on their own; not asserted).
CP_PP_LAYOUTS = {
    "cp_x_pp": (4, PP + ["parallelism.cp=2"]),
    "cp_x_pp_interleaved_1f1b": (4, PP + ["parallelism.cp=2", "parallelism.pp_schedule=interleaved_1f1b",
                                          "parallelism.pp_virtual_stages=2"]),
    "zero3_x_pp_zbv": (4, PP + ["parallelism.dp_shard=2", "train.micro_batch=2", "parallelism.pp_schedule=zbv",
                                "parallelism.pp_virtual_stages=2"]),
}

# ZeRO-1 / ZeRO-2 with TP or PP (4 ranks; tests/e2e/test_memory_calibration.py and scripts/bench/memory.py
# --zero launch them on their own), next to the replicated layout they replace.
ZERO_TP_PP = ["parallelism.dp_replicate=2", "parallelism.zero1=true"]
ZERO_LAYOUTS = {
    "replicate_x_tp": (4, ["parallelism.dp_replicate=2", "parallelism.tp=2"]),
    "zero1_x_tp": (4, ZERO_TP_PP + ["parallelism.tp=2"]),
    "zero1_x_tp_grad_accum": (4, ZERO_TP_PP + ["parallelism.tp=2", "train.micro_batch=4"]),
    "zero1_x_pp": (4, ZERO_TP_PP + PP[:2] + ["parallelism.pp=2", "train.micro_batch=4"]),
    "zero2_x_tp": (4, ["parallelism.dp_replicate=1", "parallelism.dp_shard=2", "parallelism.tp=2",
                       "parallelism.reshard_after_forward=false"]),
}


# bf16 on CPU (train.dtype=bf16): autocast around forward + loss, or FSDP2's bf16 parameters, as on a
# GPU (fp32 parameters, gradients and AdamW states; bf16 weight copies). tests/e2e/test_memory_calibration.py
# and scripts/bench/memory.py --bf16 launch them on their own (2 ranks).
BF16 = ["train.dtype=bf16"]
WIDE = ["model.dim=512", "model.ffn_dim=2048", "model.n_layers=4", "model.n_heads=8", "train.seq_len=32",
        "train.global_batch=4"] + BYTES
BF16_LAYOUTS = {
    "single_bf16": (1, SINGLE + BF16),
    "recompute_full_bf16": (1, SINGLE + BF16 + ["train.recompute=full"]),
    "ddp_bf16": (2, ["parallelism.dp_replicate=2"] + BF16),
    "fsdp_zero3_bf16": (2, ["parallelism.dp_replicate=1", "parallelism.dp_shard=2"] + BF16),
    "tp_bf16": (2, ["parallelism.dp_replicate=1", "parallelism.tp=2"] + BF16),
    # weights outweigh activations (as in an 8B model at a short micro batch): autocast's copies decide the peak
    "wide_recompute_full_grad_accum_bf16": (1, SINGLE + BF16 + WIDE + ["train.recompute=full", "train.micro_batch=2"]),
}


def measure_layout(world: int, overrides: list[str]) -> dict:
    from tests.dist.parity import plan_dict
    from usp.engine.observe.memory_probe import optimizer_state_tensors, storage_bytes
    from usp.engine.parallel.mesh import make_context
    from usp.engine.trainer import Trainer

    if world == 1 and dist.get_rank() != 0:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        plan = plan_dict(STEPS + overrides, world, tmp)
        memory = plan.memory
        trainer = Trainer(plan, make_context(plan), write_outputs=False)
        summary = trainer.fit()
        record = next(r for r in trainer.history if "memory_measured_gib" in r)
        optimizer_bytes = storage_bytes(optimizer_state_tensors(trainer.optimizers))  # this rank's share
        del trainer
    return {"world": world, "predicted_gib": summary["memory_predicted_peak_gib"],
            "predicted_total_gib": summary["memory_predicted_peak_total_gib"],
            "measured_gib": summary["memory_measured_peak_gib"], "measured_by": summary["memory_measured_by"],
            "rank0_measured_gib": record["memory_measured_gib"], "rank0_predicted_gib": record["memory_predicted_gib"],
            "measured_breakdown_gib": record["memory_measured_breakdown_gib"],
            "predicted_breakdown_gib": record["memory_predicted_breakdown_gib"],
            "peak_phase": memory.peak.peak_phase,
            "optimizer_state_bytes": optimizer_bytes,
            "step_time_measured_s": summary.get("step_time_measured_s"),
            "step_time_predicted_s": summary.get("step_time_predicted_s")}


if __name__ == "__main__":
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a broken case fails, not hangs
    layouts = {**MEMORY_LAYOUTS, **EXTRA_LAYOUTS} if "--extra" in sys.argv else MEMORY_LAYOUTS
    layouts = ZERO_LAYOUTS if "--zero" in sys.argv else layouts
    layouts = CP_PP_LAYOUTS if "--cp-pp" in sys.argv else layouts
    layouts = BF16_LAYOUTS if "--bf16" in sys.argv else layouts
    cases = {name: (lambda w=w, ov=ov: measure_layout(w, ov)) for name, (w, ov) in layouts.items() if w <= world}
    run_cases(cases)
