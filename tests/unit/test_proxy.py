"""``epd proxy`` against a fake encoder client and a fake vLLM backend (real HTTP on 127.0.0.1):
the rewrite, the error mapping, streaming, what it says when the backend fails a request, and
which model id it handshakes with (``--model-id``, else the request's ``model``, else the
backends' ``/v1/models``)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import ProxyConfig
from common.errors import (
    CacheFullError,
    ECLoadFailure,
    EncoderCallError,
    EncoderUnreachable,
    EpdError,
    HandshakeError,
    InvalidMediaError,
    InvalidRequestError,
    LimitExceededError,
    LoadFailureReason,
    WeightsMismatchError,
)
from common.wire import pb2
from prefill_client.consumer.connection import MediaSpec
from prefill_client.handoff import PREFETCH_HEADER, Placement, from_hint, from_params
from prefill_client.proxy.app import Proxy
from prefill_client.proxy.clients import MAX_MODELS
from prefill_client.proxy.media import b64decode

PNG = b"\x89PNG fake bytes"


def _data_url(data: bytes = PNG) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@dataclass
class FakeConn:
    present: bool = True
    processor_is_ours: bool = True  # epd-cache's own tower
    lookups: list[list[str]] = field(default_factory=list)
    error: Exception | None = None  # what lookup raises

    def lookup(self, hashes: Sequence[str]) -> list[pb2.ItemLocation | None]:
        self.lookups.append(list(hashes))
        if self.error is not None:
            raise self.error
        return [pb2.ItemLocation(mm_hash=h, lease_id=5) if self.present else None for h in hashes]

    def release(self, lease_ids: Sequence[int]) -> None:
        pass


@dataclass
class FakeClient:
    error: Exception | None = None
    placed: list[list[MediaSpec]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    conn: FakeConn = field(default_factory=FakeConn)
    model_id: str = "tiny-qwen3-vl"
    closed: bool = False

    def close(self) -> None:
        self.closed = True

    @property
    def targets(self) -> tuple[str, ...]:
        return ("127.0.0.1:1",)

    def place(self, specs: Sequence[MediaSpec]) -> list[Placement]:
        self.placed.append(list(specs))
        if self.error is not None:
            raise self.error
        out: dict[str, Placement] = {}
        for spec in specs:  # as an encoder answers: an item named twice has one location and one lease
            h = hashlib.sha256(spec.frames[0]).hexdigest()[:16]
            loc = pb2.ItemLocation(mm_hash=h, block_ids=[1], tokens_per_block=[4], num_tokens=4,
                                   lease_id=100 + len(out), grid_thw=[1, 4, 4])
            out.setdefault(h, Placement(h, "127.0.0.1:1", "inc", loc))
        return [out[hashlib.sha256(spec.frames[0]).hexdigest()[:16]] for spec in specs]

    def release_placed(self, placements: Sequence[Placement]) -> None:
        self.released += [p.mm_hash for p in placements]

    def connection(self, target: str) -> FakeConn:
        return self.conn


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _run(client: FakeClient, backend: Handler | None, body: Any, *, raw: bytes | None = None,
               cfg: dict[str, Any] | None = None, stream: bool = False,
               path: str = "/v1/chat/completions") -> tuple[int, dict[str, str], Any, list[Any]]:
    """POST ``body`` to ``path`` of a proxy in front of ``backend``; (status, headers, answer, bodies the
    backend got, on either route)."""
    seen: list[Any] = []
    backend_app = web.Application()

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        assert backend is not None
        return await backend(request)

    backend_app.router.add_post("/v1/chat/completions", record)
    backend_app.router.add_post("/v1/completions", record)
    backend_server = TestServer(backend_app, host="127.0.0.1")
    await backend_server.start_server()
    url = str(backend_server.make_url("")).rstrip("/") if backend is not None else "http://127.0.0.1:9"
    proxy = Proxy(ProxyConfig(backends=(url,), **(cfg or {})), client)  # type: ignore[arg-type]
    async with TestClient(TestServer(proxy.app(), host="127.0.0.1")) as http:
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        resp = await http.post(path, **kwargs)
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
    # One Encode for the request's images; the repeated image's one lease is the puller's to give back.
    assert len(client.placed) == 1 and len(client.placed[0]) == 3
    assert client.released == []
    assert sent["messages"][0] == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize("hints", [True, False])
def test_the_placements_go_in_the_prefetch_header_too_unless_turned_off(hints: bool) -> None:
    got: list[str | None] = []

    async def backend(request: web.Request) -> web.StreamResponse:
        got.append(request.headers.get(PREFETCH_HEADER))
        return await _ok(request)

    status, _, _, seen = asyncio.run(_run(FakeClient(), backend, _chat(_image(_data_url()), _image(_data_url(b"x"))),
                                          cfg={"prefetch_hints": hints}))
    assert status == 200
    (header,) = got
    if hints:
        assert header is not None and from_hint(header.encode()) == from_params(seen[0]["ec_transfer_params"])
    else:
        assert header is None
    got.clear()
    status, _, _, _ = asyncio.run(_run(FakeClient(), backend, _chat()))  # nothing placed: no hint
    assert status == 200 and got == [None]


def test_an_earlier_turns_images_get_no_prefetch_hint() -> None:
    got: list[str | None] = []

    async def backend(request: web.Request) -> web.StreamResponse:
        got.append(request.headers.get(PREFETCH_HEADER))
        return await _ok(request)

    first, second = _data_url(b"first turn's image"), _data_url(b"second turn's image")
    turn = {"role": "user", "content": [_image(first), {"type": "text", "text": "what is it?"}]}
    answer = {"role": "assistant", "content": "a cat"}
    again = {"model": "m", "messages": [turn, answer, {"role": "user", "content": "and its colour?"}]}
    status, _, _, seen = asyncio.run(_run(FakeClient(), backend, again))
    assert status == 200 and got == [None] and from_params(seen[0]["ec_transfer_params"])  # placed, not hinted
    got.clear()
    new = {"model": "m", "messages": [turn, answer, {"role": "user", "content": [_image(second), _image(first)]}]}
    status, _, _, seen = asyncio.run(_run(FakeClient(), backend, new))
    parts = seen[0]["messages"][2]["content"]
    assert status == 200 and got[0] is not None
    # This turn's two images (the first one again, too), not the earlier turn's own part.
    assert set(from_hint(got[0].encode())) == {parts[0]["uuid"], parts[1]["uuid"]}
    assert len(from_params(seen[0]["ec_transfer_params"])) == 2


@pytest.mark.parametrize("error, status, words", [
    (InvalidMediaError("messages[1].content[0]", "cannot identify image file"), 400, "messages[1].content[0]"),
    (CacheFullError("every block is leased", 1500), 429, "every block is leased"),
    (ECLoadFailure(LoadFailureReason.HANDSHAKE, "h", detail="no encoder reachable (a: down)"), 503,
     "no encoder reachable"),
    (HandshakeError("model_id mismatch: this encoder serves 'my-vlm', request names 'tiny-qwen3-vl'"), 502,
     "refused the handshake for model 'tiny-qwen3-vl' (from --model-id): model_id mismatch: this encoder serves "
     "'my-vlm', request names 'tiny-qwen3-vl' (epd proxy's --model-id must be the encoders')"),
    (LimitExceededError("request has 40 items; at most 32"), 400, "request has 40 items; at most 32"),
    (InvalidRequestError("item 0: cache_salt is 300 characters; at most 256"), 400,
     "the encoders refused the request: item 0: cache_salt is 300 characters; at most 256"),
    (ECLoadFailure(LoadFailureReason.TIMEOUT, "h", detail="Encode on a:1: Deadline Exceeded"), 504,
     "encoding timed out: EC load failure (timeout) for mm_hash h"),
    (WeightsMismatchError("a:1", "d1", "d2"), 502,
     "encoding failed: encoder a:1 serves vision weights d2, this consumer expects d1"),
    (EncoderUnreachable(grpc.StatusCode.UNAVAILABLE, "connection refused"), 503,
     "encoder error: UNAVAILABLE: connection refused"),
    (EncoderCallError(grpc.StatusCode.INTERNAL, "boom"), 503, "encoder error: INTERNAL: boom"),
    (EpdError("something else"), 502, "encoding failed: EpdError: something else"),
])
def test_encoder_errors_map_to_http(error: Exception, status: int, words: str) -> None:
    got, headers, answer, seen = asyncio.run(_run(FakeClient(error=error), _ok, _chat(_image(_data_url()))))
    assert got == status and words in answer["error"]["message"], answer
    assert not seen
    if status == 429:
        assert headers["Retry-After"] == "2"


def test_an_encoders_invalid_media_message_names_the_item_once() -> None:
    # The encoder's message for the item carries its label already, and the client labels it again.
    label = "item 0 (messages[1].content[0])"
    error = InvalidMediaError(label, f"invalid media item {label}: not a decodable image")
    status, _, answer, _ = asyncio.run(_run(FakeClient(error=error), _ok, _chat(_image(_data_url()))))
    assert status == 400 and answer["error"]["message"] == f"invalid media item {label}: not a decodable image"


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


@given(st.one_of(st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()),
                 st.text(alphabet="ABCab+/=-_ \n%é", max_size=16)))
@settings(max_examples=400, deadline=None)
def test_media_base64_accepts_and_refuses_what_the_standard_decoder_does(text: str) -> None:
    try:
        expected: bytes | str = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        expected = str(exc)
    try:
        got: bytes | str = b64decode(text)
    except (binascii.Error, ValueError) as exc:
        got = str(exc)  # the standard decoder's own words (what is wrong), not the fast one's
    assert got == expected


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
    from prefill_client.proxy.rewrite import video_timestamps

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


def test_a_failed_backend_request_names_an_unreachable_encoder() -> None:
    async def fails(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "Internal server error"}}, status=500)

    client = FakeClient(conn=FakeConn(error=EncoderUnreachable(grpc.StatusCode.UNAVAILABLE, "connection refused")))
    status, _, answer, _ = asyncio.run(_run(client, fails, _chat(_image(_data_url()))))
    assert status == 500 and "encoder 127.0.0.1:1 is unreachable (UNAVAILABLE)" in answer["error"]["message"], answer


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


# --- which model id the proxy handshakes with ------------------------------------------------------


@dataclass
class FakeEncoders:
    """Makes the proxy's client of a model id; its encoders serve ``serves`` (None: any id), and
    refuse another in the handshake as ``epd encoder`` does."""

    serves: str | None = "served-model"
    made: list[FakeClient] = field(default_factory=list)

    def __call__(self, model_id: str) -> FakeClient:
        refused = self.serves is not None and model_id != self.serves
        error = HandshakeError(f"model_id mismatch: this encoder serves {self.serves!r}, request names "
                               f"{model_id!r}") if refused else None
        client = FakeClient(error=error, model_id=model_id)
        self.made.append(client)
        return client


@dataclass
class FakeBackend:
    """A vLLM server: answers chats, and ``/v1/models`` with ``models`` (status ``models_status``)."""

    models: Any = None
    models_status: int = 200
    chats: list[Any] = field(default_factory=list)
    model_asks: int = 0


def _served(*names: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": n, "object": "model", "root": "/ckpt"} for n in names]}


@contextlib.asynccontextmanager
async def _proxy(backend: FakeBackend, make_client: Callable[[str], Any] | None = None,
                 cfg: dict[str, Any] | None = None) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    """A proxy without a fixed client (no ``--model-id`` unless ``cfg`` has it) in front of ``backend``."""
    app = web.Application()

    async def chat(request: web.Request) -> web.StreamResponse:
        backend.chats.append(await request.json())
        return await _ok(request)

    async def models(request: web.Request) -> web.Response:
        backend.model_asks += 1
        return web.json_response(backend.models, status=backend.models_status)

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    proxy = Proxy(ProxyConfig(backends=(url,), **(cfg or {})), make_client=make_client)
    try:
        async with TestClient(TestServer(proxy.app(), host="127.0.0.1")) as http:
            yield http
    finally:
        await server.close()


async def _post(http: TestClient[web.Request, web.Application], body: dict[str, Any]) -> tuple[int, Any]:
    resp = await http.post("/v1/chat/completions", json=body)
    return resp.status, await resp.json()


def _with_model(model: Any, *parts: dict[str, Any]) -> dict[str, Any]:
    body = _chat(*(parts or (_image(_data_url()),)))
    if model is None:
        del body["model"]
    else:
        body["model"] = model
    return body


def test_without_model_id_the_requests_model_is_the_handshakes() -> None:
    encoders, backend = FakeEncoders(), FakeBackend(models=_served("served-model"))

    async def go() -> tuple[list[tuple[int, Any]], Any]:
        async with _proxy(backend, encoders) as http:
            answers = [await _post(http, _with_model("served-model")) for _ in range(2)]
            return answers, await (await http.get("/health")).json()

    answers, health = asyncio.run(go())
    assert [status for status, _ in answers] == [200, 200], answers
    (client,) = encoders.made  # one client for the model, made on its first request
    assert client.model_id == "served-model" and len(client.placed) == 2
    assert health["models"] == ["served-model"] and health["encoders"] == ["127.0.0.1:1"]
    assert backend.model_asks == 0  # the request named its model
    assert [b["model"] for b in backend.chats] == ["served-model"] * 2
    assert backend.chats[0]["messages"][1]["content"][0]["type"] == "image_embeds"
    assert client.closed  # with the proxy


def test_without_a_model_the_backends_one_model_is_used() -> None:
    encoders, backend = FakeEncoders(), FakeBackend(models=_served("served-model"))

    async def go() -> list[tuple[int, Any]]:
        async with _proxy(backend, encoders) as http:
            return list(await asyncio.gather(*(_post(http, _with_model(None)) for _ in range(3))))

    answers = asyncio.run(go())
    assert [status for status, _ in answers] == [200] * 3, answers
    assert backend.model_asks == 1  # asked once, for requests that came together
    assert [c.model_id for c in encoders.made] == ["served-model"]
    assert all("model" not in b for b in backend.chats) and len(backend.chats) == 3  # the body is left as it is


@pytest.mark.parametrize("models, models_status, status, words", [
    (_served("a", "b"), 200, 400, "'model' is required: the backends serve 2 models ('a', 'b')"),
    (_served(), 200, 400, "'model' is required: the backends' /v1/models lists no model"),
    ({"error": {"message": "Not Found"}}, 404, 502, "/v1/models answered 404: Not Found"),
    ({"error": {"message": "bad key"}}, 401, 401, "/v1/models answered 401: bad key"),
])
def test_without_a_model_the_backends_must_serve_one(models: Any, models_status: int, status: int,
                                                     words: str) -> None:
    encoders, backend = FakeEncoders(), FakeBackend(models=models, models_status=models_status)

    async def go() -> tuple[int, Any]:
        async with _proxy(backend, encoders) as http:
            return await _post(http, _with_model(None))

    got, answer = asyncio.run(go())
    assert got == status and words in answer["error"]["message"], answer
    assert not encoders.made and not backend.chats


def test_a_text_only_request_needs_no_model_id() -> None:
    encoders, backend = FakeEncoders(), FakeBackend(models=_served("a", "b"))

    async def go() -> tuple[int, Any]:
        async with _proxy(backend, encoders) as http:
            return await _post(http, _with_model(None, {"type": "text", "text": "hello"}))

    status, _ = asyncio.run(go())
    assert status == 200 and len(backend.chats) == 1
    assert not encoders.made and backend.model_asks == 0


@pytest.mark.parametrize("model, words", [
    (7, "model must be a non-empty string, got 7"),
    ("", "model must be a non-empty string, got ''"),
    ("  ", "model must be a non-empty string"),
    (["served-model"], "model must be a non-empty string, got ['served-model']"),
    ("m" * 257, "model is 257 characters; at most 256"),
])
def test_bad_model_values_are_400(model: Any, words: str) -> None:
    encoders, backend = FakeEncoders(), FakeBackend(models=_served("served-model"))

    async def go() -> tuple[int, Any]:
        async with _proxy(backend, encoders) as http:
            return await _post(http, _with_model(model))

    status, answer = asyncio.run(go())
    assert status == 400 and words in answer["error"]["message"], answer
    assert not encoders.made and not backend.chats and backend.model_asks == 0


def test_a_model_the_encoders_do_not_serve_is_an_error_naming_both_ids() -> None:
    encoders, backend = FakeEncoders(serves="served-model"), FakeBackend(models=_served("served-model"))

    async def go() -> list[tuple[int, Any]]:
        async with _proxy(backend, encoders) as http:
            return [await _post(http, _with_model(m)) for m in ("other-model", "other-model", "served-model")]

    (s1, a1), (s2, _), (s3, _) = asyncio.run(go())
    message = a1["error"]["message"]
    assert s1 == 502 and s2 == 502, a1
    assert "refused the handshake for model 'other-model' (from the request's model)" in message
    assert "this encoder serves 'served-model', request names 'other-model'" in message
    assert message.endswith("(the encoders' --model-id must be the name vLLM serves the model under, or start "
                            "epd proxy with --model-id set to the encoders')")
    # A refused client is dropped, closed, and keeps no place: each request made its own.
    assert [(c.model_id, c.closed) for c in encoders.made] == [
        ("other-model", True), ("other-model", True), ("served-model", True)]
    assert s3 == 200 and len(backend.chats) == 1


def test_clients_are_bounded() -> None:
    encoders, backend = FakeEncoders(serves=None), FakeBackend()
    names = [f"model-{i}" for i in range(MAX_MODELS)]

    async def go() -> list[tuple[int, Any]]:
        async with _proxy(backend, encoders) as http:
            return [await _post(http, _with_model(m)) for m in [*names, "one-too-many", names[0]]]

    answers = asyncio.run(go())
    assert [s for s, _ in answers] == [200] * MAX_MODELS + [400, 200], answers
    message = answers[MAX_MODELS][1]["error"]["message"]
    assert message.startswith("model 'one-too-many': ") and f"encoder clients for {MAX_MODELS} models" in message
    assert [c.model_id for c in encoders.made] == names and all(c.closed for c in encoders.made)


def test_with_model_id_the_requests_model_is_not_the_handshakes() -> None:
    encoders, backend = FakeEncoders(serves="fixed-id"), FakeBackend()

    async def go() -> list[tuple[int, Any]]:
        async with _proxy(backend, encoders, cfg={"model_id": "fixed-id"}) as http:
            return [await _post(http, _with_model(m)) for m in ("whatever", None, 7)]

    assert [s for s, _ in asyncio.run(go())] == [200, 200, 200]
    assert [c.model_id for c in encoders.made] == ["fixed-id"] and backend.model_asks == 0


def test_the_cache_salt_goes_with_every_item_and_on_to_the_backend_unchanged() -> None:
    client = FakeClient()
    frames = {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,AAAA,AAAA"}}
    body = {**_chat(_image(_data_url()), frames), "cache_salt": "tenant-a"}
    status, _, _, seen = asyncio.run(_run(client, _ok, body))
    assert status == 200 and seen[0]["cache_salt"] == "tenant-a"
    assert [s.cache_salt for s in client.placed[0]] == ["tenant-a", "tenant-a"]
    # Absent or null: no salt, and the body goes on as it came.
    for extra in ({}, {"cache_salt": None}):
        client = FakeClient()
        status, _, _, seen = asyncio.run(_run(client, _ok, {**_chat(_image(_data_url())), **extra}))
        assert status == 200 and [s.cache_salt for s in client.placed[0]] == [""]
        assert seen[0].get("cache_salt", "absent") == extra.get("cache_salt", "absent")


@pytest.mark.parametrize("raw, words", [
    (b'7', "cache_salt must be a non-empty string, got 7"),
    (b'""', "cache_salt must be a non-empty string, got ''"),
    (b'["a"]', "cache_salt must be a non-empty string"),
    (b'"' + b"s" * 257 + b'"', "cache_salt is 257 characters; at most 256"),
    (b'"\\ud800"', "cache_salt is not valid Unicode text"),
])
def test_bad_cache_salts_are_400_before_anything_is_encoded(raw: bytes, words: str) -> None:
    client = FakeClient()
    body = json.dumps(_chat(_image(_data_url())))[:-1].encode() + b', "cache_salt": ' + raw + b"}"
    status, _, answer, seen = asyncio.run(_run(client, _ok, None, raw=body))
    assert status == 400 and words in answer["error"]["message"], answer
    assert not client.placed and not seen


def test_a_request_without_media_goes_on_as_the_caller_wrote_it() -> None:
    # Its bytes, not a second serialisation: key order, spacing and non-ASCII text as sent.
    raw = '{"messages": [{"role": "user", "content": "héllo  \\u00e9"}],   "model":"m", "max_tokens": 2}'.encode()
    got: list[tuple[bytes, str]] = []

    async def backend(request: web.Request) -> web.Response:
        got.append((await request.read(), request.headers["Content-Type"]))
        return await _ok(request)

    status, _, _, seen = asyncio.run(_run(FakeClient(), backend, None, raw=raw))
    assert status == 200 and got == [(raw, "application/json")]
    assert seen[0]["messages"][0]["content"] == "héllo  é"


def test_text_completions_go_on_as_the_caller_wrote_them() -> None:
    raw = '{"prompt": "Once upon  a time \u00e9",   "model":"m", "max_tokens": 2}'.encode()
    got: list[tuple[str, bytes]] = []

    async def backend(request: web.Request) -> web.Response:
        got.append((request.path, await request.read()))
        return web.json_response({"choices": [{"text": " there", "index": 0}]})

    client = FakeClient()
    status, _, answer, _ = asyncio.run(_run(client, backend, None, raw=raw, path="/v1/completions"))
    assert status == 200 and answer["choices"][0]["text"] == " there"
    assert got == [("/v1/completions", raw)] and not client.placed


def sse_backend(*events: dict[str, Any]) -> Handler:
    """A backend that streams ``events`` as server-sent events, then ``data: [DONE]``."""
    async def stream(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for event in events:
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    return stream


def test_text_completion_streams_are_relayed_as_they_come() -> None:
    backend = sse_backend(*({"choices": [{"text": text}]} for text in ("a", "b")))
    status, headers, chunks, _ = asyncio.run(_run(FakeClient(), backend, {"prompt": "x", "stream": True},
                                                  path="/v1/completions", stream=True))
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert b"".join(chunks).endswith(b"data: [DONE]\n\n") and b'"text": "b"' in b"".join(chunks)


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "x"', "request body is not JSON"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "with a 'prompt'"),
    (b'["x"]', "with a 'prompt'"),
])
def test_bad_text_completions_are_400_and_reach_no_backend(raw: bytes, words: str) -> None:
    status, _, answer, seen = asyncio.run(_run(FakeClient(), _ok, None, raw=raw, path="/v1/completions"))
    assert status == 400 and words in answer["error"]["message"], answer
    assert not seen
