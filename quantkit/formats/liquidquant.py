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
The packed tile layout will live here with the packer.
"""

from __future__ import annotations

import numpy as np

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
