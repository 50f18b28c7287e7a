"""The QServe packer: exact round trips, the formats.md tensor layout, the kernel's W4 -> INT8 arithmetic, errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from quantkit.formats import get_packer
from quantkit.formats.base import ExportError
from quantkit.formats.compressed_tensors import CompressedTensorsPacker
from quantkit.formats.qserve import QServePacker
from quantkit.formats.qserve_layout import (
    emulate_group_dequant,
    pack_group_params,
    pack_qweight,
    s2_order,
    unpack_qweight,
)
from quantkit.quantizers import (
    QParams,
    QuantizedLinear,
    QuantSpec,
    compute_qparams,
    dequantize,
    quantize,
    search_qparams,
)
from quantkit.recipe import load_recipe

CHANNEL = QuantSpec(bits=4, symmetric=False, granularity="channel", zero_form="scaled")
MODULE = "model.layers.3.mlp.down_proj"


def group_spec(g: int = 128, protect: int = 119) -> QuantSpec:
    return QuantSpec(bits=4, symmetric=False, granularity="group", group_size=g, progressive=True,
                     protective_range=protect)


def make_packer(dtype: torch.dtype = torch.float16) -> QServePacker:
    return QServePacker(load_recipe("qoq"), dtype)


def quantized(w: torch.Tensor, spec: QuantSpec) -> QuantizedLinear:
    qp = compute_qparams(w, spec)
    return QuantizedLinear(quantize(w, qp, spec), qp, spec)


def random_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows of varied magnitude with a few outliers, rounded to fp16 like a real checkpoint."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    idx = torch.randint(0, k, (n,), generator=g)
    w[torch.arange(n), idx] *= 8
    return w.half().float()


def assert_same_linear(back: QuantizedLinear, q: QuantizedLinear) -> None:
    """Codes, every QParams field, and the dequantized weights are bit-identical."""
    assert back.codes.dtype == torch.int8 and torch.equal(back.codes, q.codes)
    for field in QParams.TENSORS:
        a, b = getattr(back.qparams, field), getattr(q.qparams, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), field
    assert back.qparams.group_size == q.qparams.group_size
    assert back.qparams.protect == q.qparams.protect
    assert back.qparams.code_offset == q.qparams.code_offset
    assert back.g_idx is None
    assert torch.equal(back.dequantize(), q.dequantize())


SPECS = [CHANNEL, group_spec(128), group_spec(64)]
SPEC_IDS = ["channel", "g128", "g64"]


# ---------------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("shape", [(32, 128), (96, 512), (128, 256)])
def test_round_trip_is_exact(spec, shape):
    q = quantized(random_weight(*shape, seed=shape[0] + shape[1]), spec)
    packer = make_packer()
    assert_same_linear(packer.unpack(packer.pack(q), spec), q)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_round_trip_after_clip_search(spec):
    w = random_weight(64, 256, seed=9)
    qp = search_qparams(w, spec)
    q = QuantizedLinear(quantize(w, qp, spec), qp, spec)
    packer = make_packer()
    assert_same_linear(packer.unpack(packer.pack(q), spec), q)


@settings(max_examples=20, deadline=None)
@given(spec_i=st.integers(0, len(SPECS) - 1), nt=st.integers(1, 4), groups=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
def test_round_trip_random(spec_i, nt, groups, seed):
    spec = SPECS[spec_i]
    q = quantized(random_weight(32 * nt, 128 * groups, seed), spec)
    packer = make_packer()
    assert_same_linear(packer.unpack(packer.pack(q), spec), q)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_round_trip_through_safetensors(spec, tmp_path):
    q = quantized(random_weight(64, 256, seed=7), spec)
    packer = make_packer()
    save_file(packer.pack(q), tmp_path / "t.safetensors")
    assert_same_linear(packer.unpack(load_file(tmp_path / "t.safetensors"), spec), q)


# ---------------------------------------------------------------------------------------------------- layout


def test_per_channel_tensors_match_formats_md():
    n, k = 96, 256
    q = quantized(random_weight(n, k, seed=1), CHANNEL)
    t = make_packer().pack(q)
    assert set(t) == {"qweight", "s1_scales", "s1_szeros"}
    assert t["qweight"].dtype == torch.int8 and t["qweight"].shape == (n, k // 2)
    assert t["s1_scales"].dtype == torch.float16 and t["s1_scales"].shape == (n,)
    assert t["s1_szeros"].dtype == torch.float16 and t["s1_szeros"].shape == (n,)
    assert torch.equal(t["qweight"], pack_qweight(q.codes.to(torch.int32) + 8))
    assert torch.equal(t["s1_scales"].float(), q.qparams.scale.reshape(n))
    # s1_szeros is the scaled zero z_u * s (z_u the UINT4 zero), rounded once to fp16
    z_u = q.qparams.zero.reshape(n) + 8
    assert torch.equal(t["s1_szeros"], (z_u.float() * q.qparams.scale.reshape(n)).half())


@pytest.mark.parametrize("g", [128, 64])
def test_group_tensors_match_formats_md(g):
    n, k = 64, 512
    q = quantized(random_weight(n, k, seed=2), group_spec(g))
    t = make_packer().pack(q)
    assert set(t) == {"qweight", "s1_scales", "s2_scales", "s2_zeros"}
    assert t["qweight"].dtype == torch.int8 and t["qweight"].shape == (n, k // 2)
    assert t["s1_scales"].dtype == torch.float16 and t["s1_scales"].shape == (n,)
    assert torch.equal(t["s1_scales"].float(), q.qparams.s1.reshape(n))
    s2 = q.qparams.s2.to(torch.int64)
    z_u = q.qparams.zero.to(torch.int64) + 8
    for name in ("s2_scales", "s2_zeros"):
        assert t[name].dtype == torch.int8 and t[name].shape == (k // g, n)
    # position p of every 32-channel tile holds channel 8*(p % 4) + p // 4; s2_zeros holds -(z_u * s2)
    for grp in range(k // g):
        for pos in range(n):
            ch = pos - pos % 32 + 8 * (pos % 4) + (pos % 32) // 4
            assert int(t["s2_scales"][grp, pos]) == int(s2[ch, grp])
            assert int(t["s2_zeros"][grp, pos]) == -int(z_u[ch, grp] * s2[ch, grp])
    assert torch.equal(s2_order(n)[:8], torch.tensor([0, 8, 16, 24, 1, 9, 17, 25]))


def test_per_channel_dequant_from_stored_fp16_tensors():
    n, k = 64, 256
    q = quantized(random_weight(n, k, seed=3), CHANNEL)
    t = make_packer().pack(q)
    q_u = unpack_qweight(t["qweight"]).float()
    w = q_u * t["s1_scales"].float()[:, None] - t["s1_szeros"].float()[:, None]
    assert torch.equal(w, q.dequantize())
    assert torch.equal(w, dequantize(q.codes, q.qparams))


def worst_case_weight(n: int = 64, k: int = 256) -> torch.Tensor:
    """Rows that stress the level-2 INT8 range (two groups of 128 columns per row)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(n, k, generator=g)
    # row 0: digest-qserve P6b's group [-113, 120] (with row max 127, so s1 = 1 when P = 127)
    w[0, :128] = torch.linspace(-113, 120, 128).round()
    w[0, 128:] = torch.linspace(-127, 127, 128).round()
    w[1] = 0  # all-zero row
    w[2] = 0.5  # all-equal groups
    w[3, :128], w[3, 128:] = -0.25, 3.0
    w[4] = torch.where(torch.arange(k) % 2 == 0, 65504.0, -65504.0)  # fp16 max magnitude
    w[5] = torch.linspace(-65504, 65504, k)
    w[6, :128] = 0  # one all-zero group next to a normal one
    w[7, :128], w[7, 128:] = 120.0, -113.0  # equal groups at the extremes of the row
    return w.half().float()


