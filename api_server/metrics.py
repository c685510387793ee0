"""Prometheus metrics, with vLLM's names under a `loom:` prefix and a `model_name` label; the
few the Gateway API Inference Extension's model-server protocol reads also under vLLM's own.

Where each number comes from:
- per-request latencies (TTFT, inter-token, end-to-end) are measured in this process, when the
  tokens arrive from the scheduler, on this process's monotonic clock;
- queue / prefill / decode times come from the scheduler's own timestamps (RequestTimings),
  intervals taken on its clock;
- gauges, totals, tokens per step and the per-step scheduling overhead arrive as SchedulerStats
  with every response batch.
"""

from __future__ import annotations

import contextlib
import re
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from pipelines.response import TextGenerationOutput
from pipelines.status import GenerationStatus
from processes.sockets import malformed_frame_counts
from serialization.messages import SchedulerStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01,
                    0.025, 0.05, 0.1)
FORWARD_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                   0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

FINISH_REASONS = {
    GenerationStatus.END_OF_SEQUENCE: "stop",
    GenerationStatus.MAXIMUM_LENGTH: "length",
    GenerationStatus.CANCELLED: "abort",
    GenerationStatus.ERROR: "error",
}


_CODE = re.compile(rb'"code":"([a-z_]{1,40})"')
_TYPE = re.compile(rb'"type":"([a-z_]{1,40})"')


def rejection_reason(body: bytes, status: int) -> str:
    """The reason label of a refused request: its error body's `code`, else its `type` (all
    our own, a bounded set); a body that has neither is labelled by the status."""
    head = body[:4096]
    match = _CODE.search(head) or _TYPE.search(head)
    return match.group(1).decode() if match else f"http_{status}"


