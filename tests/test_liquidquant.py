"""LiquidQuant: two-level quantization with an integer step and offset, and the kernel's IMAD + XOR lanes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import cli_ok

from quantkit.eval.loading import load_for_eval
from quantkit.formats.base import ExportError
from quantkit.formats.liquidquant import (
    COLS,
    ROWS,
    LiquidQuantPacker,
    lane_dequant,
    pack_codes,
    pack_register,
    register_rows,
    registers,
    unpack_codes,
)
from quantkit.quantizers import QuantizedLinear, QuantSpec, compute_qparams, dequantize, quantize, quantize_column
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

LQQ = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=240, progressive=True, level2="lqq")


def _all_groups() -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """One row per (min8, max8) pair with -119 <= min8 <= max8 <= 119 (28,680 rows): group 0 pins the level-1
    scale to exactly 1 (it holds -119 and 119), group 1 holds every integer of [min8, max8]."""
    lo, hi = np.triu_indices(239)
    lo, hi = lo - 119, hi - 119
    span = np.arange(240)
    group = np.minimum(lo[:, None] + span, hi[:, None])  # min8, min8 + 1, ..., max8, max8, ...
    pin = np.tile(np.r_[-119, 119, np.zeros(238)], (len(lo), 1))
    return torch.from_numpy(np.concatenate([pin, group], axis=1)).float(), lo, hi


@pytest.fixture(scope="module")
def every_group():
    w, lo, hi = _all_groups()
    qp = compute_qparams(w, LQQ)
    assert torch.equal(qp.s1, torch.ones_like(qp.s1))
    return w, lo, hi, qp, quantize(w, qp, LQQ)


def test_parameters_of_every_group(every_group):
    """Step = round(range / 15) within 1..16 and offset = min8, as the paper's Eq. 7 (round to nearest)."""
    _, lo, hi, qp, _ = every_group
    s = qp.s2[:, 1].numpy()
    assert np.array_equal(s, np.clip(np.round((hi - lo) / 15), 1, 16))
    assert np.array_equal(qp.offset[:, 1].numpy(), lo)
    assert s.max() == 16 and s.min() == 1


