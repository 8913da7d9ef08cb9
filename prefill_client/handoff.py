"""What crosses a process boundary about placed items: ``Placement`` and ``ec_transfer_params`` (proxy, connector).

The proxy encodes each media item on its encoder and hands the leased location on in the
request's ``ec_transfer_params``; the vLLM connector reads it there.

The connector pulls each item without another RPC::

    {"epd_cache": {"items": {MM_HASH: {"encoder": "HOST:PORT", "incarnation": ID, "owner": CONSUMER_ID,
                                      "weights_digest": DIGEST, "location": BASE64}}}}

``location`` is the encoder's ``ItemLocation`` in protobuf wire format; ``owner`` the consumer
id the lease was granted to (the proxy's): the connector gives the lease back in its name once
the rows are in. Nothing here is
trusted: the pull checks every block's tag and generation after the data (a forged or stale
location fails the request with ``ECLoadFailure``), and an item without an entry is looked up
by its ``mm_hash`` instead.

The connector's side channel (its scheduler and its workers, :mod:`prefill_client.vllm.channel`)
speaks the typed messages at the end of this module (:class:`Op`, :func:`encode_message`,
:func:`decode_message`); a pull order carries its items as the same entries.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias, TypeVar

from google.protobuf.message import DecodeError

from common.errors import ConfigError, LoadFailureReason
from common.placeholder import PlaceholderField
from common.placeholder import from_proto as placeholder_from_proto
from common.wire import pb2

KEY = "epd_cache"


@dataclass(frozen=True, slots=True)
class Placement:
    """An item encoded (or found) on an encoder and leased there, not pulled yet.

    What a front end (``epd proxy``) hands to the process that will pull it (the vLLM
    connector): the encoder, the incarnation the location belongs to, and the location.
    Nothing in it needs trusting: the pull verifies tag and generation after the data, so a
    stale or forged placement is an ``ECLoadFailure``, never wrong rows.
    """

    mm_hash: str
    encoder: str
    incarnation_id: str
    location: pb2.ItemLocation
    weights_digest: str = ""
    owner: str = ""  # the consumer id the lease was granted to (the one that placed the item)

    @property
    def grid_thw(self) -> tuple[int, ...]:
        return tuple(self.location.grid_thw)

    @property
    def placeholder(self) -> tuple[PlaceholderField, ...]:
        """The fields that size the item's placeholders in the engine (see :mod:`common.placeholder`)."""
        return placeholder_from_proto(self.location.placeholder)

    @property
    def num_tokens(self) -> int:
        return int(self.location.num_tokens)


def placement_entry(p: Placement) -> dict[str, str]:
    """One placed item as JSON, keyed by its mm_hash wherever it travels: in ``ec_transfer_params``
    (:func:`to_params`) and in the connector's pull orders (:class:`PullOrder`)."""
    return {"encoder": p.encoder, "incarnation": p.incarnation_id, "weights_digest": p.weights_digest,
            "owner": p.owner, "location": base64.b64encode(p.location.SerializeToString()).decode("ascii")}


def placement_from_entry(mm_hash: str, entry: object, where: str = "ec_transfer_params") -> Placement:
    """The placement a JSON entry (:func:`placement_entry`) describes.

    Raises ConfigError naming ``where`` and the entry when it is malformed.
    """
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} item {mm_hash!r} must be an object")
    try:
        location = pb2.ItemLocation.FromString(base64.b64decode(str(entry["location"]), validate=True))
        encoder, incarnation = str(entry["encoder"]), str(entry["incarnation"])
    except KeyError as exc:
        raise ConfigError(f"{where} item {mm_hash!r} lacks {exc.args[0]!r}") from exc
    except (binascii.Error, DecodeError, ValueError) as exc:
        raise ConfigError(f"{where} item {mm_hash!r}: bad location ({exc})") from exc
    if location.mm_hash != mm_hash:
        raise ConfigError(f"{where} item {mm_hash!r} carries the location of {location.mm_hash!r}")
    return Placement(mm_hash, encoder, incarnation, location, str(entry.get("weights_digest", "")),
                     str(entry.get("owner", "")))


def to_params(placements: Sequence[Placement]) -> dict[str, Any]:
    """The ``ec_transfer_params`` for a request whose items were placed."""
    return {KEY: {"items": {p.mm_hash: placement_entry(p) for p in placements}}}


