"""`loom serve` as a subprocess, driven by the official openai client, stopped cleanly."""

import openai
import pytest

from tests.helpers import pid_alive, start_server


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completions(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text


def test_chat(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_seeded_sampling_repeats(client):
    kw = dict(model="tiny", prompt="Once", max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 99}).choices[0].text
    assert a == b and a != c


def test_errors_raise_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=1)
    assert exc.value.body["param"] == "messages"


def test_models(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_stop_leaves_no_child_process(tiny_model_dir):
    srv = start_server(tiny_model_dir)
    assert len(srv.children) >= 2
    assert all(pid_alive(p) for p in srv.children)
    assert srv.stop() == 0
    assert not any(pid_alive(p) for p in srv.children)
