"""Bit-exact CPU emulation of the W4A8 kernels and `quantkit validate`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import cli, cli_ok, record_rewritten_file, rewrite_tensor, wikitext_rows
from safetensors.torch import load_file

from quantkit.emulate import INT32, check_against_reference, emulate, int8_gemm, quantize_tokens
from quantkit.kernels import compiler_available
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama


def test_quantize_tokens_is_per_token_symmetric_int8():
    x = np.array([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [254.0, 1.0, -127.0]], dtype=np.float32)
    q, s = quantize_tokens(x)
    assert s.tolist() == pytest.approx([2 / 127, 1.0, 2.0])
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 0, -64]]  # 63.5 and -63.5 round half to even


def test_int8_gemm_reports_int32_overflow():
    big = np.full((1, 140000), 127, dtype=np.int64)
    with pytest.raises(OverflowError):
        int8_gemm(big, big)
    assert int8_gemm(big[:, :1000], big[:, :1000])[0, 0] == 127 * 127 * 1000 < INT32[1]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, calib_txt):
    tmp = tmp_path_factory.mktemp("emu")
    model = write_synthetic_llama(tmp / "m", SyntheticLlama(hidden_size=256, intermediate_size=512,
                                                             num_hidden_layers=2))
    out = {}
    for recipe in ("qqq", "qqq-g128", "lqq-g64", "qoq", "qoq-g128"):
        out[recipe] = tmp / recipe
        fast = [] if recipe.startswith("qoq") else ["--set", "passes.smooth.enabled=false"]
        cli_ok("quantize", model, "--recipe", recipe, "-o", out[recipe], "--calib", calib_txt, "--num-samples", "4",
               "--seq-len", "64", *fast)
    return out


@pytest.mark.parametrize("recipe", ["qqq", "qqq-g128", "lqq-g64", "qoq", "qoq-g128"])
def test_emulation_matches_the_reference_dequant(artifacts, recipe):
    from quantkit.formats import get_packer
    from quantkit.recipe import load_recipe

    shard = load_file(str(sorted(artifacts[recipe].glob("model-*.safetensors"))[0]))
    fmt = {"lqq-g64": "liquidquant", "qoq": "qserve", "qoq-g128": "qserve"}.get(recipe, "qqq")
    packer = get_packer(fmt)(load_recipe(recipe), torch.float16)
    prefix = "model.layers.0.mlp.down_proj."
    parts = {k[len(prefix):]: v for k, v in shard.items() if k.startswith(prefix) and packer.owns(k[len(prefix):])}
    spec = load_recipe(recipe).weights.spec()
    weight = packer.unpack(dict(parts), spec).dequantize()
    x = np.random.default_rng(0).standard_normal((8, weight.shape[1])).astype(np.float32)
    emulation = emulate(fmt, parts, x)
    check = check_against_reference(emulation, weight, x)
    assert check.exact and check.rel_error < 2e-3
    assert emulation.out.dtype == np.float16 and emulation.out.shape == (8, weight.shape[0])


@pytest.mark.parametrize("recipe", ["qqq-g128", "lqq-g64", "qoq", "qoq-g128"])
def test_validate_passes(artifacts, recipe):
    """Every packed linear of each recipe's artifact matches its reference, with progress and whole linear names."""
    result = cli_ok("validate", artifacts[recipe], "--kernel", "sim" if compiler_available() else "none")
    assert "every packed linear matches" in result.output and "yes" in result.output
    assert "validating layers: 2/2" in result.output  # progress, in a log one line each tenth
    # whole linear names in an 80-column log (no "self_attn.…"), the kernel's column included
    assert all(f" {name} " in result.output for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"))
    assert "…" not in result.output
    if compiler_available():
        text = " ".join(result.output.split())
        assert "kernel (warp simulator) against the emulation" in text
        assert "kernels run against the emulation: small-M on" in text  # and the large-M ones where shapes fit


def test_validate_catches_a_lane_overflow(artifacts, tmp_path):
    """LiquidQuant group parameters that make a step's u * s + a leave its byte: the IMAD lanes wrap, the reference
    does not, and validate names the linear and why. eval, which would read the reference's weights where the
    kernel computes others, refuses the artifact, naming the values the packer would not have written."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(artifacts["lqq-g64"], broken)

    def wrapping(s2a: torch.Tensor) -> torch.Tensor:
        s2a[..., 0] = 16
        s2a[..., 1] = 250
        return s2a

    # a well-formed artifact with these parameters, not a damaged one
    rewrite_tensor(broken, "model.layers.0.mlp.down_proj.s2a", wrapping)
    result = cli("validate", broken)
    assert result.exit_code == 1 and "NO" in result.output
    # the verdict names the failing linear and why, in words a log without colours keeps
    assert "layer 0 mlp.down_proj (int32" in " ".join(result.output.split())
    result = cli("eval", broken, "--data-dir", wikitext_rows(tmp_path / "data"), "--limit", "1", "--seq-len", "64")
    assert result.exit_code == 2 and "layer 0 mlp.down_proj: it holds values that the liquidquant packer does not " \
        "write (liquidquant: a code would overflow the kernel's byte lane" in " ".join(result.output.split())


def test_validate_refuses_bad_options_and_damaged_linears(artifacts, tmp_path):
    """Options that would make the verdict meaningless are refused (exit 2, not the mismatch's 1), and so is an
    artifact whose shards lack a linear's tensor or whose config names more layers than were written; with no
    kernel run the verdict says so."""
    import shutil

    for option in (["--seed", "-1"], ["--tolerance", "-1"], ["--tolerance", "nan"], ["--tolerance", "inf"]):
        result = cli("validate", artifacts["qqq"], "--kernel", "none", *option)
        assert result.exit_code == 2 and option[0] in result.output, (option, result.output)
    result = cli_ok("validate", artifacts["qqq"], "--kernel", "none")
    assert "note: no kernel ran (--kernel none)" in result.output
    assert f"error: {tmp_path / 'nowhere'} does not exist" in cli("validate", tmp_path / "nowhere").output

    lacking = tmp_path / "lacking"
    shutil.copytree(artifacts["qqq"], lacking)
    weight_map = json.loads((lacking / "model.safetensors.index.json").read_text())["weight_map"]
    key = next(k for k in weight_map if k.startswith("model.layers.1.mlp.down_proj."))
    rewrite_tensor(lacking, key, lambda tensor: None)
    result = cli("validate", lacking, "--kernel", "none")
    assert result.exit_code == 2 and f"layer 1 mlp.down_proj lacks its {key.rsplit('.', 1)[1]} tensor" in result.output

    more = tmp_path / "more"
    shutil.copytree(artifacts["qqq"], more)
    config = json.loads((more / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (more / "config.json").write_text(json.dumps(config))
    record_rewritten_file(more, more / "config.json")
    result = cli("validate", more, "--kernel", "none")
    assert result.exit_code == 2 and "config.json says 3 layers where the manifest wrote 2" in result.output


def test_bench_refuses_what_it_cannot_time_before_asking_for_a_gpu(artifacts, tmp_path):
    """quantkit bench checks its options and OUTPUT (an artifact of a layout with kernels) before it looks for a
    GPU, so that a CPU machine names the mistake, not the missing device: a --layer past the artifact's, and a
    --json that would overwrite one of the artifact's files (it had replaced the manifest with the rows), another
    tool's file, or lies under a file (a traceback after the whole run) too."""
    (tmp_path / "notes.txt").write_text("mine")
    manifest = (artifacts["qqq"] / "quantkit_manifest.json").read_bytes()
    for args, says in [(["--m", "abc"], "--m"), (["--m", "0,4"], "--m"), (["--iters", "0"], "--iters"),
                       ([artifacts["qqq"], "--layer", "5"], "--layer 5: "),
                       ([artifacts["qqq"], "--json", artifacts["qqq"] / "quantkit_manifest.json"],
                        "whose files it would overwrite"),
                       (["--json", tmp_path / "notes.txt"], "exists and is not a results file of quantkit bench"),
                       (["--json", tmp_path / "notes.txt" / "r.json"], "--json: "),
                       (["--warmup", "-1"], "--warmup"), (["--formats", "qqq,nope"], "nope: not a layout"),
                       (["--layer", "1"], "--layer picks a layer of OUTPUT"), (["--shapes", "\u00b2x128"], "--shapes"),
                       ([artifacts["qqq"], "--formats", "qqq"], "--formats: with OUTPUT"),
                       ([artifacts["qqq"], "--shapes", "128x128"], "--shapes: with OUTPUT"),
                       ([artifacts["qqq"], "--layer", "-1"], "--layer"),
                       ([tmp_path / "nowhere"], "does not exist")]:
        result = cli("bench", *args)
        assert result.exit_code == 2 and says in " ".join(result.output.split()), (args, result.output)
        assert "needs a CUDA device" not in result.output
    assert (artifacts["qqq"] / "quantkit_manifest.json").read_bytes() == manifest


def test_packed_linears_refuse_layers_past_the_artifact(artifacts):
    from quantkit.errors import QuantkitError
    from quantkit.eval.loading import packed_linears

    with pytest.raises(QuantkitError, match=r"has layers 0\.\.1, not 2"):
        next(packed_linears(artifacts["qqq"], [2]))


@pytest.mark.parametrize("edit,match", [
    (("B", lambda t: t.view(torch.float32)),
     "layer 0 mlp.down_proj: its B is float32 [32, 512] where the layout has int32 [32, 512]"),
    (("s_channel", lambda t: t[:, :-1].clone()), "its tensors do not fit the manifest's 4-bit spec"),
    (("config.json", "torch_dtype", "int8"), "torch_dtype is 'int8', not one of float16, bfloat16, float32"),
    (("config.json", "num_hidden_layers", 2.0), "num_hidden_layers is 2.0, not an integer"),
    (("quantkit_manifest.json", "weights", {}), "the manifest quantizes roles none where its recipe targets"),
])
def test_validate_refuses_an_edited_artifact_naming_what_disagrees(artifacts, tmp_path, edit, match):
    """validate reads a packed linear as eval does: tensors stored in another dtype than the layout's (QQQ's B as
    float32, the same bytes), a scale cut short, or a config.json or manifest edited to what the artifact is not,
    are refused as damage (exit 2) naming it, where they had run the kernels on a misread weight or failed later."""
    import shutil

    edited = shutil.copytree(artifacts["qqq"], tmp_path / "edited")
    if edit[0].endswith(".json"):
        file = edited / edit[0]
        content = json.loads(file.read_text())
        content[edit[1]] = edit[2]
        file.write_text(json.dumps(content))
        record_rewritten_file(edited, file)
    else:
        rewrite_tensor(edited, "model.layers.0.mlp.down_proj." + edit[0], edit[1])
    result = cli("validate", edited)
    assert result.exit_code == 2 and match in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_validate_fails_when_the_kernel_differs_from_the_emulation(artifacts, monkeypatch):
    from quantkit import kernels

    monkeypatch.setattr(kernels, "resolve_device", lambda kernel: "cpu")
    monkeypatch.setattr(kernels, "matches_emulation", lambda *args, **kwargs: False)
    result = cli("validate", artifacts["qoq"])
    assert result.exit_code == 1 and "NO" in result.output and "do not match" in result.output


def test_validate_names_a_kernel_the_simulator_stopped_and_checks_the_rest(artifacts, monkeypatch):
    """A kernel the warp simulator stops (kernels.SimulatorFailure: a load past an array, a workspace left dirty)
    fails its linear, with the simulator's reason in the verdict, and validate goes on to the others: it had ended
    the run with the error alone, the table of what had passed lost."""
    from quantkit import kernels

    def stopped_once(*args, **kwargs):
        stopped_once.calls += 1
        if stopped_once.calls == 3:
            raise kernels.SimulatorFailure("warp simulator, qserve_w4a8_gemm_pc: split-K across blocks: the "
                                           "workspace is not left zero for the next launch")
        return True

    stopped_once.calls = 0
    monkeypatch.setattr(kernels, "resolve_device", lambda kernel: "cpu")
    monkeypatch.setattr(kernels, "matches_emulation", stopped_once)
    result = cli("validate", artifacts["qoq"])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "1 linear(s) do not match" in text
    assert "(kernel: warp simulator, qserve_w4a8_gemm_pc: split-K across blocks" in text
    assert "validating layers: 2/2" in result.output  # every layer checked


def test_validate_names_formats_without_emulation(tmp_path, calib_txt):
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=128, intermediate_size=256,
                                                                  num_hidden_layers=1))
    cli_ok("quantize", model, "--recipe", "rtn-w4a16-g128", "-o", tmp_path / "ct", "--calib", calib_txt,
           "--num-samples", "2", "--seq-len", "32")
    result = cli("validate", tmp_path / "ct")
    assert result.exit_code != 0 and "no kernel emulation for format 'compressed-tensors'" in result.output


