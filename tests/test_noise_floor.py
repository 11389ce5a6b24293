"""PrivBoN's noise floor (issue 51): sigma = max(the noise epsilon needs, tau), and the selection
reports the epsilon it actually spends, computed from sigma (Gumbel: 2 Delta_r / sigma; Gaussian:
App. E eq. (26), checked against the 120-digit reference)."""

import numpy as np
import pytest

from privalign import accounting as A
from privalign import mechanisms as M

from . import reference as ref

SCORES = np.random.default_rng(51).random(16)


@pytest.mark.parametrize("noise", ["gumbel", "exact"])
@pytest.mark.parametrize("delta_r,epsilon", [(0.003, 1.0), (0.003, 0.1), (0.4, 2.0), (1.0, 4.0)])
@pytest.mark.parametrize("tau", [0.0, 0.001, 0.006, 0.05, 0.3, 2.0])
def test_gumbel_spends_two_delta_over_sigma(noise, delta_r, epsilon, tau):
    if noise == "exact":
        pytest.importorskip("opendp")
    sel = M.privbon(SCORES, epsilon=epsilon, sensitivity=delta_r, temperature=tau, noise=noise,
                    rng=np.random.default_rng(0))
    sigma = max(2 * delta_r / epsilon, tau)  # the independent formula
    assert sel.noise_scale == pytest.approx(sigma, rel=1e-12)
    assert sel.epsilon == pytest.approx(2 * delta_r / sigma, rel=1e-9)
    assert sel.epsilon <= epsilon * (1 + 1e-12)
    if tau > 2 * delta_r / epsilon:  # the floor binds: strictly less than the budget
        assert sel.epsilon < epsilon
    # what the accountant charges for that noise is the same number
    assert A.privbon_event(sel.noise_scale, delta_r, noise=noise).epsilon == pytest.approx(sel.epsilon, rel=1e-9)


@pytest.mark.parametrize("tau", [0.2, 0.5, 1.0])
def test_gaussian_floor_spends_what_eq_26_gives_at_sigma(tau):
    n, delta_r, epsilon = SCORES.size, 0.01, 1.0
    sel = M.privbon(SCORES, epsilon=epsilon, sensitivity=delta_r, temperature=tau, noise="gaussian",
                    rng=np.random.default_rng(0))
    calibrated = A.privbon_noise_scale(epsilon, delta_r, noise="gaussian", n=n, r_max=1.0)
    assert sel.noise_scale == max(calibrated, tau)
    assert tau > calibrated  # every tau here binds
    exact = float(ref.gaussian_rnm_epsilon(tau, delta_r, 1.0, n))
    assert exact <= sel.epsilon <= exact * (1 + 1e-6)  # eq. (26) from above, tight
    assert sel.epsilon < epsilon


@pytest.mark.parametrize("noise", ["gumbel", "gaussian", "exact"])
@pytest.mark.parametrize("seed", range(5))
def test_a_floor_below_the_minimum_noise_changes_nothing(noise, seed):
    if noise == "exact":
        pytest.importorskip("opendp")
    delta_r, epsilon = 0.05, 1.0
    minimum = (A.privbon_noise_scale(epsilon, delta_r, noise="gaussian", n=SCORES.size, r_max=1.0)
               if noise == "gaussian" else 2 * delta_r / epsilon)
    plain = M.privbon(SCORES, epsilon=epsilon, sensitivity=delta_r, noise=noise, rng=np.random.default_rng(seed))
    for tau in (0.0, minimum / 2, minimum * (1 - 1e-9)):
        floored = M.privbon(SCORES, epsilon=epsilon, sensitivity=delta_r, noise=noise, temperature=tau,
                            rng=np.random.default_rng(seed))
        assert floored.noise_scale == plain.noise_scale and floored.epsilon == plain.epsilon
        if noise != "exact":  # OpenDP draws from the OS: the same law, not the same draw
            assert floored.index == plain.index


