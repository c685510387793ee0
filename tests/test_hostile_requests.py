"""Requests a public server gets on its first day: each is refused with a 400 naming the
parameter (or bounded), the server keeps serving, no traceback reaches the log, and /metrics
counts the refusals by reason."""

import re
import time

import httpx
import pytest

from tests.helpers import start_server

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = start_server(tiny_model_dir, "--max-model-len", "256", "--served-model-name", "tiny",
                       "--max-sequences-per-request", "64", "--max-queued-tokens", "2000")
    yield srv
    assert srv.stop() == 0
    assert "Traceback" not in srv.log()


def post(server, path, body, timeout=60):
    return httpx.post(server.url + path, json=body, timeout=timeout)


def assert_refused(r, param, code=None):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def assert_serving(server):
    ok = post(server, COMP, {"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


# ---- 1. client-sent chat templates and clashing template arguments -----------------------------
@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_a_request_cannot_send_its_own_chat_template(server, path):
    body = {"messages": MSG, "chat_template_kwargs": {"chat_template": "PWNED {{ 7*7 }}"}}
    r = post(server, path, body)
    assert_refused(r, "chat_template_kwargs.chat_template")
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    assert_serving(server)


@pytest.mark.parametrize("key,value", [("messages", []), ("tools", [{"type": "function"}]),
                                       ("add_generation_prompt", False), ("tokenize", True),
                                       ("conversation", [])])
def test_template_arguments_cannot_be_overridden(server, key, value):
    r = post(server, CHAT, {"messages": MSG, "chat_template_kwargs": {key: value}})
    assert_refused(r, f"chat_template_kwargs.{key}")


def test_template_variables_still_pass(server):
    # A variable the template does not use is harmless, and /tokenize renders like chat.
    body = {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}}
    assert post(server, "/tokenize", body).status_code == 200
    r = post(server, CHAT, {**body, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_trusted_request_templates_render_in_a_bounded_sandbox(tiny_model_dir):
    srv = start_server(tiny_model_dir, "--max-model-len", "256", "--trust-request-chat-template")
    try:
        ok = post(srv, "/tokenize", {"messages": MSG, "chat_template_kwargs": {
            "chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}{{ 7*7 }}"}})
        assert ok.status_code == 200, ok.text
        text = httpx.post(srv.url + "/detokenize", json={"tokens": ok.json()["tokens"]}).json()
        assert text["prompt"] == "[hi]49"
        huge = {"messages": MSG, "chat_template_kwargs": {"chat_template": "{{ 'x' * 10**10 }}"}}
        slow = {"messages": MSG, "chat_template_kwargs": {"chat_template":
                "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"}}
        for body in (huge, slow):
            r = post(srv, CHAT, {**body, "max_tokens": 2})
            assert_refused(r, "chat_template_kwargs.chat_template")
            assert httpx.get(srv.url + "/health").status_code == 200
        # A fresh sandbox serves the next one.
        again = post(srv, CHAT, {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {
            "chat_template": "{{ messages[0].content }}"}})
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["prompt_tokens"] == 1
    finally:
        assert srv.stop() == 0
    assert "Traceback" not in srv.log()


# ---- 2. one small request asking for thousands of sequences ------------------------------------
def test_sequences_per_request_are_capped_before_tokenizing(server):
    r = post(server, COMP, {"prompt": ["a"] * 2000, "n": 16, "max_tokens": 1})
    assert_refused(r, "n", "too_many_sequences")
    r = post(server, COMP, {"prompt": ["a"] * 65, "max_tokens": 1})
    assert_refused(r, "prompt", "too_many_sequences")
    r = post(server, CHAT, {"messages": MSG, "n": 65, "max_tokens": 1})
    assert_refused(r, "n", "too_many_sequences")
    r = post(server, COMP, {"prompt": ["a", "b"] * 16, "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 64


def test_one_request_may_not_exceed_the_queue_bounds_of_an_idle_server(server):
    # --max-queued-tokens 2000: 9 prompts of 240 tokens is more than the whole queue holds.
    r = post(server, COMP, {"prompt": [[5] * 240] * 9, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens", r.text
    assert_serving(server)


def test_many_aborts_cost_linear_time():
    import numpy as np

    from pipelines.context import TextContext
    from scheduler.block_manager import BlockManager
    from scheduler.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(), BlockManager(64, 16, True))
    ids = [f"r{i}" for i in range(20_000)]
    for rid in ids:
        sched.add_request(TextContext(request_id=rid, max_length=8, tokens=np.array([1, 2])))
    started = time.perf_counter()
    assert sched.abort(ids) == len(ids)
    # One scan per abort would be 2e8 steps (tens of seconds); one pass is milliseconds.
    assert time.perf_counter() - started < 2.0
    assert not sched.waiting and not sched.requests and not sched.timings


# ---- 3. stop strings -------------------------------------------------------------------------
def test_stop_strings_are_bounded(server):
    r = post(server, COMP, {"prompt": "hi", "stop": ["x"] * 17})
    assert_refused(r, "stop", "limit_exceeded")
    r = post(server, COMP, {"prompt": "hi", "stop": ["x" * 257]})
    assert_refused(r, "stop[0]", "limit_exceeded")
    r = post(server, COMP, {"prompt": "hi", "stop": "x" * 257})
    assert r.status_code == 400
    r = post(server, COMP, {"prompt": "hi", "stop_token_ids": [1] * 257})
    assert_refused(r, "stop_token_ids", "limit_exceeded")
    r = post(server, COMP, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}})
    assert_refused(r, "logit_bias", "limit_exceeded")
    longest = {"prompt": "hi", "max_tokens": 4, "stop": ["y" * 256] * 16}
    assert post(server, COMP, longest).status_code == 200


def test_stop_strings_stay_in_the_api_process(tiny_model_dir):
    import numpy as np

    from api_server.engine_client import _without_stop_strings
    from api_server.openai_routes import OpenAIRoutes
    from api_server.protocol import CompletionRequest
    from pipelines import TextContext
    from serialization.codec import msgpack_numpy_encoder

    req = CompletionRequest(prompt="hi", stop=["stop-one", "stop-two"])
    routes = OpenAIRoutes.__new__(OpenAIRoutes)
    routes.tokenizer = type("T", (), {"vocab_size": 100})()
    params = routes._sampling_params(req, 4, 0)
    assert params.stop == ["stop-one", "stop-two"]  # what this process's detokenizer applies
    ctx = TextContext(max_length=10, tokens=np.arange(3), sampling_params=params)
    frame = msgpack_numpy_encoder()(_without_stop_strings(ctx))
    assert b"stop-one" not in frame and b"stop-two" not in frame
    assert ctx.sampling_params.stop == ["stop-one", "stop-two"]


def test_partial_stop_matching_is_not_quadratic():
    from api_server.detokenizer import StopStringMatcher

    matcher = StopStringMatcher(["a" * 255 + "b"] * 16)
    started = time.perf_counter()
    out = "".join(matcher.push("c") for _ in range(2000))
    # Trying every prefix length of every stop string per token took seconds here.
    assert time.perf_counter() - started < 1.0
    assert out == "c" * 2000
    held = "".join(matcher.push("a") for _ in range(300))
    assert held == "a" * 45  # the last 255 could still start a stop string
    assert matcher.push("b") == "" and matcher.stopped


# ---- 4. incremental detokenization stays bounded -------------------------------------------------
class CountingTokenizer:
    """The real tokenizer, recording the longest window decoded."""

    def __init__(self, delegate):
        self.delegate = delegate
        self.longest = 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.delegate.decode(ids, **kwargs)


@pytest.mark.parametrize("token", [218, 2])  # a lone continuation byte; EOS (a special token)
def test_detokenizer_window_is_bounded(smollm2_dir, token):
    from transformers import AutoTokenizer

    from api_server.detokenizer import IncrementalDetokenizer

    tok = CountingTokenizer(AutoTokenizer.from_pretrained(smollm2_dir))
    detok = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=True)
    text = "".join(detok.push([token]) for _ in range(2000)) + detok.flush()
    assert tok.longest <= 32
    if token == 218:
        assert text == "\ufffd" * 2000
    else:
        assert text == ""
    # Ordinary text after them still decodes.
    ids = tok.delegate.encode(" hello world")
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == " hello world"


def test_forced_garbage_bytes_stream_through_the_server(server):
    r = post(server, COMP, {"prompt": "hi", "max_tokens": 200, "logit_bias": {"218": 100},
                            "temperature": 0})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == "\ufffd" * 200


# ---- 5. input that used to raise past the error handler ----------------------------------------
def nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def schema(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}}
    return s


@pytest.mark.parametrize("body,param", [
    ({"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": schema(200)}}]}, "tools"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema(200)}}}, "response_format.json_schema.schema"),
    ({"messages": MSG, "chat_template_kwargs": {"x": nested(200)}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": [nested(200)]}]}, "messages[0].content"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"function": "f"}}, "tool_choice"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": ["f"]}}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]},
     "messages.tool_calls[0].function"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
        "function": {"name": "f", "arguments": str(nested(300)).replace("'", '"')}}]}]},
     "messages.tool_calls[0].function.arguments"),
])
def test_malformed_structures_are_400s(server, body, param):
    r = post(server, CHAT, {**body, "max_tokens": 2})
    assert_refused(r, param)


