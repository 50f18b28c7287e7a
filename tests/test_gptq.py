"""GPTQ: lower Hessian-weighted error than RTN, consistent codes/qparams, damping escalation."""

import pytest
import torch

from quantkit.passes import LayerWork
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


def test_factor_is_the_inverse_cholesky_of_the_damped_hessian_with_dead_columns_set_to_one():
    """The factor U of a Hessian with dead (never active) columns is the upper Cholesky factor of (H' + lambda I)^-1
    in act-order, where H' has 1 on the dead diagonal entries (as the reference GPTQ does, before the damping is
    taken) and lambda = damp x mean(diag H'); the act-order visits columns by non-increasing diag(H'). Checked
    in float64 against a direct inverse, not against the code's own route."""
    from quantkit.passes.gptq import factor_hessian

    _, h, _ = _problem(k=16, seed=11)
    dead = [3, 9]
    h[dead, :] = 0
    h[:, dead] = 0
    factor = factor_hessian(h, GPTQConfig(damp=0.01))
    assert factor.dead.nonzero().squeeze(1).tolist() == dead
    fixed = h.double().clone()
    fixed[dead, dead] = 1.0
    diag = fixed.diagonal()
    perm = factor.perm
    assert sorted(perm.tolist()) == list(range(16))
    assert (diag[perm][:-1] >= diag[perm][1:]).all()  # act-order: decreasing diag(H'), dead columns included
    damped = fixed + 0.01 * float(diag.mean()) * torch.eye(16, dtype=torch.float64)
    expected = torch.linalg.inv(damped[perm][:, perm])
    u = factor.upper.double()
    assert torch.equal(u, u.triu())
    torch.testing.assert_close(u.T @ u, expected, rtol=1e-4, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("act_order", [False, True])
def test_diagonal_hessian_gives_round_to_nearest_and_half_the_weighted_error_as_loss(act_order):
    """With a diagonal Hessian no column's error reaches another, so GPTQ's codes are RTN's, and its loss is
    GPTQ's sum (w - q)^2 / [(H + lambda I)^-1]_jj / 2 = sum_j (H_jj + lambda) / 2 sum_i (w_ij - q_ij)^2, computed
    here by hand in float64 with lambda = damp x mean(diag H)."""
    g = torch.Generator().manual_seed(21)
    w = torch.randn(8, 64, generator=g)
    hd = torch.rand(64, generator=g) * 3 + 0.1
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=16)
    result, damp, loss = gptq_quantize(w, torch.diag(hd), spec, GPTQConfig(block_size=16, act_order=act_order),
                                       torch.float16)
    qp = compute_qparams(w, spec, torch.float16)
    assert torch.equal(result.codes, quantize(w, qp, spec))
    deq = dequantize(quantize(w, qp, spec), qp).double()
    lam = damp * float(hd.double().mean())
    expected = float((((w.double() - deq) ** 2).sum(dim=0) * (hd.double() + lam)).sum() / 2)
    assert loss == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("static", [False, True])
