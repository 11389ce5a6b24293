"""The paper's first claim on a large real pool (issue 20): as n grows, BoN rises and then falls
(reward hacking) while PrivBoN and PrivITP keep rising. One study per certified reward model.

For each reward model the pool's prompts are split once (seeded) into held-out and test prompts.

* Tuning, on the held-out prompts only: the privacy-constrained choice that exists for
  ``reproduce`` (``private.tune`` at n = ``n_ref``: PrivITP's beta and phase split within
  epsilon per query; ITP's beta), and ITP's own best beta at every n.
* Curves on the test prompts, n = 1 .. 1024: BoN, ITP at its n_ref beta and at its own best beta
  per n, Gumbel and Gaussian PrivBoN and PrivITP at epsilon per query (re-calibrated at every n),
  and capped PrivITP (Phase 2 at most T rounds), whose T, beta and phase split are chosen on the
  held-out prompts at every n within the same epsilon per query; each with 95% bootstrap intervals
  over prompts, and the capped mechanism's fallback rate at each n. Gumbel PrivBoN also runs at its
  noise floor tau, chosen on the held-out prompts at every n, with the epsilon it spends (issue 51;
  shown and given a verdict, but not part of the claim, which judges the mechanisms at epsilon).
* Verdicts, never tuned on the test prompts: a method's peak n is chosen on the held-out prompts;
  its drop from that n to the largest n is measured per test prompt, with a 95% paired bootstrap
  interval. A method *falls* when that interval lies above 0; a private method is *monotone
  within its intervals* when it does not fall. The paper's claim holds for a reward model when
  BoN falls and neither Gumbel PrivBoN nor capped PrivITP does (the uncapped PrivITP, whose
  worst case grows with n, is shown beside them and judged on its own).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..pools import Pool
from . import experiments as X
from . import private as P
from .harness import METRICS, EvalSettings
from .parallel import evaluate
from .reward_info import declared_reward, test_auc

LARGE_N = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ITP_BEST = "ITP (beta tuned at each n)"
ROUNDS_GRID = (1, 4, 16, 64)  # capped PrivITP's T, chosen at each n among these up to n, and n itself up to 64
CAPPED = "PrivITP capped"
FALLBACK = METRICS.index("fallback")


def certified_rewards(pool: Pool) -> list[str]:
    """The pool's reward models with a certified sensitivity, in the order the pool lists them."""
    info = pool.metadata.get("reward_model_info", {})
    return [r for r in pool.reward_names if info.get(r, {}).get("sensitivity") is not None]


def _drop(per_by_n: dict, peak_n: int, last_n: int, seed: int) -> dict:
    d = 100.0 * (per_by_n[peak_n] - per_by_n[last_n])
    lo, hi = P.bootstrap_ci(d, seed=seed)
    return {"peak_n": int(peak_n), "last_n": int(last_n), "drop_points": float(d.mean()), "ci": [lo, hi],
            "falls": bool(lo > 0)}


def tune_capped(held, s: EvalSettings, epsilon: float, n: int, beta_grid=X.BETA_GRID, rounds_grid=ROUNDS_GRID,
                fractions=P.PHASE1_FRACTIONS) -> tuple[dict, EvalSettings]:
    """Capped PrivITP's (T, beta, phase-1 fraction) at n: the best held-out accuracy among the settings
    whose worst case is at most ``epsilon`` per query, T over ``rounds_grid`` up to n. Returns
    ({"max_rounds", "beta", "phase1_fraction", "heldout_accuracy", "heldout_fallback"}, its settings,
    its held-out ``EvalResult``)."""
    best = None
    for T in sorted({t for t in rounds_grid if t <= n} | ({n} if n <= max(rounds_grid) else set())):
        for beta in beta_grid:
            for frac in fractions:
                try:
                    st = P.calibrate(replace(s, max_rounds=T), "privitp", epsilon, n, beta, frac)
                except ValueError:
                    continue  # this split cannot reach epsilon
                r = evaluate(held, st)
                acc = float(r.per_prompt[0, 0, :, 0].mean())
                if best is None or acc > best[0]["heldout_accuracy"]:
                    fb = float(r.per_prompt[0, 0, :, FALLBACK].mean())
                    best = ({"max_rounds": T, "beta": beta, "phase1_fraction": frac, "heldout_accuracy": acc,
                             "heldout_fallback": fb}, st, r)
    if best is None:
        raise ValueError(f"no capped PrivITP setting reaches epsilon={epsilon!r} per query at n={n}")
    return best


