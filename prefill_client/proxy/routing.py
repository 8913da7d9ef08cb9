"""Which backend gets a request: the routing policies and the affinity key (proxy process).

A policy orders the backends that take requests now (:class:`~.backends.Backends` leaves out
the ones marked down), first choice first; the request tries them in that order. Its inputs
are plain values (the backends, each one's outstanding requests in this proxy process, the
request's key), so a policy is tested without HTTP. Outstanding counts are per process: a
proxy keeps no shared state, and each of several proxy processes balances its own requests.

- :class:`RoundRobin`: every backend in turn.
- :class:`LeastOutstanding`: the backend with the fewest requests in flight (ties in turn).
- :class:`BoundedAffinity` (the default): consistent hashing with bounded loads. A request's
  key (:func:`affinity_key`: the conversation's leading messages, which vLLM's prefix cache
  keys on and every later turn sends again; a completion's start) ranks the backends by
  rendezvous hashing; the request goes to the first backend in that rank whose outstanding
  requests, this one included, stay within ``ceil(c x (all outstanding + 1) / backends)``. So a
  conversation, or a repeated image with the same text, keeps its backend and that backend's
  prefix cache while it is not overloaded, and a hot key spills over to the next backends of
  its own rank rather than piling onto one. Rendezvous hashing stands for the hash ring here:
  as on a ring, a backend that comes or goes moves only its share of keys, and a key that
  spills goes to a backend of its own random order instead of always to a ring neighbour. A
  request without a key goes to the least loaded backend.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from common.config.choices import RoutingPolicy
from common.errors import ConfigError
from prefill_client.consumer.routing import rendezvous_order

# How much of a completion's prompt its key reads (about 256 tokens: 16 of vLLM's KV blocks on a GPU,
# two of the CPU build's). Prompts that share this much of their start (a preamble, earlier turns)
# are one key.
PROMPT_KEY_CHARS = 1024
PROMPT_KEY_TOKENS = 256


class Policy(Protocol):
    """Orders backends for one request."""

    def order(self, backends: Sequence[str], outstanding: Mapping[str, int], key: Callable[[], str]) -> list[str]:
        """Every one of ``backends``, the first choice first. ``outstanding``: each one's requests in
        flight; ``key``: the request's affinity key ("" for none), computed only by a policy that uses it."""
        ...


class RoundRobin:
    """Every backend in turn, the next one first."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def order(self, backends: Sequence[str], outstanding: Mapping[str, int], key: Callable[[], str]) -> list[str]:
        if not backends:
            return []
        start = next(self._turn) % len(backends)
        return [*backends[start:], *backends[:start]]


class LeastOutstanding:
    """The backends by their outstanding requests, fewest first; equal ones in turn (so an idle
    set of backends still shares sequential requests)."""

    def __init__(self) -> None:
        self._turns = RoundRobin()

    def order(self, backends: Sequence[str], outstanding: Mapping[str, int], key: Callable[[], str]) -> list[str]:
        return sorted(self._turns.order(backends, outstanding, key), key=lambda b: outstanding.get(b, 0))


class BoundedAffinity:
    """Consistent hashing with bounded loads over rendezvous hashing; ``load_factor`` is c (>= 1)."""

    def __init__(self, load_factor: float) -> None:
        if not load_factor >= 1.0:  # below 1 no backend may be under the bound
            raise ConfigError(f"affinity load factor must be >= 1, got {load_factor}")
        self.load_factor = load_factor
        self._keyless = LeastOutstanding()

    def order(self, backends: Sequence[str], outstanding: Mapping[str, int], key: Callable[[], str]) -> list[str]:
        if len(backends) <= 1:
            return list(backends)
        digest = key()
        if not digest:
            return self._keyless.order(backends, outstanding, key)
        ranked = rendezvous_order(digest, backends)
        bound = load_bound(self.load_factor, sum(outstanding.get(b, 0) for b in backends), len(backends))
        # One always qualifies: the least loaded has at most floor(m / n) and c >= 1.
        first = next(b for b in ranked if outstanding.get(b, 0) + 1 <= bound)
        return [first, *(b for b in ranked if b != first)]


def load_bound(load_factor: float, outstanding: int, backends: int) -> int:
    """The most requests one backend may have in flight once the next one is placed:
    ``ceil(c x average)``, the average taken with the next request counted."""
    return math.ceil(load_factor * (outstanding + 1) / backends)


def make_policy(kind: RoutingPolicy, load_factor: float) -> Policy:
    if kind is RoutingPolicy.ROUND_ROBIN:
        return RoundRobin()
    if kind is RoutingPolicy.LEAST_OUTSTANDING:
        return LeastOutstanding()
    return BoundedAffinity(load_factor)


def affinity_key(body: Mapping[str, Any] | None) -> str:
    """A digest of what vLLM's prefix cache sees first of a request, or "" when it has no messages
    (a chat) and no prompt (a text completion).

    A chat: its leading messages up to and including the first user message (the system
    prompt, the opening question), with ``model`` and ``cache_salt``: every later turn of the
    conversation sends them again, so each turn gets the same key. Text counts as itself; a
    media part by its ``uuid`` (the ``mm_hash`` the proxy writes there after placing it, the
    identity vLLM's prefix cache uses), any other part by its whole content. A completion: the
    start of its prompt (of the first one of a list), :data:`PROMPT_KEY_CHARS` characters or
    :data:`PROMPT_KEY_TOKENS` token ids, with ``model`` and ``cache_salt``: a prompt that grows
    turn by turn, or shares a long preamble, keeps its backend.
    """
    if body is None:
        return ""
    if isinstance(body.get("messages"), list) and body["messages"]:
        lead: list[Any] = []
        for message in body["messages"]:
            lead.append(_message_key(message))
            if isinstance(message, dict) and message.get("role") == "user":
                break
    else:
        lead = _prompt_key(body.get("prompt"))
        if not lead:
            return ""
    text = json.dumps([body.get("model"), body.get("cache_salt"), lead], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _prompt_key(prompt: Any) -> list[Any]:
    """The start of a completion's prompt: a string, token ids, or a list of either (its first)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return ["text", prompt[:PROMPT_KEY_CHARS]]
    if isinstance(prompt, list) and prompt:
        return ["tokens", prompt[:PROMPT_KEY_TOKENS]]
    return []


def _message_key(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, list):
        content = [_part_key(part) for part in content]
    return [message.get("role"), content]


def _part_key(part: Any) -> Any:
    if isinstance(part, dict):
        if part.get("uuid"):  # a media part: its identity, not its (possibly inline) bytes
            return ["uuid", part["uuid"]]
        if part.get("type") == "text":
            return part.get("text")
    return part
