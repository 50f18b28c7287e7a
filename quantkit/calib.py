"""Calibration data: token windows from a local file or a named set, sampled deterministically from a seed.

Sources
  - ``.txt``: one document per line; line ends are removed, lines that are empty or only whitespace are
    skipped (they separate nothing and hold no text), everything else is kept verbatim.
  - ``.jsonl`` / ``.json`` (JSON lines): one object per line, the document is ``obj[text_field]``. Rows are
    kept verbatim, empty strings included, so ``"\\n\\n".join(rows)`` matches the HF/GPTQ protocol (WikiText).
    A ``.json`` file may instead hold one JSON array of such objects (read whole, not streamed).
  - ``.parquet`` (pyarrow): the ``text_field`` column, nulls skipped.
  - The text formats may be compressed: ``.gz``, or ``.zst`` when the ``zstandard`` package is installed.
  - A named set (``pileval``, ``c4``, ``wikitext2``, ``tinystories``): a YAML file in ``calib/`` lists the file
    names looked up under the data dir (argument, else ``$QUANTKIT_DATA_DIR``), then the Hugging Face Hub location
    fetched with ``hf_hub_download`` (from the local cache only when ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``
    is set, or the Hub cannot be reached).

Token stream: documents in file order joined with ``"\\n\\n"`` and tokenized in ONE call with
``add_special_tokens=False`` — no BOS at the start of the stream or of any window (a window starting mid-text
with a BOS would not look like anything the model saw in training). Only a prefix of the file is read: enough
documents for the request (``"first"``) or for ``RANDOM_POOL_FACTOR`` times it (``"random"``), or all of it.

Sampling
  - ``"first"``: the first ``num_samples`` non-overlapping windows of ``seq_len`` tokens (benchmark protocol).
  - ``"random"``: GPTQ-style; ``random.Random(seed)`` draws ``num_samples`` start offsets uniformly in
    ``[0, len(stream) - seq_len]`` of the joined stream (not per document), so windows may cross document
    boundaries and may overlap. The windows depend on (file, tokenizer, num_samples, seq_len, seed).

``CalibrationSet.sha256`` = sha256 of ``struct.pack("<qq", num_samples, seq_len)`` followed by the tokens as
int64 little-endian bytes in row-major order (see ``token_sha256``); it is recorded in the artifact so that a
rerun can be checked token for token.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import json
import os
import random
import socket
import struct
import warnings
import zlib
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import torch
import yaml

from quantkit.errors import QuantkitError, not_a_directory
from quantkit.files import DATA_DIR_ENV, json_objects, resolve_data_dir
from quantkit.resources import data_path

DOC_SEPARATOR = "\n\n"
SAMPLING_MODES = ("random", "first")
RANDOM_POOL_FACTOR = 4  # "random" draws windows from the first ~4x the requested tokens (or the whole file)
SELF_GENERATED = "self-generated"

_TEXT_FORMATS = (".txt", ".jsonl", ".json")
_FORMATS = (*_TEXT_FORMATS, ".parquet")
_COMPRESSIONS = (".gz", ".zst")
_CHARS_PER_TOKEN_GUESS = 4  # first guess of how much text to read; corrected from the measured rate
_NAMED_SET_KEYS = {"name", "description", "text_field", "local", "hub"}


class CalibrationError(QuantkitError):
    """Calibration data cannot be found, read, or cut into the requested windows."""


@dataclass(frozen=True)
class CalibrationSet:
    """Token windows [num_samples, seq_len] (int64), their origin, sampling and hash."""

    tokens: torch.Tensor
    source: str
    sampling: str
    seed: int
    sha256: str


@dataclass(frozen=True)
class NamedSet:
    """A named calibration set as described by ``calib/<name>.yaml``."""

    name: str
    description: str
    text_field: str
    local: tuple[str, ...]  # file names relative to the data dir, first match wins
    hub_repo_id: str
    hub_filename: str
    hub_revision: str | None = None


def token_sha256(tokens: torch.Tensor) -> str:
    """Hex sha256 of a [n, L] token tensor: ``pack("<qq", n, L)``, then int64 LE values, row-major."""
    if tokens.dim() != 2:
        raise ValueError(f"expected a [num_samples, seq_len] tensor, got shape {tuple(tokens.shape)}")
    array = tokens.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8", copy=False)
    digest = hashlib.sha256(struct.pack("<qq", *array.shape))
    digest.update(array.tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------- named sets


def named_sets() -> list[str]:
    """Names of the bundled calibration sets (the YAML files in ``calib/``), sorted."""
    return sorted(p.stem for p in data_path("calib").glob("*.yaml"))


def load_named_set(name: str) -> NamedSet:
    """Parse and validate ``calib/<name>.yaml``; unknown names raise an error listing the sets."""
    known = named_sets()
    if name not in known:
        raise CalibrationError(f"unknown calibration set {name!r}; known sets: {', '.join(known)} "
                               "(or pass a .txt/.jsonl/.parquet file)")
    path = data_path("calib") / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    problems = []
    if not isinstance(raw, dict):
        raise CalibrationError(f"{path}: expected a mapping, got {type(raw).__name__}")
    if unknown := sorted(set(raw) - _NAMED_SET_KEYS):
        problems.append(f"unknown keys {unknown} (allowed: {sorted(_NAMED_SET_KEYS)})")
    hub = raw.get("hub")
    local = raw.get("local")
    if raw.get("name") != name:
        problems.append(f"name is {raw.get('name')!r}, expected {name!r} (the file stem)")
    if not isinstance(local, list) or not local or not all(isinstance(x, str) for x in local):
        problems.append("local must be a non-empty list of file names")
    if not isinstance(hub, dict) or not isinstance(hub.get("repo_id"), str) or not isinstance(
            hub.get("filename"), str) or set(hub) - {"repo_id", "filename", "revision"}:
        problems.append("hub must be a mapping with repo_id, filename and optionally revision")
    if problems:
        raise CalibrationError(f"{path} is not a valid calibration set: " + "; ".join(problems))
    return NamedSet(
        name=name, description=str(raw.get("description", "")).strip(),
        text_field=str(raw.get("text_field", "text")), local=tuple(local),
        hub_repo_id=hub["repo_id"], hub_filename=hub["filename"], hub_revision=hub.get("revision"),
    )


def _find_local(spec: NamedSet, root: Path | None) -> Path | None:
    if root is not None:
        for relative in spec.local:
            if (root / relative).is_file():
                return root / relative
    return None


def _hub_offline() -> bool:
    return any(os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_named_set(name: str, data_dir: str | Path | None = None) -> Path:
    """Local file of a named set: data dir, else ``hf_hub_download`` (cache only when offline).

    Raises CalibrationError naming the file to pass with ``--calib`` or the data dir layout to provide.
    """
    spec = load_named_set(name)
    root = resolve_data_dir(data_dir)
    local = _find_local(spec, root)
    if local is not None:
        return local
    offline = _hub_offline()
    unreachable = None if offline else _hub_unreachable()
    cache_only = offline or unreachable is not None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(spec.hub_repo_id, spec.hub_filename, repo_type="dataset",
                                    revision=spec.hub_revision, local_files_only=cache_only))
    except Exception as exc:  # offline, DNS/connection/HTTP errors, missing package: all mean "not reachable"
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        if offline:
            hub_state = "HF_HUB_OFFLINE is set and it is not in the local cache"
        elif unreachable:
            hub_state = f"{unreachable} and it is not in the local cache"
        else:
            hub_state = f"download failed ({why})"
        raise CalibrationError(_not_found_message(spec, root, hub_state)) from exc


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hub endpoint cannot be reached over TCP (DNS, connect), or None; not checked behind a proxy.

    huggingface_hub retries a failed request 5 times with backoff (~25 s); this probe fails at once.
    """
    if any(os.environ.get(var) for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    url = urlsplit(constants.ENDPOINT)
    if not url.hostname:
        return None
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
    except OSError as exc:
        return f"{url.hostname} is unreachable ({exc})"
    return None


def _not_found_message(spec: NamedSet, root: Path | None, hub_state: str) -> str:
    if root is None:
        where = f"no data dir given (--data-dir or ${DATA_DIR_ENV})"
    elif not root.is_dir():
        where = f"data dir {root} {not_a_directory(root)}"
    else:
        where = f"none of its files is under data dir {root}"
    layout = "\n".join(f"    <data dir>/{relative}" for relative in spec.local)
    return (
        f"calibration set {spec.name!r} is not available: {where}, and the Hugging Face Hub copy "
        f"(dataset {spec.hub_repo_id}, file {spec.hub_filename}) could not be used: {hub_state}.\n"
        f"Either pass a local text file with --calib PATH (.txt one document per line, .jsonl/.parquet "
        f"with a {spec.text_field!r} field), e.g. --calib <data dir>/{spec.local[0]}, or provide one of\n"
        f"{layout}\nand pass --data-dir <data dir> (or set {DATA_DIR_ENV}=<data dir>)."
    )


# ---------------------------------------------------------------------------------------------- reading files


def _formats(path: Path) -> tuple[str, str | None]:
    """(format suffix, compression suffix or None) of a calibration file name."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes.pop() if suffixes and suffixes[-1] in _COMPRESSIONS else None
    fmt = suffixes[-1] if suffixes else ""
    if fmt not in _FORMATS or (compression and fmt == ".parquet"):
        raise CalibrationError(
            f"{path}: unsupported calibration file type; use .txt (one document per line), .jsonl/.json "
            f"(JSON lines with a text field, or a .json array of such objects) or .parquet, the text ones "
            f"optionally compressed as .gz or .zst"
        )
    return fmt, compression


def _open_text(path: Path, compression: str | None) -> IO[str]:
    if compression == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if compression == ".zst":
        try:
            import zstandard
        except ImportError as exc:
            raise CalibrationError(
                f"{path} is zstd-compressed and the `zstandard` package is not installed: decompress it once "
                f"(`zstd -d {path}`) and pass the uncompressed file, or install zstandard"
            ) from exc
        raw = zstandard.ZstdDecompressor().stream_reader(path.open("rb"))
        return io.TextIOWrapper(raw, encoding="utf-8")
    return path.open(encoding="utf-8")


def iter_documents(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """Yield the documents of a calibration file lazily, in file order (rules in the module docstring)."""
    path = Path(path)
    fmt, compression = _formats(path)
    if fmt == ".parquet":
        yield from _iter_parquet(path, text_field)
        return
    with _open_text(path, compression) as handle:
        try:
            if fmt == ".txt":
                for line in handle:
                    if line.strip():
                        yield line.rstrip("\r\n")
            elif fmt == ".json":
                head = []  # the lines up to the first that is not blank: JSON lines, or an array's opening
                for line in handle:
                    head.append(line)
                    if line.strip():
                        break
                lines = itertools.chain(head, handle)
                if head and head[-1].lstrip().startswith("["):
                    yield from _iter_json_array("".join(lines), path, text_field)
                else:
                    yield from _iter_jsonl(lines, path, text_field)
            else:
                yield from _iter_jsonl(handle, path, text_field)
        except UnicodeDecodeError as exc:
            raise CalibrationError(f"{path} is not UTF-8 text ({exc})") from exc
        except (OSError, EOFError, zlib.error) as exc:  # truncated or corrupt .gz (damaged deflate data: zlib.error)
            raise CalibrationError(f"cannot read {path}: {exc}") from exc


_FIELD_FIX = "choose the field with the recipe's calibration.text_field"


def _document(value: Any, where: str, text_field: str) -> str | None:
    """The document held in `text_field` of a JSON row (`where`: its file and position); None for a null."""
    if value is None or isinstance(value, str):
        return value
    raise CalibrationError(f"{where}: field {text_field!r} is {type(value).__name__}, not text")


def _iter_jsonl(lines: Iterable[str], path: Path, text_field: str) -> Iterator[str]:
    for number, row in json_objects(lines, path, (text_field,), CalibrationError, fix=_FIELD_FIX):
        if (document := _document(row[text_field], f"{path}, line {number}", text_field)) is not None:
            yield document


def _iter_json_array(text: str, path: Path, text_field: str) -> Iterator[str]:
    """The documents of a .json file holding one array of objects (as `datasets`' `to_json(lines=False)` writes)."""
    try:
        rows = json.loads(text)  # a list: the text opens with "["
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path} opens a JSON array that does not parse: {exc}") from None
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or text_field not in row:
            found = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
            raise CalibrationError(f"{path}, array element {index}: no field {text_field!r} (found {found}); "
                                   + _FIELD_FIX)
        if (document := _document(row[text_field], f"{path}, array element {index}", text_field)) is not None:
            yield document


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise CalibrationError(f"cannot read {path} as parquet: {exc}") from exc
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise CalibrationError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); "
                               "choose the column with the recipe's calibration.text_field")
    column_type = parquet.schema_arrow.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise CalibrationError(f"{path}: column {text_field!r} has type {column_type}, not string")
    try:  # a damaged data page fails here, past the footer that ParquetFile read
        for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
            for value in batch.column(0).to_pylist():
                if value is not None:
                    yield value
    except (OSError, pa.ArrowException) as exc:
        raise CalibrationError(f"cannot read {path} as parquet: {exc}") from exc


