"""Secure noise by default (issue 12): which generator the deployment path uses, no +inf Gumbel
atom, released ex-post costs snapped to a grid."""

import threading

import numpy as np
import pytest

import privalign as pa
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
        eps = out["privalign"]["epsilon_charged"]
        if mech == "privitp":  # snapped: no low bits of lambda~ in what is released
            assert eps / SNAP == int(eps / SNAP) or eps == out["privalign"]["epsilon_max"]


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
