"""Commands that run real models: ``generate`` (sample and grade a pool), ``score`` (add reward
columns), ``featurize`` (record the policy's features)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import typer

from ._app import app
from ._common import _fail, _load, _one_writer, _out_file, _progress, console


def _check_dtype(dtype: Optional[str]) -> None:
    """A one-line error for an unknown --dtype, or one this machine's device cannot run, before any
    model is loaded."""
    from ..devices import DTYPES, resolve_device, resolve_dtype

    if dtype is None:
        return
    if dtype not in DTYPES:
        _fail(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        resolve_dtype(dtype, resolve_device(None))
    except ValueError as e:
        _fail(f"--dtype: {e}")


def _generator(model: str, backend: str, base_url: Optional[str], **options):
    from ..backends import make_generator

    try:
        return make_generator(backend, model, base_url, **options)
    except ValueError as e:
        _fail(str(e))


@app.command()
def generate(task: str = typer.Option(..., help="gsm8k, math500, mmlu[:subject], mmlu-letters, "
                                                 "arithmetic, arithmetic-mix, addition or counting"),
             split: str = typer.Option("test"),
             limit: Optional[int] = typer.Option(None, help="first N problems"),
             samples: int = typer.Option(64, help="responses per prompt"),
             model: str = typer.Option("smollm2", help="'smollm2' (embedded), a path, a .gguf file or a Hub id"),
             backend: str = typer.Option("transformers", help="transformers, llamacpp, vllm or openai"),
             base_url: Optional[str] = typer.Option(None, help="openai backend: server URL"),
             temperature: float = typer.Option(1.0),
             max_new_tokens: Optional[int] = typer.Option(None, help="default: the task's"),
             seed: int = typer.Option(0),
             shard_size: int = typer.Option(10, help="prompts per shard (the unit of resumption)"),
             data_dir: Optional[str] = typer.Option(None, help="datasets folder (default: ../shared/data)"),
             features: bool = typer.Option(False, "--features", help="also record policy features (OUT.features.npz) for policy-bt"),
             threads: Optional[int] = typer.Option(None, help="torch threads (transformers backend)"),
             sampler: str = typer.Option("loop", help="transformers backend: 'loop' (built the 64-sample pools) or "
                                                      "'shared' (one copy of the prompt's cache for all samples: "
                                                      "several times faster for hundreds of short samples)"),
             batch_size: Optional[int] = typer.Option(None, help="transformers backend: rows decoded together "
                                                                 "(default on the CPU 64 for loop, 1024 for "
                                                                 "shared; on a GPU what its memory holds)"),
             dtype: Optional[str] = typer.Option(None, help="transformers backend: auto (the checkpoint's dtype "
                                                            "on a GPU, float32 on the CPU), bfloat16, float16 "
                                                            "or float32"),
             out: Path = typer.Option(..., help="output pool (Parquet)")):
    """Sample responses with a real model, grade them, and write a pool (sharded, resumable)."""
    from ..pipeline import generate_pool
    from ..tasks import get_task

    _out_file(out, "pool")
    try:
        t = get_task(task, data_dir)
        problems = t.load(split, limit)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if threads:
        import torch

        torch.set_num_threads(threads)
    if dtype is not None and backend != "transformers":
        _fail(f"--dtype applies to the transformers backend, not {backend!r}")
    _check_dtype(dtype)
    _one_writer(out)  # before the model loads: a second generate (or featurize) on this pool names this run's pid
    gen = _generator(model, backend, base_url, **({"sampler": sampler, "batch_size": batch_size, "dtype": dtype}
                                                  if backend == "transformers" else {}))
    resume = (f"interrupted: the finished shards are kept in {out}.shards; rerun the same command to resume "
              "(their prompts are skipped)")
    with _progress(on_interrupt=resume, info=True) as bar:
        job = bar.add_task("prompts", total=len(problems), info="")

        def show(st):
            rate = st["tokens"] / st["gen_seconds"] if st["gen_seconds"] else 0.0
            bar.update(job, completed=st["prompts_done"], info=f"{st['samples']} samples, {rate:.0f} tok/s")

        pool = generate_pool(t, problems, gen, out, samples=samples, temperature=temperature,
                             max_new_tokens=max_new_tokens, seed=seed, shard_size=shard_size, split=split,
                             progress=show, features=features)
    console.print(f"wrote {out}: {pool.n_rows} responses, mean accuracy {float(np.mean(pool.columns['true_reward'])):.3f}",
                  markup=False)


@app.command()
def score(pool: Path = typer.Argument(...),
          reward: list[str] = typer.Option(..., help="minilm-bt:PATH, policy-bt:PATH, hf:PATH_OR_ID, vllm:URL (a "
                                                     "vLLM server's classify API) or http:URL (repeatable)"),
          dtype: Optional[str] = typer.Option(None, help="policy-bt (its policy) and hf: auto (the checkpoint's "
                                                         "dtype on a GPU, float32 on the CPU), bfloat16, float16 "
                                                         "or float32"),
          trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                                 help="hf: run the checkpoint's own modelling code (ArmoRM, ...)"),
          batch_size: Optional[int] = typer.Option(None, help="hf: rows per forward pass (default: 16 on the CPU, "
                                                              "from free memory on a GPU); vllm: texts per request"),
          head_features: bool = typer.Option(False, "--head-features",
                                             help="policy-bt heads: also keep their feature coordinates phi "
                                                  "(phi:<name>:<j> columns), for the release study of reproduce")):
    """Score a pool's responses with reward models: adds one reward:<name> column each."""
    from ..backends.base import BackendError
    from ..pipeline import load_reward, score_pool

    _check_dtype(dtype)
    try:
        models = [load_reward(r, dtype=dtype, trust_remote_code=trust_remote_code, batch_size=batch_size)
                  for r in reward]
    except (ValueError, OSError, BackendError) as e:
        _fail(str(e))
    try:
        with _progress() as bar:
            job = bar.add_task("scoring", total=None)
            p = score_pool(pool, models, progress=lambda d, t: bar.update(job, completed=d, total=t),
                           head_features=head_features)
    except (ValueError, BackendError) as e:
        _fail(f"scoring {pool}: {e}")
    console.print(f"scored {pool}: rewards {p.reward_names}, clipped {p.metadata.get('clipped')}", markup=False)


@app.command()
def featurize(pool: Path = typer.Argument(..., help="a pool generated by a transformers model"),
              model: str = typer.Option("smollm2", help="the policy that generated the pool: 'smollm2', a path "
                                                        "or a Hub id"),
              dtype: Optional[str] = typer.Option(None, help="auto (the checkpoint's dtype on a GPU, float32 on "
                                                             "the CPU), bfloat16, float16 or float32; features "
                                                             "are float32 whatever it is")):
    """Record a pool's policy features by teacher forcing (POOL.features.npz), for policy-bt."""
    from ..backends.transformers_backend import TransformersGenerator
    from ..pipeline import featurize_pool

    _check_dtype(dtype)
    p = _load(pool)
    _one_writer(pool, option="featurize")
    name = model
    try:
        gen = TransformersGenerator(name, dtype=dtype)
    except (OSError, ValueError) as e:
        _fail(f"cannot load the policy {name!r}: {e}")
    with _progress() as bar:
        job = bar.add_task("featurizing", total=None)
        out = featurize_pool(pool, gen, progress=lambda d, t: bar.update(job, completed=d, total=t))
    console.print(f"wrote {out}: features of {p.n_rows} responses (teacher forcing through {name})", markup=False)
