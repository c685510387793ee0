"""The printed table and the JSON file: the same numbers, one for people, one for tools."""

from __future__ import annotations

import json
import os

from bench.interference import WARN_CORES
from bench.stats import ms, ratio

# The ceiling a server is compared with is the same work done by the bare model: the batch
# prefilled in chunks, then decoded ("ceil P+D"). The decode-only rate is shown beside it: no
# server can reach it on a load that has prompts, but it is the model's speed per step.
COLUMNS = [  # (header, width)
    ("conc", 4), ("server tok/s", 12), ("ceil P+D", 8), ("srv/ceil", 8), ("ceil dec", 8),
    ("srv/dec", 7), ("srv/seq", 7), ("peer tok/s", 10), ("srv/peer", 8), ("req/s", 5),
    ("TTFT p50", 8), ("TTFT p99", 8), ("ITL p50", 7), ("ITL p99", 7), ("E2E p50", 7),
    ("failed", 6),
]

# The targets, checked on every run (see README, Benchmarks).
TARGET_SERVER_OVER_CEILING = 0.90  # at concurrency 16 and 32
TARGET_SERVER_OVER_PEER = 1.5
TARGET_SERVER_OVER_SEQUENTIAL = 8.0  # at concurrency 16
TARGET_OVERHEAD_MS = 1.0  # median worker idle between steps
TARGET_TTFT_OVER_PREFILL_MS = 5.0  # at concurrency 1
TARGET_ITL_OVER_FORWARD = 1.10  # at concurrency 1
TARGET_STARTUP_S = 10.0


