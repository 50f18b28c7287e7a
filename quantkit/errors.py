"""Base class for errors quantkit reports to the user without a traceback, and how their messages name things."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class QuantkitError(Exception):
    """Base class for errors quantkit reports to the user without a traceback."""


def some(names: Sequence[str], limit: int = 5) -> str:
    """The first `limit` of `names`, comma-separated, then " and more" if there are others: an error's list of what is
    wrong stays a line where a whole checkpoint's tensor names would fill a screen."""
    return ", ".join(names[:limit]) + (" and more" if len(names) > limit else "")


def dtype_name(dtype: Any) -> str:
    """A torch dtype as messages and files name it: "bfloat16", not "torch.bfloat16"."""
    return str(dtype).removeprefix("torch.")


def not_a_directory(path: Path) -> str:
    """Why `path` is no directory, for a message: it "is not a directory" (a file is there) or "does not exist"."""
    return "is not a directory" if path.exists() else "does not exist"
