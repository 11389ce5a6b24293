"""Build response pools with real models: ``generate`` (sample and grade) and ``score`` (add rewards).

``generate`` writes in shards (one Parquet file per ``shard_size`` prompts, each written atomically
into ``<out>.shards/``) and resumes after an interruption: shards already on disk are kept and
their prompts skipped. Each prompt's samples are seeded from (seed, prompt index), so a resumed
run produces what an uninterrupted one would have. When every prompt is done, the shards are merged
into ``out``.

``features=True`` (the transformers backend) also records each sample's policy features, the
generating model's own hidden states read off the sampling pass, in ``<out>.features.npz``
(``features``, ``prompt_id``, ``sample_id``, row-aligned with the pool): the input of the certified
``policy-bt`` reward model. The file is a local cache, not shipped with a pool.
"""

from __future__ import annotations

import inspect
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .backends.base import Generator
from .pools import HEAD_FEATURES_PREFIX, REWARD_PREFIX, Pool, load_pool
from .rewards import RewardModel, reward_from_spec, score_checked
from .tasks import Task

Progress = Callable[[dict], None]


def load_reward(spec: str, **options) -> RewardModel:
    """A reward model from its spec (``rewards.reward_from_spec``: ``minilm-bt:PATH``,
    ``policy-bt:PATH``, ``hf:PATH_OR_ID``, ``vllm:URL``, ``http:URL``, with ``dtype``,
    ``trust_remote_code``, ``batch_size``), a policy-bt head scoring texts through its base model
    loaded by ``backends.load_policy`` on first use."""
    from .backends import load_policy

    return reward_from_spec(spec, policy_loader=load_policy, **options)


def _prompt_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0] % (2**63))


def _shard_path(shards: Path, k: int) -> Path:
    return shards / f"shard-{k:05d}.parquet"


def generate_pool(task: Task, problems, generator: Generator, out: str | Path, *, samples: int,
                  temperature: float = 1.0, max_new_tokens: int | None = None, seed: int = 0,
                  shard_size: int = 10, split: str = "test", progress: Progress | None = None,
                  keep_text: bool = True, features: bool = False) -> Pool:
    out = Path(out)
    if features and "features" not in inspect.signature(generator.generate).parameters:
        raise ValueError(f"the {generator.name!r} backend cannot record policy features; use the transformers backend")
    shards = out.with_name(out.name + ".shards")
    shards.mkdir(parents=True, exist_ok=True)
    max_new = max_new_tokens or task.max_new_tokens
    n_shards = (len(problems) + shard_size - 1) // shard_size
    done_prompts = sum(min(shard_size, len(problems) - k * shard_size)
                       for k in range(n_shards) if _shard_path(shards, k).exists())
    stats = {"prompts_done": done_prompts, "prompts": len(problems), "samples": 0, "tokens": 0,
             "gen_seconds": 0.0, "start": time.time()}
    if progress:
        progress(stats)
    for k in range(n_shards):
        path = _shard_path(shards, k)
        if not path.exists():
            _write_shard(path, task, problems[k * shard_size:(k + 1) * shard_size], k * shard_size, generator,
                         samples, max_new, temperature, seed, features, stats, progress)
    meta = {"task": task.name, "split": split, "base_model": generator.name, "reward_models": ["logprob"],
            "default_reward": "logprob", "true_reward_source": "grader",
            "sampling": {"samples": samples, "temperature": temperature, "max_new_tokens": max_new, "seed": seed,
                         **({"sampler": generator.sampler} if getattr(generator, "sampler", None) else {}),
                         "prompting": "chat template; " + ("few-shot" if problems and any(
                             m["role"] == "assistant" for m in task.messages(problems[0])) else "zero-shot")},
            **({"policy_features": features_path(out).name} if features else {})}
    pool = merge_shards(shards, meta)
    if features:
        parts = [load_features(features_path(p)) for p in sorted(shards.glob("shard-*.parquet"))]
        save_features(features_path(out), np.concatenate([f for f, _, _ in parts]),
                      np.concatenate([i for _, i, _ in parts]), np.concatenate([j for _, _, j in parts]))
    if not keep_text:
        for c in ("prompt", "response"):
            pool.columns.pop(c, None)
    pool.save(out)
    shutil.rmtree(shards)
    return pool


