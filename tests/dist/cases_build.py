"""Sharded build checks, one torchrun launch (4 processes), by tests/e2e/test_build.py.

Every rank builds its part of the model exactly as the trainer does (usp/engine/parallel/build.py:
meta device, parallelize, allocate this rank's shards, initialise) from a real plan, then:
- memory (first, while the process's high-water mark is still the start-up's): the growth of this
  process's VmHWM (/proc/self/status, the kernel's counter) over the build, next to the whole
  model's bytes and this rank's share; the same for a build that loads a Hugging Face checkpoint
  of that size (model.init_from: each rank reads only its part), the high-water mark reset first
  (/proc/self/clear_refs);
- values: every parameter this rank holds, made whole (DTensor.full_tensor(), a collective),
  equals a single-process eager build of the same model (torch.equal, bit for bit); expert-parallel
  slices equal their rows; the ranks together cover every parameter of the model; the RoPE tables
  (buffers, computed when the shards are allocated) equal the ones the model's args give, Llama 3's
  frequency scaling included. The same for a Hugging Face checkpoint loaded into the shards
  (model.init_from) against one process's load;
- logits: a DeepSeek-V3 (with and without YaRN), Qwen3 or Qwen3-MoE checkpoint built under FSDP2 x TP2
  (x EP2 with experts) gives transformers' logits, gathered over tp."""
from __future__ import annotations

import gc
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from usp.engine.startup_gc import pause  # noqa: E402

pause()  # the imports below run without collections; run_cases freezes what they made

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from tests.dist.harness import run_cases  # noqa: E402
from tests.dist.parity import plan_dict  # noqa: E402
from usp.engine.hf_checkpoint import load_hf_weights  # noqa: E402
from usp.engine.parallel.build import build_model, model_factory  # noqa: E402
from usp.engine.parallel.mesh import make_context  # noqa: E402
from usp.models.llama import Llama  # noqa: E402

# ~35.7 M parameters (143 MB in fp32), the largest one the 4096 x 512 embedding (8 MB): over 4 FSDP
# ranks a rank's share is 36 MB. Building the whole model first (what the engine did before) grows
# a rank's peak by at least the whole model.
MEMORY_MODEL = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.ffn_dim=2048", "train.seq_len=64"]
PP = ["model.tie_embeddings=false", "model.n_layers=4", "train.micro_batch=4"]
TIED_PP = ["model.tie_embeddings=true", "model.n_layers=4", "train.micro_batch=4"]
MOE = ["model=moe_tiny"]
# Llama 3's RoPE scaling with a short original context: at head_dim 16 (or 64) its wavelengths fall in all
# three bands, so tables computed without it differ
LLAMA3 = ["model.rope_type=llama3", "model.rope_factor=8.0", "model.rope_low_freq_factor=1.0",
          "model.rope_high_freq_factor=4.0", "model.rope_original_max_positions=32"]
ONE = ["parallelism.dp_replicate=1"]
LAYOUTS = {
    "fsdp": ONE + ["parallelism.dp_shard=4"],
    "fsdp_x_tp": ONE + ["parallelism.dp_shard=2", "parallelism.tp=2"],  # FSDP2 over TP: _StridedShard dims
    "fsdp_x_tp_padded_vocab": ONE + ["parallelism.dp_shard=2", "parallelism.tp=2", "model.vocab_size=4099"],
    "hsdp": ["parallelism.dp_replicate=2", "parallelism.dp_shard=2"],
    "ddp": ["parallelism.dp_replicate=4"],  # replicated: the whole model is allocated before the DDP wrap
    "zero1_x_tp": ["parallelism.dp_replicate=2", "parallelism.tp=2", "parallelism.zero1=true"],
    "cp_x_fsdp": ONE + ["parallelism.dp_shard=2", "parallelism.cp=2"],
    "fsdp_recompute_compile": ONE + ["parallelism.dp_shard=4", "train.recompute=full", "train.compile=true"],
    "ep_x_fsdp": MOE + ONE + ["parallelism.dp_shard=4", "parallelism.ep=2"],
    "ep_x_tp": MOE + ONE + ["parallelism.dp_shard=2", "parallelism.ep=2", "parallelism.tp=2"],
    "pp_x_fsdp": PP + ONE + ["parallelism.pp=2", "parallelism.dp_shard=2"],
    "pp_zbv_x_tp": PP + ONE + ["parallelism.pp=2", "parallelism.tp=2", "parallelism.pp_schedule=zbv",
                               "parallelism.pp_virtual_stages=2"],
    "tied_pp_x_tp": TIED_PP + ONE + ["parallelism.pp=2", "parallelism.tp=2"],
    "ep_x_pp": MOE + PP + ONE + ["parallelism.pp=2", "parallelism.dp_shard=2", "parallelism.ep=2"],
    "llama3_rope_pp_x_tp": LLAMA3 + PP + ONE + ["parallelism.pp=2", "parallelism.tp=2"],
}
# FP8 (first in parallelize's order: the blocks' linears become torchao Float8Linear on the meta
# model); train.fp8 set in the plan after planning, as tests/engine/test_fp8_engine.py does (CPU _scaled_mm)
FP8_LAYOUTS = {"fp8_fsdp": ONE + ["parallelism.dp_shard=4"]}
# model.init_from: a tiny transformers Llama / Mixtral saved on the fly (byte vocabulary of 511 rows:
# padded to 512 under tp 2, the padding rows keep usp's init)
HF_DIMS = ["data.tokenizer=bytes", "model.vocab_size=511", "model.dim=64", "model.ffn_dim=96", "model.n_layers=4",
           "model.n_heads=4", "model.n_kv_heads=2"]