@pytest.mark.parametrize(("recipe", "fmt"), [("qoq", "qserve"), ("qqq-g128", "qqq"), ("lqq-g64", "liquidquant")])
def test_eval_simulation_computes_what_the_kernel_computes(artifacts, recipe, fmt):
    """A linear of the loaded artifact, with its activation simulation (and, for QServe per channel, the epilogue
    zero point on the unquantized sum), gives the emulated kernel's output up to the fp16 rounding."""
    from quantkit.eval.loading import load_for_eval
    from quantkit.formats import get_packer
    from quantkit.recipe import load_recipe

    model = load_for_eval(artifacts[recipe]).model
    module = model.model.layers[0].mlp.down_proj
    shard = load_file(str(sorted(artifacts[recipe].glob("model-*.safetensors"))[0]))
    packer = get_packer(fmt)(load_recipe(recipe), torch.float16)
    prefix = "model.layers.0.mlp.down_proj."
    parts = {k[len(prefix):]: v for k, v in shard.items() if k.startswith(prefix) and packer.owns(k[len(prefix):])}
    x = np.random.default_rng(1).standard_normal((8, module.in_features)).astype(np.float32)
    with torch.no_grad():
        simulated = module(torch.from_numpy(x)).numpy()
    kernel = emulate(fmt, parts, x).out.astype(np.float32)
    assert np.abs(simulated - kernel).max() <= 2e-3 * np.abs(kernel).max()


