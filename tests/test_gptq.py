"""GPTQ: lower Hessian-weighted error than RTN, consistent codes/qparams, damping escalation."""

import pytest
import torch

from quantkit.passes.gptq import GPTQConfig, gptq_quantize
from quantkit.quantizers import QuantSpec, compute_qparams, dequantize, quantize


def _problem(n=32, k=128, tokens=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) * torch.linspace(0.1, 3.0, k)  # uneven channel scales
    x[:, :8] += torch.randn(tokens, 1, generator=g) * 4  # correlated outlier channels
    w = torch.randn(n, k, generator=g)
    return w, 2 * x.T @ x / tokens, x


def _output_error(w, w_hat, x):
    return float(((x @ (w - w_hat).T) ** 2).sum())


@pytest.mark.parametrize("act_order,static", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("granularity,symmetric", [("group", True), ("channel", True), ("group", False)])
def test_gptq_beats_rtn(act_order, static, granularity, symmetric):
    w, h, x = _problem()
    spec = QuantSpec(bits=4, symmetric=symmetric, granularity=granularity, group_size=32)
    cfg = GPTQConfig(block_size=32, act_order=act_order, static_groups=static)
    result, damp, loss = gptq_quantize(w, h, spec, cfg, torch.float16)
    assert damp == 0.01 and loss > 0
    qp = compute_qparams(w, spec)
    rtn = dequantize(quantize(w, qp, spec), qp)
    assert _output_error(w, result.dequantize(), x) < 0.8 * _output_error(w, rtn, x)
    assert int(result.codes.min()) >= spec.qmin and int(result.codes.max()) <= spec.qmax
    # g_idx only when act-order groups are dynamic (columns of one group are then scattered)
    if granularity == "group" and act_order and not static:
        assert result.g_idx is not None and torch.bincount(result.g_idx).tolist() == [32] * 4
    else:
        assert result.g_idx is None


def test_static_groups_use_rtn_scales():
    w, h, _ = _problem(seed=3)
    spec = QuantSpec(bits=4, granularity="group", group_size=32)
    result, _, _ = gptq_quantize(w, h, spec, GPTQConfig(act_order=True, static_groups=True), torch.float16)
    assert torch.equal(result.qparams.scale, compute_qparams(w, spec).scale)


def test_dead_columns_are_zeroed():
    w, h, _ = _problem(seed=4)
    h[5, :] = 0
    h[:, 5] = 0
    result, _, _ = gptq_quantize(w, h, QuantSpec(granularity="channel"), GPTQConfig(), torch.float16)
    assert torch.equal(result.dequantize()[:, 5], torch.zeros(w.shape[0]))


def test_damping_escalates_when_cholesky_fails():
    w, h, _ = _problem(seed=5)
    h = h - 0.02 * torch.linalg.eigvalsh(h).max() * torch.eye(h.shape[0])  # indefinite at damp 0.01
    _, damp, _ = gptq_quantize(w, h, QuantSpec(granularity="channel"), GPTQConfig(damp=0.01), torch.float16)
    assert damp > 0.01


def test_hopeless_hessian_raises():
    w = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="not positive definite"):
        gptq_quantize(w, -1e3 * torch.eye(16), QuantSpec(granularity="channel"), GPTQConfig(max_damp=0.1),
                      torch.float16)


def test_in_place_permutation_is_exact():
    from quantkit.passes.gptq import _permute_symmetric_

    _, h, _ = _problem(k=300, seed=7)
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(1))
    got = h.clone()
    _permute_symmetric_(got, perm, block=64)
    assert torch.equal(got, h[perm][:, perm])


def test_lapack_factor_in_place_matches_torch():
    """The CPU factor (LAPACK inside H's buffer, nothing else K x K) agrees with torch's out-of-place one, and
    is upper triangular."""
    from quantkit.passes.gptq import _attempt_torch, factor_hessian

    _, h, _ = _problem(k=200, seed=3)
    factor = factor_hessian(h.clone(), GPTQConfig(), consume=True)
    damped = h[factor.perm][:, factor.perm].clone()
    damped.diagonal().add_(0.01 * damped.diagonal().mean())
    exact = _attempt_torch(damped.double())  # float64: the answer both float32 routes approximate
    reference = _attempt_torch(damped)
    assert torch.equal(factor.upper, factor.upper.triu())
    ours, torchs = (float((u.double() - exact).abs().max()) for u in (factor.upper, reference))
    # both carry float32 rounding (the BLAS decides how much); the in-place route must be as accurate as torch's
    assert ours <= 2 * torchs + 1e-6 * float(exact.abs().max())


def test_escalated_damping_restores_the_hessian_exactly():
    """After a failed factorization H is rebuilt from the triangle LAPACK left alone: the result equals a
    direct factorization at the damping that worked."""
    from quantkit.passes.gptq import factor_hessian

    _, h, _ = _problem(seed=5)
    h = h - 0.02 * torch.linalg.eigvalsh(h).max() * torch.eye(h.shape[0])
    escalated = factor_hessian(h, GPTQConfig(damp=0.01))
    assert escalated.damp > 0.01
    direct = factor_hessian(h, GPTQConfig(damp=escalated.damp))
    assert torch.equal(escalated.upper, direct.upper)


@pytest.mark.parametrize("symmetric", [True, False])
def test_dynamic_groups_take_the_clip_ratios(symmetric):
    """Without act-order, each dynamic group is one of the weight's column groups, so a clipping search's ratio
    for (row, group) clips it as the sweep reaches it (the first group before any error reaches it: its
    parameters are exactly the clipped RTN ones); a per-tensor ratio clips every group. With act-order the groups
    are other columns, and per-group ratios are refused."""
    w, h, _ = _problem()
    spec = QuantSpec(bits=4, symmetric=symmetric, granularity="group", group_size=32)
    cfg = GPTQConfig(block_size=32, act_order=False, static_groups=False)
    ratios = torch.linspace(0.6, 1.0, 32)[:, None].repeat(1, 4)
    plain, _, _ = gptq_quantize(w, h, spec, cfg, torch.float16)
    clipped, _, _ = gptq_quantize(w, h, spec, cfg, torch.float16, clip=ratios)
    assert not torch.equal(plain.codes, clipped.codes)
    channel = QuantSpec(bits=4, symmetric=symmetric, granularity="channel")
    first = compute_qparams(w[:, :32], channel, torch.float16, clip_ratio=ratios[:, :1])
    assert torch.equal(clipped.qparams.scale[:, :1], first.scale)
    assert clipped.qparams.zero is None if symmetric else torch.equal(clipped.qparams.zero[:, :1], first.zero)
    per_tensor, _, _ = gptq_quantize(w, h, spec, cfg, torch.float16, clip=0.7)
    flat = compute_qparams(w[:, :32], channel, torch.float16, clip_ratio=0.7)
    assert torch.equal(per_tensor.qparams.scale[:, :1], flat.scale)
    with pytest.raises(ValueError, match="per-group clip ratios need groups in the weight's column order"):
        gptq_quantize(w, h, spec, GPTQConfig(block_size=32, act_order=True, static_groups=False), torch.float16,
                      clip=ratios)
