"""QoQ end to end: the qoq / qoq-g128 recipes, QServe export, and eval of what was exported, bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from helpers import cli, cli_ok

from quantkit.artifact import read_safetensors
from quantkit.eval.loading import load_for_eval
from quantkit.eval.perplexity import perplexity
from quantkit.formats.qserve import QServePacker
from quantkit.formats.qserve_layout import emulate_group_dequant, unpack_qweight
from quantkit.models.adapters import adapter_for
from quantkit.recipe import load_recipe
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

FAST = ["--num-samples", "4", "--seq-len", "64"]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """128-multiple widths (QServe g128 shapes), GQA, q/k/v biases, tied embeddings (rotation must untie)."""
    spec = SyntheticLlama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, model_type="qwen2",
                          attention_bias=True, tie_word_embeddings=True)
    return write_synthetic_llama(tmp_path_factory.mktemp("syn") / "qwen2-qoq", spec)


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory) -> Path:
    """A Mistral whose heads are together wider than the hidden size (head_dim 128 x 4 heads = 512 > 256), as
    Mistral Nemo and Small 3 have: q_proj's outputs and o_proj's inputs are 512 wide."""
    spec = SyntheticLlama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, model_type="mistral",
                          head_dim=128)
    return write_synthetic_llama(tmp_path_factory.mktemp("syn") / "mistral-wide-heads", spec)


def _layer_parts(out: Path, layer: int, linear: str) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = f"model.layers.{layer}.{linear}."
    shard = read_safetensors(out / index[prefix + "qweight"])
    return {k[len(prefix):]: v for k, v in shard.items() if k.startswith(prefix) and not k.endswith("bias")}


@pytest.mark.parametrize(("model", "recipe"), [("synthetic", "qoq-g128"), ("synthetic", "qoq"),
                                               ("wide_heads", "qoq-g128")])
def test_qoq_exports_qserve_and_eval_uses_exactly_its_weights(request, model, calib_txt, tmp_path, recipe):
    synthetic = request.getfixturevalue(model)
    out = tmp_path / recipe
    cli_ok("quantize", synthetic, "--recipe", recipe, "-o", out, "--calib", calib_txt, *FAST)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "qoq", "wbits": 4,
                                             "group_size": 128 if recipe == "qoq-g128" else -1}
    assert config["torch_dtype"] == "float16" and config["tie_word_embeddings"] is False
    loaded = load_for_eval(out, dtype=torch.float16)
    assert "A8 per-token" in loaded.description and "KV4 per-head" in loaded.description
    model = loaded.model
    assert torch.all(model.model.layers[0].input_layernorm.weight == 1)  # folded (OmniServe ignores norms)
    r = load_recipe(recipe)
    packer = QServePacker(r, torch.float16)
    for layer in range(2):
        for linear in LINEARS:
            parts = _layer_parts(out, layer, linear)
            n = parts["qweight"].shape[0]
            assert parts["qweight"].dtype == torch.int8 and parts["s1_scales"].shape == (n,)
            weight = model.get_submodule(f"model.layers.{layer}.{linear}").weight
            assert torch.equal(weight, packer.unpack(parts, r.weights.spec()).dequantize().half())
            codes = unpack_qweight(parts["qweight"]).float()
            s1 = parts["s1_scales"].float()[:, None]
            if recipe == "qoq-g128":  # the kernel's integer main loop, then the FP16 epilogue scale
                w8 = emulate_group_dequant(parts["qweight"], parts["s2_scales"], parts["s2_zeros"], 128)
                assert torch.equal(weight, (w8.float() * s1).half())
            else:  # per channel: q * s1 - s1_szeros (zero point in the epilogue)
                assert torch.equal(weight, (codes * s1 - parts["s1_szeros"].float()[:, None]).half())
    ids = torch.randint(0, 256, (1, 4 * 64), generator=torch.Generator().manual_seed(0))
    from transformers import AutoModelForCausalLM

    fp = AutoModelForCausalLM.from_pretrained(synthetic, dtype=torch.float32)
    nll_fp = math.log(perplexity(fp, ids[0], seq_len=64).perplexity)  # random weights: a huge but finite ppl
    nll_q = math.log(perplexity(model.float(), ids[0], seq_len=64).perplexity)
    assert abs(nll_q - nll_fp) < 0.05 * nll_fp


def test_qoq_converts_a_bfloat16_checkpoint_to_float16(tmp_path, calib_txt):
    """Llama 3 ships bfloat16 and QServe computes in float16: `--dtype auto` reads the checkpoint as float16 (with a
    warning and a manifest note), so every tensor of the artifact is float16 and eval reads exactly the packed
    weights; `--dtype bfloat16` is refused before any work, naming why."""
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=256, intermediate_size=512,
                                                                  num_hidden_layers=2, dtype="bfloat16"))
    refused = cli("quantize", model, "--recipe", "qoq-g128", "-o", tmp_path / "no", "--calib", calib_txt, *FAST,
                  "--dtype", "bfloat16")
    assert refused.exit_code == 2 and "qserve checkpoints must be float16 (QServe asserts it)" in refused.output
    out = tmp_path / "out"
    result = cli_ok("quantize", model, "--recipe", "qoq-g128", "-o", out, "--calib", calib_txt, *FAST)
    said = " ".join(result.output.split())
    assert "converting the bfloat16 checkpoint to float16 (qserve checkpoints are float16: QServe asserts it)" in said
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    notes = json.loads((out / "quantkit_manifest.json").read_text())["notes"]
    assert notes[0] == "dtype float16: the weights were read from the bfloat16 checkpoint as float16"
    floats = {k: t.dtype for f in out.glob("*.safetensors") for k, t in read_safetensors(f).items()
              if t.is_floating_point()}
    assert set(floats.values()) == {torch.float16}, floats
    loaded = load_for_eval(out, dtype=torch.float16)
    r = load_recipe("qoq-g128")
    parts = _layer_parts(out, 1, "mlp.down_proj")
    assert torch.equal(loaded.model.model.layers[1].mlp.down_proj.weight,
                       QServePacker(r, torch.float16).unpack(parts, r.weights.spec()).dequantize().half())


def test_qoq_on_stories260k_needs_simulation_export(stories260k, tinystories_txt, tmp_path):
    result = cli("quantize", stories260k, "--recipe", "qoq", "-o", tmp_path / "x", "--calib", tinystories_txt,
                 *FAST)
    assert result.exit_code != 0 and "export.format=quantkit" in result.output and "172" in result.output
    out = tmp_path / "sim"
    cli_ok("quantize", stories260k, "--recipe", "qoq", "-o", out, "--calib", tinystories_txt, *FAST,
           "--set", "export.format=quantkit")
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    assert manifest["format"] == "quantkit" and any("no inference engine" in n for n in manifest["notes"])
    assert all(r["rel_error"] < 0.5 for r in manifest["layers"])
    assert "simulating A8 per-token, KV4 per-head" in load_for_eval(out).description
    # every pass of the recipe is timed on every layer, and the manifest totals them
    passes = {p["name"] for p in yaml.safe_load((out / "quantkit_recipe.yaml").read_text())["passes"]}
    assert all(passes <= set(r["step_seconds"]) for r in manifest["layers"])
    totals = manifest["timings"]["step_seconds"]
    assert set(totals) >= passes and sum(totals.values()) <= manifest["timings"]["layer_seconds"] + 1e-6


def test_every_qoq_step_can_be_switched_off(synthetic, calib_txt, tmp_path):
    off = [f"passes.{p}.enabled=false" for p in ("fold_norms", "rotate", "reorder", "smooth_attention",
                                                 "smooth", "clip")]
    out = tmp_path / "bare"
    cli_ok("quantize", synthetic, "--recipe", "qoq-g128", "-o", out, "--calib", calib_txt, *FAST,
           *[a for o in off for a in ("--set", o)])
    saved = (out / "quantkit_recipe.yaml").read_text()
    assert saved.count("enabled: false") == 6
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True  # nothing rotated: the embeddings stay tied


def test_qserve_artifact_of_a_tied_model_carries_its_lm_head(synthetic, calib_txt, tmp_path):
    """OmniServe's model holds an lm_head of its own and never ties it to the embedding: a model that stays tied
    (no pass rewrites its edges) still gets `lm_head.weight`, a copy of the embedding, and its config stays tied."""
    out = tmp_path / "tied"
    cli_ok("quantize", synthetic, "--recipe", "qoq", "-o", out, "--calib", calib_txt, *FAST,
           "--set", "passes=[{name: rtn}]")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shard = read_safetensors(out / index["lm_head.weight"])
    assert torch.equal(shard["lm_head.weight"], shard["model.embed_tokens.weight"])
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    model = load_for_eval(out).model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_kv4_quantizes_each_token_and_head_over_its_true_range():
    """QServe's KV4 (digest P8): per (token, KV head) vector of D channels, scale = (max - min) / 15 and the true
    min as zero (no widening to include 0). x [B=1, H=2, T=2, D=4], by hand:
    [1, 2.5, 4, 16]: s = 1, codes round([0, 1.5, 3, 15]) = [0, 2, 3, 15] -> [1, 3, 4, 16];
    [3, 3, 3, 3]: a constant vector round-trips (no 0 / 0);
    [-20, -5, -12.5, -6]: s = 1 -> [-20, -5, -12, -6] (a range widened to 0 would give s = 20 / 15);
    [0, 30, 7.4, 15]: s = 2, codes [0, 15, round(3.7), round(7.5)] = [0, 15, 4, 8] -> [0, 30, 8, 16].
    Symmetric KV (bits 4): [7, -3.5, 1, 0.5] has s = 1 -> [7, -4, 1, 0] (ties to even)."""
    from quantkit.simulate import KVSim, fake_quantize_kv

    x = torch.tensor([[[[1.0, 2.5, 4.0, 16.0], [3.0, 3.0, 3.0, 3.0]],
                       [[-20.0, -5.0, -12.5, -6.0], [0.0, 30.0, 7.4, 15.0]]]])
    want = [[[[1.0, 3.0, 4.0, 16.0], [3.0, 3.0, 3.0, 3.0]], [[-20.0, -5.0, -12.0, -6.0], [0.0, 30.0, 8.0, 16.0]]]]
    assert fake_quantize_kv(x, KVSim(4)).tolist() == want
    assert fake_quantize_kv(x.half(), KVSim(4)).dtype == torch.float16
    sym = fake_quantize_kv(torch.tensor([[[[7.0, -3.5, 1.0, 0.5]]]]), KVSim(4, symmetric=True))
    assert sym.tolist() == [[[[7.0, -4.0, 1.0, 0.0]]]]


def test_kv4_scale_and_fractional_zero_are_float16_values():
    """The cache stores each vector's scale and zero in float16 (digest P8: zero = -15 min / (max - min), not
    rounded to an integer), and the codes and values come from those stored numbers. By hand, [-1, 3.5, 0.5, 1.2]:
    span 4.5, scale = fp16(0.3) = 1229 / 4096, zero = fp16(15 / 4.5) = 3414 / 1024; x / scale + zero =
    [0.0012, 14.9988, 5.0004, 7.3333] -> q = [0, 15, 5, 7]; (q - zero) scale = (1024 q - 3414) 1229 / 2^22, each
    exact in float32 (float32 parameters gave [-1, 3.5, 0.5, 1.1]). Symmetric [0.7, -0.2, 0.05, 0.0]: scale
    fp16(0.1) = 1638 / 16384, codes [7, -2, 1, 0] (0.05 / scale = 0.50012 rounds up). A vector whose float16 zero
    would overflow (a span of 0.001 at 1000: zero -1.5e7) is kept as it is, as is one whose scale would (a span of
    2e6: 133333 past float16's 65504), symmetric too."""
    from quantkit.simulate import KVSim, fake_quantize_kv

    x = torch.tensor([[[[-1.0, 3.5, 0.5, 1.2]]]])
    want = [(1024 * q - 3414) * 1229 / 2**22 for q in (0, 15, 5, 7)]
    assert fake_quantize_kv(x, KVSim(4)).flatten().tolist() == want
    sym = fake_quantize_kv(torch.tensor([[[[0.7, -0.2, 0.05, 0.0]]]]), KVSim(4, symmetric=True))
    assert sym.flatten().tolist() == [q * 1638 / 16384 for q in (7, -2, 1, 0)]
    narrow = torch.tensor([[[[1000.0, 1000.001, 1000.0005, 1000.0002]]]])
    assert torch.equal(fake_quantize_kv(narrow, KVSim(4)), narrow)
    wide = torch.tensor([[[[-1e6, 1e6, 0.5, 3.0]]]])
    assert torch.equal(fake_quantize_kv(wide, KVSim(4)), wide)
    assert torch.equal(fake_quantize_kv(wide, KVSim(4, symmetric=True)), wide)


def test_kv_simulation_is_what_every_layers_attention_reads(tmp_path, monkeypatch):
    """attach() on a whole model routes every layer's attention through the KV simulation: SDPA receives exactly
    fake_quantize_kv of the post-RoPE keys and values, while a calibration observer (SmoothAttention's statistics)
    sees them unquantized (32 distinct values per head vector, where KV4 leaves at most 16). Keys quantized before
    RoPE (Atom) are not quantized a second time after it."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as real

    from quantkit import simulate

    model_dir = write_synthetic_llama(tmp_path / "m", SyntheticLlama(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    observed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(module, query, key, value, *args, **kwargs):
        seen.append((key.clone(), value.clone()))
        return real(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(simulate, "sdpa_attention_forward", spy)
    for sim in (simulate.KVSim(4), simulate.KVSim(4, pre_rope=True)):
        seen.clear()
        observed.clear()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        layers = list(model.model.layers)
        for layer in layers:
            layer.self_attn._quantkit_observer = lambda k, v: observed.append((k.clone(), v.clone()))
        simulate.attach(layers, [], model.config, None, sim, adapter=adapter_for("llama"))
        with torch.no_grad():
            model(ids)
        assert len(seen) == len(observed) == 2
        for (key, value), (raw_key, raw_value) in zip(seen, observed, strict=True):
            if sim.pre_rope:
                assert torch.equal(key, raw_key) and torch.equal(value, raw_value)
                assert len(torch.unique(value[0, 0, 0])) <= 16  # quantized by the v_proj hook, before the cache
            else:
                assert len(torch.unique(raw_key[0, 0, 0])) == 32 and len(torch.unique(raw_value[0, 0, 0])) == 32
                assert torch.equal(key, simulate.fake_quantize_kv(raw_key, sim))
                assert torch.equal(value, simulate.fake_quantize_kv(raw_value, sim))
