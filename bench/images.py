"""`python -m bench.images`: image generation on a random FLUX-shaped model, and text
sharing the worker with it (`loom serve --image-model DIR`).

1. Step cost, in this process (worker/pixels/flux.py's FluxRunner): one denoising step for one
   request, and for four batched into one transformer call (the batching gain).
2. Images per minute: diffusers' FluxPipeline making 4 images one after another, against the
   server with 4 concurrent requests (same model, size, steps; the server's worker on the
   same number of threads).
3. Text inter-token latency at 4 concurrent streams (the default text model), alone and while
   4 image clients keep generating: p50 and p90 over every gap of every stream.

The model is random (no weights ship here) and built once into Loom's model cache: FLUX's
shape (MMDiT double- and single-stream blocks, 64 latent channels, T5's 512 padded tokens)
at a width that makes one step cost tens of milliseconds on a small CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from bench import REPO_DIR, RESULTS_DIR
from bench.endpoint import http_client, served_model
from bench.environment import busy_warning, describe_environment
from bench.prompts import prompt_ids
from bench.server import LoomServer

SHAPE = {"in_channels": 64, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 64,
         "num_attention_heads": 2, "axes_dims_rope": (16, 24, 24)}
PROMPTS = ["a red cat on a blue mat", "green hills under the sky", "a small dog near a tree",
           "a city at night with bright stars"]


def flux_shaped_model() -> str:
    """The random FLUX-shaped pipeline, built once (seconds) into Loom's model cache."""
    sys.path.insert(0, REPO_DIR)
    from pipelines.checkpoint.default_model import cache_dir
    from tests.tiny_flux import make_tiny_flux

    key = "-".join(str(v) for k, v in SHAPE.items() if k != "axes_dims_rope")
    path = os.path.join(cache_dir(), "bench-models", f"flux-shaped-{key}")
    return make_tiny_flux(path, **SHAPE)


# ---- 1. the step, in process ----------------------------------------------------------------
def step_costs(model_dir: str, size: int, threads: int, repeats: int = 5) -> dict:
    import torch

    from api_server.pixel_tokenizer import PixelGenerationRequest, PixelGenerationTokenizer
    from worker.decode_attention import set_kernel_threads
    from worker.pixels.flux import FluxRunner

    torch.set_num_threads(threads)
    set_kernel_threads(threads)  # (the native kernels' OpenMP, as the worker sets it)
    tok, runner = PixelGenerationTokenizer(model_dir), FluxRunner(model_dir)
    out = {}
    for batch in (1, 4):
        ids = []
        for i in range(batch):
            ctx = tok.new_context(PixelGenerationRequest(
                prompt=PROMPTS[i], height=size, width=size, num_inference_steps=100, seed=i,
                request_id=f"{batch}-{i}"))
            runner.add(ctx)
            ids.append(ctx.request_id)
        runner.step(ids)  # (warm)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            runner.step(ids)
            times.append(time.perf_counter() - started)
        out[f"step_ms_batch_{batch}"] = 1000 * statistics.median(times)
        for rid in ids:
            runner.release(rid)
    out["batching_gain"] = 4 * out["step_ms_batch_1"] / out["step_ms_batch_4"]
    return out


# ---- 2. images per minute -------------------------------------------------------------------
def diffusers_pipeline(model_dir: str, size: int, threads: int, steps: int):
    import torch
    from diffusers import FluxPipeline

    torch.set_num_threads(threads)
    pipe = FluxPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    # A whole image first, as the server gets one.
    pipe(prompt="warm up", height=size, width=size, num_inference_steps=steps)
    return pipe


def diffusers_sequential(pipe, size: int, steps: int) -> dict:
    import torch

    started = time.perf_counter()
    for i, prompt in enumerate(PROMPTS):
        pipe(prompt=prompt, height=size, width=size, num_inference_steps=steps,
             generator=torch.Generator().manual_seed(i))
    wall = time.perf_counter() - started
    return {"images": len(PROMPTS), "wall_s": wall, "images_per_minute": 60 * len(PROMPTS) / wall}


async def generate_image(client, base_url: str, prompt: str, seed: int, size: int,
                         steps: int) -> float:
    started = time.perf_counter()
    r = await client.post(base_url + "/v1/images/generations", json={
        "prompt": prompt, "size": f"{size}x{size}", "seed": seed,
        "num_inference_steps": steps})
    r.raise_for_status()
    return time.perf_counter() - started


async def loom_concurrent(base_url: str, size: int, steps: int) -> dict:
    async with http_client(timeout=900) as client:
        await generate_image(client, base_url, "warm up", 0, size, steps)
        started = time.perf_counter()
        latencies = await asyncio.gather(*(generate_image(client, base_url, p, i, size, steps)
                                           for i, p in enumerate(PROMPTS)))
        wall = time.perf_counter() - started
    return {"images": len(PROMPTS), "wall_s": wall, "images_per_minute": 60 * len(PROMPTS) / wall,
            "latency_s": latencies}


