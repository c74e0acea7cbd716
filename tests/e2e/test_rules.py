"""The layout search never proposes what `usp train` refuses: for every catalogue model, with and
without checkpoints, the search's top 3 planned as `usp train` plans them (a whole search per model:
the slow end-to-end check of the rule table, tests/unit/test_rules.py)."""
from __future__ import annotations

import pytest

from tests.unit.test_rules import CLUSTERS, MODELS
from usp.config.compose import compose_config
from usp.errors import PlanError
from usp.plan.plan import checked_plan
from usp.plan.search import search_config

pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it


@pytest.mark.parametrize("checkpoint", ["true", "false"])
@pytest.mark.parametrize("model", MODELS)
def test_search_never_proposes_what_train_refuses(model, checkpoint):
    """The search's top 3, planned as `usp train` plans them (build_plan + the engine rules)."""
    base = [f"model={model}", *CLUSTERS[model], f"checkpoint.enabled={checkpoint}"]
    result = search_config(compose_config(None, base)[0], top_k=3)
    assert result.top, f"nothing fits for {model}: pick a larger cluster in CLUSTERS"
    for cand in result.top:
        cfg, choices = compose_config(None, base + cand.layout.overrides())
        try:
            checked_plan(cfg, choices)
        except PlanError as exc:
            pytest.fail(f"the search proposed {cand.describe()} for {model}, which usp train refuses: {exc}")
