"""OpenAI request parameters: honoured (stop, max_completion_tokens, user, best_of) or refused with a
400 that names them before anything is charged; against a real ``privalign serve`` on loopback with
the stock openai client."""

import openai
import pytest
from openai import OpenAI

from .test_server import ADMIN, CLIENT, STUB, Server, call


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("params"), STUB.format(total=50.0))
    srv.start()
    yield srv
    srv.stop()


def _spent(srv):
    b = call(srv.url, "/v1/budgets/acme-rm")[1]
    return b["queries"], b["epsilon_spent"], b["open_reservations"]


HI = [{"role": "user", "content": "Hi"}]
PRIVBON = {"privalign": {"mechanism": "privbon", "n": 4, "epsilon": 0.5}}


@pytest.mark.parametrize("endpoint, kwargs, named", [
    ("chat", {"seed": 7}, "seed"),
    ("chat", {"top_p": 0.5}, "top_p"),
    ("chat", {"presence_penalty": 0.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": 1.0}, "frequency_penalty"),
    ("chat", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("chat", {"max_completion_tokens": 100}, "max_completion_tokens"),  # over the cap of 8
    ("chat", {"extra_body": {"colour": "red"}}, "colour"),               # an unknown top-level field
    ("chat", {"extra_body": {"privalign": "yes"}}, "privalign"),         # was a 500
    ("chat", {"extra_body": {"privalign": 5}}, "privalign"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {"messages": [{"role": "bogus", "content": "Hi"}]}, "messages[0].role"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"best_of": 33}, "best_of"),                         # over max_n
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"seed": 1}, "seed"),
])
def test_a_refused_parameter_is_a_400_naming_it_and_charges_nothing(server, endpoint, kwargs, named):
    client = OpenAI(base_url=server.url + "/v1", api_key=CLIENT, max_retries=0)
    before = _spent(server)
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(**{"model": "stub", "messages": HI, **kwargs})
        else:
            client.completions.create(**{"model": "stub", "prompt": "Hi", **kwargs})
    err = e.value.body
    assert err["param"] == named and err["message"].startswith(named + ":"), err
    assert _spent(server) == before  # nothing reserved, nothing charged


def test_defaults_that_ask_for_nothing_are_accepted(server):
    client = OpenAI(base_url=server.url + "/v1", api_key=CLIENT)
    r = client.chat.completions.create(model="stub", messages=HI, top_p=1, presence_penalty=0, frequency_penalty=0,
                                       logprobs=False, extra_body=PRIVBON)
    assert r.choices[0].message.content.startswith("candidate")


def test_stop_cuts_every_candidate_before_it_is_scored(server):
    client = OpenAI(base_url=server.url + "/v1", api_key=CLIENT)
    r = client.chat.completions.create(model="stub", messages=HI, stop=[" "], extra_body=PRIVBON)
    assert r.choices[0].message.content == "candidate" and r.choices[0].finish_reason == "stop"
    c = client.completions.create(model="stub", prompt="Hi", stop="date", extra_body=PRIVBON)
    assert c.choices[0].text == "candi"


def test_max_completion_tokens_caps_every_candidate(server):
    client = OpenAI(base_url=server.url + "/v1", api_key=CLIENT)
    r = client.chat.completions.create(model="stub", messages=HI, max_completion_tokens=2, extra_body=PRIVBON)
    # the stub's candidates are 3 tokens: at 2 each of the 4 is cut
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4 * 2
    r = client.chat.completions.create(model="stub", messages=HI, max_completion_tokens=8, extra_body=PRIVBON)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4 * 3


def test_best_of_is_the_number_of_candidates_and_user_is_logged(server):
    client = OpenAI(base_url=server.url + "/v1", api_key=CLIENT)
    c = client.completions.create(model="stub", prompt="Hi", best_of=5, user="alice-42",
                                  extra_body={"privalign": {"mechanism": "privbon", "epsilon": 0.5}})
    assert c.model_extra["privalign"]["n"] == 5 and c.model_extra["privalign"]["candidates_generated"] == 5
    with pytest.raises(openai.BadRequestError, match="best_of"):  # two different counts: refused
        client.completions.create(model="stub", prompt="Hi", best_of=5, extra_body={"privalign": {"n": 6}})
    assert "user=alice-42" in server.log_path.read_text()
