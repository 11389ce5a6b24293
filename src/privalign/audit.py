"""An empirical privacy audit of private selection on a certified reward model (``privalign audit``).

The attack (a distinguishing test between neighbouring preference data sets):

1. D is the reward model's own preference data (rebuilt from its train pool). The auditor picks two
   candidates a, b among the train samples, b just below a, as far apart in feature space as a
   score gap within one person's reach allows, and a canary pair that moves s(b) - s(a) the most: phi+ - phi- = 2 (phi_b - phi_a) / ||phi_b - phi_a||, the
   largest difference a pair with ||phi|| <= 1 can have. D' is the train pool with one person's
   samples replaced by extreme ones whose pairs push along that direction (at the data level,
   ``rewards.neighbours``: features at the edge of the feature map, half graded correct); the whole training procedure (``policy_bt.retrain``: the choice of (q, c, lambda)
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

``audit_release`` audits the one-time release w~ = w + N(0, sigma^2 I) of the head instead
(``privalign audit --release EPS_W``; its docstring).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special, stats

from . import accounting as A
from . import mechanisms as M
from .rewards.neighbours import Edit, apply, search
from .rewards.policy_bt import PolicyBTReward, retrain
from .rewards.release import check_release, draw_release, release_noise_scale


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
    choices: dict = {}  # step 2 of the procedure, shared by D and D' (their validation rows are the same)
    base = retrain(model, raw, prompt_ids, correct, choices=choices)
    phi = base.feature_map(raw)
    w_d = base.w
    s = phi @ w_d

    def with_canary(a, b):
        u = (phi[b] - phi[a]) / np.linalg.norm(phi[b] - phi[a])
        # one person's samples replaced by extreme ones, whose pairs push along u (data level)
        person = str(np.asarray(prompt_ids, str)[base.data.chosen[0]])  # the rows of D's first pair's person
        nb = apply(Edit("extreme", person, u), raw, prompt_ids, correct, base.feature_map)
        t = retrain(model, nb.raw, nb.prompt_ids, nb.correct, neighbour=True, choices=choices)
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
    if mechanism in ("privitp", "privitp-capped"):
        # capped: Phase 2 examines T = 1 of the two candidates (T < n, so the cap is in force), calibrated
        # to epsilon with the T-round worst case; a fallback (a fresh, data-free draw) counts as "not b"
        T = 1 if mechanism == "privitp-capped" else None
        sx, sz = A.privitp_noise_scales(epsilon, delta, 2, 0.05, sens, 1.0, max_rounds=T)
        out = np.empty(runs, bool)
        for i in range(runs):
            sel = M.privitp(x, x, beta=0.05, sigma_x=sx, sigma_z=sz, delta=delta, sensitivity=sens, rng=rng,
                            max_rounds=T)
            out[i] = sel.index == 1
        return out
    raise ValueError(f"mechanism must be bon, privbon, privbon-gaussian, privitp or privitp-capped, got {mechanism!r}")


def _gaussian_sigma(epsilon: float, sens: float) -> float:
    """Gaussian PrivBoN's noise on [0, 1] at ``epsilon``, as ``privbon`` calibrates it (never below the
    float sampler's floor, where the achieved epsilon, and so the claim, is lower)."""
    return A.privbon_noise_scale(epsilon, sens, noise="gaussian", n=2, r_max=1.0)


