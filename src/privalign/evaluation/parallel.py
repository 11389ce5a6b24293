"""Run the harness's prompt shards in one process, on a local process pool, or on a Dask cluster.

Every prompt draws from its own generator (``harness.prompt_generator(seed, k)``), so the result
array is the same bit for bit whatever the executor, the number of workers or the shard sizes.

* ``local``: ``settings.workers`` processes. Where the platform can fork, the workers inherit the
  prepared pool read-only from the parent (nothing is pickled but the shard bounds and the
  results); elsewhere it is pickled once per worker. Runs too small to repay the start-up of a
  pool (estimated below ``PARALLEL_MIN_WORK``) stay in the calling process.
* ``dask``: the same shards as tasks on a running Dask cluster (``settings.scheduler``, e.g.
  ``tcp://host:8786``); the prepared pool is scattered to the workers once. Needs the optional
  extra ``privalign[cluster]`` on the client and on every worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from itertools import pairwise

import numpy as np

from ..pools import GroupedPool
from .harness import METRICS, EvalResult, EvalSettings, PreparedPool, evaluate_prompts, prepare

# Estimated work (candidate draws, see ``work``) below which a local pool does not pay for its
# start-up: about 0.4 s of one core.
PARALLEL_MIN_WORK = 10_000_000
SHARDS_PER_WORKER = 16  # small shards: balanced load and a fine-grained progress bar

_STATE: tuple[PreparedPool, EvalSettings] | None = None  # a local worker's (prepared pool, settings)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), the default number of workers."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def work(n_prompts: int, s: EvalSettings) -> float:
    """Rough cost of a run in units of one candidate of the exact BoN/ITP laws (about 40 ns): a
    Gaussian-PrivBoN candidate costs a quadrature (about 1,000 units), a plain Monte Carlo replicate
    a mechanism call (about 1,000 units)."""
    per_call = 1000 if s.estimator == "mc" else 32
    per_candidate = sum(1000 if (a == "privbon-gaussian" and s.estimator == "exact") else 1 for a in s.algorithms)
    return float(n_prompts) * s.replicates * sum(per_candidate * int(n) + len(s.algorithms) * per_call
                                                 for n in s.n_grid)


def local_processes(n_prompts: int, s: EvalSettings) -> int:
    """How many processes a local run uses: 1 (no pool) for a single worker or a small run."""
    workers = usable_cores() if s.workers is None else int(s.workers)
    workers = min(workers, n_prompts)
    if workers <= 1 or work(n_prompts, s) < PARALLEL_MIN_WORK:
        return 1
    return workers


def shards(n_prompts: int, pieces: int) -> list[tuple[int, int]]:
    """Contiguous prompt ranges [lo, hi), at most ``pieces`` of them, none empty."""
    edges = np.linspace(0, n_prompts, min(pieces, n_prompts) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in pairwise(edges) if b > a]


def run(prep: PreparedPool, s: EvalSettings, progress: Callable[[int, int], None] | None = None
        ) -> tuple[np.ndarray, np.ndarray]:
    """(metrics (algorithms, n_grid, prompts, metrics), base (prompts, 4)) for every prompt."""
    P = prep.pool.n_prompts
    out = np.empty((len(s.algorithms), len(s.n_grid), P, len(METRICS)))
    base = np.empty((P, 4))
    done = 0

    def collect(lo, hi, block):
        nonlocal done
        out[:, :, lo:hi], base[lo:hi] = block
        done += hi - lo
        if progress is not None:
            progress(done, P)

    if s.executor == "dask":
        _run_dask(prep, s, collect)
        return out, base
    processes = local_processes(P, s)
    if processes == 1:
        for k in range(P):  # prompt by prompt, for the progress bar
            collect(k, k + 1, evaluate_prompts(prep, s, k, k + 1))
        return out, base
    _run_local(prep, s, processes, collect)
    return out, base


def _init(state) -> None:
    global _STATE
    _STATE = state


def _local_shard(lo: int, hi: int):
    prep, s = _STATE
    return lo, hi, evaluate_prompts(prep, s, lo, hi)


def _run_local(prep, s, processes, collect) -> None:
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else "spawn")  # fork: the pool is shared, not copied
    with ProcessPoolExecutor(processes, mp_context=ctx, initializer=_init, initargs=((prep, s),)) as ex:
        futures = [ex.submit(_local_shard, lo, hi) for lo, hi in shards(prep.pool.n_prompts,
                                                                           processes * SHARDS_PER_WORKER)]
        try:
            for f in as_completed(futures):
                collect(*f.result())
        except BaseException:  # Ctrl-C or a failed shard: drop the queued shards
            for f in futures:
                f.cancel()
            raise


def _dask_shard(prep, s, lo: int, hi: int):
    return lo, hi, evaluate_prompts(prep, s, lo, hi)


def _run_dask(prep, s, collect) -> None:
    try:
        from distributed import Client
        from distributed import as_completed as dask_completed
    except ImportError as e:
        raise ImportError("the dask executor needs the optional extra: pip install 'privalign[cluster]'") from e
    try:
        client = Client(s.scheduler, set_as_default=False)
    except OSError as e:  # unreachable scheduler: one line, not a traceback
        raise ValueError(f"cannot reach the Dask scheduler at {s.scheduler}: {e}") from e
    with client:
        threads = sum(client.nthreads().values()) or 1
        shared = client.scatter(prep, broadcast=True, hash=False)  # sent once to every worker
        futures = [client.submit(_dask_shard, shared, s, lo, hi, pure=False)
                   for lo, hi in shards(prep.pool.n_prompts, threads * SHARDS_PER_WORKER)]
        try:
            for f in dask_completed(futures, loop=client.loop):
                collect(*f.result())
        except BaseException:
            client.cancel(futures)
            raise


def evaluate(pool: GroupedPool, settings: EvalSettings, progress: Callable[[int, int], None] | None = None
             ) -> EvalResult:
    """Run the harness; ``progress(done, total)`` is called as prompts complete.

    ``settings.workers`` processes (or the Dask cluster of ``settings.scheduler``) share the
    prompts; the results do not depend on how.
    """
    s = settings.check()
    prep = prepare(pool, s)
    out, base = run(prep, s, progress)
    return EvalResult(s, out, base, prep.reward_range, pool.prompt_ids)
