"""``privalign plan``: how far a budget goes, per query or by releasing the head once."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.console import Console

from ._app import app
from ._common import _fail, _load, console, parse_float_list


@app.command()
def plan(epsilon_total: Optional[float] = typer.Option(None, help="the budget's epsilon (required but with "
                                                                  "--preferences)"),
         delta_total: float = typer.Option(1e-6, help="the budget's delta"),
         mechanism: str = typer.Option("privbon", help="privbon, privbon-gaussian or privitp"),
         epsilon: Optional[float] = typer.Option(None, help="epsilon per query: how many queries?"),
         queries: Optional[int] = typer.Option(None, help="queries to serve: what epsilon each?"),
         n: int = typer.Option(16, help="candidates per query"),
         sensitivity: Optional[float] = typer.Option(None, help="Delta_r / range (default: --pool's, or 0.01)"),
         temperature: float = typer.Option(0.0, help="privbon: noise floor tau (units of the range); queries "
                                                     "counted at the epsilon spent, 2 Delta_r / max(2 Delta_r / "
                                                     "epsilon, tau)"),
         delta: float = typer.Option(1e-8, help="privitp: delta per query"),
         beta: float = typer.Option(0.05, help="privitp: beta"),
         max_rounds: Optional[int] = typer.Option(16, min=1, help="privitp: Phase 2 examines at most min(T, n) "
                                                                  "candidates (the service's default 16); 0 rounds "
                                                                  "are refused, --max-rounds n for the uncapped"),
         pool: Optional[Path] = typer.Option(None, help="a scored pool: add the accuracy each gives"),
         reward: Optional[str] = typer.Option(None, help="its certified reward column"),
         pairs: Optional[int] = typer.Option(None, help="rescale Delta_r to a head on this many pairs"),
         pairs_per_person: Optional[int] = typer.Option(None, help="rescale Delta_r to a head whose persons give "
                                                                  "this many pairs each (k; with --pairs, or the "
                                                                  "head's own m)"),
         model: Optional[Path] = typer.Option(None, help="a certified policy-bt head (exact file) and --pool with its "
                                                         "features: add the release-then-BoN mode"),
         release_epsilon: Optional[str] = typer.Option(None, help="with --model: epsilon_w values to compare "
                                                                  "(default: the budget's epsilon)"),
         draws: int = typer.Option(60, help="with --model: release draws averaged (and their 5th percentile)"),
         seed: int = typer.Option(0, help="with --model: seed of the studied release draws"),
         target_share: Optional[float] = typer.Option(None, help="with --model: how many preference pairs make the "
                                                                 "release keep this share of BoN's lift on average "
                                                                 "(and --tail-share at the 5th percentile)?"),
         tail_share: Optional[float] = typer.Option(None, help="with --target-share: the share the 5th percentile "
                                                               "must keep (default: target - 0.1)"),
         preferences: Optional[Path] = typer.Option(None, help="with --model (a head from rm train --preferences): "
                                                               "held-out pairs; how many persons a release needs"),
         privacy_unit: str = typer.Option("row", help="with --preferences: its person column (only read)"),
         release_delta: Optional[float] = typer.Option(None, help="with --model: delta_w of the release (default: "
                                                                  "--delta-total)")):
    """Plan a budget: queries per composition, or epsilon per query.

    basic, FSRC and zcdp side by side, with the Gaussian limit no zCDP accountant can pass. With
    --model, also the head released once at epsilon_w (then BoN, free for any number of queries):
    its accuracy averaged over release draws and the 5th percentile a single deployment may get. With
    --model and --preferences, how many persons its release needs to keep --target-share of the
    head's held-out gain over chance."""
    from ..accounting import planner

    release_delta = delta_total if release_delta is None else release_delta
    if preferences is not None:
        return _plan_persons(model, preferences, privacy_unit, release_epsilon, epsilon_total, release_delta,
                             target_share, tail_share, draws, seed)
    if epsilon_total is None:
        _fail("--epsilon-total is required: the budget's epsilon (only plan --model HEAD --preferences FILE "
              "goes without it)")
    if (epsilon is None) == (queries is None):
        _fail("give exactly one of --epsilon (how many queries?) and --queries (what epsilon per query?)")
    if mechanism not in planner.MECHANISMS:
        _fail(f"--mechanism must be one of {', '.join(planner.MECHANISMS)}, got {mechanism!r}")
    base = desc = None
    if pool is not None:
        from ..evaluation.planning import plan_base

        try:
            base, desc = plan_base(_load(pool), reward, pairs, delta, beta, max_rounds, pairs_per_person)
        except (ValueError, KeyError) as e:
            _fail(str(e))
        sensitivity = desc["sensitivity"] if sensitivity is None else sensitivity
    elif pairs is not None or pairs_per_person is not None:
        _fail("--pairs and --pairs-per-person need --pool (the reward model whose Delta_r they rescale)")
    if temperature and (queries is not None or mechanism == "privitp"):
        _fail("--temperature is PrivBoN's noise floor: give it with --epsilon and a privbon mechanism")
    kw = dict(n=n, sensitivity=0.01 if sensitivity is None else sensitivity, beta=beta, delta=delta,
              max_rounds=max_rounds, temperature=temperature)
    base = base if base is None else replace(base, temperature=temperature)
    try:
        if epsilon is not None:
            counts = planner.plan_counts(epsilon_total, delta_total, planner.query_event(mechanism, epsilon, **kw))
            eps_of = {c: epsilon for c in ("basic", "fsrc", "zcdp")}
        else:
            with console.status("planning"):
                eps_of = planner.plan_epsilons(epsilon_total, delta_total, queries, mechanism, **kw)
            counts = None
    except ValueError as e:
        _fail(str(e))
    spent = planner.query_event(mechanism, epsilon, **kw).epsilon if temperature else epsilon
    title = (f"{mechanism} at epsilon {epsilon:g} per query" + (f", spending {spent:.4g} (noise floor {temperature:g})"
                                                                 if spent != epsilon else "") if epsilon is not None
             else f"{queries} {mechanism} queries") + f" within epsilon {epsilon_total:g}, delta {delta_total:g}"
    if model is None and target_share is not None:
        _fail("--target-share needs --model (the head whose release it sizes) and --pool")
    inputs = None if model is None else _release_inputs(model, pool, target_share, tail_share)
    out = Console(soft_wrap=True)
    acc, refs = _print_compositions(out, title, counts, eps_of, pool, base, mechanism, n)
    if inputs is not None:
        _plan_release(out, *inputs, release_epsilon, epsilon_total, release_delta, n, draws, seed,
                      acc if desc is not None else None, pairs, target_share, pairs_per_person)
    if refs is not None:
        out.print(f"reward {desc['reward']}: m = {desc['m']} pairs, k = {desc['pairs_per_person']} per person"
                  f"{' (rescaled from ' + str(desc['rescaled_from']) + ')' if 'rescaled_from' in desc else ''}"
                  f", Delta_r = {desc['sensitivity']:.3g} of the range; BoN (n={n}) {refs['bon']:.3f}, "
                  f"base policy {refs['base']:.3f}", markup=False)


