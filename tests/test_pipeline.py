"""End-to-end quantization runs through the CLI: artifacts, eval, transformers loading, resume, bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import artifact_digest, cli, cli_ok, record_rewritten_file, rewrite_tensor, set_weight, wikitext_rows

from quantkit.artifact import read_safetensors
from quantkit.errors import QuantkitError
from quantkit.eval.loading import load_for_eval
from quantkit.eval.perplexity import perplexity
from quantkit.pipeline import QuantizeJob, Reporter, run_quantize
from quantkit.recipe import load_recipe
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

FAST = ["--num-samples", "4", "--seq-len", "64"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """A Qwen2-style (q/k/v bias) model with 128-multiple widths, so group size 128 divides every layer."""
    spec = SyntheticLlama(hidden_size=256, intermediate_size=512, num_hidden_layers=3, model_type="qwen2")
    return write_synthetic_llama(tmp_path_factory.mktemp("syn") / "qwen2-tiny", spec)


def test_gptq_w4a16_stories_end_to_end(stories260k, tinystories_txt, shared_data, tmp_path):
    out = tmp_path / "out"
    result = cli_ok("quantize", stories260k, "--recipe", "gptq-w4a16", "-o", out, "--calib", tinystories_txt, *FAST)
    assert not (tmp_path / "out.partial").exists()
    # not a terminal: one progress line per layer, naming it as model.layers.N does, and the summary says where the
    # time went
    assert [line.split(":")[0] for line in result.output.splitlines() if line.startswith("layer ")] == [
        f"layer {i} ({i + 1}/5)" for i in range(5)]
    assert "time by step" in result.output and "gptq" in result.output
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    assert manifest["format"] == "compressed-tensors" and manifest["num_layers"] == 5
    assert manifest["calibration"]["num_samples"] == 4 and len(manifest["calibration"]["sha256"]) == 64
    assert all(0 < r["rel_error"] < 0.5 and r["metrics"]["sink_rel_error"] > 0 for r in manifest["layers"])
    for name, entry in manifest["files"].items():
        from quantkit.artifact import sha256_file

        assert sha256_file(out / name) == entry["sha256"], name
    saved = (out / "quantkit_recipe.yaml").read_text()
    assert "num_samples: 4" in saved and "seq_len: 64" in saved
    config = json.loads((out / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["num_bits"] == 4
    shard = read_safetensors(out / "model-00001-of-00006.safetensors")
    assert shard["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.int32
    assert shard["model.layers.0.self_attn.q_proj.weight_packed"].shape == (64, 8)

    inspected = cli_ok("inspect", out).output
    assert "gptq-w4a16" in inspected and manifest["calibration"]["sha256"] in inspected

    result_json = tmp_path / "eval.json"
    evaluated = cli_ok("eval", out, "--tasks", "wikitext", "--limit", "4", "--seq-len", "256",
                       "--data-dir", shared_data, "--output-json", result_json).output
    # without a terminal, the windows' progress is a line per tenth of the work (here every window)
    assert [line.split(",")[0] for line in evaluated.splitlines() if line.startswith("wikitext windows:")] == [
        f"wikitext windows: {i}/4" for i in range(1, 5)]
    ppl = json.loads(result_json.read_text())["results"]["wikitext"]["perplexity"]
    assert 1 < ppl < 1000


def test_output_errors_keep_the_attention_sink_apart():
    from quantkit.pipeline import output_errors

    y_ref = torch.zeros(2, 3, 2)
    y_ref[:, 0] = torch.tensor([0.0, 1000.0])  # the sink: a massive activation
    y_ref[:, 1:] = torch.tensor([3.0, 4.0])  # every other token has norm 5
    y_q = y_ref.clone()
    y_q[:, 0, 1] += 100.0  # 10% off at the sink
    y_q[0, 1, 0] += 2.0  # one other token off by 2
    body, sink = output_errors(y_q, y_ref)
    assert body == pytest.approx(2.0 / (5.0 * 2.0))  # ||dY|| = 2 over four tokens of norm 5
    assert sink == pytest.approx(0.1)
    assert output_errors(y_q[:, :1], y_ref[:, :1]) == pytest.approx((0.1, 0.1))  # only a sink: it is the error


def test_output_errors_of_outputs_whose_squares_pass_float32(tmp_path, calib_txt):
    """Outputs near 1e22 (a bfloat16 checkpoint's huge but finite weight) have squares past float32's range: their
    errors are the same ratios as at 1e0, not an inf that stopped the run, blaming "a scale or table overflowed"."""
    from quantkit.pipeline import output_errors

    y_ref = torch.tensor([[[3.0, 4.0], [3.0, 4.0], [6.0, 8.0]]])
    y_q = y_ref + torch.tensor([[[0.5, 0.0], [0.0, 1.0], [0.0, 0.0]]])
    small = output_errors(y_q, y_ref)
    assert output_errors(y_q * 1e22, y_ref * 1e22) == pytest.approx(small, rel=1e-6)
    assert small == pytest.approx((1.0 / 125 ** 0.5, 0.1))

    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                  num_hidden_layers=2, dtype="bfloat16"))
    set_weight(model, "model.layers.0.mlp.down_proj.weight", 1e22, at=(3, 5))
    out = tmp_path / "out"
    cli_ok("quantize", model, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", calib_txt, *FAST)
    errors = [layer["rel_error"] for layer in json.loads((out / "quantkit_manifest.json").read_text())["layers"]]
    assert all(math.isfinite(e) for e in errors) and errors[0] > 0


def _ppl(model, ids, seq_len=128):
    return perplexity(model, ids, seq_len, limit=4).perplexity


def test_perplexity_reports_progress_per_batch(synthetic):
    model = load_for_eval(synthetic).model
    ids = torch.randint(0, model.config.vocab_size, (5 * 32 + 7,))
    calls: list[tuple[int, int]] = []
    batched = perplexity(model, ids, 32, batch_size=2, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(0, 5), (2, 5), (4, 5), (5, 5)] and batched.windows == 5  # the clock starts at the first
    single = perplexity(model, ids, 32)
    assert single.perplexity == pytest.approx(batched.perplexity, rel=1e-5)


def _naive_ppl(model, ids: torch.Tensor, seq_len: int, windows: int) -> float:
    """The papers' perplexity worked out by hand: each of the first `windows` non-overlapping windows run alone,
    every token after a window's first scored by a Python loop in float64, exp of the mean over all those tokens
    (equal windows, so the mean of the windows' means)."""
    total, count = 0.0, 0
    for w in range(windows):
        window = ids[w * seq_len:(w + 1) * seq_len]
        with torch.no_grad():
            logits = model(window[None]).logits[0].double()
        for t in range(seq_len - 1):
            row = logits[t]
            total += float(torch.logsumexp(row, 0) - row[window[t + 1]])
            count += 1
    return math.exp(total / count)


def test_perplexity_equals_a_naive_loop_over_the_logits(synthetic):
    """Non-overlapping windows from the start, the partial tail dropped (and a stream of exactly n windows kept
    whole), next-token NLL averaged over tokens, then exp: checked against `_naive_ppl`, not against the code."""
    model = load_for_eval(synthetic).model
    ids = torch.randint(0, model.config.vocab_size, (3 * 32 + 7,), generator=torch.Generator().manual_seed(1))
    result = perplexity(model, ids, 32)
    assert (result.windows, result.tokens, result.scored_tokens, result.seq_len) == (3, 96, 93, 32)
    assert result.perplexity == pytest.approx(_naive_ppl(model, ids, 32, 3), rel=1e-6)
    assert perplexity(model, ids, 32, limit=2, batch_size=2).perplexity == pytest.approx(
        _naive_ppl(model, ids, 32, 2), rel=1e-6)
    exact = perplexity(model, ids[:96], 32)  # no tail: the last window counts too
    assert exact.windows == 3 and exact.perplexity == pytest.approx(result.perplexity, rel=1e-6)
    with pytest.raises(QuantkitError, match="text has 31 tokens, fewer than one window of 32"):
        perplexity(model, ids[:31], 32)


def test_perplexity_of_a_bfloat16_model_is_summed_in_float32(synthetic):
    """A bfloat16 model's logits are upcast before the NLL: the result is the float64 reference of those same
    logits, not one rounded to bfloat16's 8 bits per token."""
    model = load_for_eval(synthetic, dtype=torch.bfloat16).model
    ids = torch.randint(0, model.config.vocab_size, (2 * 32,), generator=torch.Generator().manual_seed(2))
    assert perplexity(model, ids, 32).perplexity == pytest.approx(_naive_ppl(model, ids, 32, 2), rel=1e-5)


def test_wikitext_perplexity_joins_the_rows_and_keeps_the_bos(stories260k, tmp_path):
    """The rows, blank ones and their spaces verbatim, joined with "\n\n" and tokenized once with the tokenizer's
    BOS at the stream's start (GPTQ's `tokenizer("\n\n".join(test["text"]))`), then cut into windows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.eval.perplexity import WIKITEXT_FILE, wikitext_perplexity
    from quantkit.eval.perplexity import wikitext_rows as read_rows

    rows = ["", " = Lily = ", "", " Lily had a red ball . She liked to play in the park with her dog . ",
            " The dog ran fast @-@ and Lily laughed . ", ""] * 6
    path = tmp_path / WIKITEXT_FILE
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    assert read_rows(tmp_path) == rows
    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32)
    ids = torch.tensor(tokenizer("\n\n".join(rows))["input_ids"])
    assert ids[0] == tokenizer.bos_token_id and ids.numel() > 3 * 64
    result = wikitext_perplexity(model, tokenizer, rows, seq_len=64, limit=3)
    assert result.windows == 3 and result.perplexity == pytest.approx(_naive_ppl(model, ids, 64, 3), rel=1e-6)


@pytest.mark.parametrize("recipe,extra", [
    ("gptq-w4a16-g128", []),
    ("rtn-w4a16-g128", ["--set", "weights.granularity=channel"]),
    ("gptq-w4a16-g128", ["--set", "passes.gptq.act_order=false"]),
    ("rtn-w4a16-g128", ["--set", "targets=[qkv, o]"]),  # the MLP's linears in `ignore`, left in fp16
    ("rtn-w8a8", ["--set", "activations=null"]),  # W8A16: pack-quantized, four codes a word
])
def test_transformers_loads_artifact_with_same_perplexity(synthetic, calib_txt, tmp_path, recipe, extra):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    cli_ok("quantize", synthetic, "--recipe", recipe, "-o", out, "--calib", calib_txt, *FAST, *extra)
    ids = torch.randint(0, 256, (4 * 128,), generator=torch.Generator().manual_seed(0))
    ours = load_for_eval(out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    a, b = _ppl(ours.model, ids), _ppl(hf, ids)
    assert abs(a - b) / b < 1e-3, (a, b)
    fp = AutoModelForCausalLM.from_pretrained(synthetic, dtype=torch.float32)
    assert _ppl(fp, ids) != a  # the quantized model is really quantized


def test_eval_weights_equal_reference_dequant(synthetic, calib_txt, tmp_path):
    """The weights eval builds from an artifact are its stored codes times their group's scale, rounded once to
    float16: the codes unpacked by compressed-tensors' own helper, so the reference does not share quantkit's
    unpack, which load_for_eval calls."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from quantkit.formats.compressed_tensors import CompressedTensorsPacker

    out = tmp_path / "out"
    cli_ok("quantize", synthetic, "--recipe", "gptq-w4a16-g128", "-o", out, "--calib", calib_txt, *FAST)
    model = load_for_eval(out, dtype=torch.float16).model
    shard = read_safetensors(out / "model-00002-of-00004.safetensors")
    prefix = "model.layers.1.mlp.down_proj."
    parts = {k[len(prefix):]: v for k, v in shard.items() if k.startswith(prefix)}
    n, k = (int(d) for d in parts["weight_shape"])
    codes = helpers.unpack_from_int32(parts["weight_packed"], 4, torch.Size([n, k]))
    scale = parts["weight_scale"].float().repeat_interleave(k // parts["weight_scale"].shape[1], dim=1)
    weight = model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(weight, (codes.float() * scale).half())
    recipe = load_recipe("gptq-w4a16-g128")
    q = CompressedTensorsPacker(recipe, torch.float16).unpack(parts, recipe.weights.spec())
    assert torch.equal(weight, q.dequantize().half())


def test_an_evaluated_artifact_is_a_plain_floating_point_model(rtn_artifact):
    """eval dequantizes an artifact itself, so the model it hands on carries no quantization_config: lm-eval's HF
    wrapper builds a quantizer config from one it finds (AutoQuantizationConfig.from_dict, which fails on a method
    transformers does not know), and transformers would treat the model as one it quantized."""
    assert "quantization_config" in json.loads((rtn_artifact / "config.json").read_text())
    model = load_for_eval(rtn_artifact).model
    assert getattr(model.config, "quantization_config", None) is None


def test_eval_weights_of_a_bfloat16_artifact_are_rounded_to_bfloat16(calib_txt, tmp_path):
    """An engine reconstructs a bfloat16 model's weights in bfloat16, so eval (in float32) takes each dequantized
    weight rounded to bfloat16, the manifest's dtype, not to float16, whose other rounding would score weights no
    engine runs."""
    from quantkit.formats.compressed_tensors import CompressedTensorsPacker

    model_dir = write_synthetic_llama(tmp_path / "bf16", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                         num_hidden_layers=1, dtype="bfloat16"))
    out = tmp_path / "out"
    cli_ok("quantize", model_dir, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", calib_txt, *FAST)
    weight = load_for_eval(out).model.model.layers[0].mlp.down_proj.weight
    shard = read_safetensors(sorted(out.glob("model-*.safetensors"))[0])
    prefix = "model.layers.0.mlp.down_proj."
    parts = {k[len(prefix):]: v for k, v in shard.items() if k.startswith(prefix)}
    recipe = load_recipe("rtn-w4a16-g128")
    exact = CompressedTensorsPacker(recipe, torch.bfloat16).unpack(parts, recipe.weights.spec()).dequantize()
    assert torch.equal(weight, exact.to(torch.bfloat16).float())
    assert not torch.equal(weight, exact.half().float())


def test_w8a8_simulates_activations(synthetic, calib_txt, tmp_path):
    out = tmp_path / "out"
    cli_ok("quantize", synthetic, "--recipe", "rtn-w8a8", "-o", out, "--calib", calib_txt, *FAST)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "int-quantized"
    assert config["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    shard = read_safetensors(out / "model-00001-of-00004.safetensors")
    assert shard["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    loaded = load_for_eval(out)
    assert len(loaded.model.model.layers[0].mlp.down_proj._forward_pre_hooks) == 1
    assert "A8 per-token" in loaded.description


def test_data_free_recipe_runs_only_the_error_sequences(synthetic, calib_txt, tmp_path):
    """RTN reads no calibration data: 16 windows give the artifact and layer errors of their first 2 (the error
    samples) alone, and the manifest says so; a recipe whose passes read activations runs all of them."""
    base = ["calibration.seq_len=64", "engine.error_samples=2"]
    runs = {}
    for n in (16, 2):
        recipe = load_recipe("rtn-w8a8", [*base, f"calibration.num_samples={n}", "calibration.sampling=first"])
        runs[n] = run_quantize(QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / f"rtn{n}",
                                           calib=str(calib_txt)))
    assert runs[16].calibration["used_samples"] == 2 and runs[16].calibration["num_samples"] == 16
    assert [r.rel_error for r in runs[16].layers] == [r.rel_error for r in runs[2].layers]
    weights = [{k: v for k, v in artifact_digest(tmp_path / f"rtn{n}").items() if k.endswith(".safetensors")}
               for n in (16, 2)]
    assert weights[0] == weights[1] and len(weights[0]) == 4
    recipe = load_recipe("gptq-w4a16-g128", [*base, "calibration.num_samples=4"])
    gptq = run_quantize(QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "gptq",
                                    calib=str(calib_txt)))
    assert "used_samples" not in gptq.calibration


class _Warnings(Reporter):
    def __init__(self):
        self.said: list[str] = []

    def warn(self, message: str) -> None:
        self.said.append(message)


class _InterruptAfter(Reporter):
    def __init__(self, layers: int):
        self.layers = layers

    def layer_done(self, report) -> None:
        if report.index + 1 == self.layers:
            raise KeyboardInterrupt


@pytest.mark.parametrize("name,overrides", [
    ("gptq-w4a16-g128", []),
    # smoothing folded into the norms (qkv, gate_up), GPTQ role by role: the next block's inputs come from the norms
    # as the shard holds them (rounded to the checkpoint's dtype), as the replay rebuilds them
    ("qqq", ["export.format=quantkit"]),
    # the next block reads the full-precision outputs, which the shards do not hold: without transforms the replay
    # runs the checkpoint's block, with them (qqq's smoothing) the block as they leave it
    ("gptq-w4a16-g128", ["engine.propagate=float"]),
    ("qqq", ["export.format=quantkit", "engine.propagate=float"]),
])
def test_resume_after_interrupt_is_bit_identical(synthetic, calib_txt, tmp_path, name, overrides):
    recipe = load_recipe(name, ["calibration.num_samples=4", "calibration.seq_len=64", *overrides])
    job = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "a", calib=str(calib_txt))
    run_quantize(job)
    interrupted = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "b", calib=str(calib_txt))
    with pytest.raises(KeyboardInterrupt):
        run_quantize(interrupted, _InterruptAfter(2))
    assert not (tmp_path / "b").exists() and (tmp_path / "b.partial").is_dir()
    journal = json.loads((tmp_path / "b.partial" / "quantkit_journal.json").read_text())
    assert sorted(journal["layers"]) == ["0", "1"]
    summary = run_quantize(QuantizeJob(**{**interrupted.__dict__, "resume": True}))
    assert [r.replayed for r in summary.layers] == [True, True, False]
    assert artifact_digest(tmp_path / "a") == artifact_digest(tmp_path / "b")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (--device cuda)")
def test_cuda_calibration_matches_cpu(synthetic, calib_txt, tmp_path):
    """The same run on the GPU gives nearly the CPU run's codes: GPTQ's error feedback carries any fp32 rounding
    difference (a flipped tie) on to the later columns, so a few codes move, by one step almost always."""
    recipe = load_recipe("gptq-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64"])
    cpu = run_quantize(QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "cpu", calib=str(calib_txt)))
    gpu = run_quantize(QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "gpu",
                                   calib=str(calib_txt), device="cuda"))
    for a, b in zip(cpu.layers, gpu.layers, strict=True):
        assert abs(a.rel_error - b.rel_error) < 0.1 * a.rel_error
    ta, tb = read_safetensors(tmp_path / "cpu" / "model-00001-of-00004.safetensors"), \
        read_safetensors(tmp_path / "gpu" / "model-00001-of-00004.safetensors")
    packed = [k for k in ta if k.endswith("weight_packed")]
    assert packed
    for k in packed:  # packed int32 words of 8 4-bit codes each
        codes = [torch.stack([(t >> (4 * i)) & 0xF for i in range(8)], dim=-1) for t in (ta[k], tb[k])]
        equal = (codes[0] == codes[1]).double().mean().item()
        near = ((codes[0] - codes[1]).abs() <= 1).double().mean().item()
        # an H200 run (2026-11-26): down_proj, the longest error-feedback chain, 93.58% equal and 99.913% within one
        assert equal > 0.90 and near > 0.998, f"{k}: {equal:.4%} of codes equal, {near:.4%} within one step"


