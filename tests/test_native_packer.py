"""The quantkit (native) packer: stores exactly what the quantizer computed, for every spec and shape."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.formats import get_packer
from quantkit.formats.base import ExportError
from quantkit.formats.native import NativePacker
from quantkit.quantizers import QParams, QuantizedLinear, QuantSpec, compute_qparams, quantize, search_qparams
from quantkit.recipe import load_recipe

SPECS = {
    "sym-group": QuantSpec(bits=4, symmetric=True, granularity="group", group_size=32),
    "asym-channel": QuantSpec(bits=4, symmetric=False, granularity="channel"),
    "sym-tensor": QuantSpec(bits=8, symmetric=True, granularity="tensor"),
    "asym-3bit-group": QuantSpec(bits=3, symmetric=False, granularity="group", group_size=16),
    "2bit-channel": QuantSpec(bits=2, symmetric=False, granularity="channel"),
    "scaled-channel": QuantSpec(bits=4, symmetric=False, granularity="channel", zero_form="scaled"),
    "progressive-g128": QuantSpec(bits=4, symmetric=False, granularity="group", group_size=128, progressive=True),
    "progressive-g64": QuantSpec(bits=4, symmetric=False, granularity="group", group_size=64, progressive=True),
    "progressive-channel": QuantSpec(bits=4, symmetric=False, granularity="channel", progressive=True),
}


def make_packer(dtype: torch.dtype = torch.float32) -> NativePacker:
    return NativePacker(load_recipe("rtn-w4a16-g128"), dtype)


def quantized(w: torch.Tensor, spec: QuantSpec, search: bool = False) -> QuantizedLinear:
    qp = (search_qparams if search else compute_qparams)(w, spec)
    return QuantizedLinear(quantize(w, qp, spec), qp, spec)


def assert_identical(back: QuantizedLinear, q: QuantizedLinear) -> None:
    """Every tensor (with its dtype) and scalar of the linear is equal, and so is its dequantization."""
    assert back.codes.dtype == q.codes.dtype and torch.equal(back.codes, q.codes)
    for field in QParams.TENSORS:
        a, b = getattr(back.qparams, field), getattr(q.qparams, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), field
    assert (back.qparams.group_size, back.qparams.protect, back.qparams.code_offset) == (
        q.qparams.group_size, q.qparams.protect, q.qparams.code_offset)
    assert (back.g_idx is None) == (q.g_idx is None)
    if q.g_idx is not None:
        assert back.g_idx.dtype == q.g_idx.dtype and torch.equal(back.g_idx, q.g_idx)
    assert torch.equal(back.dequantize(), q.dequantize())


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("search", [False, True], ids=["rtn", "clip-search"])
def test_round_trip_every_spec(name, search, tmp_path):
    spec = SPECS[name]
    torch.manual_seed(0)
    w = torch.randn(40, 256) * torch.rand(40, 1) * 3
    w[0] = 0
    q = quantized(w, spec, search)
    packer = make_packer()
    tensors = packer.pack(q)
    expected = {"weight_codes", "weight_meta"} | {
        f"weight_{f}" for f in QParams.TENSORS if getattr(q.qparams, f) is not None}
    assert set(tensors) == expected
    assert all(packer.owns(k) for k in tensors)
    assert tensors["weight_codes"].dtype == torch.int8 and tensors["weight_codes"].shape == (40, 256)
    assert tensors["weight_scale"].dtype == torch.float32
    assert tensors["weight_meta"].dtype == torch.int64 and tensors["weight_meta"].shape == (4,)
    assert_identical(packer.unpack(tensors, spec), q)
    save_file(tensors, tmp_path / "shard.safetensors")
    assert_identical(packer.unpack(load_file(tmp_path / "shard.safetensors"), spec), q)


def test_meta_values():
    spec = SPECS["progressive-g64"]
    q = quantized(torch.randn(32, 128), spec)
    assert make_packer().pack(q)["weight_meta"].tolist() == [1, 64, 119, 0]
    spec = SPECS["scaled-channel"]
    q = quantized(torch.randn(32, 128), spec)
    assert make_packer().pack(q)["weight_meta"].tolist() == [1, 128, -1, 8]


def test_round_trip_with_g_idx():
    spec = SPECS["asym-3bit-group"]
    torch.manual_seed(1)
    w = torch.randn(8, 64)
    g_idx = torch.randperm(64) // 16
    qp = compute_qparams(w, spec)
    q = QuantizedLinear(quantize(w, qp, spec, g_idx), qp, spec, g_idx)
    tensors = make_packer().pack(q)
    assert torch.equal(tensors["weight_g_idx"], g_idx)
    assert_identical(make_packer().unpack(tensors, spec), q)


def test_odd_shapes_and_any_spec_are_accepted():
    packer = make_packer(torch.bfloat16)
    packer.check_recipe()
    for spec in SPECS.values():
        packer.check("model.layers.0.mlp.down_proj", spec, (5, 7))
    spec = QuantSpec(bits=4, symmetric=False, granularity="channel", zero_form="scaled")
    q = quantized(torch.randn(5, 7), spec)
    assert_identical(packer.unpack(packer.pack(q), spec), q)


def test_packed_tensors_are_independent_copies():
    q = quantized(torch.randn(32, 64), SPECS["progressive-g64"])
    tensors = make_packer().pack(q)
    tensors["weight_codes"].zero_()
    tensors["weight_s2"].zero_()
    assert int(q.codes.abs().sum()) > 0 and int(q.qparams.s2.min()) >= 1


def test_pack_refuses_missing_variant_fields():
    for name, missing in (("progressive-g128", "s1"), ("scaled-channel", "szero")):
        spec = SPECS[name]
        q = quantized(torch.randn(32, 128), spec)
        qp = q.qparams.map(lambda f, t, missing=missing: None if f == missing else t)
        with pytest.raises(ExportError, match="lacks"):
            make_packer().pack(QuantizedLinear(q.codes, qp, spec))


def test_unpack_rejects_unknown_meta():
    spec = SPECS["sym-group"]
    tensors = make_packer().pack(quantized(torch.randn(4, 64), spec))
    tensors["weight_meta"][0] = 2
    with pytest.raises(ExportError, match="unknown weight_meta"):
        make_packer().unpack(tensors, spec)


def test_config_notes_and_registration():
    packer = make_packer()
    specs = {"qkv": SPECS["sym-group"], "down": SPECS["progressive-g128"]}
    assert packer.quantization_config(specs) == {
        "quant_method": "quantkit", "note": "simulation artifact; no inference engine loads it"}
    notes = packer.notes(specs)
    assert len(notes) == 1 and "no inference engine loads it" in notes[0]
    assert get_packer("quantkit") is NativePacker
    assert not packer.owns("bias")
