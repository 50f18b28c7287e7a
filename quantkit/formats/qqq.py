"""QQQ W4A8 layout (`quant_method: qqq`): what vLLM's QQQ method (PR #5218 to its removal in Aug 2025, so a vLLM
of the v0.5-v0.10 line) and GPTQModel's QQQQuantLinear load: Marlin-derived tiles for an INT8 mma.sync.

Per quantized linear `<module>` (K = in features, N = out features; N % 64 == 0, K % 128 == 0):
- `B` int32 [K/16, 2N]: the INT4 codes of W^T [K, N] cut into 16 x 16 tiles (tile (i, j) becomes row i, columns
  256 j ..), each 1024-code chunk of a row permuted so a warp's threads load their mma.m16n8k16 B fragments
  directly (`weight_perm`), then 8 codes per int32, code i in bits 4i..4i+3. The two forms differ:
  - per channel: two's-complement codes q in [-7, 7], interleave [4,0,5,1,6,2,7,3], so the high nibbles of the
    word's four bytes are elements 0-3: the kernel's `w & 0xF0F0F0F0` is four INT8 values 16 q
    (`(w << 4) & 0xF0F0F0F0` the other four);
  - per group (128): unsigned codes q + 8 in [0, 15], interleave [0,2,4,6,1,3,5,7] (Marlin's), expanded with the
    0x6400 FP16 trick to q, multiplied by the fp16 group ratio r with 1536 added in one hfma2 (the sum lies in
    [1409, 1663], where the fp16 ulp is 1, so the FMA's round-to-nearest-even is the integer rounding, and its bits
    are 0x6600 + round(q * r)), and the low bytes are the INT8 values round(q * r) (`kernel_int8` models exactly
    this, as quantkit's kernel computes it). vLLM's and the paper's kernel add 1152 = 0x6480 instead, which leaves
    0x80 + round(q * r) in the low byte, and XOR each byte with 0x80: the same INT8 values, since both sums are
    integers in [1024, 2048), where the one rounding is the same.
- `s_channel` float32 [1, N]: per channel scale / 16 (undoing the 16 q); per group the INT8 scale max|w_hat| / 127.
  Columns in `scale_perm_single` order within each 32.
- `s_group` float16 [K/128, N] (per group only): the ratios r = fp16(group scale / s_channel), columns in
  `scale_perm` order within each 64. The INT4 group scale itself is not stored (nothing reads it).
The GEMM accumulates INT8 x INT8 in int32 over all of K and ends with fp16(acc * s_channel[n] * s_token[m]).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import torch

from quantkit.formats.base import ExportError, Packer
from quantkit.quantizers import QParams, QuantizedLinear, QuantSpec

TILE = 16
MIN_N, MIN_K = 64, 128  # vLLM's MIN_THREAD_N / MIN_THREAD_K
GROUP = 128  # the only group size the kernel takes besides per channel
TENSORS = ("B", "s_channel", "s_group")
INTERLEAVE = {False: (4, 0, 5, 1, 6, 2, 7, 3), True: (0, 2, 4, 6, 1, 3, 5, 7)}  # per_group -> nibble order


@cache
def weight_perm(per_group: bool) -> np.ndarray:
    """Where each of a 1024-code chunk's positions comes from (B[.., p] = tiles[.., perm[p]]), interleave included.

    Thread t = 4 * col + r of a warp holds, for both 8-column halves of the tile, rows 4r..4r+3 of column `col`
    (the m16n8k16 B fragment); the pattern repeats for the chunk's four 16 x 16 tiles (256 codes apart)."""
    chunk = []
    for thread in range(32):
        col, r = thread // 4, thread % 4
        fragment = [16 * row + col + 8 * half for half in (0, 1) for row in range(4 * r, 4 * r + 4)]
        for tile in range(4):
            chunk += [p + 256 * tile for p in fragment]
    order = np.array(chunk).reshape(-1, 8)[:, list(INTERLEAVE[per_group])]
    return order.reshape(-1)