def test_atom_emulation_and_validate(tmp_path, calib_txt, monkeypatch):
    """Atom's W4A4 GEMM from the LinearInt4 bytes: every group's int32 partial sums equal the reference codes'
    product, the output matches quantkit's grouped activation simulation, and validate passes, quantizing the
    activations as eval simulates them: the recipe's INT4 at clip 0.9, not the unclipped default."""
    from quantkit.emulate import check_atom, emulate_atom
    from quantkit.formats.atom import AtomPacker
    from quantkit.recipe import load_recipe

    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=256, intermediate_size=512,
                                                                  num_hidden_layers=1))
    out = tmp_path / "atom"
    cli_ok("quantize", model, "--recipe", "atom-w4a4", "-o", out, "--calib", calib_txt, "--num-samples", "4",
           "--seq-len", "64")
    shard = load_file(str(sorted(out.glob("model-*.safetensors"))[0]))
    prefix = "model.layers.0.mlp.down_proj."
    packer = AtomPacker(load_recipe("atom-w4a4"), torch.float16)
    parts = {k[len(prefix):]: v for k, v in shard.items() if k.startswith(prefix) and packer.owns(k[len(prefix):])}
    q = packer.unpack(dict(parts), load_recipe("atom-w4a4").weights.spec())
    x = np.random.default_rng(2).standard_normal((6, 512)).astype(np.float32)
    emulation = emulate_atom(parts, x, 4, 0.9)
    assert emulation.partials.shape == (4, 6, 256)
    check = check_atom(emulation, q, x, 4, 0.9)
    assert check.exact and check.rel_error < 2e-3
    import quantkit.emulate
    import quantkit.validation

    real, used = quantkit.emulate.emulate_atom, set()

    def spy(tensors, x, bits=4, clip_ratio=1.0):
        used.add((bits, clip_ratio))
        return real(tensors, x, bits, clip_ratio)

    monkeypatch.setattr(quantkit.validation, "emulate_atom", spy)  # where validate calls it
    assert "every packed linear matches" in cli_ok("validate", out).output
    assert used == {(4, 0.9)}


