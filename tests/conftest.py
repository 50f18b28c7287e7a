"""Shared fixtures: paths to ../shared material (skipped with a reason when absent) and tiny synthetic models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quantkit.synthetic import write_calibration_text

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QUANTKIT_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory) -> Path:
    """Every test run gets its own $QUANTKIT_CACHE: content-keyed caches (Fisher, GGUF) must not let one run's
    results stand in for the computation a later run's test means to exercise, nor fill the user's cache."""
    path = tmp_path_factory.mktemp("quantkit-cache")
    saved = os.environ.get("QUANTKIT_CACHE")
    os.environ["QUANTKIT_CACHE"] = str(path)
    yield path
    if saved is None:
        os.environ.pop("QUANTKIT_CACHE", None)
    else:
        os.environ["QUANTKIT_CACHE"] = saved


def shared_path(relative: str) -> Path:
    """Path inside ../shared, or skip the test with a message naming what is missing."""
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"needs {path} (the project's shared/ folder); set QUANTKIT_SHARED to its location")
    return path


@pytest.fixture
def stories260k() -> Path:
    return shared_path("models/stories260K")


@pytest.fixture
def tinystories_txt() -> Path:
    return shared_path("data/tinystories/TinyStories-valid-subset.txt")


@pytest.fixture
def shared_data() -> Path:
    return shared_path("data")


@pytest.fixture(scope="session")
def calib_txt(tmp_path_factory) -> Path:
    """Calibration text that needs nothing from shared/: varied English-like lines."""
    return write_calibration_text(tmp_path_factory.mktemp("calib") / "calib.txt")
