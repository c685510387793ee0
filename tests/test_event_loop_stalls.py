"""Requests built to hold the API process's event loop (#26, items 3 and 4): each is refused
or served while `/live` keeps answering within 200 ms and an honest request finishes; the
Responses store is bounded by the memory it takes."""

import gc
import json
import threading
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
LIVE_P99_S = 0.2  # a liveness probe of 2 s x 3 restarts the pod; this is 10x under it


@pytest.fixture(scope="module")
def server(tiny_server):
    # The shared tiny server: a 1024-token context, and default bounds (256 sequences a
    # request, a million queued tokens) that admit the 128 choices of the probe below.
    yield tiny_server
    assert "Traceback" not in tiny_server.log()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def empty_lists(size: int) -> bytes:
    """A JSON array of `size` bytes of `[]`s."""
    count = (size - 2) // 3
    return b"[" + b",".join([b"[]"] * count) + b"]"


def chat_body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def with_raw(body: dict, key: str, raw: bytes) -> bytes:
    """`body` as JSON, with the placeholder string `key` replaced by raw JSON."""
    return json.dumps(body).encode().replace(json.dumps(key).encode(), raw)


def tools_probe() -> bytes:  # 16 MiB (the body limit) of [] in a tool's parameters
    tools = [{"type": "function", "function": {"name": "f", "parameters": "@"}}]
    return with_raw(chat_body(tools=tools), "@", empty_lists((16 << 20) - 200))


def messages_probe() -> bytes:  # 140k empty messages in 4 MiB
    return json.dumps({"messages": [{"role": "user", "content": ""}] * 140_000,
                       "max_tokens": 1}).encode()


def content_part_probe() -> bytes:  # 4 MiB of junk in one content part
    part = {"type": "text", "text": "hi", "junk": "@"}
    return with_raw({"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}, "@",
                    empty_lists(4 << 20))


def n128_probe() -> bytes:  # one render and tokenization for 128 choices
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 4}
             for i in range(12)]
    return json.dumps({"messages": turns, "n": 128, "max_tokens": 1}).encode()


def patterns_probe() -> bytes:  # a forced call of 25 items x 20 backtracking patterns
    item = {"type": "object", "required": [f"p{j}" for j in range(20)], "properties": {
        f"p{j}": {"type": "string", "pattern": "^(a|a)+$|^a*!$"} for j in range(20)}}
    params = {"type": "object", "required": ["items"], "properties": {"items": {
        "type": "array", "items": item, "minItems": 25, "maxItems": 25}}}
    return json.dumps(chat_body(
        max_tokens=200, tools=[{"type": "function", "function": {"name": "f",
                                                                  "parameters": params}}],
        tool_choice={"type": "function", "function": {"name": "f"}})).encode()


PROBES = {"tools_16MiB_of_empty_lists": (tools_probe, 400),
          "messages_140k_empty": (messages_probe, 400),
          "content_part_4MiB_of_junk": (content_part_probe, 400),
          "chat_n128": (n128_probe, 200),
          "forced_call_25x20_patterns": (patterns_probe, 200)}


class Attack(threading.Thread):
    def __init__(self, server, path: str, body: bytes):
        super().__init__()
        self.server, self.path, self.body, self.response = server, path, body, None
        self.start()

    def run(self):
        self.response = httpx.post(self.server.url + self.path, content=self.body, timeout=120,
                                   headers={"content-type": "application/json"})


def live_latencies(server, attack: Attack | None, at_least: int = 50) -> list[float]:
    """GET /live every ~20 ms while the attack runs (and at least `at_least` times).

    This process' garbage collector is off meanwhile: by the time the suite gets here the
    test process holds every test module's imports (a million objects, torch, transformers,
    litellm, diffusers...), and one full collection of them stalls it 0.5-0.8 s, which the
    probe in flight would count against the server."""
    out = []
    gc.disable()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while len(out) < at_least or (attack is not None and attack.is_alive()):
                started = time.perf_counter()
                assert client.get("/live").status_code == 200
                out.append(time.perf_counter() - started)
                time.sleep(0.02)
    finally:
        gc.enable()
    return out


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


@pytest.mark.parametrize("name", PROBES)
def test_live_answers_while_a_stall_probe_runs(server, name):
    make, status = PROBES[name]
    body = make()
    honest = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    idle = live_latencies(server, None)
    attack = Attack(server, CHAT, body)
    latencies = live_latencies(server, attack)
    ok = httpx.post(server.url + "/v1/completions", json=honest, timeout=60)
    attack.join(120)
    r = attack.response
    print(f"{name}: {len(body) >> 10} KiB -> {r.status_code}; /live p99 "
          f"{1000 * p99(latencies):.0f} ms, max {1000 * max(latencies):.0f} ms over "
          f"{len(latencies)} probes (idle: p99 {1000 * p99(idle):.0f} ms)")
    assert r.status_code == status, r.text[:300]
    if status == 400:
        assert r.json()["error"]["type"] == "invalid_request_error"
    elif name == "chat_n128":
        assert len(r.json()["choices"]) == 128
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    # Over what the box shows idle: on a shared 2-core machine under load, /live alone can
    # take tens of milliseconds, and that is not the probe's doing.
    assert p99(latencies) < LIVE_P99_S + p99(idle)


