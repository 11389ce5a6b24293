"""``plan --model`` recommends neither mode when neither beats the base policy (issue 50, item 10):
"per-query noise (zcdp)" at accuracy 0.0904 with the base policy at 0.092 is worse than doing nothing."""

from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from privalign.cli.plan import _plan_release


def _run(monkeypatch, release_mean, release_p5, per_query, base=0.092):
    def fake(head, _, pid, true, e, delta, n, draws, rng, **kw):
        return {"epsilon": e, "mean": release_mean, "p5": release_p5, "bon": 0.3, "base": base,
                "share_mean": None, "share_p5": None}

    monkeypatch.setattr("privalign.rewards.release.release_accuracy", fake)
    head = SimpleNamespace(persons=10, k=4, m=40, sensitivity=0.01)
    p = SimpleNamespace(columns={"prompt_id": np.arange(4), "true_reward": np.zeros(4)})
    out = Console(record=True, width=200)
    _plan_release(out, head, p, None, 0.8, None, 1.0, 1e-6, 8, 2, 0, per_query)
    return " ".join(out.export_text().split())


def test_neither_mode_is_recommended_below_the_base_policy(monkeypatch):
    text = _run(monkeypatch, 0.08, 0.07, {"zcdp": 0.0904, "basic": 0.05, "fsrc": None})
    assert "recommended: neither" in text and "base policy 0.092" in text, text
    assert "recommended: per-query" not in text and "recommended: release" not in text


@pytest.mark.parametrize("release, per_query, expected", [
    ((0.2, 0.15), {"zcdp": 0.0904}, "recommended: release then BoN"),   # only the release beats the base
    ((0.08, 0.07), {"zcdp": 0.15}, "recommended: per-query noise (zcdp)"),  # only per-query does
    ((0.2, 0.18), {"zcdp": 0.15}, "recommended: release then BoN"),     # both: the release's 5th pct wins
])
def test_a_mode_that_beats_the_base_policy_is_recommended(monkeypatch, release, per_query, expected):
    assert expected in _run(monkeypatch, *release, per_query)
