"""Two real models from one server: the default SmolLM2 GGUF and Gemma 3 270M (Q4_K_M), each
checked against transformers on its own file (tests/gguf_oracle.py's agreement criterion) with
requests for both interleaved in flight; an idle model unloads after --model-idle-timeout and
the server's resident memory drops by about that model's worker.

(tests/test_several_models.py covers loading on demand, eviction and a dead worker on tiny
models; this module checks the same server with the files users bring.)"""

import asyncio
import importlib.util
import threading
import time

import httpx
import pytest

from pipelines.checkpoint.default_model import GEMMA3_PARTS

_MISSING = [p for p, _ in GEMMA3_PARTS if importlib.util.find_spec(p) is None]
if _MISSING:
    pytest.skip(f"Gemma 3 270M's GGUF packages are not installed ({', '.join(_MISSING)}): "
                f"`make setup` installs them", allow_module_level=True)

from tests.gguf_oracle import check_against_oracle, oracle_choices  # noqa: E402
from tests.helpers import child_pids, start_server  # noqa: E402

# The GGUF serving tests' criterion (tests/test_gguf_serving.py, tests/test_gguf_gemma3.py).
TIE_NATS = 0.5
LOGPROB_NATS = 0.45
MAX_TOKENS = 12
IDLE_S = 4
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "Q: What is 12 times 12?\nA:"]


@pytest.fixture(scope="module")
def files():
    from pipelines.checkpoint.default_model import find_gguf, gemma3_gguf

    return {"smollm2": find_gguf(), "gemma": gemma3_gguf()}


@pytest.fixture(scope="module")
def oracles(gguf_oracle, gemma3_oracle):
    return {"smollm2": gguf_oracle, "gemma": gemma3_oracle}


@pytest.fixture(scope="module")
def server(files):
    srv = start_server(None, "--model", f"smollm2={files['smollm2']}", "--model",
                       f"gemma={files['gemma']}", "--model-idle-timeout", str(IDLE_S),
                       "--max-model-len", "512", "--kv-cache-memory", "64MiB", threads=1,
                       timeout=300)
    yield srv
    assert srv.stop() == 0


async def _complete(client, url, model, prompt_ids):
    r = await client.post(url + "/v1/completions", json={
        "model": model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    lp = r.json()["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], lp["token_logprobs"]


def complete_all(url, jobs):
    """[(model, prompt ids)] sent together: the two models' requests in flight at once."""
    async def go():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(_complete(client, url, m, ids) for m, ids in jobs))

    return asyncio.run(go())


def states(url: str) -> dict[str, bool]:
    return {card["id"]: card["loaded"] for card in httpx.get(url + "/v1/models").json()["data"]}


def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and every process under it, in MB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += child_pids(p)
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass  # (exited meanwhile, or a zombie)
    return total / 1024


def test_interleaved_requests_agree_with_each_models_oracle(server, oracles):
    ids = {m: [o.tokenizer(p)["input_ids"] for p in PROMPTS] for m, o in oracles.items()}
    jobs = [(m, p) for i in range(len(PROMPTS)) for m, p in (("smollm2", ids["smollm2"][i]),
                                                             ("gemma", ids["gemma"][i]))]
    results = complete_all(server.url, jobs)
    stats = {m: {} for m in oracles}
    for (model, prompt_ids), (generated, logprobs) in zip(jobs, results):
        assert len(generated) == MAX_TOKENS
        check_against_oracle(oracle_choices(oracles[model], prompt_ids, generated), prompt_ids,
                             generated, logprobs, stats[model], TIE_NATS, LOGPROB_NATS)
    for model, s in stats.items():
        assert s["exact"] >= 0.9 * s["total"], (model, s)


def test_an_idle_model_unloads_and_its_memory_is_freed(server, oracles):
    smol = oracles["smollm2"].tokenizer(PROMPTS[0])["input_ids"]
    gemma = oracles["gemma"].tokenizer(PROMPTS[0])["input_ids"]
    # smollm2 is used every half second throughout (a load of either model can take longer
    # than the idle timeout on this machine); gemma idles past the timeout.
    done = threading.Event()

    def keep_using_smollm2():
        while not done.is_set():
            complete_all(server.url, [("smollm2", smol)])
            done.wait(0.5)

    pinger = threading.Thread(target=keep_using_smollm2)
    pinger.start()
    try:
        complete_all(server.url, [("smollm2", smol)])
        (first, _), = complete_all(server.url, [("gemma", gemma)])
        assert states(server.url) == {"smollm2": True, "gemma": True}
        both = tree_rss_mb(server.proc.pid)
        deadline = time.monotonic() + IDLE_S + 60
        while states(server.url)["gemma"]:
            assert time.monotonic() < deadline, "gemma was not unloaded when idle"
            time.sleep(0.5)
        time.sleep(1)  # (its processes' exit)
        one = tree_rss_mb(server.proc.pid)
        assert states(server.url) == {"smollm2": True, "gemma": False}
        # Gemma's worker holds its 253 MB file's weights (interleaved, ~1.2x) and a runtime.
        assert both - one > 200, (both, one)
        print(f"\nserver tree RSS: both models {both:.0f} MB, after gemma's idle unload "
              f"{one:.0f} MB")
        # The next request for it loads it again and gets the same greedy tokens as before.
        (again, _), = complete_all(server.url, [("gemma", gemma)])
        assert again == first
    finally:
        done.set()
        pinger.join()
