"""Exact checks of the integer quantizer conventions, on hand-worked examples and random tensors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.quantizers import (
    QuantSpec,
    compute_qparams,
    dequantize,
    fake_quantize,
    fake_quantize_per_token,
    quantize,
    quantize_dequantize,
    search_qparams,
)


def test_symmetric_4bit_hand_worked():
    # amax = 7.5 -> scale = 7.5 / 7.5 = 1.0; codes are round-half-even of w, clamped to [-8, 7]
    w = torch.tensor([[7.5, -7.5, 0.5, 1.5, -2.4, 3.0, 0.0, -0.6]])
    spec = QuantSpec(bits=4, symmetric=True, granularity="channel")
    qp = compute_qparams(w, spec)
    assert qp.scale.item() == 1.0 and qp.zero is None
    q = quantize(w, qp, spec)
    assert q.tolist() == [[7, -8, 0, 2, -2, 3, 0, -1]]
    assert dequantize(q, qp).tolist() == [[7.0, -8.0, 0.0, 2.0, -2.0, 3.0, 0.0, -1.0]]


def test_asymmetric_4bit_hand_worked():
    # range [0, 15] -> scale 1, zero = round(-8 - 0 / 1) = -8; q = w - 8
    w = torch.tensor([[0.0, 15.0, 3.2, 7.5]])
    spec = QuantSpec(bits=4, symmetric=False, granularity="channel")
    qp = compute_qparams(w, spec)
    assert qp.scale.item() == 1.0 and qp.zero.item() == -8
    q = quantize(w, qp, spec)
    assert q.tolist() == [[-8, 7, -5, 0]]
    assert dequantize(q, qp).tolist() == [[0.0, 15.0, 3.0, 8.0]]


def test_asymmetric_range_includes_zero():
    w = torch.tensor([[2.0, 4.0, 6.0, 8.0]])  # all positive: the range is widened to [0, 8]
    spec = QuantSpec(bits=4, symmetric=False, granularity="channel")
    qp = compute_qparams(w, spec)
    assert qp.zero.item() == -8
    assert torch.equal(dequantize(quantize(torch.zeros(1, 4), qp, spec), qp), torch.zeros(1, 4))


def test_group_scales_are_per_group_and_fp16_representable():
    torch.manual_seed(0)
    w = torch.randn(4, 256)
    spec = QuantSpec(bits=4, granularity="group", group_size=64)
    qp = compute_qparams(w, spec)
    assert qp.scale.shape == (4, 4)
    assert torch.equal(qp.scale, qp.scale.half().float())
    expected = w.reshape(4, 4, 64).abs().amax(-1) / 7.5
    assert torch.equal(qp.scale, expected.half().float())


def test_all_zero_group_round_trips():
    w = torch.zeros(2, 128)
    w[1, 64:] = 1.0
    spec = QuantSpec(bits=4, granularity="group", group_size=64)
    out = fake_quantize(w, spec)
    assert torch.equal(out[0], torch.zeros(128)) and torch.equal(out[1, :64], torch.zeros(64))


def test_clip_ratio_shrinks_scale():
    w = torch.linspace(-1, 1, 128).reshape(1, 128)
    full = compute_qparams(w, QuantSpec(granularity="channel"))
    clipped = compute_qparams(w, QuantSpec(granularity="channel", clip_ratio=0.5))
    assert torch.allclose(clipped.scale, full.scale * 0.5, rtol=1e-3)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="does not divide"):
        compute_qparams(torch.zeros(2, 100), QuantSpec(group_size=64))


@pytest.mark.parametrize("bad", [dict(bits=1), dict(bits=9), dict(clip_ratio=0.0), dict(group_size=0)])
def test_spec_validation(bad):
    with pytest.raises(ValueError):
        QuantSpec(**bad)


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(2, 8), symmetric=st.booleans(), seed=st.integers(0, 10_000),
       granularity=st.sampled_from(["tensor", "channel", "group"]))
def test_codes_in_range_and_error_bounded(bits, symmetric, seed, granularity):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 64, generator=g) * 3
    spec = QuantSpec(bits=bits, symmetric=symmetric, granularity=granularity, group_size=32)
    qp = compute_qparams(w, spec)
    q = quantize(w, qp, spec)
    assert int(q.min()) >= spec.qmin and int(q.max()) <= spec.qmax
    deq = dequantize(q, qp)
    # values well inside the representable range are within half a step of their dequantized value
    expand = (lambda t: t.repeat_interleave(qp.group_size, dim=1)) if granularity != "tensor" else (lambda t: t)
    step = expand(qp.scale)
    zero = expand(qp.zero).float() if qp.zero is not None else torch.zeros_like(step)
    inside = (w >= (spec.qmin - zero) * step) & (w <= (spec.qmax - zero) * step)
    assert inside.float().mean() > 0.5  # the check below must cover most of the tensor
    assert torch.all(((w - deq).abs() <= step * 0.5001)[inside])


def test_search_qparams_never_worse_than_minmax():
    torch.manual_seed(1)
    w = torch.randn(16, 128) ** 3
    spec = QuantSpec(bits=4, granularity="group", group_size=32)
    base = compute_qparams(w, spec)
    best = search_qparams(w, spec)
    err = lambda qp: (w - dequantize(quantize(w, qp, spec), qp)).abs().pow(2.4).reshape(16, 4, 32).sum(-1)  # noqa: E731
    assert torch.all(err(best) <= err(base) + 1e-6)
    assert torch.any(err(best) < err(base))


def test_per_token_int8_matches_hand_computation():
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0], [0.0, 0.0, 0.0, 0.0]])
    out = fake_quantize_per_token(x, 8)
    assert torch.equal(out[0], torch.tensor([1.0, -2.0, 0.0, 127.0]))  # scale 1: round-half-even(0.5) = 0
    assert torch.equal(out[1], torch.zeros(4))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_matches_the_formula_and_leaves_its_input_alone(symmetric, dtype):
    """The in-place arithmetic equals the textbook formula exactly, and never writes into the caller's tensor."""
    x = (torch.randn(33, 96, generator=torch.Generator().manual_seed(3)) * 7).to(dtype)
    x[0] = 0
    x[1] = -x[1].abs()  # a row with no positive value: the asymmetric range still includes zero
    before = x.clone()
    out = fake_quantize_per_token(x, 4, symmetric, 0.9 if symmetric else 1.0)
    assert torch.equal(x, before)
    xf = x.float()
    if symmetric:
        scale = xf.abs().amax(-1, keepdim=True) * 0.9 / 7
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        want = torch.round(xf / scale).clamp(-8, 7) * scale
    else:
        lo, hi = xf.amin(-1, keepdim=True).clamp(max=0), xf.amax(-1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-lo / scale)
        want = ((torch.round(xf / scale) + zero).clamp(0, 15) - zero) * scale
    assert out.dtype == dtype and torch.equal(out, want.to(dtype))


