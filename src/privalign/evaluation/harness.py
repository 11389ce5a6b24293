"""The evaluation harness: replay selection algorithms on bootstrap replicates drawn from a pool.

Per prompt, per n, per algorithm, each of ``replicates`` replicates draws n candidates from the
prompt's pool (PrivITP: two independent batches), with replacement by default. Per-prompt metrics
are means over replicates; the summary reports their mean and standard error across prompts.
Prompt k draws from its own generator, seeded by (seed, k), so shards of prompts can run anywhere
(``evaluation.parallel``: processes or a Dask cluster) with results identical to one process's.

Estimators
    ``"exact"`` (default): the exact selection law of each mechanism given its candidates
    (Rao-Blackwellisation, ``evaluation.laws``). BoN uses its closed form under resampling, i.e.
    infinitely many replicates. PrivITP's lambda~ is drawn once per replicate and the Phase-2
    law composed given it.
    ``"mc"``: plain Monte Carlo. One selection per replicate, made by the real mechanisms in
    ``privalign.mechanisms``: an independent code path that the tests compare with ``"exact"``.

Metrics, per selection (the fallback counts as a fresh base-policy draw)
    accuracy      true reward of the chosen response
    proxy_reward  raw proxy score of the chosen response
    win_rate      P(proxy(Y) > proxy(Y0)) + P(=)/2 against Y0 from the base policy (the pool)
    true_win_rate the same with the true reward (the headline metric when it comes from a gold RM)
    hacking_gap   proxy - true of the chosen response (in the pool's raw units)
    halting_time  ITP/PrivITP: generations in the (second) phase, n + 1 for the fallback (PrivITP
                  capped at T = ``max_rounds``: T + 1)
    epsilon       privacy spent per query (PrivITP: mean realised ex-post epsilon); the summary
                  repeats it as ``epsilon_spent`` beside ``sigma``, the noise used at that n
    fallback      ITP/PrivITP: the probability that no candidate is accepted (a fresh draw answers)

Noise
    ``sigma`` (PrivBoN's noise, PrivITP's total split in halves), or with ``epsilon`` set, every
    private method calibrated at each n to spend at most ``epsilon`` per query (Gaussian PrivBoN and
    PrivITP re-calibrated per n: their worst case grows with n; PrivITP splits it in halves between
    its phases). ``temperature`` tau is PrivBoN's noise floor (Gumbel and Gaussian): sigma =
    max(that noise, tau), and the query spends what sigma costs, 2 Delta_r / sigma for Gumbel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from .. import accounting as A
from .. import mechanisms as M
from ..pools import GroupedPool
from . import laws

ALGORITHMS = ("bon", "privbon", "privbon-gaussian", "itp", "privitp")
NORMALISATIONS = ("none", "global", "per-prompt")
METRICS = ("accuracy", "proxy_reward", "win_rate", "true_win_rate", "hacking_gap", "halting_time", "epsilon",
           "fallback")
DEFAULT_N_GRID = tuple(2 ** k for k in range(13))
EXECUTORS = ("local", "dask")


@dataclass
class EvalSettings:
    algorithms: tuple[str, ...] = ("bon", "privbon", "itp", "privitp")
    n_grid: tuple[int, ...] = DEFAULT_N_GRID
    replicates: int = 50
    sigma: float = 0.5
    beta: float = 0.05
    sigma_x: float | None = None   # default sigma / 2 (the paper's split)
    sigma_z: float | None = None   # default sigma / 2
    truncation: float | None = None  # default sqrt(2 ln T)
    max_rounds: int | None = None  # PrivITP's Phase-2 cap: T = min(max_rounds, n) at each n; None: T = n
    delta: float = 1e-2
    sensitivity: float | None = None  # in units of the range; default 1 (its full width)
    reward: str | None = None
    normalisation: str = "none"
    reward_range: tuple[float, float] | None = None  # default: the normalised rewards' min and max
    replace: bool = True
    estimator: str = "exact"
    seed: int = 0
    extra: dict = field(default_factory=dict)
    epsilon: float | None = None      # calibrate every private method to this epsilon per query at each n
    temperature: float = 0.0          # PrivBoN's noise floor tau, in units of the range (0: none)
    # Execution only: results are identical for every choice (each prompt has its own generator).
    workers: int | None = 1           # local processes; None: every usable core
    executor: str = "local"           # "local" (process pool) or "dask" (a running Dask cluster)
    scheduler: str | None = None      # the Dask scheduler's address, e.g. tcp://host:8786

    def check(self) -> "EvalSettings":
        bad = [a for a in self.algorithms if a not in ALGORITHMS]
        if bad or not self.algorithms:
            raise ValueError(f"algorithms must be a non-empty subset of {ALGORITHMS}, got {list(self.algorithms)}")
        if not self.n_grid or any(int(n) != n or n < 1 for n in self.n_grid):
            raise ValueError(f"n must be a list of positive integers, got {list(self.n_grid)}")
        if self.replicates < 1:
            raise ValueError(f"replicates must be >= 1, got {self.replicates}")
        for name in ("sigma", "beta", "delta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"epsilon must be a positive number (or None: use sigma), got {self.epsilon!r}")
        A.check_temperature(self.temperature)
        if not self.delta < 1:
            raise ValueError(f"delta must lie in (0, 1), got {self.delta!r}")
        if self.max_rounds is not None and (isinstance(self.max_rounds, bool) or int(self.max_rounds) != self.max_rounds
                                            or self.max_rounds < 1):
            raise ValueError(f"max_rounds must be a positive integer (or None for T = n), got {self.max_rounds!r}")
        if self.normalisation not in NORMALISATIONS:
            raise ValueError(f"normalisation must be one of {NORMALISATIONS}, got {self.normalisation!r}")
        if self.estimator not in ("exact", "mc"):
            raise ValueError(f"estimator must be 'exact' or 'mc', got {self.estimator!r}")
        if int(self.seed) != self.seed or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.workers is not None and (int(self.workers) != self.workers or self.workers < 1):
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.executor == "dask" and not self.scheduler:
            raise ValueError("the dask executor needs a scheduler address (e.g. tcp://host:8786)")
        return self

    def at(self, algo: str, n: int) -> "EvalSettings":
        """The settings ``algo`` runs under at n candidates: PrivBoN's sigma floored at ``temperature``,
        and with ``epsilon`` set, every private method's noise calibrated to it at n."""
        sens = 1.0 if self.sensitivity is None else self.sensitivity
        if algo in ("privbon", "privbon-gaussian"):
            noise = "gumbel" if algo == "privbon" else "gaussian"
            if self.epsilon is None:
                return replace(self, sigma=max(self.sigma, self.temperature))
            if noise == "gaussian" and n == 1:  # one candidate: no noise is needed and none spends anything
                return replace(self, sigma=max(1.0, self.temperature))
            return replace(self, sigma=A.privbon_noise_scale(self.epsilon, sens, noise=noise, n=int(n), r_max=1.0,
                                                             temperature=self.temperature))
        if algo == "privitp" and self.epsilon is not None:
            sx, sz = _privitp_scales(float(self.epsilon), self.delta, self.rounds(n), float(self.beta), sens)
            return replace(self, sigma=sx + sz, sigma_x=sx, sigma_z=sz)
        return self

    def rounds(self, n: int) -> int:
        """PrivITP's Phase-2 rounds at n candidates: T = min(max_rounds, n)."""
        return int(n) if self.max_rounds is None else min(int(self.max_rounds), int(n))

    @property
    def sx(self) -> float:
        return self.sigma / 2 if self.sigma_x is None else self.sigma_x

    @property
    def sz(self) -> float:
        return self.sigma / 2 if self.sigma_z is None else self.sigma_z

    def as_dict(self) -> dict:
        """The settings that determine the results (the execution fields are left out)."""
        d = asdict(self)
        for name in ("workers", "executor", "scheduler"):
            d.pop(name)
        d.update(sigma_x=self.sx, sigma_z=self.sz)
        return d


