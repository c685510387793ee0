"""The soak's load: one mixed request (bench/soak_mix.py) sent and checked, and a phase of
them sent closed-loop at a bounded concurrency, summarized.

A request ends as ok, cancelled (the client abandoned it on purpose), error (anything else
that went wrong, with its cause) or cut (still running when the phase's time bound struck).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench.soak_mix import Spec, check_result
from bench.stats import percentile


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


def outcome_row(o: Outcome) -> dict:
    return {"index": o.spec.index, "kind": o.spec.kind, "status": o.status,
            "category": o.category, "detail": o.detail, "cancel": o.spec.cancel,
            "e2e_s": round(o.e2e, 3) if o.e2e is not None else None}
