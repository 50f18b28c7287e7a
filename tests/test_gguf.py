"""GGUF input: dequantized once through transformers into a cached float16 checkpoint that streams like any other."""

from __future__ import annotations

import os
import shutil
import stat
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from quantkit.models.source import ModelError, gguf_to_safetensors, open_model
from tests.conftest import shared_path

GGUF = "models/smollm2-135m-instruct-q4_1/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A cache dir holding the converted GGUF (one conversion for the module's tests)."""
    path = tmp_path_factory.mktemp("gguf-cache")
    gguf_to_safetensors(shared_path(GGUF), path)
    return path


def test_gguf_opens_as_a_float16_checkpoint(cache):
    source = open_model(shared_path(GGUF), cache_dir=cache)
    assert source.config.model_type == "llama" and source.num_layers == 30
    assert source.dtype == torch.float16 and source.tied_embeddings
    q = source.layer_tensors(0)["self_attn.q_proj.weight"]
    assert q.dtype == torch.float16 and q.shape == (576, 576)
    # a second open reuses the cached copy instead of converting again, and says it did not convert
    cached = next((cache / "gguf").iterdir())
    mtime = (cached / "model.safetensors").stat().st_mtime_ns
    again = open_model(shared_path(GGUF), cache_dir=cache)
    assert again.path == cached and not again.converted and not source.converted
    assert (cached / "model.safetensors").stat().st_mtime_ns == mtime
    # the cache entry has the modes mkdir and open give, not the temp dir's private 0700 / 0600
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(cached.stat().st_mode) == 0o777 & ~mask
    assert {stat.S_IMODE(f.stat().st_mode) for f in cached.iterdir()} == {0o666 & ~mask}