def test_asymmetric_zero_is_rounded_to_nearest_not_floored():
    """Range [-1.75, 13.25]: scale 15 / 15 = 1, zero = round(-8 + 1.75) = round(-6.25) = -6 (a floor would give -7)."""
    w = torch.tensor([[-1.75, 13.25, 0.0, 5.6]])
    spec = QuantSpec(bits=4, symmetric=False, granularity="channel")
    qp = compute_qparams(w, spec)
    assert qp.scale.item() == 1.0 and qp.zero.item() == -6
    q = quantize(w, qp, spec)
    assert q.tolist() == [[-8, 7, -6, 0]]  # round(-1.75) - 6, round(13.25) - 6, 0 - 6, round(5.6) - 6
    assert dequantize(q, qp).tolist() == [[-2.0, 13.0, 0.0, 6.0]]


def test_asymmetric_all_positive_row_scales_over_zero_to_max():
    """All-positive row [3, 7.5]: the range widens to [0, 7.5], so scale = 7.5 / 15 = 0.5 (not (7.5 - 3) / 15)."""
    w = torch.tensor([[3.0, 7.5, 4.5, 6.0]])
    spec = QuantSpec(bits=4, symmetric=False, granularity="channel")
    qp = compute_qparams(w, spec)
    assert qp.scale.item() == 0.5 and qp.zero.item() == -8
    assert quantize(w, qp, spec).tolist() == [[-2, 7, 1, 4]]  # w / 0.5 - 8, exact


