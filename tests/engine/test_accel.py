"""What a GPU run would choose (usp/engine/accel.py, usp/engine/parallel/precision.py, launch env,
plan rules), checked on CPU: the GPU code paths themselves are unreachable here, their decisions are not."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_accel import plan_of
from usp.engine import accel
from usp.engine.parallel import precision
from usp.plan.plan import engine_support_errors

FSDP2 = ["cluster.procs_per_node=2", "parallelism.dp_replicate=1", "parallelism.dp_shard=2"]
DDP2 = ["cluster.procs_per_node=2", "parallelism.dp_replicate=2"]
NO_CUDA_WARNING = pytest.mark.filterwarnings("ignore:CUDA is not available")  # a cuda autocast object, built on CPU


def test_fsdp_on_gpu_uses_fsdp2_mixed_precision_policy_and_no_autocast():
    plan = plan_of("cluster=local_gpu", *FSDP2)
    assert plan.decisions.fsdp_mixed_precision
    policy = precision.fsdp_mp_policy(plan)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert isinstance(accel.autocast_context(plan, torch.device("cuda", 0)), type(accel.contextlib.nullcontext()))


@NO_CUDA_WARNING
def test_ddp_and_single_on_gpu_use_bf16_autocast():
    for overrides in (DDP2, []):
        plan = plan_of("cluster=local_gpu", *overrides)
        assert precision.fsdp_mp_policy(plan) is None
        ctx = accel.autocast_context(plan, torch.device("cuda", 0))
        assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16


@NO_CUDA_WARNING
def test_pipeline_with_fsdp_on_gpu_keeps_autocast():
    plan = plan_of("cluster=local_gpu", "cluster.procs_per_node=4", "parallelism.dp_replicate=1",
                   "parallelism.dp_shard=2", "parallelism.pp=2", "model.n_layers=4", "model.tie_embeddings=false")
    assert not plan.decisions.fsdp_mixed_precision
    assert isinstance(accel.autocast_context(plan, torch.device("cuda", 0)), torch.autocast)


def test_bf16_on_cpu_takes_the_gpu_recipe():
    """train.dtype=bf16 on CPU picks what a GPU picks, so the CPU parity matrix runs it."""
    fsdp = plan_of(*FSDP2, "train.dtype=bf16")
    assert precision.fsdp_mp_policy(fsdp).param_dtype == torch.bfloat16
    assert not isinstance(accel.autocast_context(fsdp, torch.device("cpu")), torch.autocast)
    ctx = accel.autocast_context(plan_of(*DDP2, "train.dtype=bf16"), torch.device("cpu"))
    assert isinstance(ctx, torch.autocast) and ctx.device == "cpu" and ctx.fast_dtype == torch.bfloat16


def test_autocast_caches_weight_copies_only_without_recompute():
    """A recomputed layer casts its weights again; a cache would hold every layer's bf16 copy
    through the loss (measured: tests/e2e/test_memory_calibration.py's wide bf16 layouts)."""
    for recompute, cache in (("none", True), ("full", False), ("selective", False)):
        ctx = accel.autocast_context(plan_of(*DDP2, "train.dtype=bf16", f"train.recompute={recompute}"),
                                     torch.device("cpu"))
        assert ctx._cache_enabled is cache, recompute


def test_cpu_and_fp32_stay_fp32():
    for plan, device in ((plan_of(*FSDP2), "cpu"), (plan_of("cluster=local_gpu", *FSDP2, "train.dtype=fp32"), "cuda")):
        assert precision.fsdp_mp_policy(plan) is None
        assert not isinstance(accel.autocast_context(plan, torch.device(device)), torch.autocast)


def test_fused_adamw_only_on_accelerators():
    assert accel.fused_adamw("cuda") and accel.fused_adamw("xpu") and not accel.fused_adamw("cpu")


def test_sdpa_prefers_flash_on_cuda_only():
    from torch.nn.attention import SDPBackend

    assert accel.sdpa_backends("cuda")[0] == SDPBackend.FLASH_ATTENTION
    # cuDNN's kernel ran in a checkpointed forward despite flash's priority and flash's at its recomputation
    # (torch 2.11, H200): backward refused the mismatched saved tensors, so cuDNN is not offered
    assert SDPBackend.CUDNN_ATTENTION not in accel.sdpa_backends("cuda")
    assert accel.sdpa_backends("cpu") is None and accel.attention_core("sdpa", "cpu") is None


def test_cuda_sdpa_wrapper_matches_plain_sdpa_with_gqa():
    """The wrapper's arithmetic (GQA, causal), run on CPU tensors (the kernel priority is CUDA's)."""
    core = accel.attention_core("sdpa", "cuda")
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(core(q, k, v), ref)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_attn_missing_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install 'usp\[gpu\]'.*model.attention=sdpa"):
        accel.attention_core("flash_attn", "cuda")


def test_unknown_attention_is_refused():
    """At plan time (the engine installs what the plan recorded)."""
    errors = engine_support_errors(plan_of("model.attention=flash", obj=True))
    assert [e.key for e in errors] == ["model.attention"]


def test_set_attention_leaves_cpu_models_alone():
    from usp.models.llama import Llama, LlamaArgs

    model = Llama(LlamaArgs(vocab_size=64), max_seq_len=16)
    accel.set_attention(model, "sdpa", "cpu")
    assert all(b.attention.core_attention is None for b in model.layers.values())
    accel.set_attention(model, "sdpa", "cuda")  # what a GPU run installs (not run here)
    assert all(b.attention.core_attention is not None for b in model.layers.values())
