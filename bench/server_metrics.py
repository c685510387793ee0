"""Where the server's time goes, from its Prometheus /metrics, scraped around each level.

Only loom exports the series read here (step counts, the worker's idle time between steps,
queue/prefill/decode times); any other server simply gets no breakdown. Histograms are read
through their `_sum` and `_count` series, summed over label sets, as deltas over the level.
This is bench/'s one reader of /metrics: the soak reads it per label set (parse_series).
"""

from __future__ import annotations

import re

import httpx

from bench.stats import ms

PREFIX = "loom:"


async def scrape(client, base_url: str, parse=None) -> dict | None:
    """GET /metrics, parsed by `parse` (default parse_prometheus); None when the server
    does not answer it."""
    try:
        response = await client.get(f"{base_url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return (parse or parse_prometheus)(response.text)


def parse_series(text: str) -> dict[str, dict[str, float]]:
    """name -> {label set (as written, without its braces): value} for every loom series."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue  # comments, and other exporters' series
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        try:
            out.setdefault(name, {})[labels.rstrip("}")] = float(value)
        except ValueError:
            continue
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Series summed over their label sets, except that model_forward_time_seconds keeps
    prefill and decode apart (as `name:step`) and histogram buckets keep their bound (as
    `name_bucket|le`)."""
    values: dict[str, float] = {}
    for name, series in parse_series(text).items():
        for labels, value in series.items():
            key = name
            step = label_value(labels, "step")
            if step is not None:
                key += ":" + step
            bound = label_value(labels, "le") if name.endswith("_bucket") else None
            if bound is not None:
                key += "|" + bound
            values[key] = values.get(key, 0.0) + value
    return values


def label_value(labels: str, label: str) -> str | None:
    match = re.search(rf'(?:^|,){label}="((?:[^"\\]|\\.)*)"', labels)
    return match.group(1) if match else None


def series_total(series: dict | None, name: str) -> float | None:
    """A parse_series() metric summed over its label sets; None when it is absent."""
    if not series or name not in series:
        return None
    return sum(series[name].values())


def by_label(series: dict | None, name: str, label: str) -> dict[str, float]:
    """A parse_series() metric summed per value of one of its labels."""
    out: dict[str, float] = {}
    for labels, value in ((series or {}).get(name) or {}).items():
        key = label_value(labels, label)
        if key is not None:
            out[key] = out.get(key, 0.0) + value
    return out


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
        "worker_idle_ms_p50": ms(histogram_quantile(before, after, "step_overhead_seconds", 0.5)),
        "worker_idle_share": overhead_s / wall if wall else None,
        # The model's own time per step, measured by the worker during the level.
        "prefill_forward_ms_mean": ms(mean_of("model_forward_time_seconds_sum:prefill",
                                               "model_forward_time_seconds_count:prefill")),
        "decode_forward_ms_mean": ms(mean_of("model_forward_time_seconds_sum:decode",
                                              "model_forward_time_seconds_count:decode")),
        "queue_s_mean": mean("request_queue_time_seconds"),
        "prefill_s_mean": mean("request_prefill_time_seconds"),
        "decode_s_mean": mean("request_decode_time_seconds"),
        "preemptions": int(delta("num_preemptions_total")),
        "prefix_cache_hit_tokens": int(delta("prefix_cache_hits_total")),
    }