def from_params(params: Mapping[str, Any] | None) -> dict[str, Placement]:
    """Placements by mm_hash from a request's ``ec_transfer_params`` (empty when it has none).

    Raises ConfigError naming the entry when one is malformed.
    """
    if not params or KEY not in params:
        return {}
    section = params[KEY]
    items = section.get("items") if isinstance(section, Mapping) else None
    if not isinstance(items, Mapping):
        raise ConfigError(f"ec_transfer_params.{KEY}.items must be an object, got {type(items).__name__}")
    return {mm_hash: placement_from_entry(str(mm_hash), entry) for mm_hash, entry in items.items()}


def with_placements(params: Mapping[str, Any] | None, placements: Sequence[Placement]) -> dict[str, Any]:
    """A copy of a request's ``ec_transfer_params`` whose ``epd_cache`` section holds ``placements`` (others kept)."""
    out = dict(params or {})
    out[KEY] = to_params(placements)[KEY]
    return out


# --- Prefetch hints: the same entries in a header, read by vLLM's API server -----------------
# The proxy repeats a request's placements in ``X-Epd-Prefetch`` so that the engine's workers can
# start pulling while vLLM's API server still renders the request (:mod:`prefill_client.vllm.prefetch`).
# A hint only starts a pull earlier: the engine still pulls what its scheduler orders, checked the
# same way, and a hint that is lost, late, stale or forged costs at most a pull that fails.

PREFETCH_HEADER = "X-Epd-Prefetch"
# Past this a request's hint is not sent (the request itself is unchanged): vLLM's HTTP server
# refuses a request whose header block exceeds 16 KiB, and each item takes 300-400 bytes.
MAX_HINT_BYTES = 8192


def prefetch_hint(placements: Sequence[Placement]) -> str | None:
    """The ``X-Epd-Prefetch`` value for ``placements`` (their ``epd_cache`` section, compact
    JSON), or None when there are none or it would exceed :data:`MAX_HINT_BYTES`."""
    if not placements:
        return None
    value = json.dumps(to_params(placements)[KEY], separators=(",", ":"))
    return value if len(value) <= MAX_HINT_BYTES else None


def from_hint(data: bytes) -> dict[str, Placement]:
    """The placements a prefetch hint (:func:`prefetch_hint`) names, by mm_hash.

    Raises ConfigError naming what is malformed.
    """
    if len(data) > MAX_HINT_BYTES:
        raise ConfigError(f"prefetch hint of {len(data)} bytes, more than {MAX_HINT_BYTES}")
    try:
        section = json.loads(data)
    except ValueError as exc:
        raise ConfigError(f"prefetch hint is not JSON: {exc}") from exc
    return from_params({KEY: section})


# --- The vLLM connector's side channel: typed messages ----------------------------------------
# Orders go from vLLM's scheduler to every tensor-parallel worker, reports come back; one compact
# JSON object a message, its ``op`` first. Both ends are processes of one engine (one release), so
# there is no version field; what does not decode is a ConfigError naming what is malformed.


class Op(str, enum.Enum):
    """What a side-channel message is."""

    HELLO = "hello"  # worker -> scheduler, first and once: this rank joined
    PULL = "pull"  # scheduler -> workers: pull these placed items, verified, and keep the rows
    CANCEL = "cancel"  # scheduler -> workers: drop what you landed (or will land) of this job
    DONE = "done"  # worker -> scheduler: this rank holds the job's rows, verified
    FAILED = "failed"  # worker -> scheduler: this rank's pull failed, and why


@dataclass(frozen=True, slots=True)
class Hello:
    """A worker's rank, joining the channel (the channel sends and takes it itself)."""

    rank: int
    op: ClassVar[Op] = Op.HELLO


@dataclass(frozen=True, slots=True)
class PullOrder:
    """Pull ``placements`` (every item of ``job``) and check each item's rows against ``expect``
    (identifier -> the rows the prompt has for it)."""

    job: str
    placements: tuple[Placement, ...]
    expect: Mapping[str, int]
    op: ClassVar[Op] = Op.PULL


@dataclass(frozen=True, slots=True)
class Cancel:
    """Nobody waits for ``job`` any more: throw its rows away, now or when its pull ends."""

    job: str
    op: ClassVar[Op] = Op.CANCEL


