"""Bit-exact CPU emulation of the kernels that read quantkit's packed layouts (the W4A8 GEMMs, Atom's W4A4 GEMM
with INT8 outliers and the Any-Precision LUT GEMV: the arithmetic issue #6's kernels run), and the check of a
packed artifact against its reference dequantization (`quantkit validate`).

An emulation takes activations x [M, K] (float32) and one linear's stored tensors, and does what the kernel does:
1. per-token INT8 activations: s_x = max|x| / 127 (float32), q = round-half-even(x / s_x) clamped to [-128, 127];
2. the layout's INT8 weights [N, K] from the stored bytes through the kernel's own bit operations (QQQ's nibble
   mask or FP16 FMA trick, LiquidQuant's IMAD + XOR lanes, QServe's 32-bit multiply and vadd4 per group, or its
   UINT4 codes fed as they are per channel);
3. an exact integer accumulation over K (int32 in the kernel; an overflow is reported);
4. the epilogue in float32 in a fixed order, rounded once: y = fp16((float(acc) * s_w[n]) * s_x[m]), and for
   QServe per channel minus szero[n] * t_x[m], with t_x the per-token sum of the unquantized x (its zero point
   moved to the epilogue, paper Eq. 13).
The reference is the packer's `unpack(...).dequantize()`: its INT8 weights are round((W + szero) / s_w), and the
emulated accumulators must equal x_int8 @ those exactly; the fp16 outputs are compared with the float32 product
of the fake-quantized activations and the dequantized weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from quantkit.formats import liquidquant, qqq, qserve_layout

INT32 = (-(1 << 31), (1 << 31) - 1)


@dataclass
class Emulation:
    """What the kernel produces: the int32 accumulators [M, N] (int64 here), its fp16 outputs, and the pieces
    the check needs (INT8 activations and their scales, the per-channel weight scales)."""

    acc: np.ndarray
    out: np.ndarray
    x_int8: np.ndarray
    s_x: np.ndarray
    s_w: np.ndarray
    szero: np.ndarray | None = None  # QServe per channel: the scaled zero the epilogue subtracts


def quantize_tokens(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token symmetric INT8, q = round(x / s) (`quantizers.fake_quantize_per_token` says how engines differ):
    (codes int64 [M, K], scales float32 [M])."""
    x = np.asarray(x, dtype=np.float32)
    s = np.abs(x).max(axis=1) / np.float32(127)
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    q = np.clip(np.round(x / s[:, None]), -128, 127).astype(np.int64)
    return q, s


def int8_gemm(x_int8: np.ndarray, w_int8: np.ndarray) -> np.ndarray:
    """acc[m, n] = sum_k x[m, k] w[n, k], exactly; raises if a sum leaves int32 (the kernel would wrap)."""
    acc = x_int8.astype(np.int64) @ w_int8.astype(np.int64).T
    if acc.min(initial=0) < INT32[0] or acc.max(initial=0) > INT32[1]:
        raise OverflowError("an int32 accumulator overflows")
    return acc


def _epilogue(acc: np.ndarray, s_w: np.ndarray, s_x: np.ndarray, szero: np.ndarray | None = None,
              t_x: np.ndarray | None = None) -> np.ndarray:
    y = (acc.astype(np.float32) * s_w[None, :].astype(np.float32)) * s_x[:, None]
    if szero is not None:
        y = y - szero[None, :].astype(np.float32) * t_x[:, None]
    return y.astype(np.float16)


Weights = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # INT8 weights [N, K], s_w [N], szero [N] or None


def _qqq(tensors: dict[str, torch.Tensor]) -> Weights:
    s_group = tensors["s_group"].numpy() if "s_group" in tensors else None
    w = qqq.kernel_int8(tensors["B"].numpy(), s_group).T  # [N, K]
    s_w = qqq.permute_columns(tensors["s_channel"].numpy(), qqq.SCALE_PERM_SINGLE, inverse=True).reshape(-1)
    return w, s_w, None


def _liquidquant(tensors: dict[str, torch.Tensor]) -> Weights:
    w = liquidquant.kernel_int8(tensors["qweight"].numpy(), tensors["s2a"].numpy())
    return w, tensors["s1_scales"].float().numpy(), None


