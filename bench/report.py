"""The printed table and the JSON file: the same numbers, one for people, one for tools."""

from __future__ import annotations

import json
import os

from bench.interference import WARN_CORES
from bench.stats import ratio

COLUMNS = [  # (header, width)
    ("conc", 4), ("server tok/s", 12), ("ceiling tok/s", 13), ("srv/ceil", 8),
    ("srv/seq", 7), ("req/s", 6), ("TTFT p50", 8), ("TTFT p99", 8), ("ITL p50", 7),
    ("ITL p99", 7), ("E2E p50", 7), ("failed", 6),
]


def comparison_rows(results: dict) -> list[dict]:
    """One row per concurrency level, joining the server's level with the ceiling's batch of
    the same size and the sequential baseline."""
    levels = (results.get("server") or {}).get("levels") or {}
    batches = (results.get("ceiling") or {}).get("batches") or {}
    sequential = ((results.get("baseline") or {}).get("sequential") or {}).get("tok_s")
    rows = []
    for key, level in levels.items():
        ceiling = (batches.get(key) or {}).get("decode_tok_s")
        rows.append({
            "concurrency": level["concurrency"],
            "server_tok_s": level["output_tok_s"],
            "ceiling_tok_s": ceiling,
            "server_over_ceiling": ratio(level["output_tok_s"], ceiling),
            "server_over_sequential_baseline": ratio(level["output_tok_s"], sequential),
            "requests_s": level["requests_s"],
            "ttft_p50_s": level["ttft_p50_s"], "ttft_p99_s": level["ttft_p99_s"],
            "itl_p50_s": level["itl_p50_s"], "itl_p99_s": level["itl_p99_s"],
            "e2e_p50_s": level["e2e_p50_s"],
            "failed": level["failed"],
        })
    return rows


def summary_lines(results: dict) -> list[str]:
    """The single numbers the targets compare against: start-up, prefill vs TTFT, one
    forward vs ITL, and the two baselines."""
    cfg = results["config"]
    server = results.get("server") or {}
    ceiling = results.get("ceiling") or {}
    baseline = results.get("baseline") or {}
    c1 = (server.get("levels") or {}).get("1") or {}
    lines = []
    if server.get("startup_s") is not None:
        lines.append(f"start-up (process start -> /health 200): {server['startup_s']:.1f} s")
    prefill_ms = (ceiling.get("prefill_one") or {}).get("ms")
    ttft_ms = _ms(c1.get("ttft_p50_s"))
    lines.append(f"prefill of one {cfg['prompt_len']}-token prompt (ceiling): {_fmt(prefill_ms)} ms"
                 f" | TTFT p50 at c=1: {_fmt(ttft_ms)} ms ({_times(ttft_ms, prefill_ms)})")
    forward_ms = ceiling.get("one_token_forward_ms")
    itl_ms = _ms(c1.get("itl_p50_s"))
    lines.append(f"one-token forward at batch 1 (ceiling): {_fmt(forward_ms)} ms"
                 f" | ITL p50 at c=1: {_fmt(itl_ms)} ms ({_times(itl_ms, forward_ms)})")
    for key, batch in (ceiling.get("batches") or {}).items():
        lines.append(f"ceiling batch {key}: chunked prefill {batch['prefill_tok_s']:.0f} tok/s "
                     f"({batch['prefill_steps']} steps), decode step p50 "
                     f"{batch['decode_step_ms_p50']:.1f} ms, prefill+decode "
                     f"{batch['prefill_and_decode_tok_s']:.1f} tok/s")
    for name, part in baseline.items():
        lines.append(f"baseline ({name.replace('_', ' ')}): {part['tok_s']:.1f} tok/s "
                     f"({part['tokens']} tokens in {part['seconds']:.1f} s)")
    for key, level in (server.get("levels") or {}).items():
        if (level.get("tokens_per_chunk") or 1) > 1.05 or not level.get("usage_reported", True):
            lines.append(f"c={key}: {level['tokens_per_chunk']:.2f} tokens per SSE chunk, "
                         f"TPOT p50 {_fmt(_ms(level['tpot_p50_s']))} ms, usage reported: "
                         f"{level['usage_reported']}")
        if level.get("server_metrics"):
            lines.append(_breakdown_line(key, level["server_metrics"]))
        if level.get("errors"):
            lines.append(f"c={key}: errors: {'; '.join(level['errors'])}")
    for label, unit in _measured_units(results):
        if (unit.get("foreign_cpu_cores") or 0) > WARN_CORES:
            lines.append(f"WARNING: {label}: other processes used {unit['foreign_cpu_cores']:.2f} "
                         f"cores during the cleanest of {unit['attempts']} attempts; too low")
    for name, error in (results.get("errors") or {}).items():
        lines.append(f"{name} FAILED: {error}")
    if results.get("interrupted"):
        lines.append("interrupted: the numbers above are partial")
    return lines


