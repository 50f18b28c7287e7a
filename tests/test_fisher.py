"""The layer-streamed diagonal Fisher equals full-model autograd: per-sequence gradients squared, then summed."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.fisher import diagonal_fisher
from quantkit.models.source import open_model
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama


def test_streamed_fisher_matches_full_model_autograd(tmp_path):
    model_dir = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=64, intermediate_size=128,
                                                                      num_hidden_layers=3, num_attention_heads=4,
                                                                      num_key_value_heads=2))
    source = open_model(model_dir)
    windows = torch.randint(0, source.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    names = [n for names in source.adapter.linears.values() for n in names]
    paths = diagonal_fisher(source, windows, names, tmp_path / "fisher")
    assert [p.name for p in paths] == [f"fisher-{i:05d}.safetensors" for i in range(3)]
    assert not list((tmp_path / "fisher").glob("input-*"))  # activations are cleaned up

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    expect: dict[str, torch.Tensor] = {}
    for d in range(3):
        model.zero_grad()
        model(windows[d:d + 1], labels=windows[d:d + 1]).loss.backward()
        for i, layer in enumerate(model.model.layers):
            for name in names:
                g = layer.get_submodule(name).weight.grad.square()
                key = f"{i}.{name}"
                expect[key] = g if key not in expect else expect[key] + g
    for i, path in enumerate(paths):
        got = load_file(str(path))
        for name in names:
            # the stream stores block inputs in the checkpoint's fp16 and F in bfloat16 (2^-9), autograd does not
            want = expect[f"{i}.{name}"]
            assert got[name].dtype == torch.bfloat16
            rel = float(torch.linalg.vector_norm(got[name].float() - want) / torch.linalg.vector_norm(want))
            assert rel < 4e-3, (i, name, rel)
    summed = sum(load_file(str(paths[0]))[n].sum() for n in names)
    assert summed > 0
