"""EngineClient (the API process's end of the ZeroMQ channels) against a stand-in scheduler on
real sockets: requests submitted ahead of their readers are sent once, read once, and withdrawn
(cancelled in the scheduler, forgotten in the API) when nobody reads them."""

import asyncio

import numpy as np
import pytest
import zmq
from starlette.requests import ClientDisconnect

from api_server.engine_client import EngineClient
from api_server.engine_stream_response import EngineStreamResponse
from api_server.metrics import Metrics
from pipelines import SamplingParams
from pipelines.context import TextContext
from pipelines.response import TextGenerationOutput
from pipelines.status import GenerationStatus
from processes.sockets import Endpoints, make_socket
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import CancelRequest, RequestMessage, ResponseBatch


class StandInScheduler:
    """The scheduler's three API-facing sockets; what arrives is read with a timeout."""

    def __init__(self, directory: str) -> None:
        self.endpoints = Endpoints.ipc(directory)
        self.zctx = zmq.Context()
        self.requests = make_socket(self.zctx, zmq.PULL, self.endpoints.requests, bind=True)
        self.cancels = make_socket(self.zctx, zmq.PULL, self.endpoints.cancel, bind=True)
        self.responses = make_socket(self.zctx, zmq.PUSH, self.endpoints.responses, bind=True)
        self.encode = msgpack_numpy_encoder()

    def received(self, sock, decode, timeout_ms: int = 2000) -> list:
        messages = []
        while sock.poll(timeout_ms):
            messages.append(decode(sock.recv()))
            timeout_ms = 100  # after the first, collect whatever else is already there
        return messages

    def requests_received(self, timeout_ms: int = 2000) -> list:
        return self.received(self.requests, msgpack_numpy_decoder(RequestMessage), timeout_ms)

    def cancelled_ids(self, timeout_ms: int = 2000) -> list[str]:
        decoded = self.received(self.cancels, msgpack_numpy_decoder(CancelRequest), timeout_ms)
        return [rid for message in decoded for rid in message.request_ids]

    def reply(self, *outputs: TextGenerationOutput) -> None:
        self.responses.send(self.encode(ResponseBatch(outputs=list(outputs))))

    def close(self) -> None:
        self.zctx.destroy(linger=0)


def context(request_id: str) -> TextContext:
    return TextContext(request_id=request_id, max_length=20, tokens=np.arange(1, 6),
                       eos_token_ids={2})


def aborted(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value(
        "loom:request_success_total", {"finished_reason": "abort", "model_name": "m"}) or 0.0


def run(tmp_path, scenario):
    scheduler = StandInScheduler(str(tmp_path))

    async def main():
        engine = EngineClient(scheduler.endpoints, Metrics("m"))
        engine.start()
        try:
            await scenario(engine, scheduler)
        finally:
            engine.close()

    try:
        asyncio.run(main())
    finally:
        scheduler.close()


def test_submitted_request_is_sent_once_and_read_by_generate(tmp_path):
    async def scenario(engine, scheduler):
        await engine.submit(context("a"))
        assert [c.request_id for c in scheduler.requests_received()] == ["a"]
        scheduler.reply(TextGenerationOutput("a", [7]),
                        TextGenerationOutput("a", [8], GenerationStatus.MAXIMUM_LENGTH))
        outputs = [o async for o in engine.generate(context("a"))]
        assert [o.tokens for o in outputs] == [[7], [8]]
        assert scheduler.requests_received(200) == []  # generate did not send it again
        assert scheduler.cancelled_ids(200) == []
        assert engine.num_in_flight == 0 and engine.queued_requests == 0
        assert engine.queued_tokens == 0

    run(tmp_path, scenario)


def test_withdraw_cancels_only_unread_requests(tmp_path):
    async def scenario(engine, scheduler):
        await engine.submit(context("read"))
        await engine.submit(context("unread"))
        reader = engine.generate(context("read"))
        scheduler.reply(TextGenerationOutput("read", [7]))
        assert (await reader.__anext__()).tokens == [7]
        engine.withdraw(["read", "unread"])
        assert scheduler.cancelled_ids() == ["unread"]
        assert aborted(engine.metrics) == 1
        assert engine.num_in_flight == 1  # "read" is its reader's to end
        await reader.aclose()
        assert scheduler.cancelled_ids() == ["read"]
        assert engine.num_in_flight == 0 and engine.queued_requests == 0
        assert engine.queued_tokens == 0 and aborted(engine.metrics) == 2

    run(tmp_path, scenario)


def test_stream_response_withdraws_when_the_client_left_before_the_body(tmp_path):
    async def scenario(engine, scheduler):
        await engine.submit(context("gone"))

        async def body():
            async for output in engine.generate(context("gone")):
                yield bytes(output.tokens)

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            raise OSError("the client is gone")  # how an ASGI 2.4 server reports it

        response = EngineStreamResponse(body(), engine, ["gone"])
        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert scheduler.cancelled_ids() == ["gone"]
        assert engine.num_in_flight == 0 and engine.queued_requests == 0
        assert aborted(engine.metrics) == 1

    run(tmp_path, scenario)


def test_a_stop_string_in_the_final_output_leaves_no_entry_behind(tmp_path):
    from api_server.generation import stream_choice

    class Chars:  # a tokenizer whose token i is the character chr(i)
        def decode(self, ids, **kwargs):
            return "".join(chr(i) for i in ids)

    async def scenario(engine, scheduler):
        ctx = context("final")
        ctx.sampling_params = SamplingParams(stop=["k"])
        await engine.submit(ctx)
        # Stop strings stay in the API process: the scheduler gets the context without them.
        [sent] = scheduler.requests_received()
        assert sent.request_id == "final" and sent.sampling_params.stop is None
        assert ctx.sampling_params.stop == ["k"]
        scheduler.reply(TextGenerationOutput("final", [ord("o"), ord("k")],
                                             GenerationStatus.MAXIMUM_LENGTH))
        deltas = [d async for d in stream_choice(engine, ctx, Chars(), 0, True)]
        assert [(d.text, d.finish_reason) for d in deltas] == [("o", "stop")]
        assert engine._ended_early == {} and engine.streams == {}

    run(tmp_path, scenario)
