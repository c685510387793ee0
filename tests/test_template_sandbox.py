"""The sandbox that renders client-sent chat templates (--trust-request-chat-template): its
children start without the server's environment, and a slow template holds one of them, not
every request behind it. (tests/test_hostile_requests.py runs it behind a real server.)"""

import asyncio
import time

from api_server.chat_template import TemplateSandbox
from api_server.protocol import RequestError

MSG = [{"role": "user", "content": "hi"}]
ECHO = "{{ messages[0].content }}"
SLOW = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


async def render(sandbox, template):
    """(text or the RequestError, seconds taken)."""
    started = time.monotonic()
    try:
        result = await sandbox.render(template, MSG, None, {})
    except RequestError as exc:
        result = exc
    return result, time.monotonic() - started


def test_sandbox_gets_none_of_the_servers_environment(monkeypatch):
    monkeypatch.setenv("LOOM_API_KEY", "secret-key-of-the-server")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "another")

    async def main():
        sandbox = TemplateSandbox(processes=1)
        try:
            assert (await render(sandbox, ECHO))[0] == "hi"
            pid = sandbox.renderers[0].process.pid
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            return environ
        finally:
            sandbox.stop()

    environ = asyncio.run(main())
    assert b"secret-key-of-the-server" not in environ and b"another" not in environ
    names = {entry.split(b"=", 1)[0] for entry in environ.split(b"\0") if entry}
    assert names <= {b"LANG", b"LC_ALL", b"LC_CTYPE", b"LD_LIBRARY_PATH"}, names


def test_a_slow_template_does_not_hold_up_others():
    """Two children: a template running to its deadline holds one, and another request renders
    meanwhile on the other; with both busy and no queue, the next is a 503 at once; the
    children killed at the deadline are started afresh for the next request."""

    async def main():
        sandbox = TemplateSandbox(timeout=3.0, processes=2, max_waiting=0)
        sandbox.start()
        try:
            # Both children up (their imports are not the templates' time).
            warm = await asyncio.gather(render(sandbox, ECHO), render(sandbox, ECHO))
            assert [text for text, _ in warm] == ["hi", "hi"]
            slow = asyncio.ensure_future(render(sandbox, SLOW))
            await asyncio.sleep(0.3)
            text, seconds = await render(sandbox, ECHO + "!")
            assert text == "hi!" and seconds < 2.5 and not slow.done()
            second_slow = asyncio.ensure_future(render(sandbox, SLOW))
            await asyncio.sleep(0.3)
            busy, seconds = await render(sandbox, ECHO)
            assert isinstance(busy, RequestError) and busy.status == 503 and seconds < 0.5
            for error, _ in await asyncio.gather(slow, second_slow):
                assert isinstance(error, RequestError) and error.status == 400
                assert "took longer than 3s" in error.message
            assert (await render(sandbox, ECHO + "?"))[0] == "hi?"
        finally:
            sandbox.stop()

    asyncio.run(main())

