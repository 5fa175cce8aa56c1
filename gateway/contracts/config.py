"""Build one frozen settings object from command-line flags and environment variables.

Both servers (``python -m gateway`` and ``python -m worker``) describe their settings as a frozen
dataclass whose fields carry ``help`` metadata. :func:`load_settings` turns that dataclass into an
``argparse`` parser, reads ``<PREFIX><FIELD>`` environment variables as defaults, and parses once.
Precedence: command-line flag > environment variable > config file > dataclass default. The
config file is TOML with the same keys (``--config FILE`` or ``<PREFIX>CONFIG``; see
:mod:`gateway.contracts.config_file`).

Supported field types: ``str``, ``int``, ``float``, ``bool`` (``--flag`` / ``--no-flag``) and
``tuple[str, ...]`` (repeatable flag; comma-separated in the environment).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from gateway.contracts import config_file

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """An environment variable or flag could not be parsed."""


def _parse_bool(raw: str, name: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name}: expected a boolean (true/false), got {raw!r}")


def parse_value(raw: str, kind: Any, name: str) -> Any:
    """``raw`` (an environment variable, or any other ``NAME=VALUE`` text) as a value of the
    supported field type ``kind``; :class:`SettingsError` names ``name`` when it cannot."""
    try:
        if kind is bool:
            return _parse_bool(raw, name)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind == tuple[str, ...]:
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        return raw
    except ValueError as exc:
        raise SettingsError(f"{name}: cannot parse {raw!r}: {exc}") from exc


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None,
    *,
    env_prefix: str,
    prog: str,
    description: str,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Parse ``argv`` and ``environ`` into an instance of the frozen dataclass ``cls``."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    config_env = env_prefix + "CONFIG"
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    config_path = known.config or env.get(config_env, "").strip()
    try:
        from_file = config_file.read(config_path, cls) if config_path else {}
    except config_file.ConfigFileError as exc:
        raise SettingsError(str(exc)) from exc
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"Every option can also be set as an environment variable {env_prefix}<NAME>, "
        f"for example {env_prefix}PORT=8000, or as a key of the --config file. Precedence: "
        "flag > environment > file > default.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--config", metavar="FILE", default=None,
        help=f"TOML file with settings, same keys as the flags [env {config_env}]",
    )
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        flag = "--" + field.name.replace("_", "-")
        env_name = env_prefix + field.name.upper()
        default: Any = field.default
        factory: Any = field.default_factory
        if default is dataclasses.MISSING and factory is not dataclasses.MISSING:
            default = factory()
        if field.name in from_file:
            default = from_file[field.name]
        if env.get(env_name, "").strip():  # an empty variable leaves the default
            default = parse_value(env[env_name], kind, env_name)
        help_text = str(field.metadata.get("help", "")) + f" [env {env_name}]"
        if field.metadata.get("secret"):
            help_text += "%(default).0s"  # argparse prints no default (the secret) for it
        if kind is bool:
            parser.add_argument(
                flag, dest=field.name, action=argparse.BooleanOptionalAction, default=default,
                help=help_text,
            )
        elif kind == tuple[str, ...]:
            parser.add_argument(
                flag, dest=field.name, action="append", default=None, metavar="VALUE",
                help=help_text + " (repeatable)",
            )
            values[field.name] = default
        else:
            parser.add_argument(
                flag, dest=field.name, type=kind, default=default,
                metavar=field.name.upper(), help=help_text,
            )
    ns = parser.parse_args(argv)
    for field in dataclasses.fields(cls):
        parsed = getattr(ns, field.name)
        if hints[field.name] == tuple[str, ...]:
            values[field.name] = tuple(parsed) if parsed is not None else values[field.name]
        else:
            values[field.name] = parsed
    return cls(**values)
