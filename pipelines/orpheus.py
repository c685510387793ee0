"""Orpheus's conventions (canopylabs/orpheus-tts): its prompt, its speech tokens, its sampling
defaults, and what a checkpoint directory of it looks like.

Orpheus is a Llama 3 whose vocabulary adds special tokens past 128256 and 7 x 4096 audio
tokens from 128266 (worker/speech/snac_decoder.py maps them to SNAC's codebooks). The
prompt, as canopylabs' engine builds it:

    <start_of_human> <|begin_of_text|> "{voice}: {text}" <|eot_id|> <end_of_human>
    <start_of_ai> <start_of_speech>

and the model writes audio tokens until <end_of_speech>. Voice cloning puts a spoken example
first, as their voice-clone notebook does: its transcription as a human turn, its audio
tokens as the answer (closed by <end_of_speech> <end_of_ai>), then the text to speak.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from pipelines.audio_generation import AudioGenerationRequest
from pipelines.sampling_params import SamplingParams

BEGIN_OF_TEXT = 128000
END_OF_TEXT = 128009  # <|eot_id|>
START_OF_SPEECH = 128257
END_OF_SPEECH = 128258
START_OF_HUMAN = 128259
END_OF_HUMAN = 128260
START_OF_AI = 128261
END_OF_AI = 128262
AUDIO_TOKEN_OFFSET = 128266
TOKENS_PER_FRAME = 7
AUDIO_TOKENS = TOKENS_PER_FRAME * 4096
VOCAB_SIZE = AUDIO_TOKEN_OFFSET + AUDIO_TOKENS  # 156938
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
SNAC_SUBDIRECTORY = "snac"
# The decoder's chunks (4 frames, 340 ms at 24 kHz) and the frames it holds back while the
# language model may still write (worker/speech/snac_decoder.py says why).
AUDIO_CHUNK_TOKENS = 4 * TOKENS_PER_FRAME
LOOKAHEAD_TOKENS = 4 * TOKENS_PER_FRAME  # the decoder beside the language model in a served directory

_HUMAN_END = (END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH)


# canopylabs' defaults: below a repetition penalty of 1.1 generations are unstable. A served
# directory's generation_config.json and the server's flags come first
# (pipelines/checkpoint/generation_config.py).
SAMPLING_DEFAULTS = dict(temperature=0.6, top_p=0.8, repetition_penalty=1.3)


def recommended_sampling(**overrides) -> SamplingParams:
    """The sampling of a speech request: canopylabs' defaults, then `overrides`."""
    fields = dict(**SAMPLING_DEFAULTS, max_new_tokens=1200, stop_token_ids=[END_OF_SPEECH])
    fields.update(overrides)
    return SamplingParams(**fields)


def prompt_tokens(request: AudioGenerationRequest, encode: Callable[[str], Sequence[int]],
                  voice: str = "") -> list[int]:
    """The prompt's token ids. `encode` is the text tokenizer with its special tokens (it
    starts with <|begin_of_text|>); `request.prompt`, when set, is used as it is."""
    if isinstance(request.prompt, list):
        return list(request.prompt)
    if isinstance(request.prompt, str):
        return [START_OF_HUMAN, *encode(request.prompt), *_HUMAN_END]
    if not request.input:
        raise ValueError("input must not be empty")
    ids: list[int] = []
    if request.audio_prompt_tokens:
        if not request.audio_prompt_transcription:
            raise ValueError("audio_prompt_tokens need their audio_prompt_transcription")
        check_audio_tokens(request.audio_prompt_tokens)
        ids += [START_OF_HUMAN, *encode(request.audio_prompt_transcription), *_HUMAN_END,
                *request.audio_prompt_tokens, END_OF_SPEECH, END_OF_AI]
    text = f"{voice}: {request.input}" if voice else request.input
    return ids + [START_OF_HUMAN, *encode(text), *_HUMAN_END]


def check_audio_tokens(tokens: Sequence[int]) -> None:
    """Audio prompt tokens are whole frames of audio tokens, each in its position's range."""
    arr = np.asarray(tokens, dtype=np.int64)
    if len(arr) % 7:
        raise ValueError(f"audio_prompt_tokens has {len(arr)} tokens, not whole 7-token frames")
    codes = arr - AUDIO_TOKEN_OFFSET - 4096 * (np.arange(len(arr)) % 7)
    if len(arr) and (codes.min() < 0 or codes.max() >= 4096):
        raise ValueError("audio_prompt_tokens holds a token that is not an audio token of its "
                         "position in the frame")


def accept_speech_tokens(generated: Sequence[int], count: int) -> np.ndarray:
    """The audio tokens of what the model generated, after `count` accepted before: each
    must be an audio token of its position in the frame, as canopylabs' decoder reads them
    (special tokens such as <end_of_speech>, and misplaced audio tokens, are left out)."""
    accepted = []
    for token in np.asarray(generated, dtype=np.int64).tolist():
        low = AUDIO_TOKEN_OFFSET + 4096 * ((count + len(accepted)) % TOKENS_PER_FRAME)
        if low <= token < low + 4096:
            accepted.append(token)
    return np.asarray(accepted, dtype=np.int64)


def is_orpheus_directory(directory: str) -> bool:
    """A Llama with Orpheus's vocabulary, its SNAC decoder in `snac/` beside it."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return (config.get("model_type") == "llama"
            and config.get("vocab_size", 0) >= VOCAB_SIZE
            and _is_snac_directory(os.path.join(directory, SNAC_SUBDIRECTORY)))


def snac_directory(model_path: str) -> str | None:
    """The SNAC decoder of an Orpheus checkpoint: a directory's `snac/`, or for a GGUF file
    (as llama.cpp users hold Orpheus: the file and `snac/` in one directory) the `snac/`
    beside it; None for any other model."""
    if os.path.isdir(model_path):
        return os.path.join(model_path, SNAC_SUBDIRECTORY) \
            if is_orpheus_directory(model_path) else None
    snac = os.path.join(os.path.dirname(model_path), SNAC_SUBDIRECTORY)
    if not (model_path.lower().endswith(".gguf") and _is_snac_directory(snac)):
        return None
    from pipelines.checkpoint.gguf_header import ArrayValue, HeaderError, read_header

    try:
        fields = read_header(model_path).fields
    except (HeaderError, OSError):
        return None
    tokens = fields.get("tokenizer.ggml.tokens")
    is_orpheus = (fields.get("general.architecture") == "llama"
                  and isinstance(tokens, ArrayValue) and tokens.length >= VOCAB_SIZE)
    return snac if is_orpheus else None


def _is_snac_directory(directory: str) -> bool:
    return (os.path.isfile(os.path.join(directory, "config.json"))
            and os.path.isfile(os.path.join(directory, "pytorch_model.bin")))
