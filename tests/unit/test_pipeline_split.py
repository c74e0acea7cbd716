"""Pipeline planning in pure Python: layer splits, stage placement, schedule checks."""
from __future__ import annotations

import pytest

from usp.errors import PlanError
from usp.perf.pipeline_split import (
    SCHEDULES,
    arch_split,
    last_stage_rank,
    split_layers,
    stage_ranks,
    validate_schedule,
)


def counts(split):
    return [len(s) for s in split]


def contiguous(split, n_layers):
    return [i for s in split for i in s] == list(range(n_layers)) and all(split)


@pytest.mark.parametrize("n_layers,n_stages,embed,head,expected", [
    (4, 2, 0, 0, [2, 2]),
    (8, 4, 0, 0, [2, 2, 2, 2]),
    (5, 2, 0, 0, [3, 2]),                 # ties: earlier stages take the extra layer
    (4, 4, 10, 10, [1, 1, 1, 1]),         # one layer each, whatever the embedding
    (6, 2, 0, 200, [4, 2]),               # head = 2 layers -> last stage gets 2 fewer
    (6, 2, 200, 0, [2, 4]),               # embedding = 2 layers -> first stage gets 2 fewer
    (10, 3, 100, 100, [3, 4, 3]),         # 1-layer embedding and head: 4/4/4 in layer equivalents
    (16, 4, 300, 0, [2, 5, 5, 4]),        # 3-layer embedding
    (32, 8, 65, 65, [4] * 8),             # small embedding/head: no layer moves
])
def test_balanced_split(n_layers, n_stages, embed, head, expected):
    split = split_layers(n_layers, n_stages, embed, head, 100)
    assert contiguous(split, n_layers)
    assert counts(split) == expected


def test_balanced_split_minimises_the_largest_stage():
    # Brute force over all contiguous splits for a few shapes.
    import itertools
    for n, s, e, h in [(7, 3, 150, 50), (9, 4, 0, 260), (12, 5, 170, 330)]:
        best = min(
            max(sum(100 for _ in range(c)) + (e if i == 0 else 0) + (h if i == s - 1 else 0)
                for i, c in enumerate(cs))
            for cs in itertools.product(range(1, n + 1), repeat=s) if sum(cs) == n)
        got = counts(split_layers(n, s, e, h, 100))
        cost = max(100 * c + (e if i == 0 else 0) + (h if i == s - 1 else 0) for i, c in enumerate(got))
        assert cost == best, (n, s, e, h, got)


def test_per_layer_costs():
    assert counts(split_layers(4, 2, 0, 0, [300, 100, 100, 100])) == [1, 3]


def test_explicit_split_used_as_given():
    assert split_layers(8, 3, 10**9, 10**9, 1, explicit=[3, 3, 2]) == [[0, 1, 2], [3, 4, 5], [6, 7]]


@pytest.mark.parametrize("explicit,why", [
    ([3, 3], "entries"),
    ([4, 3, 2], "sums to 9"),
    ([8, 0, 0], "at least one layer"),
    ([4, 2, -1], "at least one layer"),
    ("3,3,2", "list of layer counts"),
    ([3.0, 3, 2], "list of layer counts"),
])
def test_explicit_split_rejected(explicit, why):
    with pytest.raises(PlanError) as e:
        split_layers(8, 3, 0, 0, 1, explicit=explicit)
    assert e.value.key == "parallelism.pp_layers" and e.value.value == explicit
    assert why in str(e.value) and "parallelism.pp_layers=" in e.value.fix


def test_more_stages_than_layers():
    with pytest.raises(PlanError) as e:
        split_layers(3, 4, 0, 0, 1)
    assert e.value.key == "model.n_layers"


def test_stage_ranks():
    assert stage_ranks(4, 1, "1f1b") == [[0], [1], [2], [3]]
    assert stage_ranks(2, 2, "interleaved_1f1b") == [[0, 2], [1, 3]]
    assert stage_ranks(3, 3, "interleaved_zb") == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert stage_ranks(2, 2, "zbv") == [[0, 3], [1, 2]]
    assert stage_ranks(4, 2, "zbv") == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert last_stage_rank(4, 2, "zbv") == 0 and last_stage_rank(4, 2, "interleaved_1f1b") == 3
    with pytest.raises(PlanError, match="exactly 2"):
        stage_ranks(2, 3, "zbv")


def test_pipeline_off_checks_only_the_schedule_name():
    """pp = 1: no pipeline, so stages and micro batches don't matter; the name still must be known.
    Which combinations a pipeline accepts is checked against torch's own schedule classes in
    tests/engine/test_pipeline_split.py."""
    for schedule in SCHEDULES:
        assert validate_schedule(schedule, 1, 1, 1) is None and validate_schedule(schedule, 1, 3, 0) is None
    with pytest.raises(PlanError) as e:
        validate_schedule("gpipe", 1, 1, 4)
    assert e.value.key == "parallelism.pp_schedule"


@pytest.mark.parametrize("schedule,pp,virtual,n_mb,key", [
    ("gpipe", 2, 1, 4, "parallelism.pp_schedule"),
    ("gpipe", 1, 1, 4, "parallelism.pp_schedule"),
    ("interleaved_1f1b", 2, 1, 4, "parallelism.pp_virtual_stages"),
    ("interleaved_zb", 2, 1, 4, "parallelism.pp_virtual_stages"),
    ("zbv", 2, 1, 4, "parallelism.pp_virtual_stages"),
    ("zbv", 2, 3, 4, "parallelism.pp_virtual_stages"),
    ("afab", 2, 2, 4, "parallelism.pp_virtual_stages"),
    ("1f1b", 2, 2, 4, "parallelism.pp_virtual_stages"),
    ("1f1b", 4, 1, 3, "train.grad_accum"),
    ("afab", 2, 1, 0, "train.grad_accum"),
    ("interleaved_1f1b", 2, 2, 5, "train.grad_accum"),   # rounds = 2 does not divide 5
    ("interleaved_zb", 4, 2, 9, "train.grad_accum"),
])
def test_invalid_schedules(schedule, pp, virtual, n_mb, key):
    with pytest.raises(PlanError) as e:
        validate_schedule(schedule, pp, virtual, n_mb)
    assert e.value.key == key and e.value.fix


def test_unknown_schedule_lists_choices():
    with pytest.raises(PlanError) as e:
        validate_schedule("gpipe", 2, 1, 4)
    for name in ("afab", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"):
        assert name in str(e.value)


def test_tied_embeddings_split_like_untied():
    """Under pp the last stage holds the tied embedding's copy: it costs what an untied head does."""
    from usp.perf.specs import Arch

    kw = dict(name="m", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256)
    tied, untied = Arch(**kw, tie_embeddings=True), Arch(**kw, tie_embeddings=False)
    assert arch_split(tied, 2) == arch_split(untied, 2)
    assert [len(s) for s in arch_split(tied, 2)] == [8, 8]  # embedding first, its copy last: balanced

