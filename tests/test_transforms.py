"""Every transform pass leaves the FP model's function unchanged: logits before and after agree."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transform_harness import logits, original_model, transformed_model

from quantkit.hadamard import HadamardError, hadamard, rotation
from quantkit.quantizers import QuantSpec
from quantkit.recipe import RecipeError, load_recipe
from quantkit.synthetic import SyntheticLlama, write_synthetic_llama

QOQ_TRANSFORMS = [("fold_norms", {}), ("rotate", {})]
PER_CHANNEL = QuantSpec(bits=4, symmetric=False, granularity="channel")  # stories260K: 172 = 4 x 43
ALL_TRANSFORMS = [("fold_norms", {}), ("rotate", {}), ("reorder", {}), ("smooth_attention", {}),
                  ("smooth", {})]


def _tokens(vocab: int, n: int = 4, length: int = 48) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))


def _assert_same_function(model_dir: Path, passes: list[tuple[str, dict]], tol: float = 2e-3,
                          metrics: list[dict] | None = None, spec: QuantSpec | None = None) -> None:
    ref = original_model(model_dir)
    tokens = _tokens(ref.config.vocab_size)
    a = logits(ref, tokens)
    b = logits(transformed_model(model_dir, passes, tokens, spec=spec, metrics=metrics), tokens)
    rel = float((a - b).abs().max() / a.abs().max())
    assert rel < tol, f"logits moved by {rel:.2e} of their range"
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.99


SPECS = [
    SyntheticLlama(hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=6,
                   num_key_value_heads=2, tie_word_embeddings=True),
    SyntheticLlama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, model_type="qwen2",
                   attention_bias=True),
    SyntheticLlama(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, model_type="mistral", head_dim=64),
    SyntheticLlama(hidden_size=128, intermediate_size=256, num_hidden_layers=2, attention_bias=True),
]
SPEC_IDS = ["llama-192-tied-gqa", "qwen2-256-bias", "mistral-128-head-dim-64", "llama-128-attention-bias"]


@pytest.fixture(scope="module", params=SPECS, ids=SPEC_IDS)
def synthetic(request, tmp_path_factory) -> Path:
    return write_synthetic_llama(tmp_path_factory.mktemp("syn") / "model", request.param)


@pytest.fixture(scope="module", params=[replace(s, qk_std=0.15) for s in SPECS], ids=SPEC_IDS)
def peaked(request, tmp_path_factory) -> Path:
    """The same models with q_proj and k_proj at std 0.15, not 0.02: attention that peaks, as a trained model's
    does, where near-uniform attention hides a wrong scaling of queries or keys from the logits."""
    return write_synthetic_llama(tmp_path_factory.mktemp("peaked") / "model", request.param)


def test_fold_norms_preserves_logits(synthetic):
    _assert_same_function(synthetic, [("fold_norms", {})])


def test_rotation_preserves_logits(synthetic):
    _assert_same_function(synthetic, QOQ_TRANSFORMS)


def test_rotation_preserves_logits_on_stories260k(stories260k):
    _assert_same_function(stories260k, QOQ_TRANSFORMS)


@pytest.mark.parametrize("name", ["reorder", "smooth_attention", "smooth"])
def test_pass_preserves_logits(synthetic, name):
    _assert_same_function(synthetic, [(name, {})])


@pytest.mark.parametrize("passes", [[("smooth_attention", {})], QOQ_TRANSFORMS, ALL_TRANSFORMS],
                         ids=["smooth_attention", "rotate", "all"])
def test_query_and_key_transforms_preserve_logits_with_peaked_attention(peaked, passes):
    """SmoothAttention's per-channel lambda (keys divided, each query head multiplied by its KV head's) and the
    rotation of q/k's inputs leave the function unchanged where attention peaks, so that a query scaled the wrong
    way or by another head's lambda moves the logits past the tolerance."""
    _assert_same_function(peaked, passes)


EVERY_POINT = ["qkv", "o", "gate_up", "down"]