# ---------------------------------------------------------------------------------------------- tokenizing


def _encode(tokenizer: Any, text: str) -> list[int]:
    # verbose=False: the stream is longer than model_max_length on purpose; windows are cut afterwards.
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _token_stream(path: Path, text_field: str, tokenizer: Any, target: int) -> list[int]:
    """The first ``target`` token ids of ``"\\n\\n".join`` of the documents, or all of them where the text holds fewer.
    The documents are read in chunks sized by a guess of the characters per token, and the ids past ``target`` are
    cut: how far a chunk ran is no part of the result, which depends only on (file, tokenizer, target).

    A prefix that falls short is extended and re-tokenized as one string, so the ids are those of a single
    tokenizer call: tokenizing documents separately would add a word-start piece to each (sentencepiece).
    """
    with closing(iter_documents(path, text_field)) as documents:
        return _read_until(documents, path, text_field, tokenizer, target)[:target]


def _read_until(documents: Iterator[str], path: Path, text_field: str, tokenizer: Any,
                target: int) -> list[int]:
    taken: list[str] = []
    chars = 0
    has_text = False
    budget = target * _CHARS_PER_TOKEN_GUESS
    while True:
        exhausted = True
        for doc in documents:
            taken.append(doc)
            chars += len(doc) + len(DOC_SEPARATOR)
            has_text = has_text or bool(doc.strip())
            if chars >= budget:
                exhausted = False
                break
        if exhausted and not has_text:
            in_field = "" if _formats(path)[0] == ".txt" else f" in field {text_field!r}"
            raise CalibrationError(f"calibration file {path} is empty: it holds no text{in_field}")
        ids = _encode(tokenizer, DOC_SEPARATOR.join(taken))
        if len(ids) >= target or exhausted:
            return ids
        chars_per_token = chars / max(len(ids), 1)
        budget = max(int(1.5 * chars), int(1.2 * target * chars_per_token) + 1)


