"""The service config refuses what it does not know (issue 21): a typo must not leave a default in force."""

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from privalign.cli import app
from privalign.server.config import ServiceConfig, config_error_message


@pytest.mark.parametrize("body,expected", [
    ({"reward": {"kind": "stub", "sensitivty": 0.001}}, "unknown key 'sensitivty' in [reward]; did you mean 'sensitivity'?"),
    ({"rewards": {}}, "unknown key 'rewards'; did you mean 'reward'?"),
    ({"budgets": [{"name": "a", "epsilon_total": 1, "compositon": "zcdp"}]},
     "unknown key 'compositon' in [budgets.0]; did you mean 'composition'?"),
    ({"clients": {"k": {"tenant": "t", "tennant": "u"}}}, "unknown key 'tennant' in [clients.k]; did you mean 'tenant'?"),
    ({"mechanism": {"epsilom": 1}}, "unknown key 'epsilom' in [mechanism]; did you mean 'epsilon'?"),
])
def test_unknown_keys_and_sections_are_refused_with_the_nearest_known_name(body, expected):
    with pytest.raises(ValidationError) as info:
        ServiceConfig.model_validate(body)
    assert config_error_message(info.value) == expected


def test_serve_refuses_a_typo_in_one_line_before_anything_is_created(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'ledger = "{tmp_path / "l.db"}"\n[reward]\nkind = "stub"\nsensitivty = 0.001\n[nosuch]\nx = 1\n')
    res = CliRunner().invoke(app, ["serve", "--config", str(cfg)])
    assert res.exit_code == 2
    out = " ".join(res.output.split())
    assert "unknown key 'sensitivty' in [reward]; did you mean 'sensitivity'?" in out and "'nosuch'" in out
    assert not (tmp_path / "l.db").exists()


@pytest.mark.parametrize("mechanism,needle", [
    ({"max_rounds": 0}, "max_rounds"),
    ({"max_rounds": 2.5}, "max_rounds"),
    ({"max_rounds_max": 0}, "max_rounds_max"),
    ({"max_rounds": 16, "max_rounds_max": 8}, "max_rounds_max must be >= max_rounds=16, got 8"),
])
def test_privitp_round_caps_out_of_range_are_refused_naming_the_value(mechanism, needle):
    """Issue 31: the operator's T and the largest T a request may ask are checked when the config loads."""
    with pytest.raises(ValidationError) as info:
        ServiceConfig.model_validate({"mechanism": mechanism})
    assert needle in config_error_message(info.value)


def test_privitp_round_caps_default_to_16_and_accept_a_wider_request_bound():
    assert ServiceConfig.model_validate({}).mechanism.max_rounds == 16
    m = ServiceConfig.model_validate({"mechanism": {"max_rounds": 8, "max_rounds_max": 64}}).mechanism
    assert (m.max_rounds, m.max_rounds_max) == (8, 64)