@pytest.mark.parametrize("k", [96, 1024, 1056, 2080])
def test_anyprec_gemv_decodes_every_width_like_the_reference(k):
    """The kernel's bit transpose of the first b planes gives exactly the b-bit codes (four 4-bit lanes up to 4
    bits, eight 8-bit lanes above), at every width, including a tail chunk; the LUT GEMV then matches x W_b^T."""
    from quantkit.emulate import emulate_anyprec
    from quantkit.formats.anyprec_layout import lut_dequantize, pack_planes, unpack_planes

    rng = np.random.default_rng(k)
    n = 8
    codes = rng.integers(0, 256, (n, k))
    tensors = {"qweight": torch.from_numpy(pack_planes(codes, 8))}
    x = rng.standard_normal((3, k)).astype(np.float32)
    for bits in range(3, 9):
        lut = np.sort(rng.standard_normal((n, 1 << bits)), axis=1).astype(np.float16)
        tensors[f"lut{bits}"] = torch.from_numpy(lut)
        decoded, y = emulate_anyprec(tensors, x, bits)
        assert np.array_equal(decoded, unpack_planes(pack_planes(codes, 8), bits))
        y_ref = x @ lut_dequantize(decoded, lut.astype(np.float32)).T
        assert np.abs(y.astype(np.float32) - y_ref).max() <= 2e-3 * np.abs(y_ref).max()


@pytest.mark.parametrize("recipe", ["qoq-g128", "lqq-g64", "qqq"])
def test_bench_cases_of_an_artifact_run_its_own_tensors(artifacts, recipe):
    """`quantkit bench OUT` times the artifact's own linears: one case per linear of the layer, with its shape, and
    each case's launch runs (here in the warp simulator) to the emulation's output."""
    from quantkit import kernels
    from quantkit.emulate import emulate_quantized
    from quantkit.kernel_bench import artifact_cases, variant_launch

    cases = artifact_cases(artifacts[recipe], layer=1)
    assert len(cases) == 7 and {c.label.split(" (")[0].rsplit(".", 1)[-1] for c in cases} >= {"q_proj", "down_proj"}
    down = next(c for c in cases if "down_proj" in c.label)
    assert (down.n, down.k) == (256, 512)
    if not kernels.compiler_available():
        pytest.skip("the cases' launches run in the warp simulator, which needs a host C++ compiler (g++ or c++)")
    for case in cases[:2]:
        launch = variant_launch(case.variant, case.tensors(), 3, case.k, seed=1)
        out = kernels.run(launch, "cpu").view(np.float16)
        t_x = launch.args[2] if case.variant.fmt == "qserve" else None
        reference = emulate_quantized(case.variant.fmt, case.tensors(), launch.args[0], launch.args[1], t_x)
        np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