def _interrupted(synthetic: Path, calib_txt: Path, out: Path, recipe: str = "rtn-w4a16-g128") -> QuantizeJob:
    """The job of a run of `recipe` on the synthetic model, interrupted after its first layer: `out`.partial holds
    its journal and first shard."""
    job = QuantizeJob(model=str(synthetic), output=out, calib=str(calib_txt),
                      recipe=load_recipe(recipe, ["calibration.num_samples=4", "calibration.seq_len=64"]))
    with pytest.raises(KeyboardInterrupt):
        run_quantize(job, _InterruptAfter(1))
    return job


def test_resume_on_another_device_is_refused(synthetic, calib_txt, tmp_path):
    job = _interrupted(synthetic, calib_txt, tmp_path / "b", "gptq-w4a16-g128")
    journal_path = tmp_path / "b.partial" / "quantkit_journal.json"
    journal = json.loads(journal_path.read_text())
    journal["device"] = "cuda"
    journal_path.write_text(json.dumps(journal))
    with pytest.raises(QuantkitError, match="differs from this one: device 'cuda' vs 'cpu'"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))


def test_a_resume_with_another_thread_count_warns(synthetic, calib_txt, tmp_path, caplog):
    """The journal records the run's CPU threads; a resume with another count goes on (the result is as good) but
    warns that the layers from there on may differ in their last bits from an uninterrupted run's."""
    job = _interrupted(synthetic, calib_txt, tmp_path / "b")
    journal_path = tmp_path / "b.partial" / "quantkit_journal.json"
    journal = json.loads(journal_path.read_text())
    assert journal["threads"] == torch.get_num_threads()
    journal["threads"] += 3
    journal_path.write_text(json.dumps(journal))
    run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))
    assert f"the interrupted run used {torch.get_num_threads() + 3} CPU threads" in caplog.text
    assert (tmp_path / "b" / "quantkit_manifest.json").is_file()


def test_a_layer_whose_packed_weights_overflow_stops_the_run(synthetic, calib_txt, tmp_path, monkeypatch):
    """A packed shard whose block gives non-finite outputs (here a scale made inf) is an unusable artifact: the run
    stops at that layer, naming it, instead of finishing with an error of inf; at layer 0 no layer finished, so no
    work dir is left."""
    from quantkit.formats.compressed_tensors import CompressedTensorsPacker

    real = CompressedTensorsPacker.pack

    def overflowing(self, q):
        tensors = real(self, q)
        tensors["weight_scale"][0, 0] = float("inf")
        return tensors

    monkeypatch.setattr(CompressedTensorsPacker, "pack", overflowing)
    recipe = load_recipe("rtn-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64"])
    job = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "out", calib=str(calib_txt))
    with pytest.raises(QuantkitError, match=r"layer 0: relative output error (nan|inf): the block rebuilt from its "
                                            r"packed shard gives non-finite outputs"):
        run_quantize(job)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_resume_in_another_dtype_is_refused(synthetic, calib_txt, tmp_path):
    """The artifact's dtype is part of what a resumed run must share: layers written as float16 are not mixed with
    bfloat16 ones."""
    job = _interrupted(synthetic, calib_txt, tmp_path / "b", "gptq-w4a16-g128")
    assert json.loads((tmp_path / "b.partial" / "quantkit_journal.json").read_text())["dtype"] == "float16"
    with pytest.raises(QuantkitError, match="differs from this one: dtype 'float16' vs 'bfloat16'"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True, "dtype": "bfloat16"}))


def test_resume_refuses_changed_weights_and_names_what_differs(synthetic, calib_txt, tmp_path):
    """A resumed run must quantize what the interrupted one did: weights rewritten since (a checkpoint mended in
    place) would mix old and new layers, so they are refused, and a recipe that differs is named by its fields."""
    from safetensors.torch import load_file, save_file

    model = shutil.copytree(synthetic, tmp_path / "model")
    recipe = load_recipe("rtn-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64"])
    job = QuantizeJob(model=str(model), recipe=recipe, output=tmp_path / "b", calib=str(calib_txt))
    with pytest.raises(KeyboardInterrupt):
        run_quantize(job, _InterruptAfter(1))
    other = load_recipe("rtn-w4a16-g128", ["calibration.num_samples=8", "calibration.seq_len=64"])
    with pytest.raises(QuantkitError, match="recipe calibration.num_samples 4 vs 8"):
        run_quantize(QuantizeJob(**{**job.__dict__, "recipe": other, "resume": True}))
    shard = next(model.glob("*.safetensors"))
    tensors = load_file(shard)
    save_file({k: v * 2 for k, v in tensors.items()}, shard, metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match=f"checkpoint files changed since \\({shard.name}\\)"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))


def test_resume_takes_no_leftover_and_no_run_that_is_still_writing(synthetic, calib_txt, tmp_path):
    """A temp file that a kill left in OUT.partial does not reach the artifact; a work directory whose lock names a
    live process (another run) is refused, for a fresh start as for a resume; a dead one's lock is taken over."""
    job = _interrupted(synthetic, calib_txt, tmp_path / "b")
    work = tmp_path / "b.partial"
    lock = json.loads((work / "quantkit_run.lock").read_text())
    assert lock["pid"] == os.getpid()
    (work / ".model-00002-of-00004.safetensors.abc.tmp").write_bytes(b"cut short")
    (work / "notes.txt").write_text("a stray file")
    (work / "model-00004-of-00004.safetensors").write_bytes(b"a shard the journal never recorded")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (work / "quantkit_run.lock").write_text(json.dumps({**lock, "pid": live.pid}))
        for resume, overwrite in ((True, False), (False, True)):
            with pytest.raises(QuantkitError, match=f"another quantkit run \\(pid {live.pid} on "):
                run_quantize(QuantizeJob(**{**job.__dict__, "resume": resume, "overwrite": overwrite}))
    finally:
        live.kill()
        live.wait()
    run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))  # its lock is a dead process's now
    manifest = json.loads((tmp_path / "b" / "quantkit_manifest.json").read_text())
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted([*manifest["files"], "quantkit_manifest.json"])
    assert "notes.txt" not in manifest["files"] and not [name for name in manifest["files"] if name.endswith(".tmp")]


def test_a_run_holds_its_work_dir_locked_from_its_first_instant(tmp_path, monkeypatch):
    """The work dir appears with its run's lock held (made under a hidden name, then renamed into place), so a
    second run, even one past its checks (an --overwrite run racing the first's start), can neither resume nor
    trash it, and one whose rename loses the race says so; a released run's dir is replaced."""
    from quantkit.artifact import LOCK, ArtifactError, OutputDir
    from quantkit.files import lock_held

    first = OutputDir(tmp_path / "b")
    assert first.prepare(resume=False, overwrite=False) is None
    assert lock_held(first.work / LOCK) and json.loads((first.work / LOCK).read_text())["pid"] == os.getpid()
    second = OutputDir(tmp_path / "b")
    for resume, overwrite in [(False, True), (True, False)]:
        with pytest.raises(ArtifactError, match=r"another quantkit run \(a process of this host\) is writing"):
            second.prepare(resume, overwrite)
    monkeypatch.setattr(OutputDir, "check", lambda *args, **kwargs: None)  # as if checked before the first began
    with pytest.raises(ArtifactError, match="another quantkit run .* is writing"):
        second.prepare(resume=False, overwrite=True)
    exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda path: path != first.work and exists(path))
    with pytest.raises(ArtifactError, match=r"another quantkit run took .*b\.partial meanwhile"):
        second.prepare(resume=False, overwrite=False)
    monkeypatch.setattr(Path, "exists", exists)
    assert lock_held(first.work / LOCK) and [p.name for p in tmp_path.iterdir()] == ["b.partial"]
    first.release()
    second.prepare(resume=False, overwrite=True)
    assert lock_held(second.work / LOCK) and [p.name for p in tmp_path.iterdir()] == ["b.partial"]


def test_a_run_lock_ends_with_its_process(tmp_path):
    """The flock a run holds is the kernel's: taken while its process lives, free once it is killed."""
    from quantkit.files import lock_held, take_lock

    path = tmp_path / "quantkit_run.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from quantkit.files import take_lock; "
         "assert take_lock(Path(sys.argv[1])) is not None; print('held', flush=True); time.sleep(60)", str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lock_held(path) and take_lock(path) is None
        assert json.loads(path.read_text())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
    assert not lock_held(path)
    fd = take_lock(path)
    assert fd is not None and json.loads(path.read_text())["pid"] == os.getpid()
    os.close(fd)


def test_a_lock_probe_does_not_refuse_a_run_taking_the_lock(tmp_path):
    """Another run's check probes the lock by taking it for an instant (`lock_held`); a run that takes the lock in
    that instant waits the probe out rather than being refused."""
    import fcntl
    import threading

    from quantkit.files import take_lock

    path = tmp_path / "quantkit_run.lock"
    path.touch()
    probe = os.open(path, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    release = threading.Timer(0.03, os.close, [probe])
    release.start()
    fd = take_lock(path)
    release.join()
    assert fd is not None
    os.close(fd)


def test_unwritable_or_unnamed_outputs_are_refused_before_the_model_is_read(synthetic, calib_txt, tmp_path):
    (tmp_path / "afile").write_text("x")
    for output, match in ((".", "name the output directory itself"),
                          (tmp_path / "afile" / "sub", "afile is not a directory, so"),
                          ("/proc/quantkit-out", "cannot write in /proc")):
        _fails(tmp_path, "quantize", synthetic, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST, "-o",
               output, match=match)


def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path, calib_txt):
    """SIGTERM (a scheduler's, docker's) stops the run with the hint to resume and the shell's code for it, 143;
    the run it leaves resumes."""
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=256, intermediate_size=512,
                                                                   num_hidden_layers=8))
    args = [sys.executable, "-m", "quantkit.cli", "quantize", str(model), "--recipe", "gptq-w4a16-g128",
            "--calib", str(calib_txt), "--num-samples", "8", "--seq-len", "128", "-o", str(tmp_path / "b")]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    journal = tmp_path / "b.partial" / "quantkit_journal.json"
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        if journal.exists() and json.loads(journal.read_text())["layers"]:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the signal: {proc.stderr.read()}"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 143, stderr
    assert len(json.loads(journal.read_text())["layers"]) < 8, "the run finished all its layers despite SIGTERM"
    assert "rerun with --resume to continue" in " ".join(stderr.split()), stderr
    subprocess.run([*args, "--resume"], check=True, capture_output=True)


