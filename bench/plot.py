"""`python -m bench.plot RESULT.json`: a harness result's load levels as a picture.

Two panels against concurrency: output tokens/s, and the median inter-token latency (ITL p50,
ms), one line per server: loom, and the peer the run drove, if any. `python -m bench.run`
draws it beside the JSON file it writes (same name, .png); this draws it for an older result.

Needs matplotlib (the `bench` extra: pip install -e '.[bench]'). It draws into a file with
the Agg backend: no display, and no change to pyplot's global state.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from bench import log
from bench.stats import ms


def server_lines(results: dict) -> list[dict]:
    """One entry per server with load levels: its label, and its levels by concurrency
    (tokens/s and ITL p50 in ms; NaN where a level measured nothing)."""
    servers = []
    peer = results.get("peer") or {}
    peer_name = peer.get("name") or (results.get("config") or {}).get("peer_name") or "peer"
    for label, record in (("loom", results.get("server")), (peer_name, peer)):
        levels = sorted(((record or {}).get("levels") or {}).values(),
                        key=lambda level: level["concurrency"])
        if not levels:
            continue
        servers.append({
            "label": label,
            "concurrency": [level["concurrency"] for level in levels],
            "tok_s": [_number(level.get("output_tok_s")) for level in levels],
            "itl_p50_ms": [_number(ms(level.get("itl_p50_s"))) for level in levels],
        })
    return servers


def title(results: dict) -> str:
    cfg = results.get("config") or {}
    model = cfg.get("model_name") or (results.get("server") or {}).get("model") or "?"
    return (f"{model} {cfg.get('dtype', '')}, prompt {cfg.get('prompt_len', '?')} tokens, "
            f"output {cfg.get('output_len', '?')} tokens")


def plot(results: dict, path: str) -> str:
    """Draws the two panels into `path` (PNG); raises ImportError without matplotlib and
    ValueError when the result has no load level to draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    servers = server_lines(results)
    if not servers:
        raise ValueError("no load levels in this result (was the server phase skipped?)")
    levels = sorted({c for s in servers for c in s["concurrency"]})
    fig = Figure(figsize=(11, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    tok_ax, itl_ax = fig.subplots(1, 2)
    for ax, key, ylabel, heading in (
            (tok_ax, "tok_s", "output tokens/s", "Throughput"),
            (itl_ax, "itl_p50_ms", "ITL p50 (ms)", "Inter-token latency (median)")):
        top = {}  # the highest value at each level: its label goes above, the others below
        for server in servers:
            for x, y in zip(server["concurrency"], server[key]):
                if not math.isnan(y):
                    top[x] = max(top.get(x, y), y)
        for server in servers:
            ax.plot(server["concurrency"], server[key], marker="o", label=server["label"])
            for x, y in zip(server["concurrency"], server[key]):
                if not math.isnan(y):
                    above = y >= top[x]
                    ax.annotate(f"{y:.0f}" if y >= 100 else f"{y:.1f}", (x, y),
                                textcoords="offset points", xytext=(0, 6 if above else -7),
                                ha="center", va="bottom" if above else "top", fontsize=8)
        if len(levels) > 1 and levels[0] > 0:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(levels))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(c) for c in levels])
        ax.set_xlabel("concurrency (streaming clients)")
        ax.set_ylabel(ylabel)
        ax.set_title(heading)
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.08)  # room for the labels
        ax.grid(True, alpha=0.3)
    tok_ax.legend()
    fig.suptitle(title(results))
    fig.savefig(path, format="png")
    return path


def write_plot(results: dict, path: str) -> str | None:
    """plot(), for the harness: whatever goes wrong is one line on stderr, never a failed
    run. The path written, or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log("bench: no plot: matplotlib is not installed (pip install -e '.[bench]')")
        return None
    if not server_lines(results):
        log("bench: no plot: no load level was measured")
        return None
    try:
        plot(results, path)
    except Exception as exc:  # noqa: BLE001 - the numbers are in the JSON already
        log(f"bench: no plot: {type(exc).__name__}: {exc}")
        return None
    log(f"bench: wrote {path}")
    return path


def distribution(results: dict, path: str) -> str:
    """Two panels: the TTFT and the ITL distributions (empirical CDFs, ms, log scale) of every
    level of every server, from the raw samples `loom bench` keeps (results[key]["samples"]).
    Raises ValueError when the result holds no samples."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    curves = []  # (label, ttft ms, itl ms)
    for key in ("server", "peer"):
        record = results.get(key) or {}
        name = record.get("name") or ("loom" if key == "server" else "peer")
        for c, sample in sorted((record.get("samples") or {}).items(), key=lambda kv: int(kv[0])):
            curves.append((f"{name} c={c}", sorted(t * 1e3 for t in sample["ttft_s"]),
                           sorted(t * 1e3 for t in sample["itl_s"])))
    if not any(ttft or itl for _, ttft, itl in curves):
        raise ValueError("no TTFT or ITL samples in this result")
    fig = Figure(figsize=(11, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, index, heading in ((axes[0], 1, "Time to first token"),
                               (axes[1], 2, "Inter-token latency")):
        for curve in curves:
            values = [v for v in curve[index] if v > 0]
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))],
                        where="post", label=curve[0])
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction of samples at or below")
        ax.set_ylim(0, 1.02)
        ax.set_title(heading)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title(results))
    fig.savefig(path, format="png")
    return path


def write_distribution_plot(results: dict, path: str) -> str | None:
    """distribution(), for `loom bench`: a failure is one line on stderr, never a failed run."""
    try:
        distribution(results, path)
    except ImportError:
        log("bench: no latency plot: matplotlib is not installed (pip install 'loom-serve[bench]')")
        return None
    except Exception as exc:  # noqa: BLE001 - the numbers are in the JSON already
        log(f"bench: no latency plot: {type(exc).__name__}: {exc}")
        return None
    log(f"bench: wrote {path}")
    return path


def _number(value: float | None) -> float:
    return math.nan if value is None else float(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", help="a JSON file written by python -m bench.run")
    p.add_argument("--out", default=None, help="PNG path; default: RESULT with .png")
    args = p.parse_args(argv)
    with open(args.result) as f:
        results = json.load(f)
    out = args.out or os.path.splitext(args.result)[0] + ".png"
    return 0 if write_plot(results, out) else 1


if __name__ == "__main__":
    sys.exit(main())
