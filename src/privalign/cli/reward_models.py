"""``privalign rm``: train a certified reward model, release it once with differential privacy,
and check a head's sensitivity."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from ._common import _fail, _out_file, _progress, _train_pool, console, parse_float_list, parse_int_list, private_path


rm_app = typer.Typer(no_args_is_help=True, help="Train reward models.")


@rm_app.command("train")
def rm_train(task: str = typer.Option("gsm8k", help="the task: minilm-bt builds pairs from its train split; "
                                                    "policy-bt needs it for the chat format"),
             features: Optional[str] = typer.Option(None, help="minilm (default: sentence embeddings of reference "
                                                                 "pairs) or policy (the policy's own features, from "
                                                                 "--pool); with --preferences: policy (default) or "
                                                                 "embedding (sentence embeddings of each pair)"),
             pool: Optional[Path] = typer.Option(None, help="policy: a pool of graded policy samples on the TRAIN "
                                                            "prompts, generated with --features"),
             limit: Optional[int] = typer.Option(None, help="minilm: first N training problems (one pair each)"),
             lam: Optional[str] = typer.Option(None, help="L2 regularisation lambda (policy: a comma list to choose "
                                                          "from on validation prompts)"),
             components: Optional[str] = typer.Option(None, help="policy: PCA sizes q to choose from (default 8,16; "
                                                                  "--objective release: 2,4,8,16)"),
             cs: Optional[str] = typer.Option(None, help="policy: weights c of the log-probability coordinate to "
                                                         "choose from (default 0.6,0.8,0.95; release: up to 0.99)"),
             lp_clips: Optional[str] = typer.Option(None, help="policy: log-probability clips L to choose from "
                                                               "(default 4; release: 1,2,4)"),
             objective: str = typer.Option("privbon", help="policy: what the choice of (q, c, L, lambda) maximises "
                                                           "on validation prompts: privbon (PrivBoN at "
                                                           "--target-epsilon per query) or release (BoN with the "
                                                           "head released at --release-epsilon, mean and 5th "
                                                           "percentile over draws)"),
             select_folds: int = typer.Option(1, help="--objective release: 1 scores one validation half, 2 "
                                                      "each half with the candidate trained on the other "
                                                      "(cross-fitted)"),
             pairs_per_prompt: int = typer.Option(64, help="policy: at most this many pairs per train prompt"),
             pairs_per_person: Optional[int] = typer.Option(None, help="k: at most this many pairs per person "
                                                                       "(policy: a person is a train prompt's grader, "
                                                                       "default 16, the excess dropped; minilm: 1)"),
             max_pairs_per_person: Optional[int] = typer.Option(None, hidden=True,
                                                                help="the same as --pairs-per-person"),
             max_persons: Optional[int] = typer.Option(None, help="policy and --preferences: keep a seeded random P "
                                                                  "of D's persons (a smaller deployment; the subset "
                                                                  "reads the ids alone)"),
             release_epsilon: Optional[float] = typer.Option(None, help="policy: also release the head once with "
                                                                        "Gaussian noise at this epsilon (rm release)"),
             release_delta: float = typer.Option(1e-6, help="with --release-epsilon: its delta"),
             target_epsilon: float = typer.Option(1.0, help="policy: epsilon per query that the choice of "
                                                            "(q, lambda) optimises PrivBoN accuracy for"),
             range_epsilon: float = typer.Option(0.1, help="policy: one-time epsilon to release a tight output "
                                                           "range privately (0: the data-independent 1/lambda)"),
             seed: int = typer.Option(0),
             name: Optional[str] = typer.Option(None, help="reward name (default: minilm-bt or policy-bt)"),
             data_dir: Optional[str] = typer.Option(None),
             preferences: Optional[Path] = typer.Option(None, help="your own preference data: TRL JSONL or Parquet "
                                                                   "(prompt / chosen / rejected); with "
                                                                   "--privacy-unit and --public"),
             privacy_unit: Optional[str] = typer.Option(None, help="--preferences: the column that names a "
                                                                   "person, or 'row' (each pair its own person)"),
             public: Optional[Path] = typer.Option(None, help="--preferences: a preference file usable without "
                                                              "protection; fits the feature map, chooses settings"),
             model: str = typer.Option("smollm2", help="--preferences: the deployed policy (a Hugging Face causal "
                                                       "LM) whose features the head reads"),
             out: Path = typer.Option(..., help="output model (JSON)")):
    """Train a certified Bradley-Terry reward model and print its certificate."""
    _out_file(out, "model")
    _out_file(private_path(out), "model")
    pairs_per_person = pairs_per_person if max_pairs_per_person is None else max_pairs_per_person
    if preferences is not None:
        from .rm_preferences import train_from_preferences

        grid = {"lambdas": _grid_values("lam", lam), "cs": _grid_values("cs", cs),
                "components": _grid_values("components", components, parse_int_list),
                "lp_clips": _grid_values("lp-clips", lp_clips)}
        if release_epsilon is not None:
            _check_release_args(release_epsilon, release_delta)
            _out_file(released_path(out), "model")
        head = train_from_preferences(preferences, privacy_unit, public, model, pairs_per_person or 16, grid, seed,
                                      name, out, release_epsilon or target_epsilon, max_persons, features)
        if release_epsilon is not None:
            _release(head, release_epsilon, release_delta, released_path(out), out)
        return
    features = features or "minilm"
    if features == "policy":
        if objective not in ("privbon", "release"):
            _fail(f"--objective must be 'privbon' or 'release', got {objective!r}")
        if objective == "release" and release_epsilon is None:
            _fail("--objective release needs --release-epsilon: the epsilon_w the choice is made for")
        if release_epsilon is not None:
            _check_release_args(release_epsilon, release_delta)
            _out_file(released_path(out), "model")
        grid = {"lambdas": lam, "components": components, "cs": cs, "lp_clips": lp_clips}
        model = _rm_train_policy(task, pool, grid, pairs_per_prompt, pairs_per_person or 16, target_epsilon,
                                 range_epsilon, seed, name or "policy-bt", out, max_persons,
                                 {"objective": objective, "release_epsilon": release_epsilon,
                                  "release_delta": release_delta, "select_folds": select_folds}
                                 if objective == "release" else {})
        if release_epsilon is not None:
            _release(model, release_epsilon, release_delta, released_path(out), out)
        return
    if features != "minilm":
        _fail(f"--features must be 'minilm' or 'policy', got {features!r}")
    from ..rewards import EmbeddingBTReward
    from ..rewards.preferences import preference_pairs

    try:
        lam_value = float(lam) if lam else 1e-2
        prompts, chosen, rejected = preference_pairs(task, limit, seed, data_dir)
        model = EmbeddingBTReward.train(prompts, chosen, rejected, lam=lam_value, pairs_per_person=pairs_per_person or 1,
                                        name=name or "minilm-bt", meta={"task": task, "pairs": len(prompts), "seed": seed})
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    model.save(out)
    private = model.save_private(private_path(out))
    lo, hi = model.output_range
    console.print(f"wrote {out}: {len(prompts)} pairs, lambda = {lam_value:g} (given, not chosen on D), "
                  f"certified Delta_r = {model.sensitivity:.4g} on output range [{lo:.3g}, {hi:.3g}] "
                  f"({model.sensitivity / (hi - lo):.3%} of its width); keep it with the operator", markup=False)
    console.print(f"wrote {private} (private: what the head learnt from D, with no privacy; nothing read from D "
                  "is printed here)", markup=False)


def _grid_values(name: str, text: Optional[str], parse=parse_float_list):
    if text is None:
        return None
    try:
        return tuple(parse(text))
    except typer.BadParameter:
        _fail(f"--{name} must be a comma list of numbers, got {text!r}")


def _rm_train_policy(task, pool, grid, pairs_per_prompt, pairs_per_person, target_epsilon, range_epsilon,
                     seed, name, out, max_persons=None, objective=None):
    from rich.table import Table

    from ..rewards.policy_bt import train_policy_bt

    p, raw = _train_pool(pool)
    settings = {"lambdas": _grid_values("lam", grid["lambdas"]), "cs": _grid_values("cs", grid["cs"]),
                "components": _grid_values("components", grid["components"], parse_int_list),
                "lp_clips": _grid_values("lp-clips", grid["lp_clips"])}
    try:
        model, grid = train_policy_bt(raw, p.columns["prompt_id"], p.columns["true_reward"], task=task,
                                      pairs_per_prompt=pairs_per_prompt, pairs_per_person=pairs_per_person,
                                      target_epsilon=target_epsilon, range_epsilon=range_epsilon, seed=seed,
                                      name=name, max_persons=max_persons,
                                      **{key: v for key, v in settings.items() if v is not None}, **(objective or {}))
    except ValueError as e:
        _fail(str(e))
    meta, lo_hi = model.meta, model.output_range
    release = bool(objective)
    table = Table(title=f"(q, c, L, lambda): heads trained on {meta['selection_fit_prompts']} and scored on "
                        f"{meta['selection_score_prompts']} validation prompts (never D, never test)")
    score = (f"release eps_w={objective['release_epsilon']:g}: mean, p5 (n=16)" if release
             else f"PrivBoN eps={target_epsilon:g} (n=16)")
    for col in ("q", "c", "L", "lambda", "Delta_r", "AUC", score, "BoN (n=16)"):
        table.add_column(col, justify="right")
    for r in grid:
        table.add_row(str(r["components"]), f"{r['c']:g}", f"{r['lp_clip']:g}", f"{r['lambda']:g}",
                      f"{r['sensitivity']:.3g}", f"{r['selection_auc']:.3f}",
                      f"{r['selection_release_mean']:.3f}, {r['selection_release_p5']:.3f}" if release
                      else f"{r['selection_privbon_accuracy']:.3f}", f"{r['selection_bon_accuracy']:.3f}")
    console.print(table)
    model.save(out)
    private = model.save_private(private_path(out))
    console.print(
        f"wrote {out}: P = {meta['persons']} persons (one per fit prompt; the fit prompts' ids are public) of at "
        f"most k = {model.k} pairs each (how many were kept or dropped reads D: only the private report says), "
        f"m = P k = {model.m}, "
        f"q = {meta['components']}, c = {meta['c']:g}, L = {meta['lp_clip']:g}, lambda = {model.lam:g}"
        f"{' (on the edge of its grid: ' + ', '.join(meta['on_grid_edge']) + ')' if meta['on_grid_edge'] else ''}, "
        f"chosen without reading D; certified Delta_r = {model.sensitivity:.3g} on [{lo_hi[0]:.3g}, {lo_hi[1]:.3g}] "
        f"{f'(released privately, one-time epsilon {range_epsilon:g}) ' if range_epsilon > 0 else ''}"
        f"({model.sensitivity / (lo_hi[1] - lo_hi[0]):.3%} of its width); selection AUC {meta['selection_auc']:.3f} "
        f"(log-probability alone {meta['selection_logprob_auc']:.3f}); keep the model file with the operator", markup=False)
    console.print(f"wrote {private} (private: what the head learnt from D, with no privacy; nothing read from D "
                  "is printed here)", markup=False)
    return model


def released_path(out: Path) -> Path:
    """Where ``rm train --release-epsilon`` writes the released head: beside the model."""
    return out.with_name(out.stem + ".released.json")


def _check_release_args(epsilon: float, delta: float) -> None:

    if not (math.isfinite(epsilon) and epsilon > 0):
        _fail(f"--epsilon must be positive and finite, got {epsilon!r}")
    if not (math.isfinite(delta) and 0 < delta < 1):
        _fail(f"--delta must lie in (0, 1), got {delta!r}")


def _release(model, epsilon: float, delta: float, out: Path, model_path: Path, again: bool = False) -> None:
    from ..rewards.release import check_release, compose_releases, record_release, recorded_releases, release_head

    try:
        check_release(model, epsilon, delta)
    except ValueError as e:
        _fail(str(e))
    earlier = recorded_releases(model_path, model.meta.get("head_id", ""))
    if earlier and not again:
        spent = ", ".join(f"({r['epsilon']:g}, {r['delta']:g})" for r in earlier)
        _fail(f"{model_path} was already released {len(earlier)} time(s) at {spent}: another release spends "
              "epsilon_w again (pass --again, and the new file states the composed total)")
    try:
        head = release_head(model, epsilon, delta)
    except ValueError as e:
        _fail(str(e))
    if earlier:
        head.release["composed"] = compose_releases(head, earlier)
    head.save(out)
    record_release(model_path, head, out)
    g = head.release
    total = (f"; with the {len(earlier)} earlier release(s) of this head the total is (epsilon, delta) = "
             f"({g['composed']['epsilon']:g}, {g['composed']['delta']:g})" if earlier else "")
    console.print(f"wrote {out}: {model.name} released at (epsilon_w, delta_w) = ({g['epsilon']:g}, "
                  f"{g['delta']:g}) for P = {g['persons']} persons, k = {g['pairs_per_person']}: w~ = w + "
                  f"N(0, sigma^2 I), sigma = {g['sigma']:.4g} for L2 sensitivity Delta_r = {g['sensitivity']:.4g}"
                  f"{total}; every selection with it is free; this file may be published. Unit: a person "
                  f"(replacement of one person's rows, the roster of ids public: "
                  f"{model.meta.get('person_definition', 'the grader of one train prompt')}); "
                  f"assumed public and not protected: {_public_names(g.get('public_inputs'))} "
                  f"(guarantee.public_inputs). Recorded in {model_path.name.removesuffix('.json')}.releases.json", markup=False)


def _public_names(inputs) -> str:
    """What a head's public inputs are, in words, for the line ``rm release`` prints."""
    if not isinstance(inputs, dict):
        return "not recorded (retrain the head)"
    names = {"validation_persons": "the validation persons' data", "public_file": "the --public file",
             "person_ids": "the roster of persons", "prompt_ids": "the prompt ids", "seed": "the seed"}
    return ", ".join(v for k, v in names.items() if k in inputs)


