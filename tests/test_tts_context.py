"""TTSContext as max.pipelines.core documents it: a TextContext whose speech tokens an
AudioGenerator decodes chunk by chunk, each chunk re-decoding `buffer` earlier tokens."""

import numpy as np
import pytest

import pipelines
from pipelines import GenerationStatus, TextContext, TTSContext
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import AudioStep, RequestMessage, StepMessage


def tts(**fields) -> TTSContext:
    return TTSContext(tokens=np.arange(5), max_length=64, **fields)


def test_tts_context_is_a_text_context_with_the_documented_members():
    ctx = tts()
    assert isinstance(ctx, TextContext)
    for name in ("audio_prompt_tokens", "buffer_speech_tokens", "audio_buffer",
                 "prev_samples_beyond_offset", "streaming", "decoded_index", "block_counter",
                 "is_done", "speech_tokens", "audio_generation_status",
                 "update_speech_tokens", "next_speech_tokens"):
        assert hasattr(ctx, name), name
    assert ctx.speech_tokens.size == 0 and ctx.decoded_index == 0 and not ctx.streaming
    assert ctx.audio_generation_status is GenerationStatus.ACTIVE and not ctx.is_done
    ctx.update_audio_generation_status(GenerationStatus.END_OF_SEQUENCE)
    assert not ctx.is_done  # is_done is the language model's, as for any TextContext
    for name in ("AudioGenerationRequest", "AudioGenerationResponse", "AudioGenerator",
                 "AudioGeneratorOutput", "TTSContext"):
        assert name in pipelines.__all__


def test_speech_tokens_grow_past_the_initial_buffer():
    ctx = tts()
    blocks = [np.arange(i * 100, i * 100 + 100) for i in range(3)]  # 300 > 128
    for block in blocks:
        ctx.update_speech_tokens(block)
    assert ctx.speech_tokens.tolist() == np.concatenate(blocks).tolist()
    assert ctx.block_counter == 3


def test_next_speech_tokens_chunks_with_the_overlap_buffer():
    ctx = tts()
    ctx.update_speech_tokens(np.arange(10, 30))  # 20 tokens
    chunk, buffered = ctx.next_speech_tokens(audio_chunk_size=7, buffer=3)
    assert chunk.tolist() == list(range(10, 17)) and buffered == 0  # nothing before the first
    assert ctx.decoded_index == 0  # the caller moves it, once the audio is out
    ctx.decoded_index = 7
    chunk, buffered = ctx.next_speech_tokens(audio_chunk_size=7, buffer=3)
    assert buffered == 3 and chunk.tolist() == list(range(14, 24))  # 3 again, then 7 new
    ctx.decoded_index = 14
    chunk, buffered = ctx.next_speech_tokens(audio_chunk_size=7, buffer=100)
    assert buffered == 14 and chunk.tolist() == list(range(10, 30))  # buffer stops at 0
    ctx.decoded_index = 20
    chunk, buffered = ctx.next_speech_tokens(audio_chunk_size=7, buffer=3)
    assert buffered == 3 and chunk.tolist() == [27, 28, 29]  # no new tokens: only the buffer
    assert not ctx.has_undecoded_speech_tokens()
    ctx.decoded_index = 18
    assert ctx.next_speech_tokens()[0].tolist() == [28, 29]  # no size: all that is left


def test_a_tts_context_travels_as_itself_through_the_codec():
    ctx = tts(audio_prompt_tokens=np.array([7, 8, 9]), streaming=True, voice="tara")
    ctx.update_speech_tokens(np.arange(200))
    ctx.decoded_index = 21
    wire = msgpack_numpy_encoder()(ctx)
    back = msgpack_numpy_decoder(RequestMessage)(wire)
    assert type(back) is TTSContext
    assert back.speech_tokens.tolist() == list(range(200)) and back.decoded_index == 21
    assert back.audio_prompt_tokens.tolist() == [7, 8, 9] and back.voice == "tara"
    assert back.prompt_tokens.tolist() == list(range(5)) and back.streaming
    step = msgpack_numpy_decoder(StepMessage)(msgpack_numpy_encoder()(
        AudioStep(step_id=3, contexts=[ctx], num_tokens=28)))
    assert step.contexts[0].next_speech_tokens(28, 7)[0].tolist() == list(range(14, 49))