@pytest.mark.parametrize(("g", "protect"), [(128, 119), (64, 119), (32, 119), (128, 127)])
def test_kernel_emulation_equals_reference(g, protect):
    spec = group_spec(g, protect)
    w = worst_case_weight()
    q = quantized(w, spec)
    t = make_packer().pack(q)
    w8 = emulate_group_dequant(t["qweight"], t["s2_scales"], t["s2_zeros"], g)
    codes_u = q.codes.to(torch.int32) + 8
    z_u = q.qparams.zero.repeat_interleave(g, dim=1) + 8
    s2 = q.qparams.s2.to(torch.int32).repeat_interleave(g, dim=1)
    exact = (codes_u - z_u) * s2
    assert int(exact.min()) >= -128 and int(exact.max()) <= 127  # nothing reaches 128
    assert torch.equal(w8, exact.to(torch.int8))  # the per-byte add never wrapped
    s1 = t["s1_scales"].float()[:, None]
    assert torch.equal(w8.float() * s1, dequantize(q.codes, q.qparams))
    assert torch.equal(w8.float() * s1, q.dequantize())


def test_digest_overflow_group_is_bounded():
    """Group [-113, 120] with s1 = 1: s2 = 16, z = 7, and the naive code 15 for 120 would give 128."""
    spec = group_spec(128, protect=127)
    q = quantized(worst_case_weight(), spec)
    qp = q.qparams
    assert float(qp.s1[0, 0]) == 1.0
    assert float(qp.s2[0, 0]) == 16 and int(qp.zero[0, 0]) + 8 == 7
    assert int(qp.code_hi[0, 0]) + 8 == 14
    assert int(q.codes[0, :128].max()) + 8 == 14  # 120 -> 14, i.e. (14 - 7) * 16 = 112, not 128
    # forcing the naive code makes the export refuse rather than write a checkpoint the kernel would wrap
    codes = q.codes.clone()
    codes[0, 127] = 15 - 8
    with pytest.raises(ExportError, match="outside INT8"):
        make_packer().pack(QuantizedLinear(codes, qp, spec))


