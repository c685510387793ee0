"""SpeechRunner: the worker's Piper voice as an AudioGenerator. Runs it (onnxruntime, one
thread, no spinning: it shares the cores with torch) one sentence per context and step: a
context's speech tokens are its phonemes, `segment_lengths` its sentences.

The voice loads in a background thread at worker start (about 2 s), so the text model is
ready to serve first; a speech step that arrives earlier waits for it.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from pipelines.audio_generation import AudioGenerationResponse, AudioGenerator
from pipelines.speech_context import TTSContext
from pipelines.status import GenerationStatus, PipelineTask
from serialization.messages import AudioResult, AudioStep

logger = logging.getLogger(__name__)


def run_audio_step(generator: AudioGenerator, step: AudioStep) -> AudioResult:
    """An AudioStep through any AudioGenerator: each context's next chunk, as int16 PCM."""
    from worker.speech.pcm import to_int16

    batch = {ctx.request_id: ctx for ctx in step.contexts}
    responses = generator.next_chunk(batch, step.num_tokens)
    audio = []
    for rid in batch:
        response = responses[rid]
        samples = response.audio_data if response.has_audio_data else np.zeros(0, np.float32)
        if samples.dtype != np.int16:
            samples = to_int16(samples)
        audio.append(np.ascontiguousarray(samples, np.int16))
    return AudioResult(step_id=step.step_id, audio=audio,
                       decoded_index=[ctx.decoded_index for ctx in batch.values()])

class SpeechRunner:
    speech_task = PipelineTask.AUDIO_GENERATION  # a voice beside the text model

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

    @property
    def decoder_sample_rate(self) -> int:
        return self.sample_rate

    def next_chunk(
        self, batch: dict[str, TTSContext], num_tokens: int = 0
    ) -> dict[str, AudioGenerationResponse]:
        """Each context's next sentence (`num_tokens` is unused: Piper speaks whole
        sentences)."""
        self._ready.wait()
        if self._voice is None:
            raise RuntimeError(f"the voice is unavailable: {self._error}")
        responses = {}
        for rid, ctx in batch.items():
            phonemes, _ = ctx.next_speech_tokens(ctx.next_segment_length())
            audio = self._speech.to_int16(self._voice.synthesize(phonemes.tolist(), ctx.speed))
            ctx.decoded_index += len(phonemes)
            done = not ctx.has_undecoded_speech_tokens() and ctx.status.is_done
            responses[rid] = AudioGenerationResponse(
                GenerationStatus.END_OF_SEQUENCE if done else GenerationStatus.ACTIVE, audio)
        return responses

    def release(self, context: TTSContext) -> None:
        """Nothing to free: Piper keeps no state between a request's sentences."""