def test_resume_after_sigkill_is_bit_identical(tmp_path, calib_txt):
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=512, intermediate_size=1024,
                                                                   num_hidden_layers=8, num_attention_heads=8))
    args = [sys.executable, "-m", "quantkit.cli", "quantize", str(model), "--recipe", "gptq-w4a16-g128",
            "--calib", str(calib_txt), "--num-samples", "8", "--seq-len", "128"]
    subprocess.run([*args, "-o", str(tmp_path / "a")], check=True, capture_output=True)
    proc = subprocess.Popen([*args, "-o", str(tmp_path / "b")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    journal = tmp_path / "b.partial" / "quantkit_journal.json"
    deadline = time.time() + 900  # generous: a loaded CI machine can be slow; the kill is what matters
    while time.time() < deadline and proc.poll() is None:
        if journal.exists() and len(json.loads(journal.read_text())["layers"]) >= 3:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(json.loads(journal.read_text())["layers"]) if journal.exists() else 0
    assert done >= 3, f"only {done} layers were written before the deadline"
    assert done < 8, "the run finished before it could be killed"
    subprocess.run([*args, "-o", str(tmp_path / "b"), "--resume"], check=True, capture_output=True)
    assert artifact_digest(tmp_path / "a") == artifact_digest(tmp_path / "b")


def test_log_eta_after_a_resume_uses_the_journal_times(capsys):
    """In a log (no live bar), a resumed run's ETA comes from the layers' recorded times until a fresh layer is
    done, instead of reading 0 min through the whole replay."""
    from quantkit.cli import _RichReporter
    from quantkit.pipeline import LayerReport

    reporter = _RichReporter()
    reporter.start(6, "quantize")
    try:
        reporter.layer_done(LayerReport(index=0, rel_error=0.1, seconds=120.0, replayed=True))
        reporter.layer_done(LayerReport(index=1, rel_error=0.1, seconds=120.0, replayed=True))
        reporter.layer_done(LayerReport(index=2, rel_error=0.1, seconds=60.0))
    finally:
        reporter.stop()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("layer ")]
    assert [line.rsplit("ETA ", 1)[1] for line in lines] == ["10 min", "8 min", "3 min"]


def test_log_eta_says_seconds_minutes_or_hours():
    """A log line's time left is never "0 min" for half a minute: seconds up to 90, minutes up to 90, then hours."""
    from quantkit.cli import _duration

    assert [_duration(t) for t in (0.4, 45, 89, 90, 600, 5399, 5400, 9000)] == [
        "0 s", "45 s", "89 s", "2 min", "10 min", "90 min", "1.5 h", "2.5 h"]


def _bar(reporter, width: int = 80) -> str:
    """The live bar as an 80-column terminal shows it."""
    import io

    from rich.console import Console

    screen = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
    screen.print(reporter.progress.make_tasks_table(reporter.progress.tasks))
    return screen.file.getvalue()


def test_the_live_bar_s_eta_after_a_resume_comes_from_this_run_s_layers(monkeypatch):
    """On a terminal, a resumed run's replayed layers (a blink each) do not make the bar's speed: its ETA is the mean
    of this run's layers (the journal's until this run has one) times the layers left, as in a log; and in 80
    columns the bar keeps its count, its elapsed time and its ETA whole, cutting the layer's text instead."""
    import re

    import quantkit.cli as cli_module
    from quantkit.pipeline import LayerReport

    monkeypatch.setattr(cli_module.time, "monotonic", lambda: 1000.0)  # no countdown between update and render
    reporter = cli_module._RichReporter()
    reporter.start(30, "quantizing layers")
    try:
        for i in range(10):
            reporter.layer_done(LayerReport(index=i, rel_error=0.0123, seconds=11.0, replayed=True))
        shown = _bar(reporter)
        assert "10/30" in shown and "ETA 0:03:40" in shown, shown  # 11 s x 20 layers, the journal's
        assert "layer 9 (resumed)" in shown, shown  # the tag before the text a narrow terminal cuts
        reporter.layer_done(LayerReport(index=10, rel_error=0.0123, seconds=10.0, metrics={"sink_rel_error": 0.5}))
        shown = _bar(reporter)
        assert "11/30" in shown and "ETA 0:03:10" in shown, shown  # 10 s x 19: this run's layer alone
        assert re.search(r"\d:\d\d:\d\d ETA", shown) and "…" in shown, shown  # the layer's text is what is cut
    finally:
        reporter.stop()


def test_the_index_total_size_counts_the_tensors_bytes(synthetic, calib_txt, tmp_path):
    """model.safetensors.index.json's total_size is the tensors' bytes, as transformers writes it: the shards' sizes
    less their headers."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    cli_ok("quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", calib_txt, *FAST)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = sum(t.numel() * t.element_size() for shard in set(index["weight_map"].values())
                  for t in load_file(out / shard).values())
    assert index["metadata"]["total_size"] == tensors
    assert tensors < sum((out / shard).stat().st_size for shard in set(index["weight_map"].values()))


def test_the_peak_is_put_on_a_gguf_conversion_only_where_it_raised_it():
    """The summary says the peak RSS was the GGUF's conversion only where this run converted, the opening raised the
    process's peak, and nothing after went higher."""
    from types import SimpleNamespace

    from quantkit.pipeline import _peak_while

    converted, cached = SimpleNamespace(converted=True), SimpleNamespace(converted=False)
    assert "GGUF's one-time conversion" in _peak_while(converted, 900, (400, 900))
    assert _peak_while(cached, 900, (400, 900)) is None  # a cached copy: no conversion ran
    assert _peak_while(converted, 950, (400, 900)) is None  # a layer went higher
    assert _peak_while(converted, 900, (900, 900)) is None  # the process had peaked before this run


def test_a_resumed_run_times_only_its_own_layers(synthetic, calib_txt, tmp_path):
    """A resumed run's timings are its own: the layers it quantized, their steps, and the phases around them, all
    within its time; the unfinished run's layers are counted apart, and the summary and inspect say so."""
    _interrupted(synthetic, calib_txt, tmp_path / "b")
    out = tmp_path / "b"
    said = " ".join(cli_ok("quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", calib_txt,
                           *FAST, "--resume").output.replace("│", " ").split())  # the table's rows, unwrapped
    m = json.loads((out / "quantkit_manifest.json").read_text())
    timings, layers = m["timings"], m["layers"]
    resumed = [r for r in layers if r.get("resumed")]
    assert [r["index"] for r in resumed] == [0], layers  # the interrupted run finished layer 0
    assert timings["resumed_layers"] == 1 and timings["resumed_layer_seconds"] == resumed[0]["seconds"]
    fresh = [r for r in layers if not r.get("resumed")]
    assert timings["layer_seconds"] == pytest.approx(sum(r["seconds"] for r in fresh))
    assert set(timings["phase_seconds"]) >= {"model", "calibration data", "replay"}
    assert sum(timings["step_seconds"].values()) + sum(timings["phase_seconds"].values()) <= timings["total_seconds"]
    assert f"1 of its {len(layers)} layers were quantized by the unfinished run it resumed" in said, said
    shown = " ".join(cli_ok("inspect", out).output.replace("│", " ").split())
    assert "the unfinished run it resumed quantized 1 layer(s) in" in shown, shown
    assert f"{resumed[0]['seconds']:.1f} (an earlier run)" in shown, shown
    # an uninterrupted run's manifest has no such keys
    cli_ok("quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", tmp_path / "c", "--calib", calib_txt, *FAST)
    plain = json.loads((tmp_path / "c" / "quantkit_manifest.json").read_text())
    assert "resumed_layers" not in plain["timings"] and not any("resumed" in r for r in plain["layers"])


def test_self_generated_calibration_when_offline(stories260k, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("QUANTKIT_DATA_DIR", raising=False)
    out = tmp_path / "out"
    result = cli_ok("quantize", stories260k, "--recipe", "gptq-w4a16", "-o", out, "--num-samples", "2",
                    "--seq-len", "32")
    assert "generated by the model itself" in result.output
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    assert manifest["calibration"]["source"] == "self-generated"


def test_a_set_missing_from_an_explicit_data_dir_is_an_error(stories260k, tmp_path, monkeypatch):
    """--data-dir says where the data is: a named set missing there (a typo, an unmounted disk) stops the run
    before anything is written, rather than calibrating on self-generated text the user did not ask for."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("QUANTKIT_DATA_DIR", raising=False)
    empty = tmp_path / "data"
    empty.mkdir()
    result = cli("quantize", stories260k, "--recipe", "gptq-w4a16", "-o", tmp_path / "out", "--data-dir", empty,
                 "--num-samples", "2", "--seq-len", "32")
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"none of its files is under data dir {empty}" in said and "--data-dir was given" in said, said
    assert "generated by the model itself" not in said
    assert not (tmp_path / "out").exists()


# --- bad input: a clear message, exit code 2, and nothing written ------------------------------------------


def _fails(tmp_path, *args, match: str) -> None:
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert match in " ".join(result.output.split()), result.output
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("out")]
    assert leftovers == [], leftovers


def test_output_exists_is_refused(stories260k, tinystories_txt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = cli("quantize", stories260k, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", tinystories_txt)
    assert result.exit_code == 2 and "already exists and is not quantkit's output" in result.output
    assert (out / "keep.txt").read_text() == "precious"


def test_a_symlinked_output_is_written_where_it_points(synthetic, calib_txt, tmp_path):
    """-o LINK, a symlink to an output on another disk: the run (and an --overwrite of it) writes where the link
    points and the link stays, naming the new output. --overwrite had renamed the link aside, put the new output
    in its place on the link's disk, and left the renamed link (`.LINK.trash-*`) for good, since rmtree refuses
    links; an old run's such leftover is removed now."""
    real = tmp_path / "disk" / "art"
    real.parent.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    args = ["quantize", synthetic, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST, "-o", link]
    cli_ok(*args)
    first = json.loads((real / "quantkit_manifest.json").read_text())["manifest_sha256"]
    (tmp_path / ".link.trash-0123456789ab").symlink_to(real.parent)  # what an --overwrite before this fix left
    cli_ok(*args, "--overwrite", "--set", "weights.group_size=64")
    assert link.is_symlink() and link.resolve() == real.resolve()
    manifest = json.loads((real / "quantkit_manifest.json").read_text())
    assert manifest["manifest_sha256"] != first and manifest["weights"]["o"]["group_size"] == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "link"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["art"]


def test_overwrite_replaces_only_quantkit_output(synthetic, calib_txt, tmp_path):
    """--overwrite replaces an earlier artifact (once the new one is complete) and nothing else: not a directory
    that is not quantkit's, not a file, not the model itself or a directory holding it, and not a sibling that
    happens to be named OUT.old."""
    args = ["quantize", synthetic, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST]
    out, sibling = tmp_path / "out", tmp_path / "out.old"
    sibling.mkdir()
    (sibling / "backup.txt").write_text("mine")
    cli_ok(*args, "-o", out)
    assert "already exists; pass --overwrite" in cli(*args, "-o", out).output
    (out / "stale.txt").write_text("from the first run")
    cli_ok(*args, "-o", out, "--overwrite")
    assert not (out / "stale.txt").exists() and (out / "quantkit_manifest.json").is_file()
    assert (sibling / "backup.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # the old one is gone

    precious = tmp_path / "docs"
    precious.mkdir()
    (precious / "thesis.txt").write_text("precious")
    result = cli(*args, "-o", precious, "--overwrite")
    assert result.exit_code == 2 and "already exists and is not quantkit's output" in " ".join(result.output.split())
    assert (precious / "thesis.txt").read_text() == "precious"
    assert not (tmp_path / "docs.partial").exists()

    a_file = tmp_path / "notes.txt"
    a_file.write_text("notes")
    result = cli(*args, "-o", a_file, "--overwrite")
    assert result.exit_code == 2 and "is not a directory" in result.output and a_file.read_text() == "notes"

    model = shutil.copytree(synthetic, tmp_path / "model")
    for target in (model, tmp_path):  # the model, and a directory holding it
        result = cli("quantize", model, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST, "-o", target,
                     "--overwrite")
        assert result.exit_code == 2 and "would replace the model" in result.output, result.output
    for inside in ("x.safetensors", "sub/q"):  # a folder in the model's, whose shards would be read as its own
        result = cli("quantize", model, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST, "-o",
                     model / inside)
        assert result.exit_code == 2 and "is inside the model being quantized" in " ".join(result.output.split())
    assert sorted(p.name for p in model.iterdir()) == sorted(p.name for p in synthetic.iterdir())


def test_resume_takes_the_same_model_however_spelt(synthetic, calib_txt, tmp_path, monkeypatch):
    """The journal names a local model by its absolute path, so a resumed run may spell it otherwise (relative, or
    from another directory)."""
    job = _interrupted(synthetic, calib_txt, tmp_path / "b")
    monkeypatch.chdir(synthetic.parent)
    run_quantize(QuantizeJob(**{**job.__dict__, "model": f"./{synthetic.name}/", "resume": True}))
    manifest = json.loads((tmp_path / "b" / "quantkit_manifest.json").read_text())
    assert manifest["model"] == str(synthetic.resolve())


@pytest.mark.parametrize("content", ['{"layers": ', "[]", '{"model": "x"}', "no sha256", "no model", "recipe=123",
                                     "recipe=a: [1", "recipe=- a list", "weights=[]"])
def test_resume_with_a_damaged_journal_says_so(synthetic, calib_txt, tmp_path, content):
    job = _interrupted(synthetic, calib_txt, tmp_path / "b")
    path = tmp_path / "b.partial" / "quantkit_journal.json"
    if content.startswith("no "):  # a journal that reads, without a field a resume takes
        journal = json.loads(path.read_text())
        del (journal["layers"]["0"] if content == "no sha256" else journal)[content[3:]]
        content = json.dumps(journal)
    elif "=" in content:  # an identity field of the wrong type, or a recipe that does not read
        key, value = content.split("=", 1)
        journal = json.loads(path.read_text())
        journal[key] = yaml.safe_load(value) if key == "weights" or value.isdigit() else value
        content = json.dumps(journal)
    path.write_text(content)
    with pytest.raises(QuantkitError, match="quantkit_journal.json is damaged .*rerun with --overwrite"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))


@pytest.mark.parametrize(("fields", "writer"), [
    ({"journal_format": None}, r"quantkit \S+ \(an earlier journal format\)"),
    ({"journal_format": 1}, r"quantkit \S+ \(journal format 1\)"),
    ({"quantkit_version": "0.0.9"}, r"quantkit 0\.0\.9 \(journal format \d+\)"),
])
def test_resume_of_a_run_another_quantkit_began_is_refused(synthetic, calib_txt, tmp_path, fields, writer):
    """A journal written by another quantkit version or journal format is named as such (an older one lacking a
    field had read as damaged), and not resumed: its layers could come from other arithmetic."""
    job = _interrupted(synthetic, calib_txt, tmp_path / "b")
    path = tmp_path / "b.partial" / "quantkit_journal.json"
    journal = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            del journal[key]
        else:
            journal[key] = value
    del journal["calibration_sha256"]  # an older shape, as well
    path.write_text(json.dumps(journal))
    with pytest.raises(QuantkitError, match=rf"b\.partial was written by {writer}, this is quantkit .*rerun with "
                                             "--overwrite to start afresh, or resume with the quantkit that began"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))


def test_model_without_tokenizer_or_a_linear_is_refused(synthetic, calib_txt, tmp_path):
    from safetensors.torch import load_file, save_file

    bare = shutil.copytree(synthetic, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()  # its tokenizer_config.json alone still loads, with the special tokens only
    _fails(tmp_path, "quantize", bare, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST, "-o",
           tmp_path / "out", match="no usable tokenizer beside the weights (no tokens but its special ones)")
    (bare / "tokenizer_config.json").unlink()
    for command in (["quantize", bare, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST, "-o",
                     tmp_path / "out"], ["eval", bare, "--data-dir", wikitext_rows(tmp_path / "data")]):
        _fails(tmp_path, *command, match="no tokenizer beside the weights (tokenizer.json, tokenizer.model, "
               "vocab.json, tokenizer_config.json are all missing)")
    holed = shutil.copytree(synthetic, tmp_path / "holed")
    index = json.loads((holed / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    shard = holed / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    (holed / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(tmp_path, "quantize", holed, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST, "-o",
           tmp_path / "out", match=f"the weights do not match config.json: it lacks {name}")


@pytest.mark.parametrize("edit,match", [
    ({"intermediate_size": 384},
     "model.layers.0.mlp.gate_proj.weight is [512, 256] where config.json makes [384, 256]"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]},  # Qwen2's q/k/v biases, which Llama lacks
     "it holds model.layers.0.self_attn.k_proj.bias, model.layers.0.self_attn.q_proj.bias"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": True, "mlp_bias": True},
     "it lacks model.layers.0.self_attn.o_proj.bias, model.layers.0.mlp.gate_proj.bias"),
    (None, "it lacks lm_head.weight"),  # the config does not tie it, and the checkpoint has none
])
def test_weights_that_disagree_with_the_config_are_refused_up_front(synthetic, calib_txt, tmp_path, edit, match):
    """A config.json that does not describe the weights beside it (a width, a bias it asks for or lacks, an lm_head
    it does not tie) is refused before any layer runs, naming the tensors, not in a layer's forward with a
    traceback, nor by dropping what it has no place for."""
    from safetensors.torch import load_file, save_file

    model = shutil.copytree(synthetic, tmp_path / "model")
    if edit is None:
        index = json.loads((model / "model.safetensors.index.json").read_text())
        shard = model / index["weight_map"].pop("lm_head.weight")
        tensors = load_file(shard)
        del tensors["lm_head.weight"]
        save_file(tensors, shard, metadata={"format": "pt"})
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **edit}))
    _fails(tmp_path, "quantize", model, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST, "-o",
           tmp_path / "out", match=f"the weights do not match config.json: {match}")


def test_group_size_not_dividing_names_layer(stories260k, tinystories_txt, tmp_path):
    _fails(tmp_path, "quantize", stories260k, "--recipe", "gptq-w4a16-g128", "-o", tmp_path / "out",
           "--calib", tinystories_txt, match="model.layers.0.self_attn.q_proj: group size 128 does not divide its "
           "input width 64")


def test_a_shape_error_the_overrides_caused_names_them(synthetic, stories260k, tinystories_txt, tmp_path):
    """The model's shapes refuse a group size only --set chose: the error names that override, not the others.
    Where the recipe file alone is refused as well, the overrides are not blamed."""
    result = cli("quantize", synthetic, "--recipe", "gptq-w4a16-g128", "-o", tmp_path / "out", *FAST,
                 "--set", "weights.group_size=96", "--set", "passes.gptq.damp=0.02")
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and not (tmp_path / "out.partial").exists(), result.output
    assert said.startswith("error: model.layers.0.self_attn.q_proj: group size 96 does not divide its input width "
                           "256") and said.endswith("(with the override weights.group_size=96)")
    result = cli("quantize", stories260k, "--recipe", "gptq-w4a16-g128", "-o", tmp_path / "out", "--calib",
                 tinystories_txt, "--set", "passes.gptq.damp=0.02")
    assert result.exit_code == 2 and "group size 128 does not divide" in result.output
    assert "overrides" not in result.output


def test_per_channel_fallback_when_opted_in(synthetic, calib_txt, tmp_path):
    out = tmp_path / "out"
    cli_ok("quantize", synthetic, "--recipe", "gptq-w4a16-g128", "-o", out, "--calib", calib_txt, *FAST,
           "--set", "weights.group_size=512", "--set", "weights.indivisible=per_channel")
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    strategies = {g["weights"]["strategy"]: g["targets"] for g in groups.values()}
    assert strategies["group"] == [r"re:.*mlp\.down_proj$"]  # 512 divides only down_proj's input
    assert len(strategies["channel"]) == 3


def test_dynamic_act_order_groups_are_refused_for_compressed_tensors(synthetic, tmp_path):
    _fails(tmp_path, "quantize", synthetic, "--recipe", "gptq-w4a16-g128", "-o", tmp_path / "out",
           "--set", "passes.gptq.static_groups=false", match="set passes.gptq.static_groups=true")


def test_unknown_recipe(stories260k, tmp_path):
    _fails(tmp_path, "quantize", stories260k, "--recipe", "gptq-w9", "-o", tmp_path / "out",
           match="unknown recipe 'gptq-w9'; bundled recipes:")


def test_recipe_typo(stories260k, tmp_path):
    _fails(tmp_path, "quantize", stories260k, "--recipe", "gptq-w4a16", "-o", tmp_path / "out",
           "--set", "weights.grup_size=64", match="unknown field 'grup_size'; allowed: bits")