# ---------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("shape", [(48, 256), (64, 80), (100, 100)])
def test_check_rejects_shapes_off_the_tiles(spec, shape):
    with pytest.raises(ExportError) as exc:
        make_packer().check(MODULE, spec, shape)
    msg = str(exc.value)
    assert MODULE in msg and f"N={shape[0]}" in msg and f"K={shape[1]}" in msg
    assert "--set export.format=quantkit" in msg


def test_check_group_must_divide_k():
    packer = make_packer()
    with pytest.raises(ExportError, match=f"{MODULE}: group size 128 does not divide input width 96"):
        packer.check(MODULE, group_spec(128), (64, 96))
    packer.check(MODULE, group_spec(32), (64, 96))
    packer.check(MODULE, CHANNEL, (64, 96))


@pytest.mark.parametrize("spec", [
    QuantSpec(bits=4, symmetric=True, granularity="channel"),
    QuantSpec(bits=4, symmetric=True, granularity="group", group_size=128),
    QuantSpec(bits=4, symmetric=False, granularity="channel"),  # integer zero: QServe stores the scaled zero
    QuantSpec(bits=4, symmetric=False, granularity="group", group_size=128),  # not progressive
    QuantSpec(bits=4, symmetric=False, granularity="channel", progressive=True),
    QuantSpec(bits=8, symmetric=False, granularity="channel", zero_form="scaled"),
    QuantSpec(bits=3, symmetric=False, granularity="group", group_size=128, progressive=True),
], ids=["sym-channel", "sym-group", "int-zero-channel", "plain-group", "progressive-channel", "8bit", "3bit"])
def test_check_rejects_specs_qserve_cannot_store(spec):
    with pytest.raises(ExportError, match=f"{MODULE}: qserve stores 4-bit asymmetric weights"):
        make_packer().check(MODULE, spec, (64, 256))


def test_protective_range_above_119_is_refused():
    """P = 127 can give scaled zeros z*s2 > 128, which int8 s2_zeros cannot hold: check refuses it up front, and
    pack refuses a concrete case rather than writing a wrapped zero."""
    spec = group_spec(64, protect=127)
    with pytest.raises(ExportError, match=f"{MODULE}: qserve needs protective_range <= 119"):
        make_packer().check(MODULE, spec, (64, 256))
    w = torch.zeros(32, 128)
    w[0, :64] = torch.linspace(-126, 24, 64)  # s1 = 1 (row max 127), s2 = round(150/15) = 10, z = round(12.6) = 13
    w[0, 64] = 127
    q = quantized(w, spec)
    assert float(q.qparams.s1[0, 0]) == 1 and float(q.qparams.s2[0, 0]) == 10 and int(q.qparams.zero[0, 0]) + 8 == 13
    with pytest.raises(ExportError, match="must fit int8"):
        make_packer().pack(q)


@pytest.mark.parametrize("fmt,recipe", [("qserve", "qoq"), ("qqq", "qqq")])
@pytest.mark.parametrize("overrides,match", [
    (["targets=[qkv, o, gate_up]"], "leaves down unquantized"),  # the engines build every linear as a W4A8 one
    (["activations=null"], "has no activation quantization"),
    (["activations.clip_ratio=0.9"], "has clip_ratio 0.9"),
    (["activations.group_size=64"], "has groups of 64"),
    (["activations.bits=6", "activations.symmetric=false"], "has bits 6, asymmetric ones"),
])
def test_w4a8_engine_formats_refuse_what_their_engines_would_not_compute(fmt, recipe, overrides, match):
    """OmniServe, SGLang's qoq, vLLM's and GPTQModel's qqq quantize every linear, each input per token to symmetric
    INT8: a recipe that leaves a role in floating point, or simulates other activations, would be served other
    numbers than `quantkit eval` measured (or not load), so its export is refused before any work."""
    get_packer(fmt)(load_recipe(recipe), torch.float16).check_recipe()
    with pytest.raises(ExportError, match=match):
        get_packer(fmt)(load_recipe(recipe, overrides), torch.float16).check_recipe()