def study(pool: Pool, reward: str, base: EvalSettings | None = None, *, epsilon: float = 1.0, n_ref: int = 16,
          n_grid=LARGE_N, beta_grid=X.BETA_GRID, delta: float = 1e-5, rounds_grid=ROUNDS_GRID) -> dict:
    """One reward model's large-n study: {"reward", "rows" (curve rows), "held_rows", "summary"}."""
    s = replace(declared_reward(pool, replace(base or EvalSettings(), reward=reward)), delta=delta).check()
    grouped = pool.grouped(s.reward)
    largest = int(np.diff(grouped.offsets).min())
    grid = tuple(n for n in n_grid if n <= largest)
    if len(grid) < 2:
        raise ValueError(f"a large-n study needs at least two n in n_grid up to the pool's {largest} samples per "
                         f"prompt, got {tuple(n_grid)!r}")
    held_idx, test_idx = X.split_prompts(grouped.n_prompts, 0.5, s.seed)
    held, test = grouped.subset(held_idx), grouped.subset(test_idx)
    chosen, _ = P.tune(held, s, (epsilon,), n_ref, beta_grid)
    methods = [("bon", None, P.LABELS["bon"]), ("itp", None, P.LABELS["itp"])]
    methods += [(a, epsilon, f"{P.LABELS[a]} eps={epsilon:g}") for a in P.PRIVATE if a in chosen[epsilon]]
    rows, held_rows, per = [], [], {}
    for algo, eps, label in methods:
        for n in grid:
            st = P.method_settings(s, algo, eps, n, chosen)
            for split, sub, out in (("test", test, rows), ("heldout", held, held_rows)):
                _, acc, base_acc = P._accuracy(sub, st)
                out.append(P._row(label, algo, eps if eps is not None else math.inf, n, acc, base_acc, st, s.seed))
                per[(split, label, n)] = acc
    itp_beta = _itp_at_best_beta(held, test, s, grid, beta_grid, rows, held_rows, per)
    capped = _capped_privitp(held, test, s, epsilon, grid, beta_grid, rounds_grid, rows, held_rows, per)
    floor = _privbon_floor(held, test, s, epsilon, grid, rows, held_rows, per)
    last = grid[-1]
    verdicts = _verdicts(rows, per, grid, s.seed)
    bon = verdicts[P.LABELS["bon"]]
    # the claim is judged on the mechanisms at epsilon's own noise; PrivBoN at its floor is shown beside them
    private = {label: v for label, v in verdicts.items()
               if label.startswith(("PrivBoN (Gumbel)", "PrivITP")) and not label.endswith(P.TUNED)}
    judged = [v for label, v in private.items() if label.startswith(("PrivBoN (Gumbel)", CAPPED))]
    info = pool.metadata.get("reward_model_info", {}).get(s.reward, {})
    lo, hi = info.get("output_range") or (math.nan, math.nan)
    summary = {
        "reward": s.reward, "epsilon": epsilon, "n_max": int(last), "held_prompts": int(len(held_idx)),
        "test_prompts": int(len(test_idx)), "auc": test_auc(pool, s.reward, grouped.prompt_ids[test_idx]),
        "sensitivity": info.get("sensitivity"), "sensitivity_share_of_range":
            (info["sensitivity"] / (hi - lo)) if info.get("sensitivity") and hi > lo else None,
        "m": (info.get("certificate") or {}).get("m"), "trained_on": (info.get("certificate") or {}).get("task"),
        "bon": bon, "private": private, "verdicts": verdicts, "itp_beta_by_n": {str(k): v for k, v in itp_beta.items()},
        "itp_beta_at_n_ref": chosen["itp"]["beta"], "chosen": {str(k): v for k, v in chosen.items()},
        "capped_by_n": capped, "privbon_floor_by_n": floor,
        "claim_met": bool(bon["falls"] and judged and not any(v["falls"] for v in judged)),
    }
    return {"reward": s.reward, "rows": rows, "held_rows": held_rows, "summary": summary}


def _itp_at_best_beta(held, test, s: EvalSettings, grid, beta_grid, rows: list, held_rows: list, per: dict) -> dict:
    """ITP at its own best beta at every n, chosen on the held-out prompts; appends its curve rows
    and per-prompt accuracies, and returns the beta chosen at each n."""
    itp_beta = {}
    for n in grid:
        best = None
        for beta in beta_grid:
            st = replace(s, algorithms=("itp",), n_grid=(n,), beta=beta)
            _, acc_h, base_h = P._accuracy(held, st)
            if best is None or acc_h.mean() > best[0]:
                best = (acc_h.mean(), beta, acc_h, base_h)
        itp_beta[n] = best[1]
        st = replace(s, algorithms=("itp",), n_grid=(n,), beta=best[1])
        _, acc, base_acc = P._accuracy(test, st)
        rows.append(P._row(ITP_BEST, "itp", math.inf, n, acc, base_acc, st, s.seed))
        held_rows.append(P._row(ITP_BEST, "itp", math.inf, n, best[2], best[3], st, s.seed))
        per[("test", ITP_BEST, n)], per[("heldout", ITP_BEST, n)] = acc, best[2]
    return itp_beta