def test_no_lane_overflows_for_any_group_or_code(every_group):
    """Every code the quantizer may emit (0 up to the group's code bound), in every lane of a register next to
    lanes at that bound, dequantizes through the modelled IMAD + XOR to exactly u * s + min8: no lane ever
    carries into its neighbour, whatever GPTQ's error updates push a weight to."""
    _, lo, _, qp, _ = every_group
    s = qp.s2[:, 1].numpy().astype(np.int64)
    u_hi = (qp.code_hi[:, 1] + 8).numpy().astype(np.int64)
    assert np.array_equal(u_hi, np.minimum(15, (127 - lo) // s))
    assert (u_hi * s + 128 + lo <= 255).all()
    u = np.minimum(np.arange(16)[None, :], u_hi[:, None])  # [pairs, 16]: every admissible code
    top = np.broadcast_to(u_hi[:, None, None], (*u.shape, 4))
    for lane in range(4):
        low = top.copy()
        low[..., lane] = u
        words = pack_register(low, top)
        lo_lanes, hi_lanes = lane_dequant(words, s[:, None], (128 + lo)[:, None])
        assert np.array_equal(lo_lanes[..., lane], (u * s[:, None] + lo[:, None]).astype(np.int8))
        assert np.array_equal(hi_lanes, (top * s[:, None, None] + lo[:, None, None]).astype(np.int8))
        assert np.array_equal(lo_lanes.astype(np.int64), low * s[:, None, None] + lo[:, None, None])


def test_every_value_of_every_group_round_trips_within_eight(every_group):
    """Each INT8 value x of [min8, max8] gets a code within the bound, and the kernel's byte lies in
    [min8, 127] (never -128). The error is at most s/2 where the top value rounds to a code <= 15 (the paper's
    proof), and at most 8 where rounding the step down makes code 15 clamp (8,484 groups, as the digest's
    independent count says)."""
    w, lo, hi, qp, codes = every_group
    u = codes[:, 240:].numpy().astype(np.int64) + 8
    assert (u >= 0).all() and (u <= (qp.code_hi[:, 1:2] + 8).numpy()).all()
    s = qp.s2[:, 1:2].numpy().astype(np.int64)
    lanes = u * s + lo[:, None]
    err = np.abs(lanes - w[:, 240:].numpy())
    spans = np.round((hi - lo) / s[:, 0]) <= 15  # code 15 needs no clamp
    assert (err[spans] <= s[spans] / 2).all()
    assert err.max() == 8 and (~spans).sum() == 8484
    assert (lanes >= lo[:, None]).all() and (lanes <= 127).all()
    assert np.array_equal(dequantize(codes, qp)[:, 240:].numpy(), lanes)  # float path == integer path


def test_paper_overflow_example():
    """LiquidGEMM §4: Q_u4 = 15, max 119, min -104: s = round(223 / 15) = 15, and 225 - 104 = 121 must come
    out; the naive UINT8 sum 225 + (-104) wraps, the XOR form does not."""
    lo, hi = lane_dequant(pack_register([15, 0, 0, 0], [0, 0, 0, 0]), 15, 128 - 104)
    assert lo[0] == 121 and lo[1] == -104 and hi[0] == -104


def test_dequant_is_exact_two_level_product():
    """w_hat = (u * s + min8) * s1 in fp32 exactly, for random weights and fp16 level-1 scales."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g)
    spec = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=64, progressive=True, level2="lqq")
    qp = compute_qparams(w, spec)
    codes = quantize(w, qp, spec)
    u = (codes.double() + 8).reshape(64, 4, 64)
    int8 = u * qp.s2.double()[..., None] + qp.offset.double()[..., None]
    expected = (int8.reshape(64, 256) * qp.s1.double()).float()
    assert torch.equal(dequantize(codes, qp), expected)
    assert int8.min() >= -119 and int8.max() <= 127


def test_code_bound_keeps_the_lane_in_a_byte_beyond_the_protective_range():
    """With the protective range 119 a code never needs the bound (round((119 - min8) / s) <= (127 - min8) / s
    since s <= 16). At 127 it does: group [89, 127] has s = 3 and 127 rounds to code 13, whose lane
    13 * 3 + 128 + 89 = 256 would carry; the bound holds it at 12 (lane 253), also in GPTQ's column step."""
    spec = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=8, progressive=True,
                     protective_range=127, level2="lqq")
    w = torch.tensor([[127.0, 89, 100, 110, 120, 127, 89, 89]])
    qp = compute_qparams(w, spec)
    assert qp.s1.item() == 1 and qp.s2.item() == 3 and qp.offset.item() == 89
    assert qp.code_hi.item() + 8 == 12
    codes = quantize(w, qp, spec)
    assert codes[0, 0].item() + 8 == 12
    assert dequantize(codes, qp)[0, 0].item() == 12 * 3 + 89
    lanes, _ = lane_dequant(pack_register([12, 0, 0, 0], [0, 0, 0, 0]), 3, 128 + 89)
    assert lanes[0] == 125
    q, deq = quantize_column(torch.tensor([127.0]), qp, 0, spec)
    assert q.item() + 8 == 12 and deq.item() == 125


def test_lqq_needs_progressive_four_bits():
    with pytest.raises(ValueError, match="progressive"):
        QuantSpec(bits=4, symmetric=False, granularity="group", level2="lqq")
    with pytest.raises(ValueError, match="level2"):
        QuantSpec(bits=4, symmetric=False, granularity="group", progressive=True, level2="qserve")


G64 = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=64, progressive=True, level2="lqq")


def _quantized(n: int = 128, k: int = 192, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) + 0.3 * torch.randn(n, 1, generator=g)
    qp = compute_qparams(w, G64)
    return QuantizedLinear(quantize(w, qp, G64), qp, G64)


