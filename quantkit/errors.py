"""Base class for errors quantkit reports to the user without a traceback, and how their messages list names."""

from __future__ import annotations

from collections.abc import Sequence


class QuantkitError(Exception):
    """Base class for errors quantkit reports to the user without a traceback."""


def some(names: Sequence[str], limit: int = 5) -> str:
    """The first `limit` of `names`, comma-separated, then " and more" if there are others: an error's list of what is
    wrong stays a line where a whole checkpoint's tensor names would fill a screen."""
    return ", ".join(names[:limit]) + (" and more" if len(names) > limit else "")
