"""What a web page may not make a browser send to Loom.

A page on any site can point its visitor's browser at a server on that visitor's machine or
network: through DNS rebinding (its own name resolved to 127.0.0.1, so the browser sends
`Host: evil.example` and lets the page read the answers) or with a "simple" cross-site POST
(a `text/plain` body that needs no CORS preflight). A key-less server would serve both. So:

- Host: without an API key, only loopback names and addresses, the --host the server was
  bound to, and --allowed-hosts (`*`: any) are answered; a server bound to a non-loopback
  address (which needs --allow-unauthenticated) also answers any IP address, since rebinding
  always presents a name. The probes (/health, /live, /metrics) answer any Host: a
  Kubernetes probe sends the pod's IP. Jupyter has the same rule for its loopback default.
- Origin: a request from a browser page of another origin is refused unless --allowed-origins
  lists it; those listed get CORS (preflight answered, Access-Control-* headers).
- Content-Type: request bodies are JSON, and only accepted as such (415 otherwise), so no
  simple request can carry one.
"""

from __future__ import annotations

import ipaddress
import re

from starlette.middleware.cors import CORSMiddleware

from api_server.middleware import send_error

# Answered whatever the Host: the probes of load balancers, kubelets and Prometheus.
PROBE_PATHS = frozenset({"/health", "/live", "/metrics"})
_WILDCARD_BINDS = {"", "0.0.0.0", "::", "[::]"}
_HOST = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^:\[\]]*)(?::\d*)?$")


def host_name(header: str) -> str | None:
    """The name or address of a Host header, without its port or brackets; None if it is
    not one."""
    match = _HOST.match(header.strip())
    if match is None:
        return None
    return match.group(1).strip("[]").rstrip(".").lower()


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostPolicy:
    """Which Host headers a key-less server answers (see the module's notes)."""

    def __init__(self, bound_host: str, allowed_hosts: tuple[str, ...]) -> None:
        self.any = "*" in allowed_hosts
        self.names = {name.rstrip(".").lower() for name in allowed_hosts}
        bound = bound_host.strip("[]").rstrip(".").lower()
        if bound_host not in _WILDCARD_BINDS:
            self.names.add(bound)
        self.any_address = not _is_loopback(bound)

    def allows(self, header: str | None) -> bool:
        if self.any or header is None:  # no Host: HTTP/1.0, never a browser
            return True
        name = host_name(header)
        if name is None:
            return False
        if name in self.names or _is_loopback(name):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return self.any_address


def _origin(value: str) -> str:
    return value.strip().rstrip("/").lower()


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/")
                                            and media.endswith(b"+json"))


def _has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length", b"").strip()
    return b"transfer-encoding" in headers or (length not in (b"", b"0"))


def guard_cross_site(app, host_policy: HostPolicy | None, allowed_origins: tuple[str, ...]):
    """Host (when `host_policy` is given: servers without a key), Origin and Content-Type
    checks, then CORS for the allowed origins, in front of `app`."""
    any_origin = "*" in allowed_origins
    origins = {_origin(o) for o in allowed_origins}
    if origins:
        app = CORSMiddleware(app, allow_origins=["*"] if any_origin else sorted(origins),
                             allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"],
                             allow_private_network=True, max_age=600)

    async def middleware(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        host = host.decode("latin-1") if host is not None else None
        if (host_policy is not None and scope["path"] not in PROBE_PATHS
                and not host_policy.allows(host)):
            return await send_error(
                send, 403, f"Host {host!r} is not served: without an API key only loopback "
                           f"names are (--allowed-hosts adds names, a guard against DNS "
                           f"rebinding)", "invalid_request_error", "host_not_allowed")
        origin = headers.get(b"origin")
        if origin is not None and not any_origin:
            value = _origin(origin.decode("latin-1"))
            same_origin = host is not None and value.split("://", 1)[-1] == host.lower()
            if value not in origins and not same_origin:
                return await send_error(
                    send, 403, f"cross-origin request from {value!r} refused: list the origin "
                               f"in --allowed-origins", "invalid_request_error",
                    "origin_not_allowed")
        if (scope["method"] in ("POST", "PUT", "PATCH") and _has_body(headers)
                and not _is_json(headers.get(b"content-type", b""))):
            given = headers.get(b"content-type", b"none").decode("latin-1")
            return await send_error(
                send, 415, f"request bodies are JSON: send them with Content-Type: "
                           f"application/json (not {given!r})", "invalid_request_error",
                "unsupported_media_type")
        return await app(scope, receive, send)

    return middleware