def test_gguf_conversions_racing_for_one_cache_entry_both_succeed(cache, tmp_path, monkeypatch):
    """Two runs started at once on one GGUF (two benchmarks, say) each convert it; the one that finishes second
    keeps the first one's copy and leaves no temp dir behind."""
    gguf = shared_path(GGUF)
    finished = next((cache / "gguf").iterdir())
    target = tmp_path / "cache" / "gguf" / finished.name
    write = safetensors.torch.save_file

    def other_run_finishes_meanwhile(*args, **kwargs):
        shutil.copytree(finished, target)
        write(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", other_run_finishes_meanwhile)
    assert gguf_to_safetensors(gguf, tmp_path / "cache") == target
    assert [p.name for p in target.parent.iterdir()] == [target.name]
    assert (target / "config.json").is_file()


def test_an_open_that_converts_says_so(cache, tmp_path, monkeypatch):
    """A GGUF opened without a cached copy is converted, and the source says so (the summary then puts a peak RSS
    that the conversion set on it); opened again, from the copy, it is not."""
    import quantkit.models.source as source_module

    finished = next((cache / "gguf").iterdir())
    calls = []

    def convert(gguf, cache_dir=None):  # the conversion, as a copy of the module's finished one
        calls.append(gguf)
        return Path(shutil.copytree(finished, cache_dir / "gguf" / finished.name))

    monkeypatch.setattr(source_module, "_convert_gguf", convert)
    first = open_model(shared_path(GGUF), cache_dir=tmp_path)
    second = open_model(shared_path(GGUF), cache_dir=tmp_path)
    assert (first.converted, second.converted, len(calls)) == (True, False, 1)


def test_gguf_cache_follows_the_file_bytes(cache, tmp_path, monkeypatch):
    """The same GGUF copied elsewhere (new path, new mtime: a re-provisioned mount) reuses the converted copy
    instead of dequantizing again; the cache is keyed by content, not by where the file is or when it was touched."""
    import transformers

    copy = tmp_path / "moved.gguf"
    shutil.copyfile(shared_path(GGUF), copy)
    os.utime(copy, ns=(1, 1))

    def no_conversion(*_, **__):
        raise AssertionError("GGUF converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    converted = next((cache / "gguf").iterdir())
    assert gguf_to_safetensors(copy, cache) == converted


def test_a_resumed_run_stamps_the_gguf_file_not_its_cached_copy(cache):
    """A resume compares the model's files by size and mtime: for a GGUF model those of the GGUF file itself, so a
    cache rebuilt since the interruption (a new mtime on the dequantized copy) does not refuse the resume."""
    from quantkit.pipeline import _weights_stamp

    gguf = shared_path(GGUF)
    stamp = _weights_stamp(open_model(gguf, cache_dir=cache))
    assert stamp == {gguf.name: [gguf.stat().st_size, gguf.stat().st_mtime_ns]}


def test_a_damaged_gguf_file_is_named_as_such(tmp_path):
    """Bytes that are no GGUF, a header cut short, a tensor count corrupted and a file cut in its tensor data each
    say the file is damaged (transformers said a corrupted count made an invalid JSON file)."""
    gguf = shared_path(GGUF)
    data = gguf.read_bytes()
    count = struct.unpack_from("<Q", data, 8)[0]
    cases = {"noise.gguf": bytes(range(256)) * 4, "header.gguf": data[:12],
             "count.gguf": data[:8] + struct.pack("<Q", count * 1000) + data[16:], "cut.gguf": data[: len(data) // 2]}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelError, match=rf"{name}: not a readable GGUF file, damaged or truncated .*; download"):
            gguf_to_safetensors(tmp_path / name, tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_directory_of_several_gguf_files_names_them(tmp_path: Path) -> None:
    """A directory without config.json holding more than one .gguf (two quantizations of one model, say) is refused
    naming the files to choose from, before any is read: quantkit does not pick one of them for the user."""
    for name in ("model.Q4_1.gguf", "model.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF not read")
    with pytest.raises(ModelError, match="several .gguf files, pass one of model.Q4_1.gguf, model.Q8_0.gguf"):
        open_model(tmp_path, cache_dir=tmp_path / "cache")


def test_eval_of_a_gguf_file_says_transformers_dequantized_it(cache, monkeypatch):
    """`quantkit eval` of a .gguf file evaluates the float16 copy transformers dequantized (the cached conversion),
    and its description says so, with the file's own name, not "unquantized", which would pass the quantized
    model's score off as the original's."""
    from quantkit.eval.loading import load_for_eval

    monkeypatch.setenv("QUANTKIT_CACHE", str(cache))
    loaded = load_for_eval(shared_path(GGUF))
    assert loaded.description == f"{shared_path(GGUF).resolve()} (GGUF, dequantized by transformers, stored in float16)"
    assert loaded.recipe is None


def _small_gguf(path: Path, arch: str, metadata: dict[str, int], blocks: int, width: int = 64) -> Path:
    """A GGUF file of `blocks` blocks' norms and an embedding `width` wide, with `arch`'s `metadata` (name: int)."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((32, width), dtype=np.float32))
    for i in range(blocks):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(width, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_metadata_is_checked_before_transformers_builds_the_model(tmp_path):
    """A GGUF file whose metadata lacks the model's size made transformers build a model of its default (7B) size
    and dequantize into it, until the memory ran out (22 GB for one small tensor); an architecture without an
    adapter was refused only after the whole conversion. Each is now refused from the file's metadata, as is
    metadata that disagrees with the tensors, and nothing is cached."""
    size = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4}
    cases = {
        "nosize.gguf": (_small_gguf(tmp_path / "nosize.gguf", "llama", {"embedding_length": 64}, 2),
                        r"nosize.gguf: its metadata lacks llama.block_count, llama.feed_forward_length, "
                        r"llama.attention.head_count, so the size of the model it holds is unknown"),
        "gpt2.gguf": (_small_gguf(tmp_path / "gpt2.gguf", "gpt2", size, 2),
                      r"gpt2.gguf: unsupported architecture: model_type 'gpt2'.*\(its general.architecture\)"),
        "blocks.gguf": (_small_gguf(tmp_path / "blocks.gguf", "llama", size, 3),
                        r"blocks.gguf: the metadata does not match the tensors: its tensors hold 3 blocks where "
                        r"llama.block_count says 2"),
        "width.gguf": (_small_gguf(tmp_path / "width.gguf", "qwen2", {**size, "embedding_length": 96}, 2),
                       r"token_embd.weight is \[64, 32\] where qwen2.embedding_length makes 96 columns"),
    }
    for path, message in cases.values():
        with pytest.raises(ModelError, match=message):
            gguf_to_safetensors(path, tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())
