"""What the planner's models and rules read from a composed config: the model shape, hardware,
precision, sequence length and global batch (`PlannerContext`, for the memory / time models and
the layout search), and one layout's rule `Subject` (usp.plan.rules). Pure Python."""
from __future__ import annotations

from dataclasses import dataclass, replace

from usp.contract.decide import uses_compile
from usp.errors import PlanError
from usp.perf.specs import Arch, Hardware, Layout, Precision
from usp.perf.stack_profile import Profile, get_profile
from usp.plan.rules import Settings, Subject, field_failures


@dataclass(frozen=True)
class PlannerContext:
    arch: Arch
    hw: Hardware
    prec: Precision
    seq_len: int
    global_batch: int
    settings: Settings
    profile: Profile


def tokenizer_vocab(data) -> int:
    """The vocabulary the data's token ids come from (bytes: 256; hf / tiktoken: the file's)."""
    if data.source == "token_files":
        return int(data.vocab_size)
    if data.tokenizer == "bytes":
        return 256
    if data.tokenizer in ("hf", "tiktoken"):
        from usp.data.tokenizer import pretrained_vocab_size

        return pretrained_vocab_size(data)
    return int(data.vocab_size)


def data_vocab(model, data) -> int:
    """model.vocab_size when set, else the tokenizer's."""
    return int(model.vocab_size) if int(model.vocab_size) > 0 else tokenizer_vocab(data)


def config_field_failures(cfg) -> list[PlanError]:
    """model.init_from's shape adopted (the keys no one set come from its config.json), then every
    field rule (usp.plan.rules): each value on its own first, since what follows derives from them."""
    from usp.plan.hf_config import adopt_hf_shape

    adopt_hf_shape(cfg.model)
    return field_failures(cfg)


def planner_context(cfg, vocab: int | None = None) -> PlannerContext:
    from usp.plan.hf_config import adopt_hf_shape

    adopt_hf_shape(cfg.model)  # model.init_from: the keys no one set come from its config.json
    train = cfg.train
    seq = int(train.seq_len)
    gb = int(train.global_batch_tokens) // seq if train.global_batch_tokens is not None else int(train.global_batch)
    arch = Arch.from_model(cfg.model, vocab or data_vocab(cfg.model, cfg.data))
    hw = Hardware.from_cluster(cfg.cluster)
    profile, prec = recipe_precision(cfg, hw.device)
    return PlannerContext(arch, hw, prec, seq, gb, settings_of(cfg), profile)


def checkpoint_bytes(model) -> int:
    """model.init_from's bytes per value (its config.json's dtype), 0 without one: the build's read
    buffer (usp.perf.memory.build_memory)."""
    init_from = model.init_from
    if not init_from:
        return 0
    from usp.plan.hf_config import checkpoint_value_bytes, read_hf_config

    return checkpoint_value_bytes(read_hf_config(init_from))


def settings_of(cfg) -> Settings:
    """Settings.from_config, with model.init_from's bytes per value (read from its config.json)."""
    return replace(Settings.from_config(cfg), checkpoint_bytes=checkpoint_bytes(cfg.model))


def recipe_precision(cfg, device: str) -> tuple[Profile, Precision]:
    """planner.profile's recipe and the bytes per value it stores at train.dtype on this device, with
    the states of the optimizer the config names."""
    profile = get_profile(str(getattr(getattr(cfg, "planner", None), "profile", "usp")))
    train = cfg.train
    par = cfg.parallelism
    compiled = profile.follows_compile and uses_compile(getattr(train, "compile", "auto"), device,
                                                        str(par.pp_schedule), int(par.pp))
    return profile, Precision.resolve(str(train.dtype), device, profile.fp32_params, compiled,
                                      str(train.fp8), optimizer=str(cfg.optimizer.name),
                                      momentum=float(cfg.optimizer.momentum))


def rule_subject(cfg, degrees: dict, batch, vocab: int) -> Subject:
    """The rules' view of a composed config (or of a plan's, RunPlan.config) with its resolved degrees
    and batch."""
    layout = Layout.from_config(degrees, cfg.parallelism, batch, str(cfg.train.recompute))
    return Subject(Arch.from_model(cfg.model, vocab), layout, Hardware.from_cluster(cfg.cluster), settings_of(cfg))


def planned_local_bytes(plan, ranks: list[int]) -> dict:
    """Each rank's model states as the planner counts them (usp.perf.memory.local_bytes at its place
    in its FSDP2 shard group), from a RunPlan's resolved config: what `usp plan --build-check` sets
    beside the engine's real build."""

    from usp.contract.dims import shard_index
    from usp.perf.memory import local_bytes

    subject = rule_subject(plan.config, plan.degrees, plan.batch, plan.model.vocab_size)
    profile, prec = recipe_precision(plan.config, plan.device)
    zero1 = bool(plan.config.parallelism.zero1)
    out = {}
    for rank in ranks:
        coords = plan.ranks[rank].coords
        out[rank] = local_bytes(subject.arch, subject.layout, prec, coords["pp"],
                                shard_index(plan.degrees, coords, zero1), profile)
    return out