def test_empty_calibration_file(stories260k, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails(tmp_path, "quantize", stories260k, "--recipe", "gptq-w4a16", "-o", tmp_path / "out",
           "--calib", empty, match="empty")


def test_calibration_shorter_than_one_window(stories260k, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time.\n")
    _fails(tmp_path, "quantize", stories260k, "--recipe", "gptq-w4a16", "-o", tmp_path / "out",
           "--calib", short, "--seq-len", "256", match="too short")


def test_missing_model(tmp_path):
    _fails(tmp_path, "quantize", tmp_path / "nope", "--recipe", "gptq-w4a16", "-o", tmp_path / "out",
           match="no such model directory")


def test_eval_missing_data_names_file(stories260k, tmp_path):
    result = cli("eval", stories260k, "--tasks", "wikitext", "--data-dir", tmp_path)
    assert result.exit_code == 2
    # the whole path, which the console may have wrapped over lines
    assert str(tmp_path / "wikitext-2-raw-v1" / "test.jsonl") in "".join(result.output.split())


@pytest.fixture(scope="module")
def rtn_artifact(synthetic, tmp_path_factory) -> Path:
    """An RTN artifact of the synthetic model (calibration text is read for the error measure alone)."""
    from quantkit.synthetic import write_calibration_text

    root = tmp_path_factory.mktemp("rtn")
    out = root / "art"
    cli_ok("quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib",
           write_calibration_text(root / "calib.txt"), *FAST)
    return out


@pytest.mark.parametrize("options,match", [
    (["--limit", "0"], "--limit"), (["--batch-size", "0"], "--batch-size"), (["--seq-len", "1"], "--seq-len"),
    (["--output-json", "."], "--output-json"),  # a directory
    (["--tasks", "wikitext,piqa"], "task piqa: missing data file"),  # before the model loads, so no wikitext run
    (["--tasks", " , "], "--tasks names no task"),
])
def test_eval_refuses_bad_options_before_loading_the_model(rtn_artifact, tmp_path, options, match):
    result = cli("eval", rtn_artifact, "--data-dir", wikitext_rows(tmp_path / "data"), *options)
    assert result.exit_code == 2 and match in " ".join(result.output.split()), result.output
    assert "evaluating" not in result.output and "Traceback" not in result.output


def test_bits_is_refused_where_there_is_no_width_to_choose(synthetic, rtn_artifact, tmp_path):
    """--bits reads an Any-Precision artifact at one of its widths: given a floating-point checkpoint, or an
    artifact of one fixed width other than the one asked, it is refused (exit 2, naming why), not ignored, which
    would report the model's own perplexity as that of the width asked for."""
    data = wikitext_rows(tmp_path / "data")
    result = cli("eval", synthetic, "--data-dir", data, "--bits", "3")
    assert result.exit_code == 2, result.output
    assert "--bits applies to Any-Precision artifacts" in " ".join(result.output.split())
    result = cli("eval", rtn_artifact, "--data-dir", data, "--bits", "3")
    assert result.exit_code == 2 and "serves only its 4 bits" in " ".join(result.output.split()), result.output


def test_tied_embeddings_stay_tied_through_quantize_and_eval(tmp_path, calib_txt):
    """A checkpoint that ties lm_head to the embeddings (it stores no lm_head tensor) is read with the embeddings as its
    head, quantized, and evaluated with the head tied again to the unchanged embeddings."""
    from transformers import AutoModelForCausalLM

    from quantkit.models.source import open_model

    model_dir = write_synthetic_llama(tmp_path / "tied", SyntheticLlama(
        hidden_size=128, intermediate_size=256, num_hidden_layers=1, tie_word_embeddings=True))
    source = open_model(model_dir)
    edges = source.edges()
    assert source.tied_embeddings and torch.equal(edges.lm_head, edges.embed)
    out = tmp_path / "art"
    cli_ok("quantize", model_dir, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", calib_txt, *FAST)
    loaded = load_for_eval(out).model
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert torch.equal(loaded.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    assert torch.equal(loaded.lm_head.weight, reference.model.embed_tokens.weight)


def test_a_config_that_ties_beside_a_stored_head_keeps_the_head(tmp_path, calib_txt):
    """config.json says tie_word_embeddings but the checkpoint stores an lm_head of its own: transformers reads the
    stored head (both present with different values, it does not tie them), and so do quantize, the artifact's
    config (tie_word_embeddings false) and eval, also of an artifact whose config still says tie. eval had tied the
    head to the embeddings, a different model (perplexity 9 where the checkpoint's is 538)."""
    from transformers import AutoModelForCausalLM

    model_dir = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                      num_hidden_layers=1))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert not torch.equal(reference.lm_head.weight, reference.model.embed_tokens.weight)
    out = tmp_path / "art"
    cli_ok("quantize", model_dir, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", calib_txt, *FAST)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    loaded = load_for_eval(out).model
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight)
    written = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**written, "tie_word_embeddings": True}))  # as quantize wrote it
    record_rewritten_file(out, out / "config.json")
    assert torch.equal(load_for_eval(out).model.lm_head.weight, reference.lm_head.weight)


def test_quantize_shorthands_win_over_set(synthetic, calib_txt, tmp_path):
    """--num-samples and --seq-len win over --set calibration.num_samples / seq_len (and over the recipe), as their
    help says: the calibration recorded is 3 x 48 tokens."""
    out = tmp_path / "out"
    cli_ok("quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", calib_txt,
           "--set", "calibration.num_samples=5", "--set", "calibration.seq_len=32", "--num-samples", "3",
           "--seq-len", "48")
    calibration = json.loads((out / "quantkit_manifest.json").read_text())["calibration"]
    assert (calibration["num_samples"], calibration["seq_len"]) == (3, 48)
    saved = yaml.safe_load((out / "quantkit_recipe.yaml").read_text())["calibration"]
    assert (saved["num_samples"], saved["seq_len"]) == (3, 48)


def test_quantize_data_dir_finds_a_named_set(synthetic, calib_txt, tmp_path, monkeypatch):
    """--data-dir is where a named --calib set is looked up: the run calibrates on the set's file there (the Hub
    offline and $QUANTKIT_DATA_DIR unset, so nothing else could supply it), and the manifest names it."""
    monkeypatch.delenv("QUANTKIT_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data"
    (data / "tinystories").mkdir(parents=True)
    shutil.copy(calib_txt, data / "tinystories/TinyStories-valid-subset.txt")
    out = tmp_path / "out"
    cli_ok("quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", "tinystories", "--data-dir", data,
           *FAST)
    source = json.loads((out / "quantkit_manifest.json").read_text())["calibration"]["source"]
    assert source == f"tinystories:{(data / 'tinystories/TinyStories-valid-subset.txt').resolve()}"


def test_eval_options_reach_the_perplexity(rtn_artifact, tmp_path):
    """--seq-len, --limit and --batch-size reach the perplexity (4 windows of 32 tokens, progress after each batch
    of 2), and --dtype its forward passes: bfloat16 scores near float32, but not bit for bit. A task named twice
    runs, and is recorded, once."""
    data = wikitext_rows(tmp_path / "data")
    ppl = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"{dtype}.json"
        result = cli_ok("eval", rtn_artifact, "--data-dir", data, "--seq-len", "32", "--limit", "4", "--batch-size",
                        "2", "--dtype", dtype, "--output-json", out, "--tasks", "wikitext, wikitext")  # run once
        progress = [line.split(",")[0] for line in result.output.splitlines() if line.startswith("wikitext windows:")]
        assert progress == ["wikitext windows: 2/4", "wikitext windows: 4/4"], result.output
        payload = json.loads(out.read_text())
        assert payload["options"] == {"tasks": ["wikitext"], "seq_len": 32, "limit": 4, "batch_size": 2,
                                      "dtype": dtype, "bits": None, "device": "cpu"}  # what the numbers depend on
        wikitext = payload["results"]["wikitext"]
        assert (wikitext["windows"], wikitext["seq_len"], wikitext["tokens"]) == (4, 32, 128)
        ppl[dtype] = wikitext["perplexity"]
    assert ppl["bfloat16"] != ppl["float32"] and ppl["bfloat16"] == pytest.approx(ppl["float32"], rel=0.05)


def test_eval_windows_are_capped_at_the_models_positions(tmp_path):
    """A --seq-len past the model's max_position_embeddings evaluates windows of max_position_embeddings tokens, with
    a note, as the option's help says."""
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, max_position_embeddings=48))
    out = tmp_path / "results.json"
    result = cli_ok("eval", model, "--seq-len", "64", "--limit", "2", "--data-dir", wikitext_rows(tmp_path / "data"),
                    "--output-json", out)
    assert "note: windows of 48 tokens (the model's max_position_embeddings), not 64" in " ".join(result.output.split())
    wikitext = json.loads(out.read_text())["results"]["wikitext"]
    assert (wikitext["seq_len"], wikitext["windows"], wikitext["tokens"]) == (48, 2, 96)


def test_eval_options_reach_lm_eval(rtn_artifact, tmp_path, monkeypatch):
    """--tasks (every lm-eval task, wikitext_lm included), --limit, --batch-size and --data-dir reach run_lm_eval as
    given (lm-eval itself replaced by a recorder: what is checked is the CLI's wiring, not lm-eval's scores)."""
    pytest.importorskip("lm_eval")
    from quantkit.eval import lmeval

    data = tmp_path / "data"
    (data / "piqa").mkdir(parents=True)
    (data / "piqa/validation.jsonl").write_text(json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 0}) + "\n")
    (data / "wikitext-2-raw-v1").mkdir()
    (data / "wikitext-2-raw-v1/document_level_test.jsonl").write_text(json.dumps({"page": " = A = \n"}) + "\n")
    calls = []

    def record(model, tokenizer, tasks, **kwargs):
        calls.append((tasks, kwargs))
        return {"piqa": {"acc": 0.5}, "wikitext_lm": {"word_perplexity": 9.0}}

    monkeypatch.setattr(lmeval, "run_lm_eval", record)
    result = cli_ok("eval", rtn_artifact, "--tasks", "piqa,wikitext_lm", "--data-dir", data, "--limit", "3",
                    "--batch-size", "2")
    assert calls == [(["piqa", "wikitext_lm"], {"data_dir": data, "limit": 3, "batch_size": 2})], calls
    results = json.loads(result.output.splitlines()[-1])["results"]
    assert results == {"piqa": {"acc": 0.5}, "wikitext_lm": {"word_perplexity": 9.0}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_eval_on_cuda_without_a_gpu_is_refused_before_loading(rtn_artifact, tmp_path):
    result = cli("eval", rtn_artifact, "--data-dir", wikitext_rows(tmp_path / "data"), "--device", "cuda")
    assert result.exit_code == 2 and "--device cuda: no CUDA device" in result.output, result.output
    assert "loading" not in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (eval --device cuda)")
@pytest.mark.parametrize("recipe", ["qoq", "atom-w4a4"])  # the epilogue zero point; grouped activations, KV4
def test_eval_on_cuda_matches_cpu(synthetic, calib_txt, tmp_path, recipe):
    """The GPU evaluates what the CPU does: the simulation's runtime tensors travel with the model, and only float
    sums in another order separate the two perplexities."""
    out = tmp_path / "out"
    cli_ok("quantize", synthetic, "--recipe", recipe, "-o", out, "--calib", calib_txt, *FAST)
    data = wikitext_rows(tmp_path / "data")
    ppl = {}
    for device in ("cpu", "cuda"):
        result = tmp_path / f"{device}.json"
        cli_ok("eval", out, "--data-dir", data, "--seq-len", "64", "--limit", "4", "--device", device,
               "--output-json", result)
        payload = json.loads(result.read_text())
        assert payload["options"]["device"] == device
        ppl[device] = payload["results"]["wikitext"]["perplexity"]
    assert ppl["cuda"] == pytest.approx(ppl["cpu"], rel=1e-2), ppl


def test_quantkit_warnings_read_as_the_tools(synthetic, tmp_path):
    """A warning of quantkit's own (here: random calibration windows that must overlap) prints as `warning: ...`,
    not as Python's source line of the call."""
    from quantkit.synthetic import write_calibration_text

    text = write_calibration_text(tmp_path / "calib.txt").read_text().splitlines()
    short = tmp_path / "short.txt"
    short.write_text("\n".join(text[:12]))  # about 4000 tokens, for 256 windows of 32
    done = subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", str(synthetic), "--recipe",
                           "rtn-w4a16-g128", "--calib", str(short), "--num-samples", "256", "--seq-len", "32", "-o",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=600)  # pytest would
    # catch the warning itself in this process
    lines = [line for line in done.stderr.splitlines() if "necessarily overlap" in line]
    assert done.returncode == 0 and lines and lines[0].startswith("warning: "), done.stderr
    assert "UserWarning" not in done.stderr


def test_validate_refuses_no_tokens(rtn_artifact):
    result = cli("validate", rtn_artifact, "--tokens", "0")
    assert result.exit_code == 2 and "--tokens" in result.output


@pytest.mark.parametrize("name,damage,match", [
    ("config.json", "garbage", "config.json: cannot read it"),
    ("config.json", "{}", "config.json: cannot read it (no 'model_type', no 'num_hidden_layers')"),
    ("model.safetensors.index.json", "[1]", "model.safetensors.index.json: cannot read it (not a JSON object)"),
    ("quantkit_recipe.yaml", "a: [", "quantkit_recipe.yaml: cannot read it"),
    ("quantkit_manifest.json", "no weights", "a damaged manifest (weights missing or of the wrong type)"),
])
def test_damaged_artifact_metadata_is_named(rtn_artifact, tmp_path, name, damage, match):
    """The artifact's small files damaged at their size (a copy gone wrong, an edit) give a short error naming the
    file, from eval and inspect alike, not a traceback."""
    out = shutil.copytree(rtn_artifact, tmp_path / "art")
    file = out / name
    if damage == "no weights":
        manifest = json.loads(file.read_text())
        del manifest["weights"]
        file.write_text(json.dumps(manifest))
    else:  # at the recorded size, which the size check cannot see
        file.write_text(damage.ljust(file.stat().st_size))
    data = wikitext_rows(tmp_path / "data")
    for args in (["eval", out, "--data-dir", data, "--limit", "1", "--seq-len", "64"], ["inspect", out]):
        if args[0] == "inspect" and name not in ("quantkit_manifest.json", "config.json"):
            continue  # inspect reads the manifest and the config, and only the headers of the shards
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert match in " ".join(result.output.split()) and "Traceback" not in result.output, (args, result.output)


@pytest.mark.parametrize("damage", ["truncated", "missing", "corrupt"])
def test_damaged_artifact_is_refused_with_the_file_named(stories260k, tinystories_txt, tmp_path, damage):
    """A shard cut short or gone (a copy that did not finish) is caught from the manifest's recorded sizes before
    anything reads the artifact; one of the right size that safetensors cannot read is named when it is read. Each
    as a short error (exit 2), not a traceback, by eval, validate and inspect alike."""
    out = tmp_path / "art"
    cli_ok("quantize", stories260k, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", tinystories_txt, *FAST,
           "--set", "weights.indivisible=per_channel")
    shard = out / "model-00002-of-00006.safetensors"
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
        match = f"{shard.name} has {len(data) // 2} bytes where {len(data)} were written"
    elif damage == "missing":
        shard.unlink()
        match = f"{shard.name} is missing"
    else:
        shard.write_bytes(data[:8] + b"@" * 16 + data[24:])  # the header's JSON, same size
        match = f"{shard.name}: cannot read this safetensors file"
    data = wikitext_rows(tmp_path / "data")  # eval checks its data before it reads the model
    for args in (["eval", out, "--tasks", "wikitext", "--data-dir", data], ["validate", out], ["inspect", out]):
        if damage == "corrupt" and args[0] == "validate":
            continue  # validate has no kernel for compressed-tensors (inspect reads every shard's header)
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert match in " ".join(result.output.split()), (args, result.output)
        assert "Traceback" not in result.output


def test_inspect_verify_hashes_every_file(stories260k, tinystories_txt, tmp_path):
    """--verify reads every file against its recorded sha256, and the manifest against its own digest: a shard
    changed in place, at its size (which the size check cannot see), or an edited manifest fails with exit 1 and its
    name; the untouched artifact verifies."""
    out = tmp_path / "art"
    cli_ok("quantize", stories260k, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", tinystories_txt, *FAST,
           "--set", "weights.indivisible=per_channel")
    assert "files match their recorded sha256" in cli_ok("inspect", out, "--verify").output
    shard = out / "model-00003-of-00006.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data
    shard.write_bytes(bytes(data))
    result = cli("inspect", out, "--verify")
    assert result.exit_code == 1 and "1 file(s) differ" in result.output and shard.name in result.output
    shard.write_bytes(bytes(data[:-1] + bytes([data[-1] ^ 0x01])))
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    manifest["layers"][0]["rel_error"] /= 2  # an edit of the manifest itself, which no file digest covers
    (out / "quantkit_manifest.json").write_text(json.dumps(manifest, indent=2))
    result = cli("inspect", out, "--verify")
    assert result.exit_code == 1 and "1 file(s) differ" in result.output and "quantkit_manifest.json" in result.output
    del manifest["manifest_sha256"]  # an artifact written before manifests had a digest: its files still checked
    (out / "quantkit_manifest.json").write_text(json.dumps(manifest, indent=2))
    assert "files match their recorded sha256" in cli_ok("inspect", out, "--verify").output


