"""`python -m bench.vision`: what an image costs a request, and a load, on a SmolVLM-style model.

No vision weights exist offline, so unless --model names an Idefics3 checkpoint, a random one
is built (tests/tiny_idefics3.py, size "small" by default: 256 px SigLIP tiles, 16 tokens a
tile, a 12-layer Llama of width 576; a 512 x 512 image is 5 tiles, 80 image tokens). Its
figures measure the serving machinery and the encoder's size, not a real SmolVLM's quality.
Two measurements, each with and without images, on /v1/chat/completions:
  ttft        sequential max_tokens=1 requests (their latency is the time to the first token),
              a 512 x 512 image prompt against the same prompt text-only, alternating; p50;
  throughput  output tokens/s at --concurrency, --image-share of the requests carrying a
              512 x 512 image, against none (ignore_eos: every request the same length).
Every request has its own image and text, so none finds another's blocks in the prefix cache.
Starts loom unless --url names a loopback server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import tempfile
import time

import numpy as np

from bench import RESULTS_DIR, log
from bench.endpoint import http_client, loopback_base_url, served_model
from bench.server import LoomServer

QUESTION = "Describe what you see, the shapes and the colours, in a few sentences."


def image_data_url(seed: int, side: int) -> str:
    """A random `side` x `side` JPEG as a data: URL (noise: its own pixels for every seed)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_messages(index: int, image_side: int | None) -> list[dict]:
    """Request `index`'s conversation: the question numbered (so no two prompts share a
    block), after an image of its own when `image_side` is given."""
    parts = [{"type": "text", "text": f"Picture {index}. {QUESTION}"}]
    if image_side:
        parts.insert(0, {"type": "image_url",
                         "image_url": {"url": image_data_url(index, image_side)}})
    return [{"role": "user", "content": parts}]


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


async def post_chat(client, base_url: str, body: dict) -> tuple[float, dict]:
    """(seconds, usage) of one non-streamed request."""
    started = time.perf_counter()
    response = await client.post(f"{base_url}/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response.json()["usage"]


async def measure_ttft(base_url: str, model: str, requests: int, side: int) -> dict:
    """Image and text-only requests one at a time, alternating (so a slow spell of the
    machine falls on both); the median latency of each, with one warm-up of each first."""
    latencies: dict[str, list[float]] = {"image": [], "text": []}
    prompt_tokens: dict[str, int] = {}
    async with http_client(timeout=600) as client:
        for i in range(-1, requests):
            for kind in ("image", "text"):
                messages = chat_messages(10**6 + 2 * i + (kind == "text"),
                                         side if kind == "image" else None)
                elapsed, usage = await post_chat(client, base_url,
                                                 chat_body(model, messages, 1))
                if i >= 0:  # (-1: the warm-up)
                    latencies[kind].append(elapsed)
                prompt_tokens[kind] = usage["prompt_tokens"]
    return {kind: {"ttft_p50_ms": 1000 * statistics.median(values),
                   "ttfts_ms": [1000 * v for v in values],
                   "prompt_tokens": prompt_tokens[kind]}
            for kind, values in latencies.items()}


async def run_load(base_url: str, model: str, args, image_share: float, first: int) -> dict:
    """`args.requests` requests by `args.concurrency` clients; every 1/image_share-th carries
    an image (spread evenly, so the share holds at every point of the run)."""
    every = round(1 / image_share) if image_share else 0
    bodies = [chat_body(model, chat_messages(first + i, args.image_side
                                             if every and i % every == 0 else None),
                        args.output_len) for i in range(args.requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    tokens: list[int] = []

    async def client_loop(client):
        while not queue.empty():
            _, usage = await post_chat(client, base_url, queue.get_nowait())
            tokens.append(usage["completion_tokens"])

    async with http_client(timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
    return {"image_share": image_share, "requests": len(tokens), "tokens": sum(tokens),
            "wall_s": wall, "tok_s": sum(tokens) / wall}


def measure(base_url: str, args) -> dict:
    model = served_model(base_url)
    log("vision bench: TTFT ...")
    ttft = asyncio.run(measure_ttft(base_url, model, args.ttft_requests, args.image_side))
    loads = []
    for k in range(args.repeats):  # alternating, fresh prompts every load
        for share in (args.image_share, 0.0):
            log(f"vision bench: load with {100 * share:.0f}% images ...")
            first = 2 * 10**6 + (2 * k + (share == 0)) * args.requests
            loads.append(asyncio.run(run_load(base_url, model, args, share, first)))
    throughput = {}
    for share, name in ((args.image_share, "with_images"), (0.0, "text_only")):
        runs = sorted((r for r in loads if r["image_share"] == share), key=lambda r: r["tok_s"])
        throughput[name] = {**runs[len(runs) // 2], "tok_s_runs": [r["tok_s"] for r in runs]}
    return {"ttft": ttft, "throughput": throughput}


def print_table(result: dict, args) -> None:
    t, q = result["ttft"], result["throughput"]
    image, text = t["image"], t["text"]
    with_images, text_only = q["with_images"], q["text_only"]
    print(f"{'':34s}{'image':>12s}{'text only':>12s}{'ratio':>8s}")
    print(f"{'TTFT p50 (ms), sequential':34s}{image['ttft_p50_ms']:12.0f}"
          f"{text['ttft_p50_ms']:12.0f}{image['ttft_p50_ms'] / text['ttft_p50_ms']:8.2f}")
    print(f"{'  prompt tokens':34s}{image['prompt_tokens']:12d}{text['prompt_tokens']:12d}")
    label = f"output tok/s, c={args.concurrency}"
    share = f"{100 * args.image_share:.0f}% images"
    print(f"{label + ' (' + share + ')':34s}{with_images['tok_s']:12.1f}"
          f"{text_only['tok_s']:12.1f}{with_images['tok_s'] / text_only['tok_s']:8.2f}")


def build_model(size: str, target: str) -> str:
    from pipelines.checkpoint.default_model import ensure_default_model
    from tests.tiny_idefics3 import make_tiny_idefics3

    log(f"vision bench: building a random Idefics3 ({size}) in {target} ...")
    return make_tiny_idefics3(target, ensure_default_model(), size)


def serve_and_measure(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="loom-bench-vision-") as tmp:
        model_dir = args.model or build_model(args.size, os.path.join(tmp, "model"))
        log_path = os.path.splitext(args.out)[0] + ".server.log"
        extra = ["--no-speech", *args.serve_args.split()]
        with LoomServer(args.dtype, model_dir, extra, log_path) as server:
            server.wait_quiet()
            return measure(server.base_url, args)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.vision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an Idefics3 checkpoint (default: build one)")
    p.add_argument("--size", choices=("tiny", "small"), default="small",
                   help="of the checkpoint built when --model is not given")
    p.add_argument("--url", default=None, help="a loopback server to measure instead")
    p.add_argument("--image-side", type=int, default=512)
    p.add_argument("--ttft-requests", type=int, default=5, help="of each kind")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32, help="per load")
    p.add_argument("--image-share", type=float, default=0.25)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="loads of each kind; the median")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--serve-args", default="", help="more loom serve flags")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "vision.json"))
    args = p.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.url:
        result = measure(loopback_base_url(args.url), args)
    else:
        result = serve_and_measure(args)
    print_table(result, args)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), **result}, f, indent=2)


if __name__ == "__main__":
    main()
