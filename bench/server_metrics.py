"""Where the server's time goes, from its Prometheus /metrics, scraped around each level.

Only loom exports the series read here (step counts, the worker's idle time between steps,
queue/prefill/decode times); any other server simply gets no breakdown. Histograms are read
through their `_sum` and `_count` series, summed over label sets, as deltas over the level.
"""

from __future__ import annotations

import httpx

PREFIX = "loom:"


async def scrape(client, base_url: str) -> dict[str, float] | None:
    try:
        response = await client.get(f"{base_url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_prometheus(response.text)


def parse_prometheus(text: str) -> dict[str, float]:
    """Series summed over their label sets; histogram buckets keep their bound, as
    `name_bucket|le`."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue  # comments, and other exporters' series
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        if 'step="' in name_and_labels:  # model_forward_time_seconds: prefill and decode apart
            name += ":" + name_and_labels.split('step="', 1)[1].split('"', 1)[0]
        if name.endswith("_bucket") and 'le="' in name_and_labels:
            name += "|" + name_and_labels.split('le="', 1)[1].split('"', 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def histogram_quantile(before: dict, after: dict, name: str, q: float) -> float | None:
    """The q-quantile of a histogram's observations between two scrapes, interpolated
    linearly inside its bucket (as Prometheus' histogram_quantile does)."""
    prefix = f"{PREFIX}{name}_bucket|"
    bounds = sorted((float(key[len(prefix):]), after[key] - before.get(key, 0.0))
                    for key in after if key.startswith(prefix))
    if not bounds or bounds[-1][1] <= 0:
        return None
    rank = q * bounds[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in bounds:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def level_breakdown(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """Per-step and per-request averages over one level; None without loom's metrics."""
    if not before or not after:
        return None

    def delta(name: str) -> float:
        return after.get(PREFIX + name, 0.0) - before.get(PREFIX + name, 0.0)

    def mean_of(sum_name: str, count_name: str) -> float | None:
        count = delta(count_name)
        return delta(sum_name) / count if count else None

    def mean(name: str) -> float | None:
        return mean_of(f"{name}_sum", f"{name}_count")

    steps = delta("iteration_tokens_total_count")
    if not steps:
        return None
    overhead_s = delta("step_overhead_seconds_sum")
    overhead_count = delta("step_overhead_seconds_count")
    return {
        "steps": int(steps),
        "tokens_per_step": delta("iteration_tokens_total_sum") / steps,
        "step_period_ms": wall / steps * 1e3,
        # The worker waiting for its next step (scheduling, ZeroMQ, decode of messages):
        # time the model is not running.
        "worker_idle_ms_per_step": overhead_s / overhead_count * 1e3 if overhead_count else None,
        "worker_idle_ms_p50": _ms(histogram_quantile(before, after, "step_overhead_seconds", 0.5)),
        "worker_idle_share": overhead_s / wall if wall else None,
        # The model's own time per step, measured by the worker during the level.
        "prefill_forward_ms_mean": _ms(mean_of("model_forward_time_seconds_sum:prefill",
                                               "model_forward_time_seconds_count:prefill")),
        "decode_forward_ms_mean": _ms(mean_of("model_forward_time_seconds_sum:decode",
                                              "model_forward_time_seconds_count:decode")),
        "queue_s_mean": mean("request_queue_time_seconds"),
        "prefill_s_mean": mean("request_prefill_time_seconds"),
        "decode_s_mean": mean("request_decode_time_seconds"),
        "preemptions": int(delta("num_preemptions_total")),
        "prefix_cache_hit_tokens": int(delta("prefix_cache_hits_total")),
    }