def _qserve(tensors: dict[str, torch.Tensor]) -> Weights:
    s1 = tensors["s1_scales"].float().numpy()
    if "s2_scales" in tensors:  # progressive groups: q * s2 - z * s2 per byte lane
        k = tensors["qweight"].shape[1] * 2
        group = k // tensors["s2_scales"].shape[0]
        w = qserve_layout.emulate_group_dequant(tensors["qweight"], tensors["s2_scales"], tensors["s2_zeros"], group)
        return w.numpy().astype(np.int64), s1, None
    codes = qserve_layout.unpack_qweight(tensors["qweight"]).numpy().astype(np.int64)  # UINT4 as s8 operands
    return codes, s1, tensors["s1_szeros"].float().numpy()


WEIGHTS: dict[str, Callable[[dict[str, torch.Tensor]], Weights]] = {
    "qqq": _qqq,
    "liquidquant": _liquidquant,
    "qserve": _qserve,
}


EMULATED = frozenset({*WEIGHTS, "atom", "anyprec"})  # formats `quantkit validate` checks (atom, anyprec: their own)


def emulate(fmt: str, tensors: dict[str, torch.Tensor], x: np.ndarray) -> Emulation:
    """The kernel's GEMM of layout `fmt` on one linear's stored tensors and activations x [M, K]."""
    if fmt not in WEIGHTS:
        raise KeyError(f"no kernel emulation for format {fmt!r} (emulated: {', '.join(sorted(WEIGHTS))})")
    x_int8, s_x = quantize_tokens(x)
    return emulate_quantized(fmt, tensors, x_int8, s_x, np.asarray(x, dtype=np.float32).sum(axis=1, dtype=np.float32))


def emulate_quantized(fmt: str, tensors: dict[str, torch.Tensor], x_int8: np.ndarray, s_x: np.ndarray,
                      t_x: np.ndarray | None = None) -> Emulation:
    """The GEMM from activations already quantized (codes, per-token scales, and for QServe per channel the sums
    t_x of the unquantized activations), as the kernels receive them."""
    w_int8, s_w, szero = WEIGHTS[fmt](tensors)
    s_x = np.asarray(s_x, dtype=np.float32)
    acc = int8_gemm(np.asarray(x_int8, dtype=np.int64), w_int8)
    out = _epilogue(acc, s_w, s_x, szero, None if szero is None else np.asarray(t_x, dtype=np.float32))
    return Emulation(acc, out, np.asarray(x_int8, dtype=np.int64), s_x, s_w.astype(np.float32), szero)


def _rel_error(out: np.ndarray, y_ref: np.ndarray) -> float:
    """The largest over tokens (rows) of max |out - y_ref| / max |y_ref| within the token's row (out the kernel's
    fp16 result): each token against its own outputs, so that a miss in a token of small outputs (its activation
    scale, say) is not measured against another token's large ones."""
    error = np.abs(out.astype(np.float32) - y_ref).max(axis=-1)
    return float((error / np.maximum(np.abs(y_ref).max(axis=-1), 1e-30)).max())


@dataclass
class Check:
    exact: bool  # the accumulators equal the reference integer product
    rel_error: float  # max |y - y_ref| / max |y_ref| of the fp16 outputs against the float32 reference, per token


def check_against_reference(emulation: Emulation, weight: torch.Tensor, x: np.ndarray) -> Check:
    """Compare an emulation with the reference dequantized weight [N, K] (float32) on the same activations."""
    w = weight.detach().float().numpy()
    szero = np.zeros_like(emulation.s_w) if emulation.szero is None else emulation.szero.astype(np.float32)
    ref_int8 = np.round((w + szero[:, None]) / emulation.s_w[:, None]).astype(np.int64)
    exact = bool(np.array_equal(emulation.acc, emulation.x_int8 @ ref_int8.T)
                 and np.array_equal(ref_int8.astype(np.float32) * emulation.s_w[:, None] - szero[:, None], w))
    x_hat = emulation.x_int8.astype(np.float32) * emulation.s_x[:, None]
    y_ref = x_hat @ w.T
    if emulation.szero is not None:  # QServe per channel: the zero point acts on sum(x), not sum(x_hat)
        gap = x_hat.sum(axis=1) - np.asarray(x, dtype=np.float32).sum(axis=1)
        y_ref = y_ref + gap[:, None] * emulation.szero[None, :]
    return Check(exact, _rel_error(emulation.out, y_ref))


