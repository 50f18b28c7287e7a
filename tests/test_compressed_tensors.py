"""The compressed-tensors packer: bit-exact against the library's own packing and a hand-worked word."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.formats.base import ExportError
from quantkit.formats.compressed_tensors import CompressedTensorsPacker, pack_int32, unpack_int32
from quantkit.quantizers import QuantizedLinear, QuantSpec, compute_qparams, quantize
from quantkit.recipe import load_recipe


def test_pack_hand_worked_word():
    # codes 0..7 -> stored +8 -> nibbles 8..15, low nibble first: 0xFEDCBA98
    codes = torch.arange(8, dtype=torch.int8).reshape(1, 8)
    packed = pack_int32(codes, 4)
    assert packed.shape == (1, 1)
    assert packed.item() == torch.tensor(0xFEDCBA98, dtype=torch.int64).to(torch.int32).item()
    assert torch.equal(unpack_int32(packed, 4, 8), codes)


@settings(max_examples=30, deadline=None)
@given(bits=st.integers(2, 7), rows=st.integers(1, 9), cols=st.integers(1, 70), dim=st.sampled_from([0, 1]),
       seed=st.integers(0, 1000))
def test_pack_matches_compressed_tensors(bits, rows, cols, dim, seed):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (rows, cols), generator=g, dtype=torch.int8)
    ours = pack_int32(codes, bits, dim)
    assert torch.equal(ours, helpers.pack_to_int32(codes, bits, dim))
    assert torch.equal(unpack_int32(ours, bits, codes.shape[dim], dim), codes)


def test_pack_rejects_out_of_range_codes():
    with pytest.raises(ValueError, match="out of range"):
        pack_int32(torch.tensor([[8]], dtype=torch.int8), 4)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity", ["group", "channel"])
@pytest.mark.parametrize("bits", [4, 8, 3])
def test_linear_round_trip_and_library_dequant(symmetric, granularity, bits):
    torch.manual_seed(0)
    w = torch.randn(24, 128)
    spec = QuantSpec(bits=bits, symmetric=symmetric, granularity=granularity, group_size=32)
    qp = compute_qparams(w, spec)
    q = QuantizedLinear(quantize(w, qp, spec), qp, spec)
    packer = CompressedTensorsPacker(load_recipe("rtn-w4a16-g128"), torch.float16)  # weights alone: all packed
    tensors = packer.pack(q)
    back = packer.unpack(tensors, spec)
    assert torch.equal(back.codes, q.codes)
    assert torch.equal(back.dequantize(), q.dequantize())
    assert tensors["weight_scale"].dtype == torch.float16
    assert tensors["weight_packed"].dtype == torch.int32 and "weight" not in tensors
    assert tensors["weight_packed"].shape == (24, 128 * bits // 32)
    if not symmetric:
        assert tensors["weight_zero_point"].shape == (-(-24 * bits // 32), qp.scale.shape[1])
    # the library's own unpacker must read our codes identically
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    lib = helpers.unpack_from_int32(tensors["weight_packed"], bits, torch.Size([24, 128]))
    assert torch.equal(lib, q.codes)


@pytest.mark.parametrize("activations,fmt", [(["activations=null"], "pack-quantized"), ([], "int-quantized")])
def test_eight_bit_weights_are_int_quantized_only_beside_quantized_activations(activations, fmt):
    """vLLM and SGLang assert that an `int-quantized` model quantizes its activations: W8A16 is `pack-quantized`
    (four codes a word), W8A8 `int-quantized` (int8 `weight`); the library decompresses either to our weights."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    recipe = load_recipe("rtn-w8a8", activations)
    spec = recipe.weights.spec()
    torch.manual_seed(2)
    w = torch.randn(32, 64)
    qp = compute_qparams(w, spec)
    q = QuantizedLinear(quantize(w, qp, spec), qp, spec)
    packer = CompressedTensorsPacker(recipe, torch.float16)
    config = packer.quantization_config({role: spec for role in ("qkv", "o", "gate_up", "down")})
    QuantizationConfig.model_validate(config)
    assert config["format"] == fmt and (config["config_groups"]["group_0"]["input_activations"] is None) == (
        fmt == "pack-quantized")
    tensors = packer.pack(q)
    assert ("weight_packed" in tensors) == (fmt == "pack-quantized")
    assert tensors.get("weight", tensors.get("weight_packed")).dtype == (torch.int32 if fmt == "pack-quantized"
                                                                          else torch.int8)
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    library = PackedQuantizationCompressor if fmt == "pack-quantized" else IntQuantizationCompressor
    assert torch.equal(library.decompress(tensors, scheme)["weight"], q.dequantize().half())


