"""examples/service.toml calibrates PrivITP to the worst case docs/deploy.md states (issue 30,
item 7), measured by the service's own accountant on the served reward model."""

from pathlib import Path

import pytest

from privalign.server.app import Service, StubGenerator
from privalign.server.config import load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "service.toml"


def test_the_examples_privitp_worst_case_is_the_stated_one(tmp_path):
    cfg = load_config(EXAMPLE)
    cfg.ledger, cfg.warm_up = str(tmp_path / "l.db"), False  # the policy's base model is not needed here
    svc = Service(cfg, generator=StubGenerator())
    try:
        privitp = svc.options({"mechanism": "privitp"}, "default")
        privbon = svc.options({}, "default")
        assert privbon["epsilon_max"] == pytest.approx(0.3)
        # docs/deploy.md: "a worst case of 0.29999 per query (rho 0.01176)": PrivITP calibrated to
        # PrivBoN's epsilon, never above it, on the person-unit counting head (issue 48)
        assert 0.29 < privitp["epsilon_max"] <= 0.3 and privitp["epsilon_max"] == pytest.approx(0.29999, abs=5e-5)
        assert privitp["event"].rho == pytest.approx(0.01176, abs=5e-6)
        from privalign.accounting.planner import plan_counts

        counts = plan_counts(10.0, 1e-6, privitp["event"])
        assert (counts["zcdp"], counts["basic"]) == (130, 33)
        assert svc.guarantee()["unit"] == "person"  # the example serves a person-unit head
    finally:
        svc.close()