def comparison_rows(results: dict) -> list[dict]:
    """One row per concurrency level, joining the server's level with the ceiling's batch of
    the same size, the peer's level and the sequential baseline."""
    levels = (results.get("server") or {}).get("levels") or {}
    peer_levels = (results.get("peer") or {}).get("levels") or {}
    batches = (results.get("ceiling") or {}).get("batches") or {}
    sequential = ((results.get("baseline") or {}).get("sequential") or {}).get("tok_s")
    rows = []
    for key, level in levels.items():
        batch = batches.get(key) or {}
        ceiling = batch.get("prefill_and_decode_tok_s")
        decode = batch.get("decode_tok_s")
        peer = (peer_levels.get(key) or {}).get("output_tok_s")
        rows.append({
            "concurrency": level["concurrency"],
            "server_tok_s": level["output_tok_s"],
            "ceiling_tok_s": ceiling,
            "server_over_ceiling": ratio(level["output_tok_s"], ceiling),
            "ceiling_decode_tok_s": decode,
            "server_over_decode_ceiling": ratio(level["output_tok_s"], decode),
            "server_over_sequential_baseline": ratio(level["output_tok_s"], sequential),
            "peer_tok_s": peer,
            "server_over_peer": ratio(level["output_tok_s"], peer),
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
    ttft_ms = ms(c1.get("ttft_p50_s"))
    lines.append(f"prefill of one {cfg['prompt_len']}-token prompt (ceiling): {_fmt(prefill_ms)} ms"
                 f" | TTFT p50 at c=1: {_fmt(ttft_ms)} ms ({_times(ttft_ms, prefill_ms)})")
    pairs = server.get("ttft_pairs") or {}
    if pairs.get("pairs"):
        lines.append(f"c=1 TTFT paired with the ceiling's prefill of the same prompt "
                     f"({pairs['pairs']} pairs): TTFT p50 {pairs['ttft_ms_p50']:.1f} ms, "
                     f"prefill p50 {pairs['prefill_ms_p50']:.1f} ms, difference p50 "
                     f"{pairs['ttft_over_prefill_ms_p50']:+.1f} ms, p90 "
                     f"{pairs['ttft_over_prefill_ms_p90']:+.1f} ms")
        if pairs.get("ttft_over_server_forward_ms_p50") is not None:
            lines.append(f"c=1 TTFT - the worker's own prefill forward for the same request: "
                         f"p50 {pairs['ttft_over_server_forward_ms_p50']:+.1f} ms, p90 "
                         f"{pairs['ttft_over_server_forward_ms_p90']:+.1f} ms")
    forward_ms = ceiling.get("one_token_forward_ms")
    itl_ms = ms(c1.get("itl_p50_s"))
    lines.append(f"one-token forward at batch 1 (ceiling): {_fmt(forward_ms)} ms"
                 f" | ITL p50 at c=1: {_fmt(itl_ms)} ms ({_times(itl_ms, forward_ms)})")
    for key, batch in (ceiling.get("batches") or {}).items():
        lines.append(f"ceiling batch {key}: chunked prefill {batch['prefill_tok_s']:.0f} tok/s "
                     f"({batch['prefill_steps']} steps), decode step p50 "
                     f"{batch['decode_step_ms_p50']:.1f} ms, prefill+decode "
                     f"{batch['prefill_and_decode_tok_s']:.1f} tok/s")
    peer = results.get("peer") or {}
    for key, level in (peer.get("levels") or {}).items():
        lines.append(f"{peer.get('name', 'peer')} c={key}: {_fmt(level['output_tok_s'])} tok/s, "
                     f"TTFT p50 {_fmt(ms(level['ttft_p50_s']), 0)} ms, ITL p50 "
                     f"{_fmt(ms(level['itl_p50_s']))} ms, {level['failed']} failed")
    for name, part in baseline.items():
        lines.append(f"baseline ({name.replace('_', ' ')}): {part['tok_s']:.1f} tok/s "
                     f"({part['tokens']} tokens in {part['seconds']:.1f} s)")
    for key, level in (server.get("levels") or {}).items():
        if (level.get("tokens_per_chunk") or 1) > 1.05 or not level.get("usage_reported", True):
            lines.append(f"c={key}: {level['tokens_per_chunk']:.2f} tokens per SSE chunk, "
                         f"TPOT p50 {_fmt(ms(level['tpot_p50_s']))} ms, usage reported: "
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
    idle, share = _fmt(m.get("worker_idle_ms_p50"), 2), _fmt(_pct(m["worker_idle_share"]), 0)
    queue, prefill = _fmt(ms(m["queue_s_mean"]), 0), _fmt(ms(m["prefill_s_mean"]), 0)
    return (f"c={key} server steps: {m['steps']} steps of {m['tokens_per_step']:.1f} tokens, "
            f"one every {m['step_period_ms']:.1f} ms, worker idle {idle} ms/step (median; {share}% "
            f"of wall); per request: queue {queue} ms, prefill {prefill} ms, decode "
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
            _fmt(r["server_over_ceiling"], 2), _fmt(r["ceiling_decode_tok_s"]),
            _fmt(r["server_over_decode_ceiling"], 2), _fmt(r["server_over_sequential_baseline"], 1),
            _fmt(r["peer_tok_s"]), _fmt(r["server_over_peer"], 2), _fmt(r["requests_s"], 2),
            _fmt(ms(r["ttft_p50_s"]), 0), _fmt(ms(r["ttft_p99_s"]), 0),
            _fmt(ms(r["itl_p50_s"]), 1), _fmt(ms(r["itl_p99_s"]), 1),
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
    targets = target_lines(results)
    if targets:
        parts += ["", "targets:"] + targets
    return "\n".join(parts)


def target_lines(results: dict) -> list[str]:
    """Each target of the issue that this run measured: PASS or MISS, with the numbers."""
    rows = {str(r["concurrency"]): r for r in comparison_rows(results)}
    server = results.get("server") or {}
    ceiling = results.get("ceiling") or {}
    c1 = (server.get("levels") or {}).get("1") or {}
    peer = (results.get("peer") or {}).get("name") or "peer"
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"  {'PASS' if ok else 'MISS'}  {text}")

    for key in ("16", "32"):
        r = rows.get(key) or {}
        if r.get("server_over_ceiling") is not None:
            check(r["server_over_ceiling"] >= TARGET_SERVER_OVER_CEILING,
                  f"c={key}: server / ceiling (same work) {r['server_over_ceiling']:.2f} >= "
                  f"{TARGET_SERVER_OVER_CEILING}")
        if r.get("server_over_peer") is not None:
            check(r["server_over_peer"] >= TARGET_SERVER_OVER_PEER,
                  f"c={key}: server / {peer} {r['server_over_peer']:.2f} >= "
                  f"{TARGET_SERVER_OVER_PEER}")
    seq = (rows.get("16") or {}).get("server_over_sequential_baseline")
    if seq is not None:
        check(seq >= TARGET_SERVER_OVER_SEQUENTIAL,
              f"c=16: server / sequential transformers {seq:.1f} >= "
              f"{TARGET_SERVER_OVER_SEQUENTIAL:.0f}")
    for key, level in (server.get("levels") or {}).items():
        idle = (level.get("server_metrics") or {}).get("worker_idle_ms_p50")
        if idle is not None:
            check(idle <= TARGET_OVERHEAD_MS,
                  f"c={key}: scheduling + IPC gap at the worker, median {idle:.2f} ms <= "
                  f"{TARGET_OVERHEAD_MS:.0f} ms")
    # TTFT and ITL at c=1 against the model's own time: the ceiling's plain loop and the
    # worker's forward time for the same requests, measured by the server. For TTFT, when
    # the run made them, pairs of one request each (bench.ttft_pairs): the level's few
    # requests against a prefill measured minutes away mostly measure the machine's drift.
    # (medians against the ceiling's median; means against the server's mean)
    c1_server = c1.get("server_metrics") or {}
    pairs = server.get("ttft_pairs") or {}
    if pairs.get("pairs"):  # the precise measurement, when this run made it
        for key, against in (("ttft_over_prefill_ms_p50", "the ceiling's prefill of the same "
                              "prompt, side by side"),
                             ("ttft_over_server_forward_ms_p50", "the worker's own forward for "
                              "the same request")):
            if pairs.get(key) is not None:
                check(pairs[key] <= TARGET_TTFT_OVER_PREFILL_MS,
                      f"c=1: TTFT - {against}, median of {pairs['pairs']}: {pairs[key]:+.1f} "
                      f"ms <= {TARGET_TTFT_OVER_PREFILL_MS:.0f} ms")
    else:
        for stat, prefill_ms, source in (
                ("p50", (ceiling.get("prefill_one") or {}).get("ms"), "ceiling, median"),
                ("mean", c1_server.get("prefill_forward_ms_mean"), "server's forward, mean")):
            ttft_ms = ms(c1.get(f"ttft_{stat}_s"))
            if prefill_ms is not None and ttft_ms is not None:
                check(ttft_ms - prefill_ms <= TARGET_TTFT_OVER_PREFILL_MS,
                      f"c=1: TTFT {stat} {ttft_ms:.1f} ms - prefill ({source}) "
                      f"{prefill_ms:.1f} ms = {ttft_ms - prefill_ms:+.1f} ms <= "
                      f"{TARGET_TTFT_OVER_PREFILL_MS:.0f} ms")
    for stat, forward_ms, source in (
            ("p50", ceiling.get("one_token_forward_ms"), "ceiling, median"),
            ("mean", c1_server.get("decode_forward_ms_mean"), "server's forward, mean")):
        itl_ms = ms(c1.get(f"itl_{stat}_s"))
        if forward_ms and itl_ms is not None:
            check(itl_ms / forward_ms <= TARGET_ITL_OVER_FORWARD,
                  f"c=1: ITL {stat} {itl_ms:.1f} ms / one-token forward ({source}) "
                  f"{forward_ms:.1f} ms = {itl_ms / forward_ms:.2f} <= "
                  f"{TARGET_ITL_OVER_FORWARD}")
    if server.get("startup_s") is not None:
        check(server["startup_s"] <= TARGET_STARTUP_S,
              f"start-up to a healthy /health {server['startup_s']:.1f} s <= "
              f"{TARGET_STARTUP_S:.0f} s")
    return lines


def write_json(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    results = dict(results, comparison=comparison_rows(results))
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


def _pct(share: float | None) -> float | None:
    return None if share is None else share * 100


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _times(value: float | None, reference: float | None) -> str:
    r = ratio(value, reference)
    return "-" if r is None else f"{r:.2f}x"
