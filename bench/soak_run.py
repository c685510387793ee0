"""The soak's run against one server: warm-up, KV-touch pass and load phases in order, and
what is read beside them: the server's gauges from /metrics (until it is idle), the RSS of
its processes, other processes' CPU, and a timeline of all three every --sample-interval."""

from __future__ import annotations

import asyncio
import time

import httpx

from bench import log
from bench.endpoint import http_client
from bench.interference import InterferenceMonitor
from bench.proc_memory import snapshot
from bench.server_metrics import by_label, parse_series, scrape, series_total
from bench.soak_load import Phase, outcome_row, run_phase, summarize_phase
from bench.soak_mix import Spec, kv_touch_spec, make_spec


# ---- the server's view --------------------------------------------------------------------------
def label_delta(before: dict | None, after: dict | None, name: str, label: str) -> dict[str, int]:
    b, a = by_label(before, name, label), by_label(after, name, label)
    return {k: int(a[k] - b.get(k, 0)) for k in sorted(a) if a[k] - b.get(k, 0)}

def gauges(metrics: dict | None) -> dict:
    return {"kv_cache_usage_perc": series_total(metrics, "loom:kv_cache_usage_perc"),
            "num_requests_running": series_total(metrics, "loom:num_requests_running"),
            "num_requests_waiting": series_total(metrics, "loom:num_requests_waiting")}


async def wait_idle(client, base_url: str, timeout: float, settle: float = 3.0) -> dict:
    """Poll /metrics until the KV cache is empty and nothing runs or waits, then check it
    stays so for `settle` s. Returns the last reading and how long it took."""
    started = time.monotonic()
    reading, idle_since = {}, None
    while True:
        metrics = await scrape(client, base_url, parse_series)
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
        self.foreign = InterferenceMonitor()  # other processes' CPU: not ours, not the server's
        if server_pid:
            self.foreign.count_as_ours(server_pid)
        self._foreign_last = (0.0, time.monotonic())
        self.current: Phase | None = None
        self.t0 = time.monotonic()

    def rss(self) -> list[dict]:
        if not self.server_pid:
            return []
        return snapshot(self.server_pid, (self.kv_info or {}).get("kv_bytes"))

    async def sampler(self, client) -> None:
        while True:
            await asyncio.sleep(self.args.sample_interval)
            reading = gauges(await scrape(client, self.base_url, parse_series))
            foreign = self.foreign_cores()
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

    def foreign_cores(self) -> float | None:
        """Other processes' CPU since the last call, in cores."""
        total, now = self.foreign.sample(), time.monotonic()
        (last_total, last_t), self._foreign_last = self._foreign_last, (total, now)
        return (total - last_total) / (now - last_t) if now > last_t else None

    async def phase(self, client, name: str, specs: list, deadline: float) -> dict:
        phase = self.current = Phase(name, specs)
        self.foreign.mark(name)
        log(f"soak: {name}: {len(specs)} requests at concurrency {self.args.concurrency}")
        try:
            await run_phase(client, self.base_url, phase, self.args.concurrency, deadline,
                            self.args.grace, self.args.request_timeout)
        finally:
            summary = summarize_phase(phase)
            self.results.setdefault("phases", {})[name] = summary
            if name == "load":
                self.results["load_outcomes_sample"] = [
                    outcome_row(o) for o in phase.outcomes if o.status != "ok"][:500]
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
        with self.foreign:
            self._foreign_last = (self.foreign.sample(), time.monotonic())
            async with http_client(limits=limits, timeout=timeout) as client:
                sampler = asyncio.create_task(self.sampler(client))
                try:
                    await self.measure(client, deadline)
                finally:
                    sampler.cancel()
                    await asyncio.gather(sampler, return_exceptions=True)
                    self.foreign.mark("done")
                    results["foreign_cpu"] = self.foreign.overall()
                    results["foreign_cpu_by_phase"] = self.foreign.summary()

    async def measure(self, client, deadline: float) -> None:
        """The phases, and the server's state before and after the load."""
        args, results = self.args, self.results
        m_start = await scrape(client, self.base_url, parse_series)
        results["metrics_available"] = m_start is not None
        warm = [make_spec(args.seed, "warmup", i, self.model, args.cancel_fraction)
                for i in range(args.warmup)]
        if warm:
            await self.phase(client, "warmup", warm, deadline)
        touch = self.kv_touch_specs()
        if touch:
            await self.phase(client, "kv-touch", touch, deadline)
        log("soak: waiting for the server to go idle before measuring RSS")
        self.foreign.mark("idle-before")
        before_idle = await wait_idle(client, self.base_url, args.idle_timeout)
        results["idle_before"] = {k: v for k, v in before_idle.items() if k != "metrics"}
        results["rss_before"] = self.rss()
        m_before = before_idle["metrics"]
        specs = [make_spec(args.seed, "load", i, self.model, args.cancel_fraction)
                 for i in range(args.requests)]
        await self.phase(client, "load", specs, deadline)
        self.current = None
        self.foreign.mark("idle-after")
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

    def kv_touch_specs(self) -> list[Spec]:
        info = self.kv_info
        if self.args.no_kv_touch or not info:
            return []
        length = 1000
        blocks_each = -(-(length + 1) // info["block_size"])
        count = -(-info["num_blocks"] // blocks_each) + 2
        return [kv_touch_spec(self.args.seed, i, self.model, length) for i in range(count)]


def _delta(before: dict | None, after: dict | None, name: str) -> int | None:
    a, b = series_total(after, name), series_total(before, name)
    return int(a - b) if a is not None and b is not None else None
