"""Hessians a block collects for GPTQ and clipping: H = 2/n X^T diag(weights) X per role."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from quantkit.models.block import BlockRunner, build_block
from quantkit.models.source import open_model
from quantkit.passes import LayerWork
from quantkit.passes.base import token_weights
from quantkit.recipe import RecipeError, load_recipe
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama


@pytest.fixture(scope="module")
def block_work(tmp_path_factory):
    path = write_synthetic_llama(tmp_path_factory.mktemp("hess") / "llama",
                                 SyntheticLlama(hidden_size=64, intermediate_size=128, num_hidden_layers=1))
    source = open_model(path)
    runner = BlockRunner(source, 16, batch_size=2)  # 3 sequences: chunks of 2 and 1
    inputs = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(0))

    def make(sink_weight: float | None, token_cap: float | None = None) -> LayerWork:
        linears = {n: r for r, n in source.adapter.linear_names()}
        return LayerWork(index=0, block=build_block(source, 0), linears=linears, specs={}, inputs=inputs,
                         runner=runner, adapter=source.adapter, config=source.config, sink_weight=sink_weight,
                         token_cap=token_cap)
    return make


def _linear_inputs(work: LayerWork) -> dict[str, torch.Tensor]:
    """Inputs [n_seq, L, K] of the first linear of each role, captured by plain hooks."""
    firsts: dict[str, str] = {}
    for name, role in work.linears.items():
        firsts.setdefault(role, name)
    seen: dict[str, list[torch.Tensor]] = {r: [] for r in firsts}
    work.forward({name: (lambda x, r=role: seen[r].append(x.detach().clone())) for role, name in firsts.items()})
    return {r: torch.cat(xs) for r, xs in seen.items()}


def test_token_weights_by_hand():
    # energies |x|^2 of two sequences of four tokens: median 4
    x = torch.tensor([[[10.0], [2.0], [1.0], [2.0]],
                      [[0.0], [3.0], [2.0], [20.0]]])
    assert torch.equal(token_weights(x, None, None), torch.ones(2, 4))
    # first tokens count as 3 median tokens (12 = w * 100 and 0 stays 0); others as they are
    torch.testing.assert_close(token_weights(x, 3.0, None), torch.tensor([[0.12, 1, 1, 1], [1, 1, 1, 1]]))
    # any other token weighs at most 5 median tokens (20): the 400 becomes 20
    torch.testing.assert_close(token_weights(x, 3.0, 5.0), torch.tensor([[0.12, 1, 1, 1], [1, 1, 1, 0.05]]))


@pytest.mark.parametrize("sink_weight,token_cap", [(None, None), (7.0, None), (64.0, 2.0)])
def test_hessian_is_weighted_gram_of_linear_inputs(block_work, sink_weight, token_cap):
    work = block_work(sink_weight, token_cap)
    xs = _linear_inputs(work)
    y = work.collect_hessians()
    assert torch.allclose(y, work.forward())  # the collecting pass returns the block outputs
    for role, x in xs.items():
        n = x.shape[0] * x.shape[1]
        weights = torch.cat([token_weights(chunk, sink_weight, token_cap) for chunk in x.split(2)])  # per chunk
        flat = (x * weights.sqrt().unsqueeze(-1)).reshape(n, -1)
        expected = 2.0 / n * flat.T @ flat
        torch.testing.assert_close(work.hessians[role], expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
        if sink_weight is not None:  # the sink's share of the trace is what it was given, whatever its size
            energy = (x * x).sum(-1)
            assert torch.allclose(weights[:, 0] * energy[:, 0],
                                  sink_weight * torch.stack([c.median() for c in energy.split(2)]).repeat_interleave(
                                      torch.tensor([2, 1])), rtol=1e-5)


def test_token_weights_are_validated():
    recipe = load_recipe("gptq-w4a16-g128")
    assert recipe.calibration.sink_weight is not None  # the bundled GPTQ recipes weight the sink
    for field in ("sink_weight", "token_cap"):
        with pytest.raises(RecipeError, match=field):
            load_recipe("gptq-w4a16-g128", overrides=[f"calibration.{field}=0"])


@pytest.mark.parametrize("k,blocks", [(64, 3), (500, 2), (577, 3)])
def test_blocked_gram_equals_full_product(k, blocks):
    from quantkit.passes.base import add_gram_

    x = torch.randn(300, k, generator=torch.Generator().manual_seed(k))
    h = torch.ones(k, k)
    add_gram_(h, x, blocks)
    torch.testing.assert_close(h, 1.0 + x.T @ x, rtol=1e-5, atol=1e-3)
    assert torch.equal(h, h.T)


def test_quantized_hessian_inputs_are_the_simulations_inputs(block_work):
    """calibration.hessian_inputs: quantized (Atom): each role's Hessian is 2/n X^T X^ of its input as the deployed
    activation simulation quantizes it, groups and INT8 outliers formed along the role's column order exactly as
    the g_idx the weight quantizer records for it."""
    from quantkit.quantizers import QuantSpec, ordered_quantize
    from quantkit.simulate import ActivationSim, fake_quantize_activation

    work = block_work(None)
    inputs = _linear_inputs(work)
    sim = ActivationSim(bits=4, group_size=16, outliers=16, clip_ratio=0.9)
    work.hessian_sim = sim
    g = torch.Generator().manual_seed(3)
    for role, x in inputs.items():
        work.column_order[role] = torch.randperm(x.shape[-1], generator=g)
    work.collect_hessians()
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=16, outliers=16)
    for role, x in inputs.items():
        w = torch.randn(8, x.shape[-1], generator=g)
        _, _, g_idx = ordered_quantize(w, spec, work.column_order[role])  # what the deployed linear records
        xq = fake_quantize_activation(x, sim, g_idx)
        assert torch.equal(work.quantized_input(role, x), xq)
        assert not torch.equal(xq, x)
        flat = xq.reshape(-1, xq.shape[-1]).double()
        torch.testing.assert_close(work.hessians[role].double(), 2 / flat.shape[0] * flat.T @ flat,
                                   rtol=1e-5, atol=1e-6)


def test_quantized_hessian_inputs_need_activations():
    from quantkit.recipe import parse_recipe

    raw = {"name": "x", "weights": {"bits": 4}, "calibration": {"hessian_inputs": "quantized"},
           "passes": [{"name": "gptq"}]}
    with pytest.raises(RecipeError, match="needs an `activations` section"):
        parse_recipe(raw)
    with pytest.raises(RecipeError, match="hessian_inputs"):
        parse_recipe({**raw, "calibration": {"hessian_inputs": "fake"}})


def test_clip_grid_runs_from_one_down_to_min_ratio_inclusive():
    from quantkit.passes.clip import _grid

    assert _grid(0.5, 0.02) == pytest.approx([1.0 - 0.02 * i for i in range(26)])
    assert _grid(0.6, 0.05)[-1] == pytest.approx(0.6) and len(_grid(0.6, 0.05)) == 9
    assert _grid(1.0, 0.1) == [1.0]


def test_hessian_clip_search_is_the_brute_force_argmin_per_row_and_group():
    """QServe's clipping objective per (row, group): d_g^T H_gg d_g with d = w - fake_quant(w; ratio), H_gg the
    group's diagonal block of the Hessian (off-diagonal blocks ignored). The search returns, for every (row,
    group), the first ratio of least error and that error: checked against explicit loops with a hand-written
    symmetric 4-bit fake quantizer (scale = ratio x amax / 7.5)."""
    from quantkit.passes.clip import hessian_clip_search
    from quantkit.quantizers import QuantSpec

    g = torch.Generator().manual_seed(8)
    n, k, gs = 3, 24, 8
    w = torch.randn(n, k, generator=g)
    w[1, gs:2 * gs] = 0  # an all-zero group: every ratio ties at 0, and the first (1, no clipping) is kept
    x = torch.randn(64, k, generator=g) + torch.randn(64, 1, generator=g)  # correlated columns
    h = 2 * x.T @ x / 64
    ratios = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    spec = QuantSpec(bits=4, symmetric=True, granularity="group", group_size=gs)
    best, err = hessian_clip_search(w, h, spec, torch.float32, ratios)
    assert best.shape == err.shape == (n, k // gs)
    chosen = 0
    for r in range(n):
        for grp in range(k // gs):
            cols = slice(grp * gs, (grp + 1) * gs)
            v = w[r, cols].double()
            block = h[cols, cols].double()
            errors = []
            for ratio in ratios:
                scale = float(v.abs().max()) * ratio / 7.5 or 1.0  # a zero group keeps scale 1
                d = v - torch.clamp(torch.round(v / scale), -8, 7) * scale
                errors.append(float(d @ block @ d))
            i = min(range(len(ratios)), key=lambda j, e=errors: e[j])
            assert float(best[r, grp]) == pytest.approx(ratios[i]), (r, grp, errors)
            assert float(err[r, grp]) == pytest.approx(errors[i], rel=1e-4)
            chosen += i > 0
    assert chosen > 0  # not vacuous: some group is clipped
    assert float(best[1, 1]) == 1.0 and float(err[1, 1]) == 0.0


def test_attention_clip_ratio_minimizes_the_attention_output_error(block_work):
    """q_proj / k_proj take the one ratio of the coarse grid (1 down to 0.6 by 0.05) whose fake-quantized weight
    moves the attention module's output least (squared error), and the FP weight is left in place afterwards."""
    from quantkit.passes.clip import Clip, ClipConfig
    from quantkit.quantizers import QuantSpec, fake_quantize

    work = block_work(None)
    name = work.adapter.q_proj
    spec = QuantSpec(bits=3, symmetric=True, granularity="channel")
    work.specs[name] = spec
    module = work.module(name)
    original = module.weight.data.clone()
    reference = work.attention_output(4)
    errors = {}
    for i in range(9):
        ratio = 1.0 - 0.05 * i
        module.weight.data = fake_quantize(original, QuantSpec(bits=3, symmetric=True, granularity="channel",
                                                               clip_ratio=ratio), torch.float16)
        errors[ratio] = float((work.attention_output(4) - reference).pow(2).sum())
    module.weight.data = original.clone()
    chosen = Clip(ClipConfig())._attention_ratio(work, name, reference)
    assert torch.equal(module.weight.data, original)
    assert chosen == pytest.approx(min(errors, key=errors.get))
    assert max(errors.values()) > 1.01 * min(errors.values())  # not vacuous: the ratios differ


