"""Calibration passes, registered by name so recipes can list them."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.passes.base import LayerWork, Pass, QuantizedLinear

PASSES: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available to recipes under `cls.name`."""
    if cls.name in PASSES:
        raise ValueError(f"pass {cls.name!r} registered twice")
    PASSES[cls.name] = cls
    return cls


def get_pass(name: str) -> type[Pass]:
    if name not in PASSES:
        raise QuantkitError(f"unknown pass {name!r}; known passes: {', '.join(sorted(PASSES))}")
    return PASSES[name]


from quantkit.passes import (  # noqa: E402  (registration)
    clip,
    gptq,
    outliers,
    reorder,
    rtn,
    smooth,
    squeezellm,
    transforms,
)

__all__ = ["PASSES", "LayerWork", "Pass", "QuantizedLinear", "clip", "get_pass", "gptq", "outliers", "register",
           "reorder", "rtn", "smooth", "squeezellm", "transforms"]
