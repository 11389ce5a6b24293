"""``privalign rm train --preferences`` and ``privalign rm evaluate``: a certified head from a user's
own preference file (TRL's formats, a person column), and its held-out pairwise accuracy, exact and
released."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from ._common import _fail, _load, _progress, console, parse_float_list, private_path


def read_table(path: Path, privacy_unit: Optional[str], option: str = "--preferences"):
    from ..preferences.trl import read_preferences

    if privacy_unit is None:
        _fail(f"{option} needs --privacy-unit: the column that names a person, or 'row' to make every pair its "
              "own person (say so explicitly: it is right only when nobody gave two pairs)")
    try:
        return read_preferences(path, privacy_unit, drop_empty=True)
    except ValueError as e:
        _fail(str(e))


def pairs_of(table, model: str, policy=None):
    """The table's pairs with their raw policy features (cached beside the file, read from it when
    used), and the policy: ``policy``, or the one loaded here (None when every text was cached).
    ``model`` = ``embedding_bt.EMBEDDER``: the pairs' sentence embeddings instead, cached the same way."""
    from ..preference_features import featurize_table
    from ..rewards.preference_bt import PreferencePairs

    loaded = {"policy": policy}

    def load():
        from ..backends import load_policy
        from ..rewards.embedding_bt import EMBEDDER, EmbeddingFeaturizer

        loaded["policy"] = EmbeddingFeaturizer() if model == EMBEDDER else load_policy(model)
        return loaded["policy"]
    resume = ("interrupted: the features computed so far are cached beside the file; rerun the same command to "
              "resume")
    shown: dict = {}
    with ExitStack() as stack:  # the display opens with the first text computed: a cached file shows none

        def show(done, total):
            if not shown:
                shown["bar"] = stack.enter_context(_progress(on_interrupt=resume))
                shown["job"] = shown["bar"].add_task(f"featurizing {table.source.name} with {model}", total=total)
            shown["bar"].update(shown["job"], completed=done, total=total)

        chosen, rejected = featurize_table(table, policy, model, progress=show, load_policy=load)
    prompts = np.array([json.dumps(p, sort_keys=True, ensure_ascii=False) for p in table.prompts], object)
    return PreferencePairs(chosen, rejected, np.asarray(table.person, str), prompts), loaded["policy"]


def train_from_preferences(preferences: Path, privacy_unit: Optional[str], public: Optional[Path], model: str,
                           k: int, grid: dict, seed: int, name: Optional[str], out: Path, target_epsilon: float = 1.0,
                           max_persons: Optional[int] = None, features: Optional[str] = None):
    """``rm train --preferences``: read both files, check them, featurize, train, write, print.
    ``features``: policy (the default: ``model``'s features) or embedding (sentence embeddings)."""
    from ..preferences.trl import check_disjoint
    from ..rewards.embedding_bt import EMBEDDER
    from ..rewards.preference_bt import train_preference_bt
    features = features or "policy"
    if features not in ("policy", "embedding"):
        _fail(f"--features with --preferences must be 'policy' or 'embedding', got {features!r}")
    if features == "embedding":
        fixed = [f"--{key.replace('_', '-')}" for key in ("components", "cs", "lp_clips") if grid.get(key)]
        if fixed:
            _fail(f"--features embedding has no feature map to set: {', '.join(fixed)} apply to policy features")
        model, name = EMBEDDER, name or "embedding-bt"
    if privacy_unit is None:
        read_table(preferences, None)
    if public is None:
        _fail("--preferences needs --public FILE: a preference file the curator may use without protection (a "
              "public data set, or the curator's own), on which the feature map and the settings are chosen, "
              "so that no choice reads D")
    d_table = read_table(preferences, privacy_unit)
    if max_persons is not None:  # a seeded subset by a keyed hash of the ids alone (public): a smaller deployment
        from ..preferences.splits import subsample_ids

        if max_persons < 2:
            _fail(f"--max-persons must be at least 2, got {max_persons!r}")
        d_table = d_table.of_persons(subsample_ids(d_table.person, max_persons, seed))
    p_table = _read_public(public, privacy_unit)
    try:
        check_disjoint(p_table, d_table)
    except ValueError as e:
        _fail(str(e))
    d, policy = pairs_of(d_table, model)
    p, _ = pairs_of(p_table, model, policy)
    try:
        head, rows = train_preference_bt(d, p, k=k, seed=seed, grid=grid, base_model=model,
                                         name=name or "policy-bt", privacy_unit=d_table.unit, source=str(public),
                                         target_epsilon=target_epsilon, features=features)
    except ValueError as e:
        _fail(str(e))
    head.save(out)
    head.save_private(private_path(out))
    best = max(rows, key=lambda r: (r["selection_accuracy"], r["lambda"]))
    settings = (f"features: {model} sentence embeddings (a fixed map); lambda = {head.lam:g}" if features ==
                "embedding" else f"q = {best['components']}, c = {best['c']:g}, L = {best['lp_clip']:g}, "
                f"lambda = {head.lam:g}")
    console.print(f"wrote {out}: P = {d.persons} persons (privacy unit: {d_table.unit}) of at most k = {k} pairs "
                  f"each (how many were kept or dropped reads D: only the private report says), m = P k = {head.m}; "
                  f"{settings} chosen on the public file ({p.persons} persons; on its held-out half, "
                  f"{'pairwise accuracy' if best['selection_metric'] == 'pairwise' else 'accuracy of the top choice among a prompt' + chr(39) + 's responses'} "
                  f"{best['selection_exact_accuracy']:.3f} exact, {best['selection_accuracy']:.3f} released at "
                  f"epsilon_w {target_epsilon:g}), never on D; certified Delta_r = {head.sensitivity:.4g}; assumed public "
                  f"and not protected: {public.name} and the roster of persons (guarantee.public_inputs); keep the "
                  f"model file with the operator", highlight=False, markup=False)
    console.print(f"wrote {private_path(out)} (private: what the head learnt from D, with no privacy; nothing read "
                  "from D is printed here)", highlight=False, markup=False)
    return head