def _check_request(num_samples: int, seq_len: int, sampling: str) -> None:
    if sampling not in SAMPLING_MODES:
        raise CalibrationError(f"unknown sampling {sampling!r}; use one of {', '.join(SAMPLING_MODES)}")
    if num_samples < 1 or seq_len < 1:
        raise CalibrationError(f"num_samples and seq_len must be positive, got {num_samples} and {seq_len}")


def sample_windows(ids: list[int], *, num_samples: int, seq_len: int, seed: int, sampling: str,
                   origin: str = "the token stream") -> torch.Tensor:
    """Cut [num_samples, seq_len] windows from a token stream, "first" in order or "random" from ``seed``."""
    _check_request(num_samples, seq_len, sampling)
    total = len(ids)
    if total < seq_len:
        raise CalibrationError(f"{origin} is too short: {total} tokens found, but one window needs {seq_len} "
                               "tokens (seq_len); use a longer file or a smaller --seq-len")
    if sampling == "first":
        available = total // seq_len
        if available < num_samples:
            raise CalibrationError(
                f"{origin} has {total} tokens: {available} non-overlapping windows of {seq_len}, fewer than "
                f"the {num_samples} requested (num_samples); use a longer file, fewer samples or 'random' "
                "sampling"
            )
        return torch.tensor(ids[: num_samples * seq_len], dtype=torch.long).view(num_samples, seq_len)
    if total < num_samples * seq_len:
        warnings.warn(f"{origin} has {total} tokens, fewer than {num_samples} x {seq_len}: the random "
                      "calibration windows necessarily overlap", stacklevel=3)
    rng = random.Random(seed)
    starts = [rng.randrange(total - seq_len + 1) for _ in range(num_samples)]
    return torch.tensor([ids[s: s + seq_len] for s in starts], dtype=torch.long)


