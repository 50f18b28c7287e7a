"""LiquidQuant (LiquidGEMM, SC'25) integer dequantization, modelled exactly as the kernel runs it.

Weights are two-level (`QuantSpec(progressive=True, level2="lqq")`, see `quantizers`): INT8 per channel, then
per group UINT4 codes u with an integer step s (1..16) and the byte a = 128 + min8 of the group. A thread holds
eight codes in one 32-bit register, one per nibble, all of the same output row and group; the kernel turns
them into eight INT8 values with five integer instructions:

    lo = R & 0x0F0F0F0F          # the low nibble of each byte: four lanes
    hi = (R >> 4) & 0x0F0F0F0F   # the high nibbles
    lo = lo * s + a * 0x01010101 # IMAD, modulo 2^32: one multiply-add for four byte lanes
    lo ^= 0x80808080             # LOP3: per-lane "- 128 mod 256", carry-free
    (the same for hi)

Each lane then holds the two's-complement byte of u * s + min8. That holds only if no lane exceeds 255
before the XOR (a carry would corrupt the next lane); the quantizer's per-group code bound
u <= (127 - min8) // s guarantees it, and `tests/test_liquidquant.py` checks every (min8, max8) group.

Export format `liquidquant` (layout "lqq_dual64"; the paper leaves the tile order open, this is ours): per
linear [N, K] with N and K multiples of 64 and groups of 64,
- `qweight` uint8 [N/64, K/64, 2048]: one 64 x 64 block (one group per row) per (row tile, K tile), K tiles
  contiguous within a row tile. Thread t of the 128 that dequantize a block owns bytes 16t..16t+15, four
  32-bit registers. With w = t // 32, gid = (t % 32) // 4, tig = t % 4, rows r0 = 16 w + gid and r1 = r0 + 8:
  register 2j + h (j = 0, 1 the two k32 MMAs one 128-bit load feeds; h = 0 for r0, 1 for r1), byte b, holds
  column 32 j + 4 tig + b in its low nibble and column 32 j + 4 tig + 16 + b in its high nibble. Unpacking a
  register therefore gives the A fragments a0/a1 (low) and a2/a3 (high) of `mma.m16n8k32.s8` (and of each
  warp's slice of wgmma m64nNk32), and all eight codes share one row and group: one (s, a) per register.
- `s2a` uint8 [N/64, K/64, 64, 2]: per block row, the step s (1..16) and the byte a = 128 + min8.
- `s1_scales` fp16 [N]: level-1 per-channel scales, applied in the epilogue: y = fp16(acc_i32 * s1 * s_x).
No public engine loads it (LiquidServe is not released); quantkit's own CUDA kernels (kernels/liquidquant_w4a8.cu,
run by `quantkit validate` and `quantkit bench`) read it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from quantkit.formats.base import ExportError, Packer, stored_exactly
from quantkit.quantizers import QParams, QuantizedLinear, QuantSpec, lqq_code_bound

LOW_NIBBLES = np.uint32(0x0F0F0F0F)
ONES = np.uint32(0x01010101)
SIGN_BITS = np.uint32(0x80808080)


def lane_dequant(words: np.ndarray, s: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's dequantization of 32-bit registers `words` (uint32, eight UINT4 codes each) with their
    group's step `s` and byte `a` (broadcastable to `words`), in uint32 arithmetic modulo 2^32.

    Returns the INT8 results of the low-nibble lanes and of the high-nibble lanes, each [..., 4] with lane i
    from byte i of the register.
    """
    words = np.asarray(words, dtype=np.uint32)
    s = np.asarray(s, dtype=np.uint32)
    aw = np.asarray(a, dtype=np.uint32) * ONES
    with np.errstate(over="ignore"):  # wrapping is the arithmetic being modelled
        lo = (words & LOW_NIBBLES) * s + aw
        hi = ((words >> np.uint32(4)) & LOW_NIBBLES) * s + aw
    return _bytes(lo ^ SIGN_BITS), _bytes(hi ^ SIGN_BITS)


def _bytes(words: np.ndarray) -> np.ndarray:
    """The four bytes of each uint32 as int8, lane i = bits 8i..8i+7."""
    shifts = np.arange(4, dtype=np.uint32) * np.uint32(8)
    return ((words[..., None] >> shifts) & np.uint32(0xFF)).astype(np.uint8).view(np.int8)


