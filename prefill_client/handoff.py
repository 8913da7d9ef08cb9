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
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from common.errors import ConfigError
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


def to_params(placements: Sequence[Placement]) -> dict[str, Any]:
    """The ``ec_transfer_params`` for a request whose items were placed."""
    items = {
        p.mm_hash: {"encoder": p.encoder, "incarnation": p.incarnation_id, "weights_digest": p.weights_digest,
                    "owner": p.owner, "location": base64.b64encode(p.location.SerializeToString()).decode("ascii")}
        for p in placements
    }
    return {KEY: {"items": items}}


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
    out: dict[str, Placement] = {}
    for mm_hash, entry in items.items():
        if not isinstance(entry, Mapping):
            raise ConfigError(f"ec_transfer_params item {mm_hash!r} must be an object")
        try:
            location = pb2.ItemLocation.FromString(base64.b64decode(str(entry["location"]), validate=True))
            encoder, incarnation = str(entry["encoder"]), str(entry["incarnation"])
        except KeyError as exc:
            raise ConfigError(f"ec_transfer_params item {mm_hash!r} lacks {exc.args[0]!r}") from exc
        except (binascii.Error, DecodeError, ValueError) as exc:
            raise ConfigError(f"ec_transfer_params item {mm_hash!r}: bad location ({exc})") from exc
        if location.mm_hash != mm_hash:
            raise ConfigError(f"ec_transfer_params item {mm_hash!r} carries the location of {location.mm_hash!r}")
        out[mm_hash] = Placement(mm_hash, encoder, incarnation, location, str(entry.get("weights_digest", "")),
                                 str(entry.get("owner", "")))
    return out