@pytest.mark.parametrize("overrides,match", [
    (["kv_cache.rope=pre"], "has keys quantized before RoPE"),
    (["kv_cache.bits=6"], "has bits 6"),
    (["kv_cache.symmetric=true", "kv_cache.bits=2"], "has bits 2, symmetric ones"),
])
def test_qserve_refuses_a_kv_cache_its_engines_do_not_run(overrides, match):
    """OmniServe quantizes the KV cache per (token, head) to asymmetric 4 or 8 bits after RoPE and SGLang keeps it in
    floating point: a recipe simulating another KV cache would have eval measure what no engine serves, so its export
    is refused (it had been accepted silently). KV8 and none pass; none is noted, as OmniServe quantizes it anyway."""
    with pytest.raises(ExportError, match=match):
        QServePacker(load_recipe("qoq", overrides), torch.float16).check_recipe()
    for ok in (["kv_cache.bits=8"], ["kv_cache=null"], []):
        packer = QServePacker(load_recipe("qoq", ok), torch.float16)
        packer.check_recipe()
        noted = any(n.startswith("kv cache: the recipe simulates none") for n in packer.notes({"o": group_spec(128)}))
        assert noted == (ok == ["kv_cache=null"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_recipe_needs_fp16(dtype):
    with pytest.raises(ExportError, match="must be float16"):
        make_packer(dtype).check_recipe()
    make_packer(torch.float16).check_recipe()


def test_pack_rejects_g_idx():
    q = quantized(random_weight(32, 256, seed=4), group_spec(128))
    q.g_idx = torch.arange(256) // 128
    with pytest.raises(ExportError, match="g_idx"):
        make_packer().pack(q)


def test_pack_refuses_missing_variant_fields():
    """A linear that lost its variant fields (e.g. a device move that copies only scale and zero) must not export."""
    for spec, missing in ((CHANNEL, "szero"), (group_spec(128), "s1")):
        q = quantized(random_weight(32, 256, seed=5), spec)
        qp = q.qparams.map(lambda f, t, missing=missing: None if f == missing else t)
        with pytest.raises(ExportError, match="lacks"):
            make_packer().pack(QuantizedLinear(q.codes, qp, spec))


@pytest.mark.parametrize("spec", [CHANNEL, group_spec(128)], ids=["scaled", "progressive"])
def test_compressed_tensors_refuses_variant_specs(spec):
    packer = CompressedTensorsPacker(load_recipe("rtn-w4a16-g128"), torch.float16)
    with pytest.raises(ExportError, match=f"{MODULE}: compressed-tensors cannot express.*export.format=qserve"):
        packer.check(MODULE, spec, (64, 256))


# ---------------------------------------------------------------------------------------------------- config, notes


@pytest.mark.parametrize(("spec", "size"), [(CHANNEL, -1), (group_spec(128), 128), (group_spec(64), 64)])
def test_quantization_config(spec, size):
    packer = make_packer()
    specs = dict.fromkeys(("qkv", "o", "gate_up", "down"), spec)
    assert packer.quantization_config(specs) == {"quant_method": "qoq", "wbits": 4, "group_size": size}
    simulation = [n for n in packer.notes(specs) if "simulation only" in n]
    if size == 64:
        assert simulation == ["group size 64: no engine loads it (QServe kernels take -1 or 128); simulation only"]
    else:
        assert simulation == []


@pytest.mark.parametrize("spec", [CHANNEL, group_spec(128)], ids=["channel", "g128"])
def test_notes_name_shapes_the_engines_kernels_cannot_tile(spec):
    """quantkit's kernels take 32-multiples, the engines' QServe kernels tile N and K by 128 without bounds checks
    (digest-qserve §6.19): such linears export, and the manifest says no engine runs them."""
    packer = make_packer()
    specs = dict.fromkeys(("qkv", "o", "gate_up", "down"), spec)
    for layer in range(2):
        packer.check(f"model.layers.{layer}.mlp.down_proj", spec, (256, 512))
    assert not [n for n in packer.notes(specs) if "multiple of 128" in n]
    for layer in range(2):
        packer.check(f"model.layers.{layer}.self_attn.k_proj", spec, (192, 256))
        packer.check(f"model.layers.{layer}.mlp.gate_proj", spec, (160, 256))
    (note,) = [n for n in packer.notes(specs) if "multiple of 128" in n]
    assert note.startswith("4 linears have N or K not a multiple of 128 ([N, K] = [160, 256], [192, 256]): ")
    assert "cannot run them" in note


def test_quantization_config_rejects_mixed_variants():
    with pytest.raises(ExportError, match="one weight variant"):
        make_packer().quantization_config({"qkv": CHANNEL, "down": group_spec(128)})


def test_owns_and_registration():
    packer = make_packer()
    for key in ("qweight", "s1_scales", "s1_szeros", "s2_scales", "s2_zeros"):
        assert packer.owns(key)
    for key in ("bias", "weight", "weight_packed", "qweight.x"):
        assert not packer.owns(key)
    ct = CompressedTensorsPacker(load_recipe("rtn-w4a16-g128"), torch.float16)
    assert ct.owns("weight_packed") and ct.owns("weight_scale") and not ct.owns("bias")
    assert ct.notes({"down": QuantSpec()}) == []
    assert get_packer("qserve") is QServePacker


@pytest.mark.parametrize(("recipe", "overrides", "warned"), [
    ("qoq-g128", [], False),  # fold_norms, then smoothing of the o and down inputs only: every norm is one
    ("qoq-g128", ["passes.smooth.targets=[qkv, o, down]"], True),  # the q/k/v input's smoothing divides a norm
    ("rtn-w4a16-g128", [], True),  # norms as the checkpoint has them
])
def test_omniserve_norm_note_only_where_norms_are_not_ones(recipe, overrides, warned):
    """OmniServe's loader takes every norm as ones: the manifest says so only where the recipe leaves other norms."""
    packer = QServePacker(load_recipe(recipe, overrides), torch.float16)
    notes = packer.notes(dict.fromkeys(("qkv", "o", "gate_up", "down"), group_spec(128)))
    assert any("ignores every '*norm*' tensor" in n for n in notes) == warned


def test_unpack_code_bounds_keep_every_code_in_int8():
    """For every storable (s2, z_u) (z_u * s2 <= 128), unpack's per-group code bounds are the smallest and largest
    UINT4 codes u with (u - z_u) * s2 in [-128, 127], found here by trying all 16 codes (e.g. s2 = 16, z_u = 8:
    u = 0 gives -128, so the lowest signed code is -8)."""
    pairs = [(s2, z) for s2 in range(1, 128) for z in range(16) if z * s2 <= 128]
    n = -(-len(pairs) // 32) * 32
    pairs += [(1, 0)] * (n - len(pairs))
    s2 = torch.tensor([[p[0]] for p in pairs])
    zero = torch.tensor([[p[1]] for p in pairs])
    s2_scales, s2_zeros = pack_group_params(s2, zero)
    tensors = {"qweight": pack_qweight(torch.zeros(n, 32, dtype=torch.uint8)), "s1_scales": torch.ones(n).half(),
               "s2_scales": s2_scales, "s2_zeros": s2_zeros}
    qp = make_packer().unpack(tensors, group_spec(32)).qparams
    for i, (s, z) in enumerate(pairs):
        fits = [u for u in range(16) if -128 <= (u - z) * s <= 127]
        assert (int(qp.code_lo[i, 0]), int(qp.code_hi[i, 0])) == (min(fits) - 8, max(fits) - 8), (s, z)
        assert int(qp.zero[i, 0]) == z - 8 and float(qp.s2[i, 0]) == s


def test_unpack_refuses_s2_zeros_that_are_no_multiple_of_s2():
    """A damaged s2_zeros (-7 beside s2 = 3) names no integer zero: unpack refuses it rather than flooring."""
    s2_scales, s2_zeros = pack_group_params(torch.full((32, 1), 3), torch.full((32, 1), 2))
    assert int(s2_zeros[0, 0]) == -6
    s2_zeros[0, 0] = -7
    tensors = {"qweight": pack_qweight(torch.zeros(32, 32, dtype=torch.uint8)), "s1_scales": torch.ones(32).half(),
               "s2_scales": s2_scales, "s2_zeros": s2_zeros}
    with pytest.raises(ExportError, match="negated multiple"):
        make_packer().unpack(tensors, group_spec(32))


def test_per_channel_unpack_recovers_the_zero_only_when_szero_is_a_multiple():
    """Scale 0.5 with szero 1.5 = 3 * 0.5 gives z_u = 3 (signed -5); szero 0.75 is no multiple of 0.5, so no integer
    zero is claimed, and the weights still dequantize through szero: w = q_u * 0.5 - 0.75."""
    codes = torch.arange(32 * 32).reshape(32, 32) % 16
    for szero, zero in ((1.5, -5), (0.75, None)):
        tensors = {"qweight": pack_qweight(codes), "s1_scales": torch.full((32,), 0.5).half(),
                   "s1_szeros": torch.full((32,), szero).half()}
        back = make_packer().unpack(tensors, CHANNEL)
        if zero is None:
            assert back.qparams.zero is None
        else:
            assert torch.equal(back.qparams.zero, torch.full((32, 1), zero, dtype=torch.int32))
        assert torch.equal(back.dequantize(), codes.float() * 0.5 - szero)


def test_pack_refuses_a_scale_other_than_s1_times_s2():
    """The progressive export stores s1 and s2 only: a scale that is not their exact product cannot be stored."""
    q = quantized(random_weight(32, 256, seed=6), group_spec(128))
    scale = q.qparams.scale.clone()
    scale[0, 0] *= 1.5
    qp = q.qparams.map(lambda f, t: scale if f == "scale" else t)
    with pytest.raises(ExportError, match=r"s1 \* s2"):
        make_packer().pack(QuantizedLinear(q.codes, qp, q.spec))


def test_check_refuses_protective_range_from_120():
    """119 is the largest protective range whose scaled zeros always fit int8: 119 passes, 120 is refused."""
    packer = make_packer()
    packer.check(MODULE, group_spec(128, protect=119), (64, 256))
    with pytest.raises(ExportError, match="protective_range <= 119"):
        packer.check(MODULE, group_spec(128, protect=120), (64, 256))


def test_pack_refuses_codes_outside_signed_int4():
    """A signed code 8 (UINT4 16) cannot be stored: the packer says so as an ExportError, not a layout ValueError."""
    q = quantized(random_weight(32, 128, seed=8), CHANNEL)
    codes = q.codes.clone()
    codes[0, 0] = 8
    with pytest.raises(ExportError, match=r"\[-8, 7\]"):
        make_packer().pack(QuantizedLinear(codes, q.qparams, CHANNEL))


def test_notes_name_linears_whose_k_is_off_the_engine_tile():
    """The engines' QServe kernels step K by CTA_K (up to 128) as well as N (digest-qserve §3.2, §6.19): N = 256 fits,
    K = 160 does not, so the linear exports but the manifest says no engine runs it."""
    packer = make_packer()
    packer.check(MODULE, CHANNEL, (256, 160))
    (note,) = [n for n in packer.notes({"down": CHANNEL}) if "multiple of 128" in n]
    assert note.startswith("1 linears have N or K not a multiple of 128 ([N, K] = [256, 160]): ")


@pytest.mark.parametrize("field", ["scale", "szero"])
def test_pack_refuses_per_channel_scales_that_are_not_fp16(field):
    """s1_scales and s1_szeros are fp16 on disk (formats.md): 1 + 2^-12 is no fp16 value, so the export refuses it
    rather than round it into a checkpoint that dequantizes to other weights than quantkit measured."""
    q = quantized(random_weight(32, 128, seed=12), CHANNEL)
    value = getattr(q.qparams, field).clone()
    value[0, 0] = 1 + 2**-12
    qp = q.qparams.map(lambda f, t: value if f == field else t)
    with pytest.raises(ExportError, match="not float16 values"):
        make_packer().pack(QuantizedLinear(q.codes, qp, CHANNEL))


def test_pack_refuses_a_level1_scale_that_is_not_fp16():
    """The progressive s1_scales is fp16 too: s1 = 1 + 2^-12 (with scale = s1 * s2 kept exact) is refused."""
    q = quantized(random_weight(32, 256, seed=13), group_spec(128))
    s1 = q.qparams.s1.clone()
    s1[0, 0] = 1 + 2**-12
    scale = s1 * q.qparams.s2
    qp = q.qparams.map(lambda f, t: s1 if f == "s1" else scale if f == "scale" else t)
    with pytest.raises(ExportError, match="not float16 values"):
        make_packer().pack(QuantizedLinear(q.codes, qp, q.spec))