def audit(model: PolicyBTReward, raw, prompt_ids, correct, *, epsilon: float = 1.0, delta: float = 1e-5,
          runs: int = 200_000, mechanisms=("bon", "privbon", "privbon-gaussian", "privitp", "privitp-capped"),
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
        dl = delta if mech.startswith("privitp") else 0.0
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
            ratio = hi_p / max(lo_p, 0.5 / pilot)  # a perfectly separating threshold (lo_p = 0) counts too
            if hi_p > 0 and ratio > best[0]:
                best = (ratio, c, up)
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


# ---------------------------------------------------------------------------------- the release


def _epsilon_lower_bounds(k_hi, k_lo, runs: int, delta: float, alpha: float = 0.05) -> np.ndarray:
    """``epsilon_lower_bound`` over arrays of counts (the same Clopper-Pearson bounds, vectorised)."""
    k_hi, k_lo = np.asarray(k_hi, float), np.asarray(k_lo, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        p_hi = np.where(k_hi == 0, 0.0, stats.beta.ppf(alpha / 2, k_hi, runs - k_hi + 1))
        p_lo = np.where(k_lo == runs, 1.0, stats.beta.ppf(1 - alpha / 2, k_lo + 1, runs - k_lo))
        out = np.log((p_hi - delta) / p_lo)
    return np.where(p_hi - delta > 0, np.maximum(out, 0.0), 0.0)


def _release_neighbours(model: PolicyBTReward, raw, prompt_ids, correct, candidates: int = 3):
    """D (the model's own train pool) and the data-level neighbour D' (one person's raw rows edited,
    ``rewards.neighbours``) that moves the head the most: every (person, edit) is ranked by the
    first-order shift it predicts at w_D, the ``candidates`` strongest (each edit's best among them)
    are rerun through the whole procedure, and the largest realised ||w_D - w_D'|| is kept. Returns
    (w_D, w_D', information about D')."""
    base, rows = search(model, raw, prompt_ids, correct, max(1, candidates))
    for r in rows:
        if r["settings_changed"]:  # cannot happen: the choice does not read D (train_procedure)
            raise RuntimeError(f"the neighbour {r['adversary']} of {r['person']} changed the chosen settings")
    best = max(rows, key=lambda r: r["weight_change"])
    return base.w, best["w_neighbour"], {
        "realised_shift": best["weight_change"], "predicted_shift": best["predicted_change"],
        "person": best["person"], "canary": f"{best['adversary']}{' (' + best['detail'] + ')' if best['detail'] else ''}",
        "persons_pairs": int(np.sum(base.data.person == best["person"])),
        "neighbours_tried": [{k: r[k] for k in ("adversary", "person", "detail", "weight_change")} for r in rows]}


def _gaussian_pair_power(mu: float, runs: int, delta: float) -> float:
    """The lower bound the threshold test of ``audit_release`` shows, with expected counts
    (``runs`` times each side's probability of {x >= t}, x ~ N(0, 1) under D and N(mu, 1) under D'),
    at its best threshold t: what the attack can show at this sample size on the realised shift."""
    t = np.linspace(min(0.0, mu) - 8.0, max(0.0, mu) + 8.0, 4001)
    k_hi = np.round(runs * stats.norm.sf(t - mu))
    k_lo = np.round(runs * stats.norm.sf(t))
    return float(np.max(_epsilon_lower_bounds(k_hi, k_lo, runs, delta)))


def _choose_threshold(x_d: np.ndarray, x_d2: np.ndarray, delta: float) -> tuple[float, bool]:
    """The threshold t and event ({x >= t}, favouring D', or {x <= t}, favouring D) whose
    Clopper-Pearson bound is largest on the pilot batches; candidates are quantiles of each batch,
    spread evenly and densely in both tails."""
    n = min(x_d.size, x_d2.size)
    tail = np.geomspace(min(3.0 / n, 0.5), 0.5, 80)
    levels = np.unique(np.concatenate([tail, 1 - tail, np.linspace(0.01, 0.99, 99)]))
    t = np.unique(np.concatenate([np.quantile(x_d, levels), np.quantile(x_d2, levels)]))
    xd, xd2 = np.sort(x_d), np.sort(x_d2)
    ge_d = x_d.size - np.searchsorted(xd, t, side="left")    # #{x >= t}
    ge_d2 = x_d2.size - np.searchsorted(xd2, t, side="left")
    le_d = np.searchsorted(xd, t, side="right")              # #{x <= t}
    le_d2 = np.searchsorted(xd2, t, side="right")
    up = _epsilon_lower_bounds(ge_d2, ge_d, n, delta)        # {x >= t}: D' over D
    down = _epsilon_lower_bounds(le_d, le_d2, n, delta)      # {x <= t}: D over D'
    if up.max() >= down.max():
        return float(t[np.argmax(up)]), True
    return float(t[np.argmax(down)]), False


def audit_release(model: PolicyBTReward, raw, prompt_ids, correct, *, epsilon_w: float, delta_w: float,
                  runs: int = 200_000, seed: int | None = None, noise_scale: float | None = None,
                  candidates: int = 8) -> dict:
    """Audit the one-time release w~ = w_D + N(0, sigma^2 I) (``rewards.release``) at its claimed
    (epsilon_w, delta_w): a 95% lower bound on its epsilon that must stay below epsilon_w.

    1. *Neighbours.* D is the head's own preference data, rebuilt from its train pool; D' replaces
       one person's pairs by k canary pairs, chosen to move the head the most
       (``_release_neighbours``); the whole training procedure is rerun on each, giving w_D and w_D'.
       The realised ||w_D - w_D'|| is reported beside the certified Delta_r.
    2. *Direction.* u = (w_D' - w_D) / ||w_D' - w_D||, chosen before any release draw: the auditor
       trained both neighbours, so the difference itself is its pilot, and it is independent of
       every draw counted below. It is also the best direction: the noise is isotropic, so the
       likelihood ratio of w~ under D' against D is a monotone function of u . w~ (Neyman-Pearson),
       and the projection keeps the whole release's privacy profile. A direction estimated from a
       pilot batch of draws (the mean difference of two batches) would only add its own error.
    3. *Draws.* ``runs`` releases on each side, through the release's own sampling step
       (``draw_release``, seeded by ``seed``), at the calibrated sigma (``release_noise_scale``) or
       at ``noise_scale``: an under-noised release that still claims epsilon_w, which the audit
       must catch. Each draw is projected, x = u . (w~ - w_D) / sigma: N(0, 1) under D and N(mu, 1)
       under D', mu = ||w_D - w_D'|| / sigma.
    4. *Threshold.* A separate pilot batch of ``runs`` draws per side chooses the threshold t and
       the event ({x >= t} or {x <= t}) with the largest pilot bound.
    5. *Bound.* With k' and k events among the counted draws, the side the event favours first,
       the 95% lower bound is log((CP_lo(k') - delta_w) / CP_hi(k)) (``epsilon_lower_bound``).

    The attack's power is reported beside the bound: ``epsilon_of_realised_pair``, the exact epsilon
    at delta_w of the Gaussian pair at distance mu (``gaussian_mechanism_epsilon`` with sensitivity
    the realised shift: the most any test could show on these neighbours, with unlimited draws);
    ``expected_lower_bound``, what this test shows at this many runs with expected counts; and
    ``largest_bound_for_runs``, the most ``runs`` draws can show at all. The realised shift is a
    fraction of Delta_r (the certificate is a worst case over all D), so with the calibrated sigma
    the bound sits far below epsilon_w by construction: it confirms the claim is not violated, not
    that it is tight. ``epsilon_at_certified_sensitivity`` is the release's true epsilon at its
    sigma (epsilon_w when calibrated; with ``noise_scale`` below it, what the claim should have been).
    """
    eps, dlt = check_release(model, epsilon_w, delta_w)
    runs = int(runs)
    if runs < 1000:
        raise ValueError(f"runs must be at least 1000 release draws per side, got {runs}")
    calibrated = release_noise_scale(model, eps, dlt)
    sigma = calibrated if noise_scale is None else float(noise_scale)
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"noise_scale must be positive and finite, got {noise_scale!r}")
    w_d, w_d2, info = _release_neighbours(model, raw, prompt_ids, correct, candidates)
    diff = w_d2 - w_d
    shift = float(np.linalg.norm(diff))
    u = diff / shift if shift > 0 else np.eye(w_d.size)[0]
    rng = np.random.default_rng(seed)

    def projections(w, size, chunk=50_000):  # u . (w~ - w_D) / sigma for ``size`` release draws of w
        return np.concatenate([(draw_release(w, sigma, rng, min(chunk, size - s)) - w_d) @ u / sigma
                               for s in range(0, size, chunk)])

    t, up = _choose_threshold(projections(w_d, runs), projections(w_d2, runs), dlt)
    x_d, x_d2 = projections(w_d, runs), projections(w_d2, runs)
    ev_d = int(np.sum(x_d >= t if up else x_d <= t))
    ev_d2 = int(np.sum(x_d2 >= t if up else x_d2 <= t))
    k_hi, k_lo = (ev_d2, ev_d) if up else (ev_d, ev_d2)
    mu = shift / sigma
    return {"epsilon_w": eps, "delta_w": dlt, "sigma": sigma, "calibrated_sigma": calibrated,
            "noise_factor": sigma / calibrated, "certified_sensitivity": model.sensitivity,
            **info, "shift_share": shift / model.sensitivity, "mu": mu, "dimension": int(w_d.size),
            "runs_per_side": runs, "pilot_per_side": runs, "threshold": t, "direction": ">=" if up else "<=",
            "favours": "D'" if up else "D", "events_D": ev_d, "events_D_prime": ev_d2,
            "epsilon_lower_bound": epsilon_lower_bound(k_hi, k_lo, runs, dlt),
            "expected_lower_bound": _gaussian_pair_power(mu, runs, dlt),
            "epsilon_of_realised_pair": A.gaussian_mechanism_epsilon(sigma, shift, dlt) if shift > 0 else 0.0,
            "epsilon_at_certified_sensitivity": A.gaussian_mechanism_epsilon(sigma, model.sensitivity, dlt),
            "largest_bound_for_runs": epsilon_lower_bound(runs, 0, runs, dlt)}
