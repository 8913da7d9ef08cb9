"""The NIXL binding boundary: the only import of NIXL, agent creation, states, errors (both processes).

Everything that touches the binding's names lives here:

- :func:`load_nixl` imports the first of ``nixl._api``, ``nixl_cu12._api``,
  ``nixl_cu13._api`` that is installed, or raises
  :class:`~common.errors.TransportUnavailable` naming the ``nixl`` extra.
- :class:`TransferState` replaces the binding's ``"DONE"`` / ``"PROC"`` /
  ``"ERR"`` strings; nothing else compares them.
- :func:`binding_errors` maps the binding's exceptions (twelve classes that
  share no base class) to the project's error tree, ``from`` the original.
- :func:`create_agent` builds a real ``nixl_agent`` or the
  :class:`~common.transport.mock_agent.MockNixlAgent`, which has the same
  method names and semantics.

UCX reads ``UCX_*`` variables when a backend is created (measured:
``UCX_TLS`` is honoured per agent), but a few (memory hooks, logging) only
when the library loads, so pass them to :func:`load_nixl` before the first
import. Left unset, ``UCX_TLS`` picks cross-memory-attach plus TCP wire-up on
one host, the fastest choice there.
"""

from __future__ import annotations

import enum
import importlib
import logging
import os
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Protocol, cast

from common.config import TransportKind
from common.errors import ConfigError, EpdError, PeerDisconnected, TransportError, TransportUnavailable

logger = logging.getLogger(__name__)

NIXL_MODULES: tuple[str, ...] = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
NIXL_EXTRA_HINT = "pip install 'epd-cache[nixl]'"
# prep_xfer_dlist's name for "the initiator's own memory".
LOCAL_AGENT = "NIXL_INIT_AGENT"

# The binding's exception classes, by name, and the error each becomes. The
# mock agent raises classes with the same names, so one table serves both.
BINDING_ERRORS: Mapping[str, type[EpdError]] = {
    "nixlRemoteDisconnectError": PeerDisconnected,
    "nixlBackendError": TransportError,
    "nixlCancelledError": TransportError,
    "nixlInvalidParamError": TransportError,
    "nixlMismatchError": TransportError,
    "nixlNoTelemetryError": TransportError,
    "nixlNotAllowedError": TransportError,
    "nixlNotFoundError": TransportError,
    "nixlNotPostedError": TransportError,
    "nixlNotSupportedError": TransportError,
    "nixlRepostActiveError": TransportError,
    "nixlUnknownError": TransportError,
}
_BINDING_PACKAGES = frozenset({"nixl", "nixl_cu12", "nixl_cu13", "common"})


class TransferState(enum.Enum):
    """State of a posted transfer, as ``transfer()`` / ``check_xfer_state()`` report it."""

    PROCESSING = "PROC"
    DONE = "DONE"
    ERROR = "ERR"

    @classmethod
    def parse(cls, raw: str) -> TransferState:
        try:
            return _STATES[raw]
        except KeyError:
            raise TransportError(f"NIXL reported an unknown transfer state {raw!r}") from None


_STATES = {state.value: state for state in TransferState}


class AgentLike(Protocol):
    """The subset of ``nixl_agent`` this project uses (the mock implements the same)."""

    name: str

    def register_memory(self, reg_list: Any, mem_type: str | None = None) -> Any: ...
    def deregister_memory(self, dereg_list: Any) -> None: ...
    def get_agent_metadata(self) -> bytes: ...
    def add_remote_agent(self, metadata: bytes) -> str | bytes: ...
    def remove_remote_agent(self, agent: str) -> None: ...
    def make_connection(self, remote_agent: str) -> None: ...
    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: str | None = None) -> Any: ...
    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: Any,
        local_indices: Any,
        remote_xfer_side: Any,
        remote_indices: Any,
        notif_msg: bytes = b"",
    ) -> Any: ...
    def transfer(self, handle: Any, notif_msg: bytes = b"") -> str: ...
    def check_xfer_state(self, handle: Any) -> str: ...
    def release_xfer_handle(self, handle: Any) -> None: ...
    def release_dlist_handle(self, handle: Any) -> None: ...
    def get_new_notifs(self) -> dict[str, list[bytes]]: ...
    def send_notif(self, remote_agent_name: str, notif_msg: bytes) -> None: ...


# --- errors -------------------------------------------------------------------------------


def is_binding_error(exc: BaseException) -> bool:
    """True for the binding's (or the mock's) exception classes, matched by name and package."""
    kind = type(exc)
    return kind.__name__ in BINDING_ERRORS and kind.__module__.split(".")[0] in _BINDING_PACKAGES


def translate_error(
    exc: BaseException, action: str, overrides: Mapping[str, type[EpdError]] | None = None
) -> EpdError:
    """The project error for binding exception ``exc`` raised while doing ``action``."""
    name = type(exc).__name__
    cls = (overrides or {}).get(name) or BINDING_ERRORS.get(name, TransportError)
    detail = str(exc) or "no detail"
    return cls(f"{action}: {name} ({detail})")


class binding_errors:  # noqa: N801 - used like the function it was
    """Re-raise binding exceptions inside the block as project errors, ``from`` the original.

    A class, not ``@contextmanager``: it wraps every NIXL call of every READ,
    and a generator-based manager costs several times more to enter and leave.
    """

    __slots__ = ("action", "overrides")

    def __init__(self, action: str, overrides: Mapping[str, type[EpdError]] | None = None) -> None:
        self.action = action
        self.overrides = overrides

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or isinstance(exc, EpdError) or not isinstance(exc, Exception):
            return
        if is_binding_error(exc):
            raise translate_error(exc, self.action, self.overrides) from exc


