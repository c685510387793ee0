"""SpeechRunner: the worker's AudioGenerator. Runs the Piper voice (onnxruntime, one thread,
no spinning: it shares the cores with torch) one segment per AudioStep.

The voice loads in a background thread at worker start (about 2 s), so the text model is
ready to serve first; a speech step that arrives earlier waits for it.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from serialization.messages import AudioResult, AudioStep

logger = logging.getLogger(__name__)


class SpeechRunner:
    def __init__(self, noise: bool = True) -> None:
        import worker.speech as speech

        self._noise = noise
        self._speech = speech
        self.voice_id = speech.VOICE_ID
        self.sample_rate = speech.default_voice_config().sample_rate
        self._voice = None
        self._error: Exception | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._load, name="voice-load", daemon=True).start()

    @staticmethod
    def available() -> bool:
        try:
            import worker.speech as speech
        except ImportError:
            return False
        return speech.is_available()

    def _load(self) -> None:
        try:
            voice = self._speech.load_default_voice(intra_op_threads=1, allow_spinning=False)
            self._speech.warm_up(voice)
            self._voice = voice if self._noise else voice.with_noise(0.0, 0.0)
            logger.info("voice %s loaded (%d Hz)", self.voice_id, self.sample_rate)
        except Exception as exc:
            self._error = exc
            logger.error("voice %s failed to load: %s", self.voice_id, exc)
        finally:
            self._ready.set()

    def next_chunk(self, step: AudioStep) -> AudioResult:
        self._ready.wait()
        if self._voice is None:
            return AudioResult(step_id=step.step_id, audio=np.zeros(0, np.int16),
                               error=f"the voice is unavailable: {self._error}")
        audio = self._speech.to_int16(self._voice.synthesize(step.phoneme_ids.tolist(), step.speed))
        return AudioResult(step_id=step.step_id, audio=np.ascontiguousarray(audio, np.int16))
