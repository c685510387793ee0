"""`python -m bench.soak`: a long mixed load, then a check that nothing leaked.

Sends --requests (default 10,000) mixed requests (see bench/soak_mix.py: completions and chat,
streamed or not, 5-1,000-token prompts, 1-200-token outputs, stop strings, temperatures 0 and
1 with seeds, ~10 % cancelled by the client mid-way) at a bounded concurrency, after a warm-up,
and reports:

- errors: requests that failed other than by their deliberate cancellation (target 0), by
  cause, and requests/s;
- leaked KV blocks: once the load has ended and the server is idle, loom:kv_cache_usage_perc
  must be back to 0 and loom:num_requests_running / _waiting too;
- the RSS of every loom process (the API server and its children, from /proc) after the
  warm-up and after the load, and its growth (target < 5 %).

The warm-up is --warmup mixed requests plus, when the server's log says how many KV blocks it
has, one pass of long max_tokens=1 prompts that hands every KV block out once: the KV cache is
a zero-filled mapping that becomes resident block by block, and without that pass the worker's
RSS would "grow" by the part of the cache the warm-up had not reached yet. The worker's RSS
outside that mapping is reported as well.

Bounded: no new request after --max-time seconds (warm-up included); requests still running
--grace seconds later are cancelled and reported as cut off; every request has a
--request-timeout. Traffic goes to 127.0.0.1 only.

Examples:
  python -m bench.soak --requests 300                 # a quick check
  python -m bench.soak                                # the full soak (10,000 requests)
  python -m bench.soak --url http://127.0.0.1:8000 --requests 2000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from bench.endpoint import NotLoopbackError, http_client, loopback_base_url, served_model
from bench.environment import busy_warning, cpu_busy_share, describe_environment
from bench.interference import TICKS, _ours, _read_procs, wait_until_idle
from bench.proc_memory import listening_pid, snapshot
from bench.soak_mix import Spec, check_result, kv_touch_spec, make_spec
from bench.stats import percentile

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_DIR, "bench", "results")
RSS_TARGET = 0.05
KV_LINE = re.compile(r"KV cache ([\d.]+) GiB = (\d+) blocks x (\d+)")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000, help="requests after the warm-up")
    p.add_argument("--warmup", type=int, default=200, help="mixed warm-up requests")
    p.add_argument("--no-kv-touch", action="store_true",
                   help="skip the warm-up pass that makes the whole KV cache resident")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--max-time", type=float, default=3600.0,
                   help="seconds (warm-up included) after which no new request is sent")
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds requests still running at --max-time get before being cut off")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds after which a request counts as failed (client timeout)")
    p.add_argument("--cancel-fraction", type=float, default=0.10,
                   help="share of requests the client abandons mid-way")
    p.add_argument("--seed", type=int, default=2024, help="seed of the request mix")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds to wait for the server to report an empty KV cache and no "
                        "running or waiting request once the load has ended")
    p.add_argument("--sample-interval", type=float, default=30.0,
                   help="seconds between progress lines / timeline samples (metrics, RSS)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before starting, wait up to this long for other processes to leave "
                        "the CPUs alone (they are reported either way)")
    p.add_argument("--url", default=None,
                   help="drive this running server (127.0.0.1 only) instead of starting loom")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --url: the API server's pid, for RSS (default: whoever listens "
                        "on the port)")
    p.add_argument("--server-log", default=None,
                   help="with --url: the server's log, for its KV cache size and warnings")
    p.add_argument("--model", default=None,
                   help="model name sent in requests; default: the first of GET /v1/models")
    p.add_argument("--model-dir", default=None, help="checkpoint for loom serve --model")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--serve-args", default="", help='extra `loom serve` flags, e.g. '
                   '"--max-num-seqs 32"')
    p.add_argument("--out", default=None,
                   help="JSON path; default bench/results/soak-<timestamp>.json")
    return p


# ---- one request --------------------------------------------------------------------------------
@dataclass
class Outcome:
    spec: Spec
    status: str = "pending"  # ok | cancelled | error | cut
    category: str | None = None
    detail: str | None = None
    started: float = 0.0
    ended: float | None = None
    first_text: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cancel_too_late: bool = False  # a cancellation the server's answer beat

    def fail(self, category: str, detail: str) -> None:
        self.status, self.category, self.detail = "error", category, detail[:300]

    def cancelled(self, how: str) -> None:
        self.status, self.category = "cancelled", how

    @property
    def e2e(self) -> float | None:
        return self.ended - self.started if self.ended is not None else None

    @property
    def ttft(self) -> float | None:
        return self.first_text - self.started if self.first_text is not None else None


def _error_message(raw: bytes | str) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        body = json.loads(text)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return str(body["error"].get("message"))
    except ValueError:
        pass
    return text.strip()[:200]


def _take_choices(spec: Spec, chunk: dict, texts: dict, finish: dict) -> bool:
    """Adds a chunk's (or a whole body's) choices; True if it carried text."""
    carried = False
    for choice in chunk.get("choices") or []:
        index = choice.get("index", 0)
        if spec.route == "completions":
            text = choice.get("text")
        else:
            text = (choice.get("delta") or choice.get("message") or {}).get("content")
        if text:
            texts[index] = texts.get(index, "") + text
            carried = True
        if choice.get("finish_reason"):
            finish[index] = choice["finish_reason"]
    return carried


def _finish_ok(out: Outcome, texts: dict, finish: dict, usage: dict | None) -> None:
    out.ended = time.perf_counter()
    if usage:
        out.prompt_tokens = usage.get("prompt_tokens")
        out.completion_tokens = usage.get("completion_tokens")
    problem = check_result(out.spec, texts, finish, usage)
    if problem:
        out.fail("invalid response", problem)
    else:
        out.status = "ok"


async def _streamed(client, url: str, out: Outcome) -> None:
    spec = out.spec
    close_after = spec.cancel[1] if spec.cancel and spec.cancel[0] == "close" else None
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    async with client.stream("POST", url, json=spec.body) as response:
        if response.status_code != 200:
            out.fail(f"HTTP {response.status_code}", _error_message(await response.aread()))
            return
        if close_after == 0:
            out.cancelled("stream closed after the headers")
            return
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                out.fail("bad SSE event", data[:200])
                return
            events += 1
            if "error" in chunk:
                out.fail("error event in stream", _error_message(json.dumps(chunk)))
                return
            if _take_choices(spec, chunk, texts, finish) and out.first_text is None:
                out.first_text = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
            if close_after is not None and events >= close_after:
                out.cancelled("stream closed mid-way")
                return
        else:
            out.fail("stream ended without [DONE]", f"after {events} events")
            return
    out.cancel_too_late = close_after is not None
    _finish_ok(out, texts, finish, usage)


async def _plain(client, url: str, out: Outcome) -> None:
    spec = out.spec
    request = client.post(url, json=spec.body)
    if spec.cancel and spec.cancel[0] == "timeout":
        try:
            response = await asyncio.wait_for(request, spec.cancel[1])
        except asyncio.TimeoutError:
            out.cancelled("timed out by the client")
            return
        out.cancel_too_late = True
    else:
        response = await request
    if response.status_code != 200:
        out.fail(f"HTTP {response.status_code}", _error_message(response.content))
        return
    try:
        body = response.json()
    except ValueError:
        out.fail("bad JSON body", response.text[:200])
        return
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    _take_choices(spec, body, texts, finish)
    out.first_text = None
    _finish_ok(out, texts, finish, body.get("usage"))


async def run_one(client, base_url: str, spec: Spec, request_timeout: float) -> Outcome:
    out = Outcome(spec)
    out.started = time.perf_counter()
    url = base_url + spec.path
    try:
        await asyncio.wait_for((_streamed if spec.stream else _plain)(client, url, out),
                               request_timeout)
    except asyncio.TimeoutError:
        out.fail("client timeout", f"no answer in {request_timeout:g} s")
    except httpx.HTTPError as exc:
        out.fail(f"transport: {type(exc).__name__}", str(exc) or type(exc).__name__)
    except asyncio.CancelledError:
        out.status, out.category = "cut", "cut off at the time bound"
        raise
    except Exception as exc:  # noqa: BLE001 - a bug or a surprise: fails one request, not the run
        out.fail(f"exception: {type(exc).__name__}", str(exc))
    if out.ended is None:
        out.ended = time.perf_counter()
    return out


# ---- a phase: N requests at concurrency C -------------------------------------------------------
@dataclass
class Phase:
    name: str
    specs: list
    outcomes: list = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0


async def run_phase(client, base_url: str, phase: Phase, concurrency: int, deadline: float,
                    grace: float, request_timeout: float) -> None:
    """Closed loop: `concurrency` clients each take the next spec when their last request ends.
    Nothing new is sent after `deadline`; what still runs at deadline + grace is cut off."""
    phase.started = time.perf_counter()
    next_index = 0
    in_flight: dict[int, Outcome] = {}

    async def client_loop() -> None:
        nonlocal next_index
        while next_index < len(phase.specs) and time.monotonic() < deadline:
            spec = phase.specs[next_index]
            next_index += 1
            task = asyncio.current_task()
            in_flight[id(task)] = Outcome(spec, status="cut", category="cut off at the time bound",
                                          started=time.perf_counter())
            try:
                phase.outcomes.append(await run_one(client, base_url, spec, request_timeout))
            finally:
                in_flight.pop(id(task), None)

    tasks = [asyncio.create_task(client_loop()) for _ in range(concurrency)]
    hard_stop = max(0.0, deadline + grace - time.monotonic())
    done, pending = await asyncio.wait(tasks, timeout=hard_stop)
    for task in pending:
        outcome = in_flight.get(id(task))
        task.cancel()
        if outcome is not None:
            outcome.ended = time.perf_counter()
            phase.outcomes.append(outcome)
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        if task.exception() is not None:
            raise task.exception()
    phase.ended = time.perf_counter()


def summarize_phase(phase: Phase) -> dict:
    outs = phase.outcomes
    wall = max(phase.ended - phase.started, 1e-9)
    ok = [o for o in outs if o.status == "ok"]
    errors = [o for o in outs if o.status == "error"]
    by_status = Counter(o.status for o in outs)
    e2e = [o.e2e for o in ok if o.e2e is not None]
    ttft = [o.ttft for o in ok if o.ttft is not None and o.spec.stream]
    tokens = sum(o.completion_tokens or 0 for o in outs if o.status in ("ok",))
    kinds: dict[str, Counter] = {}
    for o in outs:
        kinds.setdefault(o.spec.kind, Counter())[o.status] += 1
    breakdown = Counter((o.category, o.detail) for o in errors)
    examples: dict[str, list] = {}
    for o in errors:
        examples.setdefault(f"{o.category}: {o.detail}", []).append(
            {"index": o.spec.index, "kind": o.spec.kind, "prompt_kind": o.spec.prompt_kind,
             "size": o.spec.size, "max_tokens": o.spec.max_tokens, "n": o.spec.n,
             "stop": o.spec.stop, "cancel": o.spec.cancel})
    return {
        "name": phase.name,
        "planned": len(phase.specs),
        "sent": len(outs),
        "ok": by_status["ok"],
        "cancelled": by_status["cancelled"],
        "errors": by_status["error"],
        "cut_off": by_status["cut"],
        "cancel_too_late": sum(1 for o in outs if o.cancel_too_late),
        "cancelled_by": dict(Counter(o.category for o in outs if o.status == "cancelled")),
        "error_breakdown": [{"category": c, "detail": d, "count": n}
                            for (c, d), n in breakdown.most_common()],
        "error_examples": {k: v[:5] for k, v in examples.items()},
        "wall_s": wall,
        "requests_s": (len(outs) - by_status["cut"]) / wall,
        "ok_requests_s": len(ok) / wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "prompt_tokens": sum(o.prompt_tokens or 0 for o in ok),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "e2e_max_s": max(e2e) if e2e else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "by_kind": {k: dict(v) for k, v in sorted(kinds.items())},
        "by_size": {s: dict(Counter(o.status for o in outs if o.spec.size == s))
                    for s in ("short", "medium", "long")},
    }


# ---- the server's view --------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """name -> {labels: value} for every loom: series."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith("loom:"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        try:
            out.setdefault(name, {})[labels.rstrip("}")] = float(value)
        except ValueError:
            continue
    return out


