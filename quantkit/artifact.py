"""The output directory: atomic writes, the resume journal, the manifest, and reading an artifact back.

A run writes into `OUT.partial/` and renames it to `OUT` only when complete, so `OUT` is never half-written.
Each decoder layer is its own safetensors shard, written atomically and recorded (with its sha256) in
`quantkit_journal.json`; `--resume` trusts exactly the shards the journal lists and whose hash matches.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quantkit import __version__
from quantkit.errors import QuantkitError
from quantkit.files import (
    DIR_MODE,
    atomic_write,
    atomic_write_with,
    cannot_write,
    lock_held,
    lock_owner,
    take_lock,
)

MANIFEST = "quantkit_manifest.json"
RECIPE = "quantkit_recipe.yaml"
JOURNAL = "quantkit_journal.json"
LOCK = "quantkit_run.lock"  # in OUT.partial while a run writes it: the pid and host of that run


class ArtifactError(QuantkitError):
    """The output directory is in a state the requested operation cannot use."""


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Save `tensors` as a safetensors file at `path` atomically."""
    atomic_write_with(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                                                  metadata={"format": "pt"}))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_safetensors(path: Path, header_only: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at `path` (none with `header_only`, which reads and checks the header
    alone); a file safetensors cannot read is an ArtifactError that names it."""
    try:
        with safe_open(path, framework="pt") as f:
            names = f.keys()
            return {} if header_only else {k: f.get_tensor(k) for k in names}
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"{path}: cannot read this safetensors file, corrupt or truncated ({exc})") from None


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 of a manifest's content but its own digest (`manifest_sha256`), in canonical JSON: what
    `inspect --verify` tells an edited manifest by, where the files' digests cover every other file."""
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def verify_files(path: Path, manifest: dict[str, Any]) -> list[str]:
    """The files of artifact `path` whose sha256 differs from the one its manifest recorded (every byte read), the
    manifest first if its content differs from its own digest (an artifact written before it had one: unchecked)."""
    edited = "manifest_sha256" in manifest and manifest_digest(manifest) != manifest["manifest_sha256"]
    return [MANIFEST] * edited + [name for name, entry in manifest.get("files", {}).items()
                                  if sha256_file(Path(path) / name) != entry["sha256"]]


def shard_name(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def json_object(file: Path, keys: tuple[str, ...] = ()) -> tuple[Any, str]:
    """The JSON object in `file` and "", or what is wrong with the file: unreadable, not an object, or without one
    of `keys`."""
    try:
        content = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, str(exc)
    if not isinstance(content, dict):
        return None, "not a JSON object"
    return content, ", ".join(f"no {key!r}" for key in keys if key not in content)


def _ours(path: Path) -> bool:
    """Whether directory `path` is quantkit's to replace: an artifact, an interrupted run (its journal, or only the
    lock of one killed before it wrote a journal), or holding nothing but atomic writes' temp files."""
    return any((path / name).is_file() for name in (MANIFEST, JOURNAL, LOCK)) or all(
        p.name.startswith(".") and p.name.endswith(".tmp") for p in path.iterdir())


def _trash_name(path: Path) -> Path:
    """A hidden sibling of `path` of a name no one else uses, where it waits to be deleted (`OutputDir._sweep`)."""
    return path.with_name(f".{path.name}.trash-{uuid.uuid4().hex[:12]}")


def _remove(path: Path) -> None:
    """Delete `path`, a directory tree or a file or link (a link, not what it points to), as far as it can."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _trash(path: Path) -> None:
    """Delete directory `path` in one step as readers see it: renamed to a hidden sibling, then deleted; a kill
    on the way leaves only the sibling, which the next run on this output deletes (`OutputDir.check`)."""
    hidden = _trash_name(path)
    path.rename(hidden)
    _remove(hidden)


@dataclass
class OutputDir:
    """The final and in-progress locations of one run's output, and the lock of the run writing it.

    The run holds an flock on `OUT.partial/quantkit_run.lock` (with its pid and host written in it) from before the
    work dir appears until the commit, so no other run ever sees the work dir unlocked; the kernel drops the lock
    when the process ends, a kill included."""

    final: Path
    _lock: int | None = field(default=None, init=False, repr=False)
    _link: Path | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # an output that is a symlink (to a folder on a bigger disk, say) is written where it points, so the link
        # stays and names the new output: replacing the link itself would move the artifact onto the link's disk
        if self.final.is_symlink():
            self._link, self.final = self.final, Path(os.path.realpath(self.final))

    @property
    def work(self) -> Path:
        return self.final.with_name(self.final.name + ".partial")

    def check(self, resume: bool, overwrite: bool, protect: tuple[Path, ...] = ()) -> None:
        """Refuse, before any work, to clobber an existing output or an interrupted run, and --overwrite to replace
        anything but quantkit's own output: a directory that is not an artifact, a file, or `protect` (the model
        being quantized) or a directory holding it. An output inside the model's folder, that cannot be written,
        or that another run is writing, is refused too."""
        if self.final.name in ("", ".", ".."):
            raise ArtifactError(f"-o {self.final}: name the output directory itself (quantkit writes NAME.partial "
                                "beside it, then renames it to NAME)")
        for path in (self.final, self.work):
            if path.exists() and not path.is_dir():
                raise ArtifactError(f"{path} exists and is not a directory; choose another output path")
        parent = self.final.parent.resolve()
        there = next(p for p in (parent, *parent.parents) if p.exists())  # where the first directory is made
        if not there.is_dir():
            raise ArtifactError(f"{there} is not a directory, so {self.final} cannot be made; choose another "
                                "output path")
        if why := cannot_write(there / self.work.name):
            raise ArtifactError(f"cannot write in {there} ({why}); choose another output path")
        if owner := self.writer():
            raise ArtifactError(f"another quantkit run ({owner}) is writing {self.work}; wait for it, or remove "
                                f"{self.work / LOCK} if no run is")
        self._sweep()
        final = self.final.resolve()
        for model in protect:
            if model.resolve() == final or final in model.resolve().parents:
                raise ArtifactError(f"the output {self.final} would replace the model being quantized ({model}); "
                                    "choose another output path")
            if model.is_dir() and model.resolve() in final.parents:  # its *.safetensors would be read as the model's
                raise ArtifactError(f"the output {self.final} is inside the model being quantized ({model}), whose "
                                    "folder must hold the model's files alone; choose another output path")
        for path in (self.final, None if resume else self.work):  # --overwrite replaces only quantkit's output
            if path is not None and path.exists() and not _ours(path):
                raise ArtifactError(
                    f"{path} already exists and is not quantkit's output (no {MANIFEST} or {JOURNAL}); choose "
                    "another output path, or empty it yourself")
        if self.final.exists() and not overwrite:
            if resume and (self.work / JOURNAL).is_file():  # an interrupted --overwrite run
                raise ArtifactError(f"{self.work} holds an unfinished run (interrupted, or stopped by an error) that "
                                    f"replaces {self.final}; pass --resume --overwrite to continue it")
            raise ArtifactError(
                f"{self.final} already exists; pass --overwrite to replace it"
                + (" (it is complete: nothing to resume)" if resume else "")
            )
        journal = (self.work / JOURNAL).is_file()
        if resume and not journal:
            if self.work.exists() and not _ours(self.work):  # --overwrite would refuse it too
                raise ArtifactError(f"--resume: {self.work} holds no journal, and files that are not quantkit's, so "
                                    "nothing can be resumed; choose another output path, or empty it yourself")
            if self.work.exists():
                raise ArtifactError(f"--resume: {self.work} holds no journal (its run was killed before it recorded "
                                    "one), so nothing can be resumed; rerun with --overwrite to start afresh")
            raise ArtifactError(f"--resume: no interrupted run found ({self.work / JOURNAL} does not exist)")
        if not resume and self.work.exists() and not overwrite:
            raise ArtifactError(
                f"{self.work} holds an unfinished run (interrupted, or stopped by an error); pass --resume to "
                "continue it or --overwrite to restart"
                if journal else f"{self.work} holds a run killed before it recorded anything to resume; pass "
                "--overwrite to restart")

    def prepare(self, resume: bool, overwrite: bool, protect: tuple[Path, ...] = ()) -> dict[str, Any] | None:
        """Create or reopen the work dir and take its lock; returns the journal when resuming."""
        self.check(resume, overwrite, protect)
        if resume:
            journal, problem = json_object(self.work / JOURNAL, ("layers", *JOURNAL_IDENTITY))
            if journal is not None and (writer := _other_writer(journal)):
                raise ArtifactError(f"--resume: {self.work} was written by {writer}, this is quantkit {__version__} "
                                    f"(journal format {JOURNAL_FORMAT}), whose layers could differ; rerun with "
                                    "--overwrite to start afresh, or resume with the quantkit that began the run")
            problem = problem or _journal_problem(journal)
            if problem:
                raise ArtifactError(f"--resume: {self.work / JOURNAL} is damaged ({problem}); rerun with "
                                    "--overwrite to start afresh")
            # what a resumed run takes from there: its journal, lock and the journal's layer shards; anything else
            # (an atomic write a kill cut short, a shard the journal never recorded, a stray file) is written again
            # or would reach the artifact
            self._lock = self._take(self.work)
            keep = {JOURNAL, LOCK} | {entry["shard"] for entry in journal["layers"].values()}
            for leftover in self.work.iterdir():
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover)
                elif leftover.name not in keep:
                    leftover.unlink()
            return journal
        self.work.parent.mkdir(parents=True, exist_ok=True)
        # made under a hidden name with its lock held, then renamed into place: no run sees it unlocked
        fresh = Path(tempfile.mkdtemp(prefix=f".{self.work.name}.new-", dir=self.work.parent))
        try:
            fresh.chmod(DIR_MODE)
            self._lock = self._take(fresh)
            if self.work.exists():  # checked replaceable above; locked again here, as another run could take it
                stale = self._take(self.work)
                try:
                    _trash(self.work)
                finally:
                    os.close(stale)
            try:
                fresh.rename(self.work)
            except OSError:  # another run's work dir appeared meanwhile (a non-empty directory is not replaced)
                raise ArtifactError(f"another quantkit run took {self.work} meanwhile; wait for it, or choose another "
                                    "output path") from None
        except BaseException:
            self.release()
            shutil.rmtree(fresh, ignore_errors=True)
            raise
        return None

    def _take(self, work: Path) -> int:
        """The lock of work dir `work`, held; an error if another run holds it."""
        fd = take_lock(work / LOCK)
        if fd is None:
            raise ArtifactError(f"another quantkit run ({lock_owner(work / LOCK) or 'a process of this host'}) "
                                f"is writing {self.work}; wait for it")
        return fd

    def release(self) -> None:
        """Let go of the run's lock (the process's end does as well)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def writer(self) -> str | None:
        """The live run whose lock is in the work dir ("pid N on HOST"), or None: this run, no lock, or the lock of a
        run that has ended (a kill leaves the file behind, not its flock). A stamp of another host counts as live:
        its pid cannot be checked."""
        return None if self._lock is not None else lock_owner(self.work / LOCK)

    def save_journal(self, journal: dict[str, Any]) -> None:
        atomic_write(self.work / JOURNAL, json.dumps(journal, indent=1))

    def commit(self) -> None:
        """Move the finished work dir into place, replacing an old output only now (when --overwrite: it is moved to
        a hidden sibling, then deleted). A kill at any point leaves the new output or a resumable work dir: the
        journal and lock go only once the work dir is the output."""
        old = None
        if self.final.exists():
            old = _trash_name(self.final)
            self.final.rename(old)
        self.work.rename(self.final)
        self._drop_run_files()
        self.release()
        if old is not None:
            _remove(old)

    def _drop_run_files(self) -> None:
        """Remove the journal and lock from a committed output."""
        for name in (JOURNAL, LOCK):
            (self.final / name).unlink(missing_ok=True)

    def _sweep(self) -> None:
        """Delete what killed runs left beside this output: trashed directories (`_trash`, `commit`), and the journal
        and lock of a commit killed right after its rename."""
        # beside a symlinked output, the link's too: what an --overwrite of the link itself once left
        for path in [self.final, self.work, *([self._link] if self._link else [])]:
            for stale in path.parent.glob(f".{glob.escape(path.name)}.trash-*"):
                _remove(stale)
        # a work dir a kill left before it was renamed into place; one of a live run is locked (or just made)
        for fresh in self.final.parent.glob(f".{glob.escape(self.work.name)}.new-*"):
            try:
                old = time.time() - fresh.stat().st_mtime > 60
            except OSError:  # gone meanwhile
                continue
            if old and not lock_held(fresh / LOCK):
                shutil.rmtree(fresh, ignore_errors=True)
        if (self.final / MANIFEST).is_file():
            self._drop_run_files()