def test_clip_grid_count_survives_float_error() -> None:
    """The clip grid still ends at min_ratio when (1 - min_ratio) / step falls just below an integer."""
    # (1 - 0.7) / 0.1 and (1 - 0.4) / 0.2 are both 2.9999999999999996: rounded, not truncated, the count is 3.
    from quantkit.passes.clip import _grid

    assert _grid(0.7, 0.1) == pytest.approx([1.0, 0.9, 0.8, 0.7])
    assert _grid(0.4, 0.2) == pytest.approx([1.0, 0.8, 0.6, 0.4])


def test_clip_pass_gives_q_and_k_one_attention_ratio_and_the_rest_hessian_ratios(
        block_work: Callable[..., LayerWork]) -> None:
    """The clip pass gives q_proj and k_proj the attention objective's one ratio, other linears the Hessian search's;
    the two attention searches share one reference output (one attention forward a candidate, and one more)."""
    from quantkit.passes.clip import Clip, ClipConfig, _grid, hessian_clip_search
    from quantkit.quantizers import QuantSpec

    work = block_work(None)
    spec = QuantSpec(bits=3, symmetric=True, granularity="group", group_size=32)
    work.specs = dict.fromkeys(work.linears, spec)
    clip = Clip(ClipConfig())
    forwards = []
    attention_output = work.attention_output
    work.attention_output = lambda samples=None: forwards.append(samples) or attention_output(samples)
    clip.run(work)
    del work.attention_output  # the method again
    assert forwards == [4] * (1 + 2 * len(_grid(0.6, 0.05)))
    a = work.adapter
    for name in (a.q_proj, a.k_proj):
        assert isinstance(work.clip[name], float), name
        assert work.clip[name] == clip._attention_ratio(work, name, work.attention_output(4))
    for name in set(work.linears) - {a.q_proj, a.k_proj}:
        w = work.weight(name).detach().float()
        expected, _ = hessian_clip_search(w, work.hessian(name), spec, work.scale_dtype, _grid(0.5, 0.02))
        assert torch.equal(work.clip[name], expected), name
