"""Test helpers: run the CLI in-process, compare artifacts byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner, Result

from quantkit.cli import main


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def cli_ok(*args: str) -> Result:
    result = cli(*args)
    assert result.exit_code == 0, result.output
    return result


def artifact_digest(path: Path) -> dict[str, str]:
    """sha256 of every artifact file except the manifest (which holds timings), plus the manifest's layers."""
    manifest = json.loads((path / "quantkit_manifest.json").read_text())
    digest = {name: f["sha256"] for name, f in manifest["files"].items()}
    digest["layers"] = json.dumps([(r["index"], r["rel_error"]) for r in manifest["layers"]])
    digest["calibration"] = manifest["calibration"]["sha256"]
    return digest
