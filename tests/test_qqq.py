"""QQQ: narrow-range and INT8-requantized weights, the Marlin-derived `qqq` layout, the kernel's INT8 model, recipes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import cli, cli_ok

from quantkit.artifact import MANIFEST
from quantkit.eval.loading import load_for_eval
from quantkit.formats.base import ExportError
from quantkit.formats.qqq import (
    SCALE_PERM,
    SCALE_PERM_SINGLE,
    QQQPacker,
    kernel_int8,
    pack_b,
    permute_columns,
    unpack_b,
    weight_perm,
)
from quantkit.quantizers import QParams, QuantizedLinear, QuantSpec, compute_qparams, quantize, requantize_int8
from quantkit.recipe import load_recipe
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

PER_CHANNEL = QuantSpec(bits=4, symmetric=True, granularity="channel", narrow_range=True)
PER_GROUP = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=128, requant_int8=True)


def _packer() -> QQQPacker:
    return QQQPacker(load_recipe("qqq"), torch.float16)


def _linear(spec: QuantSpec, n: int = 128, k: int = 256, seed: int = 0) -> QuantizedLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[3, :5] *= 20  # an outlier row segment: its group's scale dominates the row's INT8 scale
    w[7, 128:] = 0  # an all-zero group
    qp = compute_qparams(w, spec)
    return QuantizedLinear(quantize(w, qp, spec), qp, spec).finished()


@pytest.mark.parametrize("per_group", [False, True])
def test_weight_perm_is_a_permutation_of_each_chunk(per_group):
    assert sorted(weight_perm(per_group).tolist()) == list(range(1024))
    assert sorted(SCALE_PERM.tolist()) == list(range(64))
    assert sorted(SCALE_PERM_SINGLE.tolist()) == list(range(32))


@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize(("k", "n"), [(128, 64), (256, 192), (384, 128)])
def test_pack_b_round_trips(per_group, k, n):
    rng = np.random.default_rng(k + n)
    q = rng.integers(0, 16, (k, n)) if per_group else rng.integers(-7, 8, (k, n))
    b = pack_b(q, per_group)
    assert b.dtype == np.int32 and b.shape == (k // 16, 2 * n)
    assert np.array_equal(unpack_b(b, per_group), q)


def test_per_channel_word_by_hand():
    """Word 0 holds column 0 of tile rows 0-3 in its high nibbles and column 8 in its low nibbles (interleave
    [4,0,5,1,6,2,7,3]), so `w & 0xF0F0F0F0` is the thread's first four INT8 weights times 16."""
    q = np.zeros((128, 64), dtype=np.int64)
    q[0:4, 0] = [1, 2, 3, -1]
    q[0:4, 8] = [-7, 4, 0, 5]
    word = int(pack_b(q, per_group=False)[0, 0]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0x9, 1, 4, 2, 0, 3, 5, 0xF]  # (-7 & 15), q[0,0], q[1,8], q[1,0], q[2,8], q[2,0], ...
    high = np.array([word & 0xF0F0F0F0], dtype=np.uint32).view(np.int8)
    assert high.tolist() == [16, 32, 48, -16]


