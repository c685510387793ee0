"""SnacDecoder: the AudioGenerator of an Orpheus-style model, SNAC decoding its speech tokens.

Orpheus (a Llama) writes audio as frames of 7 tokens, each frame one code of SNAC's coarsest
codebook, two of the middle one and four of the finest, interleaved as canopylabs' reference
decoder (orpheus_tts/decoder.py) reads them:

    position in frame:  0    1    2    3    4    5    6
    codebook:           c0   c1   c2   c2   c1   c2   c2

and token id = ORPHEUS_AUDIO_TOKEN_OFFSET + 4096 * position + code. A frame is
`hop_length * max(vq_strides)` samples (2048 at 24 kHz: 85 ms).

Chunks are seamless: SNAC's decoder is convolutional, so a frame's audio depends on its
neighbours. Each chunk decodes `buffer_frames` already-spoken frames before its new ones (the
documented `next_speech_tokens(size, buffer)`), and, while the language model may still add
frames, holds back its last `lookahead_frames` (decoded again by the next chunk, as its
buffer). With both at least the decoder's reach, every emitted sample is the one decoding
the whole sequence at once gives (tests/test_snac_decoder.py checks this against
`SNAC.decode`). The reference decoder instead re-decodes 4-frame windows and keeps the second
frame, which is approximate at every border.

Requests are batched: their windows are decoded together, one SNAC call per distinct window
length (in steady state all are the same). SNAC's noise blocks (`noise: true` in
snac_24khz) add fresh random noise at every call; chunks then differ from one whole decode
by that noise, as two whole decodes do.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from pipelines import orpheus
from pipelines.audio_generation import AudioGenerationResponse
from pipelines.speech_context import TTSContext
from pipelines.status import GenerationStatus, PipelineTask

TOKENS_PER_FRAME = orpheus.TOKENS_PER_FRAME
ORPHEUS_AUDIO_TOKEN_OFFSET = orpheus.AUDIO_TOKEN_OFFSET  # <custom_token_10>: 128256 + 10
CODEBOOK_SIZE = 4096
# Which codebook each of a frame's 7 tokens belongs to, in order within that codebook.
_FRAME_LAYOUT = ((0, (0,)), (1, (1, 4)), (2, (2, 3, 5, 6)))


def tokens_to_codes(tokens: np.ndarray, token_offset: int) -> list[np.ndarray]:
    """[batch, 7*F] token ids of whole frames -> SNAC's codes [batch, F], [batch, 2F],
    [batch, 4F]."""
    frames = tokens.reshape(tokens.shape[0], -1, TOKENS_PER_FRAME)
    codes = frames - token_offset - CODEBOOK_SIZE * np.arange(TOKENS_PER_FRAME)
    if codes.size and (codes.min() < 0 or codes.max() >= CODEBOOK_SIZE):
        raise ValueError("a speech token is not an audio code of its position in the frame")
    return [codes[:, :, list(positions)].reshape(codes.shape[0], -1)
            for _, positions in _FRAME_LAYOUT]


def codes_to_tokens(codes: list[np.ndarray], token_offset: int) -> np.ndarray:
    """The inverse of tokens_to_codes (tests and tools write speech tokens from codes)."""
    batch, num_frames = codes[0].shape
    frames = np.zeros((batch, num_frames, TOKENS_PER_FRAME), dtype=np.int64)
    for level, positions in _FRAME_LAYOUT:
        frames[:, :, list(positions)] = codes[level].reshape(batch, num_frames, len(positions))
    frames += token_offset + CODEBOOK_SIZE * np.arange(TOKENS_PER_FRAME)
    return frames.reshape(batch, -1)


class SnacDecoder:
    speech_task = PipelineTask.SPEECH_TOKEN_GENERATION  # the text model writes its tokens

    def __init__(self, model, *, token_offset: int = ORPHEUS_AUDIO_TOKEN_OFFSET,
                 buffer_frames: int = 4,
                 lookahead_frames: int = orpheus.LOOKAHEAD_TOKENS // TOKENS_PER_FRAME,
                 device: str | torch.device = "cpu") -> None:
        if list(model.vq_strides) != [4, 2, 1]:
            raise ValueError(f"Orpheus's frames need SNAC's three codebooks of strides 4, 2, 1; "
                             f"this model has {list(model.vq_strides)}")
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.token_offset = token_offset
        self.buffer_frames = buffer_frames
        self.lookahead_frames = lookahead_frames
        self.samples_per_frame = int(model.hop_length) * max(model.vq_strides)

    @classmethod
    def from_pretrained(cls, directory: str, **kwargs) -> SnacDecoder:
        """A SNAC directory (config.json, pytorch_model.bin) on disk: nothing is downloaded."""
        from snac import SNAC

        return cls(SNAC.from_pretrained(directory), **kwargs)

    @classmethod
    def for_checkpoint(cls, model_path: str, voice_id: str, **kwargs) -> SnacDecoder:
        """The decoder of an Orpheus checkpoint (its `snac/`: orpheus.snac_directory), served
        as the voice `voice_id` (the served model's name), on the language model's device
        (float32)."""
        directory = orpheus.snac_directory(model_path)
        if directory is None:
            raise ValueError(f"{model_path} is not an Orpheus checkpoint with its snac/ decoder")
        decoder = cls.from_pretrained(directory, **kwargs)
        decoder.voice_id, decoder.sample_rate = voice_id, decoder.decoder_sample_rate
        return decoder

    @property
    def decoder_sample_rate(self) -> int:
        return int(self.model.sampling_rate)

    def release(self, context: TTSContext) -> None:
        """Nothing to free: a request's decoder state is its context's speech tokens."""

    def next_chunk(
        self, batch: dict[str, TTSContext], num_tokens: int
    ) -> dict[str, AudioGenerationResponse]:
        """Each context's next chunk: up to `num_tokens` new speech tokens (whole frames; the
        last chunk of a finished request takes its held-back frames too), decoded with the
        overlap buffer; moves its `decoded_index` past the audio returned."""
        plans = {rid: self._plan(ctx, num_tokens) for rid, ctx in batch.items()}
        by_length: dict[int, list[str]] = defaultdict(list)
        for rid, (window, _, _) in plans.items():
            if len(window):
                by_length[len(window)].append(rid)
        audio: dict[str, np.ndarray] = {}
        for rids in by_length.values():
            decoded = self._decode(np.stack([plans[rid][0] for rid in rids]))
            for row, rid in zip(decoded, rids):
                _, skip, keep = plans[rid]
                audio[rid] = row[skip * self.samples_per_frame:keep * self.samples_per_frame]
        responses = {}
        for rid, ctx in batch.items():
            window, skip, keep = plans[rid]
            ctx.decoded_index += (keep - skip) * TOKENS_PER_FRAME
            done = ctx.status.is_done and not ctx.has_undecoded_speech_tokens(
                exclude_last_n=len(ctx.speech_tokens) % TOKENS_PER_FRAME)
            if done:
                ctx.update_audio_generation_status(ctx.status)
            responses[rid] = AudioGenerationResponse(
                ctx.status if done else GenerationStatus.ACTIVE,
                audio.get(rid, np.zeros(0, np.float32)))
        return responses

    def _plan(self, ctx: TTSContext, num_tokens: int) -> tuple[np.ndarray, int, int]:
        """The context's window of whole frames, the buffered frames that open it (their
        audio is dropped) and the frame its returned audio ends at."""
        if ctx.decoded_index % TOKENS_PER_FRAME:
            raise ValueError("decoded_index must sit on a frame border")
        new_frames = max(1, num_tokens // TOKENS_PER_FRAME)
        window, buffered = ctx.next_speech_tokens(
            (new_frames + self.lookahead_frames) * TOKENS_PER_FRAME,
            self.buffer_frames * TOKENS_PER_FRAME)
        frames = len(window) // TOKENS_PER_FRAME
        skip = buffered // TOKENS_PER_FRAME
        at_end = ctx.decoded_index + (frames - skip) * TOKENS_PER_FRAME \
            + TOKENS_PER_FRAME > len(ctx.speech_tokens)
        if ctx.status.is_done and at_end:
            keep = frames  # nothing follows: the last frames need no right context
        else:
            keep = min(frames - self.lookahead_frames, skip + new_frames)
        if keep <= skip:
            return window[:0], 0, 0
        return window[:frames * TOKENS_PER_FRAME], skip, keep

    @torch.inference_mode()
    def _decode(self, tokens: np.ndarray) -> np.ndarray:
        codes = [torch.from_numpy(c).to(self.device) for c in
                 tokens_to_codes(tokens, self.token_offset)]
        return self.model.decode(codes)[:, 0].float().cpu().numpy()
