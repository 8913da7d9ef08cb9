"""A fake vLLM OpenAI server for proxy tests: lists one model, answers its health, records and can hold the chats (test process)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class FakeVllm:
    """An OpenAI server in a thread: lists ``served`` on ``/v1/models`` (``model_asks`` counts the
    asks), answers ``/health`` as vLLM does (no body) with ``health_status``, records each chat and
    its Authorization header, and holds chats while :meth:`hold` is on (``arrived`` is set as one
    comes in; at most ``HOLD_LIMIT_S``)."""

    served: str
    health_status: int = 200
    chats: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    model_asks: int = 0
    arrived: threading.Event = field(default_factory=threading.Event)
    _open: threading.Event = field(default_factory=threading.Event)

    HOLD_LIMIT_S = 60.0

    def __post_init__(self) -> None:
        self._open.set()
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/health"):
                    self.send_response(backend.health_status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                backend.model_asks += 1
                self._answer({"object": "list", "data": [{"id": backend.served, "object": "model"}]})

            def do_POST(self) -> None:
                backend.chats.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
                backend.auth.append(self.headers.get("Authorization"))
                backend.arrived.set()
                backend._open.wait(backend.HOLD_LIMIT_S)
                self._answer({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})

            def _answer(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def hold(self) -> None:
        """Hold the chats that arrive from now on until :meth:`release`."""
        self.arrived.clear()
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    @property
    def holding(self) -> bool:
        """Whether chats are held (:meth:`hold` without :meth:`release` since)."""
        return not self._open.is_set()

    def close(self) -> None:
        self._open.set()
        self._server.shutdown()
        self._server.server_close()