def pack_register(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """uint32 registers from codes [..., 4] for the low and the high nibble of bytes 0..3 (inverse of the
    kernel's unpack)."""
    low = np.asarray(low, dtype=np.uint32)
    high = np.asarray(high, dtype=np.uint32)
    if (low > 15).any() or (high > 15).any():
        raise ValueError("UINT4 codes must be in 0..15")
    shifts = np.arange(4, dtype=np.uint32) * np.uint32(8)
    return ((low | (high << np.uint32(4))) << shifts).sum(axis=-1, dtype=np.uint32)


BLOCK = 64  # rows and columns of one packed block; also the only group size the layout takes
OFFSET = 8  # signed 4-bit code + 8 = the UINT4 code stored
TENSORS = frozenset({"qweight", "s2a", "s1_scales"})


def _block_coords() -> tuple[np.ndarray, np.ndarray]:
    """(row, column) inside a 64 x 64 block of the low [:, 0] and high [:, 1] nibble of each of its 2048 bytes."""
    rows = np.zeros((2048, 2), dtype=np.int64)
    cols = np.zeros((2048, 2), dtype=np.int64)
    for t in range(128):
        w, lane = divmod(t, 32)
        gid, tig = divmod(lane, 4)
        for j in range(2):
            for h, r in enumerate((16 * w + gid, 16 * w + gid + 8)):
                for b in range(4):
                    byte = 16 * t + 4 * (2 * j + h) + b
                    rows[byte] = r
                    cols[byte] = (32 * j + 4 * tig + b, 32 * j + 4 * tig + 16 + b)
    return rows, cols


ROWS, COLS = _block_coords()


def pack_codes(u: np.ndarray) -> np.ndarray:
    """UINT4 codes [N, K] (N, K multiples of 64) -> `qweight` bytes [N/64, K/64, 2048]."""
    n, k = u.shape
    blocks = u.astype(np.uint8).reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK).transpose(0, 2, 1, 3)
    lo = blocks[:, :, ROWS[:, 0], COLS[:, 0]]
    hi = blocks[:, :, ROWS[:, 1], COLS[:, 1]]
    return lo | (hi << 4)


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """Inverse of `pack_codes`: UINT4 codes [N, K]."""
    nt, kt, _ = packed.shape
    blocks = np.zeros((nt, kt, BLOCK, BLOCK), dtype=np.uint8)
    blocks[:, :, ROWS[:, 0], COLS[:, 0]] = packed & 0x0F
    blocks[:, :, ROWS[:, 1], COLS[:, 1]] = packed >> 4
    return blocks.transpose(0, 2, 1, 3).reshape(nt * BLOCK, kt * BLOCK)


def registers(packed: np.ndarray) -> np.ndarray:
    """The 32-bit registers a block's threads load: [..., 128 threads, 4 registers] uint32 (little-endian)."""
    return np.ascontiguousarray(packed).view("<u4").reshape(*packed.shape[:-1], 128, 4)


def register_rows() -> np.ndarray:
    """Block row of each (thread, register) [128, 4]: the row whose (s, a) the register's eight codes use."""
    return ROWS[:, 0].reshape(128, 4, 4)[:, :, 0]


def kernel_int8(qweight: np.ndarray, s2a: np.ndarray) -> np.ndarray:
    """The INT8 weights [N, K] (int64) the kernel's IMAD + XOR makes from the stored `qweight` and `s2a`, each lane
    put back at the cell the layout assigns it (the A operand of its MMAs)."""
    regs = registers(qweight)  # [N/64, K/64, 128, 4]
    sa = s2a.astype(np.uint32)
    rows = register_rows()
    lo, hi = lane_dequant(regs, sa[:, :, rows, 0], sa[:, :, rows, 1])  # [N/64, K/64, 128, 4, 4]
    nt, kt = qweight.shape[:2]
    blocks = np.zeros((nt, kt, BLOCK, BLOCK), dtype=np.int64)
    r, c = ROWS.reshape(128, 4, 4, 2), COLS.reshape(128, 4, 4, 2)
    blocks[:, :, r[..., 0], c[..., 0]] = lo
    blocks[:, :, r[..., 1], c[..., 1]] = hi
    return blocks.transpose(0, 2, 1, 3).reshape(nt * BLOCK, kt * BLOCK)


