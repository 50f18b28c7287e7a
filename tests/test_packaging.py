"""The wheel that a non-editable `pip install .` builds: the package with every file of its data folders."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA_FOLDERS = ("recipes", "calib", "eval", "kernels")  # shipped as quantkit.data.<folder> (pyproject.toml)


def test_wheel_ships_every_data_file_and_module(tmp_path):
    """Each data folder's files (recipes, calibration sets, lm-eval configs, the kernel sources the warp simulator
    and NVRTC build) are in the wheel under quantkit/data/, as is every module of the package: a new kind of file
    in a folder that package-data does not name would otherwise be missing only from an installed quantkit."""
    source = tmp_path / "source"  # a copy, so the build leaves no build/ or egg-info in the checkout
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "__pycache__", ".*_cache", ".kcache", ".kartifacts", "out"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = next((tmp_path / "wheel").glob("quantkit-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in DATA_FOLDERS:
        shipped = {name.rsplit("/", 1)[1] for name in names if name.startswith(f"quantkit/data/{folder}/")}
        expected = {p.name for p in (REPO / folder).iterdir() if p.is_file() and p.name != "README.md"}
        assert expected and shipped - {"__init__.py"} == expected, folder
    modules = {str(p.relative_to(REPO)) for p in (REPO / "quantkit").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
