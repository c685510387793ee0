"""Hostile frames on the wire: every malformed frame is dropped and counted (never raised past
`decode_or_drop`), the log is not flooded, oversized frames are cut off by ZeroMQ, bounded
queues block or refuse rather than drop, and a valid message afterwards still gets through."""

import logging
import os

import msgpack
import numpy as np
import pytest
import zmq

from pipelines.context import TextContext
from processes import sockets
from processes.sockets import Endpoints, decode_or_drop, make_socket
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import (
    CancelRequest,
    RequestMessage,
    ResponseBatch,
    ResponseMessage,
    ResultMessage,
    StepResult,
    WorkerReady,
)

encode = msgpack_numpy_encoder()
decode_result = msgpack_numpy_decoder(ResultMessage)
VALID = encode(StepResult(step_id=3, sampled_token_ids=np.array([4, -1], np.int32)))


@pytest.fixture(autouse=True)
def fresh_counts():
    sockets.dropped_frames.clear()
    sockets._last_logged.clear()
    sockets._unlogged.clear()
    yield


def result_frame(array_field) -> bytes:
    """A StepResult whose array field is `array_field`, written by a plain msgpack peer."""
    return msgpack.packb({"type": "StepResult", "step_id": 1, "sampled_token_ids": array_field})


def array_map(**fields) -> dict:
    base = {b"nd": True, b"type": "<i4", b"kind": b"", b"shape": [2], b"data": b"\0" * 8}
    for key, value in fields.items():
        if value is None:
            del base[key.encode()]
        else:
            base[key.encode()] = value
    return base


def nested(depth: int) -> list:
    value = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


HOSTILE_ARRAYS = {
    "map without type": array_map(type=None),
    "map without shape": array_map(shape=None),
    "map without data": array_map(data=None),
    "object dtype": array_map(type="|O8"),
    "record dtype": array_map(type="V8"),
    "string dtype": array_map(type="<U2"),
    "datetime dtype": array_map(type="<M8[s]", data=b"\0" * 16),
    "type not a string": array_map(type=5),
    "unparsable type": array_map(type="not a dtype"),
    "type numpy parses as Python": array_map(type="i4,("),
    "comma record type": array_map(type="i4,i4", shape=[1]),
    "shape not a list": array_map(shape=2),
    "negative dims": array_map(shape=[-1, -2]),
    "bool dim": array_map(shape=[True, 2], data=b"\0" * 8),
    "string dim": array_map(shape=["2"]),
    "int64-wrapping shape": array_map(shape=[2 ** 32, 2 ** 32], data=b""),
    "too many dims": array_map(shape=[1] * 40, data=b"\0" * 4),
    "data not binary": array_map(data="xxxxxxxx"),
    "data shorter than shape": array_map(data=b"\0" * 4),
    "list with None": [1, None],
    "list with a string": [1, "a"],
    "list of maps": [{}],
    "ragged list": [[1, 2], [3]],
    "list nested 40 deep": nested(40),
    "list nested 100 deep": nested(100),
    "int instead of array": 5,
    "string instead of array": "abc",
}


@pytest.mark.parametrize("field", HOSTILE_ARRAYS.values(), ids=HOSTILE_ARRAYS.keys())
def test_hostile_array_is_dropped_and_counted(field):
    frame = result_frame(field)
    assert decode_or_drop(decode_result, frame, "results") is None
    assert sockets.dropped_frames["results"] == 1
    assert sockets.malformed_frame_counts() == {"results": 1}
    # The decoder is not left in a bad state: the next valid frame decodes.
    assert decode_or_drop(decode_result, VALID, "results").step_id == 3
    assert sockets.dropped_frames["results"] == 1


def test_numeric_lists_and_foreign_byte_order_still_decode():
    ints = decode_result(result_frame([1, 2, 3])).sampled_token_ids
    assert ints.dtype.kind == "i" and ints.tolist() == [1, 2, 3]
    assert decode_result(result_frame([True, False])).sampled_token_ids.dtype == np.bool_
    big = np.array([1, 70000], dtype=">i4")
    back = decode_result(result_frame(array_map(type=">i4", data=big.tobytes())))
    assert back.sampled_token_ids.dtype.isnative and back.sampled_token_ids.tolist() == [1, 70000]


def test_strings_and_objects_are_not_encoded_either():
    for bad in (np.array(["a"]), np.array([object()])):
        with pytest.raises(TypeError):
            encode(StepResult(step_id=1, sampled_token_ids=bad))


