"""Requests a public server gets on its first day: each is refused with a 400 naming the
parameter (or bounded), the server keeps serving, no traceback reaches the log, and /metrics
counts the refusals by reason."""

import json
import os
import re
import socket
import threading
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(guarded_server):
    yield guarded_server  # (shared with tests/test_api_errors.py)
    assert "Traceback" not in guarded_server.log()


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


def test_trusted_request_templates_render_in_a_bounded_sandbox(features_server):
    srv = features_server  # (served with --trust-request-chat-template)
    log_start = len(srv.log())
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
    assert "Traceback" not in srv.log()[log_start:]


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


def test_chat_messages_are_capped_like_the_other_apis(server):
    r = post(server, CHAT, {"messages": MSG * 4097, "max_tokens": 1})
    assert_refused(r, "messages", "limit_exceeded")
    assert "4096" in r.json()["error"]["message"]
    assert_serving(server)


def test_the_n_choices_of_a_chat_are_admitted_as_one_request(server):
    # A ~150-token prompt: 16 choices hold 2,400 prompt tokens, more than --max-queued-tokens
    # (2000): refused as a whole, after one render (not 16); 8 choices fit, all of them served.
    long_msg = [{"role": "user", "content": "count " * 140}]
    r = post(server, CHAT, {"messages": long_msg, "n": 16, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens", r.text
    r = post(server, CHAT, {"messages": long_msg, "n": 8, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(8))
    texts = {c["message"]["content"] for c in body["choices"]}
    assert len(texts) == 1 and body["usage"]["completion_tokens"] == 24  # greedy: the same
    one = post(server, CHAT, {"messages": long_msg, "max_tokens": 3, "temperature": 0}).json()
    assert texts == {one["choices"][0]["message"]["content"]}
    assert body["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"] > 140


def test_many_aborts_cost_linear_time():
    import numpy as np

    from pipelines.config import PipelineConfig
    from pipelines.context import TextContext
    from scheduler.block_manager import BlockManager
    from scheduler.scheduler import Scheduler

    sched = Scheduler(PipelineConfig().replace(max_length=8192), BlockManager(64, 16, True))
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
    from api_server.protocol import CompletionRequest
    from api_server.serving_context import ServingContext
    from pipelines import TextContext
    from pipelines.config import SamplingParamsDefaults
    from serialization.codec import msgpack_numpy_encoder

    req = CompletionRequest(prompt="hi", stop=["stop-one", "stop-two"])
    serving = ServingContext.__new__(ServingContext)
    serving.tokenizer = type("T", (), {"vocab_size": 100})()
    serving.sampling_defaults = SamplingParamsDefaults()  # (none set: the request's own)
    params = serving.sampling_params(req, 4, 0)
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
    # 60,000 arrays deep (within the count a body may hold: 100,000 are refused for their
    # number before decoding, tests/test_event_loop_stalls.py), decoded off the event loop.
    deep = b"[" * 60_000 + b"]" * 60_000
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


# ---- HTTP framing: heads that never end, connections that never ask (#26) ---------------------
def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def open_sockets(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


class HonestRequest(threading.Thread):
    """A completion that runs while an attack does: it must finish, and in full."""

    def __init__(self, server, max_tokens=48):
        super().__init__()
        self.server, self.max_tokens, self.response = server, max_tokens, None
        self.start()

    def run(self):
        self.response = post(self.server, COMP, {"prompt": "hi", "max_tokens": self.max_tokens,
                                                 "ignore_eos": True, "temperature": 0})

    def assert_finished(self):
        self.join(60)
        r = self.response
        assert r is not None and r.status_code == 200, r and r.text
        assert r.json()["usage"]["completion_tokens"] == self.max_tokens


def endless_head(port: int, limit: int = 64 << 20) -> tuple[int, bytes]:
    """Send one header field that never ends; (bytes sent, the server's answer)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Endless: ")
        sent, chunk = 0, b"a" * (64 << 10)
        try:
            while sent < limit:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server closed the connection: what we want
            pass
        s.settimeout(10)
        try:
            return sent, s.recv(4096)
        except OSError:
            return sent, b""


def test_request_heads_are_bounded(server):
    honest = HonestRequest(server)
    before = rss_mib(server.proc.pid)
    results = []
    attackers = [threading.Thread(target=lambda: results.append(endless_head(server.port)))
                 for _ in range(8)]
    for t in attackers:
        t.start()
    for t in attackers:
        t.join(60)
    after = rss_mib(server.proc.pid)
    print(f"endless heads: API process RSS {before:.0f} -> {after:.0f} MiB, "
          f"{sum(sent for sent, _ in results) >> 10} KiB sent by 8 clients")
    assert len(results) == 8
    for sent, answer in results:
        assert sent < 32 << 20, sent  # cut off (the rest sat in the kernel's buffers)
        assert answer.startswith(b"HTTP/1.1 431 "), answer
        assert b"--max-header-bytes" in answer
    assert after - before < 64
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        fields = b"".join(b"X-%d: 1\r\n" % i for i in range(500))
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n" + fields + b"\r\n")
        s.settimeout(10)
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"--max-headers" in answer, answer
    honest.assert_finished()
    assert_serving(server)


def test_slow_heads_are_closed_and_capped(server):
    """Slowloris: 2,500 connections that never finish their head. Beyond --max-connections
    (2,048) the oldest give way; --header-timeout (3 s here) closes the rest; an honest
    client is served meanwhile."""
    honest = HonestRequest(server)
    slow = []
    try:
        for _ in range(2500):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: loc")
            slow.append(s)
        started = time.monotonic()
        held, rss = open_sockets(server.proc.pid), rss_mib(server.proc.pid)
        r = httpx.get(server.url + "/v1/models", timeout=30)
        assert r.status_code == 200 and time.monotonic() - started < 10
        closed, deadline = set(), time.monotonic() + 30
        while len(closed) < len(slow) and time.monotonic() < deadline:
            for i, s in enumerate(slow):
                if i in closed:
                    continue
                s.setblocking(False)
                try:
                    s.recv(4096)
                    closed.add(i)  # a 408 or the end of the stream
                except BlockingIOError:
                    pass
                except OSError:
                    closed.add(i)
            held = max(held, open_sockets(server.proc.pid))
            time.sleep(0.2)
        assert len(closed) == len(slow)
        assert held <= 2048 + 32  # + the listener, ZeroMQ, ...
        print(f"2,500 slow heads: at most {held} sockets held by the API process (RSS "
              f"{rss:.0f} MiB), all closed {time.monotonic() - started:.1f} s after the last "
              f"opened")
    finally:
        for s in slow:
            s.close()
    honest.assert_finished()
    assert_serving(server)


FIT_LIMITS = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, int(sys.argv[1])))
from api_server.http_protocol import fit_descriptor_limit
from pipelines.config import HttpLimits
print(fit_descriptor_limit(HttpLimits(max_connections=2048)).max_connections,
      resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize("hard,expected", [(2304, "2048 2304"), (1024, "768 1024")])
def test_connection_cap_fits_the_open_files_limit(hard, expected):
    """At the usual soft limit (1,024 files) slow clients would exhaust the descriptors, and
    block every accept, before --max-connections could close one of them: the server raises
    the soft limit, or lowers the cap to what the hard limit allows."""
    import resource
    import subprocess
    import sys

    from tests.helpers import ROOT

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:  # (only root raises it)
        pytest.skip(f"the hard open-files limit is below {hard}")
    out = subprocess.run([sys.executable, "-c", FIT_LIMITS, str(hard)], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert out.stdout.split() == expected.split(), out.stderr


# ---- what a web page may not send: DNS-rebound Host, other origins, text/plain JSON (#26) ------
def post_raw(server, path, body=b'{"prompt": "hi", "max_tokens": 2, "temperature": 0}',
             headers=None):
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=body, headers=headers, timeout=60)


def test_a_keyless_server_answers_only_local_host_names(server):
    evil = httpx.get(server.url + "/v1/models", headers={"Host": "evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "host_not_allowed"
    r = post_raw(server, COMP, headers={"Host": "evil.example:80"})
    assert r.status_code == 403
    for host in (f"localhost:{server.port}", "127.0.0.1", f"[::1]:{server.port}"):
        assert httpx.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200
    for probe in ("/health", "/live", "/metrics"):  # a kubelet sends the pod's IP
        assert httpx.get(server.url + probe, headers={"Host": "10.1.2.3"}).status_code == 200


def test_host_rule_of_servers_bound_elsewhere():
    """(Tests serve on loopback only: the rule for other binds, read directly.) Bound to every
    address, a key-less server (--allow-unauthenticated) answers IP addresses, a container's
    or pod's included, but no name a page could rebind; --allowed-hosts adds names."""
    from api_server.cross_site import HostPolicy

    everywhere = HostPolicy("0.0.0.0", ("gpu-box.lan",))
    for host in ("10.1.2.3:8000", "[fd00::5]:8000", "localhost:8000", "GPU-box.lan.", None):
        assert everywhere.allows(host), host
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "a b"):
        assert not everywhere.allows(host), host
    named = HostPolicy("gpu-box.lan", ())
    assert named.allows("gpu-box.lan:8000") and not named.allows("other.lan")
    loopback = HostPolicy("::1", ())
    assert loopback.allows("[::1]:8000") and not loopback.allows("10.1.2.3")
    assert HostPolicy("127.0.0.1", ("*",)).allows("evil.example")


def test_json_bodies_need_a_json_content_type(server):
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        for path in (COMP, CHAT, "/v1/messages", "/tokenize"):
            r = post_raw(server, path, headers={"content-type": kind})
            assert r.status_code == 415, (kind, path, r.text)
    r = post_raw(server, COMP, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_cross_origin_requests_need_an_allowed_origin(server):
    simple = post_raw(server, COMP, headers={"origin": "https://evil.example",
                                             "content-type": "text/plain"})
    assert simple.status_code == 403 and simple.json()["error"]["code"] == "origin_not_allowed"
    evil = post_raw(server, COMP, headers={"origin": "https://evil.example"})
    assert evil.status_code == 403
    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "content-type,authorization"}
    refused = httpx.options(server.url + CHAT,
                            headers={"origin": "https://evil.example", **preflight})
    assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
    ok = httpx.options(server.url + CHAT, headers={"origin": "https://app.example", **preflight})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"]
    r = post_raw(server, COMP, headers={"origin": "https://app.example"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"



# ---- issue 26: numeric sampling fields bounded where they are parsed, in all three APIs ---------
HUGE = 2**64 - 1
RESP, MESSAGES = "/v1/responses", "/v1/messages"
ASK = {"model": "tiny", "max_tokens": 4, "messages": MSG}
OUT_OF_RANGE = [  # (path, body, the parameter the 400 names)
    (COMP, {"prompt": "hi", "top_k": HUGE, "temperature": 1}, "top_k"),
    (COMP, {"prompt": "hi", "top_k": 1_000_000, "temperature": 1}, "top_k"),  # > vocabulary
    (COMP, {"prompt": "hi", "top_k": -2}, "top_k"),
    (COMP, {"prompt": "hi", "seed": HUGE}, "seed"),
    (COMP, {"prompt": "hi", "min_tokens": HUGE}, "min_tokens"),
    (COMP, b'{"prompt": "hi", "repetition_penalty": 1e999}', "repetition_penalty"),
    (COMP, {"prompt": "hi", "repetition_penalty": 1e-300}, "repetition_penalty"),
    # token ids past int64 (found by schemathesis: a 500 once)
    (COMP, {"prompt": [1, HUGE * 7], "max_tokens": 2}, "prompt"),
    (COMP, {"prompt": [[1, 2], [HUGE]], "max_tokens": 2}, "prompt"),
    (COMP, {"prompt": [[1, 2], [-(2**63) - 1]], "max_tokens": 2}, "prompt[1]"),
    (CHAT, {"messages": MSG, "top_k": 2**63, "temperature": 1}, "top_k"),
    (CHAT, {"messages": MSG, "top_k": 1_000_000}, "top_k"),
    (CHAT, {"messages": MSG, "seed": -(2**63) - 1}, "seed"),
    (CHAT, {"messages": MSG, "max_completion_tokens": HUGE}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (RESP, {"input": "hi", "top_k": 2**63, "temperature": 1}, "top_k"),
    (RESP, {"input": "hi", "top_k": 1_000_000}, "top_k"),
    (RESP, {"input": "hi", "seed": HUGE}, "seed"),
    (RESP, {"input": "hi", "max_output_tokens": HUGE}, "max_output_tokens"),
    (MESSAGES, {**ASK, "top_k": HUGE, "temperature": 1}, "top_k"),
    (MESSAGES, {**ASK, "top_k": 1_000_000}, "top_k"),
    (MESSAGES, {**ASK, "max_tokens": HUGE}, "max_tokens"),
]


def test_out_of_range_sampling_fields_are_refused_while_others_are_served(server):
    # Each probe is a 400 naming its parameter (in Anthropic's shape on /v1/messages), and a
    # streamed request running meanwhile ends as it would alone.
    honest = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    alone = post(server, COMP, honest).json()["choices"][0]["text"]
    streamed: dict = {}

    def stream():
        texts = []
        with httpx.stream("POST", server.url + COMP, json={**honest, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    texts.append(choice["text"])
                    streamed["finish"] = choice["finish_reason"] or streamed.get("finish")
        streamed["text"] = "".join(texts)

    reader = threading.Thread(target=stream)
    reader.start()
    for path, body, param in OUT_OF_RANGE:
        r = (httpx.post(server.url + path, content=body, timeout=60,
                        headers={"content-type": "application/json"})
             if isinstance(body, bytes) else post(server, path, body))
        if path == MESSAGES:
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and param in error["message"], error
        else:
            assert_refused(r, param)
    reader.join(timeout=120)
    assert streamed == {"text": alone, "finish": "length"}
    # In range, the same fields are served: -1 turns top_k off, as vLLM takes it.
    ok = post(server, COMP, {"prompt": "hi", "max_tokens": 2, "top_k": -1, "seed": 2**63 - 1,
                             "repetition_penalty": 100.0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    vocab_top_k = post(server, CHAT, {"messages": MSG, "max_tokens": 2, "top_k": 49152})
    assert vocab_top_k.status_code == 200, vocab_top_k.text