# The shape of a journal and the meaning of what its layers hold: bumped when either changes, so that a run resumed
# by another quantkit is refused, not read as damaged or mixed with layers of other arithmetic. 3: "weights" stamps
# the config and tokenizer files too.
JOURNAL_FORMAT = 3


@dataclass(frozen=True)
class RunIdentity:
    """What a journal records of the run that began it, and a resumed run must share: otherwise its layers would
    be mixed with layers quantized from other weights, recipe, tokens, device or dtype."""

    model: str  # as the user named it
    weights: dict[str, list[int]]  # each checkpoint file's [size, mtime_ns], by name (pipeline's weights stamp)
    recipe: str  # the resolved recipe, as YAML
    calibration_sha256: str  # of the token windows
    device: str
    dtype: str  # what the checkpoint is read as

    def journal_fields(self) -> dict[str, Any]:
        """The fields as the journal holds them, with the recipe's sha256 beside its text."""
        return {**asdict(self), "recipe_sha256": hashlib.sha256(self.recipe.encode()).hexdigest()}

    def differences(self, journal: dict[str, Any]) -> list[str]:
        """How an interrupted run's journal differs from this identity, in words: the recipe by its fields (e.g.
        "calibration.num_samples 8 vs 4"), the weights by their files."""
        import yaml

        out = []
        for key, value in asdict(self).items():
            was = journal.get(key)
            if was == value:
                continue
            if key == "recipe":
                before, now = _flat(yaml.safe_load(was)), _flat(yaml.safe_load(value))
                changed = [f"{k} {before.get(k)!r} vs {now.get(k)!r}" for k in sorted(set(before) | set(now), key=str)
                           if before.get(k) != now.get(k)]
                out.append(f"recipe {', '.join(changed) or 'text'}")
            elif key == "weights":
                was = was if isinstance(was, dict) else {}
                changed = [f for f in sorted(set(was) | set(value)) if was.get(f) != value.get(f)]
                out.append(f"checkpoint files changed since ({', '.join(changed)})")
            else:
                out.append(f"{key.replace('_', ' ')} {was!r} vs {value!r}")
        return out


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A recipe's YAML as dotted keys ("passes.0.damp"), its passes by position."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def new_journal(identity: RunIdentity, threads: int) -> dict[str, Any]:
    """The journal of a fresh run with `identity`, on `threads` CPU threads, no layer done yet."""
    return {**identity.journal_fields(), "threads": threads, "quantkit_version": __version__,
            "journal_format": JOURNAL_FORMAT, "layers": {}}


