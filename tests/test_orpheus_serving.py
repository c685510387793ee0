"""An Orpheus-style directory (a Llama writing SNAC tokens, its decoder in `snac/`) served by
`loom serve --model DIR`: /v1/audio/speech streams the audio of the speech tokens the language
model writes, equal to `snac`'s decoder over them (tests/tiny_orpheus.py says why the tiny
model's tokens are known)."""

import json
import os
import struct

import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("snac")

from tests.helpers import start_server  # noqa: E402
from tests.tiny_orpheus import (  # noqa: E402
    cached_orpheus_gguf,
    make_tiny_orpheus,
    snac_decode,
    speech_chain,
)
from worker.speech.pcm import to_int16  # noqa: E402

FRAMES = 12


@pytest.fixture(scope="module")
def orpheus_dir(smollm2_dir, tmp_path_factory):
    directory = make_tiny_orpheus(str(tmp_path_factory.mktemp("tiny-orpheus")), smollm2_dir,
                                  frames=FRAMES)
    # A recommended top_k in the checkpoint's generation_config.json: greedy by default.
    path = os.path.join(directory, "generation_config.json")
    with open(path) as f:
        generation = json.load(f)
    with open(path, "w") as f:
        json.dump({**generation, "top_k": 1}, f)
    return directory


@pytest.fixture(scope="module")
def server(orpheus_dir):
    srv = start_server(orpheus_dir, "--served-model-name", "orpheus")
    yield srv
    srv.stop()


def test_the_language_model_writes_the_chain(orpheus_dir):
    """The oracle's premise, by transformers: greedy generation is the chain."""
    import torch
    import transformers

    from pipelines import orpheus

    model = transformers.LlamaForCausalLM.from_pretrained(orpheus_dir)
    prompt = torch.tensor([[orpheus.START_OF_HUMAN, 1, 2, *orpheus._HUMAN_END]])
    out = model.generate(prompt, max_new_tokens=7 * FRAMES + 5, do_sample=False)
    assert out[0, prompt.shape[1]:].tolist()[: 7 * FRAMES + 1] == \
        [*speech_chain(FRAMES), orpheus.END_OF_SPEECH]


