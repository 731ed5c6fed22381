"""The client side of controller hardening (issue 16, "Controller and client hardening"):
ControllerClient against a real HTTP server playing a hostile or overloaded peer.

- An answer larger than MAX_RESPONSE_BYTES (a 276 MB ``/v1/backends``) is refused while streaming:
  the caller's resident memory grows by far less than 64 MiB, and the error says why.
- Non-JSON 429, 408 and 5xx answers (a proxy's page, a load balancer's) are transient
  (Unavailable, retryable), not permanent refusals.

Each test attacks one defence and fails when that defence is removed.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from iris.controller.client import MAX_RESPONSE_BYTES, ControllerClient
from iris.controller.errors import ControllerError, Unavailable

HUGE = 276_000_000
CHUNK = b"[" + b"0," * (1 << 19) + b"0]"  # ~1 MiB of a (never-ending) JSON array


@dataclass
class Answer:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/html"
    huge: bool = False  # stream HUGE bytes instead of ``body``
    chunked: bool = False  # with no Content-Length (the cap must hold while streaming)
    encoding: str | None = None


@dataclass
class Peer:
    url: str
    answers: dict[str, Answer] = field(default_factory=dict)
    sent: list[int] = field(default_factory=list)  # bytes written per huge answer
    done: threading.Event = field(default_factory=threading.Event)


class _Handler(BaseHTTPRequestHandler):
    peer: ClassVar[Peer]
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        answer = self.peer.answers.get(self.path, Answer(status=404, body=b"<html>no</html>"))
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type)
        if answer.encoding:
            self.send_header("Content-Encoding", answer.encoding)
        if answer.huge and answer.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(HUGE if answer.huge else len(answer.body)))
        self.end_headers()
        if not answer.huge:
            self.wfile.write(answer.body)
            return
        sent = 0
        try:
            while sent < HUGE:
                data = CHUNK if not answer.chunked else b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
                self.wfile.write(data)
                sent += len(CHUNK)
            if answer.chunked:
                self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading, as it should
        finally:
            self.peer.sent.append(sent)
            self.peer.done.set()
            self.close_connection = True


@pytest.fixture
def peer() -> Iterator[Peer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    state = Peer(url=f"http://127.0.0.1:{server.server_address[1]}")
    _Handler.peer = state
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field_name} in /proc/self/status")


class RssPeak:
    """This process's resident-memory peak over a block (VmHWM, reset through clear_refs)."""

    def __enter__(self) -> RssPeak:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        self.before_kib = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth_mib = (_status_kib("VmHWM") - self.before_kib) / 1024


@pytest.mark.parametrize("chunked", [False, True], ids=["with-length", "chunked"])
async def test_a_huge_answer_is_refused_without_filling_memory(peer: Peer, chunked: bool) -> None:
    peer.answers["/v1/backends"] = Answer(content_type="application/json", huge=True, chunked=chunked)
    async with ControllerClient(peer.url, timeout=60) as c:
        with RssPeak() as rss, pytest.raises(Unavailable) as err:
            await c.backends()
    assert rss.growth_mib < 64, f"RSS grew by {rss.growth_mib:.0f} MiB"
    assert f"larger than {MAX_RESPONSE_BYTES} bytes" in err.value.message
    assert err.value.retryable
    # It stopped reading early: the peer could not push (much) more than the cap plus socket buffers.
    assert await asyncio.to_thread(peer.done.wait, 10)
    assert peer.sent[0] < HUGE


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
async def test_non_json_overload_answers_are_transient(peer: Peer, status: int) -> None:
    page = f"<html><body><h1>{status}</h1>try again later</body></html>".encode()
    peer.answers["/v1/backends"] = Answer(status=status, body=page)
    async with ControllerClient(peer.url) as c:
        with pytest.raises(ControllerError) as err:
            await c.backends()
    assert isinstance(err.value, Unavailable), err.value
    assert err.value.retryable
    assert f"HTTP {status}" in err.value.message and "try again later" in err.value.message


async def test_a_non_json_refusal_stays_permanent(peer: Peer) -> None:
    """Only overload answers turn transient: a 403 page is still a refusal."""
    peer.answers["/v1/backends"] = Answer(status=403, body=b"<html>forbidden</html>")
    async with ControllerClient(peer.url) as c:
        with pytest.raises(ControllerError) as err:
            await c.backends()
    assert not err.value.retryable and "HTTP 403" in err.value.message


async def test_a_compressed_answer_is_refused(peer: Peer) -> None:
    """The cap counts bytes as parsed: the client asks for no compression and refuses one it did not
    ask for (a gzip bomb would otherwise inflate past the cap in one chunk)."""
    bomb = gzip.compress(b"0" * (1 << 20))
    peer.answers["/v1/backends"] = Answer(body=bomb, content_type="application/json", encoding="gzip")
    async with ControllerClient(peer.url) as c:
        with pytest.raises(Unavailable, match="compressed"):
            await c.backends()
