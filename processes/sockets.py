"""ZeroMQ plumbing: private ipc endpoints, socket construction, decode-or-drop receives."""

from __future__ import annotations

import collections
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """The addresses of the five channels between the three processes."""

    requests: str
    cancel: str
    responses: str
    steps: str
    results: str

    @classmethod
    def ipc(cls, directory: str) -> "Endpoints":
        return cls(**{name: f"ipc://{os.path.join(directory, name)}" for name in _CHANNELS})

    def steps_of_rank(self, rank: int) -> str:
        """Where worker rank `rank` of a model split over several takes its steps (the
        scheduler sends every step to each rank; rank 0's is `steps`)."""
        return self.steps if rank == 0 else f"{self.steps}.{rank}"

    @property
    def rendezvous_file(self) -> str:
        """The file the worker ranks meet at to form their process group (beside the
        sockets, in the server's private directory)."""
        return self.steps.removeprefix("ipc://") + ".rendezvous"


_CHANNELS = ("requests", "cancel", "responses", "steps", "results")


def make_private_ipc_dir() -> str:
    """A fresh directory only this user can enter (mkdtemp creates it 0700)."""
    path = tempfile.mkdtemp(prefix="loom-ipc-")
    os.chmod(path, 0o700)
    return path


MiB = 1 << 20

# The largest frame each channel's receiving socket accepts (ZMQ_MAXMSGSIZE): a peer that sends
# more is disconnected by ZeroMQ before the frame is buffered, so a hostile or broken peer
# cannot make a process allocate gigabytes. Each bound is far above the channel's largest
# legitimate message:
#   requests   a context: tokens (max_model_len <= 128k x 8 B = 1 MiB) and the request's
#              strings, from an HTTP body of at most --max-request-bytes (16 MiB by default)
#   cancel     request ids, ~40 B each
#   responses  a step's outputs with top-20 logprobs, echoed prompt logprobs of a step's
#              chunk, embeddings (n x dim x 4 B) or an audio segment: a few MiB
#   steps      block tables (seqs x max_model_len / block_size x 4 B: 32 MiB at 1024 seqs of
#              128k tokens) and each new request's prompt (with a repetition penalty, 1 MiB)
#              and JSON schema: only its trusted peer (the scheduler binds) sends here, so
#              the bound guards against bugs and is the loosest
#   results    sampled ids and logprobs, embeddings of a batch (1024 x 8192 x 4 B = 32 MiB),
#              an audio segment
# Raise `requests` with --max-request-bytes beyond 256 MiB.
MAX_MESSAGE_BYTES = {
    "requests": 256 * MiB,
    "cancel": 64 * MiB,
    "responses": 256 * MiB,
    "steps": 1024 * MiB,
    "results": 256 * MiB,
}
DEFAULT_MAX_MESSAGE_BYTES = 256 * MiB

# High-water marks, in messages per peer. ZeroMQ never drops on PUSH/PULL: a PUSH whose peer's
# queue is full blocks in send (or raises zmq.Again with NOBLOCK), and a full PULL stops
# reading, which fills the sender's queue. Unbounded queues (0) let a peer that stops reading,
# or one flooding us, grow this process without limit; the bound is set far above legitimate
# load so that a queue only fills when its reader is gone or hung: requests and cancellations
# are at most the open requests (--max-queued-requests, 512, plus the running ones, and the
# scheduler drains both every step), responses one per step, steps and results at most two in
# flight. So a blocked send, or a cancellation refused with NOBLOCK, means the other process
# is hung, which /health reports anyway; nothing legitimate is lost or waits.
HIGH_WATER_MARK = 100_000


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                high_water_mark: int = HIGH_WATER_MARK) -> zmq.Socket:
    """A socket with the channel's bounds (see MAX_MESSAGE_BYTES and HIGH_WATER_MARK)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, high_water_mark)
    sock.setsockopt(zmq.RCVHWM, high_water_mark)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


# Frames dropped per channel since the process started, for the metrics: the scheduler's ride
# in SchedulerStats, the API process reads its own with `malformed_frame_counts()`.
dropped_frames: collections.Counter[str] = collections.Counter()
LOG_INTERVAL_SECONDS = 10.0  # at most one log line per channel this often: a flood of bad
_last_logged: dict[str, float] = {}  # frames must not become a flood of log lines
_unlogged: collections.Counter[str] = collections.Counter()


def malformed_frame_counts() -> dict[str, int]:
    """Malformed frames dropped by this process so far, per channel."""
    return dict(dropped_frames)


def decode_or_drop(decode: Callable[[bytes], Any], frame: bytes, channel: str) -> Any | None:
    """Decode a frame; a malformed one is counted, logged (rate-limited) and dropped instead of
    crashing the process."""
    try:
        return decode(frame)
    except Exception as exc:  # any frame a peer can send; not KeyboardInterrupt/SystemExit
        _note_drop(channel, memoryview(frame).nbytes, exc)
        return None


def _note_drop(channel: str, size: int, exc: Exception) -> None:
    dropped_frames[channel] += 1
    now = time.monotonic()
    last = _last_logged.get(channel)
    if last is not None and now - last < LOG_INTERVAL_SECONDS:
        _unlogged[channel] += 1
        return
    _last_logged[channel] = now
    also = _unlogged.pop(channel, 0)
    logger.warning("dropped a malformed %d-byte frame on %s (%s: %.200s)%s", size, channel,
                   type(exc).__name__, exc,
                   f"; {also} more since the last report" if also else "")