class LiquidQuantPacker(Packer):
    name = "liquidquant"
    quant_method = "liquidquant"

    def owns(self, key: str) -> bool:
        return key in TENSORS

    def check(self, module: str, spec: QuantSpec, shape: tuple[int, int]) -> None:
        """LiquidQuant weights (progressive, level2 lqq, groups of 64), N and K multiples of 64."""
        _require_lqq(spec, module)
        n, k = shape
        if n % BLOCK or k % BLOCK:
            raise ExportError(f"{module}: shape [N={n}, K={k}] does not fit liquidquant's 64 x 64 blocks (N and K "
                              "must be multiples of 64); use --set export.format=quantkit for a simulation artifact")

    def pack(self, q: QuantizedLinear) -> dict[str, torch.Tensor]:
        """`qweight`, `s2a` and `s1_scales`; refuses anything whose kernel lanes could leave a byte."""
        spec, qp = q.spec, q.qparams
        _require_lqq(spec, "liquidquant")
        if q.g_idx is not None:
            raise ExportError("liquidquant cannot store permuted groups (g_idx): use act-order off or static groups")
        if qp.s1 is None or qp.s2 is None or qp.offset is None or qp.code_offset != OFFSET:
            raise ExportError("liquidquant export needs s1, the integer steps and the group offsets (level2 lqq)")
        n, k = q.codes.shape
        if n % BLOCK or k % BLOCK or qp.group_size != BLOCK:
            raise ExportError(f"liquidquant needs N, K multiples of 64 and groups of 64, got [{n}, {k}] with "
                              f"group size {qp.group_size}")
        u = q.codes.detach().cpu().numpy().astype(np.int64) + OFFSET
        s = qp.s2.detach().cpu().numpy()
        m = qp.offset.detach().cpu().numpy()
        if not (np.array_equal(s, np.round(s)) and s.min() >= 1 and s.max() <= 16):
            raise ExportError("liquidquant steps must be integers in 1..16")
        if not (np.array_equal(m, np.round(m)) and m.min() >= -128 and m.max() <= 127):
            raise ExportError("liquidquant group offsets must be INT8 values")
        lanes = u.reshape(n, k // BLOCK, BLOCK) * s[..., None] + (128 + m)[..., None]
        if u.min() < 0 or u.max() > 15 or lanes.max() > 255:
            raise ExportError("liquidquant: a code would overflow the kernel's byte lane (u * s + 128 + min > 255); "
                              "the codes ignore the quantizer's per-group code bound")
        s1 = stored_exactly(qp.s1.reshape(n), torch.float16, "liquidquant", "the level-1 scales s1")
        sa = np.stack([s, 128 + m], axis=-1).astype(np.uint8)  # [N, K/64, 2]
        return {
            "qweight": torch.from_numpy(pack_codes(u)),
            "s2a": torch.from_numpy(np.ascontiguousarray(sa.reshape(n // BLOCK, BLOCK, k // BLOCK, 2)
                                                         .transpose(0, 2, 1, 3))),
            "s1_scales": s1.contiguous(),
        }

    def unpack(self, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> QuantizedLinear:
        """Exact inverse of `pack`: signed codes and the full QParams (steps, offsets, code bounds)."""
        packed = tensors["qweight"].numpy()
        u = unpack_codes(packed)
        n, k = u.shape
        sa = tensors["s2a"].numpy().transpose(0, 2, 1, 3).reshape(n, k // BLOCK, 2).astype(np.int64)
        s2 = torch.from_numpy(sa[..., 0]).float()
        offset = torch.from_numpy(sa[..., 1] - 128).float()
        s1 = tensors["s1_scales"].float().reshape(n, 1)
        code_hi = lqq_code_bound(offset, s2) - OFFSET
        qp = QParams(scale=s1 * s2, zero=None, group_size=BLOCK, s1=s1, s2=s2, offset=offset,
                     code_lo=torch.full_like(s2, -OFFSET).to(torch.int32), code_hi=code_hi.to(torch.int32),
                     protect=spec.protective_range, code_offset=OFFSET)
        codes = torch.from_numpy(u.astype(np.int8) - OFFSET)
        return QuantizedLinear(codes, qp, spec)

    def quantization_config(self, specs: dict[str, QuantSpec]) -> dict[str, Any]:
        return {"quant_method": self.quant_method, "wbits": 4, "abits": 8, "group_size": BLOCK, "layout": "lqq_dual64",
                "note": "no public engine loads it; quantkit's kernels read it"}

    def notes(self, specs: dict[str, QuantSpec]) -> list[str]:
        return ["export format liquidquant: no public engine loads it (LiquidServe is not released)"]


def _require_lqq(spec: QuantSpec, where: str) -> None:
    if not (spec.progressive and spec.level2 == "lqq" and spec.bits == 4 and spec.granularity == "group"
            and spec.group_size == BLOCK):
        raise ExportError(f"{where}: liquidquant stores LiquidQuant weights only (weights: progressive, level2 lqq, "
                          f"4 bits, groups of {BLOCK}); got bits={spec.bits}, granularity={spec.granularity}, "
                          f"group_size={spec.group_size}, progressive={spec.progressive}, level2={spec.level2}")
