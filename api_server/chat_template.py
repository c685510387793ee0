"""What a request may pass to the chat template, and templates sent by clients.

`chat_template_kwargs` are variables for the checkpoint's own template (`enable_thinking`,
...). A client must not set the template itself: a Jinja template is code, and one as small as
`{{ 'x' * 10**10 }}` takes the process down (vLLM GHSA-jmjw-q4x3-hmc2). So `chat_template` is
refused unless the server runs with `--trust-request-chat-template`, and even then such a
template is rendered in a child process under a memory limit and a deadline, never on the event
loop. Keys that are the template's own arguments (`messages`, `tools`, ...) are refused too:
they would replace what the server renders, or clash with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
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
    """Renders client-sent templates in a child process, one at a time.

    The child has an address-space limit, so a template that allocates without bound fails
    there with a MemoryError (or the child dies); a template still running at the deadline gets
    the child killed. Either way the request is a 400 and the next one starts a fresh child.
    """

    def __init__(self, timeout: float = 2.0, memory_bytes: int = 2 << 30) -> None:
        self.timeout = timeout
        self.memory_bytes = memory_bytes
        self._mp = multiprocessing.get_context("spawn")
        self._child = None
        self._conn = None
        self._ready = False  # the child has imported what it renders with
        self._lock = asyncio.Lock()

    def start(self) -> None:
        if self._child is not None and self._child.is_alive():
            return
        parent, child = self._mp.Pipe()
        self._child = self._mp.Process(target=_serve_renders, args=(child, self.memory_bytes),
                                       name="loom-template-sandbox", daemon=True)
        self._child.start()
        child.close()
        self._conn, self._ready = parent, False

    def stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join(5)
            self._conn.close()
        self._child = self._conn = None
        self._ready = False

    async def render(self, template: str, messages: list[dict], tools: list[dict] | None,
                     options: dict[str, Any]) -> str:
        job = json.dumps({"template": template, "messages": messages, "tools": tools,
                          "options": options})
        async with self._lock:
            self.start()
            conn = self._conn
            loop = asyncio.get_running_loop()
            if not self._ready:  # its start-up (~1.5 s of imports) is not the template's time
                started = await loop.run_in_executor(None, conn.poll, _STARTUP_TIMEOUT)
                try:
                    self._ready = started and conn.recv_bytes() == b"ready"
                except (EOFError, OSError):
                    pass
                if not self._ready:
                    self.stop()
                    raise RequestError("the chat template renderer could not start",
                                       param="chat_template_kwargs.chat_template", status=503)
            conn.send_bytes(job.encode())
            answered = await loop.run_in_executor(None, conn.poll, self.timeout)
            if not answered:
                self.stop()
                raise RequestError(f"the chat template took longer than {self.timeout:g}s to "
                                   f"render", param="chat_template_kwargs.chat_template")
            try:
                reply = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self.stop()
                raise RequestError("the chat template renderer stopped (out of memory?)",
                                   param="chat_template_kwargs.chat_template") from None
        if "error" in reply:
            raise RequestError(f"the chat template could not render the messages: "
                               f"{reply['error']}", param="chat_template_kwargs.chat_template")
        return reply["text"]


def _serve_renders(conn, memory_bytes: int) -> None:
    """The sandbox child: render each job it is sent with transformers' Jinja environment."""
    import resource

    from serialization.lifecycle import die_with_parent, ignore_interrupts

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
