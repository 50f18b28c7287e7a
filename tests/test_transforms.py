"""Every transform pass leaves the FP model's function unchanged: logits before and after agree."""

from __future__ import annotations

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
                  ("smooth_output", {})]


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
], ids=["llama-192-tied-gqa", "qwen2-256-bias"])
def synthetic(request, tmp_path_factory) -> Path:
    return write_synthetic_llama(tmp_path_factory.mktemp("syn") / "model", request.param)


def test_fold_norms_preserves_logits(synthetic):
    _assert_same_function(synthetic, [("fold_norms", {})])


def test_rotation_preserves_logits(synthetic):
    _assert_same_function(synthetic, QOQ_TRANSFORMS)


def test_rotation_preserves_logits_on_stories260k(stories260k):
    _assert_same_function(stories260k, QOQ_TRANSFORMS)


@pytest.mark.parametrize("name", ["reorder", "smooth_attention", "smooth_output"])
def test_pass_preserves_logits(synthetic, name):
    _assert_same_function(synthetic, [(name, {})])


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