def _other_writer(journal: dict[str, Any]) -> str:
    """Which other quantkit wrote `journal` ("quantkit 0.1.0 (journal format 1)"), or "" if this one did or the
    journal names no version (every quantkit's journal does: it is damaged)."""
    version, fmt = journal.get("quantkit_version"), journal.get("journal_format")
    if not isinstance(version, str) or (version == __version__ and fmt == JOURNAL_FORMAT):
        return ""
    return f"quantkit {version}" + (f" (journal format {fmt})" if fmt is not None else " (an earlier journal format)")


# What a journal records of its run (RunIdentity's fields, and the recipe's sha256), and of each layer.
_JOURNAL_TYPES: dict[str, type] = {
    **{name: get_origin(kind) or kind for name, kind in get_type_hints(RunIdentity).items()}, "recipe_sha256": str}
JOURNAL_IDENTITY = tuple(_JOURNAL_TYPES)
_JOURNAL_LAYER = {"shard": str, "sha256": str, "rel_error": (int, float), "seconds": (int, float), "notes": list,
                  "metrics": dict}


def _journal_problem(journal: dict[str, Any]) -> str:
    """What is wrong with a journal's identity fields or layers, or ""."""
    import yaml

    if bad := [key for key, kind in _JOURNAL_TYPES.items() if not isinstance(journal[key], kind)]:
        return f"{', '.join(bad)} of the wrong type"
    try:
        if not isinstance(yaml.safe_load(journal["recipe"]), dict):
            return "its recipe is not a YAML mapping"
    except yaml.YAMLError:
        return "its recipe is not valid YAML"
    if not isinstance(journal["layers"], dict):
        return "no layers"
    for index, entry in journal["layers"].items():
        bad = [key for key, kind in _JOURNAL_LAYER.items()
               if not (isinstance(entry, dict) and isinstance(entry.get(key), kind))]
        if bad:
            return f"layer {index} lacks {', '.join(bad)}"
    return ""