def _write_shard(path: Path, task: Task, chunk, first: int, generator: Generator, samples: int, max_new: int,
                 temperature: float, seed: int, features: bool, stats: dict, progress: Progress | None) -> None:
    """Sample and grade ``samples`` responses to each problem of ``chunk`` (problem ``first + i``
    seeded from (seed, first + i)), and write them as one shard (its features beside it)."""
    rows: dict[str, list] = {c: [] for c in ("prompt_id", "sample_id", "prompt", "response", "answer",
                                             "true_reward", "logprob", "n_tokens", "reward:logprob")}
    feats: list = []
    for i, p in enumerate(chunk, start=first):
        t0 = time.perf_counter()
        gens = generator.generate(task.messages(p), samples, max_new_tokens=max_new, temperature=temperature,
                                  seed=_prompt_seed(seed, i), **({"features": True} if features else {}))
        stats["gen_seconds"] += time.perf_counter() - t0
        for j, g in enumerate(gens):
            rows["prompt_id"].append(p.id)
            rows["sample_id"].append(j)
            rows["prompt"].append(p.question)
            rows["response"].append(g.text)
            rows["answer"].append(task.extract(g.text))
            rows["true_reward"].append(task.grade(g.text, p))
            rows["logprob"].append(g.logprob)
            rows["n_tokens"].append(g.n_tokens)
            # mean token log-probability: the base model's own confidence, a reward-free proxy
            rows["reward:logprob"].append(g.logprob / max(g.n_tokens, 1) if g.logprob is not None else None)
            stats["tokens"] += g.n_tokens
            if features:
                feats.append(g.features)
        stats["samples"] += len(gens)
        stats["prompts_done"] += 1
        if progress:
            progress(stats)
    cols = {c: np.array(v, dtype=object if c in ("prompt_id", "prompt", "response", "answer") else None)
            for c, v in rows.items()}
    if features:
        save_features(features_path(path), np.stack(feats), cols["prompt_id"], cols["sample_id"])
    Pool(cols, {}).save(path)  # atomic: temporary file, then rename (after its features)


def features_path(pool_path: str | Path) -> Path:
    """Where a pool's policy features live: ``<pool>.features.npz`` beside it."""
    p = Path(pool_path)
    return p.with_name(p.name + ".features.npz")


def save_features(path: Path, features: np.ndarray, prompt_id, sample_id) -> None:
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(tmp, features=np.asarray(features, np.float32), prompt_id=np.asarray(prompt_id, str),
             sample_id=np.asarray(sample_id, np.int64))
    tmp.replace(path)