class RequestClock:
    """Latency bookkeeping for one engine request."""

    __slots__ = ("started", "first", "last")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.first = 0.0
        self.last = 0.0


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, label = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(f"loom:{name}", doc, label, registry=reg).labels(model_name)

        def counter(name, doc):
            return Counter(f"loom:{name}", doc, label, registry=reg).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"loom:{name}", doc, label, buckets=buckets,
                             registry=reg).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self._init_inference_gateway_metrics()
        self._totals = {
            "num_preemptions_total": counter("num_preemptions", "Preemptions of running requests."),
            "prompt_tokens_total": counter("prompt_tokens", "Prompt tokens prefilled."),
            "generation_tokens_total": counter("generation_tokens", "Tokens generated."),
            "prefix_cache_queries_total": counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            "prefix_cache_hits_total": counter("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            "spec_num_drafts_total": counter("spec_decode_num_drafts", "Speculative decoding: proposals verified."),
            "spec_num_draft_tokens_total": counter("spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed."),
            "spec_num_accepted_tokens_total": counter("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted."),
        }
        self.spec_accepted_per_pos = Counter(
            "loom:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: accepted "
            "tokens by their position in the proposal (0: the first).",
            ["model_name", "position"], registry=reg)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.", LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduled to first token.", LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from first token to finish.", LATENCY_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens fed to the model per step.", ITERATION_BUCKETS)
        self.step_overhead = histogram("step_overhead_seconds", "Worker idle time between steps (scheduling + IPC).", OVERHEAD_BUCKETS)
        forward = Histogram("loom:model_forward_time_seconds", "The worker's time per step (forward pass and sampling), by steps with a prompt chunk (prefill) or of decodes only.", ["model_name", "step"], buckets=FORWARD_BUCKETS, registry=reg)
        self.prefill_forward = forward.labels(model_name, "prefill")
        self.decode_forward = forward.labels(model_name, "decode")
        self.time_to_first_audio = histogram("time_to_first_audio_seconds", "Speech: time to the first audio chunk.", LATENCY_BUCKETS)
        self.audio_seconds = counter("generated_audio_seconds", "Speech: seconds of audio generated.")
        self.audio_real_time_factor = histogram("audio_real_time_factor", "Speech: synthesis time / audio duration, per request.", (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0))
        self.generated_images = counter("generated_images", "Images: images generated.")
        self.denoising_steps = counter("denoising_steps", "Images: denoising steps done (one per request per step).")
        self.image_first_step = histogram("image_time_to_first_step_seconds", "Images: submission to the request's first denoising step done (queue time and one step).", LATENCY_BUCKETS)
        self.embedding_batches = counter("embedding_batches", "Forward passes of the embeddings model.")
        self.embedding_inputs = counter("embedding_inputs", "Inputs embedded.")
        self.tool_call_schema_failures = counter(
            "tool_call_schema_failures", "Tool calls returned although their arguments do not "
            "validate against the tool's parameter schema (or name no tool of the request).")
        self.images_decoded = counter(
            "images_decoded", "Images decoded (each image of a request once, whatever its n).")
        self.image_pixels_in_flight = gauge(
            "image_pixels_in_flight", "Image pixels being decoded or held as pixel arrays by "
            "requests (--max-image-pixels-in-flight bounds it).")
        self.request_success = Counter("loom:request_success", "Finished requests by reason.",
                                       ["model_name", "finished_reason"], registry=reg)
        self.http_requests = Counter("loom:http_requests", "HTTP requests by route and status.",
                                     ["handler", "method", "status"], registry=reg)
        self.rejected_requests = Counter(
            "loom:rejected_requests", "Requests refused with a 4xx or 503, by reason (the "
            "error's code, else its type).", ["model_name", "reason"], registry=reg)
        self.malformed_frames = Counter(
            "loom:malformed_frames", "Malformed inter-process frames dropped, by channel (this "
            "process's and the scheduler's).", ["model_name", "channel"], registry=reg)
        self._malformed_seen: dict[str, int] = {}
        self._last = SchedulerStats()

    def _init_inference_gateway_metrics(self) -> None:
        """The names the Gateway API Inference Extension's model-server protocol documents for
        vLLM: its endpoint pickers (llm-d, production-stack, GKE's gateway) scrape them to
        place each request, so they schedule on loom with no per-server configuration."""
        reg, name = self.registry, self.model_name

        def gauge(metric, doc, labels=()):
            return Gauge(f"vllm:{metric}", doc, ["model_name", *labels], registry=reg)

        self.vllm_num_requests_running = gauge(
            "num_requests_running", "Requests in the running batch.").labels(name)
        self.vllm_num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled.").labels(name)
        kv_doc = "Fraction of KV cache blocks in use (0-1)"
        self.vllm_kv_cache_usage = (
            gauge("kv_cache_usage_perc", kv_doc + ".").labels(name),
            gauge("gpu_cache_usage_perc", kv_doc + "; the name before "
                  "vllm:kv_cache_usage_perc, still read by older pickers.").labels(name),
        )
        # One series at a time (vLLM's): the adapters of the running and the waiting
        # requests, comma-separated, from the scheduler's stats; max_lora 0 without
        # --enable-lora. Adapter names are the operator's (configured or loaded by route).
        lora_labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
        self.vllm_lora_info = gauge(
            "lora_requests_info", "LoRA adapters running and waiting; the value is when it was "
            "last updated (Unix time).", lora_labels)
        self.max_lora = 0
        self._lora_labels = (name, "0", "", "")
        self._cache_config = gauge(
            "cache_config_info", "The KV cache's configuration, in the labels (value 1).",
            ["block_size", "num_gpu_blocks"])

    def observe_cache_config(self, block_size: int, num_blocks: int) -> None:
        """Prefix-cache scorers size their model of this replica's cache from these."""
        self._cache_config.labels(self.model_name, str(block_size), str(num_blocks)).set(1)

    def watch_images(self, budget) -> None:
        """Report an ImagePixelBudget's decodes and pixels in flight."""
        budget.on_decoded = self.images_decoded.inc
        self.image_pixels_in_flight.set_function(lambda: budget.in_flight)

    # ---- scheduler stats ----------------------------------------------------------------------
    def observe_scheduler(self, stats: SchedulerStats) -> None:
        for gauge in (self.num_requests_running, self.vllm_num_requests_running):
            gauge.set(stats.num_running)
        for gauge in (self.num_requests_waiting, self.vllm_num_requests_waiting):
            gauge.set(stats.num_waiting)
        for gauge in (self.kv_cache_usage_perc, *self.vllm_kv_cache_usage):
            gauge.set(stats.kv_cache_usage)
        for field, counter in self._totals.items():
            delta = getattr(stats, field) - getattr(self._last, field)
            if delta > 0:
                counter.inc(delta)
        before = self._last.spec_accepted_per_position
        for position, total in enumerate(stats.spec_accepted_per_position):
            delta = total - (before[position] if position < len(before) else 0)
            if delta > 0:
                self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(delta)
        for tokens in stats.iteration_tokens:
            self.iteration_tokens.observe(tokens)
        for overhead in stats.step_overheads:
            self.step_overhead.observe(max(0.0, overhead))
        for seconds in stats.prefill_forward_times:
            self.prefill_forward.observe(seconds)
        for seconds in stats.decode_forward_times:
            self.decode_forward.observe(seconds)
        self._last = stats

    # ---- requests ------------------------------------------------------------------------------
    def observe_output(self, clock: RequestClock, output: TextGenerationOutput) -> None:
        now = time.monotonic()
        n = len(output.tokens)
        if n:
            if not clock.first:
                clock.first = now
                self.ttft.observe(now - clock.started)
                n -= 1
            if n and clock.last:
                gap = (now - clock.last) / n
                for _ in range(n):
                    self.itl.observe(gap)
            clock.last = now
        if output.is_done:
            self.e2e.observe(now - clock.started)
            reason = FINISH_REASONS.get(output.final_status, "error")
            self.request_success.labels(self.model_name, reason).inc()
            t = output.timings
            if t is not None:
                if t.first_scheduled:
                    self.queue_time.observe(t.first_scheduled - t.arrival)
                if t.first_token:
                    self.prefill_time.observe(t.first_token - t.first_scheduled)
                    self.decode_time.observe(t.finished - t.first_token)

    def observe_early_end(self, clock: RequestClock, reason: str) -> None:
        """The API stopped reading a request (stop string, client gone) before it finished."""
        self.e2e.observe(time.monotonic() - clock.started)
        self.request_success.labels(self.model_name, reason).inc()

    def observe_request_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)

    # ---- HTTP ----------------------------------------------------------------------------------
    def http_middleware(self, app, known_paths: set[str]):
        async def middleware(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            handler = scope["path"] if scope["path"] in known_paths else "other"
            status = {"code": 500}

            async def send_wrapper(message):
                if message["type"] == "http.response.start":
                    status["code"] = message["status"]
                elif (message["type"] == "http.response.body" and status["code"] != 500
                      and status["code"] >= 400 and "counted" not in status):
                    status["counted"] = True
                    reason = rejection_reason(message.get("body", b""), status["code"])
                    # (Several models: the one the request was routed to, model_router.py.)
                    model = scope.get("loom.model_name", self.model_name)
                    self.rejected_requests.labels(model, reason).inc()
                await send(message)

            try:
                await app(scope, receive, send_wrapper)
            finally:
                self.http_requests.labels(handler, scope["method"], str(status["code"])).inc()

        return middleware

    def _sync_malformed_frames(self) -> None:
        """Bring the counter up to the running totals (the scheduler's arrive with its stats,
        the API process's own are read here)."""
        totals = dict(self._last.malformed_frames_total)
        for channel, count in malformed_frame_counts().items():
            totals[channel] = totals.get(channel, 0) + count
        for channel, total in totals.items():
            delta = total - self._malformed_seen.get(channel, 0)
            if delta > 0:
                self.malformed_frames.labels(self.model_name, channel).inc(delta)
                self._malformed_seen[channel] = total

    def _update_lora_info(self) -> None:
        """The adapters as of the scheduler's last stats; the info is current when read."""
        stats = self._last
        labels = (self.model_name, str(self.max_lora), ",".join(stats.running_lora_adapters),
                  ",".join(stats.waiting_lora_adapters))
        if labels != self._lora_labels:
            with contextlib.suppress(KeyError):
                self.vllm_lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
        self.vllm_lora_info.labels(*labels).set(time.time())

    def registry_now(self) -> CollectorRegistry:
        """The registry, brought up to date for a scrape."""
        self._sync_malformed_frames()
        self._update_lora_info()
        return self.registry

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry_now()), media_type=CONTENT_TYPE_LATEST)
