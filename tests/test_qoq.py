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
