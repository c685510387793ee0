"""/v1/audio/speech through loom serve: the audio is what the voice produces run directly,
valid 22,050 Hz WAV/PCM, streamed as it is made; OpenAI's client and SSE format work."""

import asyncio
import base64
import io
import json
import time
import wave

import httpx
import numpy as np
import openai
import pytest

from api_server import speech_text
from tests.helpers import start_server
from worker.speech import is_available, load_default_voice, synthesize_segments

pytestmark = pytest.mark.skipif(not is_available(), reason="the [tts] extra is not installed")

VOICE = "piper-en_US-joe-medium"
TEXT = "Hello there. This is Loom, speaking through the same processes as the text model."
LONG = " ".join(f"Sentence number {i} talks about the weather, the sea and the mountains."
                for i in range(14))
# (Long enough that the text requests run while it is spoken: the tiny text model's 64 tokens
# take milliseconds.)
SEVERAL = ". ".join(LONG.split(". ")[:4]) + "."


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = start_server(tiny_model_dir, "--deterministic-speech", threads=2, speech=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def direct_voice():
    return load_default_voice().with_noise(0.0, 0.0)


def speech(server, **body):
    r = httpx.post(server.url + "/v1/audio/speech",
                   json={"model": VOICE, "voice": "joe", **body}, timeout=120)
    return r


def test_wav_equals_the_voice_run_directly(server, direct_voice):
    r = speech(server, input=TEXT, response_format="wav")
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(r.content)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (22050, 1, 2)
        got = np.frombuffer(w.readframes(10**9), dtype="<i2")
    want = np.concatenate(list(synthesize_segments(direct_voice, speech_text.text_to_segments(TEXT))))
    assert len(got) == len(want)
    assert np.abs(got.astype(np.int32) - want).max() <= 1  # same samples (rounding aside)
    assert np.abs(got).max() > 1000  # not silence


def test_pcm_duration_grows_with_text_and_speed(server):
    def seconds(**body):
        r = speech(server, response_format="pcm", **body)
        assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
        return len(r.content) / 2 / 22050

    short, longer = seconds(input="Hello."), seconds(input=TEXT)
    assert 0 < short < longer
    assert seconds(input=TEXT, speed=2.0) < longer * 0.7


def test_first_audio_arrives_before_the_end(server):
    async def timings():
        async with httpx.AsyncClient(timeout=120) as client:
            started = time.monotonic()
            arrivals = []
            async with client.stream("POST", server.url + "/v1/audio/speech", json={
                    "model": VOICE, "input": LONG, "response_format": "pcm"}) as r:
                async for chunk in r.aiter_raw():
                    if chunk:
                        arrivals.append(time.monotonic() - started)
            return arrivals

    arrivals = asyncio.run(timings())
    assert len(arrivals) > 3
    assert arrivals[0] < arrivals[-1] / 3  # streamed, not synthesized whole first


def test_sse_stream(server, direct_voice):
    events = []
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=120, json={
            "model": VOICE, "input": TEXT, "response_format": "pcm",
            "stream_format": "sse"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert events[-1]["usage"]["output_tokens"] == len(pcm) // 2
    want = np.concatenate(list(synthesize_segments(direct_voice, speech_text.text_to_segments(TEXT))))
    assert len(pcm) // 2 == len(want)


def test_openai_client(server, tmp_path):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.audio.speech.create(model=VOICE, voice="joe", input="Testing one two three.",
                                   response_format="wav")
    assert r.content[:4] == b"RIFF"
    target = tmp_path / "out.wav"
    with client.audio.speech.with_streaming_response.create(
            model=VOICE, voice="joe", input=TEXT, response_format="wav") as response:
        response.stream_to_file(target)
    with wave.open(str(target)) as w:
        assert w.getframerate() == 22050 and w.readframes(10**9)


@pytest.mark.parametrize("body,status,param", [
    ({"input": ""}, 400, "input"),
    ({"input": "   "}, 400, "input"),
    ({"input": "a" * 4097}, 400, "input"),
    ({"input": "hi", "voice": "alloy"}, 400, "voice"),
    ({"input": "hi", "response_format": "aac"}, 400, "response_format"),
    ({"input": "hi", "speed": 5}, 400, "speed"),
    ({"input": "hi", "speed": 0.1}, 400, "speed"),
    ({"input": "hi", "model": "nope"}, 404, "model"),
])
def test_bad_requests(server, body, status, param):
    r = speech(server, **body)
    assert r.status_code == status and r.json()["error"]["param"] == param


def test_voice_is_listed(server):
    ids = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert VOICE in ids


def test_speech_and_text_together(server):
    async def scenario():
        async with httpx.AsyncClient(timeout=180) as client:
            talk = [client.post(server.url + "/v1/audio/speech",
                                json={"model": VOICE, "input": SEVERAL, "response_format": "pcm"})
                    for _ in range(2)]
            text = [client.post(server.url + "/v1/completions",
                                json={"prompt": f"story {i}", "max_tokens": 64,
                                      "ignore_eos": True, "temperature": 0})
                    for i in range(4)]
            return await asyncio.gather(*talk, *text)

    results = asyncio.run(scenario())
    assert all(r.status_code == 200 for r in results)
    assert all(len(r.content) > 22050 for r in results[:2])
    assert all(r.json()["usage"]["completion_tokens"] == 64 for r in results[2:])


def test_speech_queue_forgets_cancellations_of_other_requests():
    """The cancel channel carries text and embeddings ids too: they must leave no trace."""
    import numpy as np

    from pipelines.speech_context import TTSContext
    from scheduler.speech_queue import SpeechQueue

    queue = SpeechQueue()
    for i in range(100_000):
        queue.abort({f"text-{i}"})
    assert queue.running is None and not queue.cancelled and len(queue) == 0
    ctx = TTSContext.from_phoneme_segments([np.arange(3), np.arange(3)], request_id="s", voice="v")
    queue.add(ctx)
    assert queue.take() is ctx
    queue.abort({"s"})  # aborted while its segment runs: not put back
    queue.put_back(ctx)
    assert not queue.has_work and queue.running is None and not queue.cancelled