@pytest.mark.parametrize("config", [
    {"targets": EVERY_POINT, "method": "threshold", "thresholds": 20},
    {"targets": EVERY_POINT, "method": "alpha", "alphas": [0.3, 0.5, 0.8]},
    {"targets": EVERY_POINT, "method": "threshold", "thresholds": 20, "gqa_output": "skip"},
], ids=["threshold", "alpha", "threshold-skip-gqa"])
def test_smoothing_every_point_preserves_logits(synthetic, config):
    """Scales folded into the input norm (qkv), v_proj rows and bias (o), the post-attention norm (gate_up) and
    up_proj rows (down) leave the function unchanged, and the search chose to smooth somewhere."""
    metrics: list[dict] = []
    _assert_same_function(synthetic, [("smooth", config)], metrics=metrics)
    label = "smooth_sigma" if config["method"] == "threshold" else "smooth_alpha"
    chosen = [v for m in metrics for k, v in m.items() if k.endswith(label)]
    cfg = json.loads((synthetic / "config.json").read_text())
    skipped = config.get("gqa_output") == "skip" and cfg["num_key_value_heads"] != cfg["num_attention_heads"]
    assert len(chosen) == len(metrics) * (4 - skipped) and any(v >= 0 for v in chosen)


def test_threshold_smoothing_scales_only_channels_beyond_sigma():
    """QQQ's adaptive smoothing: lambda_j = max(1, max|X_j| / sigma), so after it no channel exceeds sigma and
    the channels already inside keep lambda = 1; the grid runs from max|X| (nothing scaled) down to 0.1."""
    from quantkit.passes.smooth import Smooth, SmoothConfig

    x = torch.tensor([[0.5, -8.0, 2.0, 0.05], [-1.0, 4.0, -3.0, 0.0]])
    weights = [torch.ones(3, 4)]
    smooth = Smooth(SmoothConfig(method="threshold", thresholds=4))
    candidates = smooth._candidates(x, weights, torch.arange(4))
    sigmas = [s for s, _ in candidates]
    assert sigmas == pytest.approx([8 - 7.9 * i / 4 for i in range(1, 5)])  # down to 0.1, as QQQ's grid
    for sigma, lam in candidates:
        assert torch.allclose(lam, (x.abs().amax(0).clamp(min=1e-5) / sigma).clamp(min=1.0))
        assert ((x / lam).abs().amax(0) <= sigma + 1e-6).all()
    assert candidates[0][1].tolist() == pytest.approx([1.0, 8 / sigmas[0], 1.0, 1.0])


def test_coarse_to_fine_search_finds_the_grid_minimum_of_unimodal_errors():
    from quantkit.passes.smooth import _search

    for count in (1, 7, 10, 11, 100, 101):
        for target in range(count):
            calls: list[int] = []

            def error(i: int, target: int = target, calls: list[int] = calls) -> float:
                calls.append(i)
                return abs(i - target) ** 1.5

            assert _search(count, error, 10) == target
            assert len(set(calls)) <= -(-count // 10) + 19
    assert _search(0, lambda i: 0.0, 10) is None


def test_all_qoq_transforms_preserve_logits_on_stories260k(stories260k):
    metrics: list[dict] = []
    _assert_same_function(stories260k, ALL_TRANSFORMS, metrics=metrics, spec=PER_CHANNEL)
    alphas = [v for m in metrics for k, v in m.items() if k.endswith("smooth_alpha")]
    assert len(alphas) == 2 * 5 and any(a >= 0 for a in alphas)  # the search chose to smooth somewhere


def test_smooth_attention_flattens_keys(stories260k):
    """After SmoothAttention the post-RoPE keys' outlier ratio (max / median of per-channel max) drops."""
    tokens = _tokens(512, 2, 32)
    before: list[dict] = []
    transformed_model(stories260k, [("smooth_attention", {})], tokens, metrics=before)
    after: list[dict] = []
    transformed_model(stories260k, [("smooth_attention", {}), ("smooth_attention", {"alpha": 0.0})], tokens,
                      metrics=after)
    ratio = "smooth_attention.key_absmax_ratio"
    assert all(a[ratio] < b[ratio] for a, b in zip(after, before, strict=True))


def test_rotation_changes_weights(synthetic):
    """Not vacuous: the rotated model's weights differ from the original's."""
    tokens = _tokens(512, 1, 8)
    ref = original_model(synthetic)
    rot = transformed_model(synthetic, QOQ_TRANSFORMS, tokens)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(ref.state_dict()[name], rot.state_dict()[name], atol=1e-3)


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 64, 192, 576, 896, 960, 1536, 3584, 5120])
def test_hadamard_orders(n):
    h = hadamard(n)
    assert set(h.unique().tolist()) <= {-1, 1}
    hf = h.double()  # float64 sums of +-1 up to n are exact, and BLAS-fast unlike int64 matmul
    assert torch.equal(hf @ hf.T, n * torch.eye(n, dtype=torch.float64))
    q = rotation(n)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("n", [6, 188])
