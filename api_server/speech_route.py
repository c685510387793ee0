"""POST /v1/audio/speech, as OpenAI defines it: the body is the audio itself, streamed in
chunks as the worker synthesizes them (`stream_format: "audio"`), or SSE events
`speech.audio.delta` (base64 PCM) then `speech.audio.done` with usage (`stream_format: "sse"`).

Formats: `wav` (a streaming header: sizes unknown up front are 0xFFFFFFFF, which readers treat
as "until the end"), `pcm` (raw 16-bit little-endian mono) and `mp3` (with the `lameenc`
package: api_server/mp3.py). The audio is at the voice's own rate (Piper's 22,050 Hz, SNAC's
24 kHz; OpenAI's `pcm` is 24 kHz: we don't resample, the `X-Sample-Rate` header says the
rate).
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Annotated, Literal

import msgspec
import numpy as np
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from api_server.engine_client import EngineClient, EngineDeadError, GenerationFailed
from api_server.mp3 import Mp3Stream, mp3_available
from api_server.off_loop import parse_body
from api_server.protocol import RequestError
from api_server.server_state import ServerState
from api_server.serving_context import error_response
from api_server.speech_text import MAX_INPUT_CHARS, text_to_segments
from pipelines import orpheus
from pipelines.audio_generation import AudioGenerationRequest
from pipelines.config import SamplingParamsDefaults
from pipelines.speech_context import TTSContext
from pipelines.status import PipelineTask

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg"}
_json = msgspec.json.Encoder()


class SpeechRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str
    voice: str | dict = ""
    # OpenAI's default is mp3, which needs an optional package: an omitted format means wav.
    response_format: str = "wav"
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    # Loom's, for a speech-token model: clone the voice of an example, its codec tokens (as
    # the model writes them) and what it says (AudioGenerationRequest's fields).
    audio_prompt_tokens: list[int] = []
    audio_prompt_transcription: str = ""


def wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16) +
            b"data" + struct.pack("<I", unknown))


class SpeechRoute:
    def __init__(self, engine: EngineClient, state: ServerState, metrics, tokenizer=None,
                 max_model_len: int = 0, sampling_defaults: SamplingParamsDefaults | None = None
                 ) -> None:
        self.engine = engine
        self.state = state
        self.metrics = metrics
        self.tokenizer = tokenizer  # a speech-token model's prompts (Orpheus)
        self.max_model_len = max_model_len
        # A speech-token model's sampling (resolved by the CLI: the flags, the model's
        # generation_config.json, Orpheus's recommended values); None: Orpheus's.
        self.sampling_defaults = sampling_defaults

    @property
    def writes_speech_tokens(self) -> bool:
        """The served text model writes speech tokens (Orpheus): it is the voice."""
        return self.engine.ready is not None \
            and self.engine.ready.speech_task is PipelineTask.SPEECH_TOKEN_GENERATION

    @property
    def voices(self) -> list[str]:
        """The voices the worker loaded (none until the engine is ready)."""
        return self.engine.ready.voices if self.engine.ready is not None else []

    @property
    def sample_rate(self) -> int:
        return self.engine.ready.sample_rate if self.engine.ready is not None else 0

    def model_cards(self, created: int) -> list[dict]:
        return [{"id": v, "object": "model", "created": created, "owned_by": "loom",
                 "root": v, "parent": None, "task": "speech",
                 "sample_rate": self.sample_rate} for v in self.voices]

    async def create(self, request: Request) -> Response:
        try:
            req = await parse_body(await request.body(), SpeechRequest)
            ctx = self._context(req)
            self.state.admit([ctx])
        except RequestError as exc:
            return error_response(exc)
        if req.stream_format == "sse":
            return StreamingResponse(self._sse(ctx, req.response_format),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return StreamingResponse(self._audio(ctx, req.response_format),
                                 media_type=MEDIA_TYPES[req.response_format],
                                 headers={"X-Sample-Rate": str(self.sample_rate)})

    def _context(self, req: SpeechRequest) -> TTSContext:
        if not self.voices:
            raise RequestError("this server has no voice (install the [tts] extra)",
                               param="model", status=404, code="model_not_found")
        if req.model not in self.voices:
            raise RequestError(f"the model `{req.model}` is not a voice of this server; "
                               f"voices: {', '.join(self.voices)}", param="model", status=404,
                               code="model_not_found")
        voice = req.voice.get("id", "") if isinstance(req.voice, dict) else req.voice
        if self.writes_speech_tokens:
            if voice not in ("", *orpheus.VOICES):
                raise RequestError(f"unknown voice {voice!r}; this model's voices: "
                                   f"{', '.join(orpheus.VOICES)}", param="voice")
        elif voice not in _voice_names(req.model):
            raise RequestError(f"unknown voice {voice!r}; this model speaks as {req.model!r}",
                               param="voice")
        if not req.input.strip():
            raise RequestError("input must not be empty", param="input")
        if len(req.input) > MAX_INPUT_CHARS:
            raise RequestError(f"input is {len(req.input)} characters; the limit is "
                               f"{MAX_INPUT_CHARS}", param="input")
        if req.response_format not in MEDIA_TYPES:
            raise RequestError(f"response_format {req.response_format!r} is not supported; use "
                               f"{', '.join(MEDIA_TYPES)}", param="response_format")
        if req.response_format == "mp3" and not mp3_available():
            raise RequestError("response_format mp3 needs the lameenc package on the server "
                               "(pip install lameenc, in the tts extra); use wav or pcm",
                               param="response_format")
        self.state.check_available()
        if self.writes_speech_tokens:
            return self._speech_token_context(req, voice or orpheus.VOICES[0])
        if req.audio_prompt_tokens:
            raise RequestError(f"{req.model} cannot clone a voice", param="audio_prompt_tokens")
        try:
            segments = text_to_segments(req.input)
        except ValueError as exc:
            raise RequestError(str(exc), param="input") from None
        request = AudioGenerationRequest(model=req.model, input=req.input)
        return TTSContext.from_phoneme_segments(
            [np.asarray(s.phoneme_ids, dtype=np.int64) for s in segments],
            request_id=request.id, model_name=request.model, voice=req.model, speed=req.speed)

    def _speech_token_context(self, req: SpeechRequest, voice: str) -> TTSContext:
        """Orpheus's prompt for the text, sampled with the model's recommended settings."""
        if req.speed != 1.0:
            raise RequestError("speed is not supported by this model: use 1.0", param="speed")
        request = AudioGenerationRequest(
            model=req.model, input=req.input, audio_prompt_tokens=req.audio_prompt_tokens,
            audio_prompt_transcription=req.audio_prompt_transcription)
        tokenizer = self.tokenizer.delegate
        try:
            ids = orpheus.prompt_tokens(
                request, lambda text: tokenizer.encode(text, add_special_tokens=True), voice)
        except ValueError as exc:
            raise RequestError(str(exc), param="audio_prompt_tokens") from None
        params = orpheus.recommended_sampling(**self._sampling())
        max_length = min(len(ids) + params.max_new_tokens, self.max_model_len or 1 << 30)
        if len(ids) >= max_length:
            raise RequestError("input is too long for this model's context", param="input",
                               code="context_length_exceeded")
        return TTSContext(tokens=np.asarray(ids, dtype=np.int64), max_length=max_length,
                          sampling_params=params, eos_token_ids={orpheus.END_OF_SPEECH},
                          request_id=request.id, model_name=req.model, voice=voice,
                          streaming=True)

    def _sampling(self) -> dict:
        d = self.sampling_defaults
        if d is None:
            return {}
        return dict(temperature=d.temperature, top_p=d.top_p, top_k=max(d.top_k, 0),
                    min_p=d.min_p, repetition_penalty=d.repetition_penalty,
                    frequency_penalty=d.frequency_penalty, presence_penalty=d.presence_penalty)

    async def _chunks(self, ctx: TTSContext):
        """PCM bytes per segment, with metrics; raises if synthesis fails mid-way."""
        started = time.monotonic()
        samples, synthesis = 0, 0.0
        async for chunk in self.engine.speak(ctx):
            if chunk.index == 0:
                self.metrics.time_to_first_audio.observe(time.monotonic() - started)
            samples += len(chunk.audio)
            synthesis += chunk.synthesis_seconds
            yield chunk.audio.astype("<i2").tobytes()
        seconds = samples / self.sample_rate
        self.metrics.audio_seconds.inc(seconds)
        if seconds:
            self.metrics.audio_real_time_factor.observe(synthesis / seconds)

    async def _encoded(self, ctx: TTSContext, response_format: str):
        """(bytes in the response's format, samples they hold) per chunk; mp3: each chunk's
        frames as LAME completes them, the rest at the end."""
        mp3 = Mp3Stream(self.sample_rate) if response_format == "mp3" else None
        async for pcm in self._chunks(ctx):
            yield (mp3.encode(pcm) if mp3 else pcm), len(pcm) // 2
        if mp3:
            yield mp3.finish(), 0

    async def _audio(self, ctx: TTSContext, response_format: str):
        if response_format == "wav":
            yield wav_header(self.sample_rate)
        async for data, _ in self._encoded(ctx, response_format):
            if data:
                yield data
        # An error raises out of here: the chunked body ends without its terminator, which
        # the client sees as a failed download rather than a short, silent file.

    async def _sse(self, ctx: TTSContext, response_format: str):
        """Deltas of PCM (wav and pcm: a stream of events has no file header) or of MP3."""
        samples = 0
        try:
            async for data, count in self._encoded(ctx, response_format):
                samples += count
                if not data:
                    continue
                yield b"data: " + _json.encode({"type": "speech.audio.delta",
                                                "audio": base64.b64encode(data).decode()}) + b"\n\n"
        except (EngineDeadError, GenerationFailed) as exc:
            yield b"data: " + _json.encode({"type": "error", "error": {
                "message": str(exc), "type": "server_error", "param": None,
                "code": None}}) + b"\n\n"
            return
        phonemes = ctx.prompt_length
        usage = {"input_tokens": phonemes, "output_tokens": samples,
                 "total_tokens": phonemes + samples}
        yield b"data: " + _json.encode({"type": "speech.audio.done", "usage": usage}) + b"\n\n"


def _voice_names(model: str) -> set[str]:
    """What a client may send as `voice` for this model: its id, the id without the engine
    prefix, the speaker's name ("joe" for piper-en_US-joe-medium), or nothing."""
    names = {"", "default", model, model.removeprefix("piper-")}
    parts = model.split("-")
    if len(parts) >= 3:
        names.add(parts[-2])
    return names
