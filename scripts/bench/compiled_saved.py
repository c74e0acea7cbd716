#!/usr/bin/env python
"""What one Llama block keeps for backward, tensor by tensor, as the engine runs it under bf16
autocast (fp32 parameters): eager, compiled (train.compile) or compiled with FP8 linears
(train.fp8, torchao's Float8Linear as usp/engine/parallel/fp8.py converts them); next to it the
planner's count (usp.perf.memory.compiled_block_bytes and the bf16 weight casts, _autocast_copies).
On CPU, no GPU: the tensors a compiled block saves are fixed when its joint graph is partitioned,
which happens at the first forward, so one forward under torch.autograd.graph.saved_tensors_hooks
lists them (no backward runs).

Measure at the shapes a plan uses (the defaults: the H100 session's 3B row, docs/benchmarks.md) and
with nothing else attached to the block: forward hooks on its submodules change what the
partitioner keeps (measured: they made it keep x + attention(x) in fp32 and FP8 copies of the
linears' inputs), so this script registers none. Parameters are not counted (they are alive
anyway); the block input is (it is the previous block's output, kept only for this block).
Measured 2026-11-27 (torch 2.13 CPU), compiled: Llama-3.2 1B at 8 x 2048 tokens 80,040 bytes per
token (the planner: 79,872), 3B at 2 x 2048 96,616 (96,256): the fp32 input, the bf16 norm
outputs, q/k/v, SDPA output, wo's output, w1/w3 outputs and w2's input, and every weight's bf16
cast; 3B FP8 tensorwise at 2 x 2048 67,944 (67,584): the same less the norm outputs, w2's input
and the casts (the fp32 weights themselves are saved). 1B at 1 x 64 and 1 x 256 tokens keeps the
same set. A compiled 3B block at 2 x 2048 takes ~3 minutes on 2 CPU cores (compile included).

    python scripts/bench/compiled_saved.py [--model llama3_2_3b] [--micro-batch 2] [--seq 2048]
        [--mode compiled|eager] [--fp8 off|tensorwise|rowwise] [--json]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

MIB = 2**20


def build_block(model: str, fp8: str):
    """One transformer block of the catalogue model, fp32 parameters, FP8 linears if asked."""
    import torch

    from usp.config.compose import compose_config
    from usp.models.llama import LlamaArgs, TransformerBlock

    cfg = compose_config(None, [f"model={model}"])[0].model
    args = LlamaArgs.from_config(cfg, vocab_size=128)
    block = TransformerBlock(args)
    if fp8 != "off":
        from usp.engine.parallel.fp8 import convertible, import_torchao_float8

        tf = import_torchao_float8(fp8)
        # Float8Linear casts its input to the autocast dtype only when CUDA's autocast is on (torchao
        # hard-codes the GPU's): on CPU it would see fp32 inputs; make it see what it sees on a GPU
        cpu_autocast = torch.is_autocast_enabled
        torch.is_autocast_enabled = lambda *device: cpu_autocast(*device) if device else cpu_autocast("cpu")
        torch.get_autocast_gpu_dtype = lambda: torch.bfloat16
        tf.convert_to_float8_training(block, config=tf.Float8LinearConfig.from_recipe_name(fp8),
                                      module_filter_fn=convertible)
    return args, block


def saved_tensors(args, block, batch: int, seq: int, compiled: bool) -> tuple[list, set]:
    """The tensors one forward saves for backward (one per storage), and the parameters' storages."""
    import torch

    from usp.models.llama import precompute_rope

    cos, sin = precompute_rope(args.head_dim, seq, args.rope_theta)
    x = torch.randn(batch, seq, args.dim, requires_grad=True)
    run = torch.compile(block) if compiled else block
    saved: list = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        run(x, cos, sin)
    seen, out = set(), []
    for t in saved:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out.append(t)
    return out, {p.untyped_storage().data_ptr() for p in block.parameters()}


def classify(tensors: list, params: set, block) -> dict:
    """Bytes by kind: parameters (not counted), weight casts (a weight's shape, low precision), activations."""
    shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}
    out: dict = {"parameters": 0, "weight casts": 0, "activations": 0, "rows": []}
    for t in tensors:
        nbytes = t.untyped_storage().nbytes()
        kind = "parameters" if t.untyped_storage().data_ptr() in params else \
            "weight casts" if tuple(t.shape) in shapes and t.element_size() < 4 else "activations"
        out[kind] += nbytes
        out["rows"].append((tuple(t.shape), str(t.dtype).replace("torch.", ""), nbytes / MIB, kind))
    return out


def planner_bytes(model: str, fp8: str, compiled: bool) -> float | None:
    """The planner's bytes per token per layer for this block (bf16 under autocast, no recompute)."""
    from usp.config.compose import compose_config
    from usp.perf.memory import activation_values, compiled_block_bytes
    from usp.perf.specs import Arch, Layout, Precision
    from usp.perf.stack_profile import PROFILES

    arch = Arch.from_model(compose_config(None, [f"model={model}"])[0].model)
    prec = Precision.resolve("bf16", "cuda", True, compiled=compiled, fp8=fp8)
    counted = compiled_block_bytes(arch, Layout(), prec)
    return counted if counted is not None else activation_values(arch, Layout(), PROFILES["usp"])[0] * prec.act


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--model", default="llama3_2_3b")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    p.add_argument("--fp8", choices=("off", "tensorwise", "rowwise"), default="off")
    args = p.parse_args()
    import torch

    torch.manual_seed(0)
    margs, block = build_block(args.model, args.fp8)
    tensors, params = saved_tensors(margs, block, args.micro_batch, args.seq, args.mode == "compiled")
    kinds = classify(tensors, params, block)
    tokens = args.micro_batch * args.seq
    counted = planner_bytes(args.model, args.fp8, args.mode == "compiled")
    result = {"model": args.model, "mode": args.mode, "fp8": args.fp8, "tokens": tokens,
              "activation_bytes_per_token": kinds["activations"] / tokens, "planner_bytes_per_token": counted,
              "weight_casts_mib": kinds["weight casts"] / MIB, "rows": kinds.pop("rows"), **_common.machine()}
    lines = [f"{shape} {dtype} {mib:.1f} MiB {kind}" for shape, dtype, mib, kind in result["rows"]]
    lines += [f"{args.model} {args.mode}, fp8 {args.fp8}, {args.micro_batch} x {args.seq} tokens: activations "
              f"{result['activation_bytes_per_token']:,.0f} bytes per token (the planner counts {counted:,.0f}), "
              f"weight casts {result['weight_casts_mib']:.1f} MiB (the block's weights: "
              f"{2 * sum(q.numel() for q in block.parameters() if q.dim() == 2) / MIB:.1f} MiB in bf16)"]
    _common.emit(result, args, lines)


if __name__ == "__main__":
    main()