def _read_public(public: Path, privacy_unit: str):
    """The public file, its persons by the same column when it has one, else each of its rows."""
    from ..preferences.trl import read_preferences

    try:
        return read_preferences(public, privacy_unit, drop_empty=True)
    except ValueError as e:
        if privacy_unit == "row" or "has no column" not in str(e):
            _fail(f"--public: {e}")
    return read_table(public, "row", "--public")


def rm_evaluate(head: Path = typer.Argument(..., help="a head trained by rm train --preferences (the exact file), "
                                                      "or a released one"),
                preferences: Path = typer.Option(..., help="held-out preference pairs (TRL JSONL or Parquet)"),
                privacy_unit: str = typer.Option("row", help="the held-out file's person column (only read)"),
                release_epsilon: Optional[str] = typer.Option(None, help="comma list of epsilon_w: the release's "
                                                                        "accuracy over draws"),
                release_delta: float = typer.Option(1e-6, help="delta_w of those releases"),
                draws: int = typer.Option(60, help="release draws"),
                seed: int = typer.Option(0),
                pool: Optional[Path] = typer.Option(None, help="a pool of the head's policy with its features "
                                                               "(privalign featurize): add BoN's accuracy on it"),
                n: int = typer.Option(16, min=1, help="with --pool: BoN's candidates per prompt"),
                json_out: bool = typer.Option(False, "--json", help="print JSON instead of a table")):
    """Held-out pairwise accuracy of a preference head (95% Wilson interval), beside the log-probability
    alone, and of its release at each --release-epsilon (mean and 5th percentile over draws); with
    --pool, BoN's accuracy at --n on that pool too (exact, each release over draws, the base policy)."""
    result = evaluate_head(head, preferences, privacy_unit, release_epsilon, release_delta, draws, seed, pool, n)
    if json_out:
        print(json.dumps(result, indent=1))
        return
    _print_evaluation(result)


def load_head(path: Path, exact: bool = False):
    """The head in ``path``: a ``PolicyBTReward``, or a ``ReleasedHead`` unless ``exact``."""
    from ..rewards.policy_bt import PolicyBTReward
    from ..rewards.release import ReleasedHead

    try:
        released = json.loads(path.read_text()).get("kind") == "policy-bt-released"
        if released and exact:
            _fail(f"{path} is a released head; this needs the operator's exact file (w, read from D)")
        return ReleasedHead.load(path) if released else PolicyBTReward.load(path)
    except (OSError, ValueError, KeyError, AttributeError) as e:
        _fail(f"{path}: {e}")


