"""A rank builds only its own part of the model (usp/engine/parallel/build.py, materialize.py),
with one process's values: one 4-process torchrun launch (tests/dist/cases_build.py) builds every
kind of layout as the trainer does."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.cases_build import FP8_LAYOUTS, HF_LAYOUTS, HF_LOGITS, LAYOUTS
from tests.dist.harness import launch
from tests.engine.test_hf_checkpoint import TOL

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "cases_build.py"

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]  # the launch's own limit (below)


@pytest.fixture(scope="module")
def results(shakespeare):
    return launch(SCRIPT, 4, timeout=900)


def _ok(results: dict, name: str) -> dict:
    r = results.get(name)
    assert r is not None, f"case {name} did not run: {sorted(results)}"
    assert r["ok"], r.get("error", "") + "\n" + str(r.get("trace", r))
    return r


def test_a_rank_allocates_its_shards_not_the_whole_model(results):
    """FSDP over 4 ranks: a rank's peak resident memory grows by its quarter of the model plus the
    largest parameter's transient, far from the whole model that each rank used to allocate first
    (VmHWM growth over the build, measured 45 MB for a 143 MB model: 36 MB shard + 8 MB embedding)."""
    r = _ok(results, "memory")
    whole, share = r["whole_model_bytes"], r["whole_model_bytes"] / 4
    assert r["max_rank_local_bytes"] <= share * 1.01
    assert r["max_rank_growth_bytes"] < share + 2 * r["largest_param_bytes"] + 16 * 2 ** 20 < whole / 2, r


def test_a_rank_reads_only_its_part_of_a_hugging_face_checkpoint(results):
    """model.init_from under FSDP over 4 ranks: a rank's peak resident memory grows by its quarter of
    the model plus one parameter's transient, not by the checkpoint (the pages of a memory-mapped file
    count while it stays mapped: a load that read every tensor whole and kept the files open grew by
    the whole checkpoint)."""
    r = _ok(results, "hf_memory")
    whole, share = r["whole_model_bytes"], r["whole_model_bytes"] / 4
    assert r["max_rank_local_bytes"] <= share * 1.01
    assert r["max_rank_growth_bytes"] < share + 2 * r["largest_param_bytes"] + 16 * 2 ** 20 < whole / 2, r


@pytest.mark.parametrize("layout", [*LAYOUTS, *FP8_LAYOUTS, *HF_LAYOUTS])
def test_sharded_build_equals_one_process_bit_for_bit(results, layout):
    """Every parameter a rank holds, made whole, equals one process's build (init, or the HF
    checkpoint's load) with torch.equal, and so do the RoPE tables (Llama 3's scaling: set, or taken
    from the checkpoint's config.json); the ranks together hold every parameter; nothing is left on
    the meta device."""
    r = _ok(results, layout)
    assert r["rope_type"] == ("llama3" if "llama3" in layout else "default"), r
    assert r["unequal"] == [], r
    assert r["missing"] == [] and r["compared"] == r["n_ref"] > 0, r
    assert r["meta_params"] == 0, r


@pytest.mark.parametrize("case", HF_LOGITS)
def test_a_checkpoint_gives_transformers_logits_under_fsdp_tp_ep(results, case):
    """A DeepSeek-V3 (latent attention's heads over tp, experts over ep, FSDP2 over both; with and without
    YaRN), Qwen3 (QK-norm) or Qwen3-MoE checkpoint loaded into the shards of FSDP2 x TP2 (x EP2 with experts):
    the first forward's logits, gathered over tp, are transformers' within 1e-5 on every rank (measured
    2.7e-6 for DeepSeek-V3, logits up to 4.5)."""
    r = _ok(results, case)
    assert r["layout"] == [2, 2, HF_LOGITS[case][1]], r
    assert r["rope_type"] == ("yarn" if "yarn" in case else "default"), r
    assert r["logits_max"] > 0.1 and r["max_abs_err"] <= TOL, r
