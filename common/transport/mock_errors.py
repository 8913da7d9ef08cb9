"""Exception classes of the mock NIXL agent, named like NIXL's binding exceptions (both processes).

NIXL's twelve binding exceptions share no base class; these mirror the names
the mock raises, so :func:`common.transport.binding.binding_errors` maps the
mock and the real agent through one table.
"""

from __future__ import annotations

# ruff: noqa: N801 - the names are NIXL's.


class nixlBackendError(Exception):
    """A backend operation failed (mock: shared memory could not be mapped, injected failure)."""


class nixlInvalidParamError(Exception):
    """Bad indices, lengths or handles (mock: also a stale dlist)."""


class nixlMismatchError(Exception):
    """Metadata that cannot be parsed."""


class nixlNotAllowedError(Exception):
    """A known agent name re-added with different metadata."""


class nixlNotFoundError(Exception):
    """Unknown agent, unregistered memory, or a transfer whose remote agent was removed."""


class nixlNotPostedError(Exception):
    """State asked of a transfer that was never posted."""


class nixlNotSupportedError(Exception):
    """An operation or memory type the mock does not implement."""


class nixlRemoteDisconnectError(Exception):
    """The remote agent's process is gone."""


class nixlRepostActiveError(Exception):
    """A transfer re-posted while still in progress."""