def test_piper_context_speaks_one_sentence_per_chunk():
    ctx = TTSContext.from_phoneme_segments([np.arange(3), np.arange(5)], request_id="s")
    assert ctx.prompt_length == 8 and ctx.is_done  # no language model to run
    assert not ctx.audio_generation_status.is_done
    assert ctx.next_segment_length() == 3
    ctx.decoded_index = 3
    assert ctx.next_segment_length() == 5
    ctx.decoded_index = 8
    assert ctx.next_segment_length() == 0 and not ctx.has_undecoded_speech_tokens()


def test_piper_context_needs_a_phoneme():
    with pytest.raises(ValueError):
        TTSContext.from_phoneme_segments([])


class FakeLM:
    def __init__(self):
        self.added, self.aborted = [], set()

    def add(self, ctx):
        self.added.append(ctx.request_id)

    def abort(self, request_ids):
        self.aborted |= request_ids


def test_speech_queue_decodes_what_the_language_model_writes_in_batched_chunks():
    from pipelines import orpheus
    from scheduler.speech_queue import SpeechQueue
    from serialization.messages import AudioResult

    lm = FakeLM()
    queue = SpeechQueue(lm)
    a, b = (TTSContext(tokens=np.arange(6), max_length=1000, request_id=r) for r in "ab")
    queue.add(a)
    queue.add(b)
    assert lm.added == ["a", "b"] and not queue.has_work
    frames = [orpheus.AUDIO_TOKEN_OFFSET + 4096 * (i % 7) + i for i in range(7 * 9)]
    for token in frames[:55]:  # 55 >= a chunk (28) and the frames held back (28)
        a.update(token)
    b.update(orpheus.START_OF_SPEECH)  # not a speech token
    for token in frames[:56]:
        b.update(token)
    step, sent = queue.next_step()
    assert [c.request_id for c in step.contexts] == ["b"] and step.num_tokens == 28
    assert b.speech_tokens.tolist() == frames[:56]
    queue.after_step(sent, AudioResult(step_id=step.step_id, audio=[np.ones(4, np.int16)],
                                       decoded_index=[28]))
    a.update(frames[55])
    for token in frames[56:]:
        b.update(token)
    b.update(orpheus.END_OF_SPEECH)
    b.status = GenerationStatus.END_OF_SEQUENCE  # (the text scheduler's stop)
    step, sent = queue.next_step()
    assert [c.request_id for c in step.contexts] == ["a", "b"]  # one step, both chunks
    batch = queue.after_step(sent, AudioResult(step_id=step.step_id,
                                               audio=[np.ones(4, np.int16)] * 2,
                                               decoded_index=[28, 63]))
    assert [(c.request_id, c.index, c.is_last) for c in batch.audio] == [
        ("a", 0, False), ("b", 1, True)]
    assert queue.owns("a") and not queue.owns("b") and len(queue) == 1
    queue.abort({"a"})
    assert not queue.has_work and not queue.owns("a")


def test_decoder_steps_batch_as_many_chunks_as_fit_in_one_chunks_time():
    """A CPU's batch costs its size: the limit stays at one (one probe of two); a GPU's costs
    about one chunk: it grows to the maximum."""
    from scheduler.chunk_batch_limit import RETRY_STEPS, ChunkBatchLimit

    cpu = ChunkBatchLimit(16)
    cpu.record(1, 2.0)
    assert cpu.limit == 2
    cpu.record(2, 4.1)
    assert cpu.limit == 1
    for _ in range(RETRY_STEPS - 2):
        cpu.record(1, 2.0)
        assert cpu.limit == 1  # not probed again while the machine's load may be the same
    gpu = ChunkBatchLimit(16)
    gpu.record(1, 0.010)
    for size in (2, 4, 8, 16, 16):
        assert gpu.limit == size
        gpu.record(size, 0.012)
    assert gpu.limit == 16
