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


def set_weight(model: Path, name: str, value: float, at: tuple[int, int] = (-1, -1)) -> None:
    """Set one value (at row, column `at`) of tensor `name` of a sharded checkpoint, in place: a NaN, or a weight
    past a dtype's range, for the tests of what a run does with it."""

    def change(tensor):
        tensor[at] = value
        return tensor

    _rewrite_shard(model, name, change, metadata={"format": "pt"})


def _rewrite_shard(directory: Path, key: str, change, metadata: dict[str, str] | None = None) -> Path:
    """Replace tensor `key` by `change(tensor)` (or drop it where that is None) in the shard the directory's index
    names for it; returns the shard's path."""
    from safetensors.torch import load_file, save_file

    shard_path = directory / json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(str(shard_path))
    changed = change(tensors.pop(key))
    if changed is not None:
        tensors[key] = changed
    save_file(tensors, str(shard_path), metadata=metadata)
    return shard_path


def record_rewritten_file(artifact: Path, path: Path) -> None:
    """Record a file a test rewrote on purpose in the artifact's manifest (bytes, sha256), as quantize would have,
    so that the artifact reads as whole rather than damaged."""
    from quantkit.artifact import MANIFEST, manifest_digest, sha256_file

    manifest = json.loads((artifact / MANIFEST).read_text())
    if path.name != MANIFEST:
        manifest["files"][path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (artifact / MANIFEST).write_text(json.dumps(manifest, indent=2))


def rewrite_tensor(artifact: Path, key: str, change) -> None:
    """Replace tensor `key` of an artifact by `change(tensor)` (or drop it where that is None), in the shard that
    holds it, and record the shard in the manifest: an artifact whose files are whole but whose tensors are not
    what its spec reads."""
    record_rewritten_file(artifact, _rewrite_shard(artifact, key, change))


def wikitext_rows(data: Path) -> Path:
    """A data directory whose WikiText-2 test file holds a few rows of text (eval checks its data before it reads
    the model)."""
    from quantkit.eval.perplexity import WIKITEXT_FILE

    (data / WIKITEXT_FILE).parent.mkdir(parents=True, exist_ok=True)
    rows = [" = A heading = ", " The quick brown fox jumps over the lazy dog . " * 40, ""] * 20
    (data / WIKITEXT_FILE).write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return data
