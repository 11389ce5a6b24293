"""Secure noise: the cost of privbon's exact sampler and of the CSPRNG default, as ratios.

Run: ``.venv/bin/python benchmarks/bench_secure.py``

* ``noise="exact"`` (OpenDP's exact report-noisy-max) against the fast Gumbel path, per selection,
  at n = 16, 256 and 4096;
* ``rng=None`` (AESCounter keyed from os.urandom) against a seeded PCG64 generator, per Gumbel
  selection at n = 4096.
Best of 5 rounds each, both measured in the same run.
"""

from __future__ import annotations

import platform
import timeit
import warnings

import numpy as np

import privalign as pa


def best(fn, number):
    return min(timeit.repeat(fn, number=number, repeat=5)) / number


def main():
    warnings.simplefilter("ignore")
    rng = np.random.default_rng(0)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    for n in (16, 256, 4096):
        r = rng.random(n)
        exact = best(lambda: pa.privbon(r, noise_scale=0.5, noise="exact"), 50)
        fast = best(lambda: pa.privbon(r, noise_scale=0.5, rng=rng), 500)
        print(f"n = {n:>4}: exact {exact * 1e6:8.1f} us, gumbel {fast * 1e6:6.1f} us, ratio {exact / fast:6.1f}x")
    r = rng.random(4096)
    secure = best(lambda: pa.privbon(r, noise_scale=0.5), 500)
    seeded = best(lambda: pa.privbon(r, noise_scale=0.5, rng=rng), 500)
    print(f"n = 4096 gumbel: rng=None (AESCounter) {secure * 1e6:.1f} us, seeded PCG64 {seeded * 1e6:.1f} us, "
          f"ratio {secure / seeded:.2f}x")


if __name__ == "__main__":
    main()