def _edge_tensors(fmt: str, group: int | None) -> dict[str, torch.Tensor]:
    """Stored tensors at their extremes: all-equal groups, the largest scales, zero points at the end of their
    range (QServe -z*s2 = -128, LiquidQuant min -128 with step 16, QQQ ratios of 127/8)."""
    from quantkit.formats import liquidquant, qqq, qserve_layout
    from quantkit.kernel_bench import synthetic

    tensors = synthetic(fmt, 64, 256, seed=3, group=group)
    if fmt == "qserve" and group:  # valid groups only: (q - z) * s2 within int8, as the quantizer makes them
        rng = np.random.default_rng(4)
        s2 = torch.from_numpy(rng.integers(1, 18, (64, 256 // group)))
        zero = torch.minimum(torch.from_numpy(rng.integers(0, 16, s2.shape)), 128 // s2)
        s2[0, 0], zero[0, 0] = 16, 8  # -z * s2 = -128, the int8 minimum
        s2[1, 0], zero[1, 0] = 127, 1  # the largest scale
        s2[2, 0], zero[2, 0] = 1, 0  # the smallest
        lo = torch.clamp(zero - 128 // s2, min=0)
        hi = torch.clamp(zero + 127 // s2, max=15)
        u = torch.from_numpy(rng.random((64, 256)))
        codes = (lo.repeat_interleave(group, 1) + u * (hi - lo + 1).repeat_interleave(group, 1)).long()
        codes = torch.minimum(codes, hi.repeat_interleave(group, 1))
        codes[3, :group] = 7  # an all-equal group
        tensors["qweight"] = qserve_layout.pack_qweight(codes)
        tensors["s2_scales"], tensors["s2_zeros"] = qserve_layout.pack_group_params(s2, zero)
    elif fmt == "liquidquant":
        u = liquidquant.unpack_codes(tensors["qweight"].numpy()).astype(np.int64)
        sa = tensors["s2a"].numpy().copy()  # [N/64, K/64, 64, 2]
        sa[0, 0, 0] = (16, 0)  # min -128, step 16: codes up to 7
        sa[0, 0, 1] = (1, 128)  # an all-equal group at 0
        u[0, :64] = np.minimum(u[0, :64], 7)
        u[1, :64] = 0
        tensors["qweight"] = torch.from_numpy(liquidquant.pack_codes(u))
        tensors["s2a"] = torch.from_numpy(sa)
    elif fmt == "qqq" and group:
        r = qqq.permute_columns(tensors["s_group"].numpy(), qqq.SCALE_PERM, inverse=True)
        r[:, :4] = np.float16(127 / 8)
        tensors["s_group"] = torch.from_numpy(qqq.permute_columns(r, qqq.SCALE_PERM))
    return tensors


@pytest.mark.parametrize(("fmt", "group", "recipe"), [("qserve", None, "qoq"), ("qserve", 128, "qoq-g128"),
                                                      ("liquidquant", 64, "lqq-g64"), ("qqq", None, "qqq"),
                                                      ("qqq", 128, "qqq-g128")])
def test_emulation_matches_the_reference_dequant_at_the_extremes(fmt, group, recipe):
    from quantkit.formats import get_packer
    from quantkit.recipe import load_recipe

    tensors = _edge_tensors(fmt, group)
    spec = load_recipe(recipe).weights.spec()
    weight = get_packer(fmt)(load_recipe(recipe), torch.float16).unpack(dict(tensors), spec).dequantize()
    x = np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32)
    x[0] = 0.0
    check = check_against_reference(emulate(fmt, tensors, x), weight, x)
    assert check.exact and check.rel_error < 4e-3


def test_int8_gemm_reports_negative_int32_overflow():
    """-127 * 127 * 140000 = -2.26e9 lies below int32's -2^31: reported like the positive overflow."""
    big = np.full((1, 140000), 127, dtype=np.int64)
    with pytest.raises(OverflowError):
        int8_gemm(-big, big)


def test_anyprec_gemv_sums_in_word_order_then_the_xor_tree():
    """The float32 order is part of the kernel's bits. One row of 1024 columns, 3 bits, table [0, 1, 2048]:
    token 0 puts 2^24 on thread 0, 1 on thread 1 and -2^24 on thread 16, so the tree (16 first) gives
    (2^24 - 2^24) + 1 = 1 where pairing 0 with 1 first would lose the 1 (2^24 + 1 rounds to 2^24);
    token 1 puts 2^24, 1, -2^24 on thread 0's weights u = 0, 1, 2, whose word-order sum is 0 (the 1 is lost)."""
    from quantkit.emulate import emulate_anyprec
    from quantkit.formats.anyprec_layout import column_map, pack_planes

    cmap = column_map(1024)
    assert (cmap[0, 0], cmap[0, 1], cmap[0, 2], cmap[1, 0], cmap[16, 0]) == (0, 1, 2, 8, 128)
    codes = np.zeros((1, 1024), dtype=np.int64)
    codes[0, [0, 2, 128]] = 2  # table entry 2048
    codes[0, [1, 8]] = 1  # table entry 1
    lut = np.zeros((1, 8), dtype=np.float16)
    lut[0, 1], lut[0, 2] = 1, 2048
    tensors = {"qweight": torch.from_numpy(pack_planes(codes, 3)), "lut3": torch.from_numpy(lut)}
    x = np.zeros((2, 1024), dtype=np.float32)
    x[0, 0], x[0, 8], x[0, 128] = 8192, 1, -8192  # threads 0, 1, 16
    x[1, 0], x[1, 1], x[1, 2] = 8192, 1, -8192  # thread 0, u = 0, 1, 2
    decoded, y = emulate_anyprec(tensors, x, 3)
    assert np.array_equal(decoded, codes)
    assert y.dtype == np.float16 and y[:, 0].tolist() == [1.0, 0.0]


def test_anyprec_gemv_takes_the_activations_rounded_to_fp16():
    """The kernel's input is fp16: x = 1 + 3 * 2^-12 arrives as 1 + 2^-10 (the nearest fp16), so with every weight
    1 and a second column of -1 the output is 2^-10, not the float32 difference 3 * 2^-12 (itself an fp16)."""
    from quantkit.emulate import emulate_anyprec
    from quantkit.formats.anyprec_layout import pack_planes

    codes = np.zeros((1, 1024), dtype=np.int64)
    lut = np.ones((1, 8), dtype=np.float16)
    tensors = {"qweight": torch.from_numpy(pack_planes(codes, 3)), "lut3": torch.from_numpy(lut)}
    x = np.zeros((1, 1024), dtype=np.float32)
    x[0, 0], x[0, 1] = 1 + 3 * 2.0 ** -12, -1
    _, y = emulate_anyprec(tensors, x, 3)
    assert y[0, 0] == np.float16(2.0 ** -10)


def test_relative_error_is_against_the_largest_reference_value():
    """validate's rel_error: the largest |out - y_ref| over the largest |y_ref| (out [1, 2] against [1, 4]: 2 / 4),
    not over a mean, which would make the same miss look larger on outputs with small values."""
    from quantkit.emulate import _rel_error

    assert _rel_error(np.array([1.0, 2.0], dtype=np.float16), np.array([1.0, 4.0], dtype=np.float32)) == 0.5


@pytest.mark.parametrize("failing", ["int32", "error", "kernel"])
def test_validate_fails_on_one_mismatch_in_the_outlier_run_of_one_linear(artifacts, monkeypatch, failing):
    """A single mismatch anywhere fails validate (exit 1, the linear named): here only the second check (the
    activations with outlier channels) of the last linear checked, in its int32 sums, its output error or its
    kernel run, while every other check passes."""
    import quantkit.emulate
    import quantkit.validation
    from quantkit import kernels
    from quantkit.emulate import Check

    real = quantkit.emulate.check_against_reference
    calls: list[int] = []

    def check(emulation, weight, x):
        calls.append(1)
        result = real(emulation, weight, x)
        if failing != "kernel" and len(calls) == 28:  # 2 layers x 7 linears x (plain, outliers): the last
            return Check(False, result.rel_error) if failing == "int32" else Check(result.exact, 0.5)
        return result

    matched: list[int] = []

    def matches(*args, **kwargs):
        matched.append(1)
        return not (failing == "kernel" and len(matched) == 28)

    monkeypatch.setattr(quantkit.validation, "check_against_reference", check)  # where validate calls it
    monkeypatch.setattr(kernels, "resolve_device", lambda kernel: "cpu")
    monkeypatch.setattr(kernels, "matches_emulation", matches)
    monkeypatch.setattr(kernels, "path_labels", lambda *args: ["small-M"])
    result = cli("validate", artifacts["qqq"])
    assert len(calls) == 28
    assert result.exit_code == 1 and "1 linear(s) do not match" in result.output, result.output
    assert "layer 1 mlp.down_proj (" in " ".join(result.output.split())


def test_validate_applies_its_tolerance_and_outlier_channels(artifacts, monkeypatch):
    """The fp16 outputs are held to --tolerance: at 0 no linear passes (an fp16 output cannot equal the float32
    reference everywhere), and the failure says so. The second activations are the first with max(1, K // 64)
    channels 30 times larger, the rest equal."""
    import quantkit.emulate
    import quantkit.validation

    failed = cli("validate", artifacts["qqq"], "--kernel", "none", "--tolerance", "0")
    assert failed.exit_code == 1 and "error above 0" in failed.output
    seen: list[np.ndarray] = []
    real = quantkit.emulate.check_against_reference
    monkeypatch.setattr(quantkit.validation, "check_against_reference",
                        lambda e, w, x: seen.append(x) or real(e, w, x))
    cli_ok("validate", artifacts["qqq"], "--kernel", "none")
    plain, heavy = seen[0], seen[1]
    k = plain.shape[1]
    boosted = np.flatnonzero(~np.all(heavy == plain, axis=0))
    assert len(boosted) == max(1, k // 64)
    np.testing.assert_array_equal(heavy[:, boosted], plain[:, boosted] * 30)


def test_output_error_catches_one_tokens_scale_off_by_a_code():
    """check_against_reference's error is max |y - y_ref| / max |y_ref| per token: one token's outputs scaled by
    128/127 (its activation scale max / 126 for max / 127, say) give 1/127 = 7.9e-3, above validate's default
    tolerance of 4e-3, whether that token holds the largest output or the smallest (whose miss, measured against
    the largest output, would be under half that), and not diluted by the other outputs (a mean or a sum would)."""
    tensors = _edge_tensors("qqq", None)
    from quantkit.formats import get_packer
    from quantkit.recipe import load_recipe

    recipe = load_recipe("qqq")
    weight = get_packer("qqq")(recipe, torch.float16).unpack(dict(tensors), recipe.weights.spec()).dequantize()
    x = np.random.default_rng(5).standard_normal((6, 256)).astype(np.float32)
    emulation = emulate("qqq", tensors, x)
    assert check_against_reference(emulation, weight, x).rel_error < 1e-3
    m = int(np.abs(emulation.out.astype(np.float32)).max(axis=1).argmax())
    emulation.out = emulation.out.copy()
    emulation.out[m] = (emulation.out[m].astype(np.float32) * np.float32(128 / 127)).astype(np.float16)
    rel = check_against_reference(emulation, weight, x).rel_error
    assert rel == pytest.approx(1 / 127, abs=1e-3) and rel > 4e-3
    # the same miss in the token of the smallest outputs: measured against that token's own, not diluted by m's
    emulation = emulate("qqq", tensors, x)
    peaks = np.abs(emulation.out.astype(np.float32)).max(axis=1)
    small = int(peaks.argmin())
    assert peaks[small] < 0.5 * peaks[m]
    emulation.out = emulation.out.copy()
    emulation.out[small] = (emulation.out[small].astype(np.float32) * np.float32(128 / 127)).astype(np.float16)
    rel = check_against_reference(emulation, weight, x).rel_error
    assert rel == pytest.approx(1 / 127, abs=1e-3) and rel > 4e-3


def test_exact_check_holds_the_weight_scales_to_the_reference_bit_for_bit():
    """The int32 check also requires the emulation's INT8 weights times its scales to give the reference weights
    exactly: one channel's scale one float32 ulp off leaves every code (and so every int32 sum) unchanged, and its
    output error far below any tolerance, but is a mismatch."""
    from quantkit.formats import get_packer
    from quantkit.recipe import load_recipe

    tensors = _edge_tensors("qqq", None)
    recipe = load_recipe("qqq")
    weight = get_packer("qqq")(recipe, torch.float16).unpack(dict(tensors), recipe.weights.spec()).dequantize()
    x = np.random.default_rng(6).standard_normal((4, 256)).astype(np.float32)
    emulation = emulate("qqq", tensors, x)
    assert check_against_reference(emulation, weight, x).exact
    emulation.s_w = emulation.s_w.copy()
    emulation.s_w[3] = np.nextafter(emulation.s_w[3], np.float32(np.inf))
    check = check_against_reference(emulation, weight, x)
    assert not check.exact and check.rel_error < 1e-3


def test_quantize_tokens_divides_by_the_scale_as_the_simulation_does():
    """The codes are round(x / s), as `fake_quantize_per_token` (eval's simulation) computes them, not
    round(x * (1 / s)): with max 1 (s = 1/127 in float32), x = 0.043307085 gives x / s = 5.5 exactly, which rounds
    half to even to 6, where the reciprocal's product 5.4999995 rounds to 5, a code away from what eval
    simulates."""
    from quantkit.quantizers import fake_quantize_per_token

    x = np.array([[1.0, 0.043307085, -0.68897635]], dtype=np.float32)
    q, s = quantize_tokens(x)
    assert q.tolist() == [[127, 6, -88]]
    simulated = fake_quantize_per_token(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(q.astype(np.float32) * s[:, None], simulated)


def test_int8_gemm_takes_sums_at_the_int32_limits():
    """An accumulator is refused only past int32: sums of INT8 products equal to -2^31 and to 2^31 - 1 exactly are
    what the kernel's int32 holds (132104 x (-128 * 127) + (-128 * 8), and 131070 x 128^2 + 2 x 127^2 + 127 * 4 + 1),
    and one more on either side overflows."""
    low_x, low_w = np.array([[-128] * 132105]), np.array([[127] * 132104 + [8]])
    assert int8_gemm(low_x, low_w)[0, 0] == INT32[0]
    high_x = np.array([[-128] * 131070 + [127, 127, 127, 1]])
    high_w = np.array([[-128] * 131070 + [127, 127, 4, 1]])
    assert int8_gemm(high_x, high_w)[0, 0] == INT32[1]
    with pytest.raises(OverflowError):
        int8_gemm(np.concatenate([low_x, [[-1]]], axis=1), np.concatenate([low_w, [[1]]], axis=1))
    with pytest.raises(OverflowError):
        int8_gemm(np.concatenate([high_x, [[1]]], axis=1), np.concatenate([high_w, [[1]]], axis=1))


@pytest.mark.parametrize(("key", "change"), [
    ("s1_scales", lambda t: t[: t.shape[0] // 2].clone()),  # half the rows: torch's reshape raises a RuntimeError
    ("qweight", lambda t: t.to(torch.int16)),  # not bytes: the layout raises a TypeError
], ids=["scales-cut", "qweight-int16"])
def test_validate_names_a_linear_whose_tensor_its_spec_cannot_read(artifacts, tmp_path, key, change):
    """A linear whose stored tensor its spec cannot read (QServe's per-channel scales cut to half their rows, its
    qweight stored as int16) is refused as a damaged artifact (exit 2) naming the layer and the linear, whatever
    error the layout raises, not with a traceback."""
    import shutil

    damaged = shutil.copytree(artifacts["qoq"], tmp_path / "damaged")
    rewrite_tensor(damaged, f"model.layers.0.mlp.down_proj.{key}", change)
    result = cli("validate", damaged, "--kernel", "none")
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "layer 0 mlp.down_proj: its tensors do not fit the manifest's 4-bit spec" in said, result.output


def test_the_epilogue_rounds_once_after_float32_products_in_the_kernels_order():
    """The W4A8 epilogue is the kernel's float32 arithmetic, in its order, rounded to fp16 once; the warp simulator
    checks it bit for bit, but only where a C++ compiler is found, so here it is by hand:
    - the int32 sum converts to float32 first: 2^24 + 2^13 + 1 becomes 2^24 + 2^13, times 2^-24 the fp16 tie
      1 + 2^-11, which rounds to even (1.0), where the exact sum would round up to 1 + 2^-10;
    - (acc * s_w) * s_x, not acc * (s_w * s_x) nor (acc * s_x) * s_w: 1903 with these scales gives 859.5, the
      other two orders 860;
    - QServe per channel subtracts szero * t_x in float32 before the one rounding: 1 + 2^-12 - 1 is 2^-12, where
      rounding the product to fp16 first would lose it."""
    from quantkit.emulate import _epilogue

    one = np.ones(1, dtype=np.float32)
    y = _epilogue(np.array([[2**24 + 2**13 + 1]]), np.array([2.0**-24], dtype=np.float32), one)
    assert y.dtype == np.float16 and y[0, 0] == 1.0
    s_w, s_x = np.array([0.62938344], dtype=np.float32), np.array([0.71782416], dtype=np.float32)
    assert _epilogue(np.array([[1903]]), s_w, s_x)[0, 0] == 859.5
    y = _epilogue(np.array([[4097]]), np.array([2.0**-12], dtype=np.float32), one, szero=one, t_x=one)
    assert y[0, 0] == np.float16(2.0**-12)


def test_atom_epilogue_accumulates_groups_in_float32_and_rounds_once():
    """Atom's GEMM adds each group's float(partial) * (s_x * s_w) into a float32 accumulator, groups in order with
    the outliers last, and rounds to fp16 once; the warp simulator checks the bits only where a C++ compiler is
    found, so here they are by hand, on hand-made tensors (one INT4 group of 128 columns, 128 outliers):
    - token 0, row 0: 5356 * (s_x * s_w) gives 2594, where (5356 * s_x) * s_w gives 2596;
    - token 1, row 1: (1 + 2^-12) from the group, then -1 from the outliers: 2^-12, where rounding the
      accumulator to fp16 between groups would lose it (0);
    - token 2, row 2: 1, then 2^-11 + 2^-30 from the outliers: the float32 sum is the fp16 tie 1 + 2^-11, which
      rounds to even (1.0), where a wider accumulator would round up to 1 + 2^-10."""
    from quantkit.emulate import emulate_atom_quantized
    from quantkit.formats.atom import scatter_scales

    n, k = 16, 256
    w4, w8 = np.zeros((n, 128), dtype=np.int64), np.zeros((n, 128), dtype=np.int64)
    codes = np.zeros((3, k), dtype=np.int64)
    w4[0, :109], w4[0, 109], codes[0, :109], codes[0, 109] = 7, 3, 7, 5  # 109 * 49 + 15 = 5356
    w4[1, :83], w4[1, 83], codes[1, :83], codes[1, 83] = 7, 5, 7, 6  # 83 * 49 + 30 = 4097
    w8[1, 0], codes[1, 128] = 1, -1
    w4[2, 0], codes[2, 0], w8[2, 0], codes[2, 128] = 1, 1, 1, 1
    nibbles = np.where(w4 < 0, w4 + 16, w4)
    s4, s8 = np.ones(n, dtype=np.float16), np.ones(n, dtype=np.float16)
    s4[0], s4[1] = 0.5336914, 2.0**-12
    tensors = {"weight_int4": torch.from_numpy((nibbles[:, 0::2] | nibbles[:, 1::2] << 4).astype(np.uint8)),
               "weight_int8": torch.from_numpy(w8.astype(np.int8)),
               "scale_int4": torch.from_numpy(scatter_scales(s4[None])),
               "scale_int8": torch.from_numpy(scatter_scales(s8)),
               "reorder_index": torch.arange(k, dtype=torch.int16)}
    s_x = np.array([[0.90783423, 1], [1, 1], [1, 2.0**-11 + 2.0**-30]], dtype=np.float32)
    emulation = emulate_atom_quantized(tensors, codes, s_x)
    assert [emulation.partials[0][0, 0], emulation.partials[0][1, 1], emulation.partials[1][1, 1]] == [5356, 4097, -1]
    assert emulation.out.dtype == np.float16
    assert [emulation.out[0, 0], emulation.out[1, 1], emulation.out[2, 2]] == [2594.0, 2.0**-12, 1.0]


def test_emulate_quantized_takes_scales_and_sums_in_float32():
    """The kernels receive the per-token scales s_x and (QServe per channel) the sums t_x of the unquantized
    activations as float32: the emulation multiplies and subtracts with them as given, not rounded to fp16 first
    (an fp16 s_x moves outputs by up to 2^-11 of themselves, several fp16 steps of the larger ones)."""
    from quantkit.emulate import _epilogue, emulate_quantized

    tensors = _edge_tensors("qserve", None)
    rng = np.random.default_rng(7)
    codes = rng.integers(-128, 128, (4, 256))
    s_x = (rng.uniform(0.01, 0.02, 4) * (1 + 2.0**-13)).astype(np.float32)
    t_x = (rng.uniform(-30, 30, 4) * (1 + 2.0**-13)).astype(np.float32)
    assert not np.array_equal(s_x.astype(np.float16).astype(np.float32), s_x)
    emulation = emulate_quantized("qserve", tensors, codes, s_x, t_x)
    assert np.array_equal(emulation.s_x, s_x)
    expected = _epilogue(emulation.acc, emulation.s_w, s_x, emulation.szero, t_x)
    assert np.array_equal(emulation.out.view(np.uint16), expected.view(np.uint16))


def test_emulation_takes_the_qserve_group_size_from_the_tensors():
    """QServe's progressive groups may be 64 wide (the kernels take 64 and 128): the emulation reads the group
    size from the stored s2 tensors (K over their rows), so a g64 linear's int32 sums equal the reference's, as
    the g128 ones do."""
    from dataclasses import replace

    from quantkit.formats import get_packer
    from quantkit.recipe import load_recipe

    recipe = load_recipe("qoq-g128")
    spec = replace(recipe.weights.spec(), group_size=64)
    tensors = _edge_tensors("qserve", 64)
    assert tensors["s2_scales"].shape[0] == 256 // 64
    weight = get_packer("qserve")(recipe, torch.float16).unpack(dict(tensors), spec).dequantize()
    x = np.random.default_rng(8).standard_normal((5, 256)).astype(np.float32)
    check = check_against_reference(emulate("qserve", tensors, x), weight, x)
    assert check.exact and check.rel_error < 4e-3


def test_anyprec_gemv_adds_its_chunks_in_float32_and_rounds_once():
    """The LUT GEMV adds the 1024-column chunks' sums in float32 and rounds to fp16 once at the end: with every
    weight 1, chunk 0 sums to 1 + 2^-12 and chunk 1 to -1, so the output is 2^-12, where rounding after each chunk
    would give 0. And a token of zeros gives zeros, where the tensor-core kernel's bound is 0: it accepts zeros and
    nothing else, not even the smallest subnormal."""
    from quantkit.emulate import emulate_anyprec, within_anyprec_tc_bound
    from quantkit.formats.anyprec_layout import pack_planes

    codes = np.ones((1, 2048), dtype=np.int64)
    lut = np.zeros((1, 8), dtype=np.float16)
    lut[0, 1] = 1
    tensors = {"qweight": torch.from_numpy(pack_planes(codes, 3)), "lut3": torch.from_numpy(lut)}
    x = np.zeros((2, 2048), dtype=np.float32)
    x[0, 0], x[0, 1], x[0, 1024] = 1, 2.0**-12, -1
    _, y = emulate_anyprec(tensors, x, 3)
    assert y[0, 0] == np.float16(2.0**-12) and y[1, 0] == 0
    assert within_anyprec_tc_bound(tensors, x[1:], 3, y[1:], y[1:])
    assert not within_anyprec_tc_bound(tensors, x[1:], 3, y[1:] + np.float16(2.0**-24), y[1:])


def test_a_linear_check_names_each_failing_part():
    """LinearCheck.problems says what fails in the words validate prints: the exact part by its column, an error
    above the tolerance (a NaN error too, in either activation run), and the kernel, with the simulator's message
    where it stopped one; a linear no kernel ran on fails on its emulation alone."""
    from quantkit.validation import LinearCheck

    ok = LinearCheck(0, "mlp.down_proj", True, (1e-3, 2e-3), None)
    assert ok.problems("qqq", 4e-3) == []
    assert LinearCheck(0, "x", False, (1e-3, 1e-3), True).problems("anyprec", 4e-3) == ["codes"]
    assert LinearCheck(0, "x", True, (1e-3, float("nan")), True).problems("qqq", 4e-3) == ["error above 0.004"]
    assert LinearCheck(0, "x", True, (float("nan"), 1e-3), True).problems("qqq", 4e-3) == ["error above 0.004"]
    stopped = LinearCheck(0, "x", False, (5e-3, 1e-3), False, "C05 at lane 3")
    assert stopped.problems("atom", 4e-3) == ["int32", "error above 0.004", "kernel: C05 at lane 3"]
