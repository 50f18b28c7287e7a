"""Open a checkpoint (local dir, hub id, or GGUF file) and read its tensors lazily, one layer at a time.

Only safetensors are read (never pickles). Every shard's header is validated up front, so a truncated or
corrupt file fails before any work starts, and every tensor read is checked for NaN/Inf.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from quantkit.errors import QuantkitError, dtype_name, some

try:  # transformers' configs validate their fields as huggingface_hub's strict dataclasses
    from huggingface_hub.errors import StrictDataclassError as _ConfigValidationError
except ImportError:  # pragma: no cover - an older huggingface_hub
    _ConfigValidationError = ValueError
from quantkit.files import DIR_MODE, FILE_MODE, atomic_write
from quantkit.models.adapters import ArchAdapter, adapter_for


class ModelError(QuantkitError):
    """The model could not be found, read or trusted."""


SAFETENSORS_DTYPES = {"F16", "BF16", "F32", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2"}


def check_safetensors(path: Path) -> dict[str, dict]:
    """Parse and validate a safetensors header (sizes, offsets, dtypes); returns the tensor entries, each with its
    data's byte range in the file as `file_offsets` beside the header's `data_offsets` (from the data's start)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelError(f"{path}: not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ModelError(f"{path}: corrupt or truncated safetensors (header says {n} bytes, file has {size})")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: corrupt safetensors header ({exc})") from None
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    data_size = size - 8 - n
    end = 0
    for name, entry in entries.items():
        try:
            start, stop = entry["data_offsets"]
            dtype = entry["dtype"]
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{path}: corrupt safetensors header entry for {name!r}") from None
        if dtype not in SAFETENSORS_DTYPES or not 0 <= start <= stop:
            raise ModelError(f"{path}: corrupt safetensors header entry for {name!r}")
        end = max(end, stop)
    if end != data_size:
        what = "truncated" if end > data_size else "corrupt (trailing bytes)"
        raise ModelError(f"{path}: {what} safetensors: tensors need {end} data bytes, file has {data_size}")
    for entry in entries.values():
        entry["file_offsets"] = [8 + n + offset for offset in entry["data_offsets"]]
    return entries


@dataclass
class ModelEdges:
    """The model-level tensors around the decoder blocks, in the checkpoint dtype, which transform passes may
    rewrite. `lm_head` is a separate tensor even for tied checkpoints; the export unties them only when they
    differ."""

    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def _declared_adapter(path: Path) -> ArchAdapter | None:
    """The adapter of the model_type config.json declares, read before transformers reads it, or an error naming the
    supported families where there is none: for a model_type transformers does not know, its error advises upgrading
    it. None where config.json cannot be read or declares none: transformers' reading then says what is wrong."""
    try:
        config = json.loads((path / "config.json").read_text())
        declared, architectures = config.get("model_type"), config.get("architectures")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(declared, str):
        return None
    named = isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    return adapter_for(declared, architectures if named else None)


class ModelSource:
    """A local Hugging Face checkpoint directory read lazily through safetensors."""

    def __init__(self, path: Path, trust_remote_code: bool = False, origin: str | None = None):
        self.path = path
        self.origin = origin or str(path)
        # this process dequantized a GGUF into the cache to open it (open_model): a conversion that holds the whole
        # model in memory at float32, once; a later run reads the cached copy
        self.converted = False
        declared = _declared_adapter(path)
        try:
            self.config: PretrainedConfig = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError, TypeError, _ConfigValidationError) as exc:
            raise ModelError(f"{path}: cannot read config.json ({' '.join(str(exc).split())})") from None
        if (positions := getattr(self.config, "max_position_embeddings", 2)) < 2:
            raise ModelError(f"{path}: config.json's max_position_embeddings is {positions}; a window needs 2 tokens "
                             "at least")
        self.adapter: ArchAdapter = declared or adapter_for(
            getattr(self.config, "model_type", "?"), getattr(self.config, "architectures", None)
        )
        self._where: dict[str, Path] = {}
        self._convert_to: torch.dtype | None = None  # read floating tensors as this dtype (`convert_to`)
        self._dtypes: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        files = sorted(p for p in path.glob("*.safetensors") if p.is_file())  # not a folder named like one
        if not files:
            pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
            hint = (
                f" It has {', '.join(pickles)}: quantkit never unpickles; convert them with "
                "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir2)` in a trusted environment."
                if pickles else ""
            )
            raise ModelError(f"{path}: no *.safetensors weights found.{hint}")
        index = _weight_map(path)
        if index is not None:  # the files the index names, as transformers reads them; others are not the model's
            files = sorted({path / name for name in index.values()})
        for file in files:
            for name, entry in check_safetensors(file).items():
                if index is not None and index.get(name) != file.name:
                    raise ModelError(f"{file}: holds {name}, which model.safetensors.index.json "
                                     + (f"puts in {index[name]}" if name in index else "does not list"))
                if name in self._where:
                    raise ModelError(f"{path}: {name} is in both {self._where[name].name} and {file.name} (a "
                                     "leftover of another save?); keep the files of one checkpoint")
                self._where[name] = file
                self._dtypes[name] = entry["dtype"]
                self._shapes[name] = tuple(entry.get("shape", ()))
        if index is not None and (unread := sorted(set(index) - set(self._where))):
            holders = sorted({index[n] for n in unread})
            raise ModelError(f"{path}: model.safetensors.index.json lists {some(unread, 3)}, which {some(holders, 3)} "
                             f"{'does' if len(holders) == 1 else 'do'} not hold")
        if getattr(self.config, "quantization_config", None) is None and (
                other := sorted(n for n, d in self._dtypes.items() if d not in _FLOAT_DTYPES)):
            raise ModelError(f"{path}: {some([f'{n} ({self._dtypes[n]})' for n in other], 3)} "
                             f"{'is' if len(other) == 1 else 'are'} not floating point; quantkit quantizes a "
                             "floating-point checkpoint (float16, bfloat16 or float32)")
        self.num_layers: int = int(self.config.num_hidden_layers)
        for i in range(self.num_layers):
            prefix = self.adapter.layer_prefix(i)
            if not any(n.startswith(prefix) for n in self._where):
                raise ModelError(f"{path}: weights of layer {i} ({prefix}*) are missing")
        self._check_against_config()

    def _check_against_config(self) -> None:
        """Every tensor the config's model has (built on the meta device: no memory), at its shape: a checkpoint
        that disagrees with its config.json (a bias it asks for, a width it names) fails here, not in a layer's
        forward after hours of others. An lm_head may be absent only where the config ties it to the embeddings.
        A quantized checkpoint (a quantization_config) is left to transformers' loader (eval checks what it lacks)."""
        from transformers import AutoModelForCausalLM

        if getattr(self.config, "quantization_config", None) is not None:
            return  # packed tensors in place of weights: what transformers' quantizer reads, not this model's
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a config's zero widths warn before the shapes below name them
                model = AutoModelForCausalLM.from_config(self.config)
        except (ValueError, TypeError, RuntimeError, ZeroDivisionError, KeyError) as exc:
            # KeyError: a name transformers looks up in its tables (hidden_act, a rope_type) that it lacks
            why = f"no {exc} known to transformers" if isinstance(exc, KeyError) else str(exc)
            raise ModelError(f"{self.path}: config.json does not describe a model transformers can build ({why})") \
                from None
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        if getattr(self.config, "tie_word_embeddings", False):
            expected.pop(self.adapter.lm_head + ".weight", None)
        missing = [name for name in expected if name not in self._shapes]
        # a tensor the model has no place for would be dropped (older checkpoints' RoPE buffers aside)
        extra = [name for name in self._shapes if name not in expected and not name.endswith("rotary_emb.inv_freq")
                 and name != self.adapter.lm_head + ".weight"]
        wrong = [f"{name} is {list(self._shapes[name])} where config.json makes {list(shape)}"
                 for name, shape in expected.items() if name in self._shapes and self._shapes[name] != shape]
        problems = ([f"it lacks {some(missing, 4)}"] if missing else []) + wrong[:4] + (
            [f"it holds {some(extra, 4)}, for which the model of config.json has no place"] if extra else [])
        if problems:
            raise ModelError(f"{self.path}: the weights do not match config.json: {'; '.join(problems)}")

    @property
    def checkpoint_dtype(self) -> torch.dtype:
        """The floating dtype the checkpoint stores (its embedding's)."""
        return _FLOAT_DTYPES.get(self._dtypes[self.adapter.embed + ".weight"], torch.float32)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the artifact's unquantized tensors and scales: the one `convert_to` set, else the
        checkpoint's (float16 for a float32 or float64 checkpoint, which `convert_to` should then be given)."""
        if self._convert_to is not None:
            return self._convert_to
        stored = self.checkpoint_dtype
        return stored if stored in (torch.float16, torch.bfloat16) else torch.float16

    @property
    def converts(self) -> bool:
        """Whether floating tensors are read as another dtype than the checkpoint's."""
        return self._convert_to is not None

    def convert_to(self, dtype: torch.dtype) -> None:
        """Read every floating tensor as `dtype` from now on, each checked to fit its range, as if the checkpoint
        stored `dtype` (the engines of some formats compute in float16 only)."""
        self._convert_to = None if dtype == self.checkpoint_dtype else dtype

    @property
    def tied_embeddings(self) -> bool:
        return self.adapter.lm_head + ".weight" not in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise ModelError(f"{self.origin}: tensor {name!r} not found in the checkpoint")
        return self._shapes[name]

    def names(self) -> list[str]:
        return list(self._where)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read the named tensors (grouped per shard, file closed after), checking each is finite."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self._where:
                raise ModelError(f"{self.origin}: tensor {name!r} not found in the checkpoint")
            by_file.setdefault(self._where[name], []).append(name)
        out = {}
        for file, group in by_file.items():
            try:
                with safe_open(file, framework="pt") as f:
                    for name in group:
                        out[name] = f.get_tensor(name)
            except (OSError, RuntimeError) as exc:
                raise ModelError(f"{file}: cannot read tensors ({exc})") from None
        for name, t in out.items():
            if t.is_floating_point() and not _all_finite(t):
                bad = ~torch.isfinite(t.reshape(len(t) if t.ndim else 1, -1))
                row, col = (int(i) for i in bad.nonzero()[0])
                raise ModelError(f"{self.origin}: tensor {name!r} has {int(bad.sum())} NaN/Inf value(s) (the first "
                                 f"at row {row}, column {col}); refusing to quantize it")
            if (t.is_floating_point() and self.narrows(t.dtype)
                    and (largest := _largest_magnitude(t)) > torch.finfo(self.dtype).max):
                raise self.out_of_range(name, largest, t.dtype)
            if self._convert_to is not None and t.is_floating_point() and t.dtype != self._convert_to:
                out[name] = t.to(self._convert_to)
        return out

    def narrows(self, stored: torch.dtype) -> bool:
        """Whether a tensor stored as `stored` holds values past the range of the run's dtype (`dtype`): a
        checkpoint converted to a narrower dtype, or one tensor of a float16 checkpoint stored wider (float32)."""
        return torch.finfo(stored).max > torch.finfo(self.dtype).max

    def out_of_range(self, name: str, largest: float, stored: torch.dtype) -> ModelError:
        """The error for tensor `name`, stored as `stored`, whose values reach `largest` in magnitude, past the
        range of the dtype the run reads it as."""
        target = dtype_name(self.dtype)
        way = ("--dtype bfloat16 keeps its range, with an export format that takes bfloat16"
               if self.dtype == torch.float16 else "no 16-bit dtype holds it")
        what = (f"so the checkpoint cannot be converted to {target}" if self.converts else
                f"the dtype of the checkpoint's other tensors, which the run computes in ({name!r} alone is stored "
                f"as {dtype_name(stored)})")
        return ModelError(f"{self.origin}: tensor {name!r} holds {largest:.6g}, past {target}'s range "
                          f"({torch.finfo(self.dtype).max:.6g}), {what}; {way}")

    def layer_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """All tensors of decoder layer `index`, keyed relative to the block (e.g. `self_attn.q_proj.weight`)."""
        prefix = self.adapter.layer_prefix(index)
        names = [n for n in self._where if n.startswith(prefix)]
        return {n[len(prefix):]: t for n, t in self.read(names).items()}

    def edges(self) -> ModelEdges:
        """Embeddings, final norm and lm_head (the embeddings again when tied)."""
        a = self.adapter
        names = [a.embed + ".weight", a.final_norm + ".weight"]
        if not self.tied_embeddings:
            names.append(a.lm_head + ".weight")
        t = self.read(names)
        embed = t[a.embed + ".weight"]
        return ModelEdges(embed, t[a.final_norm + ".weight"], t.get(a.lm_head + ".weight", embed))

    def non_layer_names(self) -> list[str]:
        return [n for n in self._where if not n.startswith(self.adapter.layers_prefix + ".")]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: Path, trust_remote_code: bool = False, what: str | None = None) -> Any:
    """The tokenizer saved beside the weights in `path` (`what` names the model in errors), or a ModelError that
    says what is missing: quantkit tokenizes calibration and evaluation text with the model's own tokenizer."""
    from transformers import AutoTokenizer

    what = what or str(path)
    need = ("quantkit tokenizes text with the model's own tokenizer (tokenizer.json, or tokenizer.model with "
            "tokenizer_config.json), saved beside the weights")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelError(f"{what}: no tokenizer beside the weights ({', '.join(_TOKENIZER_FILES)} are all missing); "
                         f"{need}")
    try:  # transformers raises for unreadable files, and makes an empty tokenizer where there are none
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        # without its vocabulary file a tokenizer still loads, holding its special tokens alone
        problem = "" if len(tokenizer) > len(set(tokenizer.all_special_ids)) else "no tokens but its special ones"
    except (OSError, ValueError, TypeError) as exc:
        problem = " ".join(str(exc).split())
    if problem:
        raise ModelError(f"{what}: no usable tokenizer beside the weights ({problem}); {need}")
    return tokenizer


