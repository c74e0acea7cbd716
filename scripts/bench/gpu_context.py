#!/usr/bin/env python
"""A bare GPU rank's memory outside the allocator (needs CUDA; exits 2 elsewhere): what the plan's
fixed allowance (usp/perf/memory.py FIXED_OVERHEAD_GIB, 1 GiB on a GPU) has to cover before any
model tensor. In one fresh process, the device's used memory (torch.cuda.mem_get_info: the driver's
count, one process on the GPU) minus the caching allocator's reserved bytes, after each thing a
training rank sets up, in the order it does:

  context   CUDA context (torch.cuda.init and a first tensor)
  cublas    a bf16 matmul forward and backward (cuBLAS / cuBLASLt handles and workspaces)
  sdpa      causal scaled_dot_product_attention, bf16, forward and backward (flash's kernels loaded)
  nccl      an NCCL process group of one rank and an all-reduce (its communicator and buffers; a
            group of several ranks adds buffers per peer and channel, not measured here)
  compile   a torch.compile'd function run forward and backward (inductor's Triton kernels)
  adamw     a fused AdamW step (its multi-tensor kernels)

    python scripts/bench/gpu_context.py [--out context.jsonl] [--json]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

GIB = 2**30


def outside_allocator(torch) -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / GIB


def measure() -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dev = torch.device("cuda", 0)  # NCCL wants a device with an index
    steps: dict[str, float] = {}
    torch.cuda.init()
    torch.ones(1, device=dev)
    steps["context"] = outside_allocator(torch)

    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    (a @ a).sum().backward()
    steps["cublas"] = outside_allocator(torch)

    q = torch.randn(2, 32, 2048, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    steps["sdpa"] = outside_allocator(torch)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    t = torch.ones(1 << 20, device=dev)
    dist.all_reduce(t)
    steps["nccl"] = outside_allocator(torch)

    @torch.compile
    def swiglu(x, w):
        return F.silu(x @ w) * (x @ w)

    x = torch.randn(2048, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    swiglu(x, torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)).sum().backward()
    steps["compile"] = outside_allocator(torch)

    params = [torch.nn.Parameter(torch.randn(1024, 1024, device=dev)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    torch.optim.AdamW(params, fused=True).step()
    steps["adamw"] = outside_allocator(torch)
    dist.destroy_process_group()
    return {"outside_allocator_gib": steps, "reserved_gib": torch.cuda.memory_reserved() / GIB,
            **_common.machine()}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--out", help="append the result as one JSON line")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_context.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    r = measure()
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
    if args.json:
        print(json.dumps(r))
        return
    for name, gib in r["outside_allocator_gib"].items():
        print(f"{name:<8} {gib:6.3f} GiB outside the allocator")
    print(f"reserved by the allocator at the end: {r['reserved_gib']:.3f} GiB ({r.get('gpu', '?')})")


if __name__ == "__main__":
    main()
