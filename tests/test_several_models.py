"""Several models from one server (`--model NAME=PATH` given again): each answers with its own
weights (transformers' greedy output), /v1/models says which are loaded, a model not loaded
loads on its request (evicting the least recently used idle one, whose processes exit) while
the others serve, and a dead worker fails its model alone. (tests/test_model_pool.py: the
pool's decisions, idle unloading and the memory check among them, without processes.)

One server for the module: a and c are the same tiny checkpoint under two names, b the untied
one; at most two are loaded (a and b at start)."""

import asyncio
import re
import threading
import time

import httpx
import pytest

from tests.helpers import child_pids, hf_greedy, start_server, wait_gone

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tiny_model_dir, untied_tiny_model_dir):
    srv = start_server(None, "--model", f"a={tiny_model_dir}", "--model",
                       f"b={untied_tiny_model_dir}", "--model", f"c={tiny_model_dir}",
                       "--max-loaded-models", "2", threads=1)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def oracles(tiny_model_dir, untied_tiny_model_dir):
    """{model name: {prompt: greedy text}} from transformers on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = {}
    for name, path in (("a", tiny_model_dir), ("b", untied_tiny_model_dir)):
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        texts[name] = {p: tok.decode(hf_greedy(model, tok, tok(p)["input_ids"], MAX_TOKENS),
                                     skip_special_tokens=True) for p in PROMPTS}
    texts["c"] = texts["a"]
    assert texts["a"] != texts["b"]  # (so an answer tells which model gave it)
    return texts


def complete(url: str, model: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def states(url: str) -> dict[str, bool]:
    cards = httpx.get(url + "/v1/models").json()["data"]
    return {card["id"]: card["loaded"] for card in cards}


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics").text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and ",".join(sorted(m.group(1).split(","))) == wanted:
            return float(m.group(2))
    return 0.0


def test_models_are_listed_with_whether_each_is_loaded(server):
    assert states(server.url) == {"a": True, "b": True, "c": False}
    card = httpx.get(server.url + "/v1/models/c").json()
    assert card["id"] == "c" and card["loaded"] is False and card["max_model_len"] > 0


def test_interleaved_requests_each_get_their_models_output(server, oracles):
    async def go():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(model, prompt):
                r = await client.post(server.url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            jobs = [(m, p) for p in PROMPTS for m in ("a", "b")]
            return jobs, await asyncio.gather(*(one(m, p) for m, p in jobs))

    jobs, texts = asyncio.run(go())
    for (model, prompt), text in zip(jobs, texts):
        assert text == oracles[model][prompt], (model, prompt)


def test_an_unknown_model_gets_openais_404(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "the model `no-such-model` does not exist",
                                 "type": "not_found_error", "param": "model",
                                 "code": "model_not_found"}
    assert httpx.get(server.url + "/v1/models/no-such-model").status_code == 404
    r = httpx.get(server.url + "/no/such/path")  # (a path no model answers)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_loading_a_model_evicts_the_idle_one_while_others_serve(server, oracles):
    complete(server.url, "a", PROMPTS[0])
    complete(server.url, "b", PROMPTS[0])  # a is now the least recently used
    before = set(child_pids(server.proc.pid))
    loads_a = metric(server.url, "loom:model_loads_total", model_name="a")
    result = {}

    def load_c():
        result["text"] = complete(server.url, "c", PROMPTS[1])
        result["done"] = time.monotonic()

    thread = threading.Thread(target=load_c)
    thread.start()
    deadline = time.monotonic() + 60
    while httpx.get(server.url + "/health").json()["models"]["c"] != "loading":
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    # b answers while c loads.
    assert complete(server.url, "b", PROMPTS[2]) == oracles["b"][PROMPTS[2]]
    b_done = time.monotonic()
    thread.join(120)
    assert result["text"] == oracles["c"][PROMPTS[1]]
    assert b_done < result["done"]
    assert states(server.url) == {"a": False, "b": True, "c": True}
    # a's scheduler and worker exited (their memory with them); c's took their place.
    gone = before - set(child_pids(server.proc.pid))
    assert len(gone) >= 2 and wait_gone(list(gone))
    assert metric(server.url, "loom:model_unloads_total", model_name="a",
                  reason="evicted") == 1
    assert metric(server.url, "loom:model_loads_total", model_name="c") == 1

    # A later request for a reloads it (evicting b, now the least recently used).
    assert complete(server.url, "a", PROMPTS[0]) == oracles["a"][PROMPTS[0]]
    assert states(server.url) == {"a": True, "b": False, "c": True}
    assert metric(server.url, "loom:model_loads_total", model_name="a") == loads_a + 1
    assert metric(server.url, "loom:model_load_duration_seconds_count", model_name="a") == 2


def test_a_dead_worker_unloads_its_model_and_the_others_serve_on(server, oracles):
    """(After the test above: a and c are loaded.) The worker with the largest address space
    is one model's; killing it fails that model alone."""
    import os
    import signal

    def vm_size(pid):
        with open(f"/proc/{pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmSize")).split()[1])

    worker = max(child_pids(server.proc.pid), key=vm_size)
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while sum(states(server.url).values()) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (alive,) = [name for name, loaded in states(server.url).items() if loaded]
    (dead,) = {"a", "c"} - {alive}
    assert metric(server.url, "loom:model_unloads_total", model_name=dead, reason="failed") == 1
    assert complete(server.url, alive, PROMPTS[2]) == oracles[alive][PROMPTS[2]]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_the_command_line_names_each_model_and_refuses_ambiguity(tiny_model_dir, tmp_path):
    from api_server.cli import build_parser, serve_configs_from_args
    from api_server.startup_error import StartupError

    def names(*flags):
        cfgs = serve_configs_from_args(build_parser().parse_args(["serve", *flags]))
        return [cfg.model_config.served_model_name for cfg in cfgs]

    for name in ("m2", "m1"):
        (tmp_path / name).symlink_to(tiny_model_dir)
    (tmp_path / "notes.txt").write_text("not a model")
    assert names("--models-dir", str(tmp_path)) == ["m1", "m2"]
    assert names("--model", f"x={tiny_model_dir}", "--models-dir", str(tmp_path)) == \
        ["x", "m1", "m2"]
    for flags, problem in (
            (["--model", f"m1={tiny_model_dir}", "--models-dir", str(tmp_path)], "named m1"),
            (["--models-dir", str(tmp_path), "--served-model-name", "s"], "NAME=PATH"),
            (["--models-dir", str(tmp_path), "--max-loaded-models", "0"], "positive"),
            (["--models-dir", str(tmp_path / "none")], "no such directory")):
        with pytest.raises(StartupError, match=problem):
            names(*flags)
