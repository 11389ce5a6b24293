"""llama.cpp backend on the embedded GGUF (slow: the wheel compiles; ``make test-all`` installs it)."""

import pytest

pytestmark = pytest.mark.slow


def test_llamacpp_generates_seeded_samples_from_the_embedded_gguf():
    pytest.importorskip("llama_cpp")
    from privalign.backends.llamacpp_backend import LlamaCppGenerator
    from privalign.tasks import get_task

    gen = LlamaCppGenerator("smollm2")
    task = get_task("arithmetic")
    p = task.load("test", 1)[0]
    a = gen.generate(task.messages(p), 4, max_new_tokens=6, seed=11)
    b = gen.generate(task.messages(p), 4, max_new_tokens=6, seed=11)
    assert [g.text for g in a] == [g.text for g in b]
    assert all(g.n_tokens >= 1 for g in a)
    assert any(g.logprob is not None and g.logprob < 0 for g in a)
