"""``epd proxy`` against a fake encoder client and a fake vLLM backend (real HTTP on 127.0.0.1):
the rewrite, the error mapping, streaming, and what it says when the backend fails a request."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.config import ProxyConfig
from common.errors import CacheFullError, ECLoadFailure, InvalidMediaError, LoadFailureReason
from common.wire import pb2
from prefill_client.client import Placement
from prefill_client.encoder_conn import MediaSpec
from prefill_client.proxy import Proxy
from prefill_client.vllm.params import from_params

PNG = b"\x89PNG fake bytes"


def _data_url(data: bytes = PNG) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@dataclass
class FakeConn:
    present: bool = True
    lookups: list[list[str]] = field(default_factory=list)

    def lookup(self, hashes: Sequence[str]) -> list[pb2.ItemLocation | None]:
        self.lookups.append(list(hashes))
        return [pb2.ItemLocation(mm_hash=h, lease_id=5) if self.present else None for h in hashes]

    def release(self, lease_ids: Sequence[int]) -> None:
        pass


@dataclass
class FakeClient:
    error: Exception | None = None
    placed: list[list[MediaSpec]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    conn: FakeConn = field(default_factory=FakeConn)

    @property
    def targets(self) -> tuple[str, ...]:
        return ("127.0.0.1:1",)

    def place(self, specs: Sequence[MediaSpec]) -> list[Placement]:
        self.placed.append(list(specs))
        if self.error is not None:
            raise self.error
        out = []
        for i, spec in enumerate(specs):
            h = hashlib.sha256(spec.frames[0]).hexdigest()[:16]
            loc = pb2.ItemLocation(mm_hash=h, block_ids=[1], tokens_per_block=[4], num_tokens=4, lease_id=100 + i,
                                   grid_thw=[1, 4, 4])
            out.append(Placement(h, "127.0.0.1:1", "inc", loc))
        return out

    def release_placed(self, placements: Sequence[Placement]) -> None:
        self.released += [p.mm_hash for p in placements]

    def connection(self, target: str) -> FakeConn:
        return self.conn


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _run(client: FakeClient, backend: Handler | None, body: Any, *, raw: bytes | None = None,
               cfg: dict[str, Any] | None = None, stream: bool = False) -> tuple[int, dict[str, str], Any, list[Any]]:
    """POST ``body`` to a proxy in front of ``backend``; (status, headers, answer, bodies the backend got)."""
    seen: list[Any] = []
    backend_app = web.Application()

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        assert backend is not None
        return await backend(request)

    backend_app.router.add_post("/v1/chat/completions", record)
    backend_server = TestServer(backend_app, host="127.0.0.1")
    await backend_server.start_server()
    url = str(backend_server.make_url("")).rstrip("/") if backend is not None else "http://127.0.0.1:9"
    proxy = Proxy(ProxyConfig(backends=(url,), **(cfg or {})), client)  # type: ignore[arg-type]
    async with TestClient(TestServer(proxy.app(), host="127.0.0.1")) as http:
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        resp = await http.post("/v1/chat/completions", **kwargs)
        if stream:
            answer: Any = [chunk async for chunk in resp.content.iter_any()]
        else:
            text = await resp.text()
            answer = json.loads(text) if text else None
        status, headers = resp.status, dict(resp.headers)
    await backend_server.close()
    return status, headers, answer, seen


def _chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]}


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"message": {"content": "ok"}}]})


def test_images_become_embeds_parts_with_their_locations() -> None:
    client = FakeClient()
    other = _data_url(b"another image")
    status, _, answer, seen = asyncio.run(_run(client, _ok, _chat(_image(_data_url()), _image(other),
                                                                   _image(_data_url()))))
    assert status == 200 and answer["choices"][0]["message"]["content"] == "ok"
    (sent,) = seen
    parts = sent["messages"][1]["content"]
    assert [p["type"] for p in parts] == ["image_embeds", "image_embeds", "image_embeds", "text"]
    assert parts[0]["image_embeds"] == {"image_grid_thw": [1, 4, 4]} and parts[0]["uuid"] == parts[2]["uuid"]
    placed = from_params(sent["ec_transfer_params"])
    assert set(placed) == {parts[0]["uuid"], parts[1]["uuid"]}
    assert placed[parts[1]["uuid"]].location.lease_id == 101
    # One Encode for the request's images; the repeated image's second lease given back.
    assert len(client.placed) == 1 and len(client.placed[0]) == 3
    assert client.released == [parts[0]["uuid"]]
    assert sent["messages"][0] == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize("error, status, words", [
    (InvalidMediaError("messages[1].content[0]", "cannot identify image file"), 400, "messages[1].content[0]"),
    (CacheFullError("every block is leased", 1500), 429, "every block is leased"),
    (ECLoadFailure(LoadFailureReason.HANDSHAKE, "h", detail="no encoder reachable (a: down)"), 503,
     "no encoder reachable"),
])
def test_encoder_errors_map_to_http(error: Exception, status: int, words: str) -> None:
    got, headers, answer, seen = asyncio.run(_run(FakeClient(error=error), _ok, _chat(_image(_data_url()))))
    assert got == status and words in answer["error"]["message"], answer
    assert not seen
    if status == 429:
        assert headers["Retry-After"] == "2"


@pytest.mark.parametrize("url, words", [
    ("http://198.51.100.7/x.png", "remote media URLs are refused"),
    ("file:///etc/hostname", "local files are refused"),
    ("ftp://x/y.png", "unsupported media URL scheme 'ftp'"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64,%%%", "not valid base64"),
    ("", "has no url"),
])
def test_bad_media_urls_are_400_naming_the_part(url: str, words: str) -> None:
    client = FakeClient()
    status, _, answer, seen = asyncio.run(_run(client, _ok, _chat(_image(_data_url()), _image(url))))
    assert status == 400
    assert answer["error"]["message"].startswith("messages[1].content[1]: ") and words in answer["error"]["message"]
    assert not client.placed and not seen


def test_local_files_only_under_the_allowed_directory(tmp_path: Path) -> None:
    (tmp_path / "ok.png").write_bytes(PNG)
    client = FakeClient()
    cfg = {"allow_local_media": str(tmp_path)}
    status, _, _, seen = asyncio.run(_run(client, _ok, _chat(_image(f"file://{tmp_path}/ok.png")), cfg=cfg))
    assert status == 200 and client.placed[0][0].frames == (PNG,)
    status, _, answer, _ = asyncio.run(_run(client, _ok, _chat(_image(f"file://{tmp_path}/../x.png")), cfg=cfg))
    assert status == 400 and "outside --allow-local-media" in answer["error"]["message"]


def test_videos_become_embeds_parts_with_their_timestamps() -> None:
    client = FakeClient()
    frames = [b"frame-a", b"frame-b", b"frame-c"]
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    body = {**_chat({"type": "video_url", "video_url": {"url": url}}), "media_io_kwargs": {"video": {"fps": 2}}}
    status, _, _, seen = asyncio.run(_run(client, _ok, body))
    assert status == 200
    (spec,) = client.placed[0]
    assert spec.kind == "video" and spec.frames == tuple(frames) and spec.fps == 0.0  # every frame kept
    part = seen[0]["messages"][1]["content"][0]
    assert part["type"] == "video_embeds" and part["uuid"] in from_params(seen[0]["ec_transfer_params"])
    # The fake encoder answers grid (1, 4, 4): one temporal patch of frames 0, 1, 2 (padded with 2) at 2 fps.
    assert part["video_embeds"] == {"video_grid_thw": [1, 4, 4], "timestamps": [(0 + 2) / 2 / 2]}


def test_video_timestamps_follow_vllm() -> None:
    from prefill_client.proxy import video_timestamps

    assert video_timestamps(4, 1.0, 2) == [0.5, 2.5]
    assert video_timestamps(3, 1.0, 2) == [0.5, 2.0]  # the last frame repeated
    assert video_timestamps(6, 3.0, 3) == [1 / 6, 5 / 6, 1.5]


def test_video_containers_and_bodies_that_are_not_chat_are_refused() -> None:
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    status, _, answer, _ = asyncio.run(_run(FakeClient(), _ok, _chat(video)))
    assert status == 400 and "videos must be frame sequences" in answer["error"]["message"]
    frames = {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,AAAA"}}
    body = {**_chat(frames), "media_io_kwargs": {"video": {"fps": -1}}}
    status, _, answer, _ = asyncio.run(_run(FakeClient(), _ok, body))
    assert status == 400 and "fps must be a positive number" in answer["error"]["message"]
    status, _, answer, _ = asyncio.run(_run(FakeClient(), _ok, None, raw=b"{not json"))
    assert status == 400 and "not JSON" in answer["error"]["message"]
    status, _, answer, _ = asyncio.run(_run(FakeClient(), _ok, {"model": "m"}))
    assert status == 400 and "'messages' list" in answer["error"]["message"]


def test_no_backend_reachable_is_502_and_the_leases_go_back() -> None:
    client = FakeClient()
    status, _, answer, _ = asyncio.run(_run(client, None, _chat(_image(_data_url()))))
    assert status == 502 and "no backend reachable" in answer["error"]["message"]
    assert len(client.released) == 1


@pytest.mark.parametrize("present, words", [(False, "is no longer on encoder 127.0.0.1:1 (evicted)"),
                                            (True, "still on their encoders")])
def test_a_failed_backend_request_is_explained(present: bool, words: str) -> None:
    async def fails(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "Internal server error"}}, status=500)

    client = FakeClient(conn=FakeConn(present=present))
    status, _, answer, _ = asyncio.run(_run(client, fails, _chat(_image(_data_url()))))
    assert status == 500, answer
    message = answer["error"]["message"]
    assert "failed the request (500: Internal server error)" in message and words in message
    assert client.conn.lookups


def test_streams_are_relayed_as_they_come() -> None:
    async def streams(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    status, headers, chunks, _ = asyncio.run(_run(FakeClient(), streams, _chat(_image(_data_url())), stream=True))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    text = b"".join(chunks).decode()
    assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
