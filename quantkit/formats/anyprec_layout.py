"""Any-Precision LLM bitplanes (the `qweight` of any-precision-llm checkpoints): one artifact, every width 3..8.

Codes are unsigned P-bit integers (P = the parent width, at most 8) whose b-bit prefix is the b-bit model's code
(incremental upscaling makes parent codes prefixes of their children's). They are stored as P bitplanes,
int32 [P, N, K/32], plane 0 the most significant bit, so a b-bit run reads the contiguous prefix planes 0..b-1.

Within a row the K columns go in chunks of 1024 (a warp: 32 threads x 32 columns); a last chunk of width
W = K mod 1024 (a multiple of 32) uses W/32 threads. Thread t of a chunk starting at column c0 owns word
32 c + t of every plane, and bit 31 - (8 j + e) of that word (byte j, most significant byte first; bit e of it,
most significant first) holds column c0 + j W/4 + 8 t + e. So the four bytes of one thread's word belong to
columns W/4 apart, which makes each of its four activation loads coalesced across the warp (the paper's
weight-layout optimization), and the kernel's bit transpose yields codes in the order it multiplies them.
"""

from __future__ import annotations

from functools import cache

import numpy as np

CHUNK = 1024  # columns per warp-wide chunk
WORD = 32


@cache
def column_map(k: int) -> np.ndarray:
    """[K/32, 32]: the column whose plane bit sits at bit 31 - u of word w (u = 0 is the most significant bit)."""
    if k % WORD:
        raise ValueError(f"any-precision bitplanes need K a multiple of 32, got {k}")
    full = k // CHUNK
    words = np.arange(k // WORD)
    chunk, thread = words // WORD, words % WORD
    start = np.minimum(chunk, full) * CHUNK
    width = np.where(chunk < full, CHUNK, k - full * CHUNK)
    thread = np.where(chunk < full, thread, words - WORD * full)
    u = np.arange(WORD)
    byte, bit = u // 8, u % 8
    out = start[:, None] + byte[None, :] * (width[:, None] // 4) + 8 * thread[:, None] + bit[None, :]
    out.flags.writeable = False
    return out


def pack_planes(codes: np.ndarray, parent_bits: int) -> np.ndarray:
    """Bitplanes int32 [P, N, K/32] of unsigned codes [N, K] < 2^P (P = `parent_bits`, 1..8)."""
    if not 1 <= parent_bits <= 8:
        raise ValueError(f"parent_bits must be in 1..8, got {parent_bits}")
    codes = np.asarray(codes)
    if codes.min(initial=0) < 0 or codes.max(initial=0) >= 1 << parent_bits:
        raise ValueError(f"codes must lie in [0, {(1 << parent_bits) - 1}] for {parent_bits}-bit planes")
    n, k = codes.shape
    gathered = codes.astype(np.uint32)[:, column_map(k)]  # [N, K/32, 32]: code of the column at bit 31 - u
    weights = np.uint32(1) << (31 - np.arange(WORD, dtype=np.uint32))
    planes = np.empty((parent_bits, n, k // WORD), dtype=np.uint32)
    for p in range(parent_bits):
        bits = (gathered >> np.uint32(parent_bits - 1 - p)) & np.uint32(1)
        planes[p] = (bits * weights).sum(axis=-1, dtype=np.uint64).astype(np.uint32)
    return planes.view(np.int32)


def unpack_planes(planes: np.ndarray, bits: int | None = None) -> np.ndarray:
    """Unsigned codes [N, K] (uint8) of the first `bits` planes (all by default): the `bits`-wide model."""
    p_total, n, words = planes.shape
    bits = p_total if bits is None else bits
    if not 1 <= bits <= p_total:
        raise ValueError(f"bits must be in 1..{p_total} for a {p_total}-plane artifact, got {bits}")
    k = words * WORD
    u32 = np.ascontiguousarray(planes[:bits]).view(np.uint32)
    shifts = (31 - np.arange(WORD, dtype=np.uint32))
    codes = np.zeros((n, k), dtype=np.uint8)
    cmap = column_map(k)
    for p in range(bits):
        plane_bits = ((u32[p][:, :, None] >> shifts) & np.uint32(1)).astype(np.uint8)  # [N, K/32, 32]
        codes[:, cmap] |= plane_bits << np.uint8(bits - 1 - p)
    return codes


def lut_dequantize(codes: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """Weights [N, K] from unsigned codes and per-row lookup tables [N, 2^b]."""
    return np.take_along_axis(lut, codes.astype(np.int64), axis=1)
