"""Prefill on one vLLM, decode on another: the proxy's E + P + D flow (proxy process).

With ``--prefill`` and ``--decode``, a chat request whose media were placed and rewritten as
for one backend (:mod:`.app`, :mod:`.rewrite`), or a text completion (``/v1/completions``, to
the same route of each member), goes on in two steps:

1. **Prefill**: to a vLLM of ``--prefill`` (EpdCacheConnector as ``ec_consumer`` and a KV
   connector as ``kv_producer``), with ``max_tokens`` 1 (and ``max_completion_tokens`` 1 when
   given), not streamed, and ``kv_transfer_params: {"do_remote_decode": true}``. Its
   EpdCacheConnector pulls the items; the engine computes the prompt's KV, keeps it for a
   decode and answers ``kv_transfer_params`` saying where it is (NixlConnector: its engine id,
   host, side-channel port, block ids, request id).
2. **Decode**: to a vLLM of ``--decode`` (the KV connector as ``kv_consumer``): the request as
   the client sent it, its media parts as rewritten (placeholder metadata, ``uuid = mm_hash``,
   no tensor: vLLM lets a KV consumer take them and lays out the same prompt tokens from them,
   and it never runs the vision encoder since every prompt token's KV comes from the prefill),
   without ``ec_transfer_params``, with the prefill's ``kv_transfer_params``. Its answer is
   relayed as it comes, streamed when the request streams.

This is the flow of vLLM's own P/D proxies (``toy_proxy_server.py``, ``disagg_epd_proxy.py``).
Each pool is a :class:`~.backends.Backends` under the routing policy (``--routing``). A member
that refuses the connection, or does not accept it within ``--backend-connect-timeout-s``, is
marked down and the request tries the next one: it never reached that member. A member that
fails once it took the request fails that request alone, with one OpenAI-form error: a decode
that died mid-answer may have read the KV already, and the prefill frees the blocks once they
are read, so the same ``kv_transfer_params`` must not go to another decode. The items' leases
are given back when no prefill took the request or the prefill refused it (a second release is
harmless); once a prefill answered, its connector has pulled and released them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from common.config import ProxyConfig
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.handoff import Placement
from prefill_client.proxy.backends import (
    CHAT_PATH,
    Backends,
    error_message,
    no_answer,
    passed_headers,
    relayed_response,
    with_hint,
)
from prefill_client.proxy.errors import SERVER_ERROR, UNAVAILABLE, HttpError
from prefill_client.proxy.routing import affinity_key, make_policy

logger = logging.getLogger(__name__)

# The request never reached the member: the next one may take it. Anything else after the
# connection was made fails the request (see the module docstring).
NOT_REACHED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# Fields of a request that make no sense for a one-token, unstreamed prefill.
_PREFILL_DROPS = ("stream_options", "min_tokens")
PROMPT_LOGPROBS_REFUSED = (
    "prompt_logprobs is not supported by epd proxy with --prefill/--decode: the decode vLLM takes the prompt's KV "
    "from the prefill and computes no prompt token; send the request without prompt_logprobs")
Diagnose = Callable[[EncoderCacheClient, Sequence[Placement]], Awaitable[str]]


def refuse_unsplittable(body: Mapping[str, Any]) -> None:
    """A 400 for what a decode cannot serve from a prefill's KV.

    vLLM reads no cached KV for a request that asks for ``prompt_logprobs`` (a prefix hit would
    leave some prompt tokens without one), the prefill's KV included: the decode would compute
    the whole prompt again, and with media it has no embeddings for, its engine dies (vLLM 0.32:
    "Expected multimodal embeddings ... but got NoneType").
    """
    if body.get("prompt_logprobs") is not None:
        raise HttpError(400, PROMPT_LOGPROBS_REFUSED)


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the prefill vLLM gets: ``body`` for one token, unstreamed, its KV kept for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """What the decode vLLM gets: ``body`` without ``ec_transfer_params`` (it pulls no item: the
    prefill's KV holds them), with the prefill's ``kv_transfer_params``."""
    out = {k: v for k, v in body.items() if k != "ec_transfer_params"}
    out["kv_transfer_params"] = dict(kv_transfer_params)
    return out


def kv_params(text: str) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` object of a prefill's answer (chat or completion), or None."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return params if isinstance(params, dict) and params else None


class Disaggregated:
    """The two pools and the two steps. ``decode``: the decode pool (the proxy's backends, which
    also answer ``/v1/models``); ``session``: the proxy's HTTP client; ``diagnose``: what became
    of a failed request's items, asked of their encoders (the proxy's)."""

    def __init__(self, cfg: ProxyConfig, decode: Backends, session: Callable[[], aiohttp.ClientSession],
                 diagnose: Diagnose) -> None:
        self.cfg = cfg
        self.prefill = Backends(cfg.prefill, make_policy(cfg.routing, cfg.affinity_load_factor),
                                retry_s=cfg.backend_retry_s, refresh_s=cfg.membership_refresh_s)
        self.decode = decode
        self._session = session
        self._diagnose = diagnose

    @property
    def pools(self) -> dict[str, Callable[[], Sequence[str]]]:
        """Each pool's base URLs now, by name (what ``/ready`` checks)."""
        return {"prefill": lambda: self.prefill.urls, "decode": lambda: self.decode.urls}

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.cfg.backend_timeout_s, sock_connect=self.cfg.backend_connect_timeout_s)

    async def serve(self, body: dict[str, Any], request: web.Request, client: EncoderCacheClient | None = None,
                    placements: Sequence[Placement] = (), *, path: str = CHAT_PATH,
                    hint: Sequence[Placement] = ()) -> web.StreamResponse:
        """Prefill ``body`` (rewritten; ``client`` placed its ``placements``), then decode it and relay the
        answer; ``path``: the route both steps go to (a chat, or a text completion); ``hint``: the
        placements to name in the prefill's prefetch header (the decode pulls nothing)."""
        headers = passed_headers(request.headers)
        key = affinity_key(body)
        try:
            refuse_unsplittable(body)
            hinted = with_hint(dict(headers), hint) if hint else headers
            prefilled = await self._prefill(path, body, hinted, key, client, placements)
        except BaseException:
            if client is not None:
                client.release_placed(placements)  # no prefill pulls them now
            raise
        if isinstance(prefilled, web.Response):  # the prefill refused the request: nobody pulls them
            if client is not None:
                client.release_placed(placements)
            return prefilled
        return await self._decode(path, decode_body(body, prefilled), headers, key, request)

    # --- prefill -------------------------------------------------------------------------------

    async def _prefill(self, path: str, body: dict[str, Any], headers: Mapping[str, str], key: str,
                       client: EncoderCacheClient | None,
                       placements: Sequence[Placement]) -> dict[str, Any] | web.Response:
        """The prefill's ``kv_transfer_params``; its answer itself when it refused the request (4xx)."""
        errors: list[str] = []
        for base in self.prefill.order(lambda: key):
            with self.prefill.sending(base):
                resp = await self._send(self.prefill, "prefill", base, path, prefill_body(body), headers, errors)
                if resp is None:
                    continue
                async with resp:
                    try:
                        text = await resp.text()
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                        raise _failed("prefill", base, exc, self.cfg.backend_timeout_s) from exc
            if resp.status >= 500:
                why = await self._diagnose(client, placements) if client is not None and placements else ""
                raise HttpError(resp.status, f"prefill {base} failed the request ({resp.status}: "
                                             f"{error_message(text)})" + (f"; {why}" if why else ""), kind=SERVER_ERROR)
            if resp.status >= 400:  # the caller's request: vLLM's answer as it came
                return web.Response(status=resp.status, text=text, content_type="application/json")
            params = kv_params(text)
            if params is None:
                raise HttpError(502, f"prefill {base} answered without kv_transfer_params: start it with "
                                     f"--kv-transfer-config and kv_role kv_producer (NixlConnector)",
                                kind=UNAVAILABLE)
            return params
        raise HttpError(502, f"no prefill reachable ({'; '.join(errors) or self.prefill.none_known()})",
                        kind=UNAVAILABLE)

    # --- decode --------------------------------------------------------------------------------

    async def _decode(self, path: str, body: dict[str, Any], headers: Mapping[str, str], key: str,
                      request: web.Request) -> web.StreamResponse:
        errors: list[str] = []
        for base in self.decode.order(lambda: key):
            with self.decode.sending(base):  # outstanding until its answer is relayed
                resp = await self._send(self.decode, "decode", base, path, body, headers, errors)
                if resp is None:
                    continue
                async with resp:
                    return await self._relay(base, resp, request)
        raise HttpError(502, f"no decode reachable ({'; '.join(errors) or self.decode.none_known()}); the "
                             "prefill frees the request's KV when its lease ends", kind=UNAVAILABLE)

    async def _relay(self, base: str, resp: aiohttp.ClientResponse, request: web.Request) -> web.StreamResponse:
        """The decode's answer to the caller as it comes; a decode that fails mid-stream ends the
        stream with an OpenAI-form error event (the status went out already)."""
        if resp.status >= 500:
            try:
                text = await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise _failed("decode", base, exc, self.cfg.backend_timeout_s) from exc
            raise HttpError(resp.status, f"decode {base} failed the request ({resp.status}: {error_message(text)})",
                            kind=SERVER_ERROR)
        out = relayed_response(resp)
        await out.prepare(request)
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            error = _failed("decode", base, exc, self.cfg.backend_timeout_s)
            logger.warning("%s", error)
            event = {"error": {"message": str(error), "type": error.kind, "code": error.status}}
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
        await out.write_eof()
        return out

    # --- one call ------------------------------------------------------------------------------

    async def _send(self, pool: Backends, role: str, base: str, path: str, body: dict[str, Any],
                    headers: Mapping[str, str], errors: list[str]) -> aiohttp.ClientResponse | None:
        """POST ``body`` to ``base`` + ``path``: its response (headers read), or None when it was not
        reached (marked down, the reason added to ``errors``)."""
        try:
            resp = await self._session().post(base + path, json=body, headers=headers, timeout=self._timeout())
        except NOT_REACHED as exc:
            why = str(exc) or type(exc).__name__
            errors.append(f"{base}: {why}")
            pool.failed(base, why)
            return None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _failed(role, base, exc, self.cfg.backend_timeout_s) from exc
        pool.answered(base)
        return resp


def _failed(role: str, base: str, exc: BaseException, timeout_s: float) -> HttpError:
    """The caller's answer when ``role``'s ``base`` took the request, then failed it without an answer:
    504 when the request's deadline (``timeout_s``) passed, else 502."""
    if isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, aiohttp.ClientConnectionError):
        return no_answer(role, base, timeout_s)
    why = str(exc) or type(exc).__name__
    return HttpError(502, f"{role} {base} failed the request without an answer ({why})", kind=UNAVAILABLE)
