"""The layer-streamed diagonal Fisher equals full-model autograd: per-sequence gradients squared, then summed."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.fisher import diagonal_fisher
from quantkit.models.source import open_model
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama


def _autograd_fisher(model, windows: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """Full-model autograd's diagonal Fisher, the reference: each window's squared weight gradients, summed over the
    windows, keyed "layer.linear"."""
    expect: dict[str, torch.Tensor] = {}
    for d in range(windows.shape[0]):
        model.zero_grad()
        model(windows[d:d + 1], labels=windows[d:d + 1]).loss.backward()
        for i, layer in enumerate(model.model.layers):
            for name in names:
                expect[f"{i}.{name}"] = expect.get(f"{i}.{name}", 0) + layer.get_submodule(name).weight.grad.square()
    return expect


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
    expect = _autograd_fisher(model, windows, names)
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


def test_streamed_fisher_is_the_gradient_at_the_stored_block_inputs(tmp_path):
    """Each block's backward restarts from its input as stored (rounded to the checkpoint's fp16), so the forward
    must carry that rounded input on too: then the result is, bit for bit in bfloat16 (all but a rare float32 order
    difference), full-model autograd with every decoder layer's input rounded to fp16 (a straight-through round,
    whose gradient passes unchanged, as the stream hands each block's input gradient down). A forward that carried
    the unrounded states would compute the head's gradient at states the backward never sees (about 5% of the
    entries then differ)."""
    model_dir = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=64, intermediate_size=128,
                                                                      num_hidden_layers=3, num_attention_heads=4,
                                                                      num_key_value_heads=2))
    source = open_model(model_dir)
    assert source.dtype == torch.float16
    windows = torch.randint(0, source.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    names = [n for names in source.adapter.linears.values() for n in names]
    paths = diagonal_fisher(source, windows, names, tmp_path / "fisher")

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    for layer in model.model.layers:
        layer.register_forward_pre_hook(
            lambda m, args: (args[0] + (args[0].half().float() - args[0]).detach(), *args[1:]))
    expect = _autograd_fisher(model, windows, names)
    same = total = 0
    for i, path in enumerate(paths):
        got = load_file(str(path))
        for name in names:
            same += int((got[name] == expect[f"{i}.{name}"].to(torch.bfloat16)).sum())
            total += got[name].numel()
    assert same >= 0.995 * total, same / total


def test_streamed_fisher_head_uses_the_configs_rms_norm_eps(tmp_path):
    """The head's final RMSNorm is recomputed outside the model: with rms_norm_eps = 0.1 (large against the tiny
    model's mean square activations) it must still agree with full-model autograd, which reads the config's eps."""
    import json

    model_dir = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=64, intermediate_size=128,
                                                                      num_hidden_layers=1, num_attention_heads=4,
                                                                      num_key_value_heads=2))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.1}))
    source = open_model(model_dir)
    windows = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    (path,) = diagonal_fisher(source, windows, ["mlp.down_proj"], tmp_path / "fisher")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert model.config.rms_norm_eps == 0.1
    want = _autograd_fisher(model, windows, ["mlp.down_proj"])["0.mlp.down_proj"]
    got = load_file(str(path))["mlp.down_proj"].float()
    assert float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)) < 4e-3
