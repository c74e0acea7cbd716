"""FP8 training (train.fp8=tensorwise|rowwise) through torchao.float8, as torchtitan's float8
converter does it: every nn.Linear inside the transformer blocks becomes a Float8Linear, whose
matmuls run in FP8 (torch._scaled_mm) with dynamic scales (one per tensor, or one per row:
rowwise), while its weight stays the same fp32 parameter (the optimizer, checkpoints and
exports see no difference). The LM head stays in bf16, and so does any linear with a dimension
that is not a multiple of 16 (what FP8 tensor cores take).

Applied first in parallelize.py, before compile (which fuses torchao's amax, scale and cast
kernels: without it FP8 is slower than bf16) and before FSDP, which gathers the converted
weights in the dtype the blocks compute in (bf16 under its mixed-precision policy) and lets each
Float8Linear cast them. torchao can also all-gather tensorwise-scaled weights in FP8
(enable_fsdp_float8_all_gather, torchtitan's option): not used here yet, since nothing can check
it before a multi-GPU run (gloo refuses FP8 tensors: "Invalid scalar type", measured; one GPU
has no FSDP).

torchao is imported here only, and only when train.fp8 is on (it is not a dependency of usp:
`pip install 'usp[fp8]'`). Where FP8 can't run (CPU, a GPU without FP8 units, rowwise over TP)
the planner refuses the config before launch (usp/plan/rules.py)."""
from __future__ import annotations

from torch import nn

from usp.errors import UspError

FP8_DIM_MULTIPLE = 16  # torch._scaled_mm: both dims of an FP8 weight are multiples of 16
TORCHAO_REQUIREMENT = "torchao>=0.17"  # 0.17: the first release built for torch 2.11's stable ABI


def convertible(module: nn.Module, fqn: str = "") -> bool:
    """torchao's module filter: a plain linear whose dims FP8 tensor cores take."""
    return isinstance(module, nn.Linear) and module.in_features % FP8_DIM_MULTIPLE == 0 \
        and module.out_features % FP8_DIM_MULTIPLE == 0


def apply_fp8(model: nn.Module, recipe: str) -> int:
    """Convert the linears of model.layers (a model or a pipeline stage) to Float8Linear in place;
    returns how many were converted."""
    torchao_float8 = import_torchao_float8(recipe)
    config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "rowwise":  # as torchtitan: inductor must round like eager around the rowwise casts (pytorch#150859)
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    before = _count_float8(model)
    for block in model.layers.values():
        torchao_float8.convert_to_float8_training(block, config=config, module_filter_fn=convertible)
    return _count_float8(model) - before


def import_torchao_float8(recipe: str):
    try:
        import torchao.float8
    except ImportError as exc:
        raise UspError(f"FP8 training runs through torchao's float8 training, and torchao is not installed "
                       f"({exc})", key="train.fp8", value=recipe,
                       fix=f"pip install '{TORCHAO_REQUIREMENT}' (or 'usp[fp8]'), or train.fp8=off") from exc
    return torchao.float8


def _count_float8(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
