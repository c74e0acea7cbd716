"""Build what one rank trains from the plan: the model (or its pipeline stages), parallelized
in the fixed order of usp/engine/parallelize.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from usp.engine.accel import set_attention
from usp.engine.dist import DistContext
from usp.engine.parallelize import parallelize
from usp.models.llama import Llama, LlamaArgs


@dataclass
class ModelParts:
    modules: list[nn.Module]  # the (wrapped) modules whose parameters this rank trains
    raw: nn.Module | None  # the bare full model, for sampling; None when pipelined
    schedule: Any = None  # torch.distributed.pipelining schedule when pp > 1
    is_first_stage: bool = True
    is_last_stage: bool = True
    stage_modules: list[nn.Module] = field(default_factory=list)

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()


def model_factory(plan: dict, ctx: DistContext):
    """A function that builds the full model, identically initialised on every rank."""
    cfg = plan["config"]
    vocab = int(plan["model"]["vocab_size"])
    if ctx.degrees["tp"] > 1:
        from usp.engine.parallel.tensor import padded_vocab

        vocab = padded_vocab(vocab, ctx.degrees["tp"])  # padded rows are masked out of the loss
    args = LlamaArgs.from_config(_Attrs(cfg["model"]), vocab)

    def build() -> Llama:
        with torch.device("meta"):  # shapes only: the weights are allocated once, on the device
            model = Llama(args, max_seq_len=int(plan["batch"]["seq_len"]))
        model.materialize(ctx.device, seed=int(cfg["train"]["seed"]))  # same seed everywhere: no broadcast needed
        set_attention(model, str(cfg["model"].get("attention", "sdpa")), ctx.device.type)
        return model

    return build


def build_model(plan: dict, ctx: DistContext) -> ModelParts:
    build = model_factory(plan, ctx)
    if ctx.degrees["pp"] > 1:
        from usp.engine.pipeline_setup import build_pipeline_parts

        return build_pipeline_parts(plan, ctx, build)
    model = build()
    wrapped = parallelize(model, plan, ctx)
    return ModelParts(modules=[wrapped], raw=model, stage_modules=[wrapped])


class _Attrs(dict):
    """Attribute access on a plain dict (the plan's config section)."""

    __getattr__ = dict.__getitem__
