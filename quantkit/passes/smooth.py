"""Smoothing passes: per-channel scales moved between an activation and the weights that read it.

`smooth_attention` (QServe SmoothAttention, Eqs. 3-5): lambda = max|K|^alpha on post-RoPE keys, one lambda per KV
channel, tied across the RoPE pair (i, i + D/2) so it commutes with rotate_half RoPE; k_proj rows (and bias) are
divided by lambda and the q_proj rows of every query head of the group multiplied by it, so Q K^T is unchanged
and the quantized KV cache sees flatter keys.

`smooth_output` (QServe block-output-module smoothing): for the o_proj and down_proj inputs X,
lambda_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha); X is divided by lambda (absorbed into the producer rows: v_proj
for o_proj, one lambda per KV channel under GQA; up_proj for down_proj) and the consumer's columns multiplied by
it. alpha is searched on a small grid near 0 (plus "no smoothing") against the consumer's output error with its
weights and (when the recipe simulates them) its per-token activations quantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantkit.passes import register
from quantkit.passes.base import LayerWork, Pass, check_output_targets
from quantkit.quantizers import compute_qparams, dequantize, fake_quantize_per_token, quantize


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


@register
class SmoothAttention(Pass):
    name = "smooth_attention"
    Config = SmoothAttentionConfig
    transforms = True

    def run(self, work: LayerWork) -> None:
        heads, kv_heads, d = work.head_dims()
        amax: list[torch.Tensor] = []

        def observe(key: torch.Tensor, value: torch.Tensor) -> None:
            m = key.detach().abs().amax(dim=(0, 2)).float()  # [H_kv, D]
            amax[:] = [m if not amax else torch.maximum(amax[0], m)]

        work.forward(samples=self.config.samples, attention_observer=observe)
        half = d // 2
        pair = torch.maximum(amax[0][:, :half], amax[0][:, half:])
        lam = pair.clamp(min=1e-5).pow(self.config.alpha)
        lam = torch.cat([lam, lam], dim=1)  # [H_kv, D]
        a = work.adapter
        _scale_rows(work.module(a.k_proj), 1.0 / lam.reshape(-1))
        _scale_rows(work.module(a.q_proj), lam.repeat_interleave(heads // kv_heads, dim=0).reshape(-1))
        work.metrics["smooth_attention.key_absmax_ratio"] = float(amax[0].max() / amax[0].median().clamp(min=1e-9))


@dataclass(frozen=True)
class SmoothOutputConfig:
    alphas: list[float] = field(default_factory=lambda: [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4])
    targets: list[str] = field(default_factory=lambda: ["o", "down"])
    max_tokens: int = 4096  # calibration tokens in the error objective

    def __post_init__(self) -> None:
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"alphas must be a non-empty list in [0, 1], got {self.alphas}")
        check_output_targets(self.targets)


@register
class SmoothOutput(Pass):
    name = "smooth_output"
    Config = SmoothOutputConfig
    transforms = True

    def run(self, work: LayerWork) -> None:
        a = work.adapter
        names = [a.linears[t][0] for t in self.config.targets if a.linears[t][0] in work.specs]
        if not names:
            return
        inputs = self._sample_inputs(work, names)
        for name in names:
            x = inputs[name]
            w = work.weight(name).detach().float()
            group = self._channel_groups(work, name).to(w.device)  # channels that share one producer row
            x_max = _pooled(x.abs().amax(dim=0), group)
            w_max = _pooled(w.abs().amax(dim=0), group)
            reference = x @ w.T
            best, best_err, best_alpha = None, self._error(work, name, x, w, reference), None
            for alpha in self.config.alphas:
                lam = (x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)).clamp(1e-4, 1e4)
                err = self._error(work, name, x / lam, w * lam, reference)
                if err < best_err:
                    best, best_err, best_alpha = lam, err, alpha
            work.metrics[f"{name}.smooth_alpha"] = -1.0 if best_alpha is None else best_alpha
            if best is None:
                continue
            work.module(name).weight.data.mul_(best)
            producer = a.v_proj if name == a.o_proj else a.up_proj
            _scale_rows(work.module(producer), 1.0 / self._producer_rows(work, name, best))

    def _sample_inputs(self, work: LayerWork, names: list[str]) -> dict[str, torch.Tensor]:
        """Up to `max_tokens` input rows of each named linear, spread over the calibration sequences."""
        per_seq = max(1, self.config.max_tokens // work.inputs.shape[0])
        rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}

        def grab(name: str):
            def fn(x: torch.Tensor) -> None:
                for seq in x.detach():
                    step = max(1, seq.shape[0] // per_seq)
                    rows[name].append(seq[::step][:per_seq].float())
            return fn

        work.forward({n: grab(n) for n in names})
        return {n: torch.cat(r) for n, r in rows.items()}

    def _channel_groups(self, work: LayerWork, name: str) -> torch.Tensor:
        """For each input channel of `name`, the producer row it comes from (GQA: query heads share v rows)."""
        k = work.weight(name).shape[1]
        if name != work.adapter.o_proj:
            return torch.arange(k)
        heads, kv_heads, d = work.head_dims()
        head = torch.arange(k) // d
        return (head // (heads // kv_heads)) * d + torch.arange(k) % d

    def _producer_rows(self, work: LayerWork, name: str, lam: torch.Tensor) -> torch.Tensor:
        """lambda per producer row (identical across the channels that share a row)."""
        group = self._channel_groups(work, name).to(lam.device)
        rows = torch.zeros(int(group.max()) + 1, dtype=lam.dtype, device=lam.device)
        rows[group] = lam
        return rows

    def _error(self, work: LayerWork, name: str, x: torch.Tensor, w: torch.Tensor, reference: torch.Tensor
               ) -> float:
        spec = work.specs[name]
        qp = compute_qparams(w, spec, work.scale_dtype)
        wq = dequantize(quantize(w, qp, spec), qp)
        xq = fake_quantize_per_token(x, work.act_bits) if work.act_bits else x
        return float((xq @ wq.T - reference).pow(2).sum())


def _pooled(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """max of `values` over channels of the same group, broadcast back to every channel."""
    pooled = torch.zeros(int(group.max()) + 1, dtype=values.dtype, device=values.device)
    pooled = pooled.scatter_reduce(0, group, values, "amax")
    return pooled[group]
