"""Helpers shared by the benchmarks: run the CLI in a subprocess, read results, print tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QUANTKIT_SHARED", REPO.parent / "shared"))


def need(path: Path) -> Path:
    if not path.exists():
        sys.exit(f"missing {path}: the benchmark reads the project's shared/ folder (set QUANTKIT_SHARED)")
    return path


def quantkit(*args: str) -> float:
    """Run `quantkit ARGS` in a fresh process (so its peak RSS is its own); returns wall seconds."""
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "quantkit.cli", *args], check=True)
    return time.time() - t0


def manifest(out: Path) -> dict:
    return json.loads((out / "quantkit_manifest.json").read_text())


def eval_ppl(model: Path, data_dir: Path, windows: int, seq_len: int, json_path: Path) -> float:
    quantkit("eval", str(model), "--tasks", "wikitext", "--limit", str(windows), "--seq-len", str(seq_len),
             "--data-dir", str(data_dir), "--output-json", str(json_path))
    return json.loads(json_path.read_text())["results"]["wikitext"]["perplexity"]


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])
