"""msgpack round trips of every message type, numpy arrays included."""

import msgpack
import msgpack_numpy
import numpy as np
import pytest

from pipelines import (
    GenerationStatus,
    LogProbabilities,
    SamplingParams,
    TextContext,
    TextGenerationOutput,
)
from processes.sockets import decode_or_drop
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import (
    CancelRequest,
    NewRequest,
    RequestMessage,
    ResponseBatch,
    ResponseMessage,
    ResultMessage,
    SchedulerFailed,
    SchedulerReady,
    SchedulerStats,
    SequenceFailure,
    Shutdown,
    StepBatch,
    StepMessage,
    StepResult,
    WorkerFailed,
    WorkerReady,
)

encode = msgpack_numpy_encoder()


def roundtrip(msg, type_, copy=True):
    return msgpack_numpy_decoder(type_, copy=copy)(encode(msg))


def assert_struct_equal(a, b):
    assert type(a) is type(b)
    for field in a.__struct_fields__:
        x, y = getattr(a, field), getattr(b, field)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), field
        elif hasattr(x, "__struct_fields__"):
            assert_struct_equal(x, y)
        else:
            assert x == y, field


def step_batch():
    return StepBatch(
        step_id=7, request_ids=["a", "b"], input_ids=np.array([5, 6, 7, 8], np.int32),
        query_lens=np.array([3, 1], np.int32), seq_lens=np.array([3, 9], np.int32),
        block_tables=np.array([[0, -1], [1, 2]], np.int32), sample=np.array([True, False]),
        new_requests=[NewRequest("a", SamplingParams(top_k=5, temperature=0.7, seed=3))],
        finished_request_ids=["z"],
    )


@pytest.mark.parametrize("msg,type_", [
    (step_batch(), StepMessage),
    (Shutdown(), StepMessage),
    (StepResult(step_id=7, sampled_token_ids=np.array([11, -1], np.int32), started_at=1.0,
                finished_at=2.0), ResultMessage),
    (StepResult(step_id=8, sampled_token_ids=np.zeros(0, np.int32), error="boom"), ResultMessage),
    (StepResult(step_id=9, sampled_token_ids=np.array([11, -1], np.int32),
                failed=[SequenceFailure(1, "RuntimeError: boom")]), ResultMessage),
    (WorkerReady(num_blocks=10, block_size=16, max_model_len=128, eos_token_ids=[2]), ResultMessage),
    (WorkerFailed(message="no"), ResultMessage),
    (CancelRequest(request_ids=["x", "y"]), CancelRequest),
    (ResponseBatch(outputs=[TextGenerationOutput("r", [1, 2], GenerationStatus.MAXIMUM_LENGTH,
                                                 [LogProbabilities([-0.5], [{1: -0.5}])])],
                   stats=SchedulerStats(num_running=2, kv_cache_usage=0.25)), ResponseMessage),
    (SchedulerReady(num_blocks=10, block_size=16, max_model_len=128), ResponseMessage),
    (SchedulerFailed(message="bad"), ResponseMessage),
])
def test_message_roundtrip(msg, type_):
    assert_struct_equal(roundtrip(msg, type_), msg)
    assert_struct_equal(roundtrip(msg, type_, copy=False), msg)


def test_text_context_roundtrip_keeps_indices_and_arrays():
    ctx = TextContext(max_length=50, tokens=np.arange(1, 8), eos_token_ids={2, 3},
                      sampling_params=SamplingParams(temperature=0.5, top_p=0.9, stop=["x"]))
    ctx.update(42)
    back = roundtrip(ctx, RequestMessage)
    assert isinstance(back, TextContext)
    assert back.request_id == ctx.request_id
    assert (back.start_idx, back.active_idx, back.end_idx) == (ctx.start_idx, ctx.active_idx, ctx.end_idx)
    assert back.all_tokens.tolist() == ctx.all_tokens.tolist()
    assert back.eos_token_ids == {2, 3} and back.sampling_params == ctx.sampling_params
    back.update(43)  # decoded arrays are writable
    assert back.generated_tokens.tolist() == [42, 43]


def test_arrays_readable_by_msgpack_numpy():
    """Our array encoding is msgpack-numpy's, so any msgpack peer can read the wire."""
    raw = msgpack.unpackb(encode(step_batch()), object_hook=msgpack_numpy.decode)
    assert raw["input_ids"].tolist() == [5, 6, 7, 8]
    assert raw["block_tables"].dtype == np.int32 and raw["block_tables"].shape == (2, 2)
    # ...and we read what msgpack-numpy writes.
    packed = msgpack.packb({"type": "CancelRequest", "request_ids": ["q"]})
    assert msgpack_numpy_decoder(CancelRequest)(packed).request_ids == ["q"]
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    blob = msgpack.packb({"type": "StepResult", "step_id": 1, "sampled_token_ids": arr},
                         default=msgpack_numpy.encode)
    assert np.array_equal(msgpack_numpy_decoder(ResultMessage)(blob).sampled_token_ids, arr)


def test_object_arrays_are_refused():
    with pytest.raises(TypeError):
        encode(StepResult(step_id=1, sampled_token_ids=np.array([object()])))


@pytest.mark.parametrize("frame", [b"", b"\xff\x00garbage", encode({"type": "Nope"}),
                                   encode({"type": "StepResult", "step_id": "x"}),
                                   msgpack.packb({"type": "StepResult", "step_id": 1,
                                                  "sampled_token_ids": {b"nd": True, b"type": "|O",
                                                                        b"shape": [1], b"data": b"x"}})])
def test_garbage_frames_are_dropped_not_raised(frame):
    assert decode_or_drop(msgpack_numpy_decoder(ResultMessage), frame, "test") is None
