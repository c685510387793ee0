"""What a request may pass to the chat template, and templates sent by clients.

`chat_template_kwargs` are variables for the checkpoint's own template (`enable_thinking`,
...). A client must not set the template itself: a Jinja template is code, and one as small as
`{{ 'x' * 10**10 }}` takes the process down (vLLM GHSA-jmjw-q4x3-hmc2). So `chat_template` is
refused unless the server runs with `--trust-request-chat-template`, and even then such a
template is rendered in a child process under a memory limit and a deadline, never on the event
loop. Keys that are the template's own arguments (`messages`, `tools`, ...) are refused too:
they would replace what the server renders, or clash with it.

The child is a fresh interpreter started with an empty environment (but for the locale and
library path Python itself may need): were a template to escape Jinja's sandbox, it would find
no `LOOM_API_KEY` nor any other secret of the server's environment there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from multiprocessing.connection import Connection, Pipe
from typing import Any

from api_server.protocol import RequestError, check_depth

logger = logging.getLogger("loom.api")

# apply_chat_template's own parameters, and the variables it gives the template.
RESERVED_TEMPLATE_KEYS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})
MAX_TEMPLATE_CHARS = 64 * 1024
_STARTUP_TIMEOUT = 60.0
SANDBOX_PROCESSES = 2
MAX_WAITING_RENDERS = 16  # beyond the processes' own: then 503, not a growing backlog
# What the sandbox inherits of the server's environment: what the interpreter may need to
# start, nothing an operator would keep a secret in.
_SANDBOX_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "LD_LIBRARY_PATH")
# The child's entry: the server's import path (argv, not the environment), then the loop.
_BOOT = ("import sys; fd, limit = int(sys.argv[1]), int(sys.argv[2]); sys.path[:0] = sys.argv[3:]; "
         "from multiprocessing.connection import Connection; "
         "from api_server.chat_template import _serve_renders; "
         "_serve_renders(Connection(fd), limit)")


def template_options(kwargs: dict[str, Any] | None, add_generation_prompt: bool,
                     trust_request_template: bool, param: str = "chat_template_kwargs",
                     ) -> dict[str, Any]:
    """The options passed to the tokenizer's renderer: the client's template variables, the
    generation prompt flag, and `chat_template` only where the operator allowed it."""
    options = dict(kwargs or {})
    check_depth(options, param)
    template = options.pop("chat_template", None)
    for key in options:
        if key in RESERVED_TEMPLATE_KEYS:
            raise RequestError(f"{param} may not set {key!r}: it is the template's own "
                               f"argument", param=f"{param}.{key}")
    if template is not None:
        if not trust_request_template:
            raise RequestError(
                "this server does not render chat templates sent in requests (start it with "
                "--trust-request-chat-template to allow it)", param=f"{param}.chat_template")
        if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
            raise RequestError(f"chat_template must be a string of at most "
                               f"{MAX_TEMPLATE_CHARS} characters", param=f"{param}.chat_template")
        options["chat_template"] = template
    options["add_generation_prompt"] = add_generation_prompt
    return options


class TemplateSandbox:
    """Renders client-sent templates in a few child processes, one template each at a time.

    Each child has an address-space limit, so a template that allocates without bound fails
    there with a MemoryError (or the child dies); a template still running at the deadline gets
    its child killed. Either way the request is a 400 and that child is started afresh. A slow
    template holds one child, not the others; past the children and a bounded queue, requests
    get a 503.
    """

    def __init__(self, timeout: float = 2.0, memory_bytes: int = 2 << 30,
                 processes: int = SANDBOX_PROCESSES,
                 max_waiting: int = MAX_WAITING_RENDERS) -> None:
        self.timeout = timeout
        self.renderers = [_Renderer(memory_bytes) for _ in range(processes)]
        self._idle = list(self.renderers)
        self._free = asyncio.Semaphore(processes)
        self._max_pending = processes + max_waiting
        self._pending = 0  # renders running or waiting for a child

    def start(self) -> None:
        for renderer in self.renderers:
            renderer.start()

    def stop(self) -> None:
        for renderer in self.renderers:
            renderer.stop()

    async def render(self, template: str, messages: list[dict], tools: list[dict] | None,
                     options: dict[str, Any]) -> str:
        if self._pending >= self._max_pending:
            raise RequestError("the chat template renderers are busy; retry shortly",
                               param="chat_template_kwargs.chat_template", status=503,
                               code="server_busy")
        job = json.dumps({"template": template, "messages": messages, "tools": tools,
                          "options": options}).encode()
        self._pending += 1
        try:
            async with self._free:
                renderer = self._idle.pop()
                try:
                    reply = await renderer.render(job, self.timeout)
                finally:
                    self._idle.append(renderer)
        finally:
            self._pending -= 1
        if "error" in reply:
            raise RequestError(f"the chat template could not render the messages: "
                               f"{reply['error']}", param="chat_template_kwargs.chat_template")
        return reply["text"]


class _Renderer:
    """One sandbox child, started when first needed and again after it was killed."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.ready = False  # the child has imported what it renders with

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.stop()
        parent, child = Pipe()
        env = {key: os.environ[key] for key in _SANDBOX_ENV if key in os.environ}
        # -I: no PYTHON* variables, user site or working directory on the path either.
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT, str(child.fileno()), str(self.memory_bytes),
             *sys.path], env=env, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        child.close()
        self.conn, self.ready = parent, False

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(5)
            self.conn.close()
        self.process = self.conn = None
        self.ready = False

    async def render(self, job: bytes, timeout: float) -> dict:
        """The child's reply to `job`; RequestError if it does not give one in time."""
        try:
            return await self._render(job, timeout)
        except BaseException:  # (a cancelled request too: its reply must not be the next's)
            self.stop()
            raise

    async def _render(self, job: bytes, timeout: float) -> dict:
        self.start()
        conn = self.conn
        loop = asyncio.get_running_loop()
        if not self.ready:  # its start-up (~1.5 s of imports) is not the template's time
            started = await loop.run_in_executor(None, conn.poll, _STARTUP_TIMEOUT)
            try:
                self.ready = started and conn.recv_bytes() == b"ready"
            except (EOFError, OSError):
                pass
            if not self.ready:
                raise RequestError("the chat template renderer could not start",
                                   param="chat_template_kwargs.chat_template", status=503)
        conn.send_bytes(job)
        if not await loop.run_in_executor(None, conn.poll, timeout):
            raise RequestError(f"the chat template took longer than {timeout:g}s to render",
                               param="chat_template_kwargs.chat_template")
        try:
            return json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            raise RequestError("the chat template renderer stopped (out of memory?)",
                               param="chat_template_kwargs.chat_template") from None


def _serve_renders(conn, memory_bytes: int) -> None:
    """The sandbox child: render each job it is sent with transformers' Jinja environment."""
    import resource

    from processes.lifecycle import die_with_parent, ignore_interrupts

    die_with_parent()
    ignore_interrupts()
    from transformers.utils.chat_template_utils import render_jinja_template

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    conn.send_bytes(b"ready")
    while True:
        try:
            job = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            options = dict(job["options"])
            text, _ = render_jinja_template(
                conversations=[job["messages"]], tools=job["tools"],
                chat_template=job["template"], **options)
            reply = {"text": text[0]}
        except MemoryError:
            reply = {"error": "out of memory"}
        except Exception as exc:  # the template's own error, shown to the client
            reply = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        try:
            conn.send_bytes(json.dumps(reply).encode())
        except MemoryError:
            conn.send_bytes(b'{"error": "out of memory"}')