def test_inspect_describes_outliers_and_lookup_tables():
    """inspect's weight line says what Atom and Any-Precision store, not only bits and groups."""
    from dataclasses import asdict

    from quantkit.cli import _describe_weights
    from quantkit.quantizers import QuantSpec

    atom = asdict(QuantSpec(bits=4, symmetric=True, granularity="group", group_size=128, outliers=128, row_block=2))
    assert _describe_weights(atom, "atom") == (
        "4-bit sym, group 128, 128 INT8 outlier columns (Atom), a scale per 2 rows")
    anyprec = asdict(QuantSpec(bits=8, granularity="channel", codebook=True, min_bits=3))
    assert _describe_weights(anyprec, "anyprec") == (
        "3..8-bit lookup tables per row (non-uniform, Any-Precision bitplanes)")
    # the same spec exported as quantkit's own format holds no bitplanes
    assert _describe_weights(anyprec, "quantkit") == (
        "3..8-bit lookup tables per row (non-uniform, one int8 code a weight)")
    squeeze = asdict(QuantSpec(bits=3, granularity="channel", codebook=True))
    assert _describe_weights(squeeze, "anyprec") == (
        "3-bit lookup tables per row (non-uniform, Any-Precision bitplanes)")


def test_inspect_shows_the_simulated_runtime_and_every_layers_errors(tmp_path, calib_txt):
    """inspect says what eval simulates (A8 per token, KV4 per head) and lists each layer's relative error and
    attention-sink error as the manifest recorded them; an artifact without runtime quantization says fp."""
    import re

    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                   num_hidden_layers=2))
    out = tmp_path / "w8a8kv4"
    cli_ok("quantize", model, "--recipe", "rtn-w8a8", "-o", out, "--calib", calib_txt, "--num-samples", "2",
           "--seq-len", "32", "--set", "kv_cache={bits: 4, symmetric: false, granularity: head}")
    text = cli_ok("inspect", out).output
    assert re.search(r"activations\s+│ 8-bit per token", text) and re.search(r"kv cache\s+│ 4-bit per head", text)
    rows = re.findall(r"│\s+(\d+) │\s+([0-9.]+) │\s+([0-9.]+) │\s+[0-9.]+ │", text)
    layers = json.loads((out / "quantkit_manifest.json").read_text())["layers"]
    assert rows == [(str(r["index"]), f"{r['rel_error']:.5f}", f"{r['metrics']['sink_rel_error']:.5f}")
                    for r in layers]
    assert len(rows) == 2 and rows[0][1] != rows[0][2]
    plain = tmp_path / "w4a16"
    cli_ok("quantize", model, "--recipe", "rtn-w4a16-g128", "-o", plain, "--calib", calib_txt, "--num-samples", "2",
           "--seq-len", "32")
    text = cli_ok("inspect", plain).output
    assert re.search(r"activations\s+│ fp ", text) and re.search(r"kv cache\s+│ fp ", text)


def test_saved_recipe_names_the_calibration_data_and_verbose_logs_the_run(synthetic, calib_txt, tmp_path, caplog):
    """--calib goes into the saved recipe (the absolute path of a file; a named set by name), so that quantizing
    again from the saved recipe calibrates on the same tokens; -v logs the model, the calibration and each layer."""
    import logging

    import yaml

    out = tmp_path / "out"
    try:
        with caplog.at_level(logging.DEBUG, logger="quantkit"):
            cli_ok("-v", "quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", calib_txt, *FAST)
    finally:
        logging.getLogger("quantkit").setLevel(logging.NOTSET)
    saved = yaml.safe_load((out / "quantkit_recipe.yaml").read_text())
    assert saved["calibration"]["dataset"] == str(Path(calib_txt).resolve())
    messages = [r.getMessage() for r in caplog.records if r.name == "quantkit"]
    assert any(m.startswith("calibration: ") and str(calib_txt) in m for m in messages), messages
    assert any(m.startswith("layer 2: rel. error") for m in messages) and any(m.startswith("model ") for m in messages)
    again = tmp_path / "again"
    cli_ok("quantize", synthetic, "--recipe", out / "quantkit_recipe.yaml", "-o", again)
    calibration = [json.loads((d / "quantkit_manifest.json").read_text())["calibration"] for d in (out, again)]
    assert calibration[0]["sha256"] == calibration[1]["sha256"]


def test_eval_without_lm_eval_says_so_before_the_model(rtn_artifact, tmp_path, monkeypatch):
    """Without the eval extra, lm-eval tasks are refused before any model time (the wikitext run before them was
    thrown away)."""
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    data = wikitext_rows(tmp_path / "data")
    (data / "piqa").mkdir()
    (data / "piqa" / "validation.jsonl").write_text("")
    result = cli("eval", rtn_artifact, "--tasks", "wikitext,piqa", "--data-dir", data)
    assert result.exit_code == 2 and "pip install 'quantkit[eval]'" in result.output, result.output
    assert "evaluating" not in result.output


def test_calibrating_on_the_wikitext_test_split_warns(synthetic, tmp_path):
    """The WikiText-2 test rows (the only split in shared/, and what atom-w4a4's default set finds there) as
    calibration text: the run says that its WikiText-2 perplexity will be optimistic."""
    from quantkit.eval.perplexity import WIKITEXT_FILE

    data = wikitext_rows(tmp_path / "data")
    result = cli_ok("quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", tmp_path / "out", "--calib",
                    data / WIKITEXT_FILE, "--num-samples", "2", "--seq-len", "32")
    assert "calibrating on the WikiText-2 test split" in " ".join(result.output.split()), result.output


def test_the_quantization_method_is_read_from_either_form_of_config():
    """eval names a checkpoint's quantization method (its description, and whether transformers can load it) from
    config.json's dict or from the loaded transformers config, whose quantization_config is an object holding a
    QuantizationMethod enum: both read as the plain method name ("gptq"), not as the enum's repr
    ("QuantizationMethod.GPTQ", a method transformers would then seem not to know)."""
    from types import SimpleNamespace

    from transformers.utils.quantization_config import QuantizationMethod

    from quantkit.eval.loading import _quant_method

    assert _quant_method({"quantization_config": {"quant_method": "awq"}}) == "awq"
    assert _quant_method({}) is None and _quant_method({"quantization_config": {}}) is None
    loaded = SimpleNamespace(quantization_config=SimpleNamespace(quant_method=QuantizationMethod.GPTQ))
    assert _quant_method(loaded) == "gptq"
    assert _quant_method(SimpleNamespace(quantization_config={"quant_method": QuantizationMethod.AWQ})) == "awq"
    assert _quant_method(SimpleNamespace()) is None


def _edit_json(artifact: Path, name: str, change) -> None:
    """Apply `change` to the dict in JSON file `name` of an artifact, and record the file as written."""
    file = artifact / name
    content = json.loads(file.read_text())
    change(content)
    file.write_text(json.dumps(content))
    record_rewritten_file(artifact, file)


def _set(key: str, value):
    return lambda d: d.__setitem__(key, value)


# Edits of an artifact whose files are whole (sizes and hashes recorded) but whose content a reader must refuse, each
# with what the refusal says. The synthetic model: 3 layers, hidden 256, MLP 512, 4 heads of 64, 2 KV heads, vocab 512;
# rtn-w4a16-g128 stores compressed-tensors pack-quantized weights (weight_packed, weight_scale fp16 [N, K/128],
# weight_shape).
_DOWN = "model.layers.0.mlp.down_proj."
EDITED_ARTIFACTS = {
    "config hidden_size": (("config.json", _set("hidden_size", 320)),
                           "the tensors and config.json disagree: model.embed_tokens.weight is [512, 256] where "
                           "config.json makes it [512, 320]"),
    "config vocab_size": (("config.json", _set("vocab_size", 500)), "model.embed_tokens.weight is [512, 256] where "
                                                                    "config.json makes it [500, 256]"),
    "config num_key_value_heads": (("config.json", _set("num_key_value_heads", 4)),
                                   "model.layers.0.self_attn.k_proj.weight is [128, 256] where config.json makes it "
                                   "[256, 256]"),
    "config torch_dtype foo": (("config.json", _set("torch_dtype", "foo")),
                               "torch_dtype is 'foo', not one of float16, bfloat16, float32"),
    "config torch_dtype int8": (("config.json", _set("torch_dtype", "int8")), "torch_dtype is 'int8', not one of"),
    "config torch_dtype Tensor": (("config.json", _set("torch_dtype", "Tensor")), "torch_dtype is 'Tensor', not one"),
    "config layers as text": (("config.json", _set("num_hidden_layers", "3")),
                              "num_hidden_layers is '3', not an integer"),
    "a norm's shape": (("model.layers.1.input_layernorm.weight", lambda t: torch.cat([t, t[:1]])),
                       "model.layers.1.input_layernorm.weight is [257] where config.json makes it [256]"),
    "a stray tensor": (("model.layers.1.input_layernorm.bias", None),
                       "holds tensor(s) model.layers.1.input_layernorm.bias, which its config.json's model has no "
                       "place for"),
    "a scale in bfloat16": ((_DOWN + "weight_scale", lambda t: t.to(torch.bfloat16)),
                            "layer 0 mlp.down_proj: its weight_scale is bfloat16 [256, 4] where the layout has "
                            "float16 [256, 4], not what the compressed-tensors packer writes"),
    "a shape's rows": ((_DOWN + "weight_shape", lambda t: t + torch.tensor([1, 0])),
                       "layer 0 mlp.down_proj: its weight_shape holds bits the layout does not write for them"),
    "a scale row short": ((_DOWN + "weight_scale", lambda t: t[:-1].clone()),
                          "layer 0 mlp.down_proj: scale is [255, 4] for a weight of 256 x 512 (256 row(s) each)"),
    "a scale column short": ((_DOWN + "weight_scale", lambda t: t[:, :3].clone()),
                             "layer 0 mlp.down_proj: scale has 3 columns for 4 group(s) of 128"),
    "a scale of one column": ((_DOWN + "weight_scale", lambda t: t[:, :1].clone()),  # would broadcast over them
                              "layer 0 mlp.down_proj: scale has 1 columns for 4 group(s) of 128"),
    "a zero point for symmetric weights": ((_DOWN + "weight_zero_point", None),
                                           "layer 0 mlp.down_proj: it holds tensor(s) weight_zero_point that its "
                                           "layout does not have"),
    "manifest spec field unknown": (("quantkit_manifest.json", lambda m: m["weights"]["o"].__setitem__("colour", 1)),
                                    "the manifest's weights.o has unknown field(s) colour"),
    "manifest spec not a spec": (("quantkit_manifest.json", lambda m: m["weights"]["o"].__setitem__("bits", 11)),
                                 "the manifest's weights.o is not a weight spec (bits must be in 2..8, got 11)"),
    "manifest spec not the recipe's": (
        ("quantkit_manifest.json", lambda m: m["weights"]["o"].__setitem__("symmetric", False)),
        "the manifest's weights.o ({'bits': 4, 'symmetric': False"),
    "manifest role dropped": (("quantkit_manifest.json", lambda m: m["weights"].pop("down")),
                              "the manifest quantizes roles qkv, o, gate_up where its recipe targets qkv, o, "
                              "gate_up, down"),
}


@pytest.mark.parametrize("edit", EDITED_ARTIFACTS)
def test_eval_refuses_an_edited_artifact_naming_what_disagrees(rtn_artifact, tmp_path, edit):
    """An artifact whose config.json, manifest or tensors were edited (recorded, so every file is whole) is refused
    as damaged (exit 2), naming what disagrees, before any evaluation: not a traceback from
    transformers' load_state_dict or the dequantization, and not values read with arithmetic they were not
    written in (a bfloat16 scale read as fp16's, a zero point a symmetric spec never wrote)."""
    (target, change), match = EDITED_ARTIFACTS[edit]
    edited = shutil.copytree(rtn_artifact, tmp_path / "edited")
    if target.endswith(".json"):
        _edit_json(edited, target, change)
    elif change is None:  # a tensor added: a copy of one of the same layer's
        like = {"bias": "model.layers.1.input_layernorm.weight", "weight_zero_point": _DOWN + "weight_packed"}
        source = like[target.rsplit(".", 1)[1]]
        shard = json.loads((edited / "model.safetensors.index.json").read_text())["weight_map"][source]
        tensors = read_safetensors(edited / shard)
        tensors[target] = tensors[source][:, :1].clone() if tensors[source].ndim == 2 else tensors[source].clone()
        from safetensors.torch import save_file

        save_file(tensors, str(edited / shard), metadata={"format": "pt"})
        _edit_json(edited, "model.safetensors.index.json", lambda d: d["weight_map"].__setitem__(target, shard))
        record_rewritten_file(edited, edited / shard)
    else:
        rewrite_tensor(edited, target, change)
    result = cli("eval", edited, "--data-dir", wikitext_rows(tmp_path / "data"), "--limit", "1", "--seq-len", "64")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and match in text, result.output
    assert "Traceback" not in result.output and "perplexity" not in text


def test_eval_names_a_linear_whose_shape_tensor_is_cut_short(rtn_artifact, tmp_path):
    """A compressed-tensors linear whose weight_shape holds one value in place of two (indexing it raises an
    IndexError in the unpack) is refused as a damaged artifact (exit 2) naming the layer and the linear, not with
    a traceback."""
    damaged = shutil.copytree(rtn_artifact, tmp_path / "damaged")
    rewrite_tensor(damaged, "model.layers.0.mlp.down_proj.weight_shape", lambda t: t[:1].clone())
    result = cli("eval", damaged, "--data-dir", wikitext_rows(tmp_path / "data"), "--limit", "1", "--seq-len", "64")
    assert result.exit_code == 2, result.output
    assert "layer 0 mlp.down_proj: its tensors do not fit the manifest's 4-bit spec" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_eval_refuses_what_it_would_score_wrong(rtn_artifact, synthetic, tmp_path):
    """What would score a model with layers missing or weights at random values is an error, not a perplexity: a
    config.json naming fewer layers than the manifest wrote, a tensor gone from an artifact (its manifest updated,
    so the sizes agree) or from an FP checkpoint, and a checkpoint of a method transformers cannot load (a quantkit
    artifact without its manifest among them)."""
    from safetensors.torch import load_file, save_file

    data = wikitext_rows(tmp_path / "data")

    def refused(path: Path, match: str) -> None:
        result = cli("eval", path, "--data-dir", data, "--limit", "1", "--seq-len", "64")
        assert result.exit_code == 2 and match in " ".join(result.output.split()), result.output
        assert "Traceback" not in result.output

    def drop(root: Path, name: str) -> Path:
        """Remove tensor `name` from the shard of `root` that holds it, and from the index; returns that shard."""
        shard = next(p for p in sorted(root.glob("*.safetensors")) if name in load_file(str(p)))
        tensors = load_file(str(shard))
        del tensors[name]
        save_file(tensors, str(shard))
        index = root / "model.safetensors.index.json"
        content = json.loads(index.read_text())
        del content["weight_map"][name]
        index.write_text(json.dumps(content))
        return shard

    fewer = shutil.copytree(rtn_artifact, tmp_path / "fewer")
    config = json.loads((fewer / "config.json").read_text())
    config["num_hidden_layers"] -= 1
    (fewer / "config.json").write_text(json.dumps(config))
    record_rewritten_file(fewer, fewer / "config.json")  # an edit the size check cannot see
    refused(fewer, "config.json says 2 layers where the manifest wrote 3")
    assert "config.json says 2 layers" in " ".join(cli("inspect", fewer).output.split())

    lacking = shutil.copytree(rtn_artifact, tmp_path / "lacking")
    record_rewritten_file(lacking, drop(lacking, "model.layers.1.input_layernorm.weight"))
    record_rewritten_file(lacking, lacking / "model.safetensors.index.json")
    refused(lacking, "the artifact lacks tensor(s) model.layers.1.input_layernorm.weight")

    # an index naming a file outside the artifact (or none there) is damage, as in a checkpoint, not a path to read
    astray = shutil.copytree(rtn_artifact, tmp_path / "astray")
    index = astray / "model.safetensors.index.json"
    for shard, match in [("../lacking/" + sorted(astray.glob("*.safetensors"))[0].name,
                          "the weight_map of model.safetensors.index.json is not a mapping of tensor names to files "
                          "of the directory; the artifact is damaged"),
                         ("gone.safetensors", "gone.safetensors, named by model.safetensors.index.json, is missing; "
                                              "the artifact is damaged")]:
        content = json.loads(index.read_text())
        content["weight_map"][next(iter(content["weight_map"]))] = shard
        index.write_text(json.dumps(content))
        record_rewritten_file(astray, index)
        refused(astray, match)

    fp = shutil.copytree(synthetic, tmp_path / "fp")
    drop(fp, "model.layers.2.mlp.down_proj.weight")
    refused(fp, "the weights do not match config.json: it lacks model.layers.2.mlp.down_proj.weight")

    bare = shutil.copytree(rtn_artifact, tmp_path / "bare")
    (bare / "quantkit_manifest.json").unlink()
    config = json.loads((bare / "config.json").read_text())
    # methods transformers does not load: refused before it loads the model with the linears at random
    for method, match in [("quantkit", "is a quantkit artifact (export format quantkit) without its "
                                       "quantkit_manifest.json"),
                          ("qoq", "is a quantkit artifact (export format qserve) without its quantkit_manifest.json"),
                          ("marlin24", "quantization method 'marlin24' (config.json's quantization_config), which "
                                       "transformers cannot load and quantkit did not write")]:
        config["quantization_config"] = {"quant_method": method}
        (bare / "config.json").write_text(json.dumps(config))
        refused(bare, match)
    # a compressed-tensors checkpoint without quantkit's manifest is transformers' to load, and what it lacks is named
    packed = shutil.copytree(rtn_artifact, tmp_path / "packed")
    (packed / "quantkit_manifest.json").unlink()
    drop(packed, "model.layers.1.mlp.up_proj.weight_scale")
    refused(packed, "the checkpoint lacks tensor(s) model.layers.1.mlp.up_proj.weight_scale")