def test_block_layout_by_hand():
    """Thread 0's first register: byte b holds row 0, column b (low nibble) and column 16 + b (high); its
    second register the same for row 8; thread 5 (gid 1, tig 1) starts at row 1, column 4. The map is a
    bijection onto the 64 x 64 block."""
    assert [(ROWS[b, 0], COLS[b, 0], COLS[b, 1]) for b in range(4)] == [(0, b, 16 + b) for b in range(4)]
    assert (ROWS[4, 0], COLS[4, 0]) == (8, 0)
    assert (ROWS[8, 0], COLS[8, 0], COLS[8, 1]) == (0, 32, 48)  # register 2: the second MMA's K half
    assert (ROWS[16 * 5, 0], COLS[16 * 5, 0]) == (1, 4)
    assert (ROWS[16 * 32, 0]) == 16  # warp 1 starts at row 16
    cells = {(r, c) for r, c in zip(ROWS.ravel(), COLS.ravel(), strict=True)}
    assert len(cells) == 64 * 64
    u = np.random.default_rng(0).integers(0, 16, (128, 192))
    assert np.array_equal(unpack_codes(pack_codes(u)), u)


def test_packer_round_trip_is_exact():
    q = _quantized()
    packer = LiquidQuantPacker(None, torch.float16)
    tensors = packer.pack(q)
    assert tensors["qweight"].dtype == torch.uint8 and tuple(tensors["qweight"].shape) == (2, 3, 2048)
    assert tuple(tensors["s2a"].shape) == (2, 3, 64, 2) and tensors["s1_scales"].dtype == torch.float16
    back = packer.unpack(tensors, G64)
    assert torch.equal(back.codes, q.codes)
    for field in ("scale", "s1", "s2", "offset", "code_lo", "code_hi"):
        assert torch.equal(getattr(back.qparams, field).float(), getattr(q.qparams, field).float()), field
    assert torch.equal(back.dequantize(), q.dequantize())


def test_kernel_lanes_on_packed_registers_equal_reference():
    """Every register of the packed artifact, dequantized through the IMAD + XOR model with the (s, a) of its
    row, gives the INT8 values of the reference dequant at the cells the layout assigns to its lanes."""
    q = _quantized(seed=3)
    t = LiquidQuantPacker(None, torch.float16).pack(q)
    regs = registers(t["qweight"].numpy())  # [N/64, K/64, 128, 4]
    sa = t["s2a"].numpy().astype(np.uint32)  # [N/64, K/64, 64, 2]
    rows = register_rows()
    lo, hi = lane_dequant(regs, sa[:, :, rows, 0], sa[:, :, rows, 1])  # [N/64, K/64, 128, 4, 4]
    int8 = (q.dequantize() / q.qparams.s1).round().to(torch.int64).numpy()  # exact: (u * s + min8)
    blocks = int8.reshape(2, 64, 3, 64).transpose(0, 2, 1, 3)
    r, c = ROWS.reshape(128, 4, 4, 2), COLS.reshape(128, 4, 4, 2)
    assert np.array_equal(lo, blocks[:, :, r[..., 0], c[..., 0]])
    assert np.array_equal(hi, blocks[:, :, r[..., 1], c[..., 1]])


def test_packer_refuses_what_the_kernel_cannot_run():
    packer = LiquidQuantPacker(None, torch.float16)
    with pytest.raises(ExportError, match="multiples of 64"):
        packer.check("mlp.down_proj", G64, (576, 1000))
    with pytest.raises(ExportError, match="level2 lqq"):
        packer.check("mlp.down_proj", QuantSpec(bits=4, symmetric=True, group_size=64), (128, 128))
    q = _quantized()
    q.codes[0, 0] = 7  # u = 15 where the bound may be lower
    q.qparams.offset[0, 0] = 120.0
    q.qparams.s2[0, 0] = 16.0
    with pytest.raises(ExportError, match="overflow"):
        packer.pack(q)