@dataclass(frozen=True, slots=True)
class PullDone:
    """``rank`` holds the rows of ``ok`` (the job's identifiers); ``pulled`` items and ``nbytes``
    bytes of them came over the wire (the rest from the client's local cache), ``prefetched`` of
    those by a prefetch hint's pull; the order took ``seconds``."""

    job: str
    rank: int
    ok: tuple[str, ...]
    pulled: int
    nbytes: int
    seconds: float
    prefetched: int = 0  # of ``pulled``, items a prefetch hint's pull had brought before the order came
    op: ClassVar[Op] = Op.DONE


@dataclass(frozen=True, slots=True)
class PullFailed:
    """``rank``'s pull of ``job`` failed: the load-failure ``reason`` and what happened."""

    job: str
    rank: int
    reason: LoadFailureReason
    why: str
    op: ClassVar[Op] = Op.FAILED


Order: TypeAlias = PullOrder | Cancel
Report: TypeAlias = PullDone | PullFailed
Message: TypeAlias = Hello | PullOrder | Cancel | PullDone | PullFailed


def encode_message(msg: Message) -> bytes:
    """``msg`` as the bytes the side channel carries."""
    body: dict[str, Any]
    if isinstance(msg, PullOrder):
        body = {"job": msg.job, "items": {p.mm_hash: placement_entry(p) for p in msg.placements},
                "expect": dict(msg.expect)}
    else:
        body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    return json.dumps({"op": msg.op.value, **body}, separators=(",", ":")).encode()


def decode_message(data: bytes) -> Message:
    """The message ``data`` carries (:func:`encode_message`).

    Raises ConfigError naming what is malformed: not JSON, no known ``op``, a field missing or of
    the wrong type, a pull order's item entry.
    """
    try:
        obj = json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        raise ConfigError(f"side-channel message is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"side-channel message must be an object, got {type(obj).__name__}")
    try:
        op = Op(obj.get("op"))
    except ValueError:
        raise ConfigError(f"side-channel message of unknown op {_brief(obj.get('op'))}") from None
    return _DECODERS[op](obj)


_T = TypeVar("_T")


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _field(obj: Mapping[str, Any], name: str, kind: type[_T]) -> _T:
    """``obj[name]``, of type ``kind`` (an int where a float is due becomes one; a bool is no int)."""
    value = obj.get(name)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"side-channel {obj.get('op')} message: {name!r} must be {kind.__name__}, "
                          f"got {_brief(value)}")
    return value


def _pull_order(obj: Mapping[str, Any]) -> PullOrder:
    items = _field(obj, "items", dict)
    expect = _field(obj, "expect", dict)
    for identifier, rows in expect.items():
        if not isinstance(rows, int) or isinstance(rows, bool):
            raise ConfigError(f"side-channel pull message: expect[{identifier!r}] must be int, got {_brief(rows)}")
    placements = tuple(placement_from_entry(h, e, "side-channel pull order") for h, e in items.items())
    return PullOrder(_field(obj, "job", str), placements, expect)


def _pull_done(obj: Mapping[str, Any]) -> PullDone:
    ok = _field(obj, "ok", list)
    if not all(isinstance(identifier, str) for identifier in ok):
        raise ConfigError(f"side-channel done message: 'ok' must be a list of identifiers, got {_brief(ok)}")
    return PullDone(_field(obj, "job", str), _field(obj, "rank", int), tuple(ok), _field(obj, "pulled", int),
                    _field(obj, "nbytes", int), _field(obj, "seconds", float),
                    _field(obj, "prefetched", int) if "prefetched" in obj else 0)


def _pull_failed(obj: Mapping[str, Any]) -> PullFailed:
    reason = _field(obj, "reason", str)
    try:
        known = LoadFailureReason(reason)
    except ValueError:
        raise ConfigError(f"side-channel failed message: unknown reason {_brief(reason)}") from None
    return PullFailed(_field(obj, "job", str), _field(obj, "rank", int), known, _field(obj, "why", str))


_DECODERS: dict[Op, Callable[[Mapping[str, Any]], Message]] = {
    Op.HELLO: lambda obj: Hello(_field(obj, "rank", int)),
    Op.PULL: _pull_order,
    Op.CANCEL: lambda obj: Cancel(_field(obj, "job", str)),
    Op.DONE: _pull_done,
    Op.FAILED: _pull_failed,
}
