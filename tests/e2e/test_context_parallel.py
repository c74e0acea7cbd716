"""Context parallelism under torchrun: ring attention and CP Llama parity against one process on 2
and 4 ranks (cases in tests/dist/cases_context.py; zigzag sharding: tests/engine/test_context_parallel.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist import harness

# A first test builds its module's torchrun launch: the launch's own limit (tests/dist/harness.py).
pytestmark = pytest.mark.timeout(600)

ATTN_ATOL = 1e-5
LOSS_REL = 1e-6
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5

CASES = Path(__file__).resolve().parents[1] / "dist" / "cases_context.py"


@pytest.fixture(scope="module")
def launches():
    cache = {}

    def get(nproc):
        if nproc not in cache:
            cache[nproc] = harness.launch(CASES, nproc)
        return cache[nproc]
    return get


def _check(results, nproc):
    expected = {"attention_mha", "attention_gqa", "llama_mha", "llama_gqa"}
    if nproc == 4:
        expected |= {"subgroup_attention_mha", "subgroup_attention_gqa"}
    assert set(results) == expected
    for name, r in results.items():
        assert r["ok"], f"{name}: {r.get('error')}\n{r.get('trace', '')}"
        if name.startswith(("attention", "subgroup")):
            assert r["configs"] >= 3
            for key in ("fwd_err", "dq_err", "dk_err", "dv_err"):
                assert r[key] < ATTN_ATOL, f"{name}: {key}={r[key]}"
        else:
            assert r["cp"] == nproc
            assert r["loss_rel_err"] < LOSS_REL, f"{name}: {r}"
            assert r["grad_abs_err"] < GRAD_ATOL or r["grad_rel_err"] < GRAD_RTOL, f"{name}: {r}"


@pytest.mark.distributed
def test_context_parallel_cp2(launches):
    _check(launches(2), 2)


@pytest.mark.distributed
def test_context_parallel_cp4(launches):
    _check(launches(4), 4)