def _breakdown_line(key: str, m: dict) -> str:
    idle, share = _fmt(m["worker_idle_ms_per_step"]), _fmt(_pct(m["worker_idle_share"]), 0)
    queue, prefill = _fmt(_ms(m["queue_s_mean"]), 0), _fmt(_ms(m["prefill_s_mean"]), 0)
    return (f"c={key} server steps: {m['steps']} steps of {m['tokens_per_step']:.1f} tokens, "
            f"one every {m['step_period_ms']:.1f} ms, worker idle {idle} ms/step ({share}% of "
            f"wall); per request: queue {queue} ms, prefill {prefill} ms, decode "
            f"{_fmt(m['decode_s_mean'], 2)} s")


def _measured_units(results: dict):
    """(label, result) of every unit that was measured on its own (and perhaps retried)."""
    ceiling = results.get("ceiling") or {}
    if ceiling.get("prefill_one"):
        yield "ceiling prefill", ceiling["prefill_one"]
    for key, batch in (ceiling.get("batches") or {}).items():
        yield f"ceiling batch {key}", batch
    for key, level in ((results.get("server") or {}).get("levels") or {}).items():
        yield f"server c={key}", level
    for name, part in (results.get("baseline") or {}).items():
        yield f"baseline {name}", part


def format_table(rows: list[dict]) -> str:
    header = "  ".join(h.rjust(w) for h, w in COLUMNS)
    out = [header, "-" * len(header)]
    for r in rows:
        cells = [
            str(r["concurrency"]), _fmt(r["server_tok_s"]), _fmt(r["ceiling_tok_s"]),
            _fmt(r["server_over_ceiling"], 2), _fmt(r["server_over_sequential_baseline"], 1),
            _fmt(r["requests_s"], 2), _fmt(_ms(r["ttft_p50_s"]), 0), _fmt(_ms(r["ttft_p99_s"]), 0),
            _fmt(_ms(r["itl_p50_s"]), 1), _fmt(_ms(r["itl_p99_s"]), 1),
            _fmt(r["e2e_p50_s"], 2) + "s", str(r["failed"]),
        ]
        out.append("  ".join(c.rjust(w) for c, (_, w) in zip(cells, COLUMNS)))
    return "\n".join(out)


def render(results: dict) -> str:
    cfg = results["config"]
    title = (f"Loom benchmark: {cfg['model_name']} {cfg['dtype']}, prompt {cfg['prompt_len']} "
             f"tokens, output {cfg['output_len']} tokens (TTFT/ITL in ms)")
    parts = [title, ""]
    rows = comparison_rows(results)
    if rows:
        parts += [format_table(rows), ""]
    parts += summary_lines(results)
    return "\n".join(parts)


def write_json(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    results = dict(results, comparison=comparison_rows(results))
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _pct(share: float | None) -> float | None:
    return None if share is None else share * 100


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _times(value: float | None, reference: float | None) -> str:
    r = ratio(value, reference)
    return "-" if r is None else f"{r:.2f}x"