HF_LAYOUTS = {
    "hf_fsdp_x_tp": ONE + ["model.tie_embeddings=true", "parallelism.dp_shard=2", "parallelism.tp=2"],
    "hf_tied_pp_x_tp": ONE + ["model.tie_embeddings=true", "parallelism.pp=2", "parallelism.tp=2",
                              "train.micro_batch=4"],
    "hf_mixtral_ep_x_fsdp": ONE + ["model=moe_tiny", "model.tie_embeddings=false", "parallelism.dp_shard=4",
                                   "parallelism.ep=2"],
    # no model.rope_* key: the scaling comes from the checkpoint's config.json
    "hf_llama3_fsdp_x_tp": ONE + ["model.tie_embeddings=true", "parallelism.dp_shard=2", "parallelism.tp=2"],
}


def planned(overrides: list[str], tmp: str, train: dict | None = None) -> dict:
    """Rank 0 plans (and prepares the dataset, once), the others receive its plan."""
    box = [plan_dict(overrides, dist.get_world_size(), tmp, train) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def vm_hwm_bytes() -> int:
    """This process's peak resident set (VmHWM), as the kernel counts it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_vm_hwm() -> None:
    """Set this process's VmHWM to its current resident set (Linux: 5 > /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def build_memory(tmp: str, init_from: str | None = None) -> dict:
    plan = planned(ONE + ["parallelism.dp_shard=4"] + (["data.tokenizer=bytes", f"model.init_from={init_from}"]
                                                      if init_from else MEMORY_MODEL), tmp)
    ctx = make_context(plan)
    whole = model_factory(plan, ctx)()  # on the meta device: shapes only
    whole_bytes = sum(p.numel() * 4 for p in whole.parameters())
    largest = max(p.numel() * 4 for p in whole.parameters())
    gc.collect()
    dist.barrier()
    reset_vm_hwm()
    before = vm_hwm_bytes()
    parts = build_model(plan, ctx)
    growth = vm_hwm_bytes() - before
    local = sum(_local(p).numel() * _local(p).element_size() for p in parts.parameters())
    del parts
    gc.collect()
    stats = torch.tensor([growth, local], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {"whole_model_bytes": whole_bytes, "largest_param_bytes": largest,
            "max_rank_growth_bytes": int(stats[0]), "max_rank_local_bytes": int(stats[1])}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def reference(plan: dict, ctx, init_from: str | None = None) -> Llama:
    """One process's eager build of the same model (same shapes, tensor parallelism's padded vocab
    included), initialised by the model itself or loaded from the checkpoint whole."""
    shape = model_factory(plan, ctx)()
    model = Llama(shape.args, max_seq_len=shape.max_seq_len)
    model.init_weights(int(plan.config.train.seed))
    if init_from:
        load_hf_weights(model, init_from, seed=int(plan.config.train.seed))
    return model


def compare(overrides: list[str], tmp: str, init_from: str | None = None, train: dict | None = None) -> dict:
    plan = planned(overrides + ([f"model.init_from={init_from}"] if init_from else []), tmp, train)
    ctx = make_context(plan)
    parts = build_model(plan, ctx)
    reference_model = reference(plan, ctx, init_from)
    ref = dict(reference_model.named_parameters())
    tables = reference_model.args.rope_tables(reference_model.max_seq_len)  # straight from the args
    names, unequal, meta = set(), [], 0
    for module in parts.stage_modules:
        bare = getattr(module, "module", module)  # DDP wraps; FSDP2 and TP work in place
        for table, expected in zip(("rope_cos", "rope_sin"), tables, strict=True):
            if not torch.equal(getattr(bare, table), expected):
                unequal.append(table)
        for name, p, _, rows in bare.full_parameters():
            meta += p.is_meta or _local(p).is_meta
            whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if not torch.equal(whole, ref[name][rows].detach()):
                unequal.append(name)
            names.add(name)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(names), unequal, meta))
    covered = set().union(*(set(n) for n, _, _ in everyone))
    return {"unequal": sorted({n for _, u, _ in everyone for n in u}), "meta_params": sum(m for *_, m in everyone),
            "missing": sorted(set(ref) - covered), "compared": len(covered), "n_ref": len(ref),
            "local_names_rank0": len(names), "rope_type": plan.config.model.rope_type}