def test_eval_names_malformed_data_and_unwritable_output_before_loading_the_model(rtn_artifact, tmp_path):
    """Data files that are there but not what a task reads are named with their line, every task's problem at once,
    and an --output-json that cannot be written is refused, all before any model time."""
    from quantkit.eval.perplexity import WIKITEXT_FILE

    data = wikitext_rows(tmp_path / "data")
    rows = (data / WIKITEXT_FILE).read_text().splitlines()
    (data / WIKITEXT_FILE).write_text("\n".join([*rows[:3], '{"txt": "a row"}', *rows[3:]]) + "\n")
    (data / "piqa").mkdir()
    (data / "piqa" / "validation.jsonl").write_text('{"goal": "x", "sol1": "a", "sol2": "b", "label": 0}\n{"goal"\n')
    (data / "wikitext-2-raw-v1" / "document_level_test.jsonl").write_text('{"page": "p"}\n{"page": null}\n')
    result = cli("eval", rtn_artifact, "--tasks", "wikitext,piqa,wikitext_lm", "--data-dir", data)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"{WIKITEXT_FILE}, line 4: no field 'text' (found 'txt')" in text
    assert "piqa/validation.jsonl, line 2: not a JSON object per line" in text
    assert "loading" not in text
    # values lm-eval would fail on after the model loaded (an index past the choices), or score as text
    for row, match in [('{"goal": "x", "sol1": "a", "sol2": "b", "label": 5}', "field 'label' is 5, not one of 0..1"),
                       ('{"goal": null, "sol1": "a", "sol2": "b", "label": 0}', "field 'goal' is not text")]:
        (data / "piqa" / "validation.jsonl").write_text(row + "\n")
        result = cli("eval", rtn_artifact, "--tasks", "piqa", "--data-dir", data)
        assert result.exit_code == 2 and f"line 1: {match} (task piqa)" in " ".join(result.output.split())
    for blank in ("", '{"text": ""}\n{"text": " \\n"}\n'):  # no rows, or rows of whitespace only
        (data / WIKITEXT_FILE).write_text(blank)
        result = cli("eval", rtn_artifact, "--data-dir", data)
        assert result.exit_code == 2 and "test.jsonl holds no text (task wikitext)" in " ".join(result.output.split())
    for where, match in [("", "--output-json '.': name the file to write"),
                         (tmp_path / "nowhere" / "r.json", "nowhere does not exist")]:
        result = cli("eval", rtn_artifact, "--data-dir", wikitext_rows(tmp_path / "good"), "--output-json", where)
        assert result.exit_code == 2 and match in result.output, result.output
    result = cli("eval", rtn_artifact, "--data-dir", wikitext_rows(tmp_path / "good"), "--output-json",
                 "/proc/quantkit-results.json")
    assert result.exit_code == 2 and "--output-json: cannot write in /proc" in result.output, result.output
    assert "evaluating" not in result.output
    # never over the model being evaluated, nor over a file that is not an earlier results file
    config = (rtn_artifact / "config.json").read_bytes()
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for where, match in [(rtn_artifact / "config.json", "whose files it would overwrite"),
                         (notes, "exists and is not a results file of quantkit eval")]:
        result = cli("eval", rtn_artifact, "--data-dir", wikitext_rows(tmp_path / "good"), "--output-json", where)
        assert result.exit_code == 2 and match in " ".join(result.output.split()), result.output
    assert (rtn_artifact / "config.json").read_bytes() == config and notes.read_text() == "mine"


def test_inspect_names_a_damaged_manifest_field_and_files_outside_the_artifact(rtn_artifact, tmp_path):
    """The fields inside the manifest's entries that inspect reads are checked like its top-level ones, and a file
    entry must name a file of the artifact itself (never a path that a size check or --verify would follow)."""
    for damage, match in [
        (lambda m: m["timings"].pop("total_seconds"), "timings.total_seconds missing or of the wrong type"),
        (lambda m: m["calibration"].pop("sha256"), "calibration.sha256 missing or of the wrong type"),
        (lambda m: m["layers"][0].pop("rel_error"), "layers.0.rel_error missing or of the wrong type"),
        (lambda m: m["files"].update({"../outside": {"bytes": 1, "sha256": "0" * 64}}),
         "files lists '../outside', not file names of the artifact"),
        # fields inspect shows where present, which had ended in a KeyError or a format error
        (lambda m: m.update(activations={"x": 1}), "activations.bits missing or of the wrong type"),
        (lambda m: m.update(kv_cache={"bits": "4"}), "kv_cache.bits missing or of the wrong type"),
        (lambda m: m["layers"][0]["metrics"].update(sink_rel_error="abc"),
         "layers.0.metrics.sink_rel_error missing or of the wrong type"),
        (lambda m: m["timings"].update(resumed_layers=1), "timings.resumed_layer_seconds missing or of the wrong"),
    ]:
        out = shutil.copytree(rtn_artifact, tmp_path / "art", dirs_exist_ok=True)
        manifest = json.loads((out / "quantkit_manifest.json").read_text())
        damage(manifest)
        (out / "quantkit_manifest.json").write_text(json.dumps(manifest))
        result = cli("inspect", out)
        assert result.exit_code == 2 and match in " ".join(result.output.split()), result.output
        assert "Traceback" not in result.output
        shutil.rmtree(out)


def test_inspect_warns_of_an_edited_manifest_and_names_what_it_was_given(rtn_artifact, tmp_path):
    """Plain inspect checks the manifest against its own digest (no file read) and warns where it was edited; the
    manifest file passed for its folder, and an artifact whose run is still OUT.partial, are named as such."""
    out = shutil.copytree(rtn_artifact, tmp_path / "art")
    assert "warning" not in cli_ok("inspect", out).output
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    manifest["recipe"] = "something-else"
    (out / "quantkit_manifest.json").write_text(json.dumps(manifest))
    said = " ".join(cli_ok("inspect", out).output.split())
    assert "warning: the manifest's content differs from its recorded digest" in said and "something-else" in said
    result = cli("inspect", out / "quantkit_manifest.json")
    assert result.exit_code == 2 and f"is a file; pass the artifact's folder ({out})" in " ".join(
        result.output.split())
    shutil.copytree(rtn_artifact, tmp_path / "run.partial")
    for command in ("inspect", "validate"):
        result = cli(command, tmp_path / "run")
        assert result.exit_code == 2 and "does not exist; " in result.output and "run.partial holds an unfinished " \
            "run" in " ".join(result.output.split()), result.output


def test_a_directory_named_after_a_recipe_does_not_hide_it(tmp_path, monkeypatch):
    """`-r rtn-w8a8 -o rtn-w8a8` a second time: the output directory in the working directory is not a recipe file,
    so the bundled recipe is meant; a file of that name still wins, and a non-UTF-8 one is named."""
    from quantkit.recipe import RecipeError, load_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rtn-w8a8").mkdir()
    assert load_recipe("rtn-w8a8").name == "rtn-w8a8"
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(RecipeError, match="elsewhere is not a file, and there is no 'elsewhere'"):
        load_recipe("elsewhere")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(RecipeError, match="bin.yaml: cannot read it as UTF-8 text"):
        load_recipe("bin.yaml")


def test_an_interrupted_overwrite_says_how_to_resume(synthetic, calib_txt, tmp_path):
    """A run that replaces OUT and is interrupted is continued by --resume --overwrite, which its interruption's
    hint and the refusal of a bare --resume name (OUT is complete, but OUT.partial is the run to continue)."""
    recipe = load_recipe("rtn-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64"])
    job = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "b", calib=str(calib_txt))
    run_quantize(job)
    reporter = _InterruptAfter(1)
    reporter.said = []
    reporter.warn = reporter.said.append
    with pytest.raises(KeyboardInterrupt):
        run_quantize(QuantizeJob(**{**job.__dict__, "overwrite": True}), reporter)
    assert "rerun with --resume --overwrite to continue" in reporter.said[-1]
    with pytest.raises(QuantkitError, match="holds an unfinished run .* that replaces .*--resume --overwrite"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))
    summary = run_quantize(QuantizeJob(**{**job.__dict__, "resume": True, "overwrite": True}))
    assert [r.replayed for r in summary.layers] == [True, False, False]


@pytest.mark.parametrize("where", ["before the journal", "after the journal"])
def test_an_interrupt_before_the_first_layer_keeps_nothing(synthetic, calib_txt, tmp_path, monkeypatch, where):
    """Ctrl-C before any layer is finished (once OUT.partial is made, before or after the journal is written) leaves no
    OUT.partial and says nothing is kept: it had said "rerun with --resume", which then refused, finding nothing to
    resume; a plain rerun then runs."""
    import quantkit.pipeline as pipeline

    recipe = load_recipe("rtn-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64"])
    job = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "b", calib=str(calib_txt))
    target = "_weights_stamp" if where == "before the journal" else "_journal_for"  # inside the run's scope
    real = getattr(pipeline, target)

    def stopped(*args, **kwargs):
        if target == "_journal_for":
            real(*args, **kwargs)  # written, with no layer yet
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, target, stopped)
    reporter = _Warnings()
    with pytest.raises(KeyboardInterrupt):
        run_quantize(job, reporter)
    assert reporter.said[-1] == "interrupted before any layer was finished: nothing is kept; rerun to start again"
    assert not (tmp_path / "b.partial").exists() and not (tmp_path / "b").exists()
    monkeypatch.setattr(pipeline, target, real)
    assert len(run_quantize(job).layers) == 3


def test_an_unexpected_error_before_the_first_layer_leaves_no_work_dir(synthetic, calib_txt, tmp_path, monkeypatch):
    """An exception no check foresaw (a bug: here the packer's) raised before any layer was finished ends the run
    with it, and leaves no OUT.partial: its journal of no layers had made the next run refuse, asking for --resume
    or --overwrite. A weights.outliers override that compressed-tensors cannot store is refused up front."""
    from quantkit.formats.compressed_tensors import CompressedTensorsPacker

    def broken(self, q):
        raise ValueError("codes out of range for 4 bits")

    monkeypatch.setattr(CompressedTensorsPacker, "pack", broken)
    recipe = load_recipe("rtn-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64"])
    job = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "b", calib=str(calib_txt))
    with pytest.raises(ValueError, match="codes out of range"):
        run_quantize(job)
    assert not (tmp_path / "b.partial").exists()
    monkeypatch.undo()
    result = cli("quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", tmp_path / "c", "--calib", calib_txt,
                 *FAST, "--set", "weights.outliers=128")
    assert result.exit_code == 2 and "compressed-tensors cannot express Atom's INT8 outlier columns" in \
        " ".join(result.output.split()), result.output
    assert not (tmp_path / "c.partial").exists()


def test_a_commit_interrupted_between_its_renames_resumes(synthetic, calib_txt, tmp_path, monkeypatch):
    """--overwrite's commit moves the old OUT aside, then OUT.partial into place: interrupted between the two, the
    work dir still holds its journal, so --resume finishes the run (the hint says so), and the old output that was
    moved aside is deleted then."""
    recipe = load_recipe("rtn-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64"])
    job = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "b", calib=str(calib_txt),
                      overwrite=True)
    run_quantize(job)
    rename = Path.rename

    def cut(self, target):
        if self.name == "b.partial":
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", cut)
    reporter = _Warnings()
    with pytest.raises(KeyboardInterrupt):
        run_quantize(job, reporter)
    monkeypatch.setattr(Path, "rename", rename)
    assert not (tmp_path / "b").exists() and (tmp_path / "b.partial" / "quantkit_journal.json").is_file()
    assert "rerun with --resume to continue" in reporter.said[-1]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".b.trash-")]  # the old output, moved aside
    summary = run_quantize(QuantizeJob(**{**job.__dict__, "resume": True, "overwrite": False}))
    assert all(r.replayed for r in summary.layers)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".b", "b"))) == ["b"]
    manifest = json.loads((tmp_path / "b" / "quantkit_manifest.json").read_text())
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted([*manifest["files"], "quantkit_manifest.json"])


def test_a_run_killed_before_its_journal_can_be_restarted(synthetic, calib_txt, tmp_path):
    """OUT.partial with a lock and no journal (killed before it wrote one, or while --overwrite deleted it): a plain
    run and --resume say there is nothing to resume and to pass --overwrite, which restarts it; a complete OUT that
    a kill left holding its run's journal and lock, and a directory a kill left in the trash, are cleaned up."""
    recipe = load_recipe("rtn-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64"])
    job = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "b", calib=str(calib_txt))
    work = tmp_path / "b.partial"
    work.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (work / "quantkit_run.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    (work / "model-00001-of-00004.safetensors").write_bytes(b"a shard without a journal")
    with pytest.raises(QuantkitError, match="killed before it recorded anything to resume; pass --overwrite"):
        run_quantize(job)
    with pytest.raises(QuantkitError, match="holds no journal .* rerun with --overwrite"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))
    trash = tmp_path / ".b.partial.trash-0123456789ab"
    trash.mkdir()
    (trash / "left.safetensors").write_bytes(b"x")
    run_quantize(QuantizeJob(**{**job.__dict__, "overwrite": True}))
    assert not trash.exists() and not work.exists()
    for name in ("quantkit_journal.json", "quantkit_run.lock"):  # a commit killed right after its rename
        (tmp_path / "b" / name).write_text("{}")
    with pytest.raises(QuantkitError, match="already exists"):
        run_quantize(job)
    assert not any((tmp_path / "b" / name).exists() for name in ("quantkit_journal.json", "quantkit_run.lock"))
    # an OUT.partial of someone else's files: --resume does not send the user to an --overwrite that refuses it
    stray = tmp_path / "g.partial"
    stray.mkdir()
    (stray / "keep.txt").write_text("x")
    elsewhere = QuantizeJob(**{**job.__dict__, "output": tmp_path / "g"})
    with pytest.raises(QuantkitError, match="holds no journal, and files that are not quantkit's, so nothing can be "
                                            "resumed; choose another output path, or empty it yourself"):
        run_quantize(QuantizeJob(**{**elsewhere.__dict__, "resume": True}))
    with pytest.raises(QuantkitError, match="is not quantkit's output"):
        run_quantize(QuantizeJob(**{**elsewhere.__dict__, "overwrite": True}))
    assert (stray / "keep.txt").read_text() == "x"


def test_resume_removes_stray_directories_from_the_work_dir(synthetic, calib_txt, tmp_path):
    job = _interrupted(synthetic, calib_txt, tmp_path / "b")
    (tmp_path / "b.partial" / "stray" / "deep").mkdir(parents=True)
    run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))
    assert not (tmp_path / "b" / "stray").exists()


def test_eval_of_a_model_with_a_nan_weight_is_an_error(synthetic, tmp_path):
    """A NaN weight makes every logit after it NaN: eval says so and exits 2, where it reported perplexity NaN."""
    model = shutil.copytree(synthetic, tmp_path / "m")
    set_weight(model, "model.layers.1.mlp.down_proj.weight", float("nan"))
    result = cli("eval", model, "--data-dir", wikitext_rows(tmp_path / "data"), "--seq-len", "64", "--limit", "2")
    assert result.exit_code == 2 and "the WikiText-2 perplexity is NaN" in " ".join(result.output.split())