# The manifest's fields that readers (inspect, eval, validate) take, with their types: a manifest without one is
# damaged, and says so rather than failing in its reader.
_MANIFEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "model": str, "architecture": str, "num_layers": int, "recipe": str, "format": str, "weights": dict,
    "activations": (dict, type(None)), "kv_cache": (dict, type(None)), "calibration": dict, "layers": list,
    "timings": dict, "files": dict, "notes": list,
}
_NUMBER = (int, float)
# The fields inside those that readers use (inspect's summary, the weight specs), by the entry they sit in.
_ENTRY_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "calibration": {"source": str, "num_samples": int, "seq_len": int, "sha256": str},
    "activations": {"bits": int}, "kv_cache": {"bits": int},  # where not null
    "timings": {"total_seconds": _NUMBER},
    "weights.*": {"bits": int, "symmetric": bool, "granularity": str},
    "layers.*": {"index": int, "rel_error": _NUMBER, "seconds": _NUMBER, "metrics": dict},
    "files.*": {"bytes": int, "sha256": str},
}


def _manifest_problems(content: Any) -> list[str]:
    """What is wrong with a manifest's content, in words: the fields missing or of the wrong type, as dotted paths
    (e.g. "timings.total_seconds"), and any listed file that is not a plain name inside the artifact."""
    if not isinstance(content, dict):
        return ["not a JSON object"]
    wrong = [name for name, kind in _MANIFEST_FIELDS.items() if not isinstance(content.get(name, ...), kind)]
    if not wrong:
        for where, fields in _ENTRY_FIELDS.items():
            name, _, each = where.partition(".")
            value = content[name]
            if value is None:  # activations or kv_cache: none simulated
                continue
            entries = (value.items() if isinstance(value, dict) else enumerate(value)) if each else [(None, value)]
            for key, entry in entries:
                at = name if key is None else f"{name}.{key}"
                wrong += [f"{at}.{field}" for field, kind in fields.items()
                          if not (isinstance(entry, dict) and isinstance(entry.get(field, ...), kind))]
    if not wrong:  # what inspect shows where present: every layer metric a number, a resumed run's time
        wrong += [f"layers.{i}.metrics.{key}" for i, layer in enumerate(content["layers"])
                  for key, v in layer["metrics"].items() if isinstance(v, bool) or not isinstance(v, _NUMBER)]
        timings = content["timings"]
        if timings.get("resumed_layers") is not None:
            wrong += [f"timings.{key}" for key, kind in (("resumed_layers", int), ("resumed_layer_seconds", _NUMBER))
                      if isinstance(timings.get(key), bool) or not isinstance(timings.get(key), kind)]
    problems = [f"{', '.join(wrong)} missing or of the wrong type"] if wrong else []
    # a file entry names a file of the artifact itself, never a path out of it
    outside = [name for name in content.get("files") or {} if Path(name).name != name or name in ("", ".", "..")]
    return problems + ([f"files lists {', '.join(map(repr, outside))}, not file names of the artifact"]
                       if outside else [])


