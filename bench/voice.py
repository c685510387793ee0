"""`python -m bench.voice`: the Piper voice in this process, without a server (the `tts`
extra). Load time, memory, first-segment latency vs total time for a ~1,000-character text,
real-time factor, batched vs unbatched throughput, and the effect of ORT thread settings.
`python -m bench.speech` measures the same voice through `loom serve`.

Wall time is what a client sees; CPU time shows what busy-waiting costs the other
processes on the machine (with spinning on, CPU time exceeds the useful work).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

from api_server import speech_text
from worker import speech

TEXT = (
    "Speech synthesis turns written language into sound, and a good system has to "
    "decide how every word is pronounced before a single sample is produced. "
    + " ".join(
        f"Sentence number {i} describes the weather, the traffic and the news."
        for i in range(1, 13)
    )
    + " Finally, the listener hears the whole text without waiting for it to finish."
)


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident memory of this process, MiB."""
    fields: dict[str, float] = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """fn's result, wall seconds, CPU seconds (all threads of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def stream(voice: Any, text: str) -> tuple[float, float, float, float]:
    """(time to first audio, total wall, total CPU, audio seconds) for one request."""
    wall, cpu = time.perf_counter(), time.process_time()
    first = None
    samples = 0
    for pcm in speech.synthesize_segments(voice, speech_text.text_to_segments(text)):
        first = first if first is not None else time.perf_counter() - wall
        samples += len(pcm)
    total = time.perf_counter() - wall
    return first or 0.0, total, time.process_time() - cpu, samples / voice.sample_rate


def batch_throughput(voice: Any, batch_size: int) -> tuple[float, float]:
    """Audio seconds per wall second over the long text's segments, and padding waste."""
    ids = [s.phoneme_ids for s in speech_text.text_to_segments(TEXT)]
    # Similar lengths together keep the padding (wasted compute) small.
    ids.sort(key=len)
    groups = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
    padded = sum(len(g) * max(map(len, g)) for g in groups)
    audio, wall, _ = timed(
        lambda: [a for g in groups for a in voice.synthesize_batch(g)]
    )
    seconds = sum(len(a) for a in audio) / voice.sample_rate
    return seconds / wall, padded / sum(map(len, ids)) - 1


def run(threads: int, spinning: bool, batch_sizes: Sequence[int]) -> None:
    print(f"\n== intra_op_threads={threads} allow_spinning={spinning}")
    voice, load_s, _ = timed(
        lambda: speech.load_default_voice(
            intra_op_threads=threads, allow_spinning=spinning
        )
    )
    print(f"load {load_s:.2f} s, RSS {rss_mib()[0]:.0f} MiB")
    sentence = speech_text.text_to_segments("This is the first request after loading.")[0]
    _, cold, _ = timed(lambda: voice.synthesize(sentence.phoneme_ids))
    _, warm, _ = timed(lambda: voice.synthesize(sentence.phoneme_ids))
    print(f"first run {cold:.3f} s, same sentence again {warm:.3f} s")
    first, total, cpu, audio = stream(voice, TEXT)
    print(
        f"{len(TEXT)} chars -> {audio:.1f} s audio: first segment {first:.2f} s, "
        f"total {total:.2f} s, RTF {total / audio:.3f}, CPU/audio {cpu / audio:.3f}"
    )
    for size in batch_sizes:
        rate, waste = batch_throughput(voice, size)
        print(f"batch {size}: {rate:.1f} s audio per s (padding +{waste:.0%})")
    print(f"peak RSS so far {rss_mib()[1]:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.voice", description=__doc__)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--spinning", choices=["off", "on", "both"], default="both")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    spin_modes = {"off": [False], "on": [True], "both": [False, True]}[args.spinning]
    print(f"{len(speech_text.text_to_segments(TEXT))} segments for the {len(TEXT)}-char text")
    for threads in args.threads:
        for spinning in spin_modes:
            run(threads, spinning, args.batch)


if __name__ == "__main__":
    main()
