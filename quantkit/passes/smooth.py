"""Smoothing passes: per-channel scales moved between an activation and the weights that read it.

`smooth_attention` (QServe SmoothAttention, Eqs. 3-5): lambda = max|K|^alpha on post-RoPE keys, one lambda per KV
channel, tied across the RoPE pair (i, i + D/2) so it commutes with rotate_half RoPE; k_proj rows (and bias) are
divided by lambda and the q_proj rows of every query head of the group multiplied by it, so Q K^T is unchanged
and the quantized KV cache sees flatter keys.

`smooth` (SmoothQuant-family migration, one pass for QServe, QQQ and LiquidQuant): at each smoothing point, named
by the role that reads the activation X, X is divided by a per-channel lambda and the readers' input columns are
multiplied by it; the division is absorbed into the producer: the input norm's weight (qkv), v_proj rows (o; one
lambda per KV channel under GQA, or the point skipped with `gqa_output: skip`, as QQQ does), the post-attention
norm's weight (gate_up) or up_proj rows (down). lambda comes from a grid searched against the point's output error
with the readers' weights and (when the recipe simulates them) per-token activations quantized; the grid always
competes with "no smoothing":
- `method: alpha` (SmoothQuant; QServe's block-output smoothing uses alpha near 0):
  lambda_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha);
- `method: threshold` (QQQ's adaptive smoothing, OS+ scaling without shift): only channels whose max|X_j| exceeds
  a threshold sigma are scaled, into [-sigma, sigma]: lambda_j = max(1, max|X_j| / sigma), sigma on an even grid
  from max|X| down to 0.1 (QQQ steps by at most 0.5, so its grid grows with the outliers; ours has a fixed count).
The error is measured on the point's output: SiLU(gate) * up for gate_up (as QQQ's code), the linear outputs for
o and down, and the q, k, v outputs for qkv (QQQ's code uses the attention output there). The grid is searched
coarse to fine (every `stride`-th candidate, then every one within a stride of the best), which finds the grid's
minimum when the error is unimodal at the coarse scale and costs ~2 stride + count / stride evaluations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from quantkit import memory
from quantkit.models.adapters import ROLES
from quantkit.passes import register
from quantkit.passes.base import LayerWork, Pass
from quantkit.quantizers import fake_quantize, fake_quantize_per_token


def _scale_rows(module: torch.nn.Linear, factor: torch.Tensor) -> None:
    module.weight.data.mul_(factor[:, None].to(module.weight.dtype))
    if module.bias is not None:
        module.bias.data.mul_(factor.to(module.bias.dtype))


@dataclass(frozen=True)
class SmoothAttentionConfig:
    alpha: float = 0.5
    samples: int | None = None  # calibration sequences used for max|K| (all by default)

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.samples is not None and self.samples < 1:
            raise ValueError(f"samples must be at least 1 (or null: all), got {self.samples}")


@register
class SmoothAttention(Pass):
    name = "smooth_attention"
    Config = SmoothAttentionConfig
    transforms = True

    def run(self, work: LayerWork) -> None:
        d = work.head_dims()[2]
        amax: list[torch.Tensor] = []

        def observe(key: torch.Tensor, value: torch.Tensor) -> None:
            m = key.detach().abs().amax(dim=(0, 2)).float()  # [H_kv, D]
            amax[:] = [m if not amax else torch.maximum(amax[0], m)]

        work.observe_kv(observe, samples=self.config.samples)
        half = d // 2
        pair = torch.maximum(amax[0][:, :half], amax[0][:, half:])
        lam = pair.clamp(min=1e-5).pow(self.config.alpha)
        lam = torch.cat([lam, lam], dim=1)  # [H_kv, D]
        a = work.adapter
        _scale_rows(work.module(a.k_proj), 1.0 / lam.reshape(-1))
        _scale_rows(work.module(a.q_proj), lam.reshape(-1)[work.kv_channels().to(lam.device)])
        work.metrics["smooth_attention.key_absmax_ratio"] = float(amax[0].max() / amax[0].median().clamp(min=1e-9))


@dataclass(frozen=True)
class SmoothConfig:
    targets: list[str] = field(default_factory=lambda: ["o", "down"])  # points, by the role reading them
    method: Literal["alpha", "threshold"] = "alpha"
    alphas: list[float] = field(default_factory=lambda: [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4])
    thresholds: int = 100  # method threshold: candidates for sigma, evenly from max|X| down to 0.1
    stride: int = 10  # coarse-to-fine: every stride-th candidate, then all within one stride of the best (1: all)
    gqa_output: Literal["pool", "skip"] = "pool"  # the o point under GQA: one lambda per v row, or none (QQQ)
    max_tokens: int = 4096  # calibration tokens in the error objective

    def __post_init__(self) -> None:
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"alphas must be a non-empty list in [0, 1], got {self.alphas}")
        if not self.targets or any(t not in ROLES for t in self.targets) or len(set(self.targets)) != len(
                self.targets):
            raise ValueError(f"targets must be distinct roles among {', '.join(map(repr, ROLES))}, "
                             f"got {self.targets}")
        if self.method not in ("alpha", "threshold"):
            raise ValueError(f"method must be 'alpha' or 'threshold', got {self.method!r}")
        if self.thresholds < 1:
            raise ValueError(f"thresholds must be at least 1, got {self.thresholds}")
        if self.stride < 1:
            raise ValueError(f"stride must be at least 1, got {self.stride}")
        if self.gqa_output not in ("pool", "skip"):
            raise ValueError(f"gqa_output must be 'pool' or 'skip', got {self.gqa_output!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")


@register
class Smooth(Pass):
    name = "smooth"
    Config = SmoothConfig
    transforms = True

    def run(self, work: LayerWork) -> None:
        a = work.adapter
        points = [role for role in ROLES if role in self.config.targets
                  and any(n in work.specs for n in work.names(role))]
        if "o" in points and self.config.gqa_output == "skip" and work.head_dims()[1] != work.head_dims()[0]:
            points.remove("o")
            work.metrics[f"{a.o_proj}.smooth_skipped_gqa"] = 1.0
        if not points:
            return
        inputs = self._sample_inputs(work, [work.names(role)[0] for role in points])
        for role in points:
            with memory.reused_temporaries():  # each candidate builds the same temporaries
                self._smooth_point(work, role, inputs[work.names(role)[0]])

    def _smooth_point(self, work: LayerWork, role: str, x: torch.Tensor) -> None:
        """Search lambda for the point read by `role` on its sampled inputs `x`, and fold the best (if any beats no
        smoothing) into the block."""
        consumers = [n for n in work.names(role) if n in work.specs]
        group = self._channel_groups(work, role).to(x.device)
        weights = [work.weight(n).detach().float() for n in consumers]
        reference = _point_output(role, x, weights)
        candidates = self._candidates(x, weights, group)
        errors: dict[int, float] = {}

        def evaluate(i: int) -> float:
            if i not in errors:
                lam = candidates[i][1]
                errors[i] = self._error(work, role, consumers, x / lam, [w * lam for w in weights], reference)
            return errors[i]

        best_i = _search(len(candidates), evaluate, self.config.stride)
        smoothed = best_i is not None and evaluate(best_i) < self._error(work, role, consumers, x, weights, reference)
        label = "smooth_alpha" if self.config.method == "alpha" else "smooth_sigma"
        work.metrics[f"{consumers[0]}.{label}"] = candidates[best_i][0] if smoothed else -1.0
        work.metrics[f"{consumers[0]}.smooth_evaluated"] = float(len(errors))
        if smoothed:
            self._apply(work, role, consumers, candidates[best_i][1])

    def _candidates(self, x: torch.Tensor, weights: list[torch.Tensor], group: torch.Tensor
                    ) -> list[tuple[float, torch.Tensor]]:
        """(grid value, lambda [K]) per candidate; lambda is equal across channels of one group."""
        x_max = _pooled(x.abs().amax(dim=0), group).clamp(min=1e-5)
        if self.config.method == "threshold":  # QQQ / OS+: only channels beyond +-sigma are scaled, into it
            top = float(x_max.max())
            count = self.config.thresholds
            sigmas = [top - (top - 0.1) * i / count for i in range(count + 1)] if top > 0.1 else []
            return [(s, (x_max / s).clamp(min=1.0)) for s in sigmas[1:]]  # sigmas[0] = max: nothing scaled
        w_max = _pooled(torch.cat(weights).abs().amax(dim=0), group).clamp(min=1e-5)
        return [(a, (x_max.pow(a) / w_max.pow(1 - a)).clamp(1e-4, 1e4)) for a in self.config.alphas]

    def _apply(self, work: LayerWork, role: str, consumers: list[str], lam: torch.Tensor) -> None:
        """Fold lambda: consumer columns times lambda, the producer (norm weight or linear rows) divided by it."""
        a = work.adapter
        for name in consumers:
            work.module(name).weight.data.mul_(lam.to(work.weight(name).dtype))
        rows = self._producer_rows(work, role, lam)
        if role in ("qkv", "gate_up"):
            norm = work.block.get_submodule(a.input_norm if role == "qkv" else a.post_attn_norm)
            norm.weight.data = (norm.weight.data.float() / rows).to(norm.weight.dtype)
        else:
            _scale_rows(work.module(a.v_proj if role == "o" else a.up_proj), 1.0 / rows)

    def _sample_inputs(self, work: LayerWork, names: list[str]) -> dict[str, torch.Tensor]:
        """About `max_tokens` input rows of each named linear: evenly spaced tokens of the first
        ceil(max_tokens / 128) sequences (only those run through the block), max_tokens / sequences from each (128
        where the calibration has that many sequences; every token where it asks for all). The spacing starts half
        a step in, so that the first token (an attention sink with massive activations) is not given L / per-sequence
        times its share of the objective."""
        available, length = work.inputs.shape[:2]
        sequences = min(available, -(-self.config.max_tokens // 128))
        per_seq = min(length, max(1, self.config.max_tokens // sequences))
        step = length // per_seq
        rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}

        def grab(name: str):
            def fn(x: torch.Tensor) -> None:
                for seq in x.detach():
                    rows[name].append(seq[step // 2::step][:per_seq].float())
            return fn

        work.forward({n: grab(n) for n in names}, samples=sequences)
        return {n: torch.cat(r) for n, r in rows.items()}

    def _channel_groups(self, work: LayerWork, role: str) -> torch.Tensor:
        """For each input channel of the point, the producer row it comes from (GQA: query heads share v rows)."""
        if role == "o":
            return work.kv_channels()
        return torch.arange(work.weight(work.names(role)[0]).shape[1])

    def _producer_rows(self, work: LayerWork, role: str, lam: torch.Tensor) -> torch.Tensor:
        """lambda per producer row (identical across the channels that share a row)."""
        group = self._channel_groups(work, role).to(lam.device)
        rows = torch.zeros(int(group.max()) + 1, dtype=lam.dtype, device=lam.device)
        rows[group] = lam
        return rows

    def _error(self, work: LayerWork, role: str, consumers: list[str], x: torch.Tensor, weights: list[torch.Tensor],
               reference: torch.Tensor) -> float:
        """Squared error of the point's output with the consumers' weights and (when simulated) activations
        quantized."""
        xq = fake_quantize_per_token(x, work.act_bits) if work.act_bits else x
        wq = [fake_quantize(w, work.specs[name], work.scale_dtype) for name, w in zip(consumers, weights, strict=True)]
        # the point's output is a fresh tensor: the difference and its square reuse its buffer (same values)
        return float(_point_output(role, xq, wq).sub_(reference).pow_(2).sum())


def _search(count: int, evaluate, stride: int) -> int | None:
    """Index minimizing `evaluate` over range(count): every `stride`-th index, then every index within one stride
    of the best of those (exhaustive when the error is unimodal at the coarse scale, as it is in sigma or alpha)."""
    if count == 0:
        return None
    coarse = min(range(0, count, stride), key=evaluate)
    return min(range(max(0, coarse - stride + 1), min(count, coarse + stride)), key=evaluate)


def _point_output(role: str, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """What the smoothing error is measured on: SiLU(gate) * up for gate_up (the MLP's product, as QQQ does),
    the consumers' outputs side by side otherwise (q, k, v: the linear outputs, not the attention output)."""
    if role == "gate_up" and len(weights) == 2:
        gate, up = (x @ w.T for w in weights)
        return torch.nn.functional.silu(gate, inplace=True).mul_(up)
    if len(weights) == 1:  # o, down: no copy through torch.cat
        return x @ weights[0].T
    return torch.cat([x @ w.T for w in weights], dim=-1)


def _pooled(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """max of `values` over channels of the same group, broadcast back to every channel."""
    pooled = torch.zeros(int(group.max()) + 1, dtype=values.dtype, device=values.device)
    pooled = pooled.scatter_reduce(0, group, values, "amax")
    return pooled[group]
