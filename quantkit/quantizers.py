"""Generic integer quantizer: 2-8 bits, symmetric or asymmetric, per tensor / channel / group, with clipping.

Conventions (shared by every pass and packer, and matching compressed-tensors):
- codes live in the signed range [qmin, qmax] = [-2^(b-1), 2^(b-1) - 1];
- symmetric: scale = clip * amax / ((qmax - qmin) / 2), no zero point (GPTQ/compressed-tensors full range);
- asymmetric: [min, max] widened to include 0, scale = clip * (max - min) / (2^b - 1),
  zero = round(qmin - min / scale) clamped to [qmin, qmax];
- q = clamp(round(w / scale + zero), qmin, qmax) (the zero added before rounding, as QServe's Eq. 7 and
  compressed-tensors do; ties go to even), w_hat = (q - zero) * scale;
- scales are rounded to the storage dtype (fp16 by default) *before* codes are computed, so the stored
  artifact dequantizes to exactly the weights the calibration and eval used.

Two variants serve kernels whose dequantization differs from (q - zero) * scale:
- `zero_form="scaled"` stores the zero as one fp16 number szero = fp16((zero - qmin) * scale) and dequantizes
  in the unsigned domain, w_hat = (q - qmin) * scale - szero (QServe's per-channel W4A8 epilogue);
- `progressive=True` is QoQ's two-level scheme: s1 = fp16(max|row| / P) with the protective range P = 119,
  x = clamp(w / s1, -P, P), then per group asymmetric codes with an *integer* scale s2 = max(1, round(range/15))
  and an integer zero; w_hat = ((q - zero) * s2) * s1, where (q - zero) * s2 must be an INT8 value. `scale`
  holds s1 * s2 (exact in fp32), and per-group code bounds keep (q - zero) * s2 inside [-128, 127] even for
  the error-updated weights GPTQ feeds in.
  With `level2="lqq"` it is LiquidQuant's form instead: level 1 rounds to INT8 x8 = clamp(round(w / s1), -P, P);
  per group, min8 = min x8, an integer step s2 = clamp(round((max8 - min8) / 15), 1, 16) and unsigned codes
  u = round((x8 - min8) / s2), so w_hat = (u * s2 + min8) * s1. The kernel computes u * s2 + (128 + min8) in
  one byte lane and flips bit 7; the per-group code bound u <= (127 - min8) // s2 keeps that lane <= 255.
  `offset` holds min8, and the float form (u * (s1 * s2) + min8 * s1) is exact in fp32.
- `narrow_range=True` drops the most negative code: symmetric codes in [-qmax, qmax], scale = amax / qmax
  (QQQ per channel: INT4 in [-7, 7], so that 16 q is an INT8 the kernel gets by masking the high nibble).
- `requant_int8=True` is QQQ's per-group form: after quantization (`requantize_int8`), each row gets an INT8
  scale s_c = max|w_hat| / 127 and each group's scale becomes the fp16 ratio r = fp16(scale / s_c); the kernel
  feeds round(q * r) to an INT8 MMA, so w_hat = round(q * r) * s_c, a second rounding nothing compensates.
- `codebook=True` is non-uniform quantization (SqueezeLLM, Any-Precision): per output row a lookup table of 2^b
  fp16 centroids, codes are table indices (unsigned u = q + 2^(b-1)). With `min_bits` < bits the codes prefix
  into every narrower width (Any-Precision): the w-bit model takes u >> (b - w) and its own table. `QParams.lut`
  holds every width's table side by side, [N, 2^min_bits + ... + 2^bits], narrowest first (`lut_width`).
- `outliers > 0` is Atom's mixed precision: the layer's columns are taken in an order (the calibration inputs'
  square-sum, ascending, `ordered_quantize`); the first K - outliers form the groups of `group_size` (or one
  per-channel group), the last `outliers` are INT8 per row, unclipped. The codes stay in the original column
  order, with `g_idx` mapping each column to its group (the outlier group last). `row_block` rows share one
  scale per group (Atom's kernel pairs rows: 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
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
    zero_form: Literal["integer", "scaled"] = "integer"
    progressive: bool = False  # QoQ two-level: INT8 per channel (protective range), integer group params
    protective_range: int = 119
    level2: Literal["qoq", "lqq"] = "qoq"  # progressive group form: QoQ zero point, or LiquidQuant offset
    narrow_range: bool = False  # symmetric codes in [-qmax, qmax] with scale amax / qmax (QQQ per channel)
    requant_int8: bool = False  # QQQ per group: group scales re-expressed over a per-channel INT8 scale
    codebook: bool = False  # per-row lookup tables of centroids (SqueezeLLM); codes index them
    outliers: int = 0  # Atom: the last `outliers` columns of the layer's order are INT8 per row (unclipped)
    row_block: int = 1  # output rows that share one scale per group (Atom: 2)
    min_bits: int | None = None  # codebook: the narrowest width the codes also serve (Any-Precision), else bits

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        if self.granularity == "group" and self.group_size <= 0:
            raise ValueError(f"group_size must be positive for group quantization, got {self.group_size}")
        if not 0.0 < self.clip_ratio <= 1.0:
            raise ValueError(f"clip_ratio must be in (0, 1], got {self.clip_ratio}")
        if self.zero_form not in ("integer", "scaled"):
            raise ValueError(f"zero_form must be 'integer' or 'scaled', got {self.zero_form!r}")
        if self.zero_form == "scaled" and (self.symmetric or self.progressive):
            raise ValueError("zero_form 'scaled' needs asymmetric, non-progressive weights")
        if self.progressive:
            if self.symmetric:
                raise ValueError("progressive quantization is asymmetric at level 2: set symmetric=false")
            if self.granularity == "tensor":
                raise ValueError("progressive quantization needs per-channel level-1 scales, not per tensor")
            if not 1 <= self.protective_range <= 127:
                raise ValueError(f"protective_range must be in 1..127, got {self.protective_range}")
        if self.level2 not in ("qoq", "lqq"):
            raise ValueError(f"level2 must be 'qoq' or 'lqq', got {self.level2!r}")
        if self.level2 == "lqq" and not (self.progressive and self.bits == 4):
            raise ValueError("level2 'lqq' (LiquidQuant) is a form of 4-bit progressive quantization: set "
                             "progressive=true and bits=4")
        if self.narrow_range and not self.symmetric:
            raise ValueError("narrow_range is a symmetric grid: set symmetric=true")
        if self.requant_int8 and not (self.symmetric and self.granularity == "group" and not self.narrow_range):
            raise ValueError("requant_int8 (QQQ per group) needs symmetric, full-range group quantization")
        if self.codebook and (self.granularity != "channel" or self.progressive or self.requant_int8
                              or self.narrow_range or self.zero_form != "integer"):
            raise ValueError("codebook (lookup-table) quantization has one table per output row: set "
                             "granularity=channel and no uniform-grid variant")
        if self.outliers < 0 or self.row_block < 1:
            raise ValueError(f"outliers must be >= 0 and row_block >= 1, got {self.outliers}, {self.row_block}")
        if (self.outliers or self.row_block > 1) and not (
                self.symmetric and self.granularity in ("group", "channel") and not (
                    self.progressive or self.codebook or self.requant_int8 or self.narrow_range)):
            raise ValueError("outliers and row_block (Atom) need symmetric group or per-channel weights without "
                             "another variant")
        if self.min_bits is not None and not (self.codebook and 2 <= self.min_bits <= self.bits):
            raise ValueError(f"min_bits needs codebook weights and 2 <= min_bits <= bits, got {self.min_bits}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) + int(self.narrow_range)

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def columns_per_group(self, in_features: int) -> int:
        """Columns sharing one scale: the group size, or all of K for per-channel / per-tensor."""
        return self.group_size if self.granularity == "group" else in_features


@dataclass
class QParams:
    """Scales [N or 1, G] (float32 holding storage-dtype values) and optional integer zeros of the same shape;
    codebook weights have no scale but a `lut`.

    Variant fields (see the module docstring): `szero` [N, G] for the scaled zero form; `s1` [N, 1] and `s2`
    [N, G] (integers held in float32) for progressive quantization, with `code_lo` / `code_hi` [N, G] the
    per-group code bounds and `protect` the level-1 clamp.
    """

    scale: torch.Tensor | None
    zero: torch.Tensor | None
    group_size: int
    szero: torch.Tensor | None = None
    s1: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    code_lo: torch.Tensor | None = None
    code_hi: torch.Tensor | None = None
    protect: int | None = None
    code_offset: int = 0  # scaled zero / LQQ: signed code + offset = the unsigned code the kernel multiplies
    offset: torch.Tensor | None = None  # LQQ: the group's INT8 minimum [N, G] (integers in float32)
    s_channel: torch.Tensor | None = None  # requant_int8: per-row INT8 scale [N, 1] (float32)
    ratio: torch.Tensor | None = None  # requant_int8: fp16(scale / s_channel) [N, G] (float32 holding fp16)
    lut: torch.Tensor | None = None  # codebook: every width's table side by side [N, sum 2^w] (narrowest first)

    TENSORS = ("scale", "zero", "szero", "s1", "s2", "code_lo", "code_hi", "offset", "s_channel", "ratio", "lut")

    def map(self, fn) -> QParams:
        """A copy with `fn` applied to every tensor field (e.g. a device move or a where-select)."""
        values = {f: None if getattr(self, f) is None else fn(f, getattr(self, f)) for f in self.TENSORS}
        return QParams(group_size=self.group_size, protect=self.protect, code_offset=self.code_offset, **values)


# QParams' fields of one value per group (the others: s1 and s_channel per row, lut per row's table)
_PER_GROUP = ("scale", "zero", "szero", "s2", "code_lo", "code_hi", "offset", "ratio")


@dataclass
class QuantizedLinear:
    """Integer codes [N, K] (signed int8 domain) with their qparams; `g_idx` maps columns to groups if permuted."""

    codes: torch.Tensor
    qparams: QParams
    spec: QuantSpec
    g_idx: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.qparams, self.g_idx)

    def shape_problem(self) -> str:
        """What in these tensors' shapes cannot be read as one weight [N, K], in words, or "": a reader's check of
        unpacked tensors, which would otherwise broadcast a short field over the weight or fail inside the
        dequantization. Each field has N rows (1 per tensor), each per-group field one column per group, g_idx one
        group per column, and the dequantization (traced on the meta device, no arithmetic) is [N, K]."""
        if self.codes.ndim != 2:
            return f"the codes are {self.codes.ndim}-D, not [N, K]"
        n, k = self.codes.shape
        qp = self.qparams
        rows = 1 if self.spec.granularity == "tensor" else n
        fields = {f: getattr(qp, f) for f in QParams.TENSORS if getattr(qp, f) is not None}
        if bad := [f"{f} is {list(t.shape)}" for f, t in fields.items() if t.ndim != 2 or t.shape[0] != rows]:
            return f"{', '.join(bad)} for a weight of {n} x {k} ({rows} row(s) each)"
        if self.g_idx is not None:
            if self.g_idx.shape != (k,):
                return f"g_idx has {list(self.g_idx.shape)} entries for {k} columns"
        elif qp.lut is None and qp.group_size > 0 and k % qp.group_size == 0:
            groups = k // qp.group_size
            if bad := [f"{f} has {t.shape[1]} columns" for f, t in fields.items()
                       if f in _PER_GROUP and t.shape[1] != groups]:
                return f"{', '.join(bad)} for {groups} group(s) of {qp.group_size}"
        try:
            traced = self.to("meta").dequantize()
        except (RuntimeError, ValueError, IndexError) as e:
            return f"the dequantization cannot read them ({e})"
        return "" if traced.shape == (n, k) else f"they dequantize to {list(traced.shape)}, not [{n}, {k}]"

    def finished(self) -> QuantizedLinear:
        """The result as deployed: with QQQ's per-group INT8 re-expression (`requant_int8`) applied to the final
        codes, which the engine does once a quantizer is done; otherwise (or once applied) this result itself."""
        if not self.spec.requant_int8 or self.qparams.ratio is not None:
            return self
        if self.g_idx is not None:
            raise ValueError("requant_int8 needs groups in natural column order (static groups)")
        return QuantizedLinear(self.codes, requantize_int8(self.codes, self.qparams), self.spec)

    def at_bits(self, bits: int) -> QuantizedLinear:
        """A codebook result narrowed to `bits` (Any-Precision): the codes' top bits and that width's table."""
        if not self.spec.codebook:
            raise ValueError("only codebook (lookup-table) weights can be read at another width")
        table = lut_width(self.qparams.lut, self.spec, bits)
        unsigned = self.codes.long() + self.qparams.code_offset
        offset = 1 << (bits - 1)
        codes = ((unsigned >> (self.spec.bits - bits)) - offset).to(torch.int8)
        spec = replace(self.spec, bits=bits, min_bits=bits)
        qp = QParams(scale=None, zero=None, group_size=self.qparams.group_size, lut=table, code_offset=offset)
        return QuantizedLinear(codes, qp, spec)

    def to(self, device: torch.device | str) -> QuantizedLinear:
        """The same result with every tensor on `device` (packers work on the CPU)."""
        qp = self.qparams.map(lambda f, t: t.to(device))
        g_idx = None if self.g_idx is None else self.g_idx.to(device)
        return QuantizedLinear(self.codes.to(device), qp, self.spec, g_idx)


# The parameters of one weight as a function of the clip ratio (None: the spec's): qparams_by_clip
ByClip = Callable[["float | torch.Tensor | None"], "QParams"]


def compute_qparams(
    w: torch.Tensor,
    spec: QuantSpec,
    scale_dtype: torch.dtype = torch.float16,
    clip_ratio: float | torch.Tensor | None = None,
) -> QParams:
    """Scales and zeros of `w` [N, K] for `spec`; `clip_ratio` (a float, or a tensor shaped like the scales)
    overrides the spec's, as clip searches do."""
    return qparams_by_clip(w, spec, scale_dtype)(clip_ratio)


