"""Core performance: selections per second and the ex-post accountant's throughput.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_core.py``). Speeds are also reported as
ratios against baselines measured in the same run, since the machines here are shared and noisy.

* privbon / itp on 4096 candidates, one core (numpy element-wise kernels are single-threaded);
  baseline: the textbook Gumbel-max ``argmax(r + rng.gumbel(0, sigma, n))`` and a sort-based ITP.
* privitp_epsilon2 vectorised over (lambda~, t); baseline: the same formula with each
  E_u Phi(.) replaced by a 512-point midpoint grid quadrature.
"""

from __future__ import annotations

import os
import platform
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
from scipy import special

import privalign as pa
import privalign.accounting as A


def rate(fn, min_time=0.3, rounds=7):
    """Calls per second of fn(): the best of ``rounds`` rounds of at least ``min_time`` seconds each."""
    best = 0.0
    for _ in range(rounds):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_time:
            fn()
            count += 1
        best = max(best, count / elapsed)
    return best


def grid_epsilon2(t, lam_t, sigma_z, d, r_max, L, points=512):
    u = (np.arange(points) + 0.5) / points
    b = r_max + sigma_z * L - lam_t

    def mean_ndtr(x):  # E_u Phi(x(u)) on the grid, x of shape (m, points)
        return special.ndtr(x).mean(axis=1)

    bu = b[:, None] * u[None, :]
    lt = lam_t[:, None]
    kappa = np.log(mean_ndtr((lt + bu - r_max + d) / sigma_z)) - np.log(mean_ndtr((lt + bu - r_max) / sigma_z))
    accept = np.log(mean_ndtr((d - lt - bu) / sigma_z)) - np.log(mean_ndtr((-lt - bu) / sigma_z))
    return (t - 1) * kappa + accept


def main():
    rng = np.random.default_rng(0)
    n = 4096
    r = rng.random(n)
    sigma = 0.1
    rows = []

    privbon_rate = rate(lambda: pa.privbon(r, noise_scale=sigma, rng=rng))
    naive_rate = rate(lambda: int(np.argmax(r + rng.gumbel(0.0, sigma, n))))
    rows.append(("privbon (gumbel), n=4096", privbon_rate, "selections/s",
                 f"{privbon_rate / naive_rate:.2f}x textbook argmax(r + rng.gumbel) (no validation)"))
    privbon_g = rate(lambda: pa.privbon(r, noise_scale=sigma, noise="gaussian", rng=rng))
    rows.append(("privbon (gaussian), n=4096", privbon_g, "selections/s", "epsilon memoised per (sigma, n)"))

    from privalign.accounting.privitp import _lambda_sorted
    itp_rate = rate(lambda: pa.itp(r, beta=0.05, rng=rng))
    sort_rate = rate(lambda: _lambda_sorted(r, n * 0.05))
    rows.append(("itp, n=4096, beta=0.05", itp_rate, "selections/s",
                 f"{itp_rate / sort_rate:.2f}x the sort-based lambda solve alone"))

    m = 1_000_000
    lam = rng.uniform(-0.05, 1.0, m)
    t = rng.integers(1, 17, m)
    L = A.default_truncation(16)
    start = time.perf_counter()
    A.privitp_epsilon2(t, lam, 0.25, 1.0, 1.0, L)
    fast = m / (time.perf_counter() - start)
    k = 20_000
    start = time.perf_counter()
    grid_epsilon2(t[:k], lam[:k], 0.25, 1.0, 1.0, L)
    slow = k / (time.perf_counter() - start)
    rows.append(("privitp_epsilon2, vectorised", fast, "evaluations/s",
                 f"{fast / slow:.0f}x a 512-point grid quadrature ({slow:,.0f}/s)"))

    eps_max_rate = rate(lambda: A.privitp_epsilon_max(16, 0.05, 0.5, 0.5, 1e-2, 1.0, 1.0, L))
    rows.append(("privitp_epsilon_max, n=16", eps_max_rate, "evaluations/s", "rigorous upper bound"))

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"numpy {np.__version__}")
    print("| what | rate | unit | against baseline |")
    print("|---|---:|---|---|")
    for name, value, unit, note in rows:
        print(f"| {name} | {value:,.0f} | {unit} | {note} |")


if __name__ == "__main__":
    main()