def evaluate_head(head_path: Path, preferences: Path, privacy_unit: str, release_epsilon, release_delta: float,
                  draws: int, seed: int, pool: Optional[Path] = None, n: int = 16) -> dict:
    from ..rewards.preference_bt import accuracy_interval, pair_correct, pair_diffs, released_accuracies
    from ..rewards.release import check_release, release_noise_scale

    head = load_head(head_path)
    exact = hasattr(head, "w")
    w = head.w if exact else head.w_tilde
    eps_list = parse_float_list(release_epsilon) if release_epsilon else []
    if eps_list and not exact:
        _fail("--release-epsilon simulates releases of the exact head: pass the operator's exact file")
    try:
        for eps in eps_list:
            check_release(head, eps, release_delta)
    except ValueError as e:
        _fail(str(e))
    on_pool = _pool_phi(head, pool) if pool is not None else None  # checked before the slow featurizing
    pairs, _ = pairs_of(read_table(preferences, privacy_unit), head.base_model)
    diffs = pair_diffs(head.feature_map, pairs)
    acc = accuracy_interval(pair_correct(w, diffs))
    out = {"head": str(head_path), "pairs": int(pairs.person.size), "exact" if exact else "released":
           dict(zip(("accuracy", "lo", "hi"), acc)), "releases": []}
    if head.reads_policy_features:  # the last raw coordinate is the log-probability (not of an embedding)
        lp = pairs.chosen[:, -1] - pairs.rejected[:, -1]
        out["logprob_alone"] = dict(zip(("accuracy", "lo", "hi"), accuracy_interval(np.where(
            lp > 0, 1.0, np.where(lp < 0, 0.0, 0.5)))))
    rng = np.random.default_rng(seed)
    for eps in eps_list:
        sigma = release_noise_scale(head, eps, release_delta)
        accs = released_accuracies(head.w, diffs, sigma, rng, draws)
        out["releases"].append({"epsilon_w": eps, "delta_w": release_delta, "sigma": sigma, "draws": draws,
                                "mean": float(accs.mean()), "p5": float(np.percentile(accs, 5))})
    if on_pool is not None:
        out["bon"] = _pool_bon(head, w, pool, *on_pool, eps_list, release_delta, draws, seed, n)
    return out


def _pool_phi(head, pool: Path):
    """(the pool, the head's feature coordinates on its rows), or a one-line error."""
    from ..pipeline import pool_head_phi

    p = _load(pool)
    try:
        return p, pool_head_phi(head, p, pool)
    except ValueError as e:
        _fail(str(e))


def _pool_bon(head, w, pool_path: Path, pool, phi, eps_list, delta: float, draws: int, seed: int, n: int) -> dict:
    """``rm evaluate --pool``: BoN at n on the pool with the head (exact, or the released head's one draw)
    and with each release over draws (``release_accuracy``, the same draws for every epsilon_w), and
    the base policy, by the harness's exact BoN law."""
    from ..evaluation.release import bon_accuracy
    from ..rewards.release import release_accuracy

    pid, y = pool.columns["prompt_id"], pool.columns["true_reward"]
    ref = bon_accuracy(phi @ w, pid, y, n)
    out = {"pool": str(pool_path), "n": n, "prompts": ref["prompts"], "draws": draws, "base_policy": ref["base"],
           "exact" if hasattr(head, "w") else "released": ref["bon"], "releases": []}
    for eps in eps_list:
        r = release_accuracy(head, None, pid, y, eps, delta, n, draws, np.random.default_rng(seed), phi=phi)
        out["releases"].append({"epsilon_w": eps, "delta_w": delta, "sigma": r["sigma"], "draws": draws,
                                "mean": r["mean"], "p5": r["p5"], "share_mean": r["share_mean"],
                                "share_p5": r["share_p5"]})
    return out


def _print_evaluation(r: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"pairwise accuracy on {r['pairs']} held-out pairs (95% interval)")
    for col in ("head", "accuracy", "interval"):
        table.add_column(col, justify="right")
    for name, key in (("exact head", "exact"), ("released head", "released"), ("log-probability alone",
                                                                              "logprob_alone")):
        if key in r:
            a = r[key]
            table.add_row(name, f"{a['accuracy']:.3f}", escape(f"[{a['lo']:.3f}, {a['hi']:.3f}]"))
    for rel in r["releases"]:
        table.add_row(escape(f"released at ({rel['epsilon_w']:g}, {rel['delta_w']:g})"), f"{rel['mean']:.3f} (mean)",
                      escape(f"5th percentile {rel['p5']:.3f} over {rel['draws']:d} draws"))
    console.print(table)
    if "bon" in r:
        _print_pool_bon(r["bon"])


def _print_pool_bon(b: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(f"BoN (n={b['n']}) on {Path(b['pool']).name} ({b['prompts']} prompts; releases: "
                               f"mean and 5th percentile over {b['draws']} draws)"))
    for col in ("selection", "accuracy", "5th percentile", "share of BoN's lift (mean / p5)"):
        table.add_column(col, justify="right")
    table.add_row("base policy", f"{b['base_policy']:.3f}", "", "")
    for name, key in (("exact head", "exact"), ("released head", "released")):
        if key in b:
            table.add_row(name, f"{b[key]:.3f}", "", "")
    for rel in b["releases"]:
        share = "-" if rel["share_mean"] is None else f"{rel['share_mean']:.0%} / {rel['share_p5']:.0%}"
        table.add_row(escape(f"released at ({rel['epsilon_w']:g}, {rel['delta_w']:g})"), f"{rel['mean']:.3f}",
                      f"{rel['p5']:.3f}", share)
    console.print(table)