def metric(metrics: dict | None, name: str) -> float | None:
    if not metrics or name not in metrics:
        return None
    return sum(metrics[name].values())


def by_label(metrics: dict | None, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in ((metrics or {}).get(name) or {}).items():
        match = re.search(rf'{label}="([^"]*)"', labels)
        if match:
            out[match.group(1)] = out.get(match.group(1), 0.0) + value
    return out


def label_delta(before: dict | None, after: dict | None, name: str, label: str) -> dict[str, int]:
    b, a = by_label(before, name, label), by_label(after, name, label)
    return {k: int(a[k] - b.get(k, 0)) for k in sorted(a) if a[k] - b.get(k, 0)}


async def scrape(client, base_url: str) -> dict | None:
    try:
        response = await client.get(f"{base_url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return parse_metrics(response.text) if response.status_code == 200 else None


def gauges(metrics: dict | None) -> dict:
    return {"kv_cache_usage_perc": metric(metrics, "loom:kv_cache_usage_perc"),
            "num_requests_running": metric(metrics, "loom:num_requests_running"),
            "num_requests_waiting": metric(metrics, "loom:num_requests_waiting")}


async def wait_idle(client, base_url: str, timeout: float, settle: float = 3.0) -> dict:
    """Poll /metrics until the KV cache is empty and nothing runs or waits, then check it
    stays so for `settle` s. Returns the last reading and how long it took."""
    started = time.monotonic()
    reading, idle_since = {}, None
    while True:
        metrics = await scrape(client, base_url)
        reading = gauges(metrics)
        idle = metrics is not None and all(v == 0 for v in reading.values())
        now = time.monotonic()
        if idle:
            idle_since = idle_since or now
            if now - idle_since >= settle:
                break
        else:
            idle_since = None
        if now - started > timeout + settle:
            break
        await asyncio.sleep(0.5)
    reading["idle"] = idle_since is not None
    reading["seconds_to_idle"] = (idle_since - started) if idle_since else None
    reading["metrics"] = metrics
    return reading


# ---- other processes' CPU -----------------------------------------------------------------------
class ForeignCpu:
    """CPU-seconds of processes that are neither ours nor the server's (the other engineer's
    tests, say): sampled at the start and at each timeline sample."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = [r for r in roots if r]
        self.last = _read_procs()
        self.last_t = time.monotonic()
        self.cpu_s = 0.0
        self.wall_s = 0.0
        self.max_cores = 0.0

    def sample(self) -> float | None:
        procs, now = _read_procs(), time.monotonic()
        ticks = sum(t - self.last.get(pid, (0, 0))[1] for pid, (_, t) in procs.items()
                    if not any(_ours(pid, procs, root) for root in self.roots))
        wall = now - self.last_t
        self.last, self.last_t = procs, now
        if wall <= 0:
            return None
        cores = ticks / TICKS / wall
        self.cpu_s += ticks / TICKS
        self.wall_s += wall
        self.max_cores = max(self.max_cores, cores)
        return cores

    def summary(self) -> dict:
        return {"foreign_cpu_cores_mean": self.cpu_s / self.wall_s if self.wall_s else None,
                "foreign_cpu_cores_max": self.max_cores, "seconds": self.wall_s}


# ---- the run ------------------------------------------------------------------------------------
class Soak:
    def __init__(self, args, base_url: str, model: str, server_pid: int | None,
                 kv_info: dict | None, results: dict) -> None:
        self.args = args
        self.base_url = base_url
        self.model = model
        self.server_pid = server_pid
        self.kv_info = kv_info
        self.results = results
        self.timeline: list[dict] = results.setdefault("timeline", [])
        self.foreign = ForeignCpu([os.getpid(), server_pid or 0])
        self.current: Phase | None = None
        self.t0 = time.monotonic()

    def rss(self) -> list[dict]:
        if not self.server_pid:
            return []
        return snapshot(self.server_pid, (self.kv_info or {}).get("kv_bytes"))

    async def sampler(self, client) -> None:
        while True:
            await asyncio.sleep(self.args.sample_interval)
            reading = gauges(await scrape(client, self.base_url))
            foreign = self.foreign.sample()
            rss = self.rss()
            phase = self.current
            done = len(phase.outcomes) if phase else 0
            errors = sum(o.status == "error" for o in phase.outcomes) if phase else 0
            elapsed = time.perf_counter() - phase.started if phase else 0
            self.timeline.append({
                "t_s": round(time.monotonic() - self.t0, 1), "phase": phase.name if phase else None,
                "done": done, "errors": errors, **reading, "foreign_cpu_cores": foreign,
                "rss_kb": {f"{r['role']}:{r['pid']}": r["rss_kb"] for r in rss},
            })
            kv = reading["kv_cache_usage_perc"]
            rss_text = " ".join(f"{r['role']} {r['rss_kb'] / 1024:.0f}MB" for r in rss)
            log(f"soak: [{phase.name if phase else '-'}] {done}/{len(phase.specs) if phase else 0}"
                f" done, {errors} errors, {done / max(elapsed, 1e-9):.2f} req/s, kv "
                f"{(kv or 0) * 100:.1f}%, running {reading['num_requests_running']}, waiting "
                f"{reading['num_requests_waiting']}, foreign CPU {foreign or 0:.2f} cores | "
                f"{rss_text}")

    async def phase(self, client, name: str, specs: list, deadline: float) -> dict:
        phase = self.current = Phase(name, specs)
        log(f"soak: {name}: {len(specs)} requests at concurrency {self.args.concurrency}")
        try:
            await run_phase(client, self.base_url, phase, self.args.concurrency, deadline,
                            self.args.grace, self.args.request_timeout)
        finally:
            summary = summarize_phase(phase)
            self.results.setdefault("phases", {})[name] = summary
            if name == "load":
                self.results["load_outcomes_sample"] = [
                    _outcome_row(o) for o in phase.outcomes if o.status != "ok"][:500]
        log(f"soak: {name}: {summary['ok']} ok, {summary['cancelled']} cancelled, "
            f"{summary['errors']} errors, {summary['cut_off']} cut off in "
            f"{summary['wall_s']:.0f} s ({summary['requests_s']:.2f} req/s)")
        return summary

    async def run(self) -> None:
        args, results = self.args, self.results
        limits = httpx.Limits(max_connections=args.concurrency + 8,
                              max_keepalive_connections=args.concurrency + 8)
        timeout = httpx.Timeout(args.request_timeout, connect=10.0)
        deadline = time.monotonic() + args.max_time
        async with http_client(limits=limits, timeout=timeout) as client:
            sampler = asyncio.create_task(self.sampler(client))
            try:
                m_start = await scrape(client, self.base_url)
                results["metrics_available"] = m_start is not None
                warm = [make_spec(args.seed, "warmup", i, self.model, args.cancel_fraction)
                        for i in range(args.warmup)]
                if warm:
                    await self.phase(client, "warmup", warm, deadline)
                touch = self.kv_touch_specs()
                if touch:
                    await self.phase(client, "kv-touch", touch, deadline)
                log("soak: waiting for the server to go idle before measuring RSS")
                before_idle = await wait_idle(client, self.base_url, args.idle_timeout)
                results["idle_before"] = {k: v for k, v in before_idle.items() if k != "metrics"}
                results["rss_before"] = self.rss()
                m_before = before_idle["metrics"]
                specs = [make_spec(args.seed, "load", i, self.model, args.cancel_fraction)
                         for i in range(args.requests)]
                await self.phase(client, "load", specs, deadline)
                self.current = None
                log("soak: load done; waiting for the server to go idle")
                after = await wait_idle(client, self.base_url, args.idle_timeout)
                m_after = after.pop("metrics")
                results["idle_after"] = after
                results["rss_after"] = self.rss()
                results["server_counts_load"] = {
                    "finished_reason": label_delta(m_before, m_after, "loom:request_success_total",
                                                   "finished_reason"),
                    "http_status": label_delta(m_before, m_after, "loom:http_requests_total",
                                               "status"),
                    "preemptions": _delta(m_before, m_after, "loom:num_preemptions_total"),
                    "prefix_cache_hit_tokens": _delta(m_before, m_after,
                                                      "loom:prefix_cache_hits_total"),
                    "prompt_tokens": _delta(m_before, m_after, "loom:prompt_tokens_total"),
                    "generation_tokens": _delta(m_before, m_after,
                                                "loom:generation_tokens_total"),
                }
                try:
                    health = await client.get(f"{self.base_url}/health", timeout=10.0)
                    results["health_after"] = health.status_code
                except httpx.HTTPError as exc:
                    results["health_after"] = f"{type(exc).__name__}: {exc}"
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
                self.foreign.sample()
                results["foreign_cpu"] = self.foreign.summary()

    def kv_touch_specs(self) -> list[Spec]:
        info = self.kv_info
        if self.args.no_kv_touch or not info:
            return []
        length = 1000
        blocks_each = -(-(length + 1) // info["block_size"])
        count = -(-info["num_blocks"] // blocks_each) + 2
        return [kv_touch_spec(self.args.seed, i, self.model, length) for i in range(count)]


def _delta(before: dict | None, after: dict | None, name: str) -> int | None:
    a, b = metric(after, name), metric(before, name)
    return int(a - b) if a is not None and b is not None else None


def _outcome_row(o: Outcome) -> dict:
    return {"index": o.spec.index, "kind": o.spec.kind, "status": o.status,
            "category": o.category, "detail": o.detail, "cancel": o.spec.cancel,
            "e2e_s": round(o.e2e, 3) if o.e2e is not None else None}


# ---- the report ---------------------------------------------------------------------------------
def kv_info_from_log(path: str | None) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        for line in f:
            match = KV_LINE.search(line)
            if match:
                gib, blocks, size = float(match.group(1)), int(match.group(2)), int(match.group(3))
                return {"kv_gib": gib, "kv_bytes": int(gib * (1 << 30)), "num_blocks": blocks,
                        "block_size": size}
    return None


def scan_log(path: str | None) -> dict | None:
    """Warnings, errors and tracebacks in the server log, grouped by message."""
    if not path or not os.path.exists(path):
        return None
    groups: Counter = Counter()
    first_seen: dict[str, str] = {}
    tracebacks = 0
    with open(path, errors="replace") as f:
        for line in f:
            text = line.rstrip("\n")
            if text.startswith("Traceback"):
                tracebacks += 1
            if not re.search(r"\b(WARNING|ERROR|CRITICAL|Traceback|Exception|Error:)", text):
                continue
            # Group by message: drop the timestamp and numbers.
            key = re.sub(r"^\d{4}-\d\d-\d\d [\d:,]+ ", "", text)
            key = re.sub(r"\d+", "N", key)[:200]
            groups[key] += 1
            first_seen.setdefault(key, text[:300])
    return {"path": path, "tracebacks": tracebacks,
            "messages": [{"count": n, "example": first_seen[k]} for k, n in groups.most_common(20)]}


def growth_rows(before: list[dict], after: list[dict]) -> list[dict]:
    after_by_pid = {r["pid"]: r for r in after}
    rows = []
    for b in before:
        a = after_by_pid.get(b["pid"])
        row = {"role": b["role"], "pid": b["pid"], "rss_before_kb": b["rss_kb"],
               "rss_after_kb": a["rss_kb"] if a else None,
               "growth": (a["rss_kb"] / b["rss_kb"] - 1) if a and b["rss_kb"] else None,
               "hwm_after_kb": a.get("hwm_kb") if a else None}
        if "rss_excl_kv_kb" in b and a and "rss_excl_kv_kb" in a:
            row.update(excl_kv_before_kb=b["rss_excl_kv_kb"], excl_kv_after_kb=a["rss_excl_kv_kb"],
                       excl_kv_growth=a["rss_excl_kv_kb"] / b["rss_excl_kv_kb"] - 1,
                       kv_rss_before_kb=b["kv_rss_kb"], kv_rss_after_kb=a["kv_rss_kb"],
                       kv_mapping_kb=b["kv_mapping_kb"])
        rows.append(row)
    for a in after:
        if a["pid"] not in {b["pid"] for b in before}:
            rows.append({"role": a["role"], "pid": a["pid"], "rss_before_kb": None,
                         "rss_after_kb": a["rss_kb"], "growth": None, "new_process": True})
    return rows


def _f(value, fmt: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def _mb(kb) -> str:
    return "-" if kb is None else f"{kb / 1024:.1f}"


def verdicts(results: dict) -> dict:
    phases = results.get("phases") or {}
    errors = sum(p["errors"] for p in phases.values())
    idle = results.get("idle_after") or {}
    kv = idle.get("kv_cache_usage_perc")
    rows = results.get("rss_growth") or []
    judged = [r for r in rows if r.get("growth") is not None and r["role"] != "resource-tracker"]
    worst = max((r["growth"] for r in judged), default=None)
    return {
        "errors": errors,
        "errors_ok": errors == 0,
        "idle_ok": bool(idle.get("idle")),
        "leaked_blocks": results.get("leaked_blocks"),
        "rss_growth_max": worst,
        "rss_ok": worst is not None and worst < RSS_TARGET,
        "complete": not results.get("interrupted") and all(
            p["sent"] == p["planned"] and p["cut_off"] == 0 for p in phases.values()),
    } | ({"kv_cache_usage_after": kv} if kv is not None else {})


def render(results: dict) -> str:
    cfg = results["config"]
    lines = [(f"soak: {cfg['requests']} requests (+{cfg['warmup']} warm-up) at concurrency "
              f"{cfg['concurrency']} against {results.get('model', '?')} "
              f"({results.get('url', '?')}), seed {cfg['seed']}")]
    if results.get("startup_s") is not None:
        lines.append(f"server start-up: {results['startup_s']:.1f} s; command: "
                     f"{' '.join(results.get('command') or [])}")
    header = (f"{'phase':<9} {'sent':>6} {'ok':>6} {'cancel':>6} {'errors':>6} {'cut':>4} "
              f"{'wall s':>7} {'req/s':>6} {'out tok/s':>9} {'E2E p50':>7} {'E2E p99':>7} "
              f"{'TTFT p50':>8} {'TTFT p99':>8}")
    lines += ["", header, "-" * len(header)]
    for name, p in (results.get("phases") or {}).items():
        lines.append(
            f"{name:<9} {p['sent']:>6} {p['ok']:>6} {p['cancelled']:>6} {p['errors']:>6} "
            f"{p['cut_off']:>4} {p['wall_s']:>7.0f} {p['requests_s']:>6.2f} "
            f"{p['output_tok_s']:>9.1f} {_f(p['e2e_p50_s']):>7} {_f(p['e2e_p99_s']):>7} "
            f"{_f(p['ttft_p50_s']):>8} {_f(p['ttft_p99_s']):>8}")
    load = (results.get("phases") or {}).get("load")
    lines.append("")
    for name, p in (results.get("phases") or {}).items():
        for e in p["error_breakdown"][:10]:
            lines.append(f"error ({name}): {e['count']} x {e['category']}: {e['detail']}")
    if load:
        kinds = ", ".join(f"{k} {sum(v.values())} ({v.get('cancelled', 0)} cancelled, "
                          f"{v.get('error', 0)} errors)" for k, v in load["by_kind"].items())
        lines.append(f"load mix: {kinds}")
        cancelled = ", ".join(f"{v} {k}" for k, v in load["cancelled_by"].items()) or "none"
        lines.append(f"load cancellations: {cancelled}; {load['cancel_too_late']} answered "
                     f"before their cancellation (checked as ordinary completions)")
    counts = results.get("server_counts_load")
    if counts:
        lines.append(f"server, load phase: finished_reason {counts['finished_reason']}, HTTP "
                     f"status {counts['http_status']}, preemptions {counts['preemptions']}, "
                     f"prefix-cache hit tokens {counts['prefix_cache_hit_tokens']}")
    idle = results.get("idle_after")
    if idle:
        kv = idle.get("kv_cache_usage_perc")
        leaked = results.get("leaked_blocks")
        total = (results.get("kv_cache") or {}).get("num_blocks")
        lines.append(
            f"after the load: kv_cache_usage_perc {_f(kv, '.4f')} (leaked blocks: "
            f"{_f(leaked, 'd')}{f' of {total}' if total else ''}), running "
            f"{_f(idle.get('num_requests_running'), '.0f')}, waiting "
            f"{_f(idle.get('num_requests_waiting'), '.0f')}; "
            + (f"idle {idle['seconds_to_idle']:.1f} s after the last request"
               if idle.get("idle") else "NOT idle within --idle-timeout")
            + f"; /health {results.get('health_after')}")
    rows = results.get("rss_growth") or []
    if rows:
        lines += ["", (f"{'process':<17} {'pid':>7} {'RSS before MB':>13} {'RSS after MB':>12} "
                       f"{'growth':>7} {'peak MB':>8}  notes")]
        for r in rows:
            note = ""
            if "excl_kv_growth" in r:
                note = (f"outside the KV cache mapping: {_mb(r['excl_kv_before_kb'])} -> "
                        f"{_mb(r['excl_kv_after_kb'])} MB ({r['excl_kv_growth']:+.1%}); KV mapping "
                        f"resident {_mb(r['kv_rss_before_kb'])} -> {_mb(r['kv_rss_after_kb'])} of "
                        f"{_mb(r['kv_mapping_kb'])} MB")
            if r.get("new_process"):
                note = "appeared during the load"
            growth = f"{r['growth']:+.1%}" if r.get("growth") is not None else "-"
            lines.append(f"{r['role']:<17} {r['pid']:>7} {_mb(r['rss_before_kb']):>13} "
                         f"{_mb(r['rss_after_kb']):>12} {growth:>7} {_mb(r.get('hwm_after_kb')):>8}"
                         f"  {note}")
        gone = [r for r in results.get("rss_before") or []
                if r["pid"] not in {a["pid"] for a in results.get("rss_after") or []}]
        for r in gone:
            lines.append(f"{r['role']} (pid {r['pid']}) is gone after the load")
    foreign = results.get("foreign_cpu") or {}
    if foreign.get("foreign_cpu_cores_mean") is not None:
        lines.append(f"\nother processes' CPU during the run: mean "
                     f"{foreign['foreign_cpu_cores_mean']:.2f} cores, max "
                     f"{foreign['foreign_cpu_cores_max']:.2f} (of {os.cpu_count()})"
                     + ("  <- numbers disturbed"
                        if foreign["foreign_cpu_cores_mean"] > 0.1 else ""))
    log_scan = results.get("server_log_scan")
    if log_scan:
        lines.append(f"server log {log_scan['path']}: {log_scan['tracebacks']} tracebacks, "
                     f"{sum(m['count'] for m in log_scan['messages'])} warning/error lines")
        for m in log_scan["messages"][:8]:
            lines.append(f"  {m['count']} x {m['example']}")
    v = results.get("verdicts") or {}
    if v:
        lines.append(
            f"\ntargets: errors {v['errors']} ({'OK' if v['errors_ok'] else 'FAIL'}); leaked KV "
            f"blocks {_f(v.get('leaked_blocks'), 'd')} / usage "
            f"{_f(v.get('kv_cache_usage_after'), '.4f')} "
            f"({'OK' if v['idle_ok'] else 'FAIL'}); RSS growth max "
            f"{_f(v['rss_growth_max'], '+.1%')} ({'OK' if v['rss_ok'] else 'FAIL'}, target < "
            f"{RSS_TARGET:.0%})" + ("" if v["complete"] else "; run INCOMPLETE"))
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------
def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def _config(args) -> dict:
    return {k: getattr(args, k) for k in (
        "requests", "warmup", "no_kv_touch", "concurrency", "max_time", "grace",
        "request_timeout", "cancel_fraction", "seed", "idle_timeout", "wait_idle", "url",
        "model_dir", "dtype", "serve_args")}


def _git_dirty(repo: str) -> int | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain"], check=False, cwd=repo,
                             capture_output=True, text=True, timeout=10)
        return len(out.stdout.splitlines())
    except (OSError, subprocess.TimeoutExpired):
        return None


def drive(args, results: dict, base_url: str, server_pid: int | None,
          log_path: str | None) -> None:
    results["url"] = base_url
    results["model"] = model = args.model or served_model(base_url)
    results["server_pid"] = server_pid
    results["kv_cache"] = kv_info = kv_info_from_log(log_path)
    if kv_info:
        log(f"soak: server KV cache: {kv_info['num_blocks']} blocks x {kv_info['block_size']} "
            f"tokens ({kv_info['kv_gib']} GiB)")
    elif not args.no_kv_touch:
        log("soak: the server's KV cache size is unknown (no log): no KV-touch pass; the "
            "worker's RSS outside the KV mapping is the number to watch")
    soak = Soak(args, base_url, model, server_pid, kv_info, results)
    asyncio.run(soak.run())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.warmup < 0:
        parser.error("--requests and --concurrency must be >= 1, --warmup >= 0")
    if args.url:
        try:
            base_url = loopback_base_url(args.url)
        except NotLoopbackError as exc:
            print(f"soak: error: {exc}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(RESULTS_DIR, f"soak-{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    log_path = os.path.splitext(out)[0] + ".server.log"
    env = describe_environment(REPO_DIR)
    env["git_dirty_files"] = _git_dirty(REPO_DIR)
    if warning := busy_warning(env):
        log(warning)
    results: dict = {"config": _config(args), "environment": env,
                     "started_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    started = time.monotonic()
    status = 0
    server_log = None
    try:
        if args.wait_idle:
            results["waited_for_idle"] = wait_until_idle(args.wait_idle, log)
            results["environment"]["cpu_busy_after_wait"] = cpu_busy_share()
        if args.url:
            port = urlsplit(base_url).port or 80
            pid = args.server_pid or listening_pid(port)
            if pid is None:
                log(f"soak: cannot find the process listening on port {port}: no RSS "
                    "(give --server-pid)")
            server_log = args.server_log
            results["started_by_soak"] = False
            drive(args, results, base_url, pid, server_log)
        else:
            from bench.server import LoomServer

            server_log = log_path
            log(f"soak: starting loom serve (log: {log_path})")
            with LoomServer(args.dtype, os.path.abspath(args.model_dir) if args.model_dir
                            else None, shlex.split(args.serve_args), log_path) as server:
                results.update(started_by_soak=True, startup_s=server.startup_s,
                               command=server.command, server_log=log_path)
                log(f"soak: healthy after {server.startup_s:.1f} s")
                try:
                    drive(args, results, server.base_url, server.process.pid, log_path)
                finally:
                    alive = server.process.poll() is None
                    results["server_alive_at_end"] = alive
                    if not alive:
                        log(f"soak: the server exited during the run (code "
                            f"{server.process.returncode})")
                stop_code = server.stop()
                results["server_exit_code"] = stop_code
    except KeyboardInterrupt:
        log("soak: interrupted; reporting what was measured")
        results["interrupted"] = True
        status = 130
    except Exception as exc:  # noqa: BLE001 - reported with what was measured so far
        log(f"soak: failed: {type(exc).__name__}: {exc}")
        results["failure"] = f"{type(exc).__name__}: {exc}"
        status = 1
    results["total_s"] = time.monotonic() - started
    idle = results.get("idle_after") or {}
    kv_usage = idle.get("kv_cache_usage_perc")
    total = (results.get("kv_cache") or {}).get("num_blocks")
    if kv_usage is not None and total:
        results["leaked_blocks"] = round(kv_usage * total)
    if results.get("rss_before") and results.get("rss_after"):
        results["rss_growth"] = growth_rows(results["rss_before"], results["rss_after"])
    results["server_log_scan"] = scan_log(server_log)
    results["verdicts"] = verdicts(results)
    print(render(results), flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    log(f"soak: wrote {out}")
    v = results["verdicts"]
    if status:
        return status
    return 0 if v["errors_ok"] and v["idle_ok"] and v["rss_ok"] and v["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