def _capped_privitp(held, test, s: EvalSettings, epsilon: float, grid, beta_grid, rounds_grid, rows: list,
                    held_rows: list, per: dict) -> dict:
    """Capped PrivITP with (T, beta, phase split) chosen on the held-out prompts at every n; appends
    its curve rows and per-prompt accuracies, and returns the choice (with its fallback rates) by n."""
    capped_label, capped = f"{CAPPED} eps={epsilon:g}", {}
    for n in grid:
        c, st, r_held = tune_capped(held, s, epsilon, n, beta_grid, rounds_grid)
        r_test = evaluate(test, st)
        c["test_fallback"] = float(r_test.per_prompt[0, 0, :, FALLBACK].mean())
        capped[str(n)] = c
        for split, r, out, fb in (("test", r_test, rows, c["test_fallback"]),
                                  ("heldout", r_held, held_rows, c["heldout_fallback"])):
            acc = r.per_prompt[0, 0, :, 0]
            out.append({**P._row(capped_label, "privitp", epsilon, n, acc, r.base[:, 0], st, s.seed),
                        "max_rounds": c["max_rounds"], "fallback": fb})
            per[(split, capped_label, n)] = acc
    return capped


def _privbon_floor(held, test, s: EvalSettings, epsilon: float, grid, rows: list, held_rows: list, per: dict) -> dict:
    """Gumbel PrivBoN at its noise floor tau, chosen on the held-out prompts at every n
    (``private.tune_temperature``); appends its curve rows (with the epsilon each n spends) and
    per-prompt accuracies, and returns the choice by n."""
    label = f"{P.LABELS['privbon']} eps={epsilon:g}{P.TUNED}"
    floors, _ = P.tune_temperature(held, s, epsilon, grid)
    for n in grid:
        tau = floors[n]["temperature"]
        st = P.calibrate(s, "privbon", epsilon, n, temperature=tau)
        for split, sub, out in (("test", test, rows), ("heldout", held, held_rows)):
            _, acc, base_acc = P._accuracy(sub, st)
            out.append({**P._row(label, "privbon", epsilon, n, acc, base_acc, st, s.seed), "temperature": tau})
            per[(split, label, n)] = acc
    return {str(n): c for n, c in floors.items()}


def _verdicts(rows: list, per: dict, grid, seed: int) -> dict:
    """Per method: its held-out peak n, the drop from there to the largest n on the test prompts
    (``_drop``), its test peak, and its paired difference from BoN at the largest n."""
    last = grid[-1]
    verdicts = {}
    for label in dict.fromkeys(r["method"] for r in rows):
        held_mean = {n: per[("heldout", label, n)].mean() for n in grid}
        peak = max(grid, key=lambda n: (held_mean[n], -n))  # ties: the smaller n
        test_by_n = {n: per[("test", label, n)] for n in grid}
        test_peak = max(grid, key=lambda n: (test_by_n[n].mean(), -n))
        gap = 100.0 * (test_by_n[last] - per[("test", P.LABELS["bon"], last)])  # paired, per test prompt
        verdicts[label] = {**_drop(test_by_n, peak, last, seed), "test_peak_n": int(test_peak),
                           "accuracy_at_last": float(test_by_n[last].mean()),
                           "vs_bon_at_last": {"points": float(gap.mean()), "ci": list(P.bootstrap_ci(gap, seed=seed))}}
    return verdicts


def claim_sentence(sm: dict, num=lambda v: f"{v:.3g}") -> str:
    """One reward model's verdict in words (the report's first screen and the CLI)."""
    b = sm["bon"]
    auc = sm["auc"]["auc"]
    parts = [f"{sm['reward']} (within-prompt AUC {num(auc)}, Delta_r {num(sm['sensitivity'])}"
             + (f", m = {sm['m']:,}" if sm.get("m") else "") + "): "]
    if b["falls"]:
        parts.append(f"BoN peaks at n = {b['peak_n']} (chosen on held-out prompts) and falls "
                     f"{num(b['drop_points'])} points by n = {b['last_n']} (95% CI {num(b['ci'][0])} to "
                     f"{num(b['ci'][1])}); ")
    else:
        parts.append(f"BoN does not fall beyond noise: from its held-out peak n = {b['peak_n']} to n = {b['last_n']} "
                     f"it changes by "
                     f"{num(0.0 - b['drop_points'])} points (95% CI of the drop {num(b['ci'][0])} to {num(b['ci'][1])}); ")
    mono = [f"{label} {'keeps rising within its intervals' if not v['falls'] else 'falls'} "
            f"(drop {num(v['drop_points'])}, CI {num(v['ci'][0])} to {num(v['ci'][1])}) and ends "
            f"{num(v['vs_bon_at_last']['points'])} points from BoN at n = {b['last_n']} (CI "
            f"{num(v['vs_bon_at_last']['ci'][0])} to {num(v['vs_bon_at_last']['ci'][1])})"
            for label, v in sm["private"].items()]
    parts.append("; ".join(mono) + ". ")
    by = claim_by_method(sm)
    parts.append("The paper's claim (BoN falls, Gumbel PrivBoN and capped PrivITP do not): "
                 + ("met." if sm["claim_met"] else "not met")
                 + ("" if sm["claim_met"] else
                    " (" + ", ".join(f"{'met' if ok else 'not met'} for {label}" for label, ok in by.items()) + ")."))
    return "".join(parts)


def claim_by_method(sm: dict) -> dict:
    """The claim for each private method alone: BoN falls and that method does not."""
    return {label: bool(sm["bon"]["falls"] and not v["falls"]) for label, v in sm["private"].items()}