def read_artifact_json(path: Path, name: str, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON object in file `name` of artifact `path` (config.json, the shard index), holding `keys`, or an
    ArtifactError naming the file."""
    file = Path(path) / name
    content, problem = json_object(file, keys)
    if problem:
        raise ArtifactError(f"{file}: cannot read it ({problem}); the artifact is damaged (copy it again, or "
                            "quantize again)")
    return content


# config.json's torch_dtype: the dtypes an artifact's model can be (the dequantized weights' dtype).
MODEL_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def artifact_dtype(config: dict[str, Any]) -> torch.dtype:
    """The model dtype of an artifact's config.json (checked by `artifact_config`; float16 where it names none)."""
    return MODEL_DTYPES[config.get("torch_dtype") or "float16"]


def artifact_config(path: Path, manifest: dict) -> dict[str, Any]:
    """Artifact `path`'s config.json, which must name as many layers as its manifest wrote: a config edited or
    copied from another model would otherwise load a model with layers missing or left at random. Its model_type
    must be a string, its layer count an integer and its torch_dtype (if any) a floating dtype of MODEL_DTYPES."""
    config = read_artifact_json(path, "config.json", ("model_type", "num_hidden_layers"))
    wrong = [f"{key} is {config[key]!r}, not {what}" for key, what, ok in (
        ("model_type", "a string", isinstance(config["model_type"], str)),
        ("num_hidden_layers", "an integer",
         isinstance(config["num_hidden_layers"], int) and not isinstance(config["num_hidden_layers"], bool)),
        ("torch_dtype", f"one of {', '.join(MODEL_DTYPES)}", config.get("torch_dtype") in (None, *MODEL_DTYPES)),
    ) if key in config and not ok]
    if wrong:
        raise ArtifactError(f"{path / 'config.json'}: {'; '.join(wrong)}; the artifact is damaged (copy it again, or "
                            "quantize again)")
    if config["num_hidden_layers"] != manifest["num_layers"]:
        raise ArtifactError(f"{path}: config.json says {config['num_hidden_layers']} layers where the manifest wrote "
                            f"{manifest['num_layers']}; copy the artifact again, or quantize again")
    return config


def load_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a finished artifact, or an error saying what `path` is instead. Every file the manifest
    lists must be there with the size it records (a stat each, no hashing): a missing or truncated shard is an
    error that names it before anything reads the artifact."""
    manifest = Path(path) / MANIFEST
    partial = Path(str(path) + ".partial")
    unfinished = f"; {partial} holds an unfinished run (quantkit quantize ... --resume)" if partial.is_dir() else ""
    if not Path(path).exists():
        raise ArtifactError(f"{path} does not exist{unfinished}")
    if Path(path).is_file():
        raise ArtifactError(f"{path} is a file; pass the artifact's folder" + (
            f" ({Path(path).parent})" if Path(path).name == MANIFEST else ""))
    if not manifest.is_file():
        raise ArtifactError(f"{path} is not a quantkit artifact (no {MANIFEST}){unfinished}")
    try:
        content = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{manifest}: not a readable manifest ({exc})") from None
    if problems := _manifest_problems(content):
        raise ArtifactError(f"{manifest}: a damaged manifest ({'; '.join(problems)}); copy the artifact again, or "
                            "quantize again")
    bad = []
    for name, entry in content["files"].items():
        file = Path(path) / name
        if not file.is_file():
            bad.append(f"{name} is missing")
        elif (size := file.stat().st_size) != entry["bytes"]:
            bad.append(f"{name} has {size} bytes where {entry['bytes']} were written")
    if bad:
        raise ArtifactError(f"{path}: the artifact is incomplete or damaged: {'; '.join(bad)} "
                            f"(copy it again, or quantize again)")
    return content
