"""The vLLM servers behind the proxy: which one gets a request, and the models they serve (proxy process)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Mapping, Sequence

import aiohttp

from prefill_client.proxy.errors import UNAVAILABLE, HttpError

logger = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 10.0  # deadline of asking a backend for /v1/models
_PASSED_HEADERS = ("authorization", "x-request-id", "accept")


class RoundRobin:
    """The backend choice: every backend, from the next one in turn on (the first that answers serves)."""

    def __init__(self, backends: Sequence[str]) -> None:
        self._backends = tuple(backends)
        self._next = itertools.cycle(range(len(self._backends)))

    def order(self) -> list[str]:
        """Every backend's base URL, from the next one in the round robin on."""
        start, count = next(self._next), len(self._backends)
        return [self._backends[(start + k) % count].rstrip("/") for k in range(count)]


class Backends:
    """The backends (base URLs), the order a request tries them in (``choice``, default
    :class:`RoundRobin`), and the model names their ``/v1/models`` lists (asked once)."""

    def __init__(self, urls: Sequence[str], choice: RoundRobin | None = None) -> None:
        self.urls = tuple(urls)
        self._choice = choice or RoundRobin(self.urls)
        self._served: list[str] | None = None  # the backends' /v1/models, once asked
        self._served_lock = asyncio.Lock()

    def order(self) -> list[str]:
        """The base URLs to try for one request, the first choice first."""
        return self._choice.order()

    async def served_models(self, session: aiohttp.ClientSession, headers: Mapping[str, str]) -> list[str]:
        """The model names the backends' ``/v1/models`` lists (asked once; a failure is not kept)."""
        async with self._served_lock:  # requests that arrive together ask once
            if not self._served:  # an empty list is asked again
                self._served = await self._ask_models(session, headers)
            return self._served

    async def _ask_models(self, session: aiohttp.ClientSession, headers: Mapping[str, str]) -> list[str]:
        errors: list[str] = []
        for base in self.order():
            try:
                async with session.get(base + "/v1/models", headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as resp:
                    text = await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors.append(f"{base}: {exc or type(exc).__name__}")
                continue
            if resp.status in (401, 403):  # the caller's credentials: theirs to fix
                raise HttpError(resp.status, f"'model' is not given and {base}/v1/models answered "
                                             f"{resp.status}: {error_message(text)}", kind="authentication_error")
            names = model_names(text) if resp.status == 200 else None
            if names is None:
                errors.append(f"{base}: /v1/models answered {resp.status}: {error_message(text)}")
                continue
            logger.info("the backends serve %s", ", ".join(names) or "no model")
            return names
        raise HttpError(502, f"'model' is not given and no backend listed its models ({'; '.join(errors)})",
                        kind=UNAVAILABLE)


def passed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The caller's headers a backend gets too (its credentials, its request id)."""
    return {k: v for k, v in headers.items() if k.lower() in _PASSED_HEADERS}


def model_names(text: str) -> list[str] | None:
    """The model names of an OpenAI ``/v1/models`` answer (``{"data": [{"id": NAME}, ...]}``), or None."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list):
        return None
    names = [m.get("id") for m in models if isinstance(m, dict)]
    return [n for n in names if isinstance(n, str) and n] if len(names) == len(models) else None


def error_message(text: str) -> str:
    """The message of a backend's error answer (OpenAI's ``{"error": {"message": ...}}``), else its text, cut."""
    try:
        data = json.loads(text)
    except ValueError:
        return text[:200]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:200]
    return text[:200]