def test_the_floor_also_applies_to_a_given_noise_scale_and_is_checked():
    sel = M.privbon(SCORES, noise_scale=0.01, sensitivity=0.003, temperature=0.1, rng=np.random.default_rng(0))
    assert sel.noise_scale == 0.1 and sel.epsilon == pytest.approx(0.06, rel=1e-12)
    for bad in (-0.1, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="temperature"):
            M.privbon(SCORES, epsilon=1.0, temperature=bad)


def test_gumbel_max_at_sigma_is_soft_bon_at_temperature_sigma():
    """The same law: the floor is soft BoN's temperature, bought with privacy (Thm 3.1)."""
    from privalign import theory

    r, sigma = SCORES[:5], 0.2
    law = theory.privbon_law(r, sigma, reward_range=(0, 1))
    softmax = np.exp(r / sigma) / np.exp(r / sigma).sum()
    assert np.allclose(law, softmax, rtol=1e-9)
    draws = 20_000
    rng = np.random.default_rng(7)
    counts = np.bincount([M.privbon(r, epsilon=1.0, sensitivity=0.003, temperature=sigma, rng=rng).index
                          for _ in range(draws)], minlength=r.size)
    # 5 standard errors of a binomial proportion at this many draws
    assert np.all(np.abs(counts / draws - softmax) <= 5 * np.sqrt(softmax * (1 - softmax) / draws))


# ---------------------------------------------------------------- the harness and `evaluate`
from privalign.evaluation import EvalSettings, evaluate  # noqa: E402
from privalign.simulate import simulate  # noqa: E402


@pytest.fixture(scope="module")
def hackable():
    return simulate("hackable", 12, 64, seed=5).grouped()


def rows(pool, **kw):
    s = EvalSettings(algorithms=("privbon", "privbon-gaussian"), n_grid=(1, 4, 16), replicates=5,
                     reward_range=(-3.0, 4.0), seed=1, **kw)
    return {(r["algorithm"], r["n"]): r for r in evaluate(pool, s).summary_rows()}


def test_the_harness_spends_what_the_floor_costs(hackable):
    eps, delta_r, tau = 1.0, 0.003, 0.05
    got = rows(hackable, epsilon=eps, sensitivity=delta_r, temperature=tau)
    for n in (1, 4, 16):
        r = got[("privbon", n)]
        sigma = max(2 * delta_r / eps, tau)
        assert r["sigma"] == pytest.approx(sigma, rel=1e-12)
        assert r["epsilon_spent"] == pytest.approx(2 * delta_r / sigma, rel=1e-9)  # 0.12, not 1
        g = got[("privbon-gaussian", n)]
        if n > 1:
            assert g["sigma"] >= tau
            assert g["epsilon_spent"] == pytest.approx(A.gaussian_rnm_epsilon(g["sigma"], delta_r, 1.0, n), rel=1e-12)
            assert g["epsilon_spent"] <= eps


def test_a_floor_below_the_minimum_noise_leaves_the_harness_unchanged(hackable):
    eps, delta_r = 1.0, 0.05
    plain = rows(hackable, epsilon=eps, sensitivity=delta_r)
    low = rows(hackable, epsilon=eps, sensitivity=delta_r, temperature=0.5 * 2 * delta_r / eps)
    assert low.keys() == plain.keys()
    for key, r in plain.items():  # every number the same (NaN where both are NaN: no halting time)
        assert {k: str(v) for k, v in low[key].items()} == {k: str(v) for k, v in r.items()}, key


