"""SnacDecoder (worker/speech/snac_decoder.py) against `snac`'s own decoder on a tiny random
SNAC: Orpheus's speech tokens streamed in chunks, batched across requests, must give the audio
SNAC.decode gives for the whole sequence at once (the overlap buffer makes borders seamless)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
snac = pytest.importorskip("snac")

from pipelines import AudioGenerator, GenerationStatus, TTSContext  # noqa: E402
from tests.tiny_orpheus import make_tiny_snac  # noqa: E402
from worker.speech.snac_decoder import (  # noqa: E402
    ORPHEUS_AUDIO_TOKEN_OFFSET,
    SnacDecoder,
    codes_to_tokens,
    tokens_to_codes,
)

FRAME = 2048  # samples per 7-token frame: hop 512 x coarsest stride 4
TOLERANCE = 1e-5  # float32 convolutions over windows of other lengths sum in another order


@pytest.fixture(scope="module")
def snac_dir() -> str:
    return make_tiny_snac()


@pytest.fixture(scope="module")
def reference(snac_dir):
    return snac.SNAC.from_pretrained(snac_dir)


def random_tokens(rng, frames: int) -> np.ndarray:
    codes = [rng.integers(0, 4096, (1, frames * n)) for n in (1, 2, 4)]
    return codes_to_tokens(codes, ORPHEUS_AUDIO_TOKEN_OFFSET)[0]


def whole(reference, tokens: np.ndarray) -> np.ndarray:
    frames = len(tokens) // 7
    codes = tokens_to_codes(tokens[None, : frames * 7], ORPHEUS_AUDIO_TOKEN_OFFSET)
    with torch.inference_mode():
        return reference.decode([torch.from_numpy(c) for c in codes])[0, 0].numpy()


def test_frames_map_to_codebooks_as_orpheus_reads_them():
    tokens = np.arange(3 * 7) * 11 % 4000
    tokens = tokens + ORPHEUS_AUDIO_TOKEN_OFFSET + 4096 * (np.arange(21) % 7)
    # canopylabs' orpheus_tts/decoder.py convert_to_audio, as a loop
    want = ([], [], [])
    for j in range(3):
        f = [int(t) - ORPHEUS_AUDIO_TOKEN_OFFSET - 4096 * k
             for k, t in enumerate(tokens[7 * j: 7 * j + 7])]
        want[0].append(f[0])
        want[1].extend([f[1], f[4]])
        want[2].extend([f[2], f[3], f[5], f[6]])
    codes = tokens_to_codes(tokens[None], ORPHEUS_AUDIO_TOKEN_OFFSET)
    assert [c[0].tolist() for c in codes] == list(want)
    assert codes_to_tokens(codes, ORPHEUS_AUDIO_TOKEN_OFFSET)[0].tolist() == tokens.tolist()
    with pytest.raises(ValueError, match="audio code"):
        tokens_to_codes(tokens[None] - 4096, ORPHEUS_AUDIO_TOKEN_OFFSET)


def stream(decoder, requests: dict[str, np.ndarray], block: int, chunk: int):
    """The language model appends `block` tokens per request per step, the decoder then
    decodes one chunk of each: the audio of each request in order, and the batch sizes."""
    contexts = {rid: TTSContext(tokens=np.arange(4), max_length=10_000, request_id=rid,
                                streaming=True) for rid in requests}
    audio = {rid: [] for rid in requests}
    written = dict.fromkeys(requests, 0)
    batch_sizes = []
    real_decode = decoder._decode

    def counting_decode(tokens):
        batch_sizes.append(len(tokens))
        return real_decode(tokens)

    decoder._decode = counting_decode
    for _ in range(1000):
        active = {rid: ctx for rid, ctx in contexts.items()
                  if not ctx.audio_generation_status.is_done}
        if not active:
            break
        for rid, ctx in active.items():
            new = requests[rid][written[rid]: written[rid] + block]
            if len(new):
                ctx.update_speech_tokens(new)
                written[rid] += len(new)
            if written[rid] == len(requests[rid]):
                ctx.status = GenerationStatus.END_OF_SEQUENCE
        for rid, response in decoder.next_chunk(active, chunk).items():
            if response.has_audio_data:
                audio[rid].append(response.audio_data)
            assert response.is_done == contexts[rid].audio_generation_status.is_done
    assert all(ctx.audio_generation_status.is_done for ctx in contexts.values())
    return audio, batch_sizes


def test_streamed_chunks_equal_decoding_the_whole_sequence(snac_dir, reference):
    decoder = SnacDecoder.from_pretrained(snac_dir)
    assert isinstance(decoder, AudioGenerator) and decoder.decoder_sample_rate == 24000
    rng = np.random.default_rng(1)
    # b ends in an incomplete frame (the model stopped mid-frame): those tokens make no audio
    requests = {"a": random_tokens(rng, 14), "b": np.concatenate([random_tokens(rng, 9),
                                                                  random_tokens(rng, 1)[:3]])}
    audio, batch_sizes = stream(decoder, requests, block=7 * 3, chunk=7 * 4)
    for rid, tokens in requests.items():
        want = whole(reference, tokens)
        got = np.concatenate(audio[rid])
        assert len(audio[rid]) >= 3  # it did stream
        assert len(got) == len(want) == (len(tokens) // 7) * FRAME
        assert np.abs(got - want).max() < TOLERANCE
        # every chunk border, cross-checked: the frame either side of it is the whole's
        border = 0
        for piece in audio[rid][:-1]:
            border += len(piece)
            around = slice(border - FRAME, border + FRAME)
            assert np.abs(got[around] - want[around]).max() < TOLERANCE
    assert max(batch_sizes) == 2  # both requests' chunks in one SNAC call


def test_without_the_overlap_buffer_borders_are_not_seamless(snac_dir, reference):
    """What the buffer buys (and that the equality above can fail): chunks decoded alone
    differ from the whole sequence's audio near their borders."""
    decoder = SnacDecoder.from_pretrained(snac_dir, buffer_frames=0, lookahead_frames=0)
    tokens = random_tokens(np.random.default_rng(2), 12)
    audio, _ = stream(decoder, {"a": tokens}, block=7 * 4, chunk=7 * 4)
    got, want = np.concatenate(audio["a"]), whole(reference, tokens)
    assert len(got) == len(want)
    assert np.abs(got[4 * FRAME - FRAME: 4 * FRAME + FRAME]
                  - want[4 * FRAME - FRAME: 4 * FRAME + FRAME]).max() > 100 * TOLERANCE


def test_a_request_stopped_before_a_whole_frame_ends_without_audio(snac_dir):
    decoder = SnacDecoder.from_pretrained(snac_dir)
    ctx = TTSContext(tokens=np.arange(4), max_length=100, request_id="x")
    ctx.update_speech_tokens(random_tokens(np.random.default_rng(3), 1)[:5])
    ctx.status = GenerationStatus.MAXIMUM_LENGTH
    response = decoder.next_chunk({"x": ctx}, 28)["x"]
    assert response.is_done and not response.has_audio_data
    assert response.final_status is GenerationStatus.MAXIMUM_LENGTH
    assert ctx.audio_generation_status.is_done
