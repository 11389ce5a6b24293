"""An empirical privacy audit of private selection on a certified reward model (``privalign audit``).

The attack (a distinguishing test between neighbouring preference data sets):

1. D is the reward model's own preference data (rebuilt from its train pool). The auditor picks two
   candidates a, b among the train samples, b just below a, as far apart in feature space as a
   score gap within one person's reach allows, and a canary pair that moves s(b) - s(a) the most: phi+ - phi- = 2 (phi_b - phi_a) / ||phi_b - phi_a||, the
   largest difference a pair with ||phi|| <= 1 can have. D' is D with one person's pair replaced
   by the canary; the whole training procedure (``policy_bt.retrain``: the choice of (q, c, lambda)
   on validation prompts, then the final head) is rerun on each.
2. Each mechanism is run ``runs`` times on the fixed candidate set {a, b} scored by each model, and
   the distinguishing event {b is selected} is checked on a separate batch to point the right
   way (D' over D or the reverse).
3. With k' and k successes in ``runs`` trials under D' and D, the 95% lower bound on epsilon is
   log((CP_lo(k') - delta) / CP_hi(k)), Clopper-Pearson bounds at level 0.025 each (delta = 0 for
   pure mechanisms, the per-query delta for PrivITP).

BoN, which is not private, must give a large lower bound (the attack has power); every private
mechanism's must stay below its claimed epsilon. The realised max |r_D - r_D'| over the train
samples is reported beside the certified Delta_r.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from . import accounting as A
from . import mechanisms as M
from .rewards.policy_bt import PolicyBTReward, replace_person, retrain


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Two-sided (1 - alpha) Clopper-Pearson interval for a binomial proportion k / n."""
    lo = 0.0 if k == 0 else float(stats.beta.ppf(alpha / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lo, hi


def epsilon_lower_bound(k_hi: int, k_lo: int, runs: int, delta: float = 0.0, alpha: float = 0.05) -> float:
    """95% lower bound on epsilon from k_hi successes (the side the event favours) and k_lo."""
    p_hi = clopper_pearson(k_hi, runs, alpha)[0]
    p_lo = clopper_pearson(k_lo, runs, alpha)[1]
    return max(math.log((p_hi - delta) / p_lo), 0.0) if p_hi - delta > 0 else 0.0


def _canary_setting(model: PolicyBTReward, raw, prompt_ids, correct):
    base = retrain(model, raw, prompt_ids, correct)
    phi = base.feature_map(raw)
    w_d = base.w
    s = phi @ w_d

    def with_canary(a, b):
        u = (phi[b] - phi[a]) / np.linalg.norm(phi[b] - phi[a])

        def edit(d):  # one person's pairs replaced by k canary pairs
            return replace_person(d, base.data, str(base.data.person[0]), np.tile(2 * u, (model.k, 1)))

        t = retrain(model, raw, prompt_ids, correct, edit)
        if t.settings != base.settings:  # cannot happen: the choice does not read D (train_procedure)
            raise RuntimeError(f"the canary changed the chosen settings {base.settings} -> {t.settings}")
        return t.w

    # first choice: the pair whose features differ most (so the canary moves their gap most) among
    # pairs whose score gap is well inside one person's reach, on a fixed subsample
    sub = np.random.default_rng(0).permutation(s.size)[:1500]
    gap = s[sub][:, None] - s[sub][None, :]
    dist = np.linalg.norm(phi[sub][:, None, :] - phi[sub][None, :, :], axis=2)
    ok = (gap > 0) & (gap < 0.2 * model.sensitivity * dist)
    if ok.any():
        i, j = np.unravel_index(np.argmax(np.where(ok, dist, -1.0)), ok.shape)
        a, b = sub[i], sub[j]  # s(b) just below s(a), far apart in feature space
        w_d2 = with_canary(a, b)
        if phi[b] @ w_d2 > phi[a] @ w_d2:  # the canary flips their order: BoN is caught
            return phi, w_d, w_d2, a, b
    # otherwise the closest distinct pair
    order = np.argsort(s)
    gaps = np.diff(s[order])
    good = np.flatnonzero((gaps > 0) & (np.linalg.norm(phi[order[1:]] - phi[order[:-1]], axis=1) > 1e-9))
    k = good[np.argmin(gaps[good])]
    b, a = order[k], order[k + 1]
    return phi, w_d, with_canary(a, b), a, b


def _runs(mechanism: str, scores: np.ndarray, runs: int, model, epsilon: float, delta: float,
          rng: np.random.Generator) -> np.ndarray:
    """Whether b (candidate 1) was selected, in each of ``runs`` independent runs."""
    lo, hi = model.output_range
    x = (np.clip(scores, lo, hi) - lo) / (hi - lo)  # [0, 1], as every mechanism maps the declared range
    sens = model.sensitivity / (hi - lo)
    if mechanism == "bon":
        return np.full(runs, x[1] > x[0])
    if mechanism == "privbon":
        sigma = A.gumbel_noise_scale(epsilon, sens)
        g = -np.log(rng.standard_exponential((runs, 2)))
        return np.argmax(x / sigma + g, axis=1) == 1
    if mechanism == "privbon-gaussian":
        sigma = _gaussian_sigma(epsilon, sens)
        return np.argmax(x + sigma * rng.standard_normal((runs, 2)), axis=1) == 1
    if mechanism == "privitp":
        sx, sz = A.privitp_noise_scales(epsilon, delta, 2, 0.05, sens, 1.0)
        out = np.empty(runs, bool)
        for i in range(runs):
            sel = M.privitp(x, x, beta=0.05, sigma_x=sx, sigma_z=sz, delta=delta, sensitivity=sens, rng=rng)
            out[i] = sel.index == 1
        return out
    raise ValueError(f"mechanism must be bon, privbon, privbon-gaussian or privitp, got {mechanism!r}")


def _gaussian_sigma(epsilon: float, sens: float) -> float:
    """Gaussian PrivBoN's noise on [0, 1] at ``epsilon``, as ``privbon`` calibrates it (never below the
    float sampler's floor, where the achieved epsilon, and so the claim, is lower)."""
    return A.privbon_noise_scale(epsilon, sens, noise="gaussian", n=2, r_max=1.0)


def audit(model: PolicyBTReward, raw, prompt_ids, correct, *, epsilon: float = 1.0, delta: float = 1e-5,
          runs: int = 200_000, mechanisms=("bon", "privbon", "privbon-gaussian", "privitp"),
          seed: int | None = None) -> dict:
    """Run the audit; returns the realised sensitivity and one row per mechanism."""
    phi, w_d, w_d2, a, b = _canary_setting(model, raw, prompt_ids, correct)
    realised = float(np.max(np.abs(phi @ (w_d - w_d2))))
    cand = phi[[a, b]]
    lo, hi = model.output_range
    sens = model.sensitivity / (hi - lo)
    rng = np.random.default_rng(seed)
    rows = []
    for mech in mechanisms:
        claimed = (math.inf if mech == "bon" else
                   A.gaussian_rnm_epsilon(_gaussian_sigma(epsilon, sens), sens, 1.0, 2) if mech == "privbon-gaussian"
                   else epsilon)
        dl = delta if mech == "privitp" else 0.0
        mech_runs = runs
        pilot = max(mech_runs // 10, 100)
        # the separate batch decides which way the event points
        p_d = _runs(mech, cand @ w_d, pilot, model, epsilon, dl, rng).mean()
        p_d2 = _runs(mech, cand @ w_d2, pilot, model, epsilon, dl, rng).mean()
        k_d = int(_runs(mech, cand @ w_d, mech_runs, model, epsilon, dl, rng).sum())
        k_d2 = int(_runs(mech, cand @ w_d2, mech_runs, model, epsilon, dl, rng).sum())
        hi, lo = (k_d2, k_d) if p_d2 >= p_d else (k_d, k_d2)
        rows.append({"mechanism": mech, "claimed_epsilon": claimed, "delta": dl, "runs_per_side": mech_runs,
                     "successes_D": k_d, "successes_D_prime": k_d2,
                     "epsilon_lower_bound": epsilon_lower_bound(hi, lo, mech_runs, dl)})
    return {"certified_sensitivity": model.sensitivity, "realised_sensitivity": realised,
            "score_gap": float(cand[0] @ w_d - cand[1] @ w_d), "rows": rows}


def audit_stream(model: PolicyBTReward, raw, prompt_ids, correct, *, queries: int = 20, epsilon: float = 0.3,
                 delta_total: float = 1e-6, runs: int = 50_000, seed: int | None = None,
                 noise_scale: float | None = None) -> dict:
    """An audit of a composed stream: ``queries`` Gumbel PrivBoN queries at ``epsilon`` each on the
    canary pair {a, b} of ``audit``, under D and under D'. The event is {b selected at least c
    times}, with c and its direction chosen on a separate pilot batch; the 95% lower bound on the
    stream's epsilon (Clopper-Pearson, minus delta_total) must stay below what each composition
    claims for the whole stream: basic k epsilon, zCDP's conversion of k epsilon^2 / 8.
    ``noise_scale`` (on the [0, 1] scale) replaces the calibrated Gumbel scale: an under-noised
    mechanism claiming ``epsilon``, which the audit must catch (its power)."""
    phi, w_d, w_d2, a, b = _canary_setting(model, raw, prompt_ids, correct)
    cand = phi[[a, b]]
    lo, hi = model.output_range
    sens = model.sensitivity / (hi - lo)
    sigma = A.gumbel_noise_scale(epsilon, sens) if noise_scale is None else noise_scale
    rng = np.random.default_rng(seed)

    def counts(w, size):
        x = (np.clip(cand @ w, lo, hi) - lo) / (hi - lo)
        p_b = 1.0 / (1.0 + math.exp((x[0] - x[1]) / sigma))  # softmax over {a, b}: the Gumbel-max law
        return rng.binomial(queries, p_b, size)

    pilot = max(runs // 10, 1000)
    c_d, c_d2 = counts(w_d, pilot), counts(w_d2, pilot)
    best = (0.0, 0, True)
    for c in range(queries + 1):  # the threshold and direction that separate the pilot batches most
        for up in (True, False):
            e_d, e_d2 = ((c_d >= c).mean(), (c_d2 >= c).mean()) if up else ((c_d <= c).mean(), (c_d2 <= c).mean())
            hi_p, lo_p = max(e_d, e_d2), min(e_d, e_d2)
            if lo_p > 0 and hi_p / lo_p > best[0]:
                best = (hi_p / lo_p, c, up)
    _, c, up = best
    k_d, k_d2 = counts(w_d, runs), counts(w_d2, runs)
    ev_d = int(((k_d >= c) if up else (k_d <= c)).sum())
    ev_d2 = int(((k_d2 >= c) if up else (k_d2 <= c)).sum())
    favoured_d2 = ((c_d2 >= c) if up else (c_d2 <= c)).mean() >= ((c_d >= c) if up else (c_d <= c)).mean()
    k_hi, k_lo = (ev_d2, ev_d) if favoured_d2 else (ev_d, ev_d2)
    rho = queries * A.bounded_range_rho(epsilon)
    return {"queries": queries, "epsilon_per_query": epsilon, "delta_total": delta_total, "runs_per_side": runs,
            "threshold": c, "direction": ">=" if up else "<=", "events_D": ev_d, "events_D_prime": ev_d2,
            "claimed_basic": queries * epsilon, "claimed_zcdp": A.zcdp_epsilon(rho, delta_total), "rho": rho,
            "epsilon_lower_bound": epsilon_lower_bound(k_hi, k_lo, runs, delta_total)}
