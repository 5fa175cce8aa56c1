"""Settings from a TOML file: ``--config gateway.toml`` (or ``<PREFIX>CONFIG``).

The file holds the same keys as the command-line flags, at the top level, with ``_`` or ``-``
(``max_attempts = 3`` or ``max-attempts = 3``); lists for repeatable flags
(``worker = ["http://a:8001", "http://b:8001"]``). Values are checked against the setting's
type and unknown keys are an error, so a typo does not silently leave a default in place.
Precedence: flag > environment variable > file > built-in default.

:func:`example` renders a commented file with every key, its help and its default; the
committed examples (``infra/config/*.example.toml``) are produced by it and tested against it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    """The file cannot be read, is not TOML, or holds an unknown key or a wrongly typed value."""


def _coerce(value: Any, kind: Any, where: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigFileError(f"{where}: expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigFileError(f"{where}: expected an integer, got {value!r}")
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigFileError(f"{where}: expected a number, got {value!r}")
    if kind == tuple[str, ...]:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigFileError(f"{where}: expected a list of strings, got {value!r}")
    if isinstance(value, str):
        return value
    raise ConfigFileError(f"{where}: expected a string, got {value!r}")


def read(path: str | Path, cls: type[Any]) -> dict[str, Any]:
    """The settings in the TOML file at ``path``, by field name of the dataclass ``cls``."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigFileError(f"cannot read the config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path} is not valid TOML: {exc}") from exc
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in hints or name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigFileError(f"{path}: unknown setting {key!r}{hint}")
        out[name] = _coerce(value, hints[name], f"{path}: {key}")
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)


def example(cls: type[Any], title: str, env_prefix: str) -> str:
    """A commented TOML file listing every setting of ``cls`` at its default."""
    lines = [
        f"# {title}",
        "#",
        "# Every key is also a command-line flag (--max-attempts) and an environment variable",
        f"# ({env_prefix}MAX_ATTEMPTS). Precedence: flag > environment > this file > default.",
        "# Uncomment what you change; the values shown are the defaults.",
    ]
    for field in dataclasses.fields(cls):
        default: Any = field.default
        factory: Any = field.default_factory
        if default is dataclasses.MISSING and factory is not dataclasses.MISSING:
            default = factory()
        help_text = " ".join(str(field.metadata.get("help", "")).split())
        lines.append("")
        for chunk in _wrap(help_text, 96):
            lines.append(f"# {chunk}")
        lines.append(f"# {field.name} = {_toml_value(default)}")
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int) -> list[str]:
    out: list[str] = []
    line = ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        out.append(line)
    return out
