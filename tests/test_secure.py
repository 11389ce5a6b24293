"""Secure noise by default (issue 12): which generator the deployment path uses, no +inf Gumbel
atom, released ex-post costs snapped to a grid."""

import threading

import numpy as np
import pytest

import privalign as pa
import privalign.accounting as A
from privalign import _validation
from privalign.accounting._rounding import SNAP, snap_up


def test_rng_none_draws_from_the_aes_counter_csprng():
    g = _validation.as_generator(None)
    assert type(g.bit_generator).__name__ == "AESCounter"
    assert _validation.as_generator(None) is g  # one per thread, keyed once from os.urandom
    other = []
    t = threading.Thread(target=lambda: other.append(_validation.as_generator(None)))
    t.start()
    t.join()
    assert other[0] is not g and type(other[0].bit_generator).__name__ == "AESCounter"
    seeded = np.random.default_rng(0)
    assert _validation.as_generator(seeded) is seeded  # research runs keep their seeded generator


def test_service_requests_use_the_secure_generator(tmp_path, monkeypatch):
    from privalign.server.app import Service, StubGenerator
    from privalign.server.config import ServiceConfig

    used = []
    real = _validation.secure_generator
    monkeypatch.setattr(_validation, "secure_generator", lambda: used.append(1) or real())
    cfg = ServiceConfig.model_validate({"ledger": str(tmp_path / "l.db"), "generator": {"backend": "stub"},
                                        "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
                                        "budgets": [{"name": "default", "epsilon_total": 100.0, "delta_total": 0.9}]})
    svc = Service(cfg, generator=StubGenerator())
    for mech in ("privbon", "privitp"):
        before = len(used)
        out = svc.answer([{"role": "user", "content": "hi"}], {"mechanism": mech, "n": 4}, "default")
        assert len(used) > before
        charged = {rid: e for rid, _, e, _ in svc.ledger.charges("default")}[out["privalign"]["request_id"]]
        assert out["privalign"]["epsilon_charged"] == float(f"{charged:.12g}")  # shown rounded, kept exact
        if mech == "privitp":  # snapped: no low bits of lambda~ in what is recorded or released
            eps_max = A.privitp_epsilon_max(4, 0.05, 1.0, 1.0, 1e-8, 0.1, 1.0)
            assert charged / SNAP == int(charged / SNAP) or charged == eps_max


def test_service_charges_a_privitp_overrun_in_full(tmp_path, monkeypatch):
    """Issue 23: a realised ex-post epsilon above the reserved worst case is charged in full (the
    filter's rule), never clamped to epsilon_max; the worst case is reserved on the snapping grid."""
    import dataclasses

    from privalign.server import selection as server_app
    from privalign.server.app import Service, StubGenerator
    from privalign.server.config import ServiceConfig

    cfg = ServiceConfig.model_validate({"ledger": str(tmp_path / "l.db"), "generator": {"backend": "stub"},
                                        "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
                                        "budgets": [{"name": "default", "epsilon_total": 1000.0, "delta_total": 0.9}]})
    svc = Service(cfg, generator=StubGenerator())
    real = server_app.M.privitp
    eps_max = snap_up(A.privitp_epsilon_max(4, 0.05, 1.0, 1.0, 1e-8, 0.1, 1.0))
    monkeypatch.setattr(server_app.M, "privitp",
                        lambda *a, **kw: dataclasses.replace(real(*a, **kw), epsilon=3 * eps_max))
    out = svc.answer([{"role": "user", "content": "hi"}], {"mechanism": "privitp", "n": 4}, "default")
    assert out["privalign"]["epsilon_max"] == pytest.approx(eps_max, rel=1e-11)
    charged = {rid: e for rid, _, e, _ in svc.ledger.charges("default")}[out["privalign"]["request_id"]]
    assert charged == snap_up(3 * eps_max) > eps_max
    assert svc.ledger.check() == []


def test_gumbel_noise_never_draws_the_infinite_atom():
    class ZerosFirst(np.random.Generator):
        calls = 0

        def standard_exponential(self, size=None, *a, **kw):
            ZerosFirst.calls += 1
            out = super().standard_exponential(size, *a, **kw)
            if ZerosFirst.calls == 1:
                out[:] = 0.0  # E = 0: log E = -inf, a Gumbel of +inf
            return out

    rng = ZerosFirst(np.random.PCG64(0))
    sel = pa.privbon(np.array([0.0, 1.0, 0.0]), noise_scale=1e-9, rng=rng)
    assert sel.index == 1 and ZerosFirst.calls == 2  # redrawn, and the scores decide again


@pytest.mark.parametrize("x", [0.0, 1e-12, 0.3, 5.119467636, 1e3])
def test_snap_up_is_a_grid_point_at_or_above(x):
    y = snap_up(x)
    assert y >= x and y - x < SNAP and (y / SNAP).is_integer()


def _exponential_rnm_law(r, scale):
    """P(i) for argmax_i r_i + scale E_i, E_i ~ Exp(1) i.i.d. (permute-and-flip), by quadrature."""
    from scipy import integrate

    def win(i, e):
        x = r[i] + scale * e
        return np.exp(-e) * np.prod([1 - np.exp(-(x - r[j]) / scale) if x > r[j] else 0.0
                                     for j in range(len(r)) if j != i])

    return np.array([integrate.quad(lambda e: win(i, e), 0, np.inf, limit=200)[0] for i in range(len(r))])


def test_exact_privbon_follows_permute_and_flip_and_states_its_epsilon():
    """OpenDP draws from the OS (it cannot be seeded: that is the point), so this chi-square test at
    level 1e-3 fails by chance once in a thousand runs; the same sample must reject softmax."""
    from scipy import stats

    r, scale, draws = np.array([0.0, 0.5, 1.0]), 0.5, 4000
    picks = [pa.privbon(r, noise_scale=scale, noise="exact") for _ in range(draws)]
    assert all(s.epsilon == 2 * 1.0 / scale and s.mechanism == "privbon-exact" for s in picks[:5])
    counts = np.bincount([s.index for s in picks], minlength=3)
    law = _exponential_rnm_law(r, scale)
    assert law.sum() == pytest.approx(1.0, abs=1e-9)
    assert stats.chisquare(counts, law * draws).pvalue > 1e-3
    softmax = np.exp(r / scale) / np.exp(r / scale).sum()
    assert stats.chisquare(counts, softmax * draws).pvalue < 1e-3  # the test has power
    assert pa.privbon(r, epsilon=1.0, sensitivity=0.25, noise="exact").noise_scale == pytest.approx(0.5)
