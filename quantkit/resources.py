"""Locate the data folders (recipes, calib, eval, kernels) in an installed package or a source checkout."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_FOLDERS = ("recipes", "calib", "eval", "kernels")


def data_path(folder: str) -> Path:
    """Directory of a bundled data folder: `quantkit/data/<folder>` when installed, `<repo>/<folder>` in a checkout."""
    if folder not in _FOLDERS:
        raise ValueError(f"unknown data folder {folder!r}; known: {', '.join(_FOLDERS)}")
    spec = importlib.util.find_spec(f"quantkit.data.{folder}")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if Path(location).is_dir():
                return Path(location)
    checkout = Path(__file__).resolve().parent.parent / folder
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"quantkit data folder {folder!r} is missing from this installation")
