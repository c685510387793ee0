"""Two loom replicas behind the SGLang Model Gateway (sglang-router, cache-aware policy), all real
processes on loopback: requests through the router succeed (official openai client, streamed
and not), a shared prefix keeps landing on the replica that caches it, and a replica killed
under load fails only the requests it held."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import free_port, start_server

pytest.importorskip("sglang_router")
openai = pytest.importorskip("openai")


class Router:
    def __init__(self, worker_urls: list[str]) -> None:
        self.port = free_port()
        self.log_path = f"/tmp/loom-test-router-{self.port}.log"
        # Health checked every second and dropped at the first failure, as the Kubernetes
        # manifest runs it: a dead replica stops getting requests within a couple of seconds.
        cmd = [sys.executable, "-m", "sglang_router.launch_router",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-urls", *worker_urls, "--policy", "cache_aware",
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--cb-failure-threshold", "1", "--worker-startup-check-interval", "1",
               "--worker-startup-timeout-secs", "60", "--shutdown-grace-period-secs", "1",
               "--log-level", "warn"]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "w"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self._healthy():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            workers = httpx.get(self.url + "/workers", timeout=1).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return len(workers) == 2 and all(w["is_healthy"] for w in workers)

    def healthy_workers(self) -> set[str]:
        workers = httpx.get(self.url + "/workers", timeout=2).json()["workers"]
        return {w["url"] for w in workers if w["is_healthy"]}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tiny_server):
    # The replica killed below is this module's own; the other is the session's shared tiny
    # server (its counters are read as deltas here).
    victim = start_server(tiny_model_dir, "--served-model-name", "tiny", "--max-num-seqs", "8")
    replicas = [victim, tiny_server]
    router = Router([r.url for r in replicas])
    yield router, replicas
    router.stop()
    victim.stop()


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def client(router: Router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_requests_through_the_router(cluster):
    router, _ = cluster
    c = client(router)
    done = c.completions.create(model="tiny", prompt="hello there", max_tokens=6,
                                temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
    chunks = list(c.completions.create(model="tiny", prompt="hello there", max_tokens=6,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == done.choices[0].text
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    stream = c.chat.completions.create(model="tiny", max_tokens=4, temperature=0, stream=True,
                                       messages=[{"role": "user", "content": "hi"}])
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == chat.choices[0].message.content


def test_shared_prefix_stays_on_one_replica(cluster):
    router, replicas = cluster
    c = client(router)
    prefix = ("You are a meticulous assistant for the weaving guild. Answer questions about "
              "looms, warps, wefts, heddles and shuttles with care and in plain words. ") * 4
    names = ("loom:request_success_total", "loom:prefix_cache_hits_total")
    before = [[metric(r.url, n) for n in names] for r in replicas]
    for i in range(6):
        c.completions.create(model="tiny", prompt=f"{prefix}Question {i}: what is a heddle?",
                             max_tokens=2, temperature=0)
    after = [[metric(r.url, n) for n in names] for r in replicas]
    served = [a[0] - b[0] for a, b in zip(after, before)]
    hits = [a[1] - b[1] for a, b in zip(after, before)]
    assert sorted(served) == [0, 6], served  # every one of them on the same replica
    home = served.index(6)
    # The five after the first found the prefix's blocks there (more than 100 tokens each).
    assert hits[home] >= 5 * 100 and hits[1 - home] == 0, hits


def test_killed_replica_fails_only_its_own_requests(cluster):
    router, replicas = cluster
    c = client(router)
    victim, survivor = replicas
    words = ("amber", "basalt", "cobalt", "dune", "ember", "fjord", "granite", "harbor")

    def stream(word: str) -> str:
        try:
            for _ in c.completions.create(model="tiny", prompt=f"{word} tales", max_tokens=700,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}):
                pass
            return "ok"
        except Exception:  # an APIError, or (older openai releases) the transport's own error
            return "failed"  # for a body cut short

    with ThreadPoolExecutor(len(words)) as pool:
        results = [pool.submit(stream, w) for w in words]
        deadline = time.monotonic() + 20
        while True:  # every request is running on one replica or the other
            held = [metric(r.url, "loom:num_requests_running") for r in replicas]
            if sum(held) == len(words):
                break
            assert time.monotonic() < deadline, held
            time.sleep(0.05)
        victim.proc.send_signal(signal.SIGKILL)  # its children die with it
        outcomes = [r.result(timeout=60) for r in results]
    assert held[0] > 0, f"the router sent the victim nothing: {held}"
    assert outcomes.count("failed") == held[0], (outcomes, held)

    deadline = time.monotonic() + 15
    while victim.url in router.healthy_workers():
        assert time.monotonic() < deadline, "the router never noticed the dead replica"
        time.sleep(0.2)
    for i in range(8):
        r = c.completions.create(model="tiny", prompt=f"{words[i]} again", max_tokens=3)
        assert r.choices[0].finish_reason == "length"
    assert survivor.proc.poll() is None