def test_calibration_larger_than_memory_is_refused_up_front(synthetic, calib_txt, tmp_path):
    """A --num-samples whose activation cache exceeds the machine's memory was killed by the OOM killer (or failed
    with a MemoryError deep in sampling) with no word of why: it is refused before any work, with the sizes."""
    _fails(tmp_path, "quantize", synthetic, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, "--num-samples",
           "100000000", "--seq-len", "64", "-o", tmp_path / "out",
           match="calibration on 100000000 windows of 64 tokens keeps")


def test_misleading_inputs_are_named_for_what_they_are(synthetic, rtn_artifact, calib_txt, tmp_path):
    """An artifact given to quantize is already quantized (it said a tensor was not found); a --data-dir that is a
    file is not a directory (it said it did not exist); a recipe path that is a directory is one (it said not
    found)."""
    _fails(tmp_path, "quantize", rtn_artifact, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST, "-o",
           tmp_path / "out", match="is already quantized (a quantkit artifact); quantize the original")
    a_file = tmp_path / "data.txt"
    a_file.write_text("x")
    _fails(tmp_path, "quantize", synthetic, "--recipe", "rtn-w4a16-g128", "--calib", "c4", "--data-dir", a_file,
           *FAST, "-o", tmp_path / "out", match=f"data dir {a_file} is not a directory")
    (tmp_path / "r.yaml").mkdir()
    _fails(tmp_path, "quantize", synthetic, "--recipe", tmp_path / "r.yaml", "--calib", calib_txt, *FAST, "-o",
           tmp_path / "out", match="r.yaml is a directory")


def test_an_atomic_write_leaves_the_old_file_or_the_new_one(tmp_path, monkeypatch):
    """A writer that fails half-way (a full disk, a kill) leaves the file as it was and no temp file beside it; a
    write that finishes is on disk (fsynced) before its rename puts it in place, so a crash cannot leave a journal or
    shard name pointing at lost bytes, and it gets the mode a plain `open` gives a new file under the umask (0o666
    less the umask), not the private 0o600 of a temp file."""
    from quantkit.files import atomic_write, atomic_write_with

    path = tmp_path / "quantkit_journal.json"
    path.write_text("old")

    def half(tmp: str) -> None:
        Path(tmp).write_text("ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_with(path, half)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [path.name]

    events: list[tuple] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        events.append(("fsync", os.fstat(fd).st_ino, path.read_text()))
        fsync(fd)

    def spy_replace(src, dst) -> None:
        events.append(("replace", Path(dst).name))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    atomic_write(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == [path.name]
    # one fsync, of the file now in place, while the old one still was; then the rename
    assert events == [("fsync", path.stat().st_ino, "old"), ("replace", path.name)]
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_lock_stamp_names_its_owner_and_only_a_live_one(tmp_path):
    """take_lock's stamp replaces whatever the lock file held (a longer stamp left by a killed run must not trail
    after it and make it unreadable); a stamp counts as a live owner while its process lives, never once it has
    ended, and always when it names another host, whose pids cannot be checked from here."""
    from quantkit.files import lock_owner, take_lock

    path = tmp_path / "quantkit_run.lock"
    path.write_text(json.dumps({"pid": 4_000_000, "host": "a-host-name-much-longer-than-any-real-one" * 4}))
    fd = take_lock(path)
    try:
        assert fd is not None
        assert json.loads(path.read_text()) == {"pid": os.getpid(), "host": socket.gethostname()}
    finally:
        os.close(fd)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    assert lock_owner(path) is None
    path.write_text(json.dumps({"pid": dead.pid, "host": "another-host.example"}))
    assert lock_owner(path) == f"pid {dead.pid} on another-host.example"


def test_verify_covers_every_file_and_every_field_of_the_manifest(rtn_artifact, tmp_path):
    """--verify's check is complete: a file other than a shard (config.json, the saved recipe) changed at its size is
    named; an edit of any manifest field, its list of files included (a file dropped from it would go unchecked), is
    caught by the manifest's own digest; and the digest is of the content, so a manifest rewritten with its keys in
    another order still verifies."""
    from quantkit.artifact import MANIFEST, verify_files

    out = shutil.copytree(rtn_artifact, tmp_path / "art")
    manifest = json.loads((out / MANIFEST).read_text())
    assert verify_files(out, manifest) == []
    assert verify_files(out, json.loads(json.dumps(manifest, sort_keys=True))) == []
    for key in manifest:
        if key == "manifest_sha256":
            continue
        edited = {**manifest, key: ["edited"]} if key != "files" else {
            **manifest, "files": {k: v for k, v in manifest["files"].items() if k != "config.json"}}
        assert verify_files(out, edited) == [MANIFEST], key
    for name in ("config.json", "quantkit_recipe.yaml"):
        data = bytearray((out / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (out / name).write_bytes(bytes(data))
    assert sorted(verify_files(out, manifest)) == ["config.json", "quantkit_recipe.yaml"]


def test_overwrite_takes_a_directory_of_temp_files_alone_as_quantkits(tmp_path):
    """A directory that holds nothing but atomic writes' temp files is what a killed run left, and --overwrite may
    replace it; one temp file beside a file of the user's does not make their directory quantkit's."""
    from quantkit.artifact import ArtifactError, OutputDir

    left = tmp_path / "left"
    left.mkdir()
    (left / ".model-00001-of-00004.safetensors.x1.tmp").write_bytes(b"cut short")
    OutputDir(left).check(resume=False, overwrite=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".notes.txt.x2.tmp").write_text("an editor's temp file")
    (mine / "thesis.txt").write_text("precious")
    with pytest.raises(ArtifactError, match="already exists and is not quantkit's output"):
        OutputDir(mine).check(resume=False, overwrite=True)
    assert (mine / "thesis.txt").read_text() == "precious"


def _journal_identity():
    from quantkit.artifact import RunIdentity

    return RunIdentity(model="m", weights={}, recipe="name: x\n", calibration_sha256="0" * 64, device="cpu",
                       dtype="float16")


def test_a_resumed_run_holds_the_lock_and_keeps_it_until_its_commit(tmp_path, monkeypatch):
    """A resumed run takes the work dir's lock, as a fresh one does, so a third run cannot resume the same work dir
    beside it; and a run keeps its lock until its work dir is the output (released before the rename, another run
    could take the work dir in between)."""
    from quantkit.artifact import LOCK, ArtifactError, OutputDir, new_journal
    from quantkit.files import lock_held

    first = OutputDir(tmp_path / "b")
    first.prepare(resume=False, overwrite=False)
    first.save_journal(new_journal(_journal_identity(), threads=1))
    first.release()
    resumed = OutputDir(tmp_path / "b")
    assert resumed.prepare(resume=True, overwrite=False)["layers"] == {}
    assert lock_held(resumed.work / LOCK)
    with pytest.raises(ArtifactError, match="another quantkit run .* is writing"):
        OutputDir(tmp_path / "b").prepare(resume=True, overwrite=False)
    held: list[bool] = []
    rename = Path.rename

    def spy(self, target):
        if self == resumed.work:
            held.append(lock_held(self / LOCK))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", spy)
    resumed.commit()
    assert held == [True] and not (tmp_path / "b" / LOCK).exists() and not resumed.work.exists()


def test_a_check_sweeps_only_the_new_work_dirs_of_dead_runs(tmp_path):
    """A run makes its work dir under a hidden name (`.OUT.partial.new-*`) and locks it before renaming it into
    place; a check deletes such a directory only when a kill left it: over a minute old and unlocked. One just made
    (its run may not have locked it yet) and an old one still locked (its run is live) are kept."""
    from quantkit.artifact import LOCK, OutputDir
    from quantkit.files import take_lock

    fresh, dead, live = (tmp_path / f".b.partial.new-{name}" for name in ("fresh", "dead", "live"))
    for d in (fresh, dead, live):
        d.mkdir()
    fd = take_lock(live / LOCK)
    try:
        old = time.time() - 120
        for d in (dead, live):
            os.utime(d, (old, old))
        OutputDir(tmp_path / "b").check(resume=False, overwrite=False)
        assert fresh.is_dir() and live.is_dir() and not dead.exists()
    finally:
        os.close(fd)


def test_resume_quantizes_again_a_layer_whose_shard_changed(synthetic, calib_txt, tmp_path, caplog):
    """--resume trusts a recorded shard only if its bytes are what the journal hashed: a shard changed in place (a
    bit flipped on disk, at its size) or gone is quantized again, with a warning, and the artifact is bit for bit
    the one an uninterrupted run writes; replaying the damaged shard would build every later layer on it."""
    import logging

    job = _interrupted(synthetic, calib_txt, tmp_path / "b")
    reference = run_quantize(QuantizeJob(**{**job.__dict__, "output": tmp_path / "a"}))
    shard = tmp_path / "b.partial" / "model-00001-of-00004.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        summary = run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))
    assert [r.replayed for r in summary.layers] == [False, False, False]
    assert f"layer 0: its shard {shard} is not what the journal recorded" in caplog.text
    assert artifact_digest(tmp_path / "b") == artifact_digest(reference.output)

    job = _interrupted(synthetic, calib_txt, tmp_path / "c")
    (tmp_path / "c.partial" / "model-00001-of-00004.safetensors").unlink()
    summary = run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))
    assert [r.replayed for r in summary.layers] == [False, False, False]
    assert artifact_digest(tmp_path / "c") == artifact_digest(reference.output)


def test_resume_refuses_other_calibration_text_or_another_model_copy(synthetic, calib_txt, tmp_path):
    """What a resumed run continues must be the same computation: calibration text rewritten in place (the same
    path, so the recipe is the same) is refused by its sha256, and a copy of the model in another directory (same
    file names, sizes and mtimes) by its path; each named in the error."""
    calib = shutil.copy(calib_txt, tmp_path / "calib.txt")
    job = _interrupted(synthetic, Path(calib), tmp_path / "b")
    lines = Path(calib).read_text().splitlines()
    Path(calib).write_text("\n".join(reversed(lines)))
    with pytest.raises(QuantkitError, match="differs from this one: calibration sha256 '[0-9a-f]{64}' vs"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))
    Path(calib).write_text("\n".join(lines))
    copy = shutil.copytree(synthetic, tmp_path / "copy")  # copy2: the same mtimes
    with pytest.raises(QuantkitError, match=f"differs from this one: model '{synthetic.resolve()}' vs '{copy}'"):
        run_quantize(QuantizeJob(**{**job.__dict__, "model": str(copy), "resume": True}))
    run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))  # as it was: resumes


def test_resume_refuses_a_checkpoint_file_of_another_size_with_its_mtime_kept(synthetic, calib_txt, tmp_path):
    """The checkpoint's stamp is each file's size and mtime: a file rewritten and given back its old mtime (a copy
    tool that preserves times, `touch -r`) still differs in size, and a resume refuses it; so for the last of several
    files as for the first."""
    from safetensors.torch import load_file, save_file

    model = shutil.copytree(synthetic, tmp_path / "model")
    job = _interrupted(model, calib_txt, tmp_path / "b")
    shard = sorted(model.glob("*.safetensors"))[-1]
    st = shard.stat()
    save_file(load_file(shard), shard, metadata={"format": "pt", "mended": "yes"})  # same tensors, longer header
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size != st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(QuantkitError, match=f"checkpoint files changed since \\({shard.name}\\)"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))


def test_resume_refuses_a_config_edited_since_the_interruption(synthetic, calib_txt, tmp_path):
    """The checkpoint a resumed run continues is its weights and its config: a config.json mended in place since the
    interruption (here rms_norm_eps and rope_theta, which every block's forward reads) would mix layers quantized on
    activations of the old config with layers of the new one, in an artifact that matches neither config's run. It
    is refused, as changed weights are, and named."""
    model = shutil.copytree(synthetic, tmp_path / "model")
    job = _interrupted(model, calib_txt, tmp_path / "b")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5, "rope_theta": 100.0}, indent=2))
    with pytest.raises(QuantkitError, match=r"differs from this one.*checkpoint files changed since \(config.json\)"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))


def test_a_fisher_cache_missing_a_layer_file_is_computed_again(tmp_path):
    """The cached Fisher files are used only when the cache is complete, its marker and every layer's file: one whose
    layer file is gone (a cleanup, a copy cut short) is computed again and put in place, rather than handed to the
    quantizer as the path of a file that is not there (as it was: the recomputed copy's rename onto the old
    directory failed, and its old complete.json read as another run's complete copy)."""
    from quantkit.fisher import cached_diagonal_fisher
    from quantkit.models.adapters import ROLES
    from quantkit.models.source import open_model

    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=64, intermediate_size=128,
                                                                   num_hidden_layers=2, num_attention_heads=4,
                                                                   num_key_value_heads=2))
    source = open_model(model)
    tokens = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    names = [name for _, name in source.adapter.linear_names(list(ROLES))]
    first = cached_diagonal_fisher(source, tokens, names)
    assert all(p.is_file() for p in first)
    first[1].unlink()
    reports = []
    again = cached_diagonal_fisher(source, tokens, names, lambda phase, done, total: reports.append((phase, done)))
    assert again == first and all(p.is_file() for p in again)
    # each phase reports 0 before its first layer, so that its clock (and ETA) starts with the layer, not after it
    assert reports == [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 0), ("backward", 1),
                       ("backward", 2)]
    hits = []
    assert cached_diagonal_fisher(source, tokens, names, lambda *report: hits.append(report)) == first
    assert hits == [("cached", 1, 1)]


def _cached_fisher(source, tokens, names):
    """fisher.cached_diagonal_fisher, as the pipeline calls it."""
    from quantkit.fisher import cached_diagonal_fisher

    return cached_diagonal_fisher(source, tokens, names)


FISHER_SPEC = SyntheticLlama(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2)


def test_the_fisher_cache_tells_windows_of_the_same_tokens_apart(tmp_path, monkeypatch):
    """The Fisher cache key holds the windows' shape, not only their token bytes: the same 32 tokens as [2, 16] and
    as [4, 8] (what "first" sampling cuts from one stream at two seq_lens) are other sequences, with other losses
    and attention contexts, so the second gets its own Fisher, equal to a direct computation (it was handed the
    [2, 16] one: the key hashed the raw bytes alone, where calib.token_sha256 also hashes the shape)."""
    from safetensors.torch import load_file

    from quantkit.fisher import diagonal_fisher
    from quantkit.models.adapters import ROLES
    from quantkit.models.source import open_model

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    source = open_model(write_synthetic_llama(tmp_path / "m", FISHER_SPEC))
    tokens = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    names = [name for _, name in source.adapter.linear_names(list(ROLES))]
    first = _cached_fisher(source, tokens, names)
    recut = _cached_fisher(source, tokens.reshape(4, 8), names)
    direct = diagonal_fisher(source, tokens.reshape(4, 8), names, tmp_path / "direct")
    got, want = load_file(str(recut[0])), load_file(str(direct[0]))
    assert not torch.equal(want[names[0]], load_file(str(first[0]))[names[0]])
    assert all(torch.equal(got[n], want[n]) for n in names)
    assert recut[0].parent != first[0].parent


def test_the_fisher_cache_tells_linears_and_dtypes_apart(tmp_path, monkeypatch):
    """Other tokens are another computation; a run for more linears than a cached one gets files holding all of
    them; a bfloat16 checkpoint read as float16 (QServe's --dtype auto) is another computation than the checkpoint
    read as it is."""
    from safetensors.torch import load_file

    from quantkit.models.adapters import ROLES
    from quantkit.models.source import open_model

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    source = open_model(write_synthetic_llama(tmp_path / "m", FISHER_SPEC))
    tokens = torch.randint(0, source.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    names = [name for _, name in source.adapter.linear_names(list(ROLES))]
    fewer, more = _cached_fisher(source, tokens, names[:1]), _cached_fisher(source, tokens, names)
    assert sorted(load_file(str(fewer[0]))) == names[:1] and sorted(load_file(str(more[0]))) == sorted(names)
    assert _cached_fisher(source, (tokens + 1) % source.config.vocab_size, names)[0].parent != more[0].parent
    bf16 = write_synthetic_llama(tmp_path / "bf16", SyntheticLlama(**{**FISHER_SPEC.__dict__, "dtype": "bfloat16"}))
    as_stored, as_fp16 = open_model(bf16), open_model(bf16)
    as_fp16.convert_to(torch.float16)
    assert _cached_fisher(as_stored, tokens, names)[0].parent != _cached_fisher(as_fp16, tokens, names)[0].parent


def test_the_scan_stops_the_run_between_layers_with_the_finished_ones_kept(synthetic, calib_txt, tmp_path,
                                                                          monkeypatch):
    """The checkpoint scan (a NaN found ahead of the run) is consulted before every layer, not only at the end: a
    scan that reports its find once layer 0 is done stops the run before layer 1, with layer 0 recorded for
    --resume. Deterministic where the scan thread's timing is not: the find is reported at a chosen moment."""
    from quantkit.models.source import FiniteScan

    found: list[bool] = []

    class FindAfterFirst(Reporter):
        def layer_done(self, report) -> None:
            found.append(True)

    def raise_if_bad(self) -> None:
        if found:
            raise QuantkitError("'model.layers.2.mlp.down_proj.weight' has a NaN/Inf value")

    monkeypatch.setattr(FiniteScan, "raise_if_bad", raise_if_bad)
    recipe = load_recipe("rtn-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64"])
    job = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "b", calib=str(calib_txt))
    with pytest.raises(QuantkitError, match="has a NaN/Inf value"):
        run_quantize(job, FindAfterFirst())
    assert len(found) == 1
    assert sorted(json.loads((tmp_path / "b.partial" / "quantkit_journal.json").read_text())["layers"]) == ["0"]