def names_a_set(source: str | Path) -> bool:
    """Whether calibration source `source` is a named set: one's bare name (a path with a folder is a file)."""
    name = str(source)
    return name in named_sets() and "/" not in name and os.sep not in name


def _resolve_source(source: str | Path, data_dir: str | Path | None,
                    text_field: str) -> tuple[Path, str, str]:
    """(file to read, text field, description for the artifact) of a file path or named set. A set's bare name is
    the set even where the working directory holds a file or folder of that name: the set's own folder, when run
    from the data dir (a file without a suffix is no calibration file quantkit reads)."""
    path = Path(source).expanduser()
    name = str(source)
    named = names_a_set(name)
    if not named and path.is_file():
        return path, text_field, str(path.resolve())
    if not named and path.is_dir():
        raise CalibrationError(f"calibration source {source} is a directory; pass a file, or a named set "
                               "with --data-dir")
    if not named and (path.suffix or len(path.parts) > 1):
        raise CalibrationError(f"calibration file {source} does not exist")
    spec = load_named_set(name)  # an unknown name raises, listing the known sets
    found = resolve_named_set(name, data_dir)
    return found, spec.text_field, f"{name}:{found.resolve()}"


def load_calibration(
    source: str | Path | None,
    tokenizer: Any,
    *,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    sampling: str = "random",
    text_field: str = "text",
    data_dir: str | Path | None = None,
    default_set: str | None = None,
) -> CalibrationSet:
    """Token windows [num_samples, seq_len] from a file or named set (None: ``default_set``), seeded.

    ``text_field`` applies to .jsonl/.parquet files; a named set uses the field its YAML names.
    """
    _check_request(num_samples, seq_len, sampling)
    chosen = source if source is not None else default_set
    if chosen is None or not str(chosen).strip():
        raise CalibrationError("no calibration data: pass --calib FILE or a named set "
                               f"({', '.join(named_sets())})")
    path, field, described = _resolve_source(chosen, data_dir, text_field)
    needed = num_samples * seq_len
    target = needed if sampling == "first" else RANDOM_POOL_FACTOR * needed
    ids = _token_stream(path, field, tokenizer, target)
    tokens = sample_windows(ids, num_samples=num_samples, seq_len=seq_len, seed=seed, sampling=sampling,
                            origin=f"calibration file {path}")
    return CalibrationSet(tokens=tokens, source=described, sampling=sampling, seed=seed,
                          sha256=token_sha256(tokens))