SCALE_PERM = np.array([i + 8 * j for i in range(8) for j in range(8)])  # group ratios, within each 64 columns
SCALE_PERM_SINGLE = np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])  # within 32


def pack_b(q_kn: np.ndarray, per_group: bool) -> np.ndarray:
    """`B` int32 [K/16, 2N] from codes [K, N]: per group unsigned 0..15, per channel signed -7..7."""
    k, n = q_kn.shape
    tiles = q_kn.reshape(k // TILE, TILE, n // TILE, TILE).transpose(0, 2, 1, 3).reshape(k // TILE, n * TILE)
    perm = weight_perm(per_group)
    nibbles = (tiles.reshape(-1, perm.size)[:, perm].reshape(tiles.shape).astype(np.int64) & 0xF).astype(np.uint32)
    words = np.zeros((k // TILE, 2 * n), dtype=np.uint32)
    for i in range(8):
        words |= nibbles[:, i::8] << np.uint32(4 * i)
    return words.view(np.int32)


def unpack_b(b: np.ndarray, per_group: bool) -> np.ndarray:
    """Codes [K, N] (int64) from `B`: exact inverse of `pack_b`."""
    rows, cols = b.shape
    k, n = rows * TILE, cols // 2
    words = np.ascontiguousarray(b).view(np.uint32)
    nibbles = np.zeros((rows, n * TILE), dtype=np.int64)
    for i in range(8):
        nibbles[:, i::8] = (words >> np.uint32(4 * i)) & 0xF
    perm = weight_perm(per_group)
    tiles = nibbles.reshape(-1, perm.size)[:, np.argsort(perm)].reshape(rows, n * TILE)
    q = tiles.reshape(rows, n // TILE, TILE, TILE).transpose(0, 2, 1, 3).reshape(k, n)
    return q if per_group else np.where(q >= 8, q - 16, q)


def permute_columns(t: np.ndarray, perm: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Apply a scale permutation to every run of len(perm) columns of `t` [R, N] (or undo it)."""
    rows, n = t.shape
    p = np.argsort(perm) if inverse else perm
    return np.ascontiguousarray(t.reshape(-1, p.size)[:, p].reshape(rows, n))


def kernel_int8(b: np.ndarray, s_group: np.ndarray | None) -> np.ndarray:
    """The INT8 B operand [K, N] the kernel feeds its MMA, from the stored tensors, with its own bit operations:
    per channel (no `s_group`) the masked high nibbles; per group the 0x6400 expansion, one fp16 FMA
    (q * r + 1536, rounded once), its low byte. `s_group` is the stored (permuted) fp16 tensor."""
    rows, cols = b.shape
    k, n = rows * TILE, cols // 2
    words = np.ascontiguousarray(b).view(np.uint32)
    if s_group is None:
        hi = (words & np.uint32(0xF0F0F0F0)).view(np.uint8).view(np.int8).reshape(rows, cols, 4)
        lo = ((words << np.uint32(4)) & np.uint32(0xF0F0F0F0)).view(np.uint8).view(np.int8).reshape(rows, cols, 4)
        lanes = np.concatenate([hi, lo], axis=-1)  # elements 0-3, then 4-7 of each word
        return _untile(lanes.reshape(rows, n * TILE).astype(np.int64), per_group=False, k=k, n=n)
    # per group: both fp16 halves of (w & 0x000F000F) | 0x64006400 are 1024 + nibble; the kernel subtracts 1032
    # (or, for the nibbles at bits 4..7, FMAs by 1/16 and -72), which gives nibble - 8 exactly in fp16
    pairs = []
    for word in (words, words >> np.uint32(8)):
        for shift in (0, 4):
            for half in (0, 16):
                pairs.append(((word >> np.uint32(shift + half)) & np.uint32(0xF)).astype(np.int64) - 8)
    # word order: (q, shift 0) -> elements 0, 1; (q, shift 4) -> 2, 3; (q >> 8, 0) -> 4, 5; (q >> 8, 4) -> 6, 7
    q = np.stack(pairs, axis=-1).reshape(rows, n * TILE)
    q = _untile(q, per_group=True, k=k, n=n)
    r = permute_columns(s_group.astype(np.float16), SCALE_PERM, inverse=True).astype(np.float64)
    exact = q * np.repeat(r, GROUP, axis=0) + 1536.0  # exact in float64 (fp16 ratio x 4-bit integer + 1.5 * 2^10)
    low = np.float16(exact).view(np.uint16) & np.uint16(0xFF)  # the hfma2's single rounding, then prmt's byte
    return low.astype(np.uint8).view(np.int8).astype(np.int64)


def _untile(lanes: np.ndarray, per_group: bool, k: int, n: int) -> np.ndarray:
    """Codes [K, N] from words' elements in sequence [K/16, 16 N]: element j of a word is the chunk position
    `weight_perm` gives before its interleave (the interleave only says which nibble holds it)."""
    inter = np.argsort(INTERLEAVE[per_group])
    base = weight_perm(per_group).reshape(-1, 8)[:, inter].reshape(-1)
    tiles = lanes.reshape(-1, base.size)[:, np.argsort(base)].reshape(lanes.shape)
    return tiles.reshape(k // TILE, n // TILE, TILE, TILE).transpose(0, 2, 1, 3).reshape(k, n)


class QQQPacker(Packer):
    name = "qqq"
    quant_method = "qqq"
    float16_only = "vLLM's QQQ method takes fp16 only"

    def owns(self, key: str) -> bool:
        return key in TENSORS

    def check_recipe(self) -> None:
        """QQQ kernels take fp16 models and per-token symmetric INT8 activations."""
        self.require_fp16()
        self.require_all_targets("vLLM's and GPTQModel's QQQ methods")
        self.require_int8_token_activations("vLLM's and GPTQModel's QQQ methods")

    def check(self, module: str, spec: QuantSpec, shape: tuple[int, int]) -> None:
        """4-bit symmetric, per channel on [-7, 7] or groups of 128 re-expressed over INT8; N % 64, K % 128."""
        _require_qqq(spec, module)
        n, k = shape
        if n % MIN_N or k % MIN_K:
            raise ExportError(f"{module}: shape [N={n}, K={k}] does not fit qqq's kernel (N must be a multiple of "
                              f"{MIN_N}, K of {MIN_K}); use --set export.format=quantkit for a simulation artifact")

    def pack(self, q: QuantizedLinear) -> dict[str, torch.Tensor]:
        """`B`, `s_channel` and (per group) `s_group` of a finished result (codes and scales on the CPU)."""
        spec = q.spec
        _require_qqq(spec, "qqq")
        if q.g_idx is not None:
            raise ExportError("qqq cannot store permuted groups (the kernel has no g_idx): use static groups")
        q = q.finished()
        qp = q.qparams
        codes = q.codes.detach().cpu().numpy().astype(np.int64)
        n, k = codes.shape
        if n % MIN_N or k % MIN_K:
            raise ExportError(f"qqq needs N % {MIN_N} == 0 and K % {MIN_K} == 0, got [{n}, {k}]")
        per_group = spec.granularity == "group"
        if per_group:
            ratio = qp.ratio.detach().cpu().float()
            if not torch.equal(ratio.half().float(), ratio) or qp.group_size != GROUP:
                raise ExportError("qqq per group needs groups of 128 with fp16 ratios (requant_int8)")
            int8 = torch.round(torch.from_numpy(codes).float() * ratio.repeat_interleave(GROUP, dim=1))
            if int8.abs().max() > 127:
                raise ExportError("qqq: a group ratio would take an INT8 weight outside [-127, 127]")
            s_channel = qp.s_channel.detach().cpu().float().reshape(1, n)
            b = pack_b(codes.T + 8, per_group=True)
            s_group = permute_columns(ratio.T.contiguous().half().numpy(), SCALE_PERM)
        else:
            if codes.min() < -7 or codes.max() > 7:
                raise ExportError("qqq per channel stores codes in [-7, 7] (weights: narrow_range)")
            s_channel = qp.scale.detach().cpu().float().reshape(1, n) / 16  # exact: a power of two
            b = pack_b(codes.T, per_group=False)
        out = {"B": torch.from_numpy(b),
               "s_channel": torch.from_numpy(permute_columns(s_channel.numpy(), SCALE_PERM_SINGLE))}
        if per_group:
            out["s_group"] = torch.from_numpy(s_group)
        return out

    def unpack(self, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> QuantizedLinear:
        """Exact inverse of `pack`: the signed codes, s_channel and (per group) the ratios; per group `scale` holds
        ratio * s_channel, since the INT4 group scale is not stored."""
        per_group = "s_group" in tensors
        codes = unpack_b(tensors["B"].numpy(), per_group)
        k, n = codes.shape
        s_channel = torch.from_numpy(permute_columns(tensors["s_channel"].numpy(), SCALE_PERM_SINGLE, inverse=True))
        s_channel = s_channel.reshape(n, 1)
        if per_group:
            ratio = torch.from_numpy(permute_columns(tensors["s_group"].numpy(), SCALE_PERM, inverse=True))
            ratio = ratio.float().T.contiguous()
            qp = QParams(scale=ratio * s_channel, zero=None, group_size=GROUP, s_channel=s_channel, ratio=ratio)
            signed = codes.T - 8
        else:
            qp = QParams(scale=s_channel * 16, zero=None, group_size=k)
            signed = codes.T
        return QuantizedLinear(torch.from_numpy(np.ascontiguousarray(signed)).to(torch.int8), qp, spec)

    def quantization_config(self, specs: dict[str, QuantSpec]) -> dict[str, Any]:
        """vLLM's QQQConfig entry: one group size for every linear (-1 per channel)."""
        sizes = {GROUP if s.granularity == "group" else -1 for s in specs.values()}
        if len(sizes) != 1:
            raise ExportError(f"qqq checkpoints use one group size for every linear; got {sorted(sizes)}")
        return {"quant_method": self.quant_method, "wbits": 4, "group_size": sizes.pop()}

    def notes(self, specs: dict[str, QuantSpec]) -> list[str]:
        """Who loads it; and a simulated KV cache, which its engines do not run."""
        kv = ([] if self.recipe.kv_cache is None else
              ["export format qqq: the recipe's KV cache quantization is simulated by quantkit eval, not exported: "
               "vLLM keeps its KV cache in floating point (fp16, or fp8 with --kv-cache-dtype fp8), so it serves "
               "other numbers than eval measured"])
        return ["export format qqq: vLLM loads it from PR #5218 until its removal (PR #23204, Aug 2025), so pin a "
                "vLLM of that window (<= v0.10.1); GPTQModel's QQQ kernel also reads it", *kv]


def _require_qqq(spec: QuantSpec, where: str) -> None:
    per_channel = spec.granularity == "channel" and spec.narrow_range and not spec.requant_int8
    per_group = spec.granularity == "group" and spec.group_size == GROUP and spec.requant_int8
    if spec.bits != 4 or not spec.symmetric or spec.progressive or not (per_channel or per_group):
        raise ExportError(
            f"{where}: qqq stores 4-bit symmetric weights either per channel on [-7, 7] (weights: {{granularity: "
            f"channel, narrow_range: true}}) or in groups of {GROUP} over an INT8 channel scale (weights: "
            f"{{granularity: group, group_size: {GROUP}, requant_int8: true}}); got bits={spec.bits}, "
            f"symmetric={spec.symmetric}, granularity={spec.granularity}, group_size={spec.group_size}, "
            f"narrow_range={spec.narrow_range}, requant_int8={spec.requant_int8}")
