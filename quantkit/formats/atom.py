"""Atom W4A4 layout (`atom`): the reordered mixed-precision tensors of Atom's `LinearInt4` (efeslab/Atom).

Per quantized linear `<module>` (O outlier columns, G groups of 128 normal columns, N % 16 == 0):
- `reorder_index` int16 [K] (int16 as punica-atom's, so K <= 32768): the original column at each reordered
  position; every group is contiguous in it and the outliers come last. quantkit stores one per linear; punica-atom
  keeps one on each norm (shared by q/k/v, and by gate/up) and one on the attention module (before o_proj), and has
  none for down_proj, whose order it would need folded into the gate/up rows;
- `weight_int4` uint8 [N, (K - O) / 2]: the normal columns in that order, two's-complement INT4, the even column
  in the low nibble;
- `weight_int8` int8 [N, O]: the outlier columns;
- `scale_int4` fp16 [G, 4 N] and `scale_int8` fp16 [4 N]: `LinearInt4`'s shapes, each row's scale at
  (r // 16) 64 + (r % 8) 8 + (r // 8) % 2, written four times at stride 2 (punica-atom's `scale_index`, the order
  its reorder kernels write activation scales in; its GEMM reads weight scales as a plain [G, N], so no engine
  is known to read this layout).
The kernel runs an INT4 MMA per group of 128 and an INT8 MMA on the outliers, scaling each partial by the
activation and weight scales (the weights dequantize as q * scale, symmetric). Atom's kernels take groups of 128
and 128 outliers; no public engine loads Atom checkpoints, so quantkit's kernels and `eval` read it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from quantkit.formats.base import ExportError, Packer, stored_exactly
from quantkit.quantizers import QParams, QuantizedLinear, QuantSpec

GROUP = OUTLIERS = 128
INDEX_MAX = torch.iinfo(torch.int16).max + 1  # columns an int16 reorder_index can number (0 .. 32767)
TENSORS = ("reorder_index", "weight_int4", "weight_int8", "scale_int4", "scale_int8")


def scale_slots(n: int) -> np.ndarray:
    """[N, 4]: the positions of row r's four copies in a scale vector of 4 N entries (N % 16 == 0)."""
    r = np.arange(n)
    base = (r // 16) * 64 + (r % 8) * 8 + (r // 8) % 2
    return base[:, None] + 2 * np.arange(4)[None, :]


def scatter_scales(scale: np.ndarray) -> np.ndarray:
    """Row scales [..., N] to the fragment layout [..., 4 N]."""
    n = scale.shape[-1]
    out = np.zeros((*scale.shape[:-1], 4 * n), dtype=scale.dtype)
    out[..., scale_slots(n)] = scale[..., :, None]
    return out


def gather_scales(laid_out: np.ndarray) -> np.ndarray:
    """Inverse of `scatter_scales`; the four copies of each row must agree."""
    n = laid_out.shape[-1] // 4
    copies = laid_out[..., scale_slots(n)]
    if not (copies == copies[..., :1]).all():
        raise ExportError("atom scales: the four copies of a row's scale differ (corrupt tensor)")
    return copies[..., 0]


class AtomPacker(Packer):
    name = "atom"
    quant_method = "atom"

    def owns(self, key: str) -> bool:
        return key in TENSORS

    def check(self, module: str, spec: QuantSpec, shape: tuple[int, int]) -> None:
        """Atom's kernel shapes: INT4 groups of 128, 128 INT8 outliers, N a multiple of 16."""
        n, k = shape
        if not (spec.bits == 4 and spec.symmetric and spec.granularity == "group" and spec.group_size == GROUP
                and spec.outliers == OUTLIERS):
            raise ExportError(f"{module}: atom stores 4-bit symmetric groups of {GROUP} with {OUTLIERS} INT8 "
                              f"outliers; got bits={spec.bits}, granularity={spec.granularity}, group_size="
                              f"{spec.group_size}, outliers={spec.outliers}; use --set export.format=quantkit")
        if n % 16 or (k - OUTLIERS) % GROUP or k <= OUTLIERS:
            raise ExportError(f"{module}: shape [N={n}, K={k}] does not fit atom's kernel (N a multiple of 16, K - "
                              f"{OUTLIERS} a positive multiple of {GROUP}); use --set export.format=quantkit")
        if k > INDEX_MAX:
            raise ExportError(f"{module}: K={k} columns do not fit atom's int16 reorder_index (at most "
                              f"{INDEX_MAX}); use --set export.format=quantkit")

    def pack(self, q: QuantizedLinear) -> dict[str, torch.Tensor]:
        spec, qp = q.spec, q.qparams
        self.check("atom", spec, tuple(q.codes.shape))
        k = q.codes.shape[1]
        groups = (k - OUTLIERS) // GROUP
        g_idx = q.g_idx if q.g_idx is not None else torch.arange(k) // GROUP
        g_idx = g_idx.cpu()
        if torch.bincount(g_idx, minlength=groups + 1).tolist() != [GROUP] * groups + [OUTLIERS]:
            raise ExportError("atom: the column groups are not INT4 groups of 128 followed by 128 outliers")
        order = torch.argsort(g_idx, stable=True)
        codes = q.codes.cpu()[:, order].numpy().astype(np.int64)
        normal, outliers = codes[:, :k - OUTLIERS], codes[:, k - OUTLIERS:]
        if normal.min() < -8 or normal.max() > 7:
            raise ExportError("atom: an INT4 code lies outside [-8, 7]")
        nibbles = (normal & 0xF).astype(np.uint8)
        s = stored_exactly(qp.scale, torch.float16, "atom", "its scales").numpy()  # [N, groups + 1]
        return {
            "reorder_index": order.to(torch.int16),
            "weight_int4": torch.from_numpy(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)),
            "weight_int8": torch.from_numpy(outliers.astype(np.int8)),
            "scale_int4": torch.from_numpy(scatter_scales(np.ascontiguousarray(s[:, :groups].T))),
            "scale_int8": torch.from_numpy(scatter_scales(np.ascontiguousarray(s[:, groups]))),
        }

    def unpack(self, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> QuantizedLinear:
        """Exact inverse of `pack`: codes in the original column order, the scales (outlier group last) and g_idx."""
        order = tensors["reorder_index"].long()  # int16 as written; earlier quantkit artifacts hold int64
        packed = tensors["weight_int4"].numpy()
        low = (packed & 0xF).astype(np.int64)
        high = (packed >> 4).astype(np.int64)
        normal = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int64)
        normal[:, 0::2], normal[:, 1::2] = low, high
        normal = np.where(normal >= 8, normal - 16, normal)
        reordered = np.concatenate([normal, tensors["weight_int8"].numpy().astype(np.int64)], axis=1)
        n, k = reordered.shape
        if order.shape != (k,) or not torch.equal(torch.sort(order).values, torch.arange(k)):
            raise ExportError(f"atom: reorder_index is not a permutation of the {k} columns (corrupt tensor)")
        groups = (k - OUTLIERS) // GROUP
        codes = torch.empty(n, k, dtype=torch.int8)
        codes[:, order] = torch.from_numpy(reordered).to(torch.int8)
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[order] = torch.cat([torch.arange(k - OUTLIERS) // GROUP, torch.full((OUTLIERS,), groups)])
        s4 = gather_scales(tensors["scale_int4"].numpy())  # [groups, N]
        s8 = gather_scales(tensors["scale_int8"].numpy())  # [N]
        scale = torch.from_numpy(np.concatenate([s4.T, s8[:, None]], axis=1).astype(np.float32))
        return QuantizedLinear(codes, QParams(scale=scale, zero=None, group_size=GROUP), spec, g_idx)

    def quantization_config(self, specs: dict[str, QuantSpec]) -> dict[str, Any]:
        return {"quant_method": self.quant_method, "wbits": 4, "group_size": GROUP, "outliers": OUTLIERS,
                "outlier_bits": 8,
                "note": "Atom LinearInt4 layout; no public engine loads it; quantkit's kernels read it"}

    def notes(self, specs: dict[str, QuantSpec]) -> list[str]:
        return ["export format atom: no public engine loads Atom checkpoints; the activation reorder, INT4 "
                "groups and pre-RoPE INT4 KV cache are runtime settings of the engine (simulated by quantkit eval)"]
