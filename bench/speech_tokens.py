"""`python -m bench.speech_tokens`: a speech-token model (Orpheus-style) served by `loom serve`.

The model: random weights in Orpheus-3B's shapes scaled to run on a small CPU. Orpheus-3B is
Llama 3.2 3B (hidden 3072, MLP 8192, 28 layers, 24 query / 8 KV heads of 128, vocabulary
156,940); here the same layer structure (GQA 3:1, head_dim 128, SwiGLU at 8/3 of hidden, its
vocabulary) with hidden 384, MLP 1024, `--layers` layers (untied head: it is steered so the
model speaks a known chain of audio tokens, tests/tiny_orpheus.py); its decoder is a SNAC of
the real snac_24khz config (19.8 M parameters, random weights).

1. c=1: time to the first audio chunk, against what it cannot beat: the time to generate the
   speech tokens the first chunk waits for (the chunk and the frames held back; the same
   prompt through /v1/completions) plus one decoder call on that window (in this process).
2. c=4: four speech requests at once: real-time factor (wall time / audio seconds).
3. Text sharing the model: one streaming /v1/completions client's inter-token latency alone,
   while four speech requests stream, and (the control) while four text requests of as many
   tokens, sampled as Orpheus samples, share the batch without a decoder.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import time

import numpy as np

from bench import RESULTS_DIR
from bench.endpoint import http_client
from bench.prompts import prompt_ids
from bench.server import LoomServer
from pipelines import orpheus

# snac_24khz's config.json (hubertsiuzdak/snac_24khz).
SNAC_24KHZ = dict(sampling_rate=24000, encoder_dim=48, encoder_rates=[2, 4, 8, 8],
                  decoder_dim=1024, decoder_rates=[8, 8, 4, 2], attn_window_size=None,
                  codebook_size=4096, codebook_dim=8, vq_strides=[4, 2, 1], noise=True,
                  depthwise=True)
SHAPE = dict(hidden_size=384, intermediate_size=1024, num_attention_heads=3,
             num_key_value_heads=1, max_position_embeddings=4096, rope_theta=500000.0)
TEXT = "The lighthouse keeper walked along the cliffs at dawn, counting the ships."
SAMPLING = dict(temperature=0.6, top_p=0.8, repetition_penalty=1.3)  # Orpheus's
SAMPLE_RATE = 24000


def build_model(directory: str, layers: int, frames: int) -> str:
    from pipelines.checkpoint.default_model import ensure_default_model
    from tests.tiny_orpheus import make_tiny_orpheus, make_tiny_snac

    if not os.path.isfile(os.path.join(directory, "model.safetensors")):
        make_tiny_orpheus(directory, ensure_default_model(), frames=frames,
                          snac_dir=make_tiny_snac(SNAC_24KHZ, "bench-snac-24khz"),
                          num_hidden_layers=layers, **SHAPE)
    return directory


def speech_prompt(model_dir: str) -> list[int]:
    import transformers

    from pipelines.audio_generation import AudioGenerationRequest

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return orpheus.prompt_tokens(AudioGenerationRequest(model="orpheus", input=TEXT),
                                 lambda t: tokenizer.encode(t, add_special_tokens=True), "tara")


def decoder_call_seconds(model_dir: str, frames: int, repeats: int = 3) -> float:
    """One SNAC call on the first chunk's window (its frames and those held back)."""
    from tests.tiny_orpheus import speech_chain
    from worker.speech.snac_decoder import SnacDecoder

    decoder = SnacDecoder.for_checkpoint(model_dir, "orpheus")
    window = np.asarray(speech_chain(frames))[None]
    decoder._decode(window)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        decoder._decode(window)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def speak(client, base_url: str, text: str) -> dict:
    started = time.perf_counter()
    first, samples = None, 0
    async with client.stream("POST", base_url + "/v1/audio/speech", json={
            "model": "orpheus", "input": text, "response_format": "pcm"}) as r:
        r.raise_for_status()
        async for chunk in r.aiter_raw():
            if chunk and first is None:
                first = time.perf_counter() - started
            samples += len(chunk) // 2
    total = time.perf_counter() - started
    audio = samples / SAMPLE_RATE
    return {"first_audio_s": first, "total_s": total, "audio_s": audio, "rtf": total / audio}


