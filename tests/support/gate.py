"""An HTTP relay that holds requests between ``epd proxy`` and vLLM until the test lets them go (test process)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx


class Gate:
    """An HTTP relay that holds each POST until :meth:`open` (bounded), then forwards it to ``backend``.

    Put between the proxy and vLLM, it makes "after the proxy encoded, before the connector
    pulled" a moment the test controls.
    """

    HOLD_LIMIT_S = 60.0

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.arrived = threading.Event()
        self._open = threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._relay(None)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                gate.arrived.set()
                gate._open.wait(gate.HOLD_LIMIT_S)
                self._relay(body)

            def _relay(self, body: bytes | None) -> None:
                resp = httpx.request("POST" if body is not None else "GET", gate.backend + self.path,
                                     content=body, headers={"Content-Type": "application/json"}, timeout=120.0)
                self.send_response(resp.status_code)
                self.send_header("Content-Type", resp.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def hold(self) -> None:
        self.arrived.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.set()
        self._server.shutdown()
        self._server.server_close()
