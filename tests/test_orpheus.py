"""Orpheus's prompt and speech-token conventions (pipelines/orpheus.py), as canopylabs'
engine and voice-clone notebook lay them out."""

import json

import pytest

from pipelines import AudioGenerationRequest, orpheus


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: <|begin_of_text|>, then one id per character."""
    return [orpheus.BEGIN_OF_TEXT, *(ord(c) for c in text)]


def audio_tokens(frames: int) -> list[int]:
    return [orpheus.AUDIO_TOKEN_OFFSET + 4096 * (i % 7) + i for i in range(7 * frames)]


def test_prompt_is_canopylabs_layout():
    ids = orpheus.prompt_tokens(AudioGenerationRequest(input="Hi"), encode, voice="tara")
    assert ids == [128259, 128000, *map(ord, "tara: Hi"), 128009, 128260, 128261, 128257]


def test_voice_cloning_puts_the_example_first():
    example = audio_tokens(2)
    request = AudioGenerationRequest(input="Hi", audio_prompt_tokens=example,
                                     audio_prompt_transcription="Yo")
    ids = orpheus.prompt_tokens(request, encode)
    head = [128259, 128000, *map(ord, "Yo"), 128009, 128260, 128261, 128257, *example,
            128258, 128262]
    assert ids == head + [128259, 128000, *map(ord, "Hi"), 128009, 128260, 128261, 128257]
    with pytest.raises(ValueError, match="transcription"):
        orpheus.prompt_tokens(AudioGenerationRequest(input="Hi", audio_prompt_tokens=example),
                              encode)
    for bad in (example[:-1], [orpheus.AUDIO_TOKEN_OFFSET + 4096] * 7):
        with pytest.raises(ValueError, match="audio_prompt_tokens"):
            orpheus.prompt_tokens(AudioGenerationRequest(
                input="Hi", audio_prompt_tokens=bad, audio_prompt_transcription="Yo"), encode)


def test_a_given_prompt_is_used_as_is():
    assert orpheus.prompt_tokens(AudioGenerationRequest(prompt=[1, 2, 3]), encode) == [1, 2, 3]


def test_speech_tokens_leave_special_and_misplaced_tokens_out():
    frame = audio_tokens(1)
    generated = [frame[0], frame[0], *frame[1:4], orpheus.START_OF_AI, *frame[4:],
                 orpheus.END_OF_SPEECH]
    assert orpheus.accept_speech_tokens(generated, 0).tolist() == frame
    assert orpheus.accept_speech_tokens(frame[3:], 3).tolist() == frame[3:]
    assert orpheus.accept_speech_tokens(frame[3:], 0).tolist() == []
    assert orpheus.recommended_sampling().stop_token_ids == [orpheus.END_OF_SPEECH]


def test_an_orpheus_directory_is_a_llama_with_snac_beside_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "vocab_size": 156940}))
    assert not orpheus.is_orpheus_directory(str(tmp_path))  # no decoder
    (tmp_path / "snac").mkdir()
    (tmp_path / "snac" / "config.json").write_text("{}")
    (tmp_path / "snac" / "pytorch_model.bin").write_bytes(b"")
    assert orpheus.is_orpheus_directory(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "vocab_size": 128256}))
    assert not orpheus.is_orpheus_directory(str(tmp_path))  # no audio tokens