# -------------------------------------------------------------------------------------------- self-generated


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def generate_calibration(
    model: Any,
    tokenizer: Any,
    *,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    temperature: float = 1.0,
    top_k: int = 50,
    batch_size: int = 8,
) -> CalibrationSet:
    """Data-free calibration (LLM-QAT style): sequences sampled from BOS by the causal LM itself, seeded.

    Every row is BOS + (seq_len - 1) sampled tokens: EOS is suppressed with min_new_tokens = max_new_tokens.
    The global RNG is forked, so the caller's random state is untouched; rows depend on seed and batch_size.
    """
    from transformers import GenerationConfig

    if num_samples < 1 or seq_len < 2:
        raise CalibrationError(f"self-generated calibration needs num_samples >= 1 and seq_len >= 2, "
                               f"got {num_samples} and {seq_len}")
    gen_config = getattr(model, "generation_config", None)
    bos = _first_id(getattr(tokenizer, "bos_token_id", None))
    if bos is None:
        bos = _first_id(getattr(gen_config, "bos_token_id", None))
    eos = getattr(gen_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if bos is None:
        bos = _first_id(eos)
    if bos is None:
        raise CalibrationError("cannot self-generate calibration text: the tokenizer has no BOS (or EOS) "
                               "token to start from; pass --calib FILE")
    pad = _first_id(getattr(tokenizer, "pad_token_id", None))
    pad = pad if pad is not None else (_first_id(eos) if eos is not None else bos)
    config = GenerationConfig(
        do_sample=True, temperature=temperature, top_k=top_k, top_p=1.0,
        min_new_tokens=seq_len - 1, max_new_tokens=seq_len - 1,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
    )
    device = next(model.parameters()).device
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    was_training = model.training
    model.eval()
    rows = []
    try:
        with torch.random.fork_rng(devices=rng_devices), torch.inference_mode():
            torch.manual_seed(seed)
            for start in range(0, num_samples, batch_size):
                count = min(batch_size, num_samples - start)
                prompt = torch.full((count, 1), bos, dtype=torch.long, device=device)
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
                rows.append(out[:, :seq_len].to("cpu", torch.long))
    finally:
        model.train(was_training)
    tokens = torch.cat(rows)
    if tuple(tokens.shape) != (num_samples, seq_len):
        raise CalibrationError(
            f"generation returned shape {tuple(tokens.shape)}, expected ({num_samples}, {seq_len})")
    sampling = f"generate(temperature={temperature}, top_k={top_k}, batch_size={batch_size})"
    return CalibrationSet(tokens=tokens, source=SELF_GENERATED, sampling=sampling, seed=seed,
                          sha256=token_sha256(tokens))