def test_hadamard_impossible_orders_are_named(n):
    with pytest.raises(HadamardError, match=str(n)):
        hadamard(n)


def test_rotate_without_fold_norms_is_refused():
    with pytest.raises(RecipeError, match="rotate needs fold_norms"):
        load_recipe("rtn-w4a16-g128", ["passes=[{name: rotate}, {name: rtn}]"])


def _gqa_block_work(tmp_path: Path):
    """A GQA block (4 query heads over 2 KV heads of width 16) with 3 calibration sequences run in chunks of 2
    and 1, so statistics must be gathered over every chunk."""
    from quantkit.models.block import BlockRunner, build_block
    from quantkit.models.source import open_model
    from quantkit.passes import LayerWork

    config = SyntheticLlama(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2)
    source = open_model(write_synthetic_llama(tmp_path / "gqa", config))
    linears = {n: r for r, n in source.adapter.linear_names()}
    inputs = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(4))
    return LayerWork(index=0, block=build_block(source, 0), linears=linears, specs=dict.fromkeys(linears, PER_CHANNEL),
                     inputs=inputs, runner=BlockRunner(source, 16, batch_size=2), adapter=source.adapter,
                     config=source.config)


def _absmax_inputs(work, names: list[str]) -> dict[str, torch.Tensor]:
    """max |x| per input channel of each named linear over all calibration tokens, from plain hooks."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    work.forward({n: (lambda x, n=n: seen[n].append(x.detach().reshape(-1, x.shape[-1]))) for n in names})
    return {n: torch.cat(xs).abs().amax(dim=0) for n, xs in seen.items()}


def test_reorder_sorts_input_channels_by_ascending_salience(tmp_path):
    """After reorder, the down_proj input channels come in ascending max|X|, and within each head the o_proj
    input channels come in ascending max|X| max-pooled over the query heads of the head's KV group (one
    permutation per KV head, shared by its query heads), measured on the transformed block."""
    from quantkit.passes.reorder import Reorder, ReorderConfig

    work = _gqa_block_work(tmp_path)
    a = work.adapter
    q = work.weight(a.q_proj).data
    for head in (1, 3):  # sharper attention in one query head of each group: the heads' saliences differ
        q[head * 16:(head + 1) * 16] *= 30
    before = _absmax_inputs(work, [a.o_proj, a.down_proj])
    Reorder(ReorderConfig()).run(work)
    after = _absmax_inputs(work, [a.o_proj, a.down_proj])
    down = after[a.down_proj]
    assert (down[1:] >= down[:-1]).all()
    torch.testing.assert_close(down.sort().values, before[a.down_proj].sort().values)  # the same channels, reordered
    pooled = after[a.o_proj].reshape(2, 2, 16).amax(dim=1)  # [KV head, channel]
    assert (pooled[:, 1:] >= pooled[:, :-1]).all()


def test_smooth_attention_scales_by_the_pair_maximum_of_the_keys(tmp_path):
    """SmoothAttention: lambda = max(max|K_i|, max|K_i+D/2|)^alpha per KV channel i (max over every calibration
    token and chunk, tied across the RoPE pair), k_proj rows divided by it and the q_proj rows of each query head
    of the KV group multiplied by it. The expected scales are built from the observed keys by explicit loops."""
    from quantkit.passes.smooth import SmoothAttention, SmoothAttentionConfig

    work = _gqa_block_work(tmp_path)
    a = work.adapter
    keys: list[torch.Tensor] = []
    work.forward(attention_observer=lambda k, v: keys.append(k.detach().clone()))
    m = torch.cat(keys).abs().amax(dim=(0, 2))  # [H_kv, D]
    k_before = work.weight(a.k_proj).detach().clone()
    q_before = work.weight(a.q_proj).detach().clone()
    SmoothAttention(SmoothAttentionConfig(alpha=0.3)).run(work)
    lam_k = torch.empty(2 * 16)
    lam_q = torch.empty(4 * 16)
    for kv in range(2):
        for i in range(16):
            lam = float(max(m[kv, i % 8], m[kv, i % 8 + 8])) ** 0.3
            lam_k[kv * 16 + i] = lam
            for head in (2 * kv, 2 * kv + 1):  # the query heads reading KV head kv
                lam_q[head * 16 + i] = lam
    torch.testing.assert_close(work.weight(a.k_proj).detach(), k_before / lam_k[:, None], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(work.weight(a.q_proj).detach(), q_before * lam_q[:, None], rtol=1e-5, atol=1e-7)


def test_alpha_candidates_by_hand():
    """SmoothQuant's lambda_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha), both maxima pooled over the channels of
    one group (the o point under GQA: the channels that share a v_proj row)."""
    from quantkit.passes.smooth import Smooth, SmoothConfig

    x = torch.tensor([[1.0, -4.0, 2.0, 0.5], [0.5, 1.0, -1.0, 0.25]])  # max|X| per channel: 1, 4, 2, 0.5
    weights = [torch.tensor([[2.0, 1.0, -1.0, 4.0]]), torch.tensor([[0.5, -0.5, 0.5, 1.0]])]  # max|W|: 2 1 1 4
    smooth = Smooth(SmoothConfig(alphas=[0.0, 0.5, 1.0]))
    candidates = smooth._candidates(x, weights, torch.tensor([0, 0, 1, 1]))
    # pooled: max|X| = 4, 4, 2, 2 and max|W| = 2, 2, 4, 4
    assert [a for a, _ in candidates] == [0.0, 0.5, 1.0]
    assert candidates[0][1].tolist() == pytest.approx([0.5, 0.5, 0.25, 0.25])
    assert candidates[1][1].tolist() == pytest.approx([2 ** 0.5, 2 ** 0.5, 2 ** -0.5, 2 ** -0.5])
    assert candidates[2][1].tolist() == pytest.approx([4.0, 4.0, 2.0, 2.0])
    ungrouped = smooth._candidates(x, weights, torch.arange(4))
    assert ungrouped[1][1].tolist() == pytest.approx([0.5 ** 0.5, 2.0, 2 ** 0.5, 0.125 ** 0.5])


def test_every_small_order_is_a_true_hadamard_or_refused():
    """For every multiple of 4 up to 400 (and 1, 2), `hadamard` returns a +-1 matrix with H H^T = n I or raises
    HadamardError: never a wrong matrix from a Paley construction on a non-prime q (25 for 52, 49 for 100, ...)."""
    built = 0
    for n in [1, 2, *range(4, 401, 4)]:
        try:
            h = hadamard(n).double()
        except HadamardError:
            continue
        built += 1
        assert set(h.unique().tolist()) <= {-1.0, 1.0}, n
        assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)), n
    assert built > 80  # most orders are built


def test_coarse_to_fine_search_reaches_a_full_stride_either_side_of_the_coarse_best():
    """The fine pass covers every index within one stride of the coarse best, both ends included: errors steep on
    one side put the minimum stride - 1 away from the coarse winner (11 from 20, 9 from 0, stride 10)."""
    from quantkit.passes.smooth import _search

    def lopsided(target: int, left: float, right: float):
        return lambda i: left * (target - i) if i < target else right * (i - target)

    assert _search(30, lopsided(11, 100.0, 1.0), 10) == 11  # coarse best 20 (error 9) beats 10 (error 100)
    assert _search(30, lopsided(9, 1.0, 100.0), 10) == 9  # coarse best 0 (error 9) beats 10 (error 100)


def test_smoothing_objective_by_hand():
    """The error a smoothing candidate is judged by: the point's output with the consumers' weights quantized and,
    when the recipe simulates them, the activations quantized per token (act_bits), against the FP output; gate_up
    measures SiLU(gate) * up. Worked by hand: x = [1, -0.3, 0.6] per-token 4-bit is [1, -2/7, 4/7] (s = 1/7: -2.1 and
    4.2 round to -2 and 4), and an 8-bit symmetric identity row dequantizes to c = 127 / 127.5."""
    import math

    from torch import nn

    from quantkit.passes import LayerWork
    from quantkit.passes.smooth import Smooth, SmoothConfig, _point_output

    x = torch.tensor([[1.0, -0.3, 0.6]])
    eye = torch.eye(3)
    spec = QuantSpec(bits=8, symmetric=True, granularity="channel")
    c = 127 / 127.5
    smooth = Smooth(SmoothConfig())
    for act_bits, expected in ((None, (c - 1) ** 2 * (1 + 0.09 + 0.36)),
                               (4, (c - 1) ** 2 + (-2 / 7 * c + 0.3) ** 2 + (4 / 7 * c - 0.6) ** 2)):
        work = LayerWork(index=0, block=nn.ModuleDict(), linears={}, specs={"lin": spec}, scale_dtype=torch.float32,
                         act_bits=act_bits)
        assert smooth._error(work, "o", ["lin"], x, [eye], x) == pytest.approx(expected, rel=1e-4)
    gate, up = torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[3.0, 1.0, 0.0]])  # gate 1, up 2.7
    out = _point_output("gate_up", x, [gate, up])
    assert out[0].tolist() == pytest.approx([2.7 / (1 + math.exp(-1))])
    assert _point_output("qkv", x, [gate, up])[0].tolist() == pytest.approx([1.0, 2.7])


def test_smoothing_samples_skip_the_first_token(tmp_path):
    """The objective's tokens are evenly spaced from half a step in: with max_tokens 8 of one 16-token sequence,
    tokens 1, 3, ..., 15 (never the attention sink at 0, which would otherwise get a share it should not have)."""
    from quantkit.passes.smooth import Smooth, SmoothConfig

    work = _gqa_block_work(tmp_path)
    name = work.adapter.down_proj
    seen: list[torch.Tensor] = []
    work.forward({name: lambda x: seen.append(x.detach().clone())}, samples=1)
    rows = Smooth(SmoothConfig(max_tokens=8))._sample_inputs(work, [name])[name]
    assert torch.equal(rows, seen[0][0, 1::2])


def test_smoothing_that_only_ties_no_smoothing_leaves_the_block_alone(tmp_path):
    """A candidate must beat no smoothing strictly: with down_proj's columns scaled to max|W| = 1 exactly and the
    grid {alpha = 0}, lambda = 1 / max|W| = 1 everywhere, its error ties the unsmoothed one, and the point is left
    as it was (metric -1, weights untouched)."""
    from quantkit.passes.smooth import Smooth, SmoothConfig

    work = _gqa_block_work(tmp_path)
    a = work.adapter
    down = work.weight(a.down_proj).data
    down.div_(down.abs().amax(dim=0))
    before = {n: work.weight(n).detach().clone() for n in (a.down_proj, a.up_proj)}
    x = torch.randn(64, down.shape[1], generator=torch.Generator().manual_seed(3))
    Smooth(SmoothConfig(targets=["down"], alphas=[0.0]))._smooth_point(work, "down", x)
    assert work.metrics[f"{a.down_proj}.smooth_alpha"] == -1.0
    assert all(torch.equal(work.weight(n), w) for n, w in before.items())


def test_alpha_candidates_take_max_w_over_every_consumer() -> None:
    """SmoothQuant's max|W_:,j| is taken over every consumer of the point, all of whose columns lambda multiplies."""
    # max|X| = [1, 4]; consumers [[1, 1]] and [[4, 0.25]] give max|W| = [4, 1], so alpha 0.5 gives
    # lambda = [sqrt(1 / 4), sqrt(4 / 1)] = [0.5, 2] (the first consumer alone would give [1, 2]).
    from quantkit.passes.smooth import Smooth, SmoothConfig

    x = torch.tensor([[1.0, -4.0], [0.5, 2.0]])
    weights = [torch.tensor([[1.0, 1.0]]), torch.tensor([[4.0, -0.25]])]
    candidates = Smooth(SmoothConfig(alphas=[0.5]))._candidates(x, weights, torch.arange(2))
    assert candidates[0][1].tolist() == [0.5, 2.0]


def test_kv_channels_pair_each_query_channel_with_its_kv_heads():
    """4 query heads of width 2 over 2 KV heads: heads 0 and 1 read KV head 0, heads 2 and 3 KV head 1, channel for
    channel; with as many KV heads as query heads (no GQA) every channel pairs with itself."""
    from types import SimpleNamespace

    from quantkit.models.adapters import adapter_for

    llama = adapter_for("llama")
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=8)
    assert llama.kv_channels(config).tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert llama.kv_channels(SimpleNamespace(num_attention_heads=4, num_key_value_heads=4, hidden_size=8)).tolist() \
        == list(range(8))