def test_per_group_word_by_hand():
    """Per group the interleave is Marlin's [0,2,4,6,1,3,5,7]: nibbles 0 and 4 hold rows 0 and 1 of column 0
    (the 0x000F000F mask gives both fp16 halves at once)."""
    q = np.full((128, 64), 8, dtype=np.int64)
    q[0:4, 0] = [1, 2, 3, 4]
    q[0:4, 8] = [11, 12, 13, 14]
    word = int(pack_b(q, per_group=True)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [1, 3, 11, 13, 2, 4, 12, 14]


def test_kernel_int8_per_channel_is_sixteen_q():
    q = np.random.default_rng(0).integers(-7, 8, (256, 128))
    assert np.array_equal(kernel_int8(pack_b(q, False), None), 16 * q)


def test_kernel_int8_per_group_for_every_fp16_ratio():
    """The FP16 path (0x6400 expansion, one hfma2 with 1536, its low byte) equals round-half-even(q * r) for
    every code and every fp16 ratio r in (0, 127/8], the range requantize_int8 can produce."""
    ratios = np.arange(1, 0x4BF1, dtype=np.uint16).view(np.float16)  # every positive fp16 up to 15.875
    assert ratios[-1] == np.float16(15.875)
    n = -(-ratios.size // 64) * 64
    r = np.full((1, n), np.float16(1.0))
    r[0, :ratios.size] = ratios
    codes = np.tile(np.arange(16), 8)[:, None].repeat(n, axis=1)  # [128, n]: every code in every column
    got = kernel_int8(pack_b(codes, True), permute_columns(r, SCALE_PERM))
    want = np.round((codes - 8) * r.astype(np.float64))  # np.round is round-half-even
    assert np.abs(want).max() == 127
    assert np.array_equal(got, want)
    ties = (np.abs(((codes - 8) * r.astype(np.float64)) % 1) == 0.5).sum()
    assert ties > 1000  # the comparison covers many exact halves, where the rounding rule matters


def test_narrow_range_spec():
    assert (PER_CHANNEL.qmin, PER_CHANNEL.qmax) == (-7, 7)
    w = torch.tensor([[-3.5, 1.0, 0.2, 3.5]])
    qp = compute_qparams(w, PER_CHANNEL, torch.float32)
    assert float(qp.scale) == 0.5
    assert quantize(w, qp, PER_CHANNEL).tolist() == [[-7, 2, 0, 7]]
    with pytest.raises(ValueError, match="symmetric"):
        QuantSpec(bits=4, symmetric=False, narrow_range=True)
    with pytest.raises(ValueError, match="requant_int8"):
        QuantSpec(bits=4, symmetric=True, granularity="channel", requant_int8=True)


def test_requantize_int8_bounds_and_hand_example():
    """Row [q * 0.5 | q * 0.25] with codes up to -8: s_c = 4 / 127, ratios fp16(0.5 * 127 / 4) and half that."""
    codes = torch.tensor([[-8, 7, 7, -8]], dtype=torch.int8)
    rq = requantize_int8(codes, QParams(scale=torch.tensor([[0.5, 0.25]]), zero=None, group_size=2))
    assert torch.equal(rq.s_channel, torch.tensor([[4.0 / 127]]))
    assert rq.ratio.tolist() == [[float(np.float16(0.5 / (4.0 / 127))), float(np.float16(0.25 / (4.0 / 127)))]]
    int8 = torch.round(codes.float() * rq.ratio.repeat_interleave(2, dim=1))
    assert int8.tolist() == [[-127, 111, 56, -64]]  # 7 * 7.9375 = 55.56; -8 * 7.9375 = -63.5, half to even
    q = _linear(PER_GROUP)
    int8 = torch.round(q.codes.float() * q.qparams.ratio.repeat_interleave(128, dim=1))
    assert int8.abs().max() <= 127 and (int8.abs().amax(dim=1) >= 126).all()
    assert q.qparams.ratio[7, 1] == 0  # the all-zero group


@pytest.mark.parametrize("spec", [PER_CHANNEL, PER_GROUP], ids=["per-channel", "g128"])
def test_packer_round_trip_is_exact(spec):
    q = _linear(spec)
    packed = _packer().pack(q)
    n, k = q.codes.shape
    assert packed["B"].dtype == torch.int32 and packed["B"].shape == (k // 16, 2 * n)
    assert packed["s_channel"].dtype == torch.float32 and packed["s_channel"].shape == (1, n)
    if spec.granularity == "group":
        assert packed["s_group"].dtype == torch.float16 and packed["s_group"].shape == (k // 128, n)
    else:
        assert "s_group" not in packed
    back = _packer().unpack(packed, spec)
    assert torch.equal(back.codes, q.codes)
    assert torch.equal(back.dequantize(), q.dequantize())
    # the kernel's INT8 weights times s_channel are exactly the reference dequantization
    s_group = packed["s_group"].numpy() if "s_group" in packed else None
    int8 = torch.from_numpy(kernel_int8(packed["B"].numpy(), s_group)).float().T
    s_channel = torch.from_numpy(permute_columns(packed["s_channel"].numpy(), SCALE_PERM_SINGLE, inverse=True))
    assert torch.equal(int8 * s_channel.reshape(-1, 1), q.dequantize())  # per channel: 16 q * (scale / 16)


def test_packer_refuses_what_the_kernel_cannot_run():
    packer = _packer()
    with pytest.raises(ExportError, match="multiple of 64"):
        packer.check("mlp.down_proj", PER_CHANNEL, (96, 256))
    with pytest.raises(ExportError, match="K of 128"):
        packer.check("mlp.down_proj", PER_CHANNEL, (128, 192))
    with pytest.raises(ExportError, match="narrow_range"):
        packer.check("mlp.down_proj", QuantSpec(bits=4, symmetric=True, granularity="channel"), (128, 256))
    with pytest.raises(ExportError, match="groups of 128"):
        packer.check("mlp.down_proj", QuantSpec(bits=4, symmetric=True, group_size=64, requant_int8=True),
                     (128, 256))
    with pytest.raises(ExportError, match="float16"):
        QQQPacker(load_recipe("qqq"), torch.bfloat16).check_recipe()
    with pytest.raises(ExportError, match="W4A8"):
        QQQPacker(load_recipe("qqq", ["activations=null"]), torch.float16).check_recipe()


def test_compressed_tensors_refuses_requant_int8():
    from quantkit.formats.compressed_tensors import CompressedTensorsPacker

    with pytest.raises(ExportError, match="qqq"):
        CompressedTensorsPacker(load_recipe("qqq-g128"), torch.float16).check("mlp.up_proj", PER_GROUP, (128, 256))


def test_recipes_resolve():
    for name, granularity in (("qqq", "channel"), ("qqq-g128", "group")):
        recipe = load_recipe(name)
        assert recipe.weights.spec().granularity == granularity and recipe.export.format == "qqq"
        smooth = next(p for p in recipe.passes if p.name == "smooth")
        assert smooth.config.method == "threshold" and smooth.config.gqa_output == "skip"
    assert load_recipe("lqq-g64").weights.spec().level2 == "lqq"


@pytest.mark.parametrize(("recipe", "method", "group_size"), [
    ("qqq", "qqq", -1), ("qqq-g128", "qqq", 128), ("lqq-g64", "liquidquant", 64)])
def test_end_to_end_artifact_loads_as_quantized(tmp_path, calib_txt, recipe, method, group_size):
    """On a synthetic 128-multiple Llama (GQA) the recipe exports its engine layout, which loads for eval with
    exactly the weights of the quantkit simulation artifact of the same run (QQQ's second rounding included)."""
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=256, intermediate_size=512,
                                                                  num_hidden_layers=2, num_attention_heads=4,
                                                                  num_key_value_heads=2))
    args = ["--recipe", recipe, "--calib", calib_txt, "--num-samples", "4", "--seq-len", "64"]
    cli_ok("quantize", model, "-o", tmp_path / "qqq", *args)
    cli_ok("quantize", model, "-o", tmp_path / "sim", *args, "--set", "export.format=quantkit")
    config = json.loads((tmp_path / "qqq" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == method
    assert config["quantization_config"]["group_size"] == group_size
    manifest = json.loads((tmp_path / "qqq" / MANIFEST).read_text())
    skipped = any("smooth_skipped_gqa" in k for layer in manifest["layers"] for k in layer["metrics"])
    assert skipped == (method == "qqq")  # QQQ skips the o point under GQA; LiquidQuant pools it
    inspected = cli_ok("inspect", tmp_path / "qqq").output
    assert {"qqq": "per channel, narrow range [-7, 7]", "qqq-g128": "INT8 re-expression (QQQ)",
            "lqq-g64": "LiquidQuant two-level"}[recipe] in inspected
    a = load_for_eval(tmp_path / "qqq", dtype=torch.float16).model
    b = load_for_eval(tmp_path / "sim", dtype=torch.float16).model
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize(("recipe", "extra"), [
    ("qqq", []),
    ("lqq-g64", ["--set", "weights.indivisible=per_channel"]),  # down_proj's K = 172: per channel
])
def test_recipes_run_on_stories260k(stories260k, tinystories_txt, tmp_path, recipe, extra):
    """stories260K (hidden 64, intermediate 172) fits neither kernel: the export refuses it with the way out, and
    the simulation artifact quantizes with a small per-layer error and evaluates with A8 simulated."""
    fast = ["--num-samples", "4", "--seq-len", "64"]
    result = cli("quantize", stories260k, "--recipe", recipe, "-o", tmp_path / "x", "--calib", tinystories_txt,
                 *fast, *extra)
    assert result.exit_code != 0 and "export.format=quantkit" in result.output
    out = tmp_path / "sim"
    cli_ok("quantize", stories260k, "--recipe", recipe, "-o", out, "--calib", tinystories_txt, *fast, *extra,
           "--set", "export.format=quantkit")
    manifest = json.loads((out / MANIFEST).read_text())
    assert all(r["rel_error"] < 0.5 for r in manifest["layers"])
    assert "simulating A8 per-token" in load_for_eval(out).description


def _group_linear(code: int, r: float) -> QuantizedLinear:
    """A finished per-group linear [64, 128]: all codes 0 but code[0, 0], every ratio 1 but ratio[0, 0] = r."""
    codes = torch.zeros(64, 128, dtype=torch.int8)
    codes[0, 0] = code
    ratio = torch.ones(64, 1)
    ratio[0, 0] = r
    qp = QParams(scale=ratio.clone(), zero=None, group_size=128, s_channel=torch.ones(64, 1), ratio=ratio)
    return QuantizedLinear(codes, qp, PER_GROUP)


def test_packer_refuses_an_int8_weight_of_128():
    """-8 * 15.9375 = -127.5 rounds half-to-even to -128 (the kernel's hfma2 too): outside QQQ's [-127, 127], so
    refused; -8 * 15.875 = -127 packs."""
    assert float(np.float16(15.9375)) == 15.9375
    assert int(kernel_int8(pack_b(np.array([[-8]]).repeat(128, 0).repeat(64, 1) + 8, True),
                           permute_columns(np.full((1, 64), np.float16(15.9375)), SCALE_PERM))[0, 0]) == -128
    with pytest.raises(ExportError, match=r"\[-127, 127\]"):
        _packer().pack(_group_linear(-8, 15.9375))
    _packer().pack(_group_linear(-8, 15.875))


def test_packer_refuses_ratios_that_are_not_fp16():
    """s_group is fp16: a ratio fp16 cannot hold (1 + 2^-12) is refused rather than rounded silently."""
    with pytest.raises(ExportError, match="fp16 ratios"):
        _packer().pack(_group_linear(1, 1 + 2**-12))


def test_per_channel_packer_refuses_code_minus_8():
    """Per channel QQQ stores the narrow range [-7, 7]; a code -8 is refused."""
    q = _linear(PER_CHANNEL)
    codes = q.codes.clone()
    codes[0, 0] = -8
    with pytest.raises(ExportError, match="narrow_range"):
        _packer().pack(QuantizedLinear(codes, q.qparams, PER_CHANNEL))


def test_per_channel_unpack_agrees_with_the_kernel_for_every_nibble():
    """For arbitrary words (every nibble 0..15, 8 included), the unpacked signed code times 16 is exactly the INT8
    value the kernel's `w & 0xF0F0F0F0` masking reads: nibble 8 is -8, not +8."""
    b = np.random.default_rng(5).integers(-(2**31), 2**31, (8, 128)).astype(np.int32)  # K = 128, N = 64
    assert np.array_equal(16 * unpack_b(b, per_group=False), kernel_int8(b, None))


def test_permutations_equal_the_digests_restatement_of_qqq_pack():
    """weight_perm, SCALE_PERM and SCALE_PERM_SINGLE against digest-liquidgemm-qqq's re-derivation of QQQ's
    qlinear_marlin.pack (`qqq_perm`), written out here: fragments thread-major, the chunk's four 16 x 16 tiles 256
    apart, then the nibble interleave; scale_perm [i + 8j], scale_perm_single [2i + j, j in 0,1,8,9,..]. Round trips
    and the emulation share the module's permutations, so only this (or the g++ warp simulator) sees them change."""
    for per_group, inter in ((True, [0, 2, 4, 6, 1, 3, 5, 7]), (False, [4, 0, 5, 1, 6, 2, 7, 3])):
        p = []
        for i in range(32):
            col, blk = i // 4, []
            for block in (0, 1):
                for row in range(4 * (i % 4), 4 * (i % 4) + 4):
                    blk.append(16 * row + col + 8 * block)
            for j in range(4):
                p += [x + 256 * j for x in blk]
        assert weight_perm(per_group).tolist() == np.array(p).reshape(-1, 8)[:, inter].ravel().tolist()
    assert SCALE_PERM[:16].tolist() == [0, 8, 16, 24, 32, 40, 48, 56, 1, 9, 17, 25, 33, 41, 49, 57]
    assert SCALE_PERM_SINGLE[:16].tolist() == [0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27]
    assert SCALE_PERM_SINGLE[-8:].tolist() == [6, 7, 14, 15, 22, 23, 30, 31]


def test_stored_scales_by_hand():
    """Position 2 of every 32 columns of s_channel holds channel 8 (scale_perm_single), position 1 of every 64 of
    s_group holds channel 8 (scale_perm); per channel s_channel is scale / 16, per group the INT8 channel scale."""
    q = _linear(PER_CHANNEL)
    t = _packer().pack(q)
    assert float(t["s_channel"][0, 2]) == float(q.qparams.scale[8, 0]) / 16
    assert float(t["s_channel"][0, 32 + 2]) == float(q.qparams.scale[32 + 8, 0]) / 16
    q = _linear(PER_GROUP)
    t = _packer().pack(q)
    assert float(t["s_channel"][0, 2]) == float(q.qparams.s_channel[8, 0])
    assert float(t["s_group"][1, 64 + 1]) == float(q.qparams.ratio[64 + 8, 1])
    assert float(t["s_group"][0, 0]) == float(q.qparams.ratio[0, 0])


def test_a_simulated_kv_cache_is_noted_as_not_served():
    """vLLM keeps the KV cache in floating point: a qqq recipe that simulates a quantized one gets a note that eval
    measured what the engine does not serve (it had said nothing); the bundled recipes, which simulate none, do not."""
    specs = {"o": load_recipe("qqq").weights.spec("channel")}
    assert not any("KV cache" in n for n in QQQPacker(load_recipe("qqq"), torch.float16).notes(specs))
    packer = QQQPacker(load_recipe("qqq", ["kv_cache={bits: 4}"]), torch.float16)
    assert any("KV cache quantization is simulated by quantkit eval, not exported" in n for n in packer.notes(specs))