# ---- 3. text beside images ------------------------------------------------------------------
async def text_stream(client, base_url: str, model: str, index: int, tokens: int) -> list[float]:
    stamps = []
    async with client.stream("POST", base_url + "/v1/completions", json={
            "model": model, "prompt": prompt_ids(29 * 10**6 + index, 64), "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def text_itl(base_url: str, model: str, streams: int, tokens: int, size: int, steps: int,
                   image_clients: int) -> dict:
    """ITL of `streams` text streams, while `image_clients` keep generating images."""
    done = asyncio.Event()
    images = 0

    async def keep_painting(client, i):
        nonlocal images
        while not done.is_set():
            await generate_image(client, base_url, PROMPTS[i % 4], i, size, steps)
            images += not done.is_set()  # (finished while text streamed)

    async with http_client(timeout=900) as client:
        painters = [asyncio.create_task(keep_painting(client, i)) for i in range(image_clients)]
        if painters:
            await asyncio.sleep(1.0)  # the image requests running before text starts
        started = time.perf_counter()
        gaps = await asyncio.gather(*(text_stream(client, base_url, model, i, tokens)
                                      for i in range(streams)))
        wall = time.perf_counter() - started
        done.set()
        await asyncio.gather(*painters)
    every = sorted(g for stream in gaps for g in stream)
    return {"streams": streams, "image_clients": image_clients, "wall_s": wall,
            "text_tok_s": streams * tokens / wall,
            "itl_p50_ms": 1000 * statistics.median(every),
            "itl_p90_ms": 1000 * every[int(0.9 * (len(every) - 1))],
            "itl_p99_ms": 1000 * every[int(0.99 * (len(every) - 1))],
            "itl_mean_ms": 1000 * statistics.fmean(every),
            "images_finished_meanwhile": images}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.images", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=128, help="image width and height")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per image")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the worker's too)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per text stream")
    p.add_argument("--rounds", type=int, default=3,
                   help="text alone / with images, alternated (the machine's load drifts)")
    p.add_argument("--serve-args", default="", help="more `loom serve` flags")
    p.add_argument("--out", default=os.path.join(
        RESULTS_DIR, time.strftime("%Y%m%d") + "-images.json"))
    args = p.parse_args()
    env = describe_environment(REPO_DIR)
    if (warning := busy_warning(env)) is not None:
        print(warning, file=sys.stderr)
    model_dir = flux_shaped_model()
    result = {"environment": env, "shape": SHAPE, "size": args.size, "steps": args.steps,
              "threads": args.threads}
    result["step"] = step_costs(model_dir, args.size, args.threads)
    pipe = diffusers_pipeline(model_dir, args.size, args.threads, args.steps)
    log = os.path.splitext(args.out)[0] + ".server.log"
    serve = ["--image-model", model_dir, "--num-threads", str(args.threads)]
    with LoomServer(None, None, serve + args.serve_args.split(), log) as server:
        url = server.base_url
        # Alternated, never at once (the idle server waits in poll): the machine's load
        # drifts, each pair sees about the same.
        result["diffusers"], result["loom"] = [], []
        # One pair first, not counted: the server finishes starting up in the background (it
        # faults its weights in when idle), which slowed the first diffusers round 3-4x.
        diffusers_sequential(pipe, args.size, args.steps)
        asyncio.run(loom_concurrent(url, args.size, args.steps))
        for _ in range(args.rounds):
            result["diffusers"].append(diffusers_sequential(pipe, args.size, args.steps))
            result["loom"].append(asyncio.run(loom_concurrent(url, args.size, args.steps)))
        model = served_model(url)
        for name in ("text_alone", "text_with_images"):
            result[name] = []
        for _ in range(args.rounds):
            for name, image_clients in (("text_alone", 0), ("text_with_images", 4)):
                result[name].append(asyncio.run(text_itl(
                    url, model, 4, args.tokens, args.size, args.steps, image_clients)))
    result["speedup"] = statistics.median(
        loom["images_per_minute"] / diffusers["images_per_minute"]
        for diffusers, loom in zip(result["diffusers"], result["loom"]))
    result["itl_p50_ratio"] = statistics.median(
        w["itl_p50_ms"] / a["itl_p50_ms"]
        for a, w in zip(result["text_alone"], result["text_with_images"]))
    result["load_average_1m_at_end"] = os.getloadavg()[0]
    s = result["step"]
    print(f"denoising step ({args.size}x{args.size}): {s['step_ms_batch_1']:.0f} ms alone, "
          f"{s['step_ms_batch_4']:.0f} ms for 4 batched (gain {s['batching_gain']:.2f}x)")
    for diffusers, loom in zip(result["diffusers"], result["loom"]):
        print(f"images/min, 4 requests: diffusers sequential "
              f"{diffusers['images_per_minute']:.1f}, loom concurrent "
              f"{loom['images_per_minute']:.1f}")
    print(f"loom / diffusers (median of rounds): {result['speedup']:.2f}x")
    for alone, both in zip(result["text_alone"], result["text_with_images"]):
        for name, r in (("text alone", alone), ("text with images", both)):
            print(f"{name:17s} ITL p50 {r['itl_p50_ms']:.1f} ms, p90 {r['itl_p90_ms']:.1f} ms, "
                  f"p99 {r['itl_p99_ms']:.0f} ms, {r['text_tok_s']:.1f} tok/s, images "
                  f"finished meanwhile {r['images_finished_meanwhile']}")
    print(f"ITL p50 with images / alone (median of rounds): {result['itl_p50_ratio']:.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