def _weight_map(path: Path) -> dict[str, str] | None:
    """The tensor -> file map of `path`'s model.safetensors.index.json, or None where there is none; every file it
    names must be there."""
    index_file = path / "model.safetensors.index.json"
    if not index_file.is_file():
        return None
    try:
        weight_map = json.loads(index_file.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise ModelError(f"{index_file}: not a safetensors index ({exc})") from None
    if problem := weight_map_problem(path, weight_map):
        raise ModelError(f"{path}: {problem}")
    return weight_map


def weight_map_problem(path: Path, weight_map: Any) -> str:
    """What is wrong with `weight_map`, the map of tensor names to files of directory `path` in its
    model.safetensors.index.json (not such a map, or naming files that are not there), or "" where nothing is: a
    checkpoint's and an artifact's readers check theirs alike."""
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(k, str) and isinstance(v, str) and "/" not in v for k, v in weight_map.items())):
        return ("the weight_map of model.safetensors.index.json is not a mapping of tensor names to files of the "
                "directory")
    if missing := sorted({v for v in weight_map.values() if not (path / v).is_file()}):
        verb = "is" if len(missing) == 1 else "are"
        return f"{some(missing, 3)}, named by model.safetensors.index.json, {verb} missing"
    return ""


_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


class FiniteScan:
    """Checks every floating tensor of a checkpoint for NaN/Inf (and, where the source converts it to a narrower
    dtype, for values past that dtype's range) in a thread of its own, reading `scan_bytes` at a
    time into one buffer with plain file reads (a memory map would keep each tensor's pages in the process's RSS),
    the layers in order after the rest: a bad weight in a late layer then stops a run at its next layer rather than
    when that layer's turn comes, hours later on a large model. The run calls `raise_if_bad()` between layers and
    `stop()` at its end; it reads every tensor itself too, and reports any other read error."""

    SCAN_BYTES = 2 << 20

    def __init__(self, source: ModelSource, scan_bytes: int = SCAN_BYTES) -> None:
        a = source.adapter
        layers = [n for i in range(source.num_layers) for n in source.names() if n.startswith(a.layer_prefix(i))]
        names = source.non_layer_names() + layers
        self.error: ModelError | None = None
        self.checked = 0  # tensors checked so far
        self._buffer = bytearray(max(8, scan_bytes // 8 * 8))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source, names), name="quantkit-finite-scan",
                                        daemon=True)
        self._thread.start()

    def _run(self, source: ModelSource, names: list[str]) -> None:
        headers: dict[Path, dict[str, dict]] = {}
        try:
            for name in names:
                file = source._where[name]
                if file not in headers:
                    headers[file] = check_safetensors(file)
                if not self._check(source, name, file, headers[file][name]) or self._stop.is_set():
                    return
                self.checked += 1
        except Exception:  # the run's own reads name any file this one cannot read
            return

    def _check(self, source: ModelSource, name: str, file: Path, entry: dict) -> bool:
        """Whether tensor `name` is finite (integers always are); else sets `error` naming its first bad value."""
        dtype = _FLOAT_DTYPES.get(entry["dtype"])
        if dtype is None:
            return True
        start, stop = entry["file_offsets"]
        size = torch.finfo(dtype).bits // 8
        shape = entry.get("shape") or [1]
        cols = max(1, int(torch.Size(shape[1:]).numel()))
        view = memoryview(self._buffer)
        with open(file, "rb", buffering=0) as f:
            f.seek(start)
            for at in range(start, stop, len(self._buffer)):
                if self._stop.is_set():
                    return True
                got = f.readinto(view[:min(len(self._buffer), stop - at)])
                t = torch.frombuffer(self._buffer, dtype=dtype, count=got // size)
                if not _all_finite(t):
                    first = (at - start) // size + int((~torch.isfinite(t)).nonzero()[0, 0])
                    self.error = ModelError(f"{source.origin}: tensor {name!r} has a NaN/Inf value (the first at "
                                            f"row {first // cols}, column {first % cols}); refusing to quantize it")
                    return False
                if source.narrows(dtype) and (largest := _largest_magnitude(t)) > torch.finfo(source.dtype).max:
                    self.error = source.out_of_range(name, largest, dtype)
                    return False
        return True

    def raise_if_bad(self) -> None:
        """Raise the ModelError of the first non-finite tensor found so far, if any."""
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """End the scan (it stops at its next read) and wait for it."""
        self._stop.set()
        self._thread.join()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the scan has read every tensor (or found a bad one)."""
        self._thread.join(timeout)


def _largest_magnitude(t: torch.Tensor, chunk: int = 1 << 22) -> float:
    """max |t| in slices (no copy of the whole tensor)."""
    flat = t.reshape(-1)
    return max((float(part.abs().max()) for part in flat.split(chunk) if part.numel()), default=0.0)


def _all_finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """torch.isfinite(t).all() in slices, so checking an embedding never allocates a mask of its size."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(chunk))


def open_model(spec: str | os.PathLike, trust_remote_code: bool = False, cache_dir: Path | None = None) -> ModelSource:
    """Resolve MODEL (local dir, `.gguf` file or dir holding one, or hub id) into a local ModelSource."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":  # local models by their absolute path: the same however spelt
        return _open_gguf(path, trust_remote_code, cache_dir)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, trust_remote_code, origin=str(path.resolve()))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _open_gguf(ggufs[0], trust_remote_code, cache_dir)
        raise ModelError(
            f"{path}: not a model directory (no config.json"
            + (f"; several .gguf files, pass one of {', '.join(p.name for p in ggufs)}" if ggufs else "")
            + ")"
        )
    if path.exists():
        raise ModelError(f"{path}: expected a model directory or a .gguf file")
    looks_like_hub_id = str(spec).count("/") == 1 and not str(spec).startswith((".", "/", "~"))
    if not looks_like_hub_id:
        partial = Path(str(path) + ".partial")
        hint = (f"; {partial} holds an unfinished quantization (quantkit quantize ... -o {spec} --resume)"
                if partial.is_dir() else "")
        raise ModelError(f"{spec}: no such model directory or file{hint}")
    return ModelSource(_download(str(spec)), trust_remote_code, origin=str(spec))


def _download(repo_id: str) -> Path:
    """Fetch config, tokenizer and safetensors of a hub model (never pickles)."""
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        )
    except Exception as exc:  # offline, unknown repo, auth: all end in the same advice
        raise ModelError(
            f"{repo_id}: not a local path, and downloading it from the Hugging Face hub failed "
            f"({type(exc).__name__}). Offline, pass a local directory holding config.json, tokenizer files and "
            "*.safetensors, or a .gguf file."
        ) from None
    return Path(local)


def default_cache_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit"))


def _umask_permissions(directory: Path) -> None:
    """Give a finished temp dir (mkdtemp makes it 0700) and its files the modes a plain mkdir and open would, so
    the cache reads like any other directory for other users."""
    directory.chmod(DIR_MODE)
    for f in directory.iterdir():
        f.chmod(FILE_MODE)


def content_digest(path: Path, cache_dir: Path | None = None) -> str:
    """Hex sha256 of a file's bytes, memoized in the cache by (path, size, mtime).

    Caches keyed by content survive a copy, a move or a re-provisioned mount that gives the same bytes a new
    mtime; the memo keeps an unchanged file from being read again on every run.
    """
    stat = path.stat()
    memo_path = (cache_dir or default_cache_dir()) / "digests.json"
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = None
    if not isinstance(memo, dict):
        memo = {}  # no memo yet, or a damaged one: hashing again is always correct
    name = str(path.resolve())
    entry = memo.get(name)
    if isinstance(entry, dict) and {k: entry.get(k) for k in stamp} == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    memo[name] = {**stamp, "sha256": digest}
    with contextlib.suppress(OSError):  # a read-only cache only costs the next run a re-hash
        atomic_write(memo_path, json.dumps(memo, indent=1, sort_keys=True))
    return digest


# What a GGUF file's metadata must say of its architecture for transformers to build the model it holds: without
# them transformers falls back to its defaults (a Llama of 7B's size), and dequantizing took 22 GB for a file of
# one small tensor before the memory ran out.
_GGUF_HYPERPARAMETERS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")


def _check_gguf(gguf: Path) -> None:
    """Parse the GGUF file's header, metadata and tensor table (memory-mapped, about a second): a damaged one is
    named as such here, where transformers would report a failure of its own ("not a valid JSON file"); and refuse,
    before transformers builds anything, an architecture quantkit has no adapter for and metadata that lacks the
    model's size or disagrees with its tensors."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover
        raise ModelError(f"reading GGUF needs the gguf package: {exc}") from None
    try:
        reader = GGUFReader(gguf)
        fields = {name: field.contents() for name, field in reader.fields.items()}
        shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    except Exception as exc:  # the parser fails on damaged bytes in any of its own ways
        raise ModelError(f"{gguf}: not a readable GGUF file, damaged or truncated ({type(exc).__name__}: {exc}); "
                         "download it again") from None
    arch = fields.get("general.architecture")
    try:
        adapter_for(str(arch))
    except QuantkitError as exc:
        raise ModelError(f"{gguf}: {exc} (its general.architecture)") from None
    if missing := [f"{arch}.{key}" for key in _GGUF_HYPERPARAMETERS if f"{arch}.{key}" not in fields]:
        raise ModelError(f"{gguf}: its metadata lacks {', '.join(missing)}, so the size of the model it holds is "
                         "unknown; convert the checkpoint again with llama.cpp's convert_hf_to_gguf.py")
    blocks, width = int(fields[f"{arch}.block_count"]), int(fields[f"{arch}.embedding_length"])
    embed = shapes.get("token_embd.weight")
    problems = ([] if embed and embed[0] == width else
                [f"token_embd.weight is {embed or 'missing'} where {arch}.embedding_length makes {width} columns"])
    layers = {int(name.split(".")[1]) for name in shapes if name.startswith("blk.") and name.split(".")[1].isdigit()}
    if layers != set(range(blocks)):
        problems.append(f"its tensors hold {len(layers)} blocks where {arch}.block_count says {blocks}")
    if problems:
        raise ModelError(f"{gguf}: the metadata does not match the tensors: {'; '.join(problems)}")


def _open_gguf(gguf: Path, trust_remote_code: bool, cache_dir: Path | None) -> ModelSource:
    """A GGUF file's cached float16 copy as a ModelSource, converted first where no copy is cached."""
    cache_dir = cache_dir or default_cache_dir()
    cached = _cached_gguf(gguf, cache_dir)
    source = ModelSource(cached or _convert_gguf(gguf, cache_dir), trust_remote_code, origin=str(gguf.resolve()))
    source.converted = cached is None
    return source


def _cached_gguf(gguf: Path, cache_dir: Path) -> Path | None:
    """The complete cached copy of a GGUF file's bytes (under any file name), if there is one."""
    key = content_digest(gguf, cache_dir)[:16]
    for done in sorted((cache_dir / "gguf").glob(f"*-{key}")):
        if (done / "config.json").is_file():
            return done
    return None


def gguf_to_safetensors(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Dequantize a GGUF file through transformers once, caching a float16 safetensors copy keyed by its content.

    The conversion holds the whole model in memory (transformers dequantizes GGUF to float32); quantization
    afterwards streams from the cache like any checkpoint.
    """
    cache_dir = cache_dir or default_cache_dir()
    return _cached_gguf(gguf, cache_dir) or _convert_gguf(gguf, cache_dir)


def _convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """gguf_to_safetensors' conversion, where the cache holds no copy yet."""
    target = cache_dir / "gguf" / f"{gguf.stem}-{content_digest(gguf, cache_dir)[:16]}"
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover
        raise ModelError(f"reading GGUF needs transformers and gguf: {exc}") from None
    _check_gguf(gguf)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:
        raise ModelError(f"{gguf}: transformers could not read this GGUF file ({exc})") from None
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF block quantization is undone; the copy is plain float16
    config.dtype = torch.float16
    state = {k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    # a temp dir of this process's own, so that two runs converting the same file at once cannot collide
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        from safetensors.torch import save_file

        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        _umask_permissions(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # another run finished the same conversion first; its copy is the same, so keep it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