def qparams_by_clip(w: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype = torch.float16) -> ByClip:
    """`compute_qparams(w, spec, scale_dtype, clip_ratio=r)` as a function of `r` (None: the spec's ratio), with
    what does not depend on the ratio (the ranges of every row or group) computed once, for searches that try many
    ratios on one weight. compute_qparams is this function applied once, so a search's parameters are its bits."""
    at = _by_clip(w, spec, scale_dtype)

    def by_clip(clip_ratio: float | torch.Tensor | None) -> QParams:
        return at(spec.clip_ratio if clip_ratio is None else clip_ratio)

    return by_clip


def _by_clip(w: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype
             ) -> Callable[[float | torch.Tensor], QParams]:
    """qparams_by_clip's function of a given ratio, for the spec's kind of parameters."""
    n, k = w.shape
    gs = spec.columns_per_group(k)
    if k % gs:
        raise ValueError(f"group size {gs} does not divide the input width {k}")
    if spec.progressive:
        return _progressive_by_clip(w, spec, scale_dtype, gs)
    x = w.detach().float()
    x = x.reshape(1, 1, -1) if spec.granularity == "tensor" else x.reshape(n, k // gs, gs)
    if spec.row_block > 1:
        if n % spec.row_block:
            raise ValueError(f"row_block {spec.row_block} does not divide the output width {n}")
        x = x.reshape(n // spec.row_block, spec.row_block, k // gs, gs).transpose(1, 2).reshape(
            n // spec.row_block, k // gs, spec.row_block * gs)  # one group spans the block's rows
    if spec.symmetric:
        absmax = x.abs().amax(dim=-1)

        def symmetric(clip: float | torch.Tensor) -> QParams:
            amax = absmax * clip
            if spec.row_block > 1:
                amax = amax.repeat_interleave(spec.row_block, dim=0)
            scale = amax / ((spec.qmax - spec.qmin) / 2)
            scale = _round_scale(scale, scale_dtype)
            return QParams(scale=scale, zero=None, group_size=gs)

        return symmetric
    lo0 = x.amin(dim=-1).clamp(max=0)
    hi0 = x.amax(dim=-1).clamp(min=0)

    def asymmetric(clip: float | torch.Tensor) -> QParams:
        lo = lo0 * clip
        hi = hi0 * clip
        scale = _round_scale((hi - lo) / (spec.qmax - spec.qmin), scale_dtype)
        zero = torch.round(spec.qmin - lo / scale).clamp(spec.qmin, spec.qmax).to(torch.int32)
        if spec.zero_form == "scaled":
            szero = ((zero - spec.qmin).float() * scale).to(scale_dtype).float()
            return QParams(scale=scale, zero=zero, group_size=gs, szero=szero, code_offset=-spec.qmin)
        return QParams(scale=scale, zero=zero, group_size=gs)

    return asymmetric


def _progressive_by_clip(w: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype, gs: int
                         ) -> Callable[[float | torch.Tensor], QParams]:
    """QoQ level 1 (s1, protective clamp) and level 2 (integer s2, zero, code bounds) for `w` [N, K], as a function
    of the clip ratio (`qparams_by_clip`)."""
    n, k = w.shape
    p = spec.protective_range
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=1, keepdim=True)
    s1 = (amax / p).to(scale_dtype).float()
    s1 = torch.where(s1 > 0, s1, torch.ones_like(s1))
    if spec.level2 == "lqq":
        return _lqq_by_clip(w32, s1, spec, gs)
    x = (w32 / s1).clamp_(-p, p).reshape(n, k // gs, gs)
    lo0 = x.amin(dim=-1).clamp(max=0)
    hi0 = x.amax(dim=-1).clamp(min=0)
    levels = spec.qmax - spec.qmin

    def progressive(clip: float | torch.Tensor) -> QParams:
        lo = lo0 * clip
        hi = hi0 * clip
        s2 = torch.round((hi - lo) / levels).clamp(min=1)
        z_u = torch.round(-lo / s2).clamp(0, levels)
        code_lo = torch.maximum(z_u - torch.floor(128 / s2), torch.zeros_like(z_u)) + spec.qmin
        code_hi = torch.minimum(z_u + torch.floor(127 / s2), torch.full_like(z_u, levels)) + spec.qmin
        return QParams(
            scale=s1 * s2, zero=(z_u + spec.qmin).to(torch.int32), group_size=gs, s1=s1, s2=s2,
            code_lo=code_lo.to(torch.int32), code_hi=code_hi.to(torch.int32), protect=p,
        )

    return progressive


OUTLIER_SPEC = QuantSpec(bits=8, symmetric=True, granularity="channel")  # Atom's outlier columns: INT8 per row


def normal_spec(spec: QuantSpec) -> QuantSpec:
    """An Atom spec's normal columns: the same spec without the outlier split."""
    return replace(spec, outliers=0)


def ordered_quantize(w: torch.Tensor, spec: QuantSpec, order: torch.Tensor, scale_dtype: torch.dtype = torch.float16,
                     clip_ratio: float | torch.Tensor | None = None) -> tuple[torch.Tensor, QParams, torch.Tensor]:
    """Round-to-nearest of `w` [N, K] with groups formed along `order` (a permutation of the columns) and, for
    Atom specs, the last `spec.outliers` columns of the order in INT8; returns codes [N, K] in the original
    column order, the qparams (the outlier group last) and g_idx [K]."""
    n, k = w.shape
    kn = k - spec.outliers
    wp = w.detach().float()[:, order]
    normal = normal_spec(spec)
    qn = compute_qparams(wp[:, :kn], normal, scale_dtype, clip_ratio)
    codes_p = [quantize(wp[:, :kn], qn, normal)]
    gs = normal.columns_per_group(kn)
    groups = [torch.arange(kn, device=w.device) // gs]
    scales = [qn.scale.expand(n, -1)]
    if spec.outliers:
        qo = compute_qparams(wp[:, kn:], OUTLIER_SPEC, scale_dtype)
        codes_p.append(quantize(wp[:, kn:], qo, OUTLIER_SPEC))
        groups.append(torch.full((spec.outliers,), kn // gs, device=w.device))
        scales.append(qo.scale)
    codes = torch.empty(n, k, dtype=torch.int8, device=w.device)
    codes[:, order] = torch.cat(codes_p, dim=1)
    g_idx = torch.empty(k, dtype=torch.long, device=w.device)
    g_idx[order] = torch.cat(groups)
    return codes, QParams(scale=torch.cat(scales, dim=1), zero=None, group_size=gs), g_idx


def lqq_code_bound(offset: torch.Tensor, s2: torch.Tensor, levels: int = 15) -> torch.Tensor:
    """The largest unsigned LQQ code u with u * s2 + 128 + offset <= 255 (the kernel's byte lane), at most
    `levels`."""
    return torch.minimum(torch.floor((127 - offset) / s2), torch.full_like(offset, levels))


def _lqq_by_clip(w: torch.Tensor, s1: torch.Tensor, spec: QuantSpec, gs: int
                 ) -> Callable[[float | torch.Tensor], QParams]:
    """LiquidQuant level 2 on the INT8 level-1 values: integer step 1..16 and offset min8 per group, as a function
    of the clip ratio (`qparams_by_clip`)."""
    n, k = w.shape
    p = spec.protective_range
    x8 = (w / s1).round_().clamp_(-p, p).reshape(n, k // gs, gs)
    lo8 = x8.amin(dim=-1)
    hi8 = x8.amax(dim=-1)
    lo0, hi0 = lo8.clamp(max=0), hi8.clamp(min=0)  # the range widened to hold 0, which a ratio scales
    levels = spec.qmax - spec.qmin

    def lqq(clip: float | torch.Tensor) -> QParams:
        # a clip ratio clips the group's integer values to `clip` times their range widened to hold 0, as the other
        # kinds' ratios do: a group on both sides of 0 narrows at both ends, a one-sided one (say [100, 119]) only
        # at the end away from 0, where scaling both ends would shift its range (to [90, 107]) instead
        floor, ceiling = lo0 * clip, hi0 * clip
        lo = torch.round(torch.clamp(lo8, floor, ceiling))
        hi = torch.round(torch.clamp(hi8, floor, ceiling))
        s2 = torch.round((hi - lo) / levels).clamp(1, 16)
        u_hi = lqq_code_bound(lo, s2, levels)
        return QParams(
            scale=s1 * s2, zero=None, group_size=gs, s1=s1, s2=s2, offset=lo,
            code_lo=torch.full_like(lo, spec.qmin).to(torch.int32), code_hi=(u_hi + spec.qmin).to(torch.int32),
            protect=p, code_offset=-spec.qmin,
        )

    return lqq


def search_qparams(
    w: torch.Tensor,
    spec: QuantSpec,
    scale_dtype: torch.dtype = torch.float16,
    grid: int = 20,
    min_ratio: float = 0.8,
    norm: float = 2.4,
) -> QParams:
    """Per-group clipping search (GPTQ's `mse` observer): the ratio in [min_ratio, 1] minimizing sum|w - w_hat|^p."""
    by_clip = qparams_by_clip(w, spec, scale_dtype)
    best = by_clip(1.0)
    x = w.detach().float()
    best_err = _group_error(x, best, spec, norm)
    for step in range(1, grid + 1):
        ratio = 1.0 - (1.0 - min_ratio) * step / grid
        cand = by_clip(ratio)
        err = _group_error(x, cand, spec, norm)
        better = err < best_err
        if better.any():
            best_err = torch.where(better, err, best_err)
            best = select_qparams(better, cand, best)
    return best


def select_qparams(mask: torch.Tensor, a: QParams, b: QParams) -> QParams:
    """Per (row, group): `a`'s parameters where `mask`, else `b`'s (row-wide s1 must agree, as it does for
    candidates that differ only in their clip ratio)."""
    return b.map(lambda f, t: t if f == "s1" else torch.where(mask, getattr(a, f), t))


def _group_error(x: torch.Tensor, qp: QParams, spec: QuantSpec, norm: float) -> torch.Tensor:
    """Sum of |x - fake_quant(x)|^norm per (row, group), shaped like the scales."""
    err = (x - quantize_dequantize(x, qp, spec)).abs_().pow_(norm)
    if spec.granularity == "tensor":
        return err.sum().reshape(1, 1)
    n, k = x.shape
    return err.reshape(n, k // qp.group_size, qp.group_size).sum(-1)


def _round_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to the storage dtype and replace zero scales (all-zero groups) with 1, so q = 0 round-trips."""
    scale = scale.to(dtype).float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _expand(t: torch.Tensor, k: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """Per-group values [N, G] for every column [N, K] (via g_idx when columns are permuted); in natural order a
    single group stays [N, 1] and broadcasts, and contiguous groups repeat without an index gather."""
    if g_idx is not None:
        return t[:, g_idx.to(t.device)]
    if t.shape[1] == 1:
        return t
    if t.shape[1] * group_size != k:
        raise ValueError(f"{t.shape[1]} groups of {group_size} do not cover {k} columns")
    return t.repeat_interleave(group_size, dim=1)


def _grouped_view(t: torch.Tensor, qp: QParams, g_idx: torch.Tensor | None):
    """`t` [N, K] as [N, G, group_size] with a function giving each per-group field [N or 1, G or 1] as
    [N or 1, G or 1, 1], so the fields broadcast over their groups instead of being repeated to [N, K]
    (`_expand`); None where groups are not contiguous (g_idx) or the codes index tables (codebook). Every
    element meets the same operands in the same operations, so the results are the same bits."""
    if g_idx is not None or qp.lut is not None or t.ndim != 2:
        return None
    n, k = t.shape
    gs = qp.group_size
    if gs <= 0 or k % gs:
        return None
    groups = k // gs

    def ex(f: torch.Tensor | None) -> torch.Tensor | None:
        if f is None:
            return None
        if f.shape[1] not in (1, groups):
            raise ValueError(f"{f.shape[1]} groups of {gs} do not cover {k} columns")
        return f.unsqueeze(-1)

    return t.reshape(n, groups, gs), ex


def _broadcast_view(t: torch.Tensor, qp: QParams, g_idx: torch.Tensor | None):
    """`t` and the function that broadcasts a per-group field to it: `_grouped_view`'s where groups are contiguous,
    else `t` itself with the fields expanded to every column (`_expand`). quantize, dequantize and
    quantize_dequantize all dispatch through here, so they meet the same operands."""
    grouped = _grouped_view(t, qp, g_idx)
    if grouped is not None:
        return grouped
    k = t.shape[1]
    return t, lambda f: None if f is None else _expand(f, k, qp.group_size, g_idx)


def quantize(w: torch.Tensor, qp: QParams, spec: QuantSpec, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Integer codes (int8, signed domain) of `w` under fixed qparams."""
    w = w.float()
    view, ex = _broadcast_view(w, qp, g_idx)
    return _codes(view, qp, spec, ex).to(torch.int8).reshape(w.shape)


def dequantize(q: torch.Tensor, qp: QParams, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 weights: (q - zero) * scale, or the variant's formula; exact products, so a cast to the scale
    dtype rounds once."""
    q = q.float()
    view, ex = _broadcast_view(q, qp, g_idx)
    return _dequant(view, qp, ex).reshape(q.shape)


def _codes(w: torch.Tensor, qp: QParams, spec: QuantSpec, ex) -> torch.Tensor:
    """Float codes of `w`; `ex` broadcasts a per-group field to `w`'s shape. The first operation makes a fresh
    tensor and the rest work on it in place: the same operations in the same order, so the same bits, with one
    buffer instead of one per step (searches quantize a weight dozens of times)."""
    if qp.s1 is not None:
        x = (w / qp.s1.to(w.device).reshape(-1, *([1] * (w.ndim - 1)))).clamp_(-qp.protect, qp.protect)
        if qp.offset is not None:  # LQQ: unsigned codes of the INT8 values above the group minimum
            q = x.round_().sub_(ex(qp.offset)).div_(ex(qp.s2)).round_().sub_(qp.code_offset)
        else:  # QServe's Eq. 7, round(x / s + z): the zero is added before rounding (ties-to-even sees it)
            q = x.div_(ex(qp.s2)).add_(ex(qp.zero)).round_()
        torch.minimum(q, ex(qp.code_hi).float(), out=q)
        return torch.maximum(q, ex(qp.code_lo).float(), out=q)
    if qp.szero is not None:
        q = (w + ex(qp.szero)).div_(ex(qp.scale)).round_().sub_(qp.code_offset)
    else:
        q = w / ex(qp.scale)
        if qp.zero is not None:
            q.add_(ex(qp.zero))
        q.round_()  # as Eq. 7 and compressed-tensors round
    return q.clamp_(spec.qmin, spec.qmax)


def requantize_int8(codes: torch.Tensor, qp: QParams) -> QParams:
    """QQQ's per-group deployment of final codes [N, K]: s_channel = max|w_hat| / 127 per row (float32) and the
    fp16 ratio scale / s_channel per group, so every group's round(q * ratio) is an INT8 value in [-127, 127].
    A group whose codes are all zero gets ratio 0 (any ratio is exact there; an unbounded one could overflow)."""
    if qp.zero is not None or qp.s1 is not None or qp.szero is not None:
        raise ValueError("requant_int8 applies to symmetric single-level group scales")
    n, k = codes.shape
    w_hat = dequantize(codes, qp)
    s_channel = w_hat.abs().amax(dim=1, keepdim=True) / 127
    s_channel = torch.where(s_channel > 0, s_channel, torch.ones_like(s_channel))
    ratio = (qp.scale / s_channel).to(torch.float16).float()
    used = codes.reshape(n, k // qp.group_size, qp.group_size).abs().amax(dim=-1) > 0
    ratio = torch.where(used, ratio, torch.zeros_like(ratio))
    return QParams(scale=qp.scale, zero=None, group_size=qp.group_size, s_channel=s_channel, ratio=ratio)


def lut_width(lut: torch.Tensor, spec: QuantSpec, bits: int) -> torch.Tensor:
    """The [N, 2^bits] table of width `bits` within a codebook's side-by-side tables."""
    low = spec.min_bits or spec.bits
    if not low <= bits <= spec.bits:
        raise ValueError(f"this codebook serves widths {low}..{spec.bits}, not {bits}")
    start = (1 << bits) - (1 << low)
    return lut[:, start:start + (1 << bits)]


def _dequant(q: torch.Tensor, qp: QParams, ex) -> torch.Tensor:
    """Float weights of codes `q` (left as they are: the first operation makes a fresh tensor, the rest work on it
    in place, as in `_codes`)."""
    if qp.lut is not None:  # codebook: the row's centroid at the widest width the tables hold
        widest = qp.lut[:, qp.lut.shape[1] - 2 * qp.code_offset:]
        return torch.gather(widest.to(q.device), 1, (q + qp.code_offset).long())
    if qp.ratio is not None:  # QQQ per group: the INT8 value the kernel computes, times the channel scale
        s_channel = qp.s_channel.to(q.device).reshape(-1, *([1] * (q.ndim - 1)))
        return (q * ex(qp.ratio)).round_().mul_(s_channel)
    if qp.offset is not None:  # LQQ: (u * s2 + min8) * s1, as u * (s1 * s2) + min8 * s1 (both exact)
        s1 = qp.s1.to(q.device).reshape(-1, *([1] * (q.ndim - 1)))
        return (q + qp.code_offset).mul_(ex(qp.scale)).add_(ex(qp.offset) * s1)
    if qp.szero is not None:  # unsigned-domain codes times scale, minus the fp16 scaled zero
        return (q + qp.code_offset).mul_(ex(qp.scale)).sub_(ex(qp.szero))
    if qp.zero is not None:
        return (q - ex(qp.zero).float()).mul_(ex(qp.scale))
    return q * ex(qp.scale)


def quantize_dequantize(w: torch.Tensor, qp: QParams, spec: QuantSpec, g_idx: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """`dequantize(quantize(w, qp, spec, g_idx), qp, g_idx)`, the same bits without the int8 codes in between, for
    the searches that fake-quantize a weight per candidate. The float codes are integers in int8's range already;
    adding 0 turns a -0 code into the +0 the int8 round trip gives. (A NaN weight stays NaN here, where the int8
    cast would make it some code; quantize's callers refuse non-finite weights first.)"""
    w = w.float()
    view, ex = _broadcast_view(w, qp, g_idx)
    return _dequant(_codes(view, qp, spec, ex).add_(0.0), qp, ex).reshape(w.shape)


def fake_quantize(w: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype = torch.float16,
                  clip_ratio: float | torch.Tensor | None = None) -> torch.Tensor:
    """Round-to-nearest quantize then dequantize `w` (float32 result), at `clip_ratio` where given (compute_qparams)."""
    return quantize_dequantize(w, compute_qparams(w, spec, scale_dtype, clip_ratio=clip_ratio), spec)


def quantize_column(col: torch.Tensor, qp: QParams, group: torch.Tensor | int, spec: QuantSpec
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and dequantized values of one column [N] under the parameters of `group` (an int, or a per-row
    index [N]) of `qp` (GPTQ's inner step)."""
    if isinstance(group, int):
        def ex(t: torch.Tensor) -> torch.Tensor:
            return t[:, group if t.shape[1] > 1 else 0]
    else:
        rows = torch.arange(col.shape[0], device=col.device)

        def ex(t: torch.Tensor) -> torch.Tensor:
            return t[rows if t.shape[0] > 1 else 0, group if t.shape[1] > 1 else 0]

    q = _codes(col.float(), qp, spec, ex)
    return q.to(torch.int8), _dequant(q, qp, ex)


def fake_quantize_per_token(x: torch.Tensor, bits: int = 8, symmetric: bool = True, clip_ratio: float = 1.0
                            ) -> torch.Tensor:
    """Dynamic per-token activation quantization (last dim): s = amax / qmax (times `clip_ratio`, for symmetric),
    q = round(x / s), as `emulate.quantize_tokens`. QServe's and vLLM's kernels round x * (127 / amax) instead,
    which moved 1.3 codes in 10^6 by one step on outlier-heavy fp16 rows. Asymmetric: round(x / s) + z, the zero
    added after rounding as vLLM's azp kernel does (`float_to_int32_rn(val / scale) + azp`), unlike the weights'
    Eq. 7; that kernel takes the token's own [min, max] where this range always holds 0, which differs only for a
    token of one sign."""
    qmax = (1 << (bits - 1)) - 1
    xf = x.float()
    # amax and amin are single fast reductions, while abs() costs a full temporary; the chain below works in
    # place on the one quotient it allocates (eval runs this on every linear input, so it dominates the hooks).
    lo = xf.amin(dim=-1, keepdim=True)
    hi = xf.amax(dim=-1, keepdim=True)
    if symmetric:
        scale = torch.maximum(hi, lo.neg_()).mul_(clip_ratio).div_(qmax)
        scale.masked_fill_(scale <= 0, 1.0)
        return (xf / scale).round_().clamp_(-qmax - 1, qmax).mul_(scale).to(x.dtype)
    lo.clamp_(max=0)
    hi.clamp_(min=0)
    levels = (1 << bits) - 1
    scale = (hi - lo).div_(levels)
    scale.masked_fill_(scale <= 0, 1.0)
    zero = torch.round(-lo / scale)
    q = (xf / scale).round_().add_(zero).clamp_(0, levels)
    return q.sub_(zero).mul_(scale).to(x.dtype)