# --- loading --------------------------------------------------------------------------------

_load_lock = threading.Lock()
_loaded: ModuleType | None = None


def _quiet_nixl_logging() -> None:
    # NIXL's Python logger writes INFO lines ("Backend UCX was instantiated")
    # to stdout through its own handler and turns logging.raiseExceptions off
    # process-wide. Route its records through the application's logging tree
    # instead, at WARNING, so stdout stays the program's.
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True
    if nixl_logger.level < logging.WARNING:
        nixl_logger.setLevel(logging.WARNING)


def load_nixl(
    *,
    ucx_env: Mapping[str, str] | None = None,
    modules: tuple[str, ...] = NIXL_MODULES,
    quiet: bool = True,
) -> ModuleType:
    """The installed NIXL ``_api`` module; raises ``TransportUnavailable`` naming the extra.

    ``ucx_env`` is written to the environment first (keys must start with
    ``UCX_``): UCX reads some settings only when its library loads.
    ``modules`` other than the default are tried without touching the cache
    (tests use it to simulate a machine without NIXL).
    """
    global _loaded
    for key in ucx_env or {}:
        if not key.startswith("UCX_"):
            raise ConfigError(f"UCX setting {key!r} must start with 'UCX_'")
    with _load_lock:
        if modules == NIXL_MODULES and _loaded is not None:
            if ucx_env:
                # Per-agent settings such as UCX_TLS still apply to agents created later.
                logger.info("UCX settings %s given after NIXL was loaded: load-time ones need a restart",
                            sorted(ucx_env))
                os.environ.update(ucx_env)
            return _loaded
        if ucx_env:
            os.environ.update(ucx_env)
        failures: list[str] = []
        for name in modules:
            raise_exceptions = logging.raiseExceptions
            try:
                module = importlib.import_module(name)
            except (ImportError, OSError) as exc:
                failures.append(f"{name}: {exc}")
                continue
            finally:
                logging.raiseExceptions = raise_exceptions
            if quiet:
                _quiet_nixl_logging()
            if modules == NIXL_MODULES:
                _loaded = module
            logger.debug("NIXL binding loaded from %s", name)
            return module
        raise TransportUnavailable(
            f"NIXL is not installed (tried {'; '.join(failures)}); install the nixl extra "
            f"with `{NIXL_EXTRA_HINT}`, or choose the mock transport"
        )


def nixl_available() -> tuple[bool, str]:
    """``(True, module name)`` when NIXL imports, else ``(False, reason)``: for skips and ``auto``."""
    try:
        module = load_nixl()
    except TransportUnavailable as exc:
        return False, str(exc)
    return True, module.__name__


def resolve_transport_kind(kind: TransportKind | str) -> TransportKind:
    """``nixl`` or ``mock``; ``auto`` becomes ``nixl`` when it imports, else ``mock`` (with a warning)."""
    try:
        resolved = TransportKind(kind)
    except ValueError:
        raise ConfigError(
            f"unknown transport {kind!r}; expected one of {[k.value for k in TransportKind]}"
        ) from None
    if resolved is not TransportKind.AUTO:
        return resolved
    ok, reason = nixl_available()
    if ok:
        return TransportKind.NIXL
    logger.warning("transport auto: NIXL unavailable, using the mock agent (shared memory, one host): %s",
                   reason)
    return TransportKind.MOCK


def create_agent(kind: TransportKind | str, name: str, **options: Any) -> AgentLike:
    """A NIXL agent (``kind`` ``nixl``) or the shared-memory mock (``mock``) named ``name``.

    NIXL options: ``backends`` (default ``("UCX",)``), ``num_threads``,
    ``ucx_env`` (see :func:`load_nixl`). Mock options: ``faults``
    (:class:`~common.transport.mock_agent.MockFaults`).
    """
    resolved = resolve_transport_kind(kind)
    if resolved is TransportKind.MOCK:
        from common.transport.mock_agent import MockNixlAgent

        return MockNixlAgent(name, **options)
    module = load_nixl(ucx_env=options.pop("ucx_env", None))
    backends = list(options.pop("backends", ("UCX",)))
    num_threads = int(options.pop("num_threads", 0))
    progress_thread = bool(options.pop("progress_thread", True))
    if options:
        raise ConfigError(f"unknown NIXL agent options {sorted(options)}")
    # The listener thread is not used: metadata travels in the gRPC handshake.
    config = module.nixl_agent_config(
        enable_prog_thread=progress_thread, enable_listen_thread=False, backends=backends,
        num_threads=num_threads,
    )
    try:
        with binding_errors(f"create NIXL agent {name!r}"):
            agent = module.nixl_agent(name, config)
    except RuntimeError as exc:  # "No plugins available"
        raise TransportUnavailable(f"NIXL agent {name!r} has no backend plugins: {exc}") from exc
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise TransportUnavailable(
            f"NIXL backend(s) {missing} unavailable for agent {name!r}; plugins found: "
            f"{agent.get_plugin_list()}"
        )
    return cast(AgentLike, agent)


def agent_name_of(added: str | bytes) -> str:
    """``add_remote_agent`` returns the name as ``bytes`` in NIXL 1.5; normalise to ``str``."""
    return added.decode("utf-8", "replace") if isinstance(added, bytes) else str(added)
