"""OpenAI's logprobs / top_logprobs: the returned answer's per-token log-probabilities under the policy,
through a real ``privalign serve`` with the embedded SmolLM2 on loopback and the stock openai client
(issue 30). The policy does not read the private data, so they cost nothing beyond the query."""

import json
import math

import pytest
from openai import OpenAI

from .test_server import CLIENT, Server, call

pytest.importorskip("torch")

CONFIG = f"""
max_n = 8
[clients.{CLIENT}]
tenant = "acme"
[generator]
backend = "transformers"
model = "smollm2"
max_new_tokens = 6
[reward]
kind = "stub"
output_range = [0.0, 1.0]
sensitivity = 0.1
[mechanism]
name = "privbon"
n = 4
epsilon = 0.5
[[budgets]]
name = "acme-rm"
tenant = "acme"
epsilon_total = 20.0
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("logprobs"), CONFIG)
    srv.start(timeout=300)
    yield srv
    srv.stop()


def _reference(messages, text, top):
    """The same log-probabilities from the model's own forward pass, in this process."""
    from privalign.backends.transformers_backend import TransformersGenerator

    return TransformersGenerator("smollm2").token_logprobs(messages, text, top=top)


MSGS = [{"role": "user", "content": "Name a colour."}]


def _joined(tokens) -> str:
    """The text of OpenAI-style tokens, ``bytes:\\xNN`` ones (a split character) read as their bytes."""
    raw = b""
    for t in tokens:
        raw += bytes(int(h, 16) for h in t[6:].split("\\x")[1:]) if t.startswith("bytes:") else t.encode("utf-8")
    return raw.decode("utf-8")


def test_a_character_split_across_tokens_keeps_its_bytes():
    """An emoji is three byte-level tokens: each carries its own bytes, spelled bytes:\\xNN, and
    together they are the character; offsets count characters of the answer."""
    from privalign.backends.transformers_backend import TransformersGenerator
    from privalign.server.replies import render_logprobs

    entries = TransformersGenerator("smollm2").token_logprobs(MSGS, "🌱 red", top=2)
    assert entries[0]["token"].startswith("bytes:\\x") and _joined([e["token"] for e in entries]) == "🌱 red"
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8") == "🌱 red"
    legacy = render_logprobs(entries, "text_completion", 0)
    assert legacy["text_offset"][-1] == 1 and legacy["tokens"][-1] == " red"


def test_chat_logprobs_are_the_policys_own_and_cost_only_the_query(server):
    client = OpenAI(base_url=server.url + "/v1", api_key=CLIENT)
    before = call(server.url, "/v1/budgets/acme-rm")[1]["epsilon_spent"]
    r = client.chat.completions.create(model="smollm2", messages=MSGS, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert content and "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        alts = [a.logprob for a in t.top_logprobs]
        assert alts == sorted(alts, reverse=True) and alts[0] >= t.logprob - 1e-9
        if not t.token.startswith("bytes:"):  # else part of a character the next tokens complete (OpenAI's spelling)
            assert bytes(t.bytes).decode("utf-8") == t.token
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8") == choice.message.content
    ref = _reference(MSGS, choice.message.content, 3)
    assert [e["token"] for e in ref] == [t.token for t in content]
    assert max(abs(e["logprob"] - t.logprob) for e, t in zip(ref, content)) < 1e-4
    spent = call(server.url, "/v1/budgets/acme-rm")[1]["epsilon_spent"]
    assert math.isclose(spent - before, r.model_extra["privalign"]["epsilon_charged"], rel_tol=1e-9)


def test_completions_logprobs_and_a_streamed_answer_token_by_token(server):
    client = OpenAI(base_url=server.url + "/v1", api_key=CLIENT)
    r = client.completions.create(model="smollm2", prompt="Name a colour.", logprobs=2)
    lp = r.choices[0].logprobs
    assert _joined(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert all(v <= 0 for v in lp.token_logprobs)
    chunks = list(client.chat.completions.create(model="smollm2", messages=MSGS, logprobs=True, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(pieces) == "".join(e.token for e in entries) and entries


def test_bad_logprobs_values_are_400s_naming_them(server):
    for body, named in (({"logprobs": "yes"}, "logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"top_logprobs": 2}, "top_logprobs")):
        status, err = call(server.url, "/v1/chat/completions", {"messages": MSGS, **body})
        assert status == 400 and err["error"]["param"] == named, err
    status, err = call(server.url, "/v1/completions", {"prompt": "Hi", "logprobs": 6})
    assert status == 400 and err["error"]["param"] == "logprobs"
