"""Where the load goes: a loopback-only base URL, its health, and the model it serves.

The harness only ever talks to this machine: a benchmark pointed at someone else's server
would be a load attack, so anything but a loopback address is refused outright.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from urllib.parse import urlsplit, urlunsplit

import httpx


class NotLoopbackError(ValueError):
    pass


def loopback_base_url(url: str) -> str:
    """`url` with its path dropped and `localhost` pinned to 127.0.0.1 (so no resolver or
    hosts file can send the traffic elsewhere); raises unless the host is a loopback IP."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = parts.hostname or ""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parts.scheme not in ("http", "https") or not loopback:
        raise NotLoopbackError(f"refusing {url!r}: only http(s) servers on 127.0.0.1 / ::1")
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, "", "", ""))


def auth_headers() -> dict[str, str]:
    """The bearer key for a server started with --api-key: $OPENAI_API_KEY, as the OpenAI
    clients read it (`loom bench --api-key` sets it). Empty when none is set."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_client(**kwargs) -> httpx.AsyncClient:
    # trust_env=False: an HTTP(S)_PROXY in the environment must not reroute loopback traffic.
    # TCP_NODELAY: httpx writes a request's headers and body separately; with Nagle's
    # algorithm the body then waits for the server's delayed ACK (~40 ms on Linux), which
    # would be charged to the server's TTFT.
    transport = httpx.AsyncHTTPTransport(
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    kwargs["headers"] = {**auth_headers(), **kwargs.get("headers", {})}
    return httpx.AsyncClient(trust_env=False, transport=transport, **kwargs)


def wait_healthy(base_url: str, timeout: float, alive=lambda: True, interval: float = 0.2) -> float:
    """Poll GET /health until 200; returns the moment it answered (time.monotonic)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError("the server exited before becoming healthy")
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    return time.monotonic()
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(interval)
    raise TimeoutError(f"{base_url}/health not 200 after {timeout:.0f}s")


def served_model(base_url: str) -> str:
    """The first model id of GET /v1/models, for when --model is not given."""
    with httpx.Client(trust_env=False, timeout=10.0, headers=auth_headers()) as client:
        response = client.get(f"{base_url}/v1/models")
        if response.status_code == 401:
            raise RuntimeError(f"{base_url} asks for an API key: pass --api-key or set "
                               f"$OPENAI_API_KEY")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]