def test_evaluate_writes_epsilon_spent(tmp_path):
    import csv

    from typer.testing import CliRunner

    from privalign.cli import app

    pool = tmp_path / "pool.parquet"
    simulate("hackable", 4, 32, seed=0).save(pool)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["evaluate", str(pool), "--algorithms", "bon,privbon", "--n", "1,8",
                                   "--replicates", "2", "--workers", "1", "--epsilon", "1", "--temperature", "0.1",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    got = {(r["algorithm"], r["n"]): r for r in csv.DictReader((out / "summary.csv").open())}
    # sensitivity defaults to the range's width, 1: 2 Delta_r / epsilon = 2 > tau, so the floor does not bind
    assert float(got[("privbon", "8")]["epsilon_spent"]) == pytest.approx(1.0, rel=1e-12)
    assert float(got[("privbon", "8")]["sigma"]) == pytest.approx(2.0, rel=1e-12)
    res = CliRunner().invoke(app, ["evaluate", str(pool), "--algorithms", "privbon", "--n", "8", "--replicates", "2",
                                   "--workers", "1", "--epsilon", "1", "--temperature", "4", "--out", str(out)])
    assert res.exit_code == 0, res.output
    row = next(csv.DictReader((out / "summary.csv").open()))
    assert float(row["epsilon_spent"]) == pytest.approx(2 * 1.0 / 4, rel=1e-12)


# ---------------------------------------------------------------- the service, through `privalign serve`
FLOOR_SERVICE = """
admin_keys = ["{admin}"]
[clients.{client}]
tenant = "acme"
[generator]
backend = "stub"
[reward]
kind = "stub"
output_range = [0.0, 1.0]
sensitivity = 0.003
[mechanism]
name = "privbon"
n = 4
epsilon = 1.0
temperature = 0.03
temperature_max = 0.5
[[budgets]]
name = "acme-basic"
tenant = "acme"
epsilon_total = 5.0
composition = "basic"
[[budgets]]
name = "acme-fsrc"
tenant = "acme"
epsilon_total = 5.0
composition = "fsrc"
[[budgets]]
name = "acme-zcdp"
tenant = "acme"
epsilon_total = 5.0
delta_total = 1e-6
composition = "zcdp"
"""


def test_serve_charges_the_floor_exactly_what_it_spends_on_every_composition(tmp_path):
    """`privalign serve` on loopback: [mechanism] temperature is privbon's noise floor, a request's
    privalign.temperature replaces it within temperature_max, never below 2 Delta_r / epsilon, and
    each query is charged exactly 2 Delta_r / sigma (its rho, under zcdp, eps^2 / 8), in the response
    and in the ledger, under basic, FSRC and zCDP composition."""
    from privalign.ledger import Ledger

    from .test_server import ADMIN, CLIENT, Server, chat

    delta_r = 0.003
    srv = Server(tmp_path, FLOOR_SERVICE.format(admin=ADMIN, client=CLIENT))
    srv.start()
    # (the request's privalign block, the sigma the independent formula gives)
    asks = [({}, max(2 * delta_r / 1.0, 0.03)),                                   # the operator's floor: eps 0.2
            ({"temperature": 0.1}, 0.1),                                            # a request's own: eps 0.06
            ({"temperature": 0.001}, 2 * delta_r / 1.0),                            # below the minimum: eps 1
            ({"temperature": 0}, 2 * delta_r / 1.0),                                # no floor: eps 1
            ({"epsilon": 0.5, "temperature": 0.2}, 0.2),                            # eps 0.03
            ({"noise_scale": 0.01, "temperature": 0.05}, 0.05)]                     # eps 0.12
    try:
        for budget in ("acme-basic", "acme-fsrc", "acme-zcdp"):
            expected = []
            for ext, sigma in asks:
                status, body = chat(srv.url, {**ext, "budget": budget})
                assert status == 200, body
                p = body["privalign"]
                spent = 2 * delta_r / sigma
                assert p["noise_scale"] == pytest.approx(sigma, rel=1e-12)
                assert p["epsilon_charged"] == pytest.approx(spent, rel=1e-6)  # shown rounded
                assert p["epsilon_max"] == p["epsilon_charged"]  # nothing reserved beyond what is spent
                if budget == "acme-zcdp":
                    assert p["rho_charged"] == pytest.approx(spent ** 2 / 8, rel=1e-6)
                expected.append(spent)
            # refusals charge nothing: over the operator's cap, and a temperature for privitp
            for ext in ({"temperature": 0.6}, {"temperature": -1}, {"mechanism": "privitp", "temperature": 0.1}):
                status, body = chat(srv.url, {**ext, "budget": budget})
                assert status == 400 and "temperature" in body["error"]["message"], body
            led = Ledger(str(srv.ledger_path))
            charges = [c[2] for c in led.charges(budget)]
            assert len(charges) == len(asks)
            for got, want, (ext, sigma) in zip(charges, expected, asks):
                assert got == pytest.approx(want, rel=1e-12)
                assert got == A.gumbel_epsilon(max(A.gumbel_noise_scale(ext.get("epsilon", 1.0), delta_r)
                                                   if "noise_scale" not in ext else ext["noise_scale"],
                                                   ext.get("temperature", 0.03)), delta_r)  # bit for bit
            state = led.budget(budget)
            assert state.queries == len(asks) and state.open == 0
            if budget == "acme-zcdp":
                assert state.spent_rho == pytest.approx(sum(e ** 2 / 8 for e in expected), rel=1e-9)
            else:
                assert state.spent.epsilon == pytest.approx(sum(expected), rel=1e-9)
    finally:
        srv.stop()


# ---------------------------------------------------------------- reproduce: tau per n on held-out prompts
def test_reproduce_chooses_the_floor_per_n_on_held_out_prompts_and_reports_what_it_spends():
    """On a hackable world with a small Delta_r, the held-out prompts choose more noise than the
    minimum at large n; the test rows at the tuned floor spend exactly 2 Delta_r / sigma < epsilon."""
    from privalign.evaluation import private as P
    from privalign.evaluation.experiments import split_prompts
    from privalign.evaluation.suite import floor_headline

    pool = simulate("hackable", 40, 256, seed=8).grouped()
    base = EvalSettings(replicates=10, reward_range=(-3.0, 3.0), sensitivity=0.003, seed=2)
    held_idx, test_idx = split_prompts(pool.n_prompts, 0.5, 0)
    held, test = pool.subset(held_idx), pool.subset(test_idx)
    floors, rows = P.tune_temperature(held, base, 1.0, (1, 16, 64))
    assert len(rows) == len(P.TEMPERATURE_GRID) * 3
    for n, c in floors.items():  # the choice is the held-out argmax, and what it spends follows from sigma
        best = max(r["heldout_accuracy"] for r in rows if r["n"] == n)
        assert c["heldout_accuracy"] == best
        assert c["sigma"] == pytest.approx(max(0.006, c["temperature"]), rel=1e-12)
        assert c["epsilon_spent"] == pytest.approx(0.006 / c["sigma"], rel=1e-9)
    assert floors[64]["sigma"] > 0.006 and floors[64]["epsilon_spent"] < 1.0  # more noise selects better
    chosen = {"itp": {"beta": 0.05}}
    curve = P.curves(test, base, chosen, (1.0,), (16, 64), {1.0: floors})
    tuned = [r for r in curve if r["method"].endswith(P.TUNED)]
    assert [r["n"] for r in tuned] == [16, 64]
    for r in tuned:
        assert r["epsilon_spent"] == r["worst_case_epsilon"] == pytest.approx(0.006 / r["sigma"], rel=1e-9)
        assert r["temperature"] == floors[r["n"]]["temperature"]
    head = floor_headline(curve, (1.0,))["1"]
    assert head["64"]["epsilon_spent"] == tuned[1]["epsilon_spent"] and head["64"]["bon_accuracy"] is not None


# ---------------------------------------------------------------- the planner
def test_plan_counts_queries_at_the_epsilon_actually_spent():
    from typer.testing import CliRunner

    from privalign.accounting import planner
    from privalign.cli import app

    delta_r, eps, tau = 0.003, 1.0, 0.05
    event = planner.query_event("privbon", eps, sensitivity=delta_r, temperature=tau)
    assert event.epsilon == pytest.approx(2 * delta_r / tau, rel=1e-12)  # 0.12, not 1
    counts = planner.plan_counts(10.0, 1e-6, event)
    assert counts["basic"] == counts["fsrc"] == 83  # floor(10 / 0.12)
    assert counts["zcdp"] > counts["basic"]
    below = planner.query_event("privbon", eps, sensitivity=delta_r, temperature=0.001)  # below the minimum noise
    assert below == planner.query_event("privbon", eps, sensitivity=delta_r)
    with pytest.raises(ValueError, match="temperature"):
        planner.query_event("privitp", eps, sensitivity=delta_r, temperature=tau)
    res = CliRunner().invoke(app, ["plan", "--epsilon-total", "10", "--epsilon", "1", "--sensitivity", "0.003",
                                   "--temperature", "0.05"])
    assert res.exit_code == 0 and "spending 0.12" in res.output and " 83 " in res.output, res.output
    res = CliRunner().invoke(app, ["plan", "--epsilon-total", "10", "--queries", "5", "--temperature", "0.05"])
    assert res.exit_code == 2 and "--temperature" in res.output


def test_the_harness_calibrates_privitp_to_epsilon_at_each_n(hackable):
    """With --epsilon, PrivITP (no floor) is calibrated at every n: its worst case fits, and it spends less."""
    s = EvalSettings(algorithms=("privitp",), n_grid=(4, 16), replicates=3, reward_range=(-3.0, 4.0), seed=1,
                     epsilon=1.0, sensitivity=0.05, delta=1e-5, temperature=0.3)
    for r in evaluate(hackable, s).summary_rows():
        at = s.at("privitp", r["n"])
        worst = A.privitp_epsilon_max(r["n"], at.beta, at.sx, at.sz, at.delta, 0.05, 1.0)
        assert worst <= 1.0 and 0 < r["epsilon_spent"] <= worst
        assert r["sigma"] == pytest.approx(at.sx + at.sz, rel=1e-12)


def test_the_headline_says_where_privacy_is_free():
    from privalign.report.html import headline_sentences

    row = {"temperature": 0.05, "sigma": 0.05, "epsilon_spent": 0.12, "accuracy": 0.55,
           "minimum_noise_accuracy": 0.1, "bon_accuracy": 0.08, "binds": True, "epsilon_star": 0.12}
    h = {"target_epsilon": 1.0, "noise_floor": {"1": {"2": {**row, "binds": False, "epsilon_star": None},
                                                      "1024": row}}}
    (line,) = headline_sentences(h)
    assert "n = 1024" in line and "spends 0.12 of epsilon = 1" in line and "epsilon* = 0.12" in line
    h["noise_floor"]["1"]["1024"] = {**row, "binds": False, "epsilon_star": None}
    assert "does not bind" in headline_sentences(h)[0]


def test_privacy_utility_plateaus_above_epsilon_star():
    """Above epsilon*, the tuned floor selects the same way at every epsilon and spends epsilon*."""
    from privalign.evaluation import private as P
    from privalign.evaluation.experiments import split_prompts

    pool = simulate("hackable", 40, 256, seed=8).grouped()
    base = EvalSettings(replicates=10, reward_range=(-3.0, 3.0), sensitivity=0.003, seed=2)
    held_idx, test_idx = split_prompts(pool.n_prompts, 0.5, 0)
    rows = P.privacy_utility(pool.subset(test_idx), base, {"itp": {"beta": 0.05}}, (1.0, 4.0, 10.0), n=64,
                             held=pool.subset(held_idx))
    tuned = {r["target_epsilon"]: r for r in rows if r["method"].endswith(P.TUNED)}
    assert set(tuned) == {1.0, 4.0, 10.0}
    star = tuned[10.0]["epsilon_spent"]
    assert star < 1.0  # the floor binds at every epsilon here
    for eps in (1.0, 4.0):
        assert tuned[eps]["sigma"] == tuned[10.0]["sigma"] and tuned[eps]["accuracy"] == tuned[10.0]["accuracy"]
        assert tuned[eps]["epsilon_spent"] == star
    plain = {r["target_epsilon"]: r for r in rows if r["method"] == P.LABELS["privbon"]}
    assert plain[10.0]["epsilon_spent"] == pytest.approx(10.0) and plain[10.0]["accuracy"] < tuned[10.0]["accuracy"]
