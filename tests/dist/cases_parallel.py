"""Parity matrix worker: every layout of LAYOUTS[world] trains the tiny model next to its
single-process reference; rank 0 records the comparison. Launched by tests/e2e/test_parallel.py.
On 2 ranks it also records the dtypes FSDP2's bf16 mixed-precision policy trains with."""
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
from tests.dist.layouts import FP8_NARROW, LAYOUTS  # noqa: E402
from tests.dist.parity import plan_dict, verify_case  # noqa: E402
from usp.engine.parallel.mesh import make_context  # noqa: E402
from usp.engine.trainer import Trainer  # noqa: E402

# No memory probe (tests/e2e/test_memory_calibration.py covers it) and one validation batch: both
# cost time on every rank of every layout and are not compared here. Three steps: the losses of
# steps 2 and 3 and the final parameters follow two optimizer updates (gradients, their reduction
# and the sharded AdamW states); most of a TP or PP layout's time is its steps' collectives (~2.5 s a
# step for tp x pp on 4 ranks sharing 2 cores, measured), so each step more costs every layout.
STEPS = ["train.steps=3", "train.seq_len=64", "optimizer.warmup_steps=2", "train.measure_memory=false",
         "train.eval_batches=1"]
# bf16 matmuls run ~10x slower than fp32 on these CPUs (no bf16 units): the bf16 layouts train
# 2 steps on sequences of 32 (the 2.4e-3 half-batch error their tolerance must catch shows at step 1).
BF16_STEPS = ["train.steps=2", "train.seq_len=32", "optimizer.warmup_steps=2", "train.measure_memory=false",
              "train.eval_batches=1"]
FP8_STEPS = [o for o in STEPS if not o.startswith("train.seq_len=")] + FP8_NARROW  # (tests/dist/layouts.py)


def steps_for(layout: str) -> list[str]:
    return BF16_STEPS if layout.startswith("bf16_") else STEPS


def _dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def bf16_fsdp_dtypes() -> dict:
    """Under train.dtype=bf16 an FSDP2 block computes with bf16 weights, while the sharded
    parameters, the gradients the optimizer sees and AdamW's moments stay fp32 (fp32 master
    weights, gradients reduced in fp32): the recipe a GPU run uses, observed on gloo."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = plan_dict(BF16_STEPS + LAYOUTS[2]["bf16_fsdp_mixed_precision"], 2, tmp)
        trainer = Trainer(plan, make_context(plan), write_outputs=False)
        forward, grads = [], []
        wq = trainer.parts.stage_modules[0].layers["0"].attention.wq
        hooks = [wq.register_forward_pre_hook(lambda m, args: forward.append(m.weight)),
                 trainer.optimizers[0].register_step_pre_hook(
                     lambda opt, args, kwargs: grads.extend(p.grad for g in opt.param_groups for p in g["params"]
                                                            if p.grad is not None))]
        trainer.fit()
        for hook in hooks:
            hook.remove()
        params = list(trainer.parts.parameters())
        moments = [v for st in trainer.optimizers[0].state.values() for k, v in st.items() if k != "step"]
        result = {"forward_weight": _dtypes(forward), "params": _dtypes(params), "grads": _dtypes(grads),
                  "moments": _dtypes(moments), "n_forward": len(forward), "n_grads": len(grads),
                  "losses": [h["loss"] for h in trainer.history]}
        del trainer
    return result

def tp_recompute_collectives() -> dict:
    """The sequence-parallel collectives each recompute mode runs again in the backward, per layer: usp's
    own TP plan and recompute wrappers on a 2-layer model, the functional collectives counted as they
    dispatch (the planner's usp.perf.timing._tp_reruns; tests/e2e/test_parallel.py compares)."""
    import collections

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from usp.engine.parallel.recompute import apply_recompute
    from usp.engine.parallel.tensor import apply_tensor_parallel
    from usp.models.llama import Llama, LlamaArgs

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if "_c10d_functional" in name:
                self.calls[name.split(".")[1]] += 1
            return func(*args, **(kwargs or {}))

    mesh, layers, backward = init_device_mesh("cpu", (2,)), 2, {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = Llama(LlamaArgs(n_layers=layers, tie_embeddings=False))
        apply_tensor_parallel(model, mesh, model.args.vocab_size)
        apply_recompute(model, mode)
        logits = model(torch.randint(0, model.args.vocab_size, (2, 16)))
        loss = logits.full_tensor().float().square().mean()
        count = Count()
        with count:
            loss.backward()
        backward[mode] = count.calls
    return {mode: [(backward[mode][kind] - backward["none"][kind]) / layers
                   for kind in ("all_gather_into_tensor", "reduce_scatter_tensor")] for mode in ("selective", "full")}


if __name__ == "__main__":
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))  # a broken case fails, not hangs
    cases = {name: (lambda name=name, ov=overrides: verify_case(steps_for(name) + ov, world))
             for name, overrides in LAYOUTS[world].items()}
    if world == 2:
        cases["bf16_fsdp_dtypes"] = bf16_fsdp_dtypes
        cases["tp_recompute_collectives"] = tp_recompute_collectives
        # FP8 (torch's CPU _scaled_mm) under FSDP2 ZeRO-3 against one FP8 process: FSDP gathers the weights,
        # each Float8Linear casts them (tests/e2e/test_parallel.py: test_fp8_under_fsdp_tracks_one_process)
        cases["fp8_fsdp"] = lambda: verify_case(FP8_STEPS + ["parallelism.dp_replicate=1", "parallelism.dp_shard=2"],
                                                2, {"fp8": "tensorwise"})
    run_cases(cases)