def test_a_run_stopped_by_an_error_says_what_it_keeps(synthetic, calib_txt, tmp_path, monkeypatch):
    """An input error found after layer 0 (here the scan's NaN) ends with where the finished layer is kept and what
    --resume and --overwrite would do, and the next run calls the work dir unfinished, not interrupted (it had said
    "holds an interrupted run" of a run that refused a NaN). One found before any layer leaves no work dir, as an
    error found before the run does."""
    import dataclasses

    from quantkit.models.source import FiniteScan

    finished: list[int] = []

    class Count(Reporter):
        def layer_done(self, report) -> None:
            finished.append(report.index)

    def after(layers: int):
        def raise_if_bad(self) -> None:
            if len(finished) >= layers:
                raise QuantkitError("'model.layers.1.mlp.down_proj.weight' has a NaN/Inf value")
        return raise_if_bad

    recipe = load_recipe("rtn-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64"])
    job = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "b", calib=str(calib_txt))
    monkeypatch.setattr(FiniteScan, "raise_if_bad", after(1))
    with pytest.raises(QuantkitError, match=r"has a NaN/Inf value; .*b.partial keeps the 1 layer\(s\) finished before "
                                            r"it: --resume continues from them where the model and recipe are "
                                            r"unchanged, --overwrite starts afresh"):
        run_quantize(job, Count())
    with pytest.raises(QuantkitError, match=r"b.partial holds an unfinished run \(interrupted, or stopped by an "
                                            r"error\); pass --resume to continue it or --overwrite to restart"):
        run_quantize(job, Count())
    finished.clear()
    monkeypatch.setattr(FiniteScan, "raise_if_bad", after(0))
    job = dataclasses.replace(job, overwrite=True)
    with pytest.raises(QuantkitError, match=r"has a NaN/Inf value$"):
        run_quantize(job, Count())
    assert not (tmp_path / "b.partial").exists() and not (tmp_path / "b").exists()


def test_a_full_disk_is_a_message_and_keeps_the_finished_layers(synthetic, calib_txt, tmp_path, monkeypatch):
    """The disk filling up while the journal of layer 1 is written: one line (exit 2 through the CLI) naming the
    error and the file, not a traceback, and layer 0 kept for --resume, which finishes the artifact."""
    import errno

    from quantkit.artifact import OutputDir

    save, calls = OutputDir.save_journal, []

    def full_disk(self, journal) -> None:
        calls.append(len(journal["layers"]))
        if len(journal["layers"]) == 2 and len(calls) < 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.work / "quantkit_journal.json"))
        save(self, journal)

    monkeypatch.setattr(OutputDir, "save_journal", full_disk)
    out = tmp_path / "d"
    result = cli("quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", calib_txt, *FAST)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "error: No space left on device (" in text and "d.partial keeps the 1 layer(s) finished before it" in text
    cli_ok("quantize", synthetic, "--recipe", "rtn-w4a16-g128", "-o", out, "--calib", calib_txt, *FAST, "--resume")
    assert (out / "quantkit_manifest.json").is_file() and not (tmp_path / "d.partial").exists()


def test_kept_tensors_are_written_in_the_artifacts_dtype(rtn_artifact: Path) -> None:
    """Norms, biases and edges are written in the dtype config.json names (here float16), as the checkpoint held
    them: a shard that kept a block's float32 copies would double their size and contradict its own config."""
    config = json.loads((rtn_artifact / "config.json").read_text())
    assert config["torch_dtype"] == "float16"
    for shard in sorted(rtn_artifact.glob("model-*.safetensors")):
        wrong = {k: t.dtype for k, t in read_safetensors(shard).items()
                 if t.is_floating_point() and t.dtype != torch.float16}
        assert wrong == {}, shard.name


def test_resume_of_a_bfloat16_run_with_folded_norms_is_bit_identical(
    synthetic: Path, calib_txt: Path, tmp_path: Path,
) -> None:
    """With --dtype bfloat16, the norms qqq's smoothing rewrites are rounded to bfloat16 (the artifact's dtype, not
    float16) before the next block's inputs are computed, so a resumed run, which replays the shards, continues with
    the very inputs the uninterrupted run had and writes the same bytes."""
    recipe = load_recipe("qqq", ["calibration.num_samples=4", "calibration.seq_len=64", "export.format=quantkit"])
    job = QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / "a", calib=str(calib_txt),
                      dtype="bfloat16")
    run_quantize(job)
    interrupted = QuantizeJob(**{**job.__dict__, "output": tmp_path / "b"})
    with pytest.raises(KeyboardInterrupt):
        run_quantize(interrupted, _InterruptAfter(1))
    summary = run_quantize(QuantizeJob(**{**interrupted.__dict__, "resume": True}))
    assert [r.replayed for r in summary.layers] == [True, False, False]
    assert json.loads((tmp_path / "b" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert artifact_digest(tmp_path / "a") == artifact_digest(tmp_path / "b")


def test_resume_refuses_tokenizer_files_touched_since_the_interruption(
    stories260k: Path, tinystories_txt: Path, tmp_path: Path,
) -> None:
    """The checkpoint stamp a resume compares covers the tokenizer files as the README says (tokenizer.json, its
    config, a SentencePiece tokenizer.model), not only config.json and the weights: each one touched since the
    interruption is refused and named; with every file as it was, the run resumes."""
    model = shutil.copytree(stories260k, tmp_path / "model")
    job = _interrupted(model, tinystories_txt, tmp_path / "b", "gptq-w4a16")
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        st = (model / name).stat()
        os.utime(model / name, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with pytest.raises(QuantkitError, match=rf"checkpoint files changed since \({name}\)"):
            run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))
        os.utime(model / name, ns=(st.st_atime_ns, st.st_mtime_ns))
    summary = run_quantize(QuantizeJob(**{**job.__dict__, "resume": True}))
    assert [r.replayed for r in summary.layers] == [True, False, False, False, False]


def test_error_samples_sets_what_the_layer_error_is_measured_on(
    synthetic: Path, calib_txt: Path, tmp_path: Path,
) -> None:
    """engine.error_samples only chooses the sequences the per-layer error is measured on: GPTQ (which reads every
    window) writes the same shards whatever it is, the errors over the first 2 of 4 windows are not those over all
    4, and error_samples equal to num_samples measures what null (all of them) does."""
    runs = {}
    for n in ("2", "4", "null"):
        recipe = load_recipe("gptq-w4a16-g128", ["calibration.num_samples=4", "calibration.seq_len=64",
                                                 f"engine.error_samples={n}"])
        summary = run_quantize(QuantizeJob(model=str(synthetic), recipe=recipe, output=tmp_path / n,
                                           calib=str(calib_txt)))
        shards = {k: v for k, v in artifact_digest(tmp_path / n).items() if k.endswith(".safetensors")}
        runs[n] = ([r.rel_error for r in summary.layers], shards)
    assert runs["2"][1] == runs["4"][1] == runs["null"][1]
    assert runs["4"][0] == runs["null"][0]
    assert all(a != b for a, b in zip(runs["2"][0], runs["null"][0], strict=True))


def test_windows_of_the_full_context_and_the_generation_config_pass_through(
    stories260k: Path, tinystories_txt: Path, tmp_path: Path,
) -> None:
    """A --seq-len equal to the model's context (stories260K: 512) is used as it is, with no warning that it exceeds
    it, and the artifact carries the checkpoint's generation_config.json unchanged (engines read its sampling
    defaults and token ids from there); one past the context is capped to it, saying so."""
    out = tmp_path / "out"
    result = cli_ok("quantize", stories260k, "--recipe", "gptq-w4a16", "-o", out, "--calib", tinystories_txt,
                    "--num-samples", "2", "--seq-len", "512")
    assert "exceeds the model's context" not in result.output
    assert yaml.safe_load((out / "quantkit_recipe.yaml").read_text())["calibration"]["seq_len"] == 512
    assert (out / "generation_config.json").read_bytes() == (stories260k / "generation_config.json").read_bytes()
    result = cli_ok("quantize", stories260k, "--recipe", "gptq-w4a16", "-o", tmp_path / "capped", "--calib",
                    tinystories_txt, "--num-samples", "2", "--seq-len", "513")
    assert "calibration.seq_len 513 exceeds the model's context (max_position_embeddings 512); using windows of " \
           "512 tokens" in " ".join(result.output.split())
    assert yaml.safe_load((tmp_path / "capped" / "quantkit_recipe.yaml").read_text())["calibration"]["seq_len"] == 512


@pytest.mark.parametrize("given", ["--calib", "--set", "recipe"])
def test_a_relative_calib_path_is_saved_absolute(
    synthetic: Path, calib_txt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str,
) -> None:
    """A calibration file given relative to the working directory (by --calib, by --set calibration.dataset, or in a
    recipe file) is recorded absolute, in the saved recipe and as the manifest's calibration source, so that
    quantizing again from the saved recipe elsewhere reads the same file and calibrates on the same tokens, where
    the relative name would not be found."""
    monkeypatch.chdir(Path(calib_txt).parent)
    name = Path(calib_txt).name
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "mine", "weights": {"bits": 4, "group_size": 128},
                                      "calibration": {"dataset": name}, "passes": [{"name": "rtn"}],
                                      "export": {"format": "compressed-tensors"}}))
    how = {"--calib": ["--recipe", "rtn-w4a16-g128", "--calib", name],
           "--set": ["--recipe", "rtn-w4a16-g128", "--set", f"calibration.dataset={name}"],
           "recipe": ["--recipe", recipe]}[given]
    out = tmp_path / "out"
    cli_ok("quantize", synthetic, *how, "-o", out, *FAST)
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    assert manifest["calibration"]["source"] == str(Path(calib_txt).resolve())
    assert yaml.safe_load((out / "quantkit_recipe.yaml").read_text())["calibration"]["dataset"] == \
        str(Path(calib_txt).resolve())
    monkeypatch.chdir(tmp_path)
    cli_ok("quantize", synthetic, "--recipe", out / "quantkit_recipe.yaml", "-o", tmp_path / "again")
    again = json.loads((tmp_path / "again" / "quantkit_manifest.json").read_text())
    assert again["calibration"]["sha256"] == manifest["calibration"]["sha256"]


def test_a_checkpoint_whose_config_says_quantized_is_refused(synthetic: Path, calib_txt: Path, tmp_path: Path) -> None:
    """A checkpoint another tool quantized (config.json holds a quantization_config, no quantkit manifest) is
    refused as already quantized, before any work, rather than read as a floating-point model."""
    model = shutil.copytree(synthetic, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(config))
    _fails(tmp_path, "quantize", model, "--recipe", "rtn-w4a16-g128", "--calib", calib_txt, *FAST, "-o",
           tmp_path / "out", match="is already quantized (its config.json has a quantization_config); quantize the "
           "original floating-point checkpoint")


def test_resume_on_a_device_other_than_the_interrupted_runs_is_refused(
    synthetic: Path, calib_txt: Path, tmp_path: Path,
) -> None:
    """The identity a resume compares holds the device this run asks for: a CPU run resumed with device cuda is
    refused before any layer runs (on a machine without a GPU too), naming both devices."""
    job = _interrupted(synthetic, calib_txt, tmp_path / "b")
    with pytest.raises(QuantkitError, match="differs from this one: device 'cpu' vs 'cuda'"):
        run_quantize(QuantizeJob(**{**job.__dict__, "resume": True, "device": "cuda"}))


def test_step_totals_sum_each_step_over_layers_largest_first() -> None:
    """The summary's "time by step" row sums each step over the layers and lists the largest first, so the pass to
    tune comes first."""
    from quantkit.pipeline import LayerReport, step_totals

    layers = [LayerReport(0, 0.1, 3.0, step_seconds={"load": 1.0, "gptq": 2.0}),
              LayerReport(1, 0.1, 4.0, step_seconds={"load": 0.5, "gptq": 3.0, "hessians": 4.0})]
    assert list(step_totals(layers).items()) == [("gptq", 5.0), ("hessians", 4.0), ("load", 1.5)]


def test_the_memory_check_counts_only_the_cached_error_windows_of_a_data_free_recipe(
    synthetic: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RTN reads no activations, so only engine.error_samples windows are embedded and cached: its memory check
    counts those, and passes where GPTQ, caching every window, is refused with the sizes."""
    from quantkit.models.source import open_model
    from quantkit.pipeline import _check_cache_fits

    source = open_model(synthetic)
    monkeypatch.setattr("quantkit.memory.available_bytes", lambda: 32 << 20)
    overrides = ["calibration.num_samples=1000", "calibration.seq_len=64", "engine.error_samples=4"]
    _check_cache_fits(load_recipe("rtn-w4a16-g128", overrides), source)
    with pytest.raises(QuantkitError, match="calibration on 1000 windows of 64 tokens keeps 0.1 GiB of activations"):
        _check_cache_fits(load_recipe("gptq-w4a16-g128", overrides), source)


def test_the_summary_names_the_layer_of_the_largest_error(synthetic: Path, calib_txt: Path, tmp_path: Path) -> None:
    """The summary table's error rows give the mean and the maximum of the manifest's layer errors and name the
    layer of each maximum, the attention sink's apart."""
    import re

    out = tmp_path / "out"
    said = " ".join(cli_ok("quantize", synthetic, "--recipe", "gptq-w4a16-g128", "-o", out, "--calib", calib_txt,
                           *FAST).output.replace("│", " ").split())  # the table's rows, unwrapped
    layers = json.loads((out / "quantkit_manifest.json").read_text())["layers"]
    errors = [r["rel_error"] for r in layers]
    sinks = [r["metrics"]["sink_rel_error"] for r in layers]
    assert errors.index(max(errors)) != errors.index(min(errors)) and sinks.index(max(sinks)) != sinks.index(min(sinks))
    row = re.search(r"mean (\S+), max (\S+) \(layer (\d+); block outputs on the first 4 window\(s\), the attention "
                    r"sink apart\)", said)
    assert row and [float(row[1]), float(row[2]), int(row[3])] == [
        round(sum(errors) / len(errors), 4), round(max(errors), 4), errors.index(max(errors))], said
    sink = re.search(r"rel\. error max (\S+) \(layer (\d+)\)", said)
    assert sink and [float(sink[1]), int(sink[2])] == [round(max(sinks), 4), sinks.index(max(sinks))], said


def test_a_shard_write_cut_short_leaves_the_old_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard whose writer fails half-way (a full disk, a kill) leaves the shard that was there, readable and
    unchanged, and no temp file beside it: shards go through a temp file and a rename, as the journal does."""
    from quantkit.artifact import atomic_save_safetensors

    path = tmp_path / "model-00001-of-00004.safetensors"
    atomic_save_safetensors({"w": torch.arange(4, dtype=torch.float16)}, path)

    def half(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        Path(filename).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
        raise OSError("disk full")

    monkeypatch.setattr("quantkit.artifact.save_file", half)
    with pytest.raises(OSError, match="disk full"):
        atomic_save_safetensors({"w": torch.zeros(4, dtype=torch.float16)}, path)
    assert torch.equal(read_safetensors(path)["w"], torch.arange(4, dtype=torch.float16))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_shard_is_on_disk_before_its_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard's bytes are fsynced before the rename puts it in place, as the journal's are: the journal records a
    shard (and the manifest lists it) only once it is written, and a crash of the machine must not leave that name
    pointing at bytes the page cache had not yet written."""
    from quantkit.artifact import atomic_save_safetensors

    path = tmp_path / "model-00001-of-00004.safetensors"
    events: list[tuple] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        events.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def spy_replace(src: str, dst: str | Path) -> None:
        events.append(("replace", Path(dst).name))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    atomic_save_safetensors({"w": torch.arange(4, dtype=torch.float16)}, path)
    monkeypatch.undo()
    assert events == [("fsync", path.stat().st_ino), ("replace", path.name)]