def test_what_a_body_holds_is_bounded_before_it_is_decoded(server):
    from api_server.off_loop import MAX_JSON_CONTAINERS

    # Brackets and commas inside strings are text, not structure: a large prompt of them is
    # decoded (and then refused for its length, not its shape).
    text = "[{,}] " * 200_000
    r = httpx.post(server.url + CHAT, json=chat_body(messages=[{"role": "user",
                                                                "content": text}]),
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # One more array than the cap, in a body large enough to be checked.
    tools = [{"type": "function", "function": {"name": "f", "parameters": "@"}}]
    body = with_raw(chat_body(tools=tools), "@", empty_lists(3 * MAX_JSON_CONTAINERS))
    r = httpx.post(server.url + CHAT, content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "limit_exceeded", r.text


def test_stored_responses_take_the_memory_they_count(server):
    """4 x store: true with 8 MiB of [] in tools: refused before it is decoded. Within what a
    body may hold, responses are kept as their JSON bytes (the Python objects of that JSON are
    ~24x larger) and read back whole."""
    before = rss_mib(server.proc.pid)
    for i in range(4):
        body = with_raw({"input": f"hi {i}", "max_output_tokens": 2, "store": True,
                         "tools": [{"type": "function", "name": "f", "x": "@"}]}, "@",
                        empty_lists(8 << 20))
        r = httpx.post(server.url + "/v1/responses", content=body, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "limit_exceeded"
    refused = rss_mib(server.proc.pid)
    nested = [[[]] * 8] * 7_000  # 63k arrays: within what a body may hold
    ids = []
    for i in range(4):
        r = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "input": f"hi {i}", "max_output_tokens": 2, "store": True,
            "tools": [{"type": "function", "name": "f", "x": nested}]})
        assert r.status_code == 200, r.text[:300]
        ids.append(r.json()["id"])
    after = rss_mib(server.proc.pid)
    print(f"store probe: API process RSS {before:.0f} MiB, {refused:.0f} after 4 x 8 MiB of [] "
          f"(refused), {after:.0f} after 4 stored with 63k arrays each")
    got = httpx.get(f"{server.url}/v1/responses/{ids[0]}", timeout=60)
    assert got.status_code == 200 and got.json()["tools"][0]["x"] == nested
    follow = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": "again", "max_output_tokens": 2, "previous_response_id": ids[-1]})
    assert follow.status_code == 200, follow.text[:300]
    assert after - before < 100


def test_the_store_evicts_by_bytes_and_holds_no_more():
    import tracemalloc

    from api_server.response_store import ResponseStore

    store = ResponseStore(max_responses=100, max_bytes=10_000)

    def put(i):  # fresh objects, as each request decodes its own
        body = json.loads(json.dumps({"id": f"r{i}", "tools": [[]] * 1000}))  # 3 KB as JSON
        store.put(body, [{"role": "user", "content": "x"}])

    tracemalloc.start()
    try:
        for i in range(3):
            put(i)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 2 * store.max_bytes, held  # as Python objects: ~70 KB each
    assert [store.get(f"r{i}") is not None for i in range(3)] == [True] * 3
    assert store.bytes == sum(store.get(f"r{i}").size for i in range(3)) <= 10_000
    put(3)  # the oldest gives way
    assert store.get("r0") is None and store.get("r3").body["tools"] == [[]] * 1000
    assert store.bytes <= 10_000
    assert store.delete("r3") and not store.delete("r3")
    store.put({"id": "huge", "x": "y" * 20_000}, [])  # larger than the whole store: not kept
    assert store.get("huge") is None and store.get("r2") is not None
    assert store.get("r2").messages == [{"role": "user", "content": "x"}]
    # A conversation's images (which no JSON body can put there) come back as they went in.
    from api_server.image_inputs import ImagePart

    image = ImagePart("input[0].content[1]", "data:image/png;base64,AAAA")
    forged = {"param": "x", "url": "file:///etc/passwd"}  # a dict of a client is no image
    talk = [{"role": "user", "content": [{"type": "text", "text": "see"}, image, forged]}]
    store.put({"id": "img"}, talk)
    assert store.get("img").messages == talk
    assert isinstance(store.get("img").messages[0]["content"][1], ImagePart)
    assert isinstance(store.get("img").messages[0]["content"][2], dict)


def test_a_full_off_loop_queue_is_a_503():
    import asyncio

    from api_server.off_loop import OffLoop
    from api_server.protocol import RequestError

    pool = OffLoop(threads=1, max_pending=1)
    release = threading.Event()

    async def main():
        first = asyncio.ensure_future(pool.run(release.wait, 10))
        await asyncio.sleep(0.05)
        with pytest.raises(RequestError) as refused:
            await pool.run(lambda: None)
        release.set()
        assert await first is True
        assert await pool.run(lambda: 7) == 7  # the slot came back
        return refused.value

    exc = asyncio.run(main())
    assert exc.status == 503 and exc.body()["error"]["code"] == "server_busy"


def test_tool_call_pattern_checks_share_one_budget_per_request():
    import regex

    from api_server.tool_calls import ToolCall
    from api_server.tool_validation import PATTERN_BUDGET_S, ToolCallChecker

    # Each search matches, after backtracking for a few ms (well under the 50 ms cap of one,
    # so that it is the budget that ends the check, not a search that gave up).
    pattern = "^(a|a)+$|^a*!$"
    regex.search(pattern, "")  # compiled
    length = 12
    while True:
        started = time.perf_counter()
        regex.search(pattern, "a" * length + "!")
        if time.perf_counter() - started > 0.002 or length > 40:
            break
        length += 1
    item = {"type": "object", "properties": {
        f"p{j}": {"type": "string", "pattern": pattern} for j in range(20)}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"items": {"type": "array", "items": item}}}}}]
    checker = ToolCallChecker(tools)
    call = ToolCall("f", json.dumps({"items": [{f"p{j}": "a" * length + "!"
                                                for j in range(20)}] * 25}))
    started = time.perf_counter()
    for _ in range(4):  # 4 calls of 500 matching searches: 4 s or more, unbudgeted
        checker.check(call)
    assert time.perf_counter() - started < PATTERN_BUDGET_S + 1.5
