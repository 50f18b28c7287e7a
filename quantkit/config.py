"""Strict construction of frozen config dataclasses from YAML data, with errors that name the field.

Every recipe section and pass config is a dataclass; `build(cls, data, where)` checks each key and type and
says, for a typo, which fields are allowed. Supported field types: bool, int, float, str, Literal, Optional,
list[...] and nested config dataclasses.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from quantkit.errors import QuantkitError

T = TypeVar("T")


class ConfigError(QuantkitError):
    """A recipe or pass config has an unknown field or a value of the wrong type."""


def build(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown fields and ill-typed values."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            + (f"allowed: {', '.join(fields)}" if fields else "it takes none")
        )
    hints = get_type_hints(cls)
    values = {}
    for name, value in data.items():
        values[name] = _coerce(hints[name], value, f"{where}.{name}")
    missing = [
        n for n, f in fields.items()
        if n not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{where}: missing required field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:  # __post_init__ range checks
        raise ConfigError(f"{where}: {exc}") from None


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {_name(tp)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (list, typing.List):  # noqa: UP006
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = get_args(tp)
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_TEXT_FLOAT.fullmatch(value.strip()):
            value = float(value)  # 1e-2: text to YAML 1.1 (PyYAML), a number to YAML 1.2 and to the user
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):  # YAML's .inf and .nan: no field means them (damp .inf never factorizes)
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported config type {tp!r}")


# The exponent forms that YAML 1.2 reads as floats and PyYAML's YAML 1.1 as strings: 1e-2, 5E3 (no dot), 1.0e2 (no
# exponent sign)
_YAML11_TEXT_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def to_dict(obj: Any) -> Any:
    """Plain-data (YAML-ready) form of a config dataclass tree."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    return obj