def test_speech_is_snac_decoding_the_models_tokens(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with client.audio.speech.with_streaming_response.create(
            model="orpheus", voice="tara", input="Hello there.",
            response_format="pcm") as response:
        assert response.headers["x-sample-rate"] == "24000"
        pieces = [piece for piece in response.iter_bytes() if piece]
    got = np.frombuffer(b"".join(pieces), dtype="<i2")
    want = to_int16(snac_decode(speech_chain(FRAMES)))
    assert len(got) == len(want) == FRAMES * 2048
    # float32 sums in another order may move a sample across an int16 step
    assert np.abs(got.astype(np.int32) - want).max() <= 1


def test_speech_requests_check_their_voice_speed_and_example(server):
    for body, param in (({"voice": "joe"}, "voice"), ({"speed": 2.0}, "speed"),
                        ({"audio_prompt_tokens": speech_chain(1)}, "audio_prompt_tokens"),
                        ({"audio_prompt_tokens": speech_chain(1)[:6],
                          "audio_prompt_transcription": "Hi"}, "audio_prompt_tokens")):
        r = httpx.post(server.url + "/v1/audio/speech", timeout=60,
                       json={"model": "orpheus", "input": "Hi", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_sse_streams_the_audio_in_chunks(server):
    import base64
    import json

    r = httpx.post(server.url + "/v1/audio/speech", timeout=120,
                   json={"model": "orpheus", "input": "Hello there.", "stream_format": "sse",
                         "response_format": "pcm"})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done"
    assert len(deltas) >= 2  # streamed while the model wrote: a chunk is 4 of the 12 frames
    got = np.frombuffer(b"".join(deltas), dtype="<i2")
    want = to_int16(snac_decode(speech_chain(FRAMES)))
    assert len(got) == len(want) and np.abs(got.astype(np.int32) - want).max() <= 1


def test_a_cloned_voice_speaks_after_its_example(server):
    """The example goes in the prompt (tests/test_orpheus.py checks where); the tiny model
    answers <start_of_speech> with its chain whatever came before, and the example's own
    audio tokens are not spoken again."""
    r = httpx.post(server.url + "/v1/audio/speech", timeout=120,
                   json={"model": "orpheus", "input": "Hello.", "response_format": "pcm",
                         "audio_prompt_tokens": speech_chain(2),
                         "audio_prompt_transcription": "An example."})
    assert r.status_code == 200
    assert len(r.content) // 2 == FRAMES * 2048


def test_sampling_defaults_come_from_flags_then_the_checkpoint(orpheus_dir):
    """vLLM's --generation-config auto: a flag wins, then generation_config.json, then (an
    Orpheus checkpoint) canopylabs' recommended values, then Loom's."""
    from api_server.cli import build_parser, serve_config_from_args

    def defaults(*flags):
        args = build_parser().parse_args(["serve", "--model", orpheus_dir, *flags])
        return serve_config_from_args(args).model_config.sampling_params_defaults

    d = defaults("--top-p", "0.5")
    assert (d.top_p, d.top_k, d.temperature, d.repetition_penalty) == (0.5, 1, 0.6, 1.3)
    d = defaults("--generation-config", "vllm")
    assert (d.top_p, d.top_k, d.temperature, d.repetition_penalty) == (1.0, 0, 1.0, 1.0)


def test_text_requests_that_leave_sampling_out_get_the_checkpoints(server):
    """generation_config.json's top_k 1 makes an omitted top_k greedy: two choices agree;
    with the request's own top_k they are sampled. (After token 2, whose embedding is zero,
    the tiny model's logits are all equal: a sample is any of 157k tokens.)"""
    def choices(**sampling):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "orpheus", "prompt": [5, 900, 77, 2], "max_tokens": 1, "n": 2,
            "logprobs": 0, "return_tokens_as_token_ids": True, **sampling})
        assert r.status_code == 200, r.text
        return [c["logprobs"]["tokens"] for c in r.json()["choices"]]

    first, second = choices()
    assert first == second
    first, second = choices(top_k=-1)
    assert first != second


def mp3_frames(data: bytes) -> list[tuple[int, int, int]]:
    """(sample rate, channel mode, samples) of each MPEG audio Layer III frame, walking the
    frame headers from the start to the end (any byte out of place fails)."""
    bitrates = {3: [0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320],
                2: [0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160]}
    rates = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000)}
    frames, at = [], 0
    while at < len(data):
        (header,) = struct.unpack(">I", data[at:at + 4])
        version, layer = (header >> 19) & 3, (header >> 17) & 3
        assert header >> 21 == 0x7FF and version in (2, 3) and layer == 1, f"byte {at}"
        rate = rates[version][(header >> 10) & 3]
        bitrate = bitrates[version][(header >> 12) & 15] * 1000
        per_frame = 1152 if version == 3 else 576
        at += per_frame // 8 * bitrate // rate + ((header >> 9) & 1)
        frames.append((rate, (header >> 6) & 3, per_frame))
    assert at == len(data)
    return frames


def test_mp3_is_frames_of_the_whole_audio(server):
    pytest.importorskip("lameenc")
    r = httpx.post(server.url + "/v1/audio/speech", timeout=120,
                   json={"model": "orpheus", "input": "Hello there.", "response_format": "mp3"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    frames = mp3_frames(r.content)
    assert {(rate, mode) for rate, mode, _ in frames} == {(24000, 3)}  # 24 kHz mono
    # LAME's start delay and the last frame's padding: under three frames more
    samples = sum(n for *_, n in frames)
    assert FRAMES * 2048 <= samples < FRAMES * 2048 + 3 * 576


@pytest.fixture(scope="module")
def gguf_server(orpheus_dir):
    # (The first start on a machine reads the file's tokenizer: minutes on a busy one.)
    srv = start_server(cached_orpheus_gguf(orpheus_dir, FRAMES), "--served-model-name",
                       "orpheus-gguf", timeout=900)
    yield srv
    srv.stop()


def test_a_gguf_orpheus_directory_speaks_the_same(gguf_server):
    """A directory holding the language model as one GGUF file and snac/ serves the same
    speech tokens, decoded the same."""
    r = httpx.post(gguf_server.url + "/v1/audio/speech", timeout=120, json={
        "model": "orpheus-gguf", "input": "Hello there.", "response_format": "pcm"})
    assert r.status_code == 200 and r.headers["x-sample-rate"] == "24000"
    got = np.frombuffer(r.content, dtype="<i2")
    want = to_int16(snac_decode(speech_chain(FRAMES)))
    assert len(got) == len(want) and np.abs(got.astype(np.int32) - want).max() <= 1
