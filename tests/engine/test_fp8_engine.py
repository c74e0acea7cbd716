"""The engine's FP8 path (usp/engine/parallel/fp8.py) and train.compile=auto, on CPU for real: torch's
CPU _scaled_mm runs torchao's float8 training here (slowly: no FP8 units), so the conversion, the
training loop and the checkpoint keys are checked here; its speed only on a GPU (scripts/bench/
gpu_session.py). The planner refuses train.fp8 on CPU, so these tests switch it on in the plan the
engine reads, after planning: what `usp train` would hand the engine on a GPU. torchao comes with
`make setup` (tests/e2e/test_missing_packages.py checks the engine without it)."""
from __future__ import annotations

import dataclasses
import tempfile

import pytest
import torch
from torch import nn

from tests.dist.layouts import FP8_NARROW
from tests.dist.parity import plan_dict
from usp.engine.parallel import mesh as udist
from usp.engine.parallel.fp8 import apply_fp8, convertible
from usp.engine.parallel.mesh import make_context
from usp.engine.parallel.parallelize import parallelize
from usp.engine.trainer import Trainer
from usp.models.llama import Llama, LlamaArgs
from usp.plan.plan import decisions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
# FP8_NARROW (tests/dist/layouts.py) says why these train a narrow model
RUN = ["model=tiny", *FP8_NARROW, "train.global_batch=8", "train.steps=4", "optimizer.warmup_steps=2",
       "train.log_interval=1", "train.measure_memory=false", "train.eval_batches=1"]


def float8_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def test_fp8_converts_the_blocks_linears_but_not_the_head_or_odd_sizes():
    model = Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=256, tie_embeddings=False))
    assert apply_fp8(model, "tensorwise") == 2 * 7  # wq, wk, wv, wo, w1, w2, w3 per block
    assert all(n.startswith("layers.") for n in float8_names(model)) and type(model.output) is nn.Linear
    odd = Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=40, vocab_size=256))  # 40: no multiple of 16
    assert apply_fp8(odd, "rowwise") == 2 * 4 and not any("feed_forward" in n for n in float8_names(odd))
    assert not convertible(nn.Linear(24, 32)) and convertible(nn.Linear(32, 48))


def _train(fp8: str, *overrides: str) -> tuple[list[float], Trainer]:
    with tempfile.TemporaryDirectory() as runs:
        # the rule refuses FP8 on CPU; the engine runs it all the same (torch's CPU _scaled_mm)
        plan = plan_dict([*RUN, *overrides, f"train.name=fp8_{fp8}"], 1, runs, train={"fp8": fp8})
        torch.manual_seed(1234)
        udist.init_process_group(plan)
        trainer = Trainer(plan, make_context(plan), write_outputs=False)
        trainer.fit()
        return [r["loss"] for r in trainer.history], trainer


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_next_to_fp32_with_unchanged_parameters_and_keys(recipe, shakespeare):
    """4 AdamW steps of the narrow tiny model: FP8 losses within 1e-3 of fp32's (measured 3.6e-5 tensorwise,
    8.6e-5 rowwise; the tiny model over 20 steps 1.6e-4 and 1.7e-4, docs/benchmarks.md); the parameters stay
    fp32 under the same names (checkpoints, exports)."""
    ref, plain = _train("off")
    losses, trainer = _train(recipe)
    assert len(losses) == len(ref) == 4
    assert max(abs(a - b) / b for a, b in zip(losses, ref)) < 1e-3, (losses, ref)
    assert losses != ref  # the matmuls did run in FP8
    model = trainer.parts.modules[0]
    assert len(float8_names(model)) == 7 * len(model.layers)  # every block linear
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert list(model.state_dict()) == list(plain.parts.modules[0].state_dict())


def test_compile_auto_wraps_blocks_on_cuda_only(shakespeare):
    """The planner resolves train.compile=auto (usp/contract/decide.py) to on for a CUDA plan, off for a CPU
    one, and parallelize compiles each block as the plan decided (torch.compile wraps lazily: nothing
    compiles here)."""
    with tempfile.TemporaryDirectory() as runs:
        plan = plan_dict(RUN, 1, runs)
    assert plan.config.train.compile == "auto"
    ctx = make_context(plan)
    for device, compiled in (("cpu", False), ("cuda", True)):
        model = Llama(LlamaArgs())
        on = dataclasses.replace(plan, device=device, decisions=decisions(plan.config, plan.degrees, device,
                                                                          plan.run_dir, plan.model.vocab_size))
        assert on.decisions.compile is compiled
        parallelize(model, on, ctx)
        kinds = {type(block).__name__ for block in model.layers.values()}
        assert kinds == ({"OptimizedModule"} if compiled else {"TransformerBlock"}), (device, kinds)
