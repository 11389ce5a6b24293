"""``privalign audit``: an empirical audit of private selection, or of a released head."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional

import typer

from ._app import app
from ._common import _fail, _out_dir, _train_pool, _working, console


def _audit_release(m, model: Path, pool: Path, p, raw, epsilon_w: float, delta_w: float, noise_factor: float,
                   runs: int, seed: Optional[int], out: Optional[Path]) -> None:
    """``privalign audit --release``: ``audit.audit_release``, its rows printed, exit 1 if caught."""
    from ..audit import audit_release
    from ..rewards.release import check_release, release_noise_scale

    try:
        check_release(m, epsilon_w, delta_w)
        sigma = release_noise_scale(m, epsilon_w, delta_w) * noise_factor
        with _working("auditing the release"):
            res = audit_release(m, raw, p.columns["prompt_id"], p.columns["true_reward"], epsilon_w=epsilon_w,
                                delta_w=delta_w, runs=runs, seed=seed,
                                noise_scale=None if noise_factor == 1.0 else sigma)
    except ValueError as e:
        _fail(f"{model}: {e}")
    console.print(f"neighbours: {res['person']}'s {res['persons_pairs']} pairs replaced by {res['canary']}; "
                  f"realised ||w_D - w_D'|| = {res['realised_shift']:.4g}, certified Delta_r = "
                  f"{res['certified_sensitivity']:.4g} ({res['shift_share']:.1%} of it)", markup=False)
    console.print(f"release: sigma = {res['sigma']:.4g} ({res['noise_factor']:g} x the calibrated "
                  f"{res['calibrated_sigma']:.4g}) in d = {res['dimension']}, claimed (epsilon_w, delta_w) = "
                  f"({res['epsilon_w']:g}, {res['delta_w']:g}); projected on w_D' - w_D the draws are N(0, 1) vs "
                  f"N(mu, 1), mu = {res['mu']:.4g}", markup=False)
    rows = [("95% lower bound on epsilon_w", res["epsilon_lower_bound"],
             f"{runs} draws per side, event x {res['direction']} {res['threshold']:.4g} chosen on a pilot of "
             f"{res['pilot_per_side']}: {res['events_D']} under D vs {res['events_D_prime']} under D'"),
            ("expected at this many draws", res["expected_lower_bound"], "this test with expected counts"),
            ("epsilon of the realised pair", res["epsilon_of_realised_pair"],
             "the most any test on these neighbours can show"),
            (f"the most {runs} draws can show", res["largest_bound_for_runs"], f"{runs} vs 0 events"),
            ("true epsilon at Delta_r and sigma", res["epsilon_at_certified_sensitivity"],
             f"the claim is {res['epsilon_w']:g}")]
    for label, value, note in rows:
        console.print(f"  {label:<36} {value:>8.4g}  ({note})", markup=False)
    if out:
        from .. import __version__
        from .._paths import write_manifest
        from ..report.results import write_json

        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out)
        write_json(out / "release-audit.json", {"model": str(model), "pool": str(pool), "seed": seed,
                                                 "privalign_version": __version__,
                                                 "command": "privalign " + " ".join(sys.argv[1:]), **res})
        console.print(f"wrote {out}/release-audit.json", markup=False)
    if res["realised_shift"] > res["certified_sensitivity"]:
        console.print(f"[red]the certificate was exceeded: realised ||w_D - w_D'|| {res['realised_shift']:.4g} > "
                      f"Delta_r {res['certified_sensitivity']:.4g}[/red]")
        raise typer.Exit(1)
    if res["epsilon_lower_bound"] > res["epsilon_w"]:
        console.print(f"[red]caught: the release's 95% lower bound {res['epsilon_lower_bound']:.4g} exceeds its "
                      f"claimed epsilon_w {res['epsilon_w']:g}[/red]")
        raise typer.Exit(1)
    console.print(f"the bound stays below the claimed epsilon_w {res['epsilon_w']:g}", markup=False)


@app.command()
def audit(model: Path = typer.Option(..., help="a policy-bt reward model (JSON)"),
          pool: Path = typer.Option(..., help="the train pool it was trained on (with recorded features)"),
          epsilon: float = typer.Option(1.0, help="claimed epsilon per query of the private mechanisms"),
          delta: float = typer.Option(1e-5, help="PrivITP's delta per query"),
          runs: int = typer.Option(200_000, help="mechanism runs per side (D and D')"),
          seed: Optional[int] = typer.Option(None),
          release: Optional[float] = typer.Option(None, "--release", metavar="EPS_W",
                                                  help="audit the head's one-time release w~ = w + N(0, sigma^2 I) "
                                                       "claimed at epsilon_w instead of the per-query mechanisms"),
          release_delta: float = typer.Option(1e-6, "--release-delta", metavar="DELTA_W",
                                              help="delta_w of the audited release (below 1/P)"),
          noise_factor: float = typer.Option(1.0, "--noise-factor",
                                             help="with --release: draw the release at this multiple of its calibrated "
                                                  "sigma while it still claims epsilon_w (0.01: 100 times too little "
                                                  "noise, which the audit must catch)"),
          out: Optional[Path] = typer.Option(None, help="write audit.json and audit.png here (with --release: "
                                                        "release-audit.json)")):
    """Audit the privacy claims empirically: 95% lower bounds on epsilon.

    A canary in the preference data, the model retrained on both neighbours, each mechanism run
    many times; 95% Clopper-Pearson lower bounds on epsilon (exit 1 if one exceeds its claim).
    With --release EPS_W: the head's one-time release, drawn RUNS times on each side and projected
    on w_D' - w_D (exit 1 if the bound exceeds epsilon_w)."""
    from ..audit import audit as run_audit
    from ..rewards.policy_bt import PolicyBTReward

    if release is None and noise_factor != 1.0:
        _fail(f"--noise-factor {noise_factor!r} applies only to a release audit (--release EPS_W)")
    if release is not None:
        if not (math.isfinite(release) and release > 0):
            _fail(f"--release must be a positive and finite epsilon_w, got {release!r}")
        if not (math.isfinite(release_delta) and 0 < release_delta < 1):
            _fail(f"--release-delta must lie in (0, 1), got {release_delta!r}")
        if not (math.isfinite(noise_factor) and noise_factor > 0):
            _fail(f"--noise-factor must be positive and finite, got {noise_factor!r}")
        if runs < 1000:
            _fail(f"--runs must be at least 1000 release draws per side, got {runs}")
    if out:
        _out_dir(out, inputs=[model, pool])
    try:
        m = PolicyBTReward.load(model)
    except (ValueError, OSError, KeyError) as e:
        _fail(f"{model}: {e}")
    p, raw = _train_pool(pool)
    if release is not None:
        _audit_release(m, model, pool, p, raw, release, release_delta, noise_factor, runs, seed, out)
        return
    with _working("auditing"):
        res = run_audit(m, raw, p.columns["prompt_id"], p.columns["true_reward"], epsilon=epsilon, delta=delta,
                        runs=runs, seed=seed)
    console.print(f"realised max |r_D - r_D'| = {res['realised_sensitivity']:.4g}, certified Delta_r = "
                  f"{res['certified_sensitivity']:.4g}", markup=False)
    ok = res["realised_sensitivity"] <= res["certified_sensitivity"]
    for r in res["rows"]:
        claimed = r["claimed_epsilon"]
        ok &= r["epsilon_lower_bound"] <= claimed
        console.print(f"  {r['mechanism']:<17} claimed epsilon {claimed:<6.3g} 95% lower bound "
                      f"{r['epsilon_lower_bound']:.3g} ({r['runs_per_side']} runs per side, "
                      f"{r['successes_D']} vs {r['successes_D_prime']} selections of the target)", markup=False)
    if out:
        from .. import __version__
        from ..report.figures import audit_bars
        from .._paths import write_manifest
        from ..report.results import write_json

        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out)
        write_json(out / "audit.json", {"model": str(model), "pool": str(pool), "epsilon": epsilon, "delta": delta,
                                         "seed": seed, "privalign_version": __version__,
                                         "command": "privalign " + " ".join(sys.argv[1:]), **res})
        audit_bars(res["rows"], out)
        console.print(f"wrote {out}/audit.json and audit.png", markup=False)
    if not ok:
        console.print("[red]a lower bound exceeds its claim, or the realised sensitivity its certificate[/red]")
        raise typer.Exit(1)
