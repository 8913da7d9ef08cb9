"""How a config class becomes flags, environment lookups and reference tables (every process).

Each field of a config class is declared with :func:`setting`, which records its CLI flag,
its environment variable and its help text. :func:`add_arguments` turns a config class into
argparse flags, :func:`build` resolves a value per field with the precedence *CLI flag >
environment variable > default*, and :func:`describe` lists every flag and variable (the
README's configuration reference is checked against it). Nothing below the CLI reads
``os.environ``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config.choices import Choice
from common.errors import ConfigError


def setting(default: Any, *, env: str, help: str, flag: str | None = None, repeat: bool = False,
            secret: bool = False) -> Any:
    """Declare a config field with its environment variable and help text.

    ``repeat``: a list setting whose flag may also be given several times (the values add up);
    ``secret``: the value stays out of the config's repr (and so out of logs).
    """
    return field(default=default, repr=not secret, metadata={"env": env, "help": help, "flag": flag, "repeat": repeat})


@dataclass(frozen=True, slots=True)
class SettingInfo:
    """One configurable value as the README's reference lists it."""

    path: tuple[str, ...]  # field names from the top-level config, nested ones included
    flag: str
    env: str
    default: Any
    help: str
    type: Any
    repeat: bool = False  # the flag may be given several times


def require(ok: bool, name: str, value: object, what: str) -> None:
    """A :class:`ConfigError` naming the setting and its value unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name} {what}, got {value!r}")


def settle_choices(config: Any) -> None:
    """Make each choice field of a (frozen) config a member of its enum, from a spelling given directly.

    :func:`build` converts flags and variables already; a config constructed in code may
    name a choice by its string (``EncoderServerConfig(encoder_backend="eager")``). A
    spelling outside the choice is a :class:`ConfigError` naming the setting and the value.
    """
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        kind, value = hints[f.name], getattr(config, f.name)
        if not (isinstance(kind, type) and issubclass(kind, Choice)) or isinstance(value, kind):
            continue
        spellings = [member.value for member in kind]
        try:
            member = kind(value)
        except ValueError:
            raise ConfigError(f"{f.name} must be {', '.join(spellings[:-1])} or {spellings[-1]}, "
                              f"got {value!r}") from None
        object.__setattr__(config, f.name, member)


def iter_settings(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[SettingInfo]:
    """Every leaf setting of a config class, nested config classes flattened."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from iter_settings(hint, prefix + (f.name,))
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        yield SettingInfo(prefix + (f.name,), flag, f.metadata["env"], f.default, f.metadata["help"], hint,
                          f.metadata.get("repeat", False))


def describe(cls: type) -> list[SettingInfo]:
    return list(iter_settings(cls))


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for ``X | None``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _convert(info: SettingInfo, raw: str, source: str) -> Any:
    base, optional = _base_type(info.type)
    if optional and raw.strip() in ("", "none", "None"):
        return None
    try:
        if base is bool:
            lowered = raw.strip().lower()
            if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(raw)
            return lowered in ("1", "true", "yes", "on")
        if base is int:
            return int(raw, 0)
        if base is float:
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError(raw)
            return value
        if typing.get_origin(base) is tuple:
            parts = tuple(part.strip() for part in raw.split(",") if part.strip())
            return tuple(int(part, 0) for part in parts) if typing.get_args(base)[0] is int else parts
        if isinstance(base, type) and issubclass(base, enum.Enum):
            return base(raw.strip().lower())
        return raw
    except ValueError:
        raise ConfigError(f"{source} has an invalid value {raw!r} for {info.flag}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per setting; defaults stay None so unset flags fall back to env."""
    for info in iter_settings(cls):
        base, _ = _base_type(info.type)
        default = info.default.value if isinstance(info.default, enum.Enum) else info.default
        if isinstance(default, tuple):
            default = ",".join(default)
        extra: dict[str, Any] = {}
        if isinstance(base, type) and issubclass(base, enum.Enum):
            extra["choices"] = [m.value for m in base]
        if info.repeat:
            extra["action"] = "append"
        parser.add_argument(
            info.flag, dest="_".join(info.path), default=None, metavar=None if extra else info.path[-1].upper(),
            # argparse %-formats help strings: a literal "%" in a setting's help must be doubled.
            help=f"{info.help} [env {info.env}; default {default}]".replace("%", "%%"), **extra,
        )


def build(cls: type, args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> Any:
    """Resolve a config: CLI flag, else environment variable, else default."""
    environ = environ or {}
    values: dict[tuple[str, ...], Any] = {}
    for info in iter_settings(cls):
        raw = getattr(args, "_".join(info.path), None) if args is not None else None
        if isinstance(raw, list):  # a repeated flag: its values, as one comma-separated setting
            raw = ",".join(raw)
        if raw is not None:
            values[info.path] = _convert(info, str(raw), f"flag {info.flag}")
        elif info.env in environ:
            values[info.path] = _convert(info, environ[info.env], f"environment variable {info.env}")
    return _instantiate(cls, values, ())


def build_from_mapping(cls: type, mapping: Mapping[str, Any], source: str,
                       environ: Mapping[str, str] | None = None) -> Any:
    """Resolve a config from a mapping (e.g. a JSON object) keyed by field name (``rpc_timeout_s``,
    ``tls_ca``) or flag name (``rpc-timeout-s``), else from the environment variable, else the
    default. A list value is a comma-separated setting. Unknown keys are a ConfigError naming them."""
    by_name: dict[str, SettingInfo] = {}
    for info in iter_settings(cls):
        by_name["_".join(info.path)] = info
        by_name[info.flag.removeprefix("--").replace("-", "_")] = info
    values: dict[tuple[str, ...], Any] = {}
    for info in iter_settings(cls):
        if environ and info.env in environ:
            values[info.path] = _convert(info, environ[info.env], f"environment variable {info.env}")
    for key, raw in mapping.items():
        found = by_name.get(key.replace("-", "_"))
        if found is None:
            raise ConfigError(f"{source}: unknown setting {key!r}; known: {', '.join(sorted(by_name))}")
        text = ",".join(str(v) for v in raw) if isinstance(raw, (list, tuple)) else str(raw)
        if isinstance(raw, bool):
            text = "true" if raw else "false"
        values[found.path] = _convert(found, text, f"{source} {key!r}")
    return _instantiate(cls, values, ())


def _instantiate(cls: type, values: dict[tuple[str, ...], Any], prefix: tuple[str, ...]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = prefix + (f.name,)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _instantiate(hints[f.name], values, path)
        elif path in values:
            kwargs[f.name] = values[path]
    return cls(**kwargs)


def markdown_reference(cls: type) -> str:
    """The README's configuration table for one config class."""
    rows = ["| flag | env | default | meaning |", "| --- | --- | --- | --- |"]
    for info in iter_settings(cls):
        default = info.default.value if isinstance(info.default, enum.Enum) else info.default
        if isinstance(default, tuple):
            default = ",".join(default)
        rows.append(f"| `{info.flag}` | `{info.env}` | {default if default is not None else '—'} | {info.help} |")
    return "\n".join(rows)


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; :class:`ConfigError` naming the file otherwise."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return raw