def test_scaled_zero_form_codes_hand_worked():
    """zero_form 'scaled' (QServe per channel): szero = fp16((zero + 8) * scale) = 2, and the codes are
    round((w + szero) / scale) - 8, so w_hat = (q + 8) * scale - szero equals the integer-zero form's."""
    w = torch.tensor([[-1.75, 13.25, 0.0, 5.6]])
    spec = QuantSpec(bits=4, symmetric=False, granularity="channel", zero_form="scaled")
    qp = compute_qparams(w, spec)
    assert qp.scale.item() == 1.0 and qp.zero.item() == -6 and qp.szero.item() == 2.0 and qp.code_offset == 8
    q = quantize(w, qp, spec)
    assert q.tolist() == [[-8, 7, -6, 0]]  # round(0.25) - 8, round(15.25) - 8, 2 - 8, round(7.6) - 8
    assert dequantize(q, qp).tolist() == [[-2.0, 13.0, 0.0, 6.0]]


PROGRESSIVE_G32 = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=32, progressive=True)


def test_progressive_level2_scale_rounds_to_nearest_and_codes_round_half_even():
    """Group [-33, 119] (s1 = fp16(119 / 119) = 1): s2 = round(152 / 15 = 10.13) = 10 (a ceiling gives 11),
    z_u = round(3.3) = 3. 25 / 10 = 2.5 is a tie: QServe's Eq. 7 rounds x / s + z = 5.5 to even, u = 6 (code -2);
    rounding 2.5 first and adding z would give 2 + 3 = 5. The packer's reference agrees code for code."""
    from quantkit.formats.qserve_layout import progressive_quantize_reference

    w = torch.zeros(1, 32)
    w[0, :3] = torch.tensor([-33.0, 119.0, 25.0])
    qp = compute_qparams(w, PROGRESSIVE_G32)
    assert qp.s1.item() == 1.0 and qp.s2.item() == 10.0 and qp.zero.item() == 3 - 8
    # code bounds: z_u - floor(128 / 10) < 0 -> 0, z_u + floor(127 / 10) = 15
    assert (qp.code_lo.item(), qp.code_hi.item()) == (-8, 7)
    codes = quantize(w, qp, PROGRESSIVE_G32)
    assert codes[0, :4].tolist() == [-8, 7, -2, -5]  # -3.3 -> 0 - 8, 14.9 -> 15 - 8, 5.5 -> 6 - 8, 3 -> 3 - 8
    assert torch.equal(codes.long() + 8, progressive_quantize_reference(w, group_size=32)[0].long())


def test_asymmetric_codes_add_the_zero_before_rounding():
    """Eq. 7, round(w / s + z) with ties to even, on a tie: w = 1, s = 2, z = 1 gives round(1.5) = 2, where
    round(0.5) + 1 = 1. Asymmetric 4-bit over [-2, 28]: s = 30 / 15 = 2, z = round(1) = 1 (signed domain: -7)."""
    w = torch.zeros(1, 8)
    w[0, :3] = torch.tensor([-2.0, 28.0, 1.0])
    spec = QuantSpec(bits=4, symmetric=False, granularity="channel")
    qp = compute_qparams(w, spec)
    assert qp.scale.item() == 2.0 and qp.zero.item() == 1 - 8
    assert quantize(w, qp, spec)[0, :4].tolist() == [-8, 7, -6, -7]  # round(1.5 - 7 = -5.5) = -6; 0 -> z