def test_each_group_takes_its_own_clip_ratio(static):
    """A clipping search's ratio of (row, group g) clips group g, for static and dynamic groups alike. With a
    diagonal Hessian no error moves between columns, so every group's parameters are exactly those of
    round-to-nearest with that group's ratio: 1 - 0.1 g for group g (the scales below are worked by hand)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4, 64, generator=g)
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=16)
    ratios = torch.tensor([1.0, 0.9, 0.8, 0.7]).repeat(4, 1)
    cfg = GPTQConfig(block_size=16, act_order=False, static_groups=static)
    result, _, _ = gptq_quantize(w, torch.diag(torch.rand(64, generator=g) + 0.5), spec, cfg, torch.float32,
                                 clip=ratios)
    amax = w.abs().reshape(4, 4, 16).amax(dim=-1)
    expected = amax * ratios / ((spec.qmax - spec.qmin) / 2)
    assert torch.equal(result.qparams.scale.reshape(4, 4), expected)  # the quantizer's ops in its order: exact


@pytest.mark.parametrize("act_order", [False, True])
def test_blocked_sweep_matches_a_naive_column_by_column_gptq(act_order):
    """The blocked sweep (lazy batch updates, errors reaching later blocks only at each block's end) is the
    paper's algorithm: a naive float64 loop (quantize column j with the static per-row scale, then
    W[:, j:] -= (w_j - q_j) / U_jj * U_j,j:, with U = chol((H + lambda I)^-1) upper, in act-order) gives the same
    codes, up to the rare rounding tie that float32 flips."""
    w, h, _ = _problem(n=16, k=64, seed=9)
    spec = QuantSpec(bits=4, symmetric=True, granularity="channel")
    result, damp, _ = gptq_quantize(w, h, spec, GPTQConfig(block_size=16, act_order=act_order), torch.float32)

    hd = h.double()
    perm = torch.argsort(hd.diagonal(), descending=True) if act_order else torch.arange(64)
    hp = hd[perm][:, perm] + damp * float(hd.diagonal().mean()) * torch.eye(64, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(hp), upper=True)
    scale = w.double().abs().amax(dim=1) / 7.5  # symmetric 4-bit: amax / ((7 - (-8)) / 2)
    wp = w.double()[:, perm].clone()
    codes = torch.zeros(16, 64, dtype=torch.long)
    for j in range(64):
        q = torch.clamp(torch.round(wp[:, j] / scale), -8, 7)
        codes[:, perm[j]] = q.long()
        err = (wp[:, j] - q * scale) / u[j, j]
        wp[:, j:] -= err[:, None] * u[j, j:][None, :]
    agree = float((result.codes.long() == codes).double().mean())
    assert agree >= 0.99, f"only {agree:.1%} of the codes agree with the naive GPTQ"


def test_mse_observer_clips_the_static_parameters():
    """observer: mse searches a clip ratio per group before the sweep: no static scale exceeds the min-max one,
    and round-to-nearest with the chosen parameters has a lower sum |w - w_hat|^2.4 (the search's norm) than
    with the min-max ones on Gaussian weights, whose extremes are not worth their range."""
    w, h, _ = _problem(n=16, k=128, seed=2)
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=32)
    cfg = GPTQConfig(block_size=32, observer="mse")
    result, _, _ = gptq_quantize(w, h, spec, cfg, torch.float32)
    minmax = compute_qparams(w, spec, torch.float32)
    assert (result.qparams.scale <= minmax.scale).all()

    def error(qp):
        return float((w - dequantize(quantize(w, qp, spec), qp)).abs().pow(2.4).sum())

    assert error(result.qparams) < 0.98 * error(minmax)


def test_rtn_pass_applies_the_clip_search_ratios():
    """The RTN pass quantizes with the ratios a clipping search left in `work.clip` (per row and group): scale =
    ratio x amax / 7.5 for symmetric 4-bit groups, worked by hand here, and codes round w / scale."""
    from torch import nn

    from quantkit.passes import LayerWork
    from quantkit.passes.rtn import RTN, RTNConfig

    g = torch.Generator().manual_seed(12)
    block = nn.ModuleDict({"lin": nn.Linear(32, 2, bias=False)})
    w = torch.randn(2, 32, generator=g)
    block["lin"].weight.data = w.clone()
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=16)
    ratios = torch.tensor([[1.0, 0.8], [0.6, 0.9]])
    work = LayerWork(index=0, block=block, linears={"lin": "down"}, specs={"lin": spec}, scale_dtype=torch.float32,
                     clip={"lin": ratios})
    RTN(RTNConfig()).run(work)
    result = work.results["lin"]
    scale = w.abs().reshape(2, 2, 16).amax(dim=-1) * ratios / 7.5
    assert torch.equal(result.qparams.scale.reshape(2, 2), scale)
    codes = torch.clamp(torch.round(w / scale.repeat_interleave(16, dim=1)), -8, 7)
    assert torch.equal(result.codes.to(torch.float32), codes)


def test_damping_escalates_tenfold_up_to_and_including_max_damp() -> None:
    """Failed Cholesky damping grows tenfold (0.01 -> 0.1) and may reach max_damp itself (1.0 with max_damp 1.0)."""
    # diag(1, 1, 1, d) + damp x mean I is positive definite once damp x (3 + d) / 4 > -d: d = -0.05 fails at 0.01 and
    # factors at 0.1 (doubling would stop at 0.08); d = -0.5 needs damp 1.0, which max_damp = 1.0 allows.
    w = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    spec = QuantSpec(granularity="channel")
    h = torch.diag(torch.tensor([1.0, 1.0, 1.0, -0.05]))
    _, damp, _ = gptq_quantize(w, h, spec, GPTQConfig(damp=0.01), torch.float32)
    assert damp == pytest.approx(0.1, rel=1e-12)
    h = torch.diag(torch.tensor([1.0, 1.0, 1.0, -0.5]))
    _, damp, _ = gptq_quantize(w, h, spec, GPTQConfig(damp=0.01, max_damp=1.0), torch.float32)
    assert damp == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("symmetric", [True, False])
def test_dynamic_groups_wider_than_a_block_take_every_column_of_the_group(symmetric: bool) -> None:
    """A dynamic group's parameters come from all its columns, also those in later blocks (block 8, groups of 16)."""
    # With a diagonal Hessian no error moves, so parameters and codes equal round-to-nearest's exactly.
    g = torch.Generator().manual_seed(13)
    w = torch.randn(6, 64, generator=g)
    spec = QuantSpec(bits=4, symmetric=symmetric, granularity="group", group_size=16)
    cfg = GPTQConfig(block_size=8, act_order=False, static_groups=False)
    result, _, _ = gptq_quantize(w, torch.diag(torch.rand(64, generator=g) + 0.5), spec, cfg, torch.float16)
    rtn = compute_qparams(w, spec, torch.float16)
    assert result.g_idx is None
    assert torch.equal(result.qparams.scale, rtn.scale)
    assert result.qparams.zero is None if symmetric else torch.equal(result.qparams.zero, rtn.zero)
    assert torch.equal(result.codes, quantize(w, rtn, spec))


def _pass_work(w: torch.Tensor, spec: QuantSpec, h: torch.Tensor, **fields: object) -> LayerWork:
    """A LayerWork of one linear `lin` (role down) holding weight `w`, its Hessian and the given statistics."""
    from torch import nn

    block = nn.ModuleDict({"lin": nn.Linear(w.shape[1], w.shape[0], bias=False)})
    block["lin"].weight.data = w.clone()
    return LayerWork(index=0, block=block, linears={"lin": "down"}, specs={"lin": spec}, scale_dtype=torch.float16,
                     hessians={"down": h.clone()}, **fields)


def test_gptq_pass_quantizes_with_the_clip_search_ratios() -> None:
    """The GPTQ pass sweeps with the ratios a clipping search left in `work.clip`, as gptq_quantize(clip=...) does."""
    from quantkit.passes.gptq import GPTQ

    w, h, _ = _problem(n=8, k=64, seed=14)
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=16)
    cfg = GPTQConfig(block_size=16, act_order=False, static_groups=True)
    ratios = torch.linspace(0.6, 1.0, 8)[:, None].repeat(1, 4)
    work = _pass_work(w, spec, h, clip={"lin": ratios})
    GPTQ(cfg).run(work)
    expected, _, _ = gptq_quantize(w, h, spec, cfg, torch.float16, clip=ratios)
    plain, _, _ = gptq_quantize(w, h, spec, cfg, torch.float16)
    got = work.results["lin"]
    assert torch.equal(got.qparams.scale, expected.qparams.scale) and torch.equal(got.codes, expected.codes)
    assert not torch.equal(got.qparams.scale, plain.qparams.scale)
    assert "down" not in work.hessians  # consumed


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_pass_forms_groups_along_the_layers_column_order(act_order: bool) -> None:
    """The GPTQ pass visits a given column order (Atom) whatever act_order says, its groups and outliers along it."""
    # The factor's permutation is the order, and the result equals gptq_with_factor's along it.
    from quantkit.passes.gptq import GPTQ, factor_hessian, gptq_with_factor

    w, h, _ = _problem(n=8, k=64, seed=15)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=16, outliers=16)
    cfg = GPTQConfig(block_size=16, act_order=act_order, static_groups=False)
    factor = factor_hessian(h, cfg, order=order)
    assert torch.equal(factor.perm, order) and factor.ordered
    expected, _ = gptq_with_factor(w, factor, spec, cfg, torch.float16)
    work = _pass_work(w, spec, h, column_order={"down": order})
    GPTQ(cfg).run(work)
    got = work.results["lin"]
    assert got.g_idx[order].tolist() == [0] * 16 + [1] * 16 + [2] * 16 + [3] * 16
    assert torch.equal(got.g_idx, expected.g_idx) and torch.equal(got.codes, expected.codes)
    assert torch.equal(got.qparams.scale, expected.qparams.scale)