def load_features(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with np.load(path) as z:
        return z["features"], z["prompt_id"], z["sample_id"]


def pool_features(pool: Pool, pool_path: str | Path) -> np.ndarray | None:
    """The recorded features of a pool's rows, in the pool's row order, or None if there are none.
    Rows are matched on (prompt_id, sample_id); a pool with rows the file lacks gets None."""
    path = features_path(pool_path)
    if not path.exists():
        return None
    f, pid, sid = load_features(path)
    index = {(str(a), int(b)): k for k, (a, b) in enumerate(zip(pid, sid))}
    try:
        rows = [index[(str(a), int(b))] for a, b in zip(pool.columns["prompt_id"], pool.columns["sample_id"])]
    except KeyError:
        return None
    return f[rows]


def merge_shards(shards: Path, metadata: dict) -> Pool:
    parts = [load_pool(p, validate=False) for p in sorted(shards.glob("shard-*.parquet"))]
    cols = {c: np.concatenate([p.columns[c] for p in parts]) for c in parts[0].columns}
    return Pool(cols, metadata).validate()


def featurize_pool(path: str | Path, generator, progress: Callable[[int, int], None] | None = None) -> Path:
    """Teacher-force a pool's responses through its policy and save the features beside it
    (``<pool>.features.npz``), as ``generate --features`` would have recorded them: a response with
    ``n_tokens`` at the pool's ``max_new_tokens`` was cut, not closed by a sampled EOS. A prompt's
    samples that repeat a text (and whether it was closed) are computed once."""
    from .tasks import Problem, get_task

    pool = load_pool(path)
    task = get_task(pool.metadata["task"])
    cap = pool.metadata.get("sampling", {}).get("max_new_tokens")
    pid = np.asarray(pool.columns["prompt_id"], str)
    out = np.empty((pid.size, 0), np.float32)
    done = 0
    for p in dict.fromkeys(pid.tolist()):
        rows = np.flatnonzero(pid == p)
        prompt = str(pool.columns["prompt"][rows[0]])
        responses = ["" if pool.columns["response"][i] is None else str(pool.columns["response"][i]) for i in rows]
        closed = [True] * rows.size if cap is None else [int(pool.columns["n_tokens"][i]) < int(cap) for i in rows]
        distinct = list(dict.fromkeys(zip(responses, closed)))
        raw = generator.featurize(task.messages(Problem(id=p, question=prompt, reference="")),
                                  [r for r, _ in distinct], closed=None if cap is None else [c for _, c in distinct])
        if out.shape[1] == 0:
            out = np.zeros((pid.size, raw.shape[1]), np.float32)
        at = {key: j for j, key in enumerate(distinct)}
        out[rows] = raw[[at[key] for key in zip(responses, closed)]]
        done += rows.size
        if progress:
            progress(done, pid.size)
    target = features_path(path)
    save_features(target, out, pid, pool.columns["sample_id"])
    pool.metadata["policy_features"] = target.name
    pool.save(path)
    return target


def pool_head_phi(head, pool: Pool, pool_path: str | Path) -> np.ndarray:
    """A head's feature coordinates on a pool's rows: its feature map of the pool's recorded policy
    features (``privalign featurize``), or else the coordinates the pool carries for this very head
    (``privalign score --head-features``, as the shipped pools do for their person heads; for a
    released head, those of the exact head it was drawn from). A one-line ValueError when neither."""
    from .rewards.release import head_phi

    if not getattr(head, "reads_policy_features", True):
        raise ValueError(f"head {head.name!r} reads sentence embeddings, not a pool's policy features: BoN on "
                         f"{pool_path} needs a head on its policy's features")
    raw = pool_features(pool, pool_path)
    if raw is not None:
        return head_phi(head, raw)
    release = getattr(head, "release", None)
    name, head_id = ((release["source_name"], release["head_id"]) if release is not None
                     else (head.name, head.meta.get("head_id")))
    stored = pool.head_features(name)
    recorded = (pool.metadata.get("head_features") or {}).get(name, {})
    if stored is None or recorded.get("head_id") != head_id:
        raise ValueError(f"{pool_path} has neither recorded policy features ({features_path(pool_path)}: run "
                         f"privalign featurize {pool_path}) nor the feature coordinates of head {name!r} "
                         "(privalign score --head-features)")
    return head_phi(head, None, stored)


class _RecordedFeatures(RewardModel):
    """A features-based reward model applied to features recorded with the pool."""

    def __init__(self, model, raw):
        self.model, self.raw = model, raw
        self.name, self.output_range = model.name, model.output_range

    def score(self, prompts, responses):
        return self.model.score_features(self.raw)


def _record_head_features(pool: Pool, model: RewardModel, raw: np.ndarray | None) -> None:
    """``score_pool(head_features=True)`` for one model: phi:<name>:<j> columns, or a ValueError."""
    if getattr(model, "released", False) or not hasattr(model, "feature_map") or "head_id" not in getattr(
            model, "meta", {}):
        raise ValueError(f"--head-features needs a certified policy-bt head with exact weights and a head_id; "
                         f"{model.name!r} is not one")
    if raw is None:
        raise ValueError(f"--head-features needs the pool's recorded features (privalign featurize) for {model.name!r}")
    phi = np.asarray(model.feature_map(raw), np.float32)
    for c in [c for c in pool.columns if c.startswith(f"{HEAD_FEATURES_PREFIX}{model.name}:")]:
        del pool.columns[c]
    for j in range(phi.shape[1]):
        pool.columns[f"{HEAD_FEATURES_PREFIX}{model.name}:{j}"] = phi[:, j]
    pool.metadata.setdefault("head_features", {})[model.name] = {"head_id": model.meta["head_id"],
                                                                 "dim": int(phi.shape[1])}


def score_pool(path: str | Path, models: list[RewardModel], batch_size: int = 256,
               progress: Callable[[int, int], None] | None = None, head_features: bool = False) -> Pool:
    """Add one ``reward:<name>`` column per model (needs the ``prompt`` and ``response`` columns).

    With ``head_features``, a certified policy-bt head (exact weights and a ``head_id``) also leaves
    its feature coordinates phi = feature_map(raw) as float32 columns ``phi:<name>:<j>``
    (``Pool.head_features``), so that its release can be studied without the raw features (a few
    hundred kB for a 19,200-row pool where the raw features take hundreds of MB)."""
    pool = load_pool(path)
    for c in ("prompt", "response"):
        if c not in pool.columns:
            raise ValueError(f"scoring needs the pool's {c!r} column (generate with texts kept)")
    prompts = [str(x) for x in pool.columns["prompt"]]
    responses = ["" if x is None else str(x) for x in pool.columns["response"]]
    total = len(models) * len(prompts)
    done = 0
    clipped = dict(pool.metadata.get("clipped", {}))
    raw = None
    for model in models:
        scores, n_clip = [], 0
        own = getattr(model, "reads_policy_features", False)  # a head on the policy's features
        if own and raw is None:
            raw = pool_features(pool, path)  # recorded while sampling: no second pass through the policy
        for i in range(0, len(prompts), batch_size):
            if own and raw is not None:
                s = score_checked(_RecordedFeatures(model, raw[i:i + batch_size]), prompts[i:i + batch_size],
                                  responses[i:i + batch_size])
            else:
                s = score_checked(model, prompts[i:i + batch_size], responses[i:i + batch_size])
            scores.append(s.scores)
            n_clip += s.n_clipped
            done += len(s.scores)
            if progress:
                progress(done, total)
        pool.columns[REWARD_PREFIX + model.name] = np.concatenate(scores)
        clipped[model.name] = n_clip
        if head_features:
            _record_head_features(pool, model, raw)
        rms = list(pool.metadata.get("reward_models", []))
        if model.name not in rms:
            rms.append(model.name)
        pool.metadata["reward_models"] = rms
        if model.sensitivity is not None:  # a certified reward model becomes the pool's default
            pool.metadata["default_reward"] = model.name
        pool.metadata.setdefault("reward_model_info", {})[model.name] = {
            "output_range": list(model.output_range), "sensitivity": model.sensitivity,
            **({"certificate": {**model.certificate(), **getattr(model, "meta", {}),
                                "hyperparameters": model.hyperparameters()}} if hasattr(model, "certificate")
               else {"certificate": model.meta} if getattr(model, "meta", None) else {})}
    pool.metadata["clipped"] = clipped
    pool.save(path)
    return pool
