"""The layout search: only valid layouts that fit, the best beats naive layouts, the largest
micro batch per layout really is the largest, and it is fast at 512 GPUs."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.helpers import usp_cli
from usp.config.compose import compose_config
from usp.perf.memory import memory_plan, peak_bytes
from usp.perf.specs import GIB, Layout
from usp.perf.timing import rank_params
from usp.plan.plan import build_plan
from usp.plan.planner_inputs import planner_context
from usp.plan.search import divisors, search, search_config

EIGHT_B_16 = ["model=llama3_1_8b", "cluster=slurm_h100", "cluster.nodes=2", "train.seq_len=4096",
              "train.global_batch=128"]


pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it


@pytest.fixture(scope="module")
def eight_b():
    cfg, _ = compose_config(None, EIGHT_B_16)
    return search_config(cfg, top_k=8)


def plan_with(base: list[str], layout: Layout):
    cfg, choices = compose_config(None, [*base, *layout.overrides()])
    return build_plan(cfg, choices, training=False)


def test_search_returns_only_valid_fitting_layouts(eight_b):
    assert len(eight_b.top) == 8 and eight_b.fitting >= 8
    for cand in eight_b.top:
        plan = plan_with(EIGHT_B_16, cand.layout)  # raises on any rule or a predicted OOM
        assert plan.memory.fits and plan.memory.peak_gib == pytest.approx(cand.peak_gib)
        assert plan.timing.tokens_per_s_per_device == pytest.approx(cand.tokens_per_s_per_device)
        assert plan.batch.micro_batch == cand.layout.micro_batch and plan.batch.grad_accum == cand.layout.grad_accum
    speeds = [float(f"{c.tokens_per_s_per_device:.3g}") for c in eight_b.top]  # ranked to 3 significant digits
    assert speeds == sorted(speeds, reverse=True)


def test_best_beats_naive_layouts(eight_b):
    best = eight_b.best
    ctx = planner_context(compose_config(None, EIGHT_B_16)[0])
    from usp.perf.timing import timing_plan

    def throughput(layout: Layout) -> float:
        return timing_plan(ctx.arch, layout, ctx.seq_len, ctx.global_batch, ctx.hw, ctx.prec).tokens_per_s_per_device

    # tp=8 everywhere (the largest micro batch that fits)
    tp8 = next(c for c in _fitting(ctx, Layout(tp=8, dp_replicate=2)))
    assert best.tokens_per_s_per_device > throughput(tp8)
    # pure data parallel: plain DDP does not even fit an 8B on 80 GiB, ZeRO-3 over all 16 does
    ddp = Layout(dp_replicate=16, micro_batch=1, grad_accum=8)
    assert peak_bytes(ctx.arch, ddp, ctx.seq_len, ctx.hw, ctx.prec, ctx.profile)[0] > 80 * GIB
    fsdp = next(c for c in _fitting(ctx, Layout(dp_replicate=1, dp_shard=16)))
    assert best.tokens_per_s_per_device >= throughput(fsdp)
    assert any("pure data parallel" in line or "other tp/pp" in line for line in __import__(
        "usp.plan.search", fromlist=["explain"]).explain(eight_b))


def _fitting(ctx, base: Layout):
    local = ctx.global_batch // base.dp
    for b in sorted(divisors(local), reverse=True):
        lay = replace(base, micro_batch=b, grad_accum=local // b)
        if peak_bytes(ctx.arch, lay, ctx.seq_len, ctx.hw, ctx.prec, ctx.profile)[0] <= ctx.hw.memory_gib * GIB:
            yield lay


def test_max_micro_batch_is_the_largest_that_fits(eight_b):
    ctx = planner_context(compose_config(None, EIGHT_B_16)[0])
    for cand in eight_b.top:
        lay = cand.layout
        local = lay.micro_batch * lay.grad_accum
        bigger = [b for b in divisors(local) if b > cand.max_micro_batch]
        at_max = replace(lay, micro_batch=cand.max_micro_batch, grad_accum=local // cand.max_micro_batch)
        assert peak_bytes(ctx.arch, at_max, ctx.seq_len, ctx.hw, ctx.prec, ctx.profile)[0] <= 80 * GIB
        if bigger:
            over = replace(lay, micro_batch=bigger[0], grad_accum=local // bigger[0])
            assert memory_plan(ctx.arch, over, ctx.seq_len, ctx.hw, ctx.prec, ctx.profile).peak_gib > 80


def test_peak_candidates_match_all_stages():
    ctx = planner_context(compose_config(None, ["model=llama3_1_70b", "cluster=slurm_h100", "cluster.nodes=8",
                                                "train.seq_len=4096"])[0])
    for sched, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("afab", 1)):
        for pp in (3, 4, 6, 16):
            lay = Layout(pp=pp, tp=8, dp_replicate=64 // pp if 64 % pp == 0 else 1, pp_schedule=sched,
                         pp_virtual_stages=v, micro_batch=1, grad_accum=16)
            mem = memory_plan(ctx.arch, lay, ctx.seq_len, ctx.hw, ctx.prec, ctx.profile)
            peak = peak_bytes(ctx.arch, lay, ctx.seq_len, ctx.hw, ctx.prec, ctx.profile)[0]
            assert peak == pytest.approx(mem.peak.total)
            assert max(rank_params(ctx.arch, lay)) == pytest.approx(max(s.params for s in mem.stages), abs=1)


def test_70b_on_512_gpus_finds_a_layout_that_fits():
    """How long this search takes is a benchmark (scripts/bench/planner_search.py, docs/benchmarks.md),
    not a timed test: a wall-clock bound flakes on a loaded machine."""
    cfg, _ = compose_config(None, ["model=llama3_1_70b", "cluster=slurm_h100", "cluster.nodes=64",
                                   "train.seq_len=4096", "train.global_batch=1024"])
    result = search_config(cfg, top_k=5)
    best = result.best
    assert best is not None and best.layout.world == 512 and best.peak_gib <= 80
    assert result.pure_dp is None and result.pure_dp_peak_gib > 80  # 70B does not fit with data parallel alone
    assert 0.2 < best.timing.mfu < 0.55


@pytest.mark.parametrize("checkpoints", ["false", "true"])
def test_moe_search_uses_expert_parallel(checkpoints):
    """Checkpointing or not: expert-parallel checkpoints reshard (docs/moe.md), so no rule keeps
    the search from proposing ep > 1 to a run that saves them."""
    cfg, _ = compose_config(None, ["model=tiny", "model.n_experts=8", "model.top_k=2", "cluster=slurm_h100",
                                   "train.seq_len=1024", "train.global_batch=64", f"checkpoint.enabled={checkpoints}"])
    result = search_config(cfg, top_k=50)
    assert {c.layout.ep for c in result.top} > {1}
    ep = [c.layout for c in result.top if c.layout.ep > 1]  # as the engine runs it: on the FSDP ranks
    assert all(8 % lay.ep == 0 and (lay.dp_shard * lay.cp) % lay.ep == 0 for lay in ep)


def test_nothing_fits_is_said():
    ctx = planner_context(compose_config(None, ["model=llama3_1_405b", "cluster=slurm_h100", "train.seq_len=4096",
                                                "train.global_batch=8"])[0])
    result = search(ctx.arch, ctx.hw, ctx.prec, ctx.seq_len, ctx.global_batch, profile=ctx.profile)
    from usp.plan.search import explain

    assert result.best is None and "no layout" in explain(result)[0]


def test_usp_plan_search_cli(tmp_path):
    r = usp_cli("plan", "--search", "--top", "3", *EIGHT_B_16, cwd=tmp_path, columns=220)
    assert r.returncode == 0, r.stderr
    assert "best layouts for llama3_1_8b on 16 device(s)" in r.stdout
    assert "max micro" in r.stdout and "best:" in r.stdout and "use it: usp plan" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("│ ") and line[2].isdigit()]
    assert len(rows) == 3


def test_mixtral_search_proposes_ep_on_the_fsdp_ranks_with_pp():
    cfg, _ = compose_config(None, ["model=mixtral_8x7b", "cluster=slurm_h100", "cluster.nodes=16",
                                   "train.seq_len=4096", "train.global_batch=256", "checkpoint.enabled=false"])
    top = search_config(cfg, top_k=10).top
    ep = [c.layout for c in top if c.layout.ep > 1]
    assert ep and all((lay.dp_shard * lay.cp) % lay.ep == 0 for lay in ep)
    assert any(lay.pp > 1 and lay.dp_shard > 1 for lay in ep)  # EP x FSDP x PP


def test_micro_batch_memo_matches_asking_every_layout():
    """The search asks the micro-batch rules once per (rules.BATCH_RULE_FIELDS, per-rank batch): for
    every layout of a pipelined search space the memo gives what asking the layout itself gives (a
    batch rule reading another field would break this)."""
    from usp.plan.rules import Settings
    from usp.plan.search import _micro_batches, enumerate_layouts

    cfg, _ = compose_config(None, ["model=llama3_1_70b", "cluster=slurm_h100", "cluster.nodes=8",
                                   "train.seq_len=4096", "train.global_batch=256"])
    ctx = planner_context(cfg)
    settings = Settings(seq_len=4096)
    memo: dict = {}
    layouts = list(enumerate_layouts(ctx.arch, ctx.hw, 4096, 256, settings=settings))
    assert len({(b.pp, b.pp_schedule, b.pp_virtual_stages) for b, _ in layouts}) > 5
    for base, local in layouts:
        memoized = _micro_batches(ctx.arch, ctx.hw, settings, base, local, memo)
        assert memoized == _micro_batches(ctx.arch, ctx.hw, settings, base, local), base
    assert len(memo) < len(layouts) / 4  # the memo is what saves the time