def test_random_bytes_are_dropped_not_raised():
    rng = np.random.default_rng(0)
    frames = [rng.bytes(int(n)) for n in rng.integers(0, 300, 500)]
    # Random frames that start like a message: a map with a type tag, then garbage.
    prefix = msgpack.packb({"type": "StepResult"})[:-1]
    frames += [prefix + rng.bytes(int(n)) for n in rng.integers(1, 100, 500)]
    decoded = [decode_or_drop(decode_result, f, "results") for f in frames]
    assert sockets.dropped_frames["results"] == sum(d is None for d in decoded) > 900
    assert decode_or_drop(decode_result, VALID, "results").step_id == 3


def test_a_flood_of_bad_frames_logs_a_line_per_interval(caplog, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(sockets.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="processes.sockets"):
        for _ in range(1000):
            decode_or_drop(decode_result, b"\xc1", "requests")
        assert len(caplog.records) == 1
        now[0] += sockets.LOG_INTERVAL_SECONDS + 1
        decode_or_drop(decode_result, b"\xc1", "requests")
    assert len(caplog.records) == 2
    assert "999 more since the last report" in caplog.records[1].getMessage()
    assert sockets.dropped_frames["requests"] == 1001


def pair(tmp_path, max_message_bytes=sockets.DEFAULT_MAX_MESSAGE_BYTES,
         high_water_mark=sockets.HIGH_WATER_MARK):
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/channel"
    pull = make_socket(ctx, zmq.PULL, address, bind=True, max_message_bytes=max_message_bytes,
                       high_water_mark=high_water_mark)
    push = make_socket(ctx, zmq.PUSH, address, bind=False, high_water_mark=high_water_mark)
    return ctx, pull, push


def test_sockets_are_bounded(tmp_path):
    ctx, pull, push = pair(tmp_path, max_message_bytes=12345)
    try:
        assert pull.getsockopt(zmq.MAXMSGSIZE) == 12345
        for sock in (pull, push):
            assert sock.getsockopt(zmq.RCVHWM) == sockets.HIGH_WATER_MARK > 0
            assert sock.getsockopt(zmq.SNDHWM) == sockets.HIGH_WATER_MARK
    finally:
        ctx.destroy(linger=0)


def test_oversized_frame_is_cut_off_and_the_channel_recovers(tmp_path):
    ctx, pull, push = pair(tmp_path, max_message_bytes=4096)
    try:
        push.send(VALID)
        assert pull.poll(5000) and decode_result(pull.recv()).step_id == 3
        push.send(b"x" * 100_000)  # ZeroMQ disconnects the sender instead of buffering this
        assert pull.poll(500) == 0
        push.send(VALID)  # the PUSH reconnects by itself; this one arrives
        assert pull.poll(5000)
        assert decode_result(pull.recv()).step_id == 3
        assert pull.poll(200) == 0  # and the oversized frame never does
    finally:
        ctx.destroy(linger=0)


def test_a_burst_of_cancellations_is_neither_refused_nor_lost(tmp_path):
    """engine_client sends cancellations with NOBLOCK: the bounded queue must take a burst far
    larger than the open requests while nobody reads."""
    ctx, pull, push = pair(tmp_path)
    try:
        frames = [encode(CancelRequest(request_ids=[f"req-{i}"])) for i in range(20_000)]
        for frame in frames:
            push.send(frame, zmq.NOBLOCK)
        decode = msgpack_numpy_decoder(CancelRequest)
        got = []
        while len(got) < len(frames) and pull.poll(5000):
            got.append(decode(pull.recv()).request_ids[0])
        assert got == [f"req-{i}" for i in range(len(frames))]
    finally:
        ctx.destroy(linger=0)


def test_a_full_queue_refuses_a_send_and_drops_nothing(tmp_path):
    """What the bound does when a reader is gone: NOBLOCK sends raise zmq.Again (a blocking
    send would wait); every message accepted before arrives, in order."""
    ctx, pull, push = pair(tmp_path, high_water_mark=10)
    try:
        assert push.poll(5000, zmq.POLLOUT)  # connected
        sent = 0
        with pytest.raises(zmq.Again):
            while sent < 1_000_000:
                push.send(sent.to_bytes(4, "little") + b"\0" * 1020, zmq.NOBLOCK)
                sent += 1
        assert 10 <= sent < 1_000_000
        received = []
        while pull.poll(1000):
            received.append(int.from_bytes(pull.recv()[:4], "little"))
        assert received == list(range(sent))
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def scheduler_loop(tmp_path, monkeypatch):
    """A real SchedulerLoop on ipc sockets, and the API's three sockets connected to it."""
    from pipelines.config import PipelineConfig
    from scheduler.process import SchedulerLoop

    monkeypatch.setitem(sockets.MAX_MESSAGE_BYTES, "cancel", 64 << 10)
    endpoints = Endpoints.ipc(str(tmp_path))
    loop = SchedulerLoop(PipelineConfig().replace(max_length=256), endpoints)
    api = zmq.Context()
    requests = make_socket(api, zmq.PUSH, endpoints.requests, bind=False)
    cancel = make_socket(api, zmq.PUSH, endpoints.cancel, bind=False)
    responses = make_socket(api, zmq.PULL, endpoints.responses, bind=False)
    loop.start(WorkerReady(num_blocks=64, block_size=16, max_model_len=256, eos_token_ids=[2]))
    decode = msgpack_numpy_decoder(ResponseMessage)
    assert responses.poll(5000)
    decode(responses.recv())  # SchedulerReady
    yield loop, requests, cancel, responses, decode
    api.destroy(linger=0)
    loop.close()


def drain_until(loop, done) -> None:
    """Run the scheduler's input drain as frames arrive, until `done()` (or 5 s)."""
    for _ in range(100):
        loop._drain_inputs()
        if done():
            return
        loop.poller.poll(50)


def test_scheduler_drops_counts_and_reports_bad_frames_then_serves(scheduler_loop):
    loop, requests, cancel, responses, decode = scheduler_loop
    bad_requests = [b"", os.urandom(64), msgpack.packb({"max_length": 5}),
                    msgpack.packb({"type": "TextContext", "max_length": 5,
                                   "tokens": array_map(type=None)}),
                    msgpack.packb({"type": "TextContext", "max_length": 5, "tokens": [1, None]})]
    for frame in bad_requests:
        requests.send(frame)
    cancel.send(msgpack.packb({"request_ids": "not a list"}))
    drain_until(loop, lambda: sum(sockets.dropped_frames.values()) == 6)
    assert sockets.malformed_frame_counts() == {"requests": 5, "cancel": 1}

    # An oversized cancellation is cut off by ZeroMQ before it is buffered (so never decoded
    # nor counted here); once the API's socket has reconnected the channel works again.
    from zmq.utils.monitor import recv_monitor_message

    monitor = cancel.get_monitor_socket(zmq.EVENT_CONNECTED)
    cancel.send(b"x" * (128 << 10))
    # Wait for the reconnection (frames behind it on the cut connection would be lost).
    assert monitor.poll(5000), "the API's cancel socket did not reconnect"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
    cancel.disable_monitor()
    requests.send(encode(TextContext(request_id="good", max_length=20,
                                     tokens=np.arange(1, 6), eos_token_ids={2})))
    drain_until(loop, lambda: len(loop.arbiter.text.scheduler.waiting) == 1)
    assert [c.request_id for c in loop.arbiter.text.scheduler.waiting] == ["good"]
    cancel.send(encode(CancelRequest(request_ids=["good"])))
    drain_until(loop, lambda: not loop.arbiter.text.scheduler.waiting)
    assert not loop.arbiter.text.scheduler.waiting  # the valid cancellation after it was applied

    loop._send(ResponseBatch(outputs=[]))
    stats = None
    while responses.poll(1000):
        msg = decode(responses.recv())
        if isinstance(msg, ResponseBatch) and msg.stats is not None:
            stats = msg.stats
    assert stats is not None
    assert stats.malformed_frames_total == {"requests": 5, "cancel": 1}


def test_decoders_of_every_channel_drop_a_map_without_type():
    frame = msgpack.packb({"type": "TextContext", "max_length": 5,
                           "tokens": array_map(type=None)})
    for type_ in (RequestMessage, ResponseMessage, ResultMessage, CancelRequest):
        assert decode_or_drop(msgpack_numpy_decoder(type_), frame, "any") is None
        assert decode_or_drop(msgpack_numpy_decoder(type_, copy=False), frame, "any") is None
    assert sockets.dropped_frames["any"] == 8


def test_malformed_frames_reach_the_metrics_endpoint():
    """The scheduler's running totals (in its stats) and the API process's own drops are
    both exported as loom:malformed_frames_total by channel."""
    import asyncio

    from api_server.metrics import Metrics
    from processes.sockets import decode_or_drop, malformed_frame_counts
    from serialization.messages import ResponseMessage, SchedulerStats

    before = malformed_frame_counts().get("responses", 0)
    decode_or_drop(msgpack_numpy_decoder(ResponseMessage), b"\xc1garbage", "responses")
    metrics = Metrics("m")
    metrics.observe_scheduler(SchedulerStats(malformed_frames_total={"requests": 3}))

    def scrape() -> dict:
        body = asyncio.run(metrics.endpoint(None)).body.decode()
        values = {}
        for line in body.splitlines():
            if line.startswith("loom:malformed_frames_total{"):
                channel = line.split('channel="')[1].split('"')[0]
                values[channel] = float(line.rsplit(" ", 1)[1])
        return values

    assert scrape() == {"requests": 3.0, "responses": float(before + 1)}
    metrics.observe_scheduler(SchedulerStats(malformed_frames_total={"requests": 5}))
    assert scrape()["requests"] == 5.0  # totals, not increments