def test_rtn_pass_splits_atom_outliers_without_a_column_order() -> None:
    """RTN with an Atom spec but no column order puts the INT8 outliers on the last columns in natural order."""
    # Exactly ordered_quantize along the identity order, as the README says ("natural order without it").
    from quantkit.passes.rtn import RTN, RTNConfig
    from quantkit.quantizers import ordered_quantize

    w, h, _ = _problem(n=8, k=64, seed=16)
    w[:, 48:] *= 20  # outlier columns: INT4 codes of them would saturate
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=16, outliers=16, row_block=2)
    work = _pass_work(w, spec, h)
    RTN(RTNConfig()).run(work)
    got = work.results["lin"]
    codes, qp, g_idx = ordered_quantize(w, spec, torch.arange(64), torch.float16)
    assert got.g_idx.tolist() == [0] * 16 + [1] * 16 + [2] * 16 + [3] * 16 and torch.equal(got.g_idx, g_idx)
    assert torch.equal(got.codes, codes) and torch.equal(got.qparams.scale, qp.scale)
    assert got.codes[:, 48:].abs().max() > 7


def test_blocked_cholesky_inverse_covers_every_block_of_columns() -> None:
    """The off-CPU (L L^T)^-1, one block of identity columns at a time, is right in every block, the partial last."""
    # Blocks of 4 over K = 10, checked in float64 against torch.linalg.inv.
    from quantkit.passes.gptq import _cholesky_inverse

    x = torch.randn(40, 10, generator=torch.Generator().manual_seed(17), dtype=torch.float64)
    a = x.T @ x + 0.1 * torch.eye(10, dtype=torch.float64)
    out = torch.empty_like(a)
    _cholesky_inverse(torch.linalg.cholesky(a), out, block=4)
    torch.testing.assert_close(out, torch.linalg.inv(a), rtol=1e-9, atol=1e-12)