def test_untargeted_linears_are_ignored():
    """Every linear must be targeted or ignored, or vLLM and SGLang find no scheme for it: the roles a recipe leaves
    in floating point go into `ignore`, and compressed-tensors validates the config."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    recipe = load_recipe("rtn-w4a16-g128", ["targets=[qkv, o]"])
    spec = recipe.weights.spec()
    config = CompressedTensorsPacker(recipe, torch.float16).quantization_config({"qkv": spec, "o": spec})
    QuantizationConfig.model_validate(config)
    assert config["ignore"] == ["lm_head", r"re:.*mlp\.(gate|up)_proj$", r"re:.*mlp\.down_proj$"]
    targeted = [t for g in config["config_groups"].values() for t in g["targets"]]
    assert targeted == [r"re:.*self_attn\.(q|k|v)_proj$", r"re:.*self_attn\.o_proj$"]


@pytest.mark.parametrize(("recipe", "overrides", "note"), [
    ("rtn-w4a16-g128", [], None),
    ("rtn-w8a8", [], None),
    ("rtn-w4a16-g128", ["weights.bits=8"], None),
    ("rtn-w4a16-g128", ["weights.symmetric=false"], "W4A16, asymmetric weights per group: vLLM runs it with zero"),
    ("rtn-w4a16-g128", ["weights.bits=3"], "W3A16, symmetric weights per group: only vLLM's newer WNAM schemes"),
    ("rtn-w4a16-g128", ["weights.granularity=tensor"], "W4A16, symmetric weights per tensor: vLLM's WNA16 and SGLang "
                                                       "take weights per channel or group: neither runs it"),
    ("rtn-w8a8", ["weights.bits=4"], "W4A8, symmetric weights per channel: only newer vLLM runs it (WNA8Int)"),
    ("rtn-w8a8", ["weights.symmetric=false"], "W8A8, asymmetric weights per channel: vLLM's and SGLang's W8A8 INT8"),
    ("rtn-w8a8", ["weights.bits=4", "activations.bits=4"], "W4A4, symmetric weights per channel: vLLM's and SGLang's "
                                                           "integer schemes take INT8 activations only"),
    ("rtn-w8a8", ["kv_cache={bits: 4, symmetric: false, granularity: head}"], "KV cache quantization is simulated"),
    ("rtn-w8a8", ["activations.symmetric=false"], "W8A8, symmetric weights per channel, asymmetric activations: "
                                                  "vLLM's W8A8 INT8 scheme runs it"),
])
def test_notes_name_who_runs_each_scheme(recipe, overrides, note):
    """The summary and manifest say which engines run a scheme where vLLM and SGLang do not both run it (the
    README's matrix), once per scheme, and nothing for the schemes both run."""
    loaded = load_recipe(recipe, overrides)
    spec = loaded.weights.spec()
    notes = CompressedTensorsPacker(loaded, torch.float16).notes({role: spec for role in ("qkv", "o", "down")})
    if note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and note in notes[0], notes


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity", ["group", "channel"])
def test_library_decompressor_reads_our_tensors_exactly(symmetric, granularity):
    """compressed-tensors' own PackedQuantizationCompressor dequantizes our tensors to our weights, bit for bit.

    (transformers 5.23 and 5.24 cannot load asymmetric pack-quantized checkpoints at all, llm-compressor#1618, so the
    library's decompressor is the conformance check for the asymmetric case.)
    """
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    torch.manual_seed(1)
    w = torch.randn(40, 256)
    spec = QuantSpec(bits=4, symmetric=symmetric, granularity=granularity, group_size=64)
    qp = compute_qparams(w, spec)
    q = QuantizedLinear(quantize(w, qp, spec), qp, spec)
    recipe = load_recipe("rtn-w4a16-g128", [f"weights.symmetric={str(symmetric).lower()}",
                                            f"weights.granularity={granularity}", "weights.group_size=64"])
    packer = CompressedTensorsPacker(recipe, torch.float16)
    group = packer.quantization_config({role: spec for role in ("qkv", "o", "gate_up", "down")})
    scheme = QuantizationScheme.model_validate(group["config_groups"]["group_0"])
    out = PackedQuantizationCompressor.decompress(packer.pack(q), scheme)
    assert ct is not None and torch.equal(out["weight"], q.dequantize().half())


@pytest.mark.parametrize("chunk", [1, 37, 1 << 20])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_in_row_slices_equals_library(chunk, dim):
    """Packing works through slices of rows to bound memory; the words must not depend on the slicing."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    import quantkit.formats.compressed_tensors as ct

    codes = torch.randint(-8, 8, (23, 97), generator=torch.Generator().manual_seed(chunk), dtype=torch.int8)
    previous, ct._CHUNK = ct._CHUNK, chunk
    try:
        ours = pack_int32(codes, 4, dim)
        assert torch.equal(ours, helpers.pack_to_int32(codes, 4, dim))
        assert torch.equal(unpack_int32(ours, 4, codes.shape[dim], dim), codes)
    finally:
        ct._CHUNK = previous


def test_per_tensor_scale_and_int_quantized_zero_point_shapes():
    """compressed-tensors' tensor strategy stores weight_scale as [1]; an int-quantized (W8A8) asymmetric zero point
    has the scale's shape [N, 1], as the library's observers make them, and is stored unpacked as int8, the zp_dtype
    compressed-tensors' QuantizationArgs gives 8-bit integer weights (only pack-quantized zero points are int32
    words)."""
    torch.manual_seed(3)
    w = torch.randn(16, 64)
    spec = QuantSpec(bits=4, symmetric=True, granularity="tensor")
    qp = compute_qparams(w, spec)
    tensors = CompressedTensorsPacker(load_recipe("rtn-w4a16-g128"), torch.float16).pack(
        QuantizedLinear(quantize(w, qp, spec), qp, spec))
    assert tensors["weight_scale"].shape == (1,)
    spec = QuantSpec(bits=8, symmetric=False, granularity="channel")
    qp = compute_qparams(w, spec)
    tensors = CompressedTensorsPacker(load_recipe("rtn-w8a8"), torch.float16).pack(
        QuantizedLinear(quantize(w, qp, spec), qp, spec))
    assert tensors["weight"].dtype == torch.int8
    assert tensors["weight_zero_point"].shape == tensors["weight_scale"].shape == (16, 1)
    assert tensors["weight_zero_point"].dtype == torch.int8
    assert torch.equal(tensors["weight_zero_point"].int(), qp.zero.int())


def test_check_group_must_divide_k_and_actorder_only_for_groups():
    """A group size that does not divide K is refused up front; the config's actorder belongs to group strategies
    only (compressed-tensors rejects actorder on channel weights)."""
    packer = CompressedTensorsPacker(load_recipe("gptq-w4a16-g128"), torch.float16)
    with pytest.raises(ExportError, match="group size 128 does not divide input width 96"):
        packer.check("mlp.down_proj", QuantSpec(bits=4, group_size=128), (64, 96))
    roles = ("qkv", "o", "gate_up", "down")
    group = packer.quantization_config(dict.fromkeys(roles, QuantSpec(bits=4, group_size=128)))
    assert group["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    channel = packer.quantization_config(dict.fromkeys(roles, QuantSpec(bits=4, granularity="channel")))
    assert channel["config_groups"]["group_0"]["weights"]["actorder"] is None


def test_asymmetric_codes_equal_the_librarys_on_ties():
    """compressed-tensors quantizes round(w / s + z) with ties to even; a row of half-steps (w / s = k + 0.5 for
    every odd w) gets the library's codes exactly, where round(w / s) + z differs on each tie."""
    pytest.importorskip("compressed_tensors")  # as the file's other tests: the [eval] and [dev] extras hold it
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize as library_quantize

    w = torch.zeros(4, 16)
    w[:, 0], w[:, 1] = -2.0, 28.0  # scale 2, zero -7: every odd w lands on a tie
    w[:, 2:] = torch.arange(14).float() / 2 + torch.arange(4)[:, None]
    spec = QuantSpec(bits=4, symmetric=False, granularity="channel")
    qp = compute_qparams(w, spec)
    assert torch.equal(qp.scale.float(), torch.full((4, 1), 2.0))
    library = library_quantize(w, qp.scale.float(), qp.zero.to(torch.int8),
                               QuantizationArgs(num_bits=4, symmetric=False, strategy="channel"))
    assert torch.equal(quantize(w, qp, spec), library.to(torch.int8))