@functools.lru_cache(maxsize=1024)
def _privitp_scales(eps: float, delta: float, rounds: int, beta: float, sens: float) -> tuple[float, float]:
    return A.privitp_noise_scales(eps, delta, rounds, beta, sens, 1.0)


@dataclass
class PreparedPool:
    """Per-sample arrays used by the harness, grouped by prompt (read-only once prepared)."""

    pool: GroupedPool
    x: np.ndarray          # selection score: normalised, clipped to the range, mapped to [0, 1]
    r_max: float
    reward_range: tuple[float, float]

    def scores(self, k: int) -> np.ndarray:
        return self.x[self.pool.offsets[k]:self.pool.offsets[k + 1]]

    def prompt(self, k: int):
        """(x, values, base) of prompt k: values (S, 4) are true, raw proxy, win, true win; base (4,)
        is their base-policy mean. The win columns are computed here, per prompt, so that they are
        computed by whichever worker runs the prompt."""
        a, b = self.pool.offsets[k], self.pool.offsets[k + 1]
        values = np.empty((b - a, 4))
        values[:, 0] = self.pool.true[a:b]
        values[:, 1] = self.pool.proxy[a:b]
        values[:, 2] = _mid_ranks(values[:, 1])
        values[:, 3] = _mid_ranks(values[:, 0])
        return self.x[a:b], values, values.sum(axis=0) / (b - a)