@dataclass
class AtomEmulation:
    """Atom's W4A4 GEMM: per group the int32 partial sums [G + 1, M, N] (the outliers last) of the reordered INT4
    (INT8 for the outliers) activations and weights, the reordered activation codes [M, K], and the fp16 output."""

    partials: np.ndarray
    out: np.ndarray
    x_codes: np.ndarray
    order: np.ndarray
    s_x: np.ndarray  # [M, G + 1] float32: the activation scale of each (token, group), the outliers last


def _atom_groups(k: int) -> list[slice]:
    """The reordered columns of each Atom group: INT4 groups of 128, then the outliers."""
    from quantkit.formats.atom import GROUP, OUTLIERS

    groups = (k - OUTLIERS) // GROUP
    return [slice(g * GROUP, (g + 1) * GROUP) for g in range(groups)] + [slice(k - OUTLIERS, k)]


def emulate_atom(tensors: dict[str, torch.Tensor], x: np.ndarray, bits: int = 4, clip_ratio: float = 1.0
                 ) -> AtomEmulation:
    """The W4A4 kernel on Atom's stored tensors: activations reordered by `reorder_index`, quantized per (token,
    group of 128) to `bits` with scale clip * max|x| / qmax (float32) and per token to INT8 over the outliers;
    then `emulate_atom_quantized`."""
    order = tensors["reorder_index"].numpy()
    xr = np.asarray(x, dtype=np.float32)[:, order]
    m, k = xr.shape
    qmax = (1 << (bits - 1)) - 1
    groups = _atom_groups(k)
    codes = np.empty((m, k), dtype=np.int64)
    scales = np.empty((m, len(groups)), dtype=np.float32)
    for g, cols in enumerate(groups):
        outliers = g == len(groups) - 1
        top, lo, clip = (127, -128, np.float32(1)) if outliers else (qmax, -qmax - 1, np.float32(clip_ratio))
        s_x = np.abs(xr[:, cols]).max(axis=1) * clip / np.float32(top)
        scales[:, g] = np.where(s_x > 0, s_x, np.float32(1)).astype(np.float32)
        codes[:, cols] = np.clip(np.round(xr[:, cols] / scales[:, g, None]), lo, top)
    return emulate_atom_quantized(tensors, codes, scales)


def emulate_atom_quantized(tensors: dict[str, torch.Tensor], codes: np.ndarray, s_x: np.ndarray) -> AtomEmulation:
    """Atom's GEMM from activations already quantized (reordered codes [M, K], scales [M, G + 1]), as the kernel
    receives them: one integer MMA per group; acc += float(partial) * (s_x * s_w) in float32, groups in order,
    outliers last; fp16 out."""
    from quantkit.formats.atom import gather_scales

    packed = tensors["weight_int4"].numpy()
    nibbles = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int64)
    nibbles[:, 0::2], nibbles[:, 1::2] = packed & 0xF, packed >> 4
    w = np.concatenate([np.where(nibbles >= 8, nibbles - 16, nibbles),
                        tensors["weight_int8"].numpy().astype(np.int64)], axis=1)  # [N, K] reordered
    s_w = np.concatenate([gather_scales(tensors["scale_int4"].numpy()),
                          gather_scales(tensors["scale_int8"].numpy())[None]]).astype(np.float32)  # [G + 1, N]
    codes, s_x = np.asarray(codes, dtype=np.int64), np.asarray(s_x, dtype=np.float32)
    groups = _atom_groups(codes.shape[1])
    partials = np.empty((len(groups), codes.shape[0], w.shape[0]), dtype=np.int64)
    acc = np.zeros((codes.shape[0], w.shape[0]), dtype=np.float32)
    for g, cols in enumerate(groups):
        partials[g] = int8_gemm(codes[:, cols], w[:, cols])
        acc += partials[g].astype(np.float32) * (s_x[:, g, None] * s_w[g][None, :])
    return AtomEmulation(partials, acc.astype(np.float16), codes, tensors["reorder_index"].numpy(), s_x)


