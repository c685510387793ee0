"""`python -m bench.speech`: speech latency, and speech and text sharing one server.

1. One long text (about 1,000 characters): time to first audio, total time, seconds of audio,
   real-time factor (wall time / audio duration).
2. Mixed load: text clients alone, speech clients alone, then both at once; reports text
   tokens/s and inter-token latency, and speech time-to-first-audio and real-time factor, so
   the cost each imposes on the other is visible.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from bench import RESULTS_DIR
from bench.endpoint import http_client, loopback_base_url, served_model
from bench.prompts import prompt_ids
from bench.server import LoomServer

VOICE = "piper-en_US-joe-medium"
LONG_TEXT = " ".join(
    f"Paragraph {i}: the lighthouse keeper walked along the cliffs at dawn, counting ships, "
    f"listening to the gulls, and wondering about the weather." for i in range(8))[:1000]
SAMPLE_RATE = 22050


async def speak(client, base_url: str, text: str) -> dict:
    started = time.perf_counter()
    first, samples = None, 0
    async with client.stream("POST", base_url + "/v1/audio/speech", json={
            "model": VOICE, "input": text, "response_format": "pcm"}) as r:
        r.raise_for_status()
        async for chunk in r.aiter_raw():
            if chunk and first is None:
                first = time.perf_counter() - started
            samples += len(chunk) // 2
    total = time.perf_counter() - started
    audio = samples / SAMPLE_RATE
    return {"ttfa_s": first, "total_s": total, "audio_s": audio, "rtf": total / audio}


async def generate(client, base_url: str, model: str, index: int, tokens: int) -> dict:
    started = time.perf_counter()
    stamps = []
    async with client.stream("POST", base_url + "/v1/completions", json={
            "model": model, "prompt": prompt_ids(7 * 10**6 + index, 64), "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"tokens": tokens, "wall_s": time.perf_counter() - started,
            "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None}


async def mixed(base_url: str, model: str, text_clients: int, speech_clients: int,
                tokens: int) -> dict:
    async with http_client(timeout=900) as client:
        started = time.perf_counter()
        jobs = [generate(client, base_url, model, i, tokens) for i in range(text_clients)]
        jobs += [speak(client, base_url, LONG_TEXT) for _ in range(speech_clients)]
        results = await asyncio.gather(*jobs)
        wall = time.perf_counter() - started
    text, audio = results[:text_clients], results[text_clients:]
    out = {"text_clients": text_clients, "speech_clients": speech_clients, "wall_s": wall}
    if text:
        out["text_tok_s"] = sum(r["tokens"] for r in text) / max(r["wall_s"] for r in text)
        out["text_itl_p50_ms"] = statistics.median(r["itl_p50_ms"] for r in text)
    if audio:
        out["speech_ttfa_s"] = statistics.median(r["ttfa_s"] for r in audio)
        out["speech_rtf"] = statistics.median(r["rtf"] for r in audio)
    return out


def measure(base_url: str, text_clients: int, speech_clients: int, tokens: int) -> dict:
    model = served_model(base_url)

    async def single():
        async with http_client(timeout=900) as client:
            await speak(client, base_url, "Warm up.")
            return await speak(client, base_url, LONG_TEXT)

    return {
        "long_text_chars": len(LONG_TEXT),
        "single": asyncio.run(single()),
        "text_alone": asyncio.run(mixed(base_url, model, text_clients, 0, tokens)),
        "speech_alone": asyncio.run(mixed(base_url, model, 0, speech_clients, tokens)),
        "both": asyncio.run(mixed(base_url, model, text_clients, speech_clients, tokens)),
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.speech", description=__doc__)
    p.add_argument("--text-clients", type=int, default=8)
    p.add_argument("--speech-clients", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--url", default=None)
    p.add_argument("--serve-args", default="")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "speech.json"))
    args = p.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.url:
        result = measure(loopback_base_url(args.url), args.text_clients, args.speech_clients,
                         args.tokens)
    else:
        log = os.path.splitext(args.out)[0] + ".server.log"
        with LoomServer("float32", None, args.serve_args.split(), log) as server:
            result = measure(server.base_url, args.text_clients, args.speech_clients,
                             args.tokens)
    s = result["single"]
    print(f"one {result['long_text_chars']}-char text: first audio {s['ttfa_s']*1000:.0f} ms, "
          f"all {s['total_s']:.2f} s for {s['audio_s']:.1f} s of audio (RTF {s['rtf']:.3f})")
    for name in ("text_alone", "speech_alone", "both"):
        r = result[name]
        parts = [f"{name:13s}"]
        if "text_tok_s" in r:
            parts.append(f"text {r['text_tok_s']:.1f} tok/s, ITL p50 {r['text_itl_p50_ms']:.0f} ms")
        if "speech_ttfa_s" in r:
            parts.append(f"speech TTFA {r['speech_ttfa_s']*1000:.0f} ms, RTF {r['speech_rtf']:.3f}")
        print(" | ".join(parts))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
