"""Weight decay only on matrices, and one short real training per optimizer and schedule (the curves
and plan-time checks: tests/unit/test_optimizer.py)."""
from __future__ import annotations

import pytest

from usp.config.compose import compose_config
from usp.contract.schedule import OptimSettings, lr_factor


def test_weight_decay_skips_norms_and_biases():
    import torch

    from usp.engine.optim import build_optimizer
    from usp.models.llama import Llama, LlamaArgs

    cfg, _ = compose_config(None, [])
    model = Llama(LlamaArgs(vocab_size=64), max_seq_len=8)
    model.extra = torch.nn.Linear(4, 4, bias=True)  # a bias, as other model families have
    opt = build_optimizer(list(model.parameters()), cfg.optimizer, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert plain and all("norm" in n or n.endswith("bias") for n in plain), plain
    assert "extra.bias" in plain and "extra.weight" in decayed
    assert any("attn" in n or "attention" in n for n in decayed) and not any("norm" in n for n in decayed)
    assert len(decayed) + len(plain) == len(list(model.parameters()))


@pytest.mark.slow
def test_each_optimizer_and_schedule_trains(tmp_path, shakespeare):
    """Three real steps per optimizer: the same first loss (same init and batch), different updates,
    the loss falls, and metrics.jsonl's lr follows the schedule's curve."""
    from tests.engine.test_training import train_inprocess

    runs = {}
    for name, extra in (("adamw", ["optimizer.schedule=linear"]), ("adam", ["optimizer.schedule=constant"]),
                        ("sgd", ["optimizer.nesterov=true", "optimizer.schedule=cosine"]),
                        ("adamw_wsd", ["optimizer.decay_fraction=0.5"])):
        runs[name] = train_inprocess(tmp_path, f"optimizer={name}", f"train.name={name}", "train.steps=4",
                                     "optimizer.warmup_steps=1", "checkpoint.enabled=false", *extra)
    first = {n: m[0]["loss"] for n, m in runs.items()}
    assert max(first.values()) - min(first.values()) < 1e-6, first
    last = {n: m[-1]["loss"] for n, m in runs.items()}
    assert len({round(v, 6) for v in last.values()}) == len(last), last  # each optimizer updates differently
    assert all(last[n] < first[n] for n in runs), (first, last)
    for name, metrics in runs.items():
        cfg, _ = compose_config(None, [f"optimizer={name}", "train.steps=4", "optimizer.warmup_steps=1"]
                                + (["optimizer.decay_fraction=0.5"] if name == "adamw_wsd" else []))
        o = OptimSettings.from_config(cfg.optimizer, 4)
        o = OptimSettings(**{**o.__dict__, "schedule": {"adamw": "linear", "adam": "constant", "sgd": "cosine"}
                             .get(name, o.schedule)})
        # the lr logged with step n (1-based) is the one the scheduler set for the next step (0-based n)
        expected = [o.lr * lr_factor(m["step"], o) for m in metrics]
        assert [m["lr"] for m in metrics] == pytest.approx(expected), name