@rm_app.command("release")
def rm_release(model: Path = typer.Argument(..., help="a certified policy-bt model, on policy features or on "
                                                    "sentence embeddings (the operator's exact file)"),
               epsilon: float = typer.Option(..., help="epsilon_w of the one-time release"),
               delta: float = typer.Option(..., help="delta_w of the one-time release (below 1/P)"),
               out: Path = typer.Option(..., help="the released head (JSON): publishable"),
               again: bool = typer.Option(False, "--again", help="release a head that was released before (each "
                                                                   "release spends epsilon_w again; the new file "
                                                                   "states the composed total)")):
    """Release a certified head once with differential privacy: w~ = w + N(0, sigma^2 I).

    sigma is the analytic Gaussian scale for the certificate's L2 sensitivity Delta_r at (epsilon_w,
    delta_w), drawn from the secure generator. Every selection made with the released head (BoN, soft
    BoN, any n, any number of queries) is post-processing and costs nothing more; serve it with
    [mechanism] name = "released-bon" and the model budget is charged the release once. Each release
    is recorded beside the model (MODEL.releases.json); a second release of the same head is refused
    unless --again, and then its file states the composed total."""
    from ..rewards.policy_bt import PolicyBTReward

    _check_release_args(epsilon, delta)
    _out_file(out, "model")
    if out.expanduser().resolve() == model.expanduser().resolve():
        _fail(f"--out {out} is the model itself; the exact weights must stay with the operator")
    try:
        m = PolicyBTReward.load(model)
    except (ValueError, OSError, KeyError) as e:
        _fail(f"{model}: {e}")
    _release(m, epsilon, delta, out, model, again)