def test_progressive_level1_clamps_to_the_protective_range():
    """max|w| = 119 * 4097 / 4096 gives s1 = fp16(1.000244) = 1, so w / s1 exceeds 119 and must clamp to it:
    group [-8.5, 119] -> s2 = round(127.5 / 15 = 8.5) = 8 (ties to even); unclamped, 127.53 / 15 would give 9."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -8.5, 119 * 4097 / 4096
    qp = compute_qparams(w, PROGRESSIVE_G32)
    assert qp.s1.item() == 1.0 and qp.s2.item() == 8.0 and qp.zero.item() == 1 - 8  # z_u = round(8.5 / 8) = 1
    assert quantize(w, qp, PROGRESSIVE_G32)[0, :3].tolist() == [-8, 7, -7]


def test_progressive_code_floor_reaches_minus_128():
    """P = 127, group [-127, 110]: s1 = 1, s2 = round(237 / 15 = 15.8) = 16, z_u = round(127 / 16) = 8; the lowest
    code u = 0 gives (0 - 8) * 16 = -128, still INT8, so code_lo = 0 - 8 (z_u - floor(128 / s2)), not -7."""
    spec = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=32, progressive=True,
                     protective_range=127)
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -127.0, 110.0
    qp = compute_qparams(w, spec)
    assert (qp.s1.item(), qp.s2.item(), qp.zero.item() + 8) == (1.0, 16.0, 8)
    assert (qp.code_lo.item(), qp.code_hi.item()) == (-8, 7)  # z_u + floor(127 / 16) = 15
    q = quantize(w, qp, spec)
    assert q[0, :2].tolist() == [-8, 7]  # round(-7.94) = -8; round(6.875) = 7
    assert dequantize(q, qp)[0, :2].tolist() == [-128.0, 112.0]


def test_lqq_clip_narrows_the_int8_level1_values():
    """LiquidQuant level 2 clips the rounded INT8 values: x8 = round(-10.6) = -11, and with clip 0.5 the offset is
    round(-11 * 0.5 = -5.5) = -6 (ties to even), not round(-10.6 * 0.5 = -5.3) = -5; s2 = round(66 / 15) = 4."""
    spec = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=32, progressive=True, level2="lqq")
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -10.6, 119.0
    qp = compute_qparams(w, spec, clip_ratio=0.5)
    assert qp.s1.item() == 1.0 and qp.offset.item() == -6.0 and qp.s2.item() == 4.0  # hi = round(59.5) = 60


def test_lqq_clip_narrows_a_one_sided_group_at_its_far_end():
    """A group of level-1 values in [40, 119] (s1 = 119 / 119 = 1; offset 40, step round(79 / 15 = 5.27) = 5): clip
    0.9 keeps the offset 40 and clips the top to round(107.1) = 107, as a clamp of the values to 0.9 x [0, 119]
    would, so the step is round(67 / 15 = 4.47) = 4. Scaling both ends gave offset 36 and step round(71 / 15) = 5: a
    range shifted below the group, and no finer step. At 0.3 the clamp bound 35.7 lies below the whole group: every
    value clips to it, so the offset is 36 with step 1. The negative mirror clips its bottom alone."""
    spec = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=32, progressive=True, level2="lqq")
    w = torch.linspace(40.0, 119.0, 32).reshape(1, 32)
    at_one = compute_qparams(w, spec)
    assert (at_one.s1.item(), at_one.offset.item(), at_one.s2.item()) == (1.0, 40.0, 5.0)
    qp = compute_qparams(w, spec, clip_ratio=0.9)
    assert (qp.offset.item(), qp.s2.item()) == (40.0, 4.0)
    assert dequantize(quantize(w, qp, spec), qp).amin().item() == 40.0  # the bottom of the group is kept
    low = compute_qparams(w, spec, clip_ratio=0.3)
    assert (low.offset.item(), low.s2.item()) == (36.0, 1.0)
    neg = compute_qparams(-w.flip(1), spec, clip_ratio=0.9)
    assert (neg.offset.item(), neg.s2.item()) == (-107.0, 4.0)  # [-107, -40]: the end nearest 0 kept


def test_search_qparams_tries_the_smallest_ratio():
    """grid=1 compares exactly the ratios 1.0 and min_ratio = 0.8. Row [7.5, 2.4 x 127]: at 1.0 (scale 1) each 2.4
    is off by 0.4 (127 * 0.4^2.4 = 14.1); at 0.8 (scale fp16(0.8)) the 2.4s are exact codes 3 and only 7.5 clips
    to 7 * 0.8 (1.9^2.4 = 4.7), so the search must return the 0.8 scale."""
    w = torch.full((1, 128), 2.4)
    w[0, 0] = 7.5
    spec = QuantSpec(bits=4, symmetric=True, granularity="channel")
    best = search_qparams(w, spec, grid=1)
    assert best.scale.item() == torch.tensor(0.8).half().item()


def test_per_token_asymmetric_adds_the_zero_after_rounding():
    """vLLM's azp kernel computes round(x / s) + z, not round(x / s + z): they differ at a tie. Row [-1, 14, 0.5, 2.5]
    at 4 bits: range [-1, 14], s = 15 / 15 = 1, z = round(1) = 1; 0.5 -> round(0.5) + 1 = 1 -> (1 - 1) * 1 = 0 and
    2.5 -> round(2.5) + 1 = 3 -> 2 (adding z first: round(1.5) = 2 -> 1, round(3.5) = 4 -> 3)."""
    x = torch.tensor([[-1.0, 14.0, 0.5, 2.5]])
    assert fake_quantize_per_token(x, 4, symmetric=False).tolist() == [[-1.0, 14.0, 0.0, 2.0]]


def test_per_token_clip_saturates_at_the_signed_code_range():
    """INT8 with clip 0.5 on [254, 100, -254, 0.5]: s = 254 * 0.5 / 127 = 1, so 254 saturates at 127 and -254 at
    -128 (the INT8 minimum, as Atom's quantizers clamp to [-2^(b-1), 2^(b-1) - 1]); 0.5 rounds half to even, to 0."""
    x = torch.tensor([[254.0, 100.0, -254.0, 0.5]])
    assert fake_quantize_per_token(x, 8, True, 0.5).tolist() == [[127.0, 100.0, -128.0, 0.0]]


P127_G32 = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=32, progressive=True,
                     protective_range=127)


