"""Expert parallelism against a single process under torchrun (one 2-process launch, cases in
tests/dist/cases_expert.py), and the MoE aux loss through a 2-stage pipeline (cases_moe_pipeline.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.harness import launch

# A first test builds its module's torchrun launch: the launch's own limit (tests/dist/harness.py).
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ep_results():
    return launch(Path(__file__).resolve().parents[1] / "dist" / "cases_expert.py", 2)


def _ok(results, case):
    r = results[case]
    assert r["ok"], r.get("trace", r)
    return r


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["layer_dropless", "layer_capacity", "layer_shared"])
def test_ep_layer_matches_single_process(ep_results, case):
    r = _ok(ep_results, case)
    print(case, r)
    assert r["n_local_experts"] == 2
    assert (r["dropped"] > 0) == (case == "layer_capacity")
    assert max(r["fwd_err"], r["vs_dense_reference"], r["dx_err"], r["aux_err"]) < 1e-6


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["llama_grads_ce", "llama_grads_aux", "llama_grads_aux_sequence"])
def test_ep_llama_gradients_match_single_process(ep_results, case):
    r = _ok(ep_results, case)
    print(case, r)
    assert r["n_expert_params"] == 6 and r["n_params"] == 22
    assert max(r["dense_grad_err"], r["expert_grad_err"], r["loss_err"]) < 1e-6


@pytest.mark.distributed
def test_ep_adamw_losses_match_single_process(ep_results):
    r = _ok(ep_results, "adamw_3_steps")
    print(r)
    assert r["loss_max_rel_err"] < 1e-6
    assert r["losses"][-1] < r["losses"][0]
    # AdamW turns float32 rounding of near-zero gradients into ~lr-sized steps (see test_pipeline.py).
    assert r["param_max_abs_err"] < 1e-4


@pytest.mark.distributed
def test_ep_init_weights_gives_the_owned_slice(ep_results):
    assert _ok(ep_results, "init_after_ep")["err"] == 0.0


@pytest.mark.distributed
def test_global_balance_loss_needs_no_collective_in_backward(ep_results):
    """Summing the counts (no gradient) and keeping each rank's mean probability gives the
    global-batch loss's gradient exactly, as an autograd all-reduce of the probabilities does."""
    r = _ok(ep_results, "balance_loss_collectives")
    print(r)
    assert r["grad_size"] > 1e-3  # the loss moves the router
    for way in ("counts", "autograd"):
        assert r[way]["grad_err"] < 1e-7 and r[way]["value_err"] < 1e-6, way


@pytest.mark.distributed
def test_sequence_balance_loss_over_split_sequences(ep_results):
    """DeepSeek-V3's sequence-wise loss with each sequence split over 2 ranks (context parallelism's
    case): the per-sequence counts summed over them give one process's loss and router gradient."""
    r = _ok(ep_results, "sequence_loss_over_cp")
    print(r)
    assert r["grad_size"] > 1e-3
    assert r["reduced"]["grad_err"] < 1e-7 and r["reduced"]["value_err"] < 1e-6
    assert r["unreduced"]["value_err"] > 1e-3  # each half's own counts are another loss


@pytest.fixture(scope="module")
def pp_aux_results():
    return launch(Path(__file__).resolve().parents[1] / "dist" / "cases_moe_pipeline.py", 2)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["afab_mb4", "1f1b_mb4", "interleaved_1f1b_mb4", "zbv_mb4"])
def test_pp_aux_loss_gradients_match_single_process(pp_aux_results, case):
    """aux_loss_coef > 0 with pp = 2: every stage's gradients equal a single process adding
    coef x aux to the loss of the same micro batches (float64: exact to rounding)."""
    r = _ok(pp_aux_results, f"aux_pp_{case}")
    print(case, r)
    assert r["aux_grad_effect"] > 1e-4  # the aux loss changes the gradients, so the check has teeth
    assert r["grad_max_abs_err"] < 1e-12