def _mid_ranks(v: np.ndarray) -> np.ndarray:
    """(#{v_j < v_i} + #{v_j = v_i} / 2) / S for each i: one sort, ties grouped."""
    S = v.size
    order = np.argsort(v)
    s = v[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    counts = np.diff(np.r_[starts, S])
    out = np.empty(S)
    out[order] = np.repeat(starts + 0.5 * counts, counts) / S
    return out


def prepare(pool: GroupedPool, settings: EvalSettings) -> PreparedPool:
    proxy = pool.proxy
    z = proxy.copy()
    starts = pool.offsets[:-1]
    sizes = np.diff(pool.offsets)
    if settings.normalisation == "global":
        z = (z - z.mean()) / (z.std() or 1.0)
    elif settings.normalisation == "per-prompt":
        mean = np.repeat(np.add.reduceat(z, starts) / sizes, sizes)
        var = np.repeat(np.add.reduceat((z - mean) ** 2, starts) / sizes, sizes)
        z = (z - mean) / np.where(var > 0, np.sqrt(var), 1.0)
    lo, hi = settings.reward_range if settings.reward_range is not None else (float(z.min()), float(z.max()))
    if not lo < hi:
        hi = lo + 1.0
    # The declared range is mapped affinely to [0, 1] (R_max = 1), so sigma, beta and the
    # sensitivity are in units of the range, as in the paper where rewards lie in [0, 1].
    x = (np.clip(z, lo, hi) - lo) / (hi - lo)
    return PreparedPool(pool, x, 1.0, (lo, hi))


def _draw(rng, S: int, M_: int, n: int, replace: bool) -> np.ndarray:
    if replace:
        return rng.integers(0, S, size=(M_, n))
    if n > S:
        raise ValueError(f"cannot draw n={n} without replacement from a pool of {S} samples")
    return np.argsort(rng.random((M_, S)), axis=1)[:, :n]


def _per_prompt(prep: PreparedPool, x: np.ndarray, vals: np.ndarray, base: np.ndarray, algo: str, n: int,
                s: EvalSettings, rng: np.random.Generator, pending: list | None = None,
                lam_start: float | None = None) -> np.ndarray:
    """Metrics of one (prompt, algorithm, n): vector of len(METRICS).

    ``lam_start``: where ITP's lambda search starts (``laws.lambda_rows``); it changes the cost,
    not the result.

    PrivITP with a ``pending`` list: its epsilon is Phase 1's only, and the record that gives
    E[epsilon_2] is appended to ``pending`` (see ``_privitp_epsilon2``).
    """
    S = x.size
    delta_r = prep.r_max if s.sensitivity is None else s.sensitivity
    T = s.rounds(n)  # PrivITP's Phase-2 rounds
    L = A.default_truncation(T) if s.truncation is None else s.truncation
    out = np.full(len(METRICS), np.nan)

    if s.estimator == "mc":
        return _per_prompt_mc(prep, x, vals, algo, n, s, rng, delta_r, L)

    M_ = s.replicates
    idx = _draw(rng, S, M_, n, s.replace)
    xc = x[idx]
    halting = fallback = np.nan

    def expectation(idx_parts, law_parts, fallback_mass):
        """Mean over replicates of the chosen response's values (fallback: a fresh base draw)."""
        w = np.zeros(S)
        for i, l in zip(idx_parts, law_parts):
            w += np.bincount(i.ravel(), weights=l.ravel(), minlength=S)
        return (w @ vals + fallback_mass * base) / M_

    if algo in ("privbon", "privbon-gaussian"):
        if algo == "privbon":
            law = laws.softmax_rows(xc, s.sigma)
            out[6] = A.gumbel_epsilon(s.sigma, delta_r)
        else:
            law = laws.gaussian_rows(xc, s.sigma)
            out[6] = A.gaussian_rnm_epsilon(s.sigma, delta_r, prep.r_max, n)
        ev = expectation([idx], [law], 0.0)
    elif algo == "itp":
        lam = laws.lambda_rows(xc, s.beta, lam_start)[:, None]

        def itp_chunk(a, b, live):
            return idx[live, a:b], laws.itp_acceptance_rows(xc[live, a:b], lam[live], prep.r_max)

        parts, law_parts, fb, t = laws.sequential_lazy(n, M_, itp_chunk)
        ev = expectation(parts, law_parts, fb.sum())
        halting, fallback = t.mean(), fb.mean()
        out[6] = math.inf
    elif algo == "privitp":
        ev, halting, fallback, out[6] = _privitp_law(prep, x, xc, s, rng, T, L, delta_r, expectation, pending, lam_start)
    out[:4] = ev
    out[4] = ev[1] - ev[0]
    out[5] = halting
    out[7] = fallback
    return out


def _privitp_law(prep: PreparedPool, x, xc, s: EvalSettings, rng, T: int, L, delta_r: float, expectation,
                 pending: list | None, lam_start):
    """PrivITP's exact law over the replicates of one (prompt, n): Phase 1's noisy threshold drawn
    once per replicate, Phase 2's T rounds drawn lazily (``laws.sequential_lazy``). Returns (the
    expected metrics, mean halting time, fallback rate, epsilon: Phase 1's, plus E[epsilon_2]
    unless the record is left in ``pending`` for the caller)."""
    M_, S = s.replicates, x.size
    lam = laws.lambda_rows(xc, s.beta, lam_start)
    lam_t = np.clip(lam + s.sx * rng.standard_normal(M_), -s.beta, prep.r_max)  # one draw per replicate
    idx2_full = None if s.replace else _draw(rng, S, M_, T, False)
    # Psi at the acceptance integral's lower end depends on the candidate only: tabulated over
    # the pool when the replicates may examine more candidates than it has
    table = laws.privitp_lower(x, s.sz, prep.r_max, L) if M_ * T >= 2 * S else None

    def privitp_chunk(a, b, live):  # the second batch is drawn lazily, as the mechanism generates it
        i2 = (rng.integers(0, S, size=(M_, b - a)) if s.replace else idx2_full[:, a:b])[live]
        return i2, laws.privitp_acceptance_rows(x[i2], lam_t[live], s.sz, prep.r_max, L,
                                                None if table is None else table[i2])

    parts, law_parts, fb, t = laws.sequential_lazy(T, M_, privitp_chunk)  # Phase 2: T rounds at most
    ev = expectation(parts, law_parts, fb.sum())
    eps = A.gaussian_mechanism_epsilon(s.sx, delta_r, s.delta)
    record = (lam_t, t - fb * (T + 1), fb, T, L)
    if pending is None:
        eps += _privitp_epsilon2(prep, s, [record])[0].mean()
    else:  # the caller adds E[epsilon_2] for every n of the prompt at once
        pending.append(record)
    return ev, t.mean(), fb.mean(), eps


def _privitp_epsilon2(prep: PreparedPool, s: EvalSettings, records) -> list[np.ndarray]:
    """E[epsilon_2^post] per replicate for several (lambda~, halting, fallback, n, L) records in one
    accountant call (the call's fixed cost dominates at 50 replicates)."""
    delta_r = prep.r_max if s.sensitivity is None else s.sensitivity
    sizes = [r[0].size for r in records]
    lam, halting, fallback = (np.concatenate([r[i] for r in records]) for i in range(3))
    n = np.concatenate([np.full(k, r[3]) for k, r in zip(sizes, records)])
    L = np.concatenate([np.full(k, r[4], dtype=float) for k, r in zip(sizes, records)])
    eps2 = laws.privitp_epsilon2_rows(lam, halting, fallback, n, sigma_z=s.sz, sensitivity=delta_r,
                                      r_max=prep.r_max, truncation=L)
    return np.split(eps2, np.cumsum(sizes)[:-1])


def _bon_exact(x: np.ndarray, vals: np.ndarray, s: EvalSettings) -> np.ndarray:
    """BoN's closed form under resampling for the whole n grid at once."""
    out = np.full((len(s.n_grid), len(METRICS)), np.nan)
    out[:, :4] = laws.bon_exact(x, vals, s.n_grid, replace=s.replace)
    out[:, 4] = out[:, 1] - out[:, 0]
    out[:, 6] = math.inf
    return out


def _per_prompt_mc(prep, x, vals, algo, n, s, rng, delta_r, L) -> np.ndarray:
    """Plain Monte Carlo with the real mechanisms: one selection per replicate."""
    S = x.size
    rr = (0.0, prep.r_max)
    acc = np.zeros(4)
    halting, eps, fallback = [], [], []
    for _ in range(s.replicates):
        idx = _draw(rng, S, 1, n, s.replace)[0]
        if algo == "bon":
            sel = M.bon(x[idx], rng=rng)
        elif algo == "privbon":
            sel = M.privbon(x[idx], noise_scale=s.sigma, sensitivity=delta_r, reward_range=rr, rng=rng)
        elif algo == "privbon-gaussian":
            sel = M.privbon(x[idx], noise_scale=s.sigma, noise="gaussian", sensitivity=delta_r,
                            reward_range=rr, rng=rng)
        elif algo == "itp":
            sel = M.itp(x[idx], beta=s.beta, reward_range=rr, rng=rng)
        else:
            T = s.rounds(n)
            idx2 = _draw(rng, S, 1, T, s.replace)[0]
            sel = M.privitp(x[idx], x[idx2], beta=s.beta, sigma_x=s.sx, sigma_z=s.sz, delta=s.delta,
                            truncation=L, sensitivity=delta_r, reward_range=rr, rng=rng, max_rounds=T)
            idx = idx2
        chosen = int(rng.integers(S)) if sel.fallback else idx[sel.index]  # fallback: fresh draw
        acc += vals[chosen]
        halting.append(sel.halting_time if sel.halting_time is not None else np.nan)
        fallback.append(float(sel.fallback) if sel.halting_time is not None else np.nan)
        eps.append(sel.epsilon)
    out = np.full(len(METRICS), np.nan)
    out[:4] = acc / s.replicates
    out[4] = out[1] - out[0]
    out[5] = np.mean(halting)
    out[6] = np.mean(eps)
    out[7] = np.mean(fallback)
    return out


@dataclass
class EvalResult:
    settings: EvalSettings
    per_prompt: np.ndarray          # (algorithms, n_grid, prompts, metrics)
    base: np.ndarray                # (prompts, 4)
    reward_range: tuple[float, float]
    prompt_ids: np.ndarray

    def summary_rows(self) -> list[dict]:
        """One row per (algorithm, n): means and standard errors across prompts."""
        rows = []
        P = self.per_prompt.shape[2]
        base_acc = self.base[:, 0]
        base_mean = float(base_acc.mean())
        for a, algo in enumerate(self.settings.algorithms):
            for j, n in enumerate(self.settings.n_grid):
                m = self.per_prompt[a, j]
                row = {"algorithm": algo, "n": int(n), "prompts": P}
                for i, name in enumerate(METRICS):
                    col = m[:, i]
                    row[name] = float(np.mean(col))
                    finite = np.isfinite(col).all()
                    row[name + "_se"] = float(np.std(col, ddof=1) / math.sqrt(P)) if P > 1 and finite else (
                        0.0 if finite else math.nan)
                lift = 100.0 * (m[:, 0] - base_acc)
                row["lift"] = float(lift.mean())
                row["lift_se"] = float(lift.std(ddof=1) / math.sqrt(P)) if P > 1 else 0.0
                # relative lift in %: (points / 100) / base * 100
                row["lift_rel"] = row["lift"] / base_mean if base_mean > 0 else math.nan
                row["lift_rel_se"] = row["lift_se"] / base_mean if base_mean > 0 else math.nan
                row["base_accuracy"] = base_mean
                row["epsilon_spent"] = row["epsilon"]
                row["sigma"] = _noise_used(self.settings.at(algo, n), algo)
                rows.append(row)
        return rows


def _noise_used(s: EvalSettings, algo: str) -> float:
    """The noise an algorithm ran with: PrivBoN's sigma, PrivITP's sigma_X + sigma_Z, 0 for BoN and ITP."""
    if algo in ("privbon", "privbon-gaussian"):
        return float(s.sigma)
    return float(s.sx + s.sz) if algo == "privitp" else 0.0


def prompt_generator(seed: int, k: int) -> np.random.Generator:
    """Prompt k's own generator: a function of (seed, k) only, so any sharding of the prompts
    (processes, Dask tasks) reproduces a single worker's results bit for bit."""
    return np.random.default_rng([int(seed), int(k)])


def evaluate_prompts(prep: PreparedPool, s: EvalSettings, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts lo..hi-1: (metrics (algorithms, n_grid, hi - lo, metrics), base (hi - lo, 4))."""
    out = np.empty((len(s.algorithms), len(s.n_grid), hi - lo, len(METRICS)))
    base = np.empty((hi - lo, 4))
    for i, k in enumerate(range(lo, hi)):
        rng = prompt_generator(s.seed, k)
        x, vals, base[i] = prep.prompt(k)
        # every replicate's lambda estimates the root over the prompt's whole pool: start there
        lam_start = float(laws.lambda_rows(x[None, :], s.beta)[0]) if {"itp", "privitp"} & set(s.algorithms) else None
        for a, algo in enumerate(s.algorithms):
            if algo == "bon" and s.estimator == "exact":
                out[a, :, i] = _bon_exact(x, vals, s)
                continue
            # PrivITP's E[epsilon_2] for the whole n grid in one call, unless sigma_Z changes with n
            pending = [] if s.epsilon is None else None
            for j, n in enumerate(s.n_grid):
                out[a, j, i] = _per_prompt(prep, x, vals, base[i], algo, int(n), s.at(algo, n), rng, pending, lam_start)
            if pending:  # PrivITP: E[epsilon_2] for the whole n grid at once
                for j, eps2 in enumerate(_privitp_epsilon2(prep, s, pending)):
                    out[a, j, i, METRICS.index("epsilon")] += eps2.mean()
    return out, base