def test_config_targets_linear_and_leaves_the_kv_cache_alone():
    """formats.md: one config group over every role targets [Linear], with status "compressed"; kv_cache_scheme stays
    null, since compressed-tensors reads any mapping there as the KV cache's QuantizationArgs (an empty one is INT8
    per tensor) and engines would quantize the cache."""
    recipe = load_recipe("rtn-w4a16-g128")
    spec = recipe.weights.spec()
    config = CompressedTensorsPacker(recipe, torch.float16).quantization_config(
        dict.fromkeys(("qkv", "o", "gate_up", "down"), spec))
    assert config["kv_cache_scheme"] is None
    assert config["quantization_status"] == "compressed"
    assert [g["targets"] for g in config["config_groups"].values()] == [["Linear"]]
    assert config["ignore"] == ["lm_head"]


@pytest.mark.parametrize("symmetric", [True, False])
def test_input_activations_entry_is_what_the_recipe_simulates(symmetric):
    """formats.md's input_activations: {num_bits: 8, type: int, symmetric, strategy: token, dynamic: true}. The
    symmetric flag must be the recipe's: vLLM's W8A8 INT8 scheme adds a per-token zero point only when it is false."""
    recipe = load_recipe("rtn-w8a8", [] if symmetric else ["activations.symmetric=false"])
    spec = recipe.weights.spec()
    config = CompressedTensorsPacker(recipe, torch.float16).quantization_config(
        dict.fromkeys(("qkv", "o", "gate_up", "down"), spec))
    act = config["config_groups"]["group_0"]["input_activations"]
    assert {k: act[k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == {
        "num_bits": 8, "type": "int", "symmetric": symmetric, "strategy": "token", "dynamic": True}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pack_refuses_scales_the_model_dtype_would_round(dtype):
    """weight_scale is stored in the model's dtype: a scale that is no value of it (1 + 2^-12 is neither float16 nor
    bfloat16) is refused, as every other packer refuses, rather than rounded into weights quantkit never measured.
    Scales of that dtype pass unchanged."""
    torch.manual_seed(5)
    w = torch.randn(16, 128)
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=64)
    qp = compute_qparams(w, spec, scale_dtype=dtype)
    packer = CompressedTensorsPacker(load_recipe("rtn-w4a16-g128"), dtype)
    stored = packer.pack(QuantizedLinear(quantize(w, qp, spec), qp, spec))["weight_scale"]
    assert stored.dtype == dtype and torch.equal(stored.float(), qp.scale.float())
    scale = qp.scale.clone()
    scale[3, 1] = 1 + 2**-12
    qp = qp.map(lambda f, t: scale if f == "scale" else t)
    with pytest.raises(ExportError, match=f"weight_scale in {str(dtype)[6:]}, but the quantizer's values are not"):
        packer.pack(QuantizedLinear(quantize(w, qp, spec), qp, spec))