# MEMORY_MODEL's shape as a Hugging Face checkpoint (untied: the LM head is read too): 143 MB in fp32
HF_MEMORY_DIMS = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=4096)


def make_hf(tmp: str, kind: str, **shape) -> str:
    """Rank 0 saves a random tiny transformers model (`shape` replaces its dims); every rank gets its path."""
    path = [os.path.join(tmp, f"hf_{kind}{'_sized' if shape else ''}")]
    if dist.get_rank() == 0:
        from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

        torch.manual_seed(0)
        dims = {**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.1,
                       vocab_size=511), **shape}
        if kind == "llama3":  # Llama 3's RoPE scaling, as LLAMA3 above
            dims["rope_parameters"] = {"rope_type": "llama3", "rope_theta": dims.pop("rope_theta"), "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32}
        if kind in ("llama", "llama3"):
            model = LlamaForCausalLM(LlamaConfig(**dims, tie_word_embeddings=not shape))
        else:
            model = MixtralForCausalLM(MixtralConfig(**dims, tie_word_embeddings=False, num_local_experts=4,
                                                     num_experts_per_tok=2))
        model.save_pretrained(path[0])
    dist.barrier()
    return path[0]


# Checkpoints of tests/engine/test_hf_checkpoint.py (DeepSeek-V3: latent attention, a dense first block, sigmoid
# group routing, a shared expert, with and without YaRN; Qwen3 with QK-norm; Qwen3-MoE) under FSDP2 x TP2 (x EP2
# with experts), their logits against transformers': {case: (kind, ep)}
HF_LOGITS = {"hf_deepseek_v3_logits": ("deepseek_v3", 2), "hf_deepseek_v3_yarn_logits": ("deepseek_v3_yarn", 2),
             "hf_qwen3_logits": ("qwen3", 1), "hf_qwen3_moe_logits": ("qwen3_moe", 2)}
HF_LOGITS_LAYOUT = ONE + ["data.tokenizer=bytes", "parallelism.dp_shard=2", "parallelism.tp=2"]


def logits_vs_transformers(tmp: str, kind: str, ep: int) -> dict:
    """The sharded model's first forward (every rank the same 2 x 48 tokens, as the first step's
    forward sees its own), the logits gathered over tp (DTensor.full_tensor(), the padded vocabulary
    cut), against transformers' logits of the same checkpoint: the max |difference| over the ranks."""
    from tests.engine.test_hf_checkpoint import hf_logits
    from tests.engine.test_hf_checkpoint import make_hf as make_hf_kind

    box = [str(make_hf_kind(Path(tmp) / f"hf_{kind}", kind, 511, tied=False)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    plan = planned(HF_LOGITS_LAYOUT + [f"parallelism.ep={ep}", f"model.init_from={box[0]}"], tmp)
    parts = build_model(plan, make_context(plan))
    model = parts.stage_modules[0]
    tokens = torch.randint(0, 511, (2, 48), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        out = model(tokens)
    logits = (out.full_tensor() if isinstance(out, DTensor) else out)[..., :511]
    expected = hf_logits(Path(box[0]), tokens)
    err = torch.tensor([(logits - expected).abs().max().item()], dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return {"max_abs_err": float(err), "logits_max": float(expected.abs().max()),
            "rope_type": plan.config.model.rope_type,
            "layout": [int(plan.degrees["dp_shard"]), int(plan.degrees["tp"]), int(plan.config.parallelism.ep)]}


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a broken case fails, not hangs
    box = [tempfile.mkdtemp(prefix="usp-build-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    tmp = box[0]
    cases = {"memory": lambda: build_memory(tmp)}  # first: the high-water mark is still the start-up's
    cases["hf_memory"] = lambda: build_memory(tmp, make_hf(tmp, "llama", **HF_MEMORY_DIMS))
    cases.update({name: (lambda ov=ov: compare(ov, tmp)) for name, ov in LAYOUTS.items()})
    fp8 = {"fp8": "tensorwise"}
    cases.update({name: (lambda ov=ov: compare(ov, tmp, train=fp8)) for name, ov in FP8_LAYOUTS.items()})
    for name, ov in HF_LAYOUTS.items():
        kind = "mixtral" if "mixtral" in name else "llama3" if "llama3" in name else "llama"
        cases[name] = lambda ov=HF_DIMS + ov, kind=kind: compare(ov, tmp, make_hf(tmp, kind))
    for name, (kind, ep) in HF_LOGITS.items():
        cases[name] = lambda kind=kind, ep=ep: logits_vs_transformers(tmp, kind, ep)
    run_cases(cases)


if __name__ == "__main__":
    main()