def test_end_to_end_liquidquant_artifact_loads_as_quantized(tmp_path, calib_txt):
    """GPTQ with LiquidQuant weights and W8 activations exports the liquidquant layout, and eval's loader
    rebuilds exactly the weights the quantkit simulation artifact of the same run holds."""
    model = write_synthetic_llama(tmp_path / "m", SyntheticLlama(hidden_size=256, intermediate_size=512,
                                                                  num_hidden_layers=2))
    args = ["--recipe", "gptq-w4a16-g128", "--calib", calib_txt, "--num-samples", "4", "--seq-len", "64",
            "--set", "weights={bits: 4, symmetric: false, granularity: group, group_size: 64, progressive: true, "
                     "level2: lqq}",
            "--set", "activations={bits: 8, symmetric: true, granularity: token}"]
    cli_ok("quantize", model, "-o", tmp_path / "lqq", *args, "--set", "export.format=liquidquant")
    cli_ok("quantize", model, "-o", tmp_path / "sim", *args, "--set", "export.format=quantkit")
    config = json.loads((tmp_path / "lqq" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "liquidquant"
    a = load_for_eval(tmp_path / "lqq", dtype=torch.float16).model
    b = load_for_eval(tmp_path / "sim", dtype=torch.float16).model
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    fp = load_for_eval(model, dtype=torch.float16).model
    assert not torch.equal(a.model.layers[0].mlp.down_proj.weight, fp.model.layers[0].mlp.down_proj.weight)


def test_packed_tensors_and_config_follow_the_documented_layout():
    """The module docstring's layout "lqq_dual64": s1_scales fp16 [N], s2a uint8 [N/64, K/64, 64, 2] holding (s, 128 +
    min8) per block row, and quantization_config naming 4-bit weights, 8-bit activations, groups of 64."""
    q = _quantized()
    packer = LiquidQuantPacker(None, torch.float16)
    t = packer.pack(q)
    assert t["s1_scales"].dtype == torch.float16 and tuple(t["s1_scales"].shape) == (128,)
    assert t["s2a"].dtype == torch.uint8
    # block row 5 of row tile 1, K tile 2 is row 69, group 2
    assert int(t["s2a"][1, 2, 5, 0]) == int(q.qparams.s2[69, 2])
    assert int(t["s2a"][1, 2, 5, 1]) == 128 + int(q.qparams.offset[69, 2])
    assert packer.quantization_config({"down": G64}) == {
        "quant_method": "liquidquant", "wbits": 4, "abits": 8, "group_size": 64, "layout": "lqq_dual64",
        "note": "no public engine loads it; quantkit's kernels read it"}


def test_step_is_capped_at_16_beyond_the_protective_range() -> None:
    """The LQQ step is clamped to 1..16 even where the protective range 127 would round it to 17."""
    # P = 127, group [-127, 127]: round(254 / 15 = 16.93) = 17 -> s2 = 16; the bound floor((127 + 127) / 16) = 15
    # keeps 127 at u = 15 -> 15 * 16 - 127 = 113 (a step of 17 would give 111).
    spec = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=32, progressive=True,
                     protective_range=127, level2="lqq")
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -127.0, 127.0
    qp = compute_qparams(w, spec)
    assert (qp.s1.item(), qp.s2.item(), qp.offset.item(), qp.code_hi.item() + 8) == (1.0, 16.0, -127.0, 15)
    q = quantize(w, qp, spec)
    assert q[0, :3].tolist() == [-8, 7, 0]  # u = 0, 15 (16 held at the bound), round(127 / 16 = 7.94) = 8
    assert dequantize(q, qp)[0, :3].tolist() == [-127.0, 113.0, 1.0]


def test_codes_round_the_int8_level1_value_not_the_float_one() -> None:
    """LQQ level 2 quantizes the INT8 value x8 = round(w / s1), also in GPTQ's column step, not w / s1 itself."""
    # Group 1 of [119 | -40, 110, -25.3] has s1 = 1, offset -40 and s2 = round(150 / 15) = 10; -25.3 is x8 = -25, so
    # u = round(15 / 10 = 1.5) = 2 (ties to even) -> -20, where rounding the float (14.7 / 10) gives u = 1 -> -30.
    w = torch.zeros(1, 64)
    w[0, 0] = 119.0
    w[0, 32:35] = torch.tensor([-40.0, 110.0, -25.3])
    spec = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=32, progressive=True, level2="lqq")
    qp = compute_qparams(w, spec)
    assert qp.s1.item() == 1.0 and qp.s2[0, 1].item() == 10.0 and qp.offset[0, 1].item() == -40.0
    q = quantize(w, qp, spec)
    assert q[0, 32:36].tolist() == [-8, 7, -6, -4]
    assert dequantize(q, qp)[0, 32:36].tolist() == [-40.0, 110.0, -20.0, 0.0]
    col, deq = quantize_column(w[:, 34], qp, 1, spec)
    assert col.item() == -6 and deq.item() == -20.0