@rm_app.command("check-sensitivity")
def rm_check_sensitivity(model: Path = typer.Argument(..., help="a policy-bt model (JSON)"),
                         pool: Path = typer.Option(..., help="the train pool it was trained on"),
                         trials: int = typer.Option(24, help="retrainings (>= 20)"),
                         seed: int = typer.Option(0)):
    """Check a certified reward model's sensitivity on raw-data neighbours.

    Each neighbour edits one person's rows in the train pool (grades flipped, all correct, all wrong,
    removed, samples replaced by extreme ones, or another person's rows); every (person, edit) is
    ranked by the shift of the head it predicts, and the whole training procedure (split, pair choice,
    bounding, the choice of q, c, L, lambda, the final head) is rerun on the strongest --trials of
    them. Compares ||w_D - w_D'|| with the certified Delta_r (exit 1 if it is ever exceeded or the
    choice ever changes). The choice of settings reads only the validation rows, which no neighbour
    edits: it is computed once and reused when they are byte for byte the same (said in the output)."""
    from ..rewards.neighbours import check_sensitivity
    from ..rewards.policy_bt import PolicyBTReward

    try:
        m = PolicyBTReward.load(model)
    except (ValueError, OSError, KeyError) as e:
        _fail(f"{model}: {e}")
    p, raw = _train_pool(pool)
    try:
        with _progress() as bar:  # nothing is written before the end: a rerun starts over
            job = bar.add_task(f"retraining {model.name} on its neighbours", total=trials + 1)
            rows = check_sensitivity(m, raw, p.columns["prompt_id"], p.columns["true_reward"], trials, seed,
                                     progress=lambda done, total: bar.update(job, completed=done, total=total))
    except ValueError as e:
        _fail(str(e))
    worst_score = max(r["max_score_change"] for r in rows)
    worst_w = max(r["weight_change"] for r in rows)
    for kind in sorted({r["adversary"] for r in rows}):
        sub = [r for r in rows if r["adversary"] == kind]
        console.print(f"  {kind:<13} {len(sub):>3} retrainings: max |r_D - r_D'| = "
                      f"{max(r['max_score_change'] for r in sub):.4g}, max ||w_D - w_D'|| = "
                      f"{max(r['weight_change'] for r in sub):.4g}", markup=False)
    changed = sum(r["settings_changed"] for r in rows)
    console.print(f"{len(rows)} raw-data neighbours (one person's rows edited in the pool), each rerun through the "
                  f"whole procedure (the choice of settings computed once: it reads only the validation rows, "
                  f"which no neighbour edits): the chosen (q, c, lambda) changed in {changed}; "
                  f"max |r_D - r_D'| on the train samples {worst_score:.4g}, over all inputs "
                  f"(||w_D - w_D'||) {worst_w:.4g}; certified Delta_r {m.sensitivity:.4g} "
                  f"({worst_w / m.sensitivity:.1%} of it)", markup=False)
    if worst_w > m.sensitivity or worst_score > m.sensitivity or changed:
        console.print("[red]the certificate was exceeded[/red]")
        raise typer.Exit(1)