def test_deeply_nested_body_is_a_400(server):
    deep = b"[" * 100_000 + b"]" * 100_000
    kwargs = b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": '
    schema = b'{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {' \
             b'"name": "x", "schema": {"x": '
    for path, body in ((CHAT, kwargs + deep + b"}}"), ("/tokenize", kwargs + deep + b"}}"),
                       (COMP, schema + deep + b"}}}}")):
        r = httpx.post(server.url + path, content=body,
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert "nested" in r.json()["error"]["message"]
    assert_serving(server)


def test_an_oversized_prompt_is_refused_before_tokenizing(server):
    r = post(server, COMP, {"prompt": "word " * 1_000_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, CHAT, {"messages": [{"role": "user", "content": "w " * 1_000_000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_refusals_are_counted_by_reason(server):
    post(server, COMP, {"prompt": ["a"] * 100, "max_tokens": 1})
    post(server, COMP, {"prompt": "hi", "stop": ["x"] * 17})
    text = httpx.get(server.url + "/metrics").text

    def count(reason):
        m = re.search(r'loom:rejected_requests_total\{[^}]*reason="%s"[^}]*\} (\S+)' % reason,
                      text)
        return float(m.group(1)) if m else 0.0

    assert count("too_many_sequences") >= 1
    assert count("limit_exceeded") >= 1
