"""A real OpenAI-compatible chat-completions server on 127.0.0.1 for judge tests, with scripted faults.

The server listens on a port the OS picks and answers `POST /v1/chat/completions`. Each request takes the next `Reply`
from the script queue (`server.script(...)`), or asks the default responder when the queue is empty. A `Reply` can be
a normal completion, an HTTP error (with `retry-after`), a hang past the client's timeout, a truncated body (the
`Content-Length` promises more than is sent, then the connection closes) or raw bytes. Every request is recorded
(`server.requests`, with lower-case header names, so a test can check the `authorization` header arrived), the
largest number of requests in flight is kept (`server.max_in_flight`), and nothing is logged or printed.

    with JudgeServer(default=lambda body: ok('{"score": 1}')) as server:
        server.script(error(500), hang(2.0))
        ... JudgeConfig(model="m", base_url=server.base_url, ...) ...
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

DEFAULT_USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


@dataclass
class Reply:
    """One scripted behaviour of the server."""

    content: str = "{}"  # the assistant message content of a 200 answer
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds to wait before answering
    hang: float = 0.0  # seconds to wait before dropping the connection without any answer
    truncate: bool = False  # send half the body under a Content-Length for the whole, then close
    usage: dict[str, Any] | None = field(default_factory=lambda: dict(DEFAULT_USAGE))  # None omits `usage`
    body: bytes | None = None  # raw response body, overriding the generated one


def ok(content: str, usage: dict[str, Any] | None = DEFAULT_USAGE, delay: float = 0.0) -> Reply:
    """A normal completion whose message content is `content`."""
    return Reply(content=content, usage=None if usage is None else dict(usage), delay=delay)


def error(status: int, retry_after: float | None = None) -> Reply:
    """An HTTP error in OpenAI's error format, with an optional `retry-after` header (seconds)."""
    headers = {} if retry_after is None else {"retry-after": str(retry_after)}
    return Reply(status=status, headers=headers)


def hang(seconds: float) -> Reply:
    """Say nothing for `seconds`, then close the connection."""
    return Reply(hang=seconds)


def truncated(content: str = "{}") -> Reply:
    """A 200 whose body is cut in half while `Content-Length` announces all of it."""
    return Reply(content=content, truncate=True)


@dataclass
class RecordedRequest:
    """One request as received; header names are lower-case."""

    path: str
    headers: dict[str, str]
    body: Any
    started: float
    finished: float = float("nan")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # silent: the server never writes requests (or their headers) anywhere

    def do_GET(self) -> None:
        """`GET /v1/models`, the start-up probe of `rewards.judge.check_endpoint`; answered with `models_status`."""
        owner = self.server.owner
        owner.model_probes += 1
        if self.path.rstrip("/") != "/v1/models":
            self._send(404, json.dumps({"error": {"message": "not found"}}).encode(), {})
        elif owner.models_status != 200:
            message = {"error": {"message": f"scripted {owner.models_status}", "type": "test"}}
            self._send(owner.models_status, json.dumps(message).encode(), {})
        else:
            listing = {"object": "list", "data": [{"id": "judge", "object": "model", "created": 0, "owned_by": "t"}]}
            self._send(200, json.dumps(listing).encode(), {})

    def do_POST(self) -> None:
        owner = self.server.owner
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        headers = {name.lower(): value for name, value in self.headers.items()}
        record = RecordedRequest(self.path, headers, body, time.monotonic())
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send(404, json.dumps({"error": {"message": "not found"}}).encode(), {})
            return
        owner._enter(record)
        try:
            self._reply(owner, owner._next_reply(body), body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (timeout); nothing left to do
        finally:
            owner._leave(record)

    def _reply(self, owner: JudgeServer, reply: Reply, body: Any) -> None:
        if reply.hang:
            owner._stop.wait(reply.hang)
            self.close_connection = True
            return
        if reply.delay:
            owner._stop.wait(reply.delay)
        if reply.body is not None:
            payload = reply.body
        elif reply.status == 200:
            payload = json.dumps(owner.completion(body, reply)).encode()
        else:
            message = {"error": {"message": f"scripted {reply.status}", "type": "test", "code": reply.status}}
            payload = json.dumps(message).encode()
        if reply.truncate:
            self.close_connection = True
            self._send(reply.status, payload[: len(payload) // 2], reply.headers, length=len(payload))
            return
        self._send(reply.status, payload, reply.headers)

    def _send(self, status: int, payload: bytes, headers: dict[str, str], length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload) if length is None else length))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # a judge opens many connections at once; the default backlog of 5 turns some away
    daemon_threads = True
    block_on_close = False
    owner: JudgeServer


class JudgeServer:
    """Start with `start()` or `with JudgeServer() as server:`; `base_url` is `http://127.0.0.1:<port>/v1`."""

    def __init__(self, default: Callable[[Any], Reply] | None = None) -> None:
        self.default = default or (lambda body: Reply())
        self.requests: list[RecordedRequest] = []  # chat completions only
        self.models_status = 200  # status of `GET /v1/models` (401: a rejected key)
        self.model_probes = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._queue: deque[Reply] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._count = 0
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def script(self, *replies: Reply) -> None:
        """Queue replies for the next requests, in order."""
        with self._lock:
            self._queue.extend(replies)

    def reset(self) -> None:
        """Forget recorded requests, the in-flight maximum and any queued replies."""
        with self._lock:
            self.requests.clear()
            self._queue.clear()
            self.max_in_flight = self.in_flight

    def completion(self, body: Any, reply: Reply) -> dict[str, Any]:
        with self._lock:
            self._count += 1
            n = self._count
        out: dict[str, Any] = {
            "id": f"chatcmpl-test-{n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": (body or {}).get("model", "test"),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": reply.content}, "finish_reason": "stop"}
            ],
        }
        if reply.usage is not None:
            out["usage"] = reply.usage
        return out

    def _next_reply(self, body: Any) -> Reply:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        return self.default(body)

    def _enter(self, record: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(record)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self, record: RecordedRequest) -> None:
        with self._lock:
            self.in_flight -= 1
            record.finished = time.monotonic()

    def start(self) -> JudgeServer:
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="judge-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()  # wakes handlers that hang or delay
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> JudgeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def judge_server() -> Iterator[JudgeServer]:
    """A started `JudgeServer` with the default responder; stopped after the test."""
    with JudgeServer() as server:
        yield server
