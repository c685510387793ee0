"""ZeroMQ plumbing: private ipc endpoints, socket construction, decode-or-drop receives."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
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

    @classmethod
    def tcp(cls, host: str, base_port: int) -> "Endpoints":
        return cls(**{name: f"tcp://{host}:{base_port + i}" for i, name in enumerate(_CHANNELS)})


_CHANNELS = ("requests", "cancel", "responses", "steps", "results")


def make_private_ipc_dir() -> str:
    """A fresh directory only this user can enter (mkdtemp creates it 0700)."""
    path = tempfile.mkdtemp(prefix="loom-ipc-")
    os.chmod(path, 0o700)
    return path


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: backpressure is the scheduler's job (bounded waiting queue), and a
    # dropped message here would lose a request or a response silently.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def decode_or_drop(decode: Callable[[bytes], Any], frame: bytes, channel: str) -> Any | None:
    """Decode a frame; a malformed one is logged and dropped instead of crashing the process."""
    try:
        return decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        logger.warning("dropped a malformed %d-byte frame on %s: %s", len(frame), channel, exc)
        return None
