"""Invalid input gets a 4xx with an OpenAI-shaped body naming the parameter; the server keeps
serving everyone else."""

import httpx
import pytest


@pytest.fixture(scope="module")
def server(guarded_server):
    # (--temperature 0: requests that leave temperature out are greedy, test_sampling_defaults)
    return guarded_server  # (shared with tests/test_hostile_requests.py)


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    (COMP, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (COMP, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    (COMP, {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    (COMP, {"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    (COMP, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (COMP, {"prompt": "hi", "n": 0}, 400, "n"),
    (COMP, {"prompt": 42}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (COMP, {"prompt": [1, "a"]}, 400, "prompt"),
    (COMP, {"prompt": [1, -5]}, 400, "prompt"),
    (COMP, {"prompt": [10**9]}, 400, "prompt"),
    (COMP, {"max_tokens": 5}, 400, "prompt"),
    (COMP, {"prompt": "word " * 400}, 400, "prompt"),
    (COMP, {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens"),
    (COMP, {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": MSG, "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": MSG, "max_tokens": -3}, 400, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "x " * 300}]}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", CASES)
def test_bad_request_names_the_parameter(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    # ...and a good request right after is served.
    ok = httpx.post(server.url + COMP, json={"prompt": "hi", "max_tokens": 3, "temperature": 0},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe\x00", b'{"prompt": "a"'])
def test_malformed_bodies(server, raw):
    r = httpx.post(server.url + COMP, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + COMP)
    assert r.status_code == 405 and "error" in r.json()


def test_models_and_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 256


def test_token_id_prompt_and_prompt_lists(server):
    r = httpx.post(server.url + COMP, json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2,
                                            "temperature": 0}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def test_sampling_defaults_apply_where_a_request_leaves_the_value_out(server):
    def text(**sampling):
        body = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, **sampling}
        r = httpx.post(server.url + COMP, json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    greedy = text(temperature=0)
    # --temperature 0 makes them greedy whatever their seed...
    assert text(seed=1) == text(seed=2) == greedy
    # ...and a request's own temperature still wins.
    assert any(text(temperature=1.0, seed=seed) != greedy for seed in range(3))
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                       "store": False}, timeout=30)
    assert r.status_code == 200 and r.json()["temperature"] == 0.0