def check_atom(emulation: AtomEmulation, q, x: np.ndarray, bits: int = 4, clip_ratio: float = 1.0) -> Check:
    """Compare an Atom emulation with the reference unpack `q` (codes in the original order, g_idx): each group's
    partial sums against the reference codes of that group's columns, and the output against quantkit's
    activation simulation times the dequantized weight."""
    from quantkit.simulate import ActivationSim, fake_quantize_activation

    codes = q.codes.numpy().astype(np.int64)
    g_idx = q.g_idx.numpy() if q.g_idx is not None else np.arange(codes.shape[1]) // q.qparams.group_size
    position = np.empty_like(emulation.order)
    position[emulation.order] = np.arange(emulation.order.size)
    exact = True
    for g in range(emulation.partials.shape[0]):
        cols = np.flatnonzero(g_idx == g)  # ascending, as the reorder index lists them
        ref = emulation.x_codes[:, position[cols]] @ codes[:, cols].T
        exact &= bool(np.array_equal(ref, emulation.partials[g]))
    outliers = int((g_idx == g_idx.max()).sum())
    sim = ActivationSim(bits=bits, group_size=q.qparams.group_size, outliers=outliers, clip_ratio=clip_ratio)
    x_hat = fake_quantize_activation(torch.from_numpy(np.asarray(x, dtype=np.float32)), sim, q.g_idx).numpy()
    y_ref = x_hat @ q.dequantize().numpy().T
    return Check(exact, _rel_error(emulation.out, y_ref))