def _fmt(v, digits=4):
    return "-" if v is None else (str(v) if isinstance(v, int) else f"{v:.{digits}g}")


def _print_compositions(out, title: str, counts, eps_of: dict, pool: Optional[Path], base, mechanism: str, n: int):
    """The table of basic, FSRC and zCDP (queries, or epsilon per query), with each one's accuracy
    by the exact laws when a pool is given; returns (accuracy per composition, reference accuracies)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("composition")
    table.add_column("queries" if counts else "epsilon per query", justify="right")
    acc = refs = None
    if pool is not None:
        from ..evaluation.planning import accuracy_at, reference_accuracies

        table.add_column(f"accuracy (n={n})", justify="right")
        with console.status("accuracy by the exact laws"):
            refs = reference_accuracies(_load(pool), base, n)
            acc = {c: accuracy_at(_load(pool), base, mechanism, eps_of.get(c), n) for c in ("basic", "fsrc", "zcdp")}
    table.add_column("note")
    for comp, note in (("basic", ""), ("fsrc", counts["fsrc_note"] if counts else ""),
                       ("zcdp", "fully adaptive (Renyi filter), CKS conversion")):
        value = counts[comp] if counts else eps_of.get(comp)
        # an epsilon per query is printed as planned (the shortest decimal the filter admits Q times at):
        # rounding it to fewer digits could round it up, and the filter would then admit Q - 1
        row = [comp, _fmt(value) if counts or value is None else repr(value)] + ([_fmt(acc[comp], 3)] if acc else []) + [note]
        table.add_row(*row)
    if counts and counts.get("zcdp_limit") is not None:
        table.add_row("(limit)", _fmt(counts["zcdp_limit"]), *([""] if pool is not None else []),
                      "no zCDP accountant admits more (Gaussian profile)")
    out.print(table)
    if counts and counts.get("zcdp") is not None and counts["zcdp"] < counts["basic"]:
        out.print(f"zcdp admits fewer queries than basic here ({counts['zcdp']} < {counts['basic']}): its "
                  "conversion costs more than it saves at large epsilons per query and small totals", markup=False)
    return acc, refs


def _release_inputs(model: Path, pool: Optional[Path], target_share: Optional[float], tail_share: Optional[float]):
    """``plan --model``'s checks, made before anything is printed: (the head, the pool, the head's
    coordinates phi on its rows, the 5th-percentile share asked for)."""
    from ..pipeline import pool_head_phi
    from ..rewards.policy_bt import PolicyBTReward

    if target_share is not None and not 0 < target_share <= 1:
        _fail(f"--target-share must lie in (0, 1], got {target_share!r}")
    tail = (target_share - 0.1) if tail_share is None and target_share is not None else tail_share
    if pool is None:
        _fail("--model needs --pool: a pool of the head's policy with recorded features (privalign featurize)")
    try:
        head = PolicyBTReward.load(model)
    except (ValueError, OSError, KeyError) as e:
        _fail(f"{model}: {e}")
    p = _load(pool)
    try:
        return head, p, pool_head_phi(head, p, pool), tail
    except ValueError as e:
        _fail(str(e))


NOT_COVERED = ("note: this plan reads the exact head w_D, trained on D without noise: an epsilon_w, a mode or a number "
               "of persons chosen from it depends on D, and that choice is not covered by the guarantee; to keep it "
               "covered, plan with a head trained only on public persons (the curator's own or public preference data)")


def _plan_release(out, head, p, phi, tail, release_epsilon, epsilon_total, delta_total, n, draws, seed,
                  per_query: dict | None, pairs: Optional[int] = None, target_share: Optional[float] = None,
                  pairs_per_person: Optional[int] = None) -> None:
    """``plan --model``: the release-then-BoN mode beside per-query noise, and which to use; with
    ``--pairs`` (and ``--pairs-per-person`` k) the release's noise is that of a head on that many
    pairs (the head's own m by default), k from each person (w held fixed); with ``--target-share``
    the fewest pairs for which the release keeps that share of BoN's lift, and the smallest epsilon_w
    for which it does with the head's own persons."""
    import math

    from rich.table import Table

    from ..rewards.release import release_accuracy

    eps_list = parse_float_list(release_epsilon) if release_epsilon else [epsilon_total]
    k = head.k if pairs_per_person is None else pairs_per_person
    rescaled = pairs is not None or pairs_per_person is not None
    persons = max(1, math.ceil((head.m if pairs is None else pairs) / k)) if rescaled else None
    table = Table(title=f"release once at (epsilon_w, {delta_total:g}), then BoN (n={n}): queries unlimited; "
                        f"{draws} release draws" + ("" if persons is None else
                                                    f"; noise of a head on {persons * k} pairs ({persons} persons "
                                                    f"of k = {k}; w held fixed)"))
    for col in ("epsilon_w", "accuracy (mean)", "5th percentile", "share of BoN's lift (mean / 5th pct)"):
        table.add_column(col, justify="right")
    rows = []
    with console.status("release draws"):
        for e in eps_list:
            try:
                r = release_accuracy(head, None, p.columns["prompt_id"], p.columns["true_reward"], e, delta_total, n,
                                     draws, np.random.default_rng(seed), persons=persons, phi=phi,
                                     pairs_per_person=k if rescaled else None)
            except ValueError as err:
                _fail(str(err))
            rows.append(r)
            share = ("-" if r["share_mean"] is None else f"{r['share_mean']:.0%} / {r['share_p5']:.0%}")
            table.add_row(f"{e:g}", f"{r['mean']:.3f}", f"{r['p5']:.3f}", share)
    out.print(table)
    out.print(NOT_COVERED, markup=False)
    r0 = rows[0]
    out.print(f"exact head: BoN (n={n}) {r0['bon']:.3f}, base policy {r0['base']:.3f}; P = "
              f"{head.persons} persons, k = {head.k}, Delta_r = {head.sensitivity:.3g}", markup=False)
    if target_share is not None:
        _print_pairs_for_share(out, head, p, phi, eps_list, delta_total, target_share, tail, n, draws, seed, k)
        _print_epsilon_for_share(out, head, p, phi, delta_total, target_share, tail, n, draws, seed)
    best = max((v, c) for c, v in (per_query or {}).items() if v is not None) if per_query else None
    full = next((r for r in rows if r["epsilon"] == epsilon_total), None)
    if best is not None and full is not None:
        out.print(_recommendation(full, best, r0["base"]), markup=False)


def _recommendation(full: dict, best: tuple, base: float) -> str:
    """Which mode to use: only one that beats the base policy (the release on average, per-query noise
    at its best); of two, the release when its 5th percentile is at least per-query's; else neither."""
    release_wins, per_query_wins = full["mean"] > base, best[0] > base
    said = (f"release at the whole budget: {full['mean']:.4g} on average, {full['p5']:.4g} at the 5th "
            f"percentile; per-query at its best {best[0]:.4g} ({best[1]}); base policy {base:.4g}")
    if not (release_wins or per_query_wins):
        return (f"recommended: neither: no mode beats the base policy ({said}); serve the base policy, or "
                "plan with a larger budget or more preference data")
    if release_wins and (not per_query_wins or full["p5"] >= best[0]):
        return f"recommended: release then BoN ({said})"
    return f"recommended: per-query noise ({best[1]}) ({said})"


def _print_pairs_for_share(out, head, p, phi, eps_list, delta_total: float, target_share: float, tail: float, n: int,
                           draws: int, seed: int, k: int) -> None:
    """``plan --target-share``: per epsilon_w, the fewest preference pairs, k from each person, whose
    release keeps that share of BoN's lift on average and ``tail`` at the 5th percentile
    (``release.pairs_for_share``)."""
    from ..rewards.release import pairs_for_share

    with console.status("sizing the preference data"):
        for e in eps_list:
            got = pairs_for_share(head, None, p.columns["prompt_id"], p.columns["true_reward"], e, delta_total,
                                  target_share, tail, n, draws, seed, phi=phi, pairs_per_person=k)
            r = got["result"]
            if r["share_mean"] is None:
                out.print(f"BoN with the exact head has no lift on this pool ({r['bon']:.3f} against the base "
                          f"policy's {r['base']:.3f}): no amount of preference data makes a release keep a share of it",
                          markup=False)
                break
            if got["pairs"] is None:
                out.print(f"epsilon_w {e:g}: even {head.persons * 10_000 * k}"
                          f" pairs do not keep {target_share:.0%} of the lift ({r['share_mean']:.0%} on average, "
                          f"{r['share_p5']:.0%} at the 5th percentile)", markup=False)
            else:
                out.print(f"epsilon_w {e:g}: {got['pairs']} pairs ({got['persons']} persons of k = {k}) keep "
                          f"{r['share_mean']:.0%} of the lift on average and {r['share_p5']:.0%} at the 5th "
                          f"percentile (target {target_share:.0%} / {tail:.0%}; noise only, w held fixed)",
                          markup=False)


def _print_epsilon_for_share(out, head, p, phi, delta_total: float, target_share: float, tail: float, n: int,
                             draws: int, seed: int) -> None:
    """``plan --target-share``: with the head's own data, the smallest epsilon_w whose release keeps that
    share of BoN's lift (``release.epsilon_for_share``)."""
    from ..rewards.release import epsilon_for_share

    with console.status("searching epsilon_w"):
        got = epsilon_for_share(head, None, p.columns["prompt_id"], p.columns["true_reward"], delta_total,
                                target_share, tail, n, draws, seed, phi=phi)
    r, persons = got["at"], head.persons
    if r["share_mean"] is None:
        out.print(f"with its own {persons} persons: BoN has no lift on this pool, so no epsilon_w keeps a share of it",
                  markup=False)
    elif got["met"]:
        out.print(f"with its own {persons} persons: the smallest epsilon_w that keeps {target_share:.0%} / {tail:.0%} "
                  f"is {got['epsilon_w']:.3g} ({r['share_mean']:.0%} on average, {r['share_p5']:.0%} at the 5th "
                  f"percentile; bisection to 5%)", markup=False)
    else:
        out.print(f"with its own {persons} persons: not even epsilon_w = {got['bounds'][1]:g} keeps "
                  f"{target_share:.0%} / {tail:.0%} ({r['share_mean']:.0%} on average, {r['share_p5']:.0%} at the "
                  f"5th percentile)", markup=False)


def _plan_persons(model: Optional[Path], preferences: Path, privacy_unit: str, release_epsilon: Optional[str],
                  epsilon_total: Optional[float], delta: float, target: Optional[float], tail: Optional[float],
                  draws: int, seed: int) -> None:
    """``plan --model HEAD --preferences HELDOUT``: per epsilon_w, the fewest persons whose release keeps
    ``target`` (0.9) of the exact head's held-out gain over chance on average and ``tail`` (0.8) at the
    5th percentile, w held fixed (``preference_bt.persons_for_pairwise_share``), beside what the head's
    own persons keep."""
    from ..rewards.preference_bt import pair_diffs, pairwise_share, persons_for_pairwise_share
    from ..rewards.release import check_release
    from .rm_preferences import load_head, pairs_of, read_table

    if model is None:
        _fail("--preferences needs --model: the exact head (rm train --preferences) whose release it sizes")
    if release_epsilon is None and epsilon_total is None:
        _fail("--preferences needs --release-epsilon: the epsilon_w values to size the release for")
    target = 0.9 if target is None else target
    tail = target - 0.1 if tail is None else tail
    if not (0 < target <= 1 and 0 <= tail <= 1):
        _fail(f"--target-share must lie in (0, 1] and --tail-share in [0, 1], got {target!r} and {tail!r}")
    head = load_head(model, exact=True)
    eps_list = parse_float_list(release_epsilon) if release_epsilon else [epsilon_total]
    try:
        for e in eps_list:
            check_release(head, e, delta)
    except ValueError as e:
        _fail(str(e))
    diffs = pair_diffs(head.feature_map, pairs_of(read_table(preferences, privacy_unit), head.base_model)[0])
    out = Console(soft_wrap=True)
    out.print(NOT_COVERED, markup=False)
    own = [pairwise_share(head, diffs, e, delta, draws, seed) for e in eps_list]
    out.print(f"exact head: pairwise accuracy {own[0]['exact']:.3f} on {len(diffs)} held-out pairs of "
              f"{preferences.name} (gain over chance {own[0]['exact'] - 0.5:+.3f}); P = {head.persons} persons, "
              f"k = {head.k}, lambda = {head.lam:g}, Delta_r = {head.sensitivity:.3g}; target {target:.0%} of the gain "
              f"on average and {tail:.0%} at the 5th percentile over {draws} release draws (noise only, w held fixed)",
              markup=False)
    if own[0]["share_mean"] is None:
        out.print("the exact head has no gain over chance on these pairs: no number of persons makes a release keep "
                  "a share of it", markup=False)
        return
    with console.status("sizing the persons"):
        for e, r in zip(eps_list, own):
            got = persons_for_pairwise_share(head, diffs, e, delta, target, tail, draws, seed)
            out.print(_persons_line(head, e, delta, r, got, target), markup=False)


def _persons_line(head, epsilon: float, delta: float, own: dict, got: dict, target: float) -> str:
    """One epsilon_w's answer: its own persons' release, and the fewest persons that meet the target."""
    said = (f"epsilon_w {epsilon:g}: with its own {head.persons} persons the release keeps {own['mean']:.3f} on "
            f"average ({own['share_mean']:.0%} of the gain), {own['p5']:.3f} at the 5th percentile "
            f"({own['share_p5']:.0%}); ")
    r = got["result"]
    if got["persons"] is None:
        return said + (f"even {r['persons']:,} persons do not keep {target:.0%} ({r['share_mean']:.0%} on average, "
                       f"{r['share_p5']:.0%} at the 5th percentile)")
    note = ("" if delta < 1 / r["persons"] else
            f" (a head on that many persons needs delta_w < 1/P = {1 / r['persons']:.3g})")
    return said + (f"{r['persons']:,} persons ({r['persons'] * head.k:,} pairs at k = {head.k}) keep {r['mean']:.3f} "
                   f"({r['share_mean']:.0%}) and {r['p5']:.3f} ({r['share_p5']:.0%}){note}")
