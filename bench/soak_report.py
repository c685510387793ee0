"""The soak's verdicts and report: what the server's log says (its KV cache size, its warnings),
RSS growth per process, the targets met or missed, and the printed summary."""

from __future__ import annotations

import os
import re
from collections import Counter

from bench.interference import WARN_CORES

RSS_TARGET = 0.05
KV_LINE = re.compile(r"KV cache ([\d.]+) GiB = (\d+) blocks x (\d+)")


def conclude(results: dict, server_log: str | None) -> dict:
    """Adds what follows from the readings (leaked KV blocks, RSS growth, the server log's
    warnings) and the verdicts; returns the verdicts."""
    idle = results.get("idle_after") or {}
    kv_usage = idle.get("kv_cache_usage_perc")
    total = (results.get("kv_cache") or {}).get("num_blocks")
    if kv_usage is not None and total:
        results["leaked_blocks"] = round(kv_usage * total)
    if results.get("rss_before") and results.get("rss_after"):
        results["rss_growth"] = growth_rows(results["rss_before"], results["rss_after"])
    results["server_log_scan"] = scan_log(server_log)
    results["verdicts"] = verdicts(results)
    return results["verdicts"]


def passed(v: dict) -> bool:
    return v["errors_ok"] and v["idle_ok"] and v["rss_ok"] and v["complete"]


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
                        if foreign["foreign_cpu_cores_mean"] > WARN_CORES else ""))
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
