"""Every transform pass leaves the FP model's function unchanged: logits before and after agree."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module", params=[
    SyntheticLlama(hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=6,
                   num_key_value_heads=2, tie_word_embeddings=True),
    SyntheticLlama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, model_type="qwen2",
                   attention_bias=True),
    SyntheticLlama(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, model_type="mistral", head_dim=64),
    SyntheticLlama(hidden_size=128, intermediate_size=256, num_hidden_layers=2, attention_bias=True),
], ids=["llama-192-tied-gqa", "qwen2-256-bias", "mistral-128-head-dim-64", "llama-128-attention-bias"])
def synthetic(request, tmp_path_factory) -> Path:
    return write_synthetic_llama(tmp_path_factory.mktemp("syn") / "model", request.param)


def test_fold_norms_preserves_logits(synthetic):
    _assert_same_function(synthetic, [("fold_norms", {})])


def test_rotation_preserves_logits(synthetic):
    _assert_same_function(synthetic, QOQ_TRANSFORMS)


def test_rotation_preserves_logits_on_stories260k(stories260k):
    _assert_same_function(stories260k, QOQ_TRANSFORMS)


@pytest.mark.parametrize("name", ["reorder", "smooth_attention", "smooth"])
def test_pass_preserves_logits(synthetic, name):
    _assert_same_function(synthetic, [(name, {})])


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
