"""Post-processing of raw model audio, identical to piper-tts's defaults.

Kept bit-for-bit equal to piper (PiperVoice.synthesize with normalize_audio=True,
volume=1, then AudioChunk.audio_int16_array) so that tests can compare our audio with
piper's sample for sample.
"""

from __future__ import annotations

import numpy as np

# piper's _MAX_WAV_VALUE: 32767, not 32768, so +1.0 and -1.0 map symmetrically.
_INT16_SCALE = 32767.0
# Below this peak the segment is silence; scaling it up would only amplify noise.
_SILENCE_PEAK = 1e-8


def peak_normalize(audio: np.ndarray) -> np.ndarray:
    """Scale so the loudest sample is +-1.0, as piper does per sentence (float32)."""
    if audio.size == 0:
        return audio.astype(np.float32)
    # Keep the peak a float32 scalar: dividing by it then rounds exactly as piper does.
    peak = np.max(np.abs(audio))
    if peak < _SILENCE_PEAK:
        return np.zeros_like(audio, dtype=np.float32)
    normalized: np.ndarray = np.clip(audio / peak, -1.0, 1.0).astype(np.float32)
    return normalized


def to_int16(audio: np.ndarray) -> np.ndarray:
    """Float PCM in [-1, 1] -> int16 PCM (truncating, like piper's astype)."""
    scaled = np.clip(audio * _INT16_SCALE, -_INT16_SCALE, _INT16_SCALE)
    return scaled.astype(np.int16)
