"""Prometheus metrics, with vLLM's names under a `loom:` prefix.

The scheduler's gauges and totals arrive with every ResponseBatch (SchedulerStats); counters
advance by the difference to the previous totals.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from serialization.messages import SchedulerStats


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"loom:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"loom:{name}", doc, labels, registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self._counters = {
            "num_preemptions_total": counter("num_preemptions", "Preemptions of running requests."),
            "prompt_tokens_total": counter("prompt_tokens", "Prompt tokens prefilled."),
            "generation_tokens_total": counter("generation_tokens", "Tokens generated."),
            "prefix_cache_queries_total": counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            "prefix_cache_hits_total": counter("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
        }
        self._last = SchedulerStats()

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        for field, counter in self._counters.items():
            delta = getattr(stats, field) - getattr(self._last, field)
            if delta > 0:
                counter.inc(delta)
        self._last = stats

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
