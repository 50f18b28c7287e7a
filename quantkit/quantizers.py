"""Generic integer quantizer: 2-8 bits, symmetric or asymmetric, per tensor / channel / group, with clipping.

Conventions (shared by every pass and packer, and matching compressed-tensors):
- codes live in the signed range [qmin, qmax] = [-2^(b-1), 2^(b-1) - 1];
- symmetric: scale = clip * amax / ((qmax - qmin) / 2), no zero point (GPTQ/compressed-tensors full range);
- asymmetric: [min, max] widened to include 0, scale = clip * (max - min) / (2^b - 1),
  zero = round(qmin - min / scale) clamped to [qmin, qmax];
- q = clamp(round(w / scale) + zero, qmin, qmax), w_hat = (q - zero) * scale;
- scales are rounded to the storage dtype (fp16 by default) *before* codes are computed, so the stored
  artifact dequantizes to exactly the weights the calibration and eval used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Granularity = Literal["tensor", "channel", "group"]


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize one weight matrix [N, K] (rows = output channels, groups run along K)."""

    bits: int = 4
    symmetric: bool = True
    granularity: Granularity = "group"
    group_size: int = 128
    clip_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        if self.granularity == "group" and self.group_size <= 0:
            raise ValueError(f"group_size must be positive for group quantization, got {self.group_size}")
        if not 0.0 < self.clip_ratio <= 1.0:
            raise ValueError(f"clip_ratio must be in (0, 1], got {self.clip_ratio}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def columns_per_group(self, in_features: int) -> int:
        """Columns sharing one scale: the group size, or all of K for per-channel / per-tensor."""
        return self.group_size if self.granularity == "group" else in_features


@dataclass
class QParams:
    """Scales [N or 1, G] (float32 holding storage-dtype values) and optional integer zeros of the same shape."""

    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int


def group_index(in_features: int, group_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Group of each input column in natural order: k // group_size."""
    return torch.arange(in_features, device=device) // group_size


def compute_qparams(
    w: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype = torch.float16, clip_ratio: float | None = None
) -> QParams:
    """Scales and zeros of `w` [N, K] for `spec`; `clip_ratio` overrides the spec's (used by clip searches)."""
    n, k = w.shape
    gs = spec.columns_per_group(k)
    if k % gs:
        raise ValueError(f"group size {gs} does not divide the input width {k}")
    clip = spec.clip_ratio if clip_ratio is None else clip_ratio
    x = w.detach().float()
    x = x.reshape(1, 1, -1) if spec.granularity == "tensor" else x.reshape(n, k // gs, gs)
    if spec.symmetric:
        amax = x.abs().amax(dim=-1) * clip
        scale = amax / ((spec.qmax - spec.qmin) / 2)
        scale = _round_scale(scale, scale_dtype)
        return QParams(scale=scale, zero=None, group_size=gs)
    lo = x.amin(dim=-1).clamp(max=0) * clip
    hi = x.amax(dim=-1).clamp(min=0) * clip
    scale = _round_scale((hi - lo) / (spec.qmax - spec.qmin), scale_dtype)
    zero = torch.round(spec.qmin - lo / scale).clamp(spec.qmin, spec.qmax).to(torch.int32)
    return QParams(scale=scale, zero=zero, group_size=gs)


def search_qparams(
    w: torch.Tensor,
    spec: QuantSpec,
    scale_dtype: torch.dtype = torch.float16,
    grid: int = 20,
    min_ratio: float = 0.8,
    norm: float = 2.4,
) -> QParams:
    """Per-group clipping search (GPTQ's `mse` observer): the ratio in [min_ratio, 1] minimizing sum|w - w_hat|^p."""
    best = compute_qparams(w, spec, scale_dtype, clip_ratio=1.0)
    gs = best.group_size
    x = w.detach().float()
    best_err = _group_error(x, best, spec, norm)
    for step in range(1, grid + 1):
        ratio = 1.0 - (1.0 - min_ratio) * step / grid
        cand = compute_qparams(w, spec, scale_dtype, clip_ratio=ratio)
        err = _group_error(x, cand, spec, norm)
        better = err < best_err
        if better.any():
            best_err = torch.where(better, err, best_err)
            best.scale = torch.where(better, cand.scale, best.scale)
            if best.zero is not None:
                best.zero = torch.where(better, cand.zero, best.zero)
    best.group_size = gs
    return best


def _group_error(x: torch.Tensor, qp: QParams, spec: QuantSpec, norm: float) -> torch.Tensor:
    """Sum of |x - fake_quant(x)|^norm per (row, group), shaped like the scales."""
    err = (x - dequantize(quantize(x, qp, spec), qp)).abs().pow(norm)
    if spec.granularity == "tensor":
        return err.sum().reshape(1, 1)
    n, k = x.shape
    return err.reshape(n, k // qp.group_size, qp.group_size).sum(-1)


def _round_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to the storage dtype and replace zero scales (all-zero groups) with 1, so q = 0 round-trips."""
    scale = scale.to(dtype).float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _expand(t: torch.Tensor, k: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """Broadcast per-group values [N, G] to per-column [N, K] (via g_idx when columns are permuted)."""
    idx = g_idx if g_idx is not None else group_index(k, group_size, t.device)
    return t[:, idx.to(t.device)]


def quantize(w: torch.Tensor, qp: QParams, spec: QuantSpec, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Integer codes (int8, signed domain) of `w` under fixed qparams."""
    k = w.shape[1]
    scale = _expand(qp.scale, k, qp.group_size, g_idx)
    q = torch.round(w.float() / scale)
    if qp.zero is not None:
        q = q + _expand(qp.zero, k, qp.group_size, g_idx)
    return q.clamp(spec.qmin, spec.qmax).to(torch.int8)


def dequantize(q: torch.Tensor, qp: QParams, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 weights (q - zero) * scale; exact products, so a cast to the scale dtype rounds once."""
    k = q.shape[1]
    scale = _expand(qp.scale, k, qp.group_size, g_idx)
    x = q.float()
    if qp.zero is not None:
        x = x - _expand(qp.zero, k, qp.group_size, g_idx).float()
    return x * scale


def fake_quantize(w: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Round-to-nearest quantize then dequantize `w` (float32 result)."""
    qp = compute_qparams(w, spec, scale_dtype)
    return dequantize(quantize(w, qp, spec), qp)


def quantize_column(
    col: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and dequantized values of one column [N] under per-row scale/zero [N] (GPTQ's inner step)."""
    q = torch.round(col / scale)
    if zero is not None:
        q = q + zero
    q = q.clamp(spec.qmin, spec.qmax)
    deq = (q - zero) * scale if zero is not None else q * scale
    return q.to(torch.int8), deq


def fake_quantize_per_token(x: torch.Tensor, bits: int = 8, symmetric: bool = True) -> torch.Tensor:
    """Dynamic per-token activation quantization (last dim), as vLLM's scaled_int8_quant: s = amax / qmax."""
    qmax = (1 << (bits - 1)) - 1
    xf = x.float()
    if symmetric:
        scale = xf.abs().amax(dim=-1, keepdim=True) / qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (torch.round(xf / scale).clamp(-qmax - 1, qmax) * scale).to(x.dtype)
    lo = xf.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = xf.amax(dim=-1, keepdim=True).clamp(min=0)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    q = (torch.round(xf / scale) + zero).clamp(0, levels)
    return ((q - zero) * scale).to(x.dtype)
