"""An Orpheus-style directory (a Llama writing SNAC tokens, its decoder in `snac/`) served by
`loom serve --model DIR`: /v1/audio/speech streams the audio of the speech tokens the language
model writes, equal to `snac`'s decoder over them (tests/tiny_orpheus.py says why the tiny
model's tokens are known)."""

import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("snac")

from tests.helpers import start_server  # noqa: E402
from tests.tiny_orpheus import make_tiny_orpheus, snac_decode, speech_chain  # noqa: E402
from worker.speech.pcm import to_int16  # noqa: E402

FRAMES = 12


@pytest.fixture(scope="module")
def orpheus_dir(smollm2_dir, tmp_path_factory):
    return make_tiny_orpheus(str(tmp_path_factory.mktemp("tiny-orpheus")), smollm2_dir,
                             frames=FRAMES)


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