def test_progressive_code_ceiling_keeps_the_int8_product_at_most_127() -> None:
    """code_hi = z_u + floor(127 / s2) holds a code whose (q - z) * s2 would be +128, no INT8 value, one below."""
    # P = 127, group [-113, 127]: s1 = 1, s2 = round(240 / 15) = 16, z_u = round(7.06) = 7, so code_hi = 7 + 7 = 14
    # (signed 6). 127 rounds to u = 15, (15 - 7) * 16 = 128, and is held at 14 -> 112; floor(128 / s2) lets it by.
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -113.0, 127.0
    qp = compute_qparams(w, P127_G32)
    assert (qp.s1.item(), qp.s2.item(), qp.zero.item() + 8) == (1.0, 16.0, 7)
    assert (qp.code_lo.item(), qp.code_hi.item()) == (-8, 6)
    q = quantize(w, qp, P127_G32)
    assert q[0, :3].tolist() == [-8, 6, -1]  # round(-0.06) = 0; round(14.94) = 15 -> 14; 0 -> z_u
    assert dequantize(q, qp)[0, :3].tolist() == [-112.0, 112.0, 0.0]


def test_progressive_code_floor_binds_when_the_zero_is_high() -> None:
    """code_lo = z_u - floor(128 / s2) is above the 4-bit minimum here, and quantize clamps the low code up to it."""
    # P = 127, group [-127, 23]: s1 = 1, s2 = round(150 / 15) = 10, z_u = round(12.7) = 13, code_lo = 13 - 12 = 1
    # (signed -7). -127 rounds to u = round(0.3) = 0, (0 - 13) * 10 = -130 is no INT8 value: held at u = 1 -> -120.
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -127.0, 23.0
    qp = compute_qparams(w, P127_G32)
    assert (qp.s1.item(), qp.s2.item(), qp.zero.item() + 8) == (1.0, 10.0, 13)
    assert (qp.code_lo.item(), qp.code_hi.item()) == (-7, 7)
    q = quantize(w, qp, P127_G32)
    assert q[0, :3].tolist() == [-7, 7, 5]
    assert dequantize(q, qp)[0, :3].tolist() == [-120.0, 20.0, 0.0]


