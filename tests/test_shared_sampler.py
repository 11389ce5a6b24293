"""The shared-prefix sampler (issue 20) on the embedded SmolLM2: its forward pass is the model's,
its samples follow the model's law, and the features it records are the teacher-forced ones."""

import numpy as np
import pytest
from scipy import stats

from privalign.tasks import get_task

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def shared(smollm2):
    from privalign.backends.shared_prefix import SharedPrefixDecoder
    from privalign.backends.transformers_backend import TransformersGenerator

    gen = TransformersGenerator.__new__(TransformersGenerator)  # the session's model, the other sampler
    gen.__dict__.update(smollm2.__dict__)
    gen.sampler, gen.batch_size = "shared", 256
    gen._shared = SharedPrefixDecoder(smollm2.model, 256)
    return gen


def _prompt(name="counting", i=0):
    t = get_task(name)
    return t, t.load("test", i + 1)[i]


def test_its_logits_are_the_models_own_forward_pass(smollm2):
    from privalign.backends.shared_prefix import check_logits, supports

    assert supports(smollm2.model)
    t, p = _prompt("arithmetic-mix", 3)
    ids = smollm2._prompt_ids(t.messages(p))[0]
    continuation = smollm2.tokenizer.encode("12 is the answer", add_special_tokens=False)
    assert check_logits(smollm2.model, ids, continuation) < 1e-3  # float32 round-off; logits are O(10)


def test_first_token_follows_the_models_softmax(shared, smollm2):
    """Chi-square goodness of fit of 4,000 first tokens against the exact next-token law."""
    import torch

    t, p = _prompt()
    n = 4000
    gens = shared.generate(t.messages(p), n, max_new_tokens=1, seed=7)
    first = [smollm2.tokenizer.encode(g.text, add_special_tokens=False)[:1] or [smollm2.tokenizer.eos_token_id]
             for g in gens]
    ids = smollm2._prompt_ids(t.messages(p))
    with torch.no_grad():
        prob = torch.softmax(smollm2.model(ids).logits[0, -1].double(), -1).numpy()
    # bins: every token expected >= 5 times, the rest pooled; tokens re-encoded from text can merge,
    # so compare on the sampled logprob instead where that happens: every recorded logprob is exact
    assert all(abs(g.logprob - np.log(prob[f[0]])) < 1e-4 for g, f in zip(gens[:200], first[:200]) if g.text)
    big = np.flatnonzero(prob * n >= 5)
    counts = np.bincount([f[0] for f in first], minlength=prob.size)
    obs = np.append(counts[big], n - counts[big].sum())
    exp = np.append(prob[big] * n, n * (1 - prob[big].sum()))
    keep = exp > 0
    assert stats.chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue > 1e-3


def test_whole_answers_have_the_law_of_one_at_a_time_sampling(shared, smollm2):
    """Two-sample chi-square: 2,048 answers from the shared sampler against 300 decoded one at a
    time (the loop sampler with one row per batch: each sample alone through the model's forward)."""
    from privalign.backends.transformers_backend import TransformersGenerator

    t, p = _prompt()
    batched = [g.text for g in shared.generate(t.messages(p), 2048, max_new_tokens=t.max_new_tokens, seed=11)]
    alone = TransformersGenerator.__new__(TransformersGenerator)
    alone.__dict__.update(smollm2.__dict__)
    alone.batch_size = 1
    single = [g.text for g in alone.generate(t.messages(p), 300, max_new_tokens=t.max_new_tokens, seed=1000)]
    cats = [c for c in set(batched) if batched.count(c) / len(batched) * len(single) >= 5]
    assert len(cats) >= 2  # the test has something to compare
    table = np.array([[sum(x == c for x in s) for c in cats] + [sum(x not in cats for x in s)]
                      for s in (batched, single)])
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > 1e-3
    # and the grader sees the same accuracy within binomial noise (4 standard errors)
    a, b = (np.mean([t.grade(x, p) for x in s]) for s in (batched, single))
    se = np.sqrt(a * (1 - a) / len(single) + a * (1 - a) / len(batched))
    assert abs(a - b) <= 4 * se + 1e-9


def test_features_recorded_in_the_batched_pass_equal_teacher_forced_ones(shared, smollm2):
    t, p = _prompt("arithmetic-mix", 1)
    gens = shared.generate(t.messages(p), 300, max_new_tokens=t.max_new_tokens, seed=3, features=True)
    cap = t.max_new_tokens
    forced = smollm2.featurize(t.messages(p), [g.text for g in gens], closed=[g.n_tokens < cap for g in gens])
    recorded = np.stack([g.features for g in gens])
    # a text that does not re-tokenize to the sampled tokens cannot be teacher-forced the same way
    eos = smollm2.tokenizer.eos_token_id
    same = np.array([len(smollm2.tokenizer.encode(g.text, add_special_tokens=False)) + (g.n_tokens < cap)
                     == g.n_tokens for g in gens]) & np.array([eos not in smollm2.tokenizer.encode(
                         g.text, add_special_tokens=False) for g in gens])
    assert same.mean() > 0.8 and (~np.array([g.n_tokens < cap for g in gens])).any()  # cut rows are covered
    assert np.abs(forced[same] - recorded[same]).max() < 1e-3


def test_shared_sampler_is_seeded_and_refuses_bad_arguments(shared):
    t, p = _prompt()
    a = [g.text for g in shared.generate(t.messages(p), 40, max_new_tokens=4, seed=5)]
    assert a == [g.text for g in shared.generate(t.messages(p), 40, max_new_tokens=4, seed=5)]
    with pytest.raises(ValueError, match="k must be"):
        shared.generate(t.messages(p), 0, max_new_tokens=4, seed=5)
    with pytest.raises(ValueError, match="temperature"):
        shared.generate(t.messages(p), 2, max_new_tokens=4, temperature=0.0, seed=5)
    from privalign.backends.transformers_backend import TransformersGenerator

    with pytest.raises(ValueError, match="sampler must be"):
        TransformersGenerator.__init__(TransformersGenerator.__new__(TransformersGenerator), "smollm2",
                                       sampler="fast")