def transpose_planes(words: np.ndarray, bits: int) -> np.ndarray:
    """The any-precision kernel's bit transpose: from the `bits` plane words of one thread [..., bits] (uint32,
    plane 0 the code's most significant bit) to the 32 codes of the word in word order u [..., 32], with bit
    31 - u of every plane holding weight u. Widths up to 4 use four lanes of 4 bits: output word r takes bit
    3 - r of each nibble from every plane (masks 0x88888888 >> r), so nibble s of word r is the code of
    u = 4 (7 - s) + r; widths 5..8 the same with eight lanes of 8 bits (masks 0x80808080 >> r)."""
    words = np.asarray(words, dtype=np.uint32)
    lanes = 4 if bits <= 4 else 8
    out = np.zeros((*words.shape[:-1], WORD_BITS), dtype=np.int64)
    for r in range(lanes):
        mask = np.uint32(((0x88888888 if lanes == 4 else 0x80808080) >> r) & 0xFFFFFFFF)
        t = np.zeros(words.shape[:-1], dtype=np.uint32)
        for j in range(bits):  # plane j lands on bit (lanes - 1 - (lanes - bits) - j) of each lane
            shift = j - r + (lanes - bits)
            part = words[..., j] & mask
            t |= (part << np.uint32(-shift)) if shift < 0 else (part >> np.uint32(shift))
        for s in range(32 // lanes):  # lane s of word r: the code of u = lanes * (32 / lanes - 1 - s) + r
            u = lanes * (32 // lanes - 1 - s) + r
            out[..., u] = (t >> np.uint32(lanes * s)) & np.uint32((1 << lanes) - 1)
    return out


WORD_BITS = 32


def emulate_anyprec(tensors: dict[str, torch.Tensor], x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The any-precision LUT GEMV at width `bits`: each thread decodes its 32 weights per 1024-column chunk from the
    first `bits` planes (`transpose_planes`), looks them up in the row's `lut{bits}`, multiplies them with the
    activations of their columns (rounded to fp16, the kernel's input, so that every product is exact in float32)
    and accumulates in float32 in word order; the 32 threads' sums are reduced by
    an xor-shuffle tree (16, 8, 4, 2, 1), chunks are added in order, and the result is rounded to fp16. Returns
    (codes [N, K] as decoded, y [M, N] fp16)."""
    from quantkit.formats.anyprec_layout import column_map

    planes = tensors["qweight"].numpy()[:bits].view(np.uint32)  # [b, N, K/32]
    lut = tensors[f"lut{bits}"].float().numpy()  # [N, 2^b]
    n, words = planes.shape[1], planes.shape[2]
    k = words * WORD_BITS
    codes_w = transpose_planes(np.moveaxis(planes, 0, -1), bits)  # [N, K/32, 32] in word order
    cmap = column_map(k)  # [K/32, 32]: column of word w's weight u
    codes = np.empty((n, k), dtype=np.int64)
    codes[:, cmap] = codes_w
    values = np.take_along_axis(lut, codes_w.reshape(n, -1), axis=1).reshape(n, words, WORD_BITS).astype(np.float32)
    xs = np.asarray(x).astype(np.float16).astype(np.float32)[:, cmap]  # [M, K/32, 32], the kernel's fp16 input
    per_word = np.zeros((xs.shape[0], n, words), dtype=np.float32)
    for u in range(WORD_BITS):  # each thread in word order
        per_word += xs[:, None, :, u] * values[None, :, :, u]
    full = k // 1024
    y = np.zeros((xs.shape[0], n), dtype=np.float32)
    for chunk in range(full + (1 if k % 1024 else 0)):
        lanes = per_word[:, :, chunk * 32:chunk * 32 + 32]
        lanes = np.concatenate([lanes, np.zeros((*lanes.shape[:2], 32 - lanes.shape[2]), np.float32)], axis=2)
        for offset in (16, 8, 4, 2, 1):  # __shfl_xor_sync tree: lane l adds lane l ^ offset
            lanes = lanes + lanes[:, :, np.arange(32) ^ offset]
        y += lanes[:, :, 0]
    return codes, y.astype(np.float16)


def anyprec_tc_bound(tensors: dict[str, torch.Tensor], x: np.ndarray, bits: int, reference: np.ndarray
                     ) -> np.ndarray:
    """How far the tensor-core Any-Precision kernel may land from the emulation's fp16 output `reference` [M, N]:
    both add the same exact products of fp16 values in float32, only in another order and rounding, so the two
    differ by one fp16 rounding of the output (2^-10 |y|, two half-ulps) plus float32 summation error, bounded
    loosely by 2^-16 sum_k |x_k w_k|. A single wrong weight or column moves y by about sum_k |x_k w_k| / K, above
    the bound for any K up to 2^16."""
    from quantkit.formats.anyprec_layout import lut_dequantize, unpack_planes

    codes = unpack_planes(tensors["qweight"].numpy(), bits)
    weights = lut_dequantize(codes, tensors[f"lut{bits}"].float().numpy().astype(np.float64))
    x16 = np.abs(np.asarray(x).astype(np.float16).astype(np.float64))
    return 2.0**-10 * np.abs(reference.astype(np.float64)) + 2.0**-16 * (x16 @ np.abs(weights).T)


def within_anyprec_tc_bound(tensors: dict[str, torch.Tensor], x: np.ndarray, bits: int, out: np.ndarray,
                            reference: np.ndarray) -> bool:
    """Whether the tensor-core kernel's fp16 output `out` lies within `anyprec_tc_bound` of the emulation's."""
    error = np.abs(out.astype(np.float64) - reference.astype(np.float64))
    return bool(np.all(error <= anyprec_tc_bound(tensors, x, bits, reference)))


def check_anyprec(tensors: dict[str, torch.Tensor], q, x: np.ndarray) -> Check:
    """Every width the artifact serves: the decoded codes equal the reference unpack's (`at_bits`), and the fp16
    GEMV output matches x W_b^T; the worst width is reported."""
    exact, worst = True, 0.0
    for bits in range((q.spec.min_bits or q.spec.bits), q.spec.bits + 1):
        ref = q.at_bits(bits)
        decoded, y = emulate_anyprec(tensors, x, bits)
        exact &= bool(np.array_equal(decoded, ref.codes.numpy().astype(np.int64) + ref.qparams.code_offset))
        y_ref = np.asarray(x, dtype=np.float32) @ ref.dequantize().numpy().T
        worst = max(worst, _rel_error(y, y_ref))
    return Check(exact, worst)