async def complete(client, base_url: str, prompt: list[int], tokens: int,
                   **sampling) -> list[float]:
    """Arrival times (from the request's start) of a streamed completion's tokens (counted
    by their log probabilities: an audio token has no text)."""
    started = time.perf_counter()
    stamps = []
    async with client.stream("POST", base_url + "/v1/completions", json={
            "model": "orpheus", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True,
            **sampling}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter() - started
                for choice in json.loads(line[6:])["choices"]:
                    stamps += [now] * len((choice.get("logprobs") or {}).get("tokens", []))
    if len(stamps) != tokens:
        raise RuntimeError(f"{len(stamps)} tokens streamed, not {tokens}")
    return stamps


def itl_stats(stamps: list[float]) -> dict:
    gaps = np.diff(stamps) * 1000
    return {"tokens": len(stamps), "itl_p50_ms": float(np.percentile(gaps, 50)),
            "itl_p90_ms": float(np.percentile(gaps, 90)),
            "itl_p99_ms": float(np.percentile(gaps, 99)), "itl_max_ms": float(gaps.max()),
            "itl_mean_ms": float(gaps.mean())}


async def measure(base_url: str, model_dir: str, text_tokens: int) -> dict:
    prompt = speech_prompt(model_dir)
    first_chunk_tokens = orpheus.AUDIO_CHUNK_TOKENS + orpheus.LOOKAHEAD_TOKENS
    async with http_client(timeout=1800) as client:
        await speak(client, base_url, "Warm up.")
        # The first chunk's speech tokens, sampled as the speech request samples them, after
        # a prompt of the same length (ids of the tokenizer's own vocabulary: the bench's
        # stands in for Orpheus's and lacks its special tokens).
        token_times = []
        for i in range(2):
            stamps = await complete(client, base_url, prompt_ids(40 + i, len(prompt)),
                                    first_chunk_tokens, **SAMPLING)
            token_times.append(stamps[first_chunk_tokens - 1])
        singles = [await speak(client, base_url, f"{TEXT} ({i})") for i in range(2)]
        text_alone = itl_stats(await complete(client, base_url, prompt_ids(31, 64),
                                              text_tokens, temperature=0))
        started = time.perf_counter()

        async def text_while_speaking():
            await asyncio.sleep(1.0)  # the speech requests are in
            return await complete(client, base_url, prompt_ids(32, 64), text_tokens,
                                  temperature=0)

        *four, stamps = await asyncio.gather(
            *(speak(client, base_url, f"{TEXT} [{i}]") for i in range(4)),
            text_while_speaking())
        wall = time.perf_counter() - started
        # The control: four text requests in the speech requests' place (sampled as Orpheus
        # samples, longer than the text client's), no decoder: what sharing the language
        # model's batch costs the text client by itself.
        async def text_beside_text():
            await asyncio.sleep(1.0)
            return await complete(client, base_url, prompt_ids(33, 64), text_tokens,
                                  temperature=0)

        *_, control = await asyncio.gather(
            *(complete(client, base_url, prompt_ids(50 + i, len(prompt)), 2 * text_tokens,
                       **SAMPLING) for i in range(4)),
            text_beside_text())
    decoder_s = decoder_call_seconds(model_dir, first_chunk_tokens // orpheus.TOKENS_PER_FRAME)
    tokens_s = statistics.median(token_times)
    first_audio = statistics.median(s["first_audio_s"] for s in singles)
    return {
        "c1": {"first_audio_s": first_audio, "first_chunk_tokens": first_chunk_tokens,
               "tokens_s": tokens_s, "decoder_call_s": decoder_s,
               "ratio": first_audio / (tokens_s + decoder_s),
               "audio_s": singles[0]["audio_s"],
               "rtf": statistics.median(s["rtf"] for s in singles), "runs": singles},
        "c4": {"rtf_median": statistics.median(s["rtf"] for s in four),
               "audio_s_per_wall_s": sum(s["audio_s"] for s in four) / wall,
               "first_audio_s_median": statistics.median(s["first_audio_s"] for s in four),
               "runs": four},
        "text_alone": text_alone,
        "text_with_4_speech": itl_stats(stamps),
        "text_with_4_text_sampled_as_speech": itl_stats(control),
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.speech_tokens", description=__doc__)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--frames", type=int, default=24, help="audio frames each request speaks")
    p.add_argument("--text-tokens", type=int, default=200)
    p.add_argument("--model-dir", default=os.path.expanduser("~/.cache/loom/bench-orpheus"))
    p.add_argument("--serve-args", default="")
    p.add_argument("--out", default=os.path.join(
        RESULTS_DIR, f"{datetime.date.today():%Y%m%d}-speech-tokens.json"))
    args = p.parse_args()
    model_dir = build_model(f"{args.model_dir}-{args.layers}l-{args.frames}f", args.layers,
                            args.frames)
    log = os.path.splitext(args.out)[0] + ".server.log"
    # No prefix cache: every request pays its prefill, as distinct texts do. A KV cache of
    # what the runs need: faulting in the default's gigabytes would compete with them.
    serve_args = ["--served-model-name", "orpheus", "--no-prefix-caching",
                  "--kv-cache-memory", "512MiB", *args.serve_args.split()]
    load_before = os.getloadavg()
    with LoomServer("float32", model_dir, serve_args, log) as server:
        result = asyncio.run(measure(server.base_url, model_dir, args.text_tokens))
    # A shared machine: its load says how much of it the runs had.
    result["load_average_1min"] = {"before": load_before[0], "after": os.getloadavg()[0],
                                   "cpus": os.cpu_count()}
    result["model"] = {"layers": args.layers, **SHAPE, "vocab_size": orpheus.VOCAB_SIZE,
                       "snac": SNAC_24KHZ, "frames_per_request": args.frames,
                       "serve_args": serve_args}
    result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    c1, c4 = result["c1"], result["c4"]
    print(f"c=1 first audio {c1['first_audio_s']*1000:.0f} ms = {c1['ratio']:.2f} x "
          f"({c1['first_chunk_tokens']} tokens {c1['tokens_s']*1000:.0f} ms + decoder call "
          f"{c1['decoder_call_s']*1000:.0f} ms); RTF {c1['rtf']:.2f} for "
          f"{c1['audio_s']:.1f} s of audio")
    print(f"c=4 RTF {c4['rtf_median']:.2f} (median), {c4['audio_s_per_wall_s']:.2f} s of audio "
          f"per s; first audio {c4['first_audio_s_median']*1000:.0f} ms")
    alone, shared = result["text_alone"], result["text_with_4_speech"]
    for name, r in (("text alone", alone), ("text + 4 speech", shared),
                    ("text + 4 text", result["text_with_4_text_sampled_as_speech"])):
        print(f"{name:16s} ITL p50 {r['itl_p50_ms']:.1f} ms, p90 {r['itl_p90_ms']:.1f}, "
              f"p99 {r['itl_p99_ms']:.1f}, max {r['itl_max_ms']:.0f}, mean {r['itl_mean_ms']:.1f}")
    print(f"ITL p50 ratio {shared['itl_p50_ms'] / alone['itl_p50_ms']:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