@pytest.mark.parametrize("symmetric", [True, False])
def test_all_zero_group_gets_scale_one_and_the_code_of_zero(symmetric: bool) -> None:
    """An all-zero group stores scale 1 (not 0, which makes w / scale 0 / 0) and the exact code of 0 (-8 asymmetric)."""
    # amax (or range) 0: the scale becomes 1, so codes are 0 symmetric, and the zero point round(-8 - 0 / 1) = -8
    # asymmetric; with scale 0 the codes would be NaN cast to int8 and the zero point NaN cast to int32.
    w = torch.zeros(2, 8)
    w[1, 4:] = torch.tensor([1.0, -2.0, 3.0, 4.0])
    spec = QuantSpec(bits=4, symmetric=symmetric, granularity="group", group_size=4)
    qp = compute_qparams(w, spec, torch.float32)
    assert qp.scale[0].tolist() == [1.0, 1.0] and qp.scale[1, 0].item() == 1.0
    q = quantize(w, qp, spec)
    if symmetric:
        assert q[0].tolist() == [0] * 8 and q[1, :4].tolist() == [0] * 4
    else:
        assert qp.zero[0].tolist() == [-8, -8] and qp.zero[1, 0].item() == -8
        assert q[0].tolist() == [-8] * 8 and q[1, :4].tolist() == [-8] * 4
    assert torch.equal(dequantize(q, qp)[0], torch.zeros(8))


_EVERY_KIND = [
    dict(bits=4, symmetric=True, granularity="group", group_size=32),
    dict(bits=4, symmetric=False, granularity="group", group_size=32),
    dict(bits=3, symmetric=False, granularity="channel"),
    dict(bits=8, symmetric=True, granularity="tensor"),
    dict(bits=4, symmetric=False, granularity="channel", zero_form="scaled"),
    dict(bits=4, symmetric=False, granularity="group", group_size=32, progressive=True),
    dict(bits=4, symmetric=False, granularity="group", group_size=32, progressive=True, level2="lqq"),
    dict(bits=4, symmetric=True, granularity="channel", narrow_range=True),
    dict(bits=4, symmetric=True, granularity="group", group_size=32, row_block=2),
]


@pytest.mark.parametrize("kind", _EVERY_KIND, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_quantize_dequantize_is_the_int8_round_trip_to_the_bit(kind: dict) -> None:
    # the searches' shortcut skips the int8 codes; it must give their bits, the sign of zero included (tiny
    # negative weights round to a -0 code, which int8 cannot hold), and leave its float32 inputs alone
    g = torch.Generator().manual_seed(7)
    w = torch.randn(8, 128, generator=g)
    w[0] = -1e-4  # but for its first, every code of row 0 rounds to -0 under the symmetric kinds
    w[0, 0] = 1.0
    w[1, :32] = 0.25  # an all-equal group
    w[2, :64] *= 50  # outliers in some groups
    spec = QuantSpec(**kind)
    qp = compute_qparams(w, spec)
    before = w.clone()
    expected = dequantize(quantize(w, qp, spec), qp)
    got = quantize_dequantize(w, qp, spec)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(fake_quantize(w, spec).view(torch.int32), expected.view(torch.int32))
    assert torch.equal(w.view(torch.int32), before.view(torch.int32))
    if kind["granularity"] == "group" and not kind.get("progressive") and not kind.get("row_block"):
        g_idx = torch.randperm(128, generator=g) // 32  # GPTQ's act-order groups
        expected = dequantize(quantize(w, qp, spec, g_idx), qp, g_idx)
        assert torch.equal(quantize_dequantize(w, qp, spec, g_idx).view(torch.int32), expected.view(torch.int32))


def test_dequantize_leaves_float_codes_alone() -> None:
    # dequantize's chain works in place after its first operation; float32 codes passed in must survive it
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    for kind in _EVERY_KIND:
        spec = QuantSpec(**kind)
        qp = compute_qparams(w, spec)
        codes = quantize(w, qp, spec).float()
        kept = codes.clone()
        dequantize(codes, qp)
        assert torch.equal(codes, kept), kind
