"""Bit-exact QServe / QoQ W4A8 weight layout (compute-aware reorder, level-2 group params) and reference models.

`qweight` is int8 [N, K/2], a reinterpretation of a byte stream cut into 32x32 (output x input channel) tiles, n-tile
major then k-tile. Each tile is 32 lanes x 16 bytes (one 128-bit load per thread of a warp). With
n = 32t + 16a + 8b + r and k = 32kt + 16p + 4c + e, lane 4r+c holds at byte 8p+4b+e the byte
code[n(a=0), k] | code[n(a=1), k] << 4: the two nibbles of a byte are output channels n and n+16 at the same k, and
the four bytes of each 32-bit word are four consecutive k of one channel (digest-qserve §3.2). Never slice `qweight`
along K; slicing along N at multiples of 32 is fine. The g128 level-2 params `s2_scales` / `s2_zeros` are int8
[K/g, N] (group-major); inside every 32-channel tile position p holds channel 8*(p % 4) + p // 4, and `s2_zeros`
stores the negated scaled zero -(z*s2) (digest §3.4). The kernel computes q*s2 + s2_zero with one 32-bit multiply
and one per-byte wraparound add (`vadd4`); `emulate_group_dequant` models exactly that.
"""

from __future__ import annotations

from typing import Literal

import torch

TILE = 32
_BYTE_MASK_LO = 0x0F0F0F0F
_WORD_MASK = 0xFFFFFFFF


def _require_int(t: torch.Tensor, name: str) -> None:
    """Raise TypeError unless `t` has an integer (non-bool) dtype."""
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")


def _require_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """Return `t` (int8 or uint8) viewed as uint8, or raise TypeError."""
    if t.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"{name} must be int8 (or uint8), got {t.dtype}")
    return t.contiguous().view(torch.uint8)


def pack_qweight(codes: torch.Tensor) -> torch.Tensor:
    """Pack UINT4 codes [N, K] (values 0..15) into QServe's compute-aware int8 `qweight` [N, K/2]."""
    _require_int(codes, "codes")
    if codes.ndim != 2 or codes.shape[0] % TILE or codes.shape[1] % TILE:
        raise ValueError(f"codes must be 2-D [N, K] with N and K multiples of 32, got shape {tuple(codes.shape)}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError(f"codes must lie in 0..15, got range [{int(codes.min())}, {int(codes.max())}]")
    n, k = codes.shape
    v = codes.to(torch.uint8).reshape(n // TILE, 2, 2, 8, k // TILE, 2, 4, 4)  # t a b r kt p c e
    v = v.permute(0, 4, 3, 6, 5, 2, 7, 1)  # t kt r c p b e a
    packed = v[..., 0] | (v[..., 1] << 4)  # [N/32, K/32, 32 lanes, 16 bytes]
    return packed.reshape(n, k // 2).contiguous().view(torch.int8)


def unpack_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_qweight`: int8 `qweight` [N, K/2] -> uint8 codes [N, K] in natural order."""
    b = _require_bytes(qweight, "qweight")
    if b.ndim != 2 or b.shape[0] % TILE or b.shape[1] % (TILE // 2):
        raise ValueError(f"qweight must be 2-D [N, K/2] with N and K multiples of 32, got shape {tuple(b.shape)}")
    n, k = b.shape[0], b.shape[1] * 2
    b = b.reshape(n // TILE, k // TILE, 8, 4, 2, 2, 4)  # t kt r c p b e
    v = torch.stack((b & 0x0F, b >> 4), dim=-1)  # t kt r c p b e a
    return v.permute(0, 7, 5, 2, 1, 4, 3, 6).reshape(n, k).contiguous()


def s2_order(n: int) -> torch.Tensor:
    """Stored-position -> channel permutation of the s2 tensors: in each 32-tile, position p holds 8*(p%4) + p//4."""
    if n < 0 or n % TILE:
        raise ValueError(f"s2_order needs a non-negative multiple of 32 channels, got {n}")
    p = torch.arange(n, dtype=torch.int64)
    q = p % TILE
    return p - q + 8 * (q % 4) + q // 4


def pack_group_params(s2: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack integer s2 [N, G] (1..127) and UINT4 zero [N, G] into int8 (s2_scales, s2_zeros=-(z*s2)), each [G, N]."""
    _require_int(s2, "s2")
    _require_int(zero, "zero")
    if s2.ndim != 2 or s2.shape != zero.shape or s2.shape[0] % TILE:
        raise ValueError(
            f"s2 and zero must both be [N, G] with N a multiple of 32, got {tuple(s2.shape)} and {tuple(zero.shape)}"
        )
    s2_64, z_64 = s2.to(torch.int64), zero.to(torch.int64)
    if s2_64.numel():
        if int(s2_64.min()) < 1 or int(s2_64.max()) > 127:
            raise ValueError(f"s2 must lie in 1..127, got range [{int(s2_64.min())}, {int(s2_64.max())}]")
        if int(z_64.min()) < 0 or int(z_64.max()) > 15:
            raise ValueError(f"zero must lie in 0..15 (UINT4), got range [{int(z_64.min())}, {int(z_64.max())}]")
        scaled = z_64 * s2_64
        if int(scaled.max()) > 128:
            raise ValueError(f"-(zero*s2) must fit int8, but zero*s2 reaches {int(scaled.max())} (> 128)")
    else:
        scaled = z_64
    order = s2_order(s2.shape[0]).to(s2.device)
    s2_scales = s2_64.t()[:, order].to(torch.int8).contiguous()
    s2_zeros = (-scaled).t()[:, order].to(torch.int8).contiguous()
    return s2_scales, s2_zeros


def unpack_group_params(s2_scales: torch.Tensor, s2_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_group_params`: int8 [G, N] -> (s2 int32 [N, G], scaled_zero = zero*s2 int32 [N, G])."""
    if s2_scales.dtype != torch.int8 or s2_zeros.dtype != torch.int8:
        raise TypeError(f"s2_scales and s2_zeros must be int8, got {s2_scales.dtype} and {s2_zeros.dtype}")
    if s2_scales.ndim != 2 or s2_scales.shape != s2_zeros.shape or s2_scales.shape[1] % TILE:
        raise ValueError(
            "s2_scales and s2_zeros must both be [G, N] with N a multiple of 32, got "
            f"{tuple(s2_scales.shape)} and {tuple(s2_zeros.shape)}"
        )
    inverse = torch.argsort(s2_order(s2_scales.shape[1])).to(s2_scales.device)
    s2 = s2_scales.to(torch.int32)[:, inverse].t().contiguous()
    scaled_zero = (-s2_zeros.to(torch.int32))[:, inverse].t().contiguous()
    return s2, scaled_zero


def _vadd4(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-byte add mod 256 of two tensors of 32-bit words (CUDA `__vadd4`), without carries between bytes."""
    low7 = (a & 0x7F7F7F7F) + (b & 0x7F7F7F7F)
    return low7 ^ ((a ^ b) & 0x80808080)


def emulate_group_dequant(
    qweight: torch.Tensor, s2_scales: torch.Tensor, s2_zeros: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """Model the per-group kernel's main-loop W4 -> INT8 arithmetic on 32-bit words; returns int8 W8 [N, K]."""
    b = _require_bytes(qweight, "qweight")
    s = _require_bytes(s2_scales, "s2_scales")
    z = _require_bytes(s2_zeros, "s2_zeros")
    if b.ndim != 2 or b.shape[0] % TILE or b.shape[1] % (TILE // 2):
        raise ValueError(f"qweight must be 2-D [N, K/2] with N and K multiples of 32, got shape {tuple(b.shape)}")
    n, k = b.shape[0], b.shape[1] * 2
    if group_size <= 0 or group_size % TILE or k % group_size:
        raise ValueError(f"group_size must be a positive multiple of 32 dividing K={k}, got {group_size}")
    if s.shape != (k // group_size, n) or z.shape != s.shape:
        raise ValueError(
            f"s2_scales and s2_zeros must be [K/group_size, N] = {(k // group_size, n)}, got "
            f"{tuple(s.shape)} and {tuple(z.shape)}"
        )
    tiles_n, tiles_k = n // TILE, k // TILE
    # One uint4 {x, y, z, w} per lane: 4 little-endian 32-bit words (word j = 2p + b), held as int64.
    by = b.reshape(tiles_n, tiles_k, 8, 4, 2, 2, 4).to(torch.int64)  # t kt r c p b byte
    words = by[..., 0] | (by[..., 1] << 8) | (by[..., 2] << 16) | (by[..., 3] << 24)  # t kt r c p b
    lo = words & _BYTE_MASK_LO  # output channel 32t + 8b + r
    hi = (words >> 4) & _BYTE_MASK_LO  # == (v & 0xF0F0F0F0) >> 4: output channel 32t + 16 + 8b + r
    # The lane's 4 s2 (and s2_zero) bytes: group row of the k-tile, offset 32t + 4*(lane // 4) + j; byte j serves
    # channel 8j + lane // 4, i.e. j = b for lo(.) and j = 2 + b for hi(.).
    group = torch.arange(tiles_k, device=b.device) * TILE // group_size
    s_lane = s[group].reshape(tiles_k, tiles_n, 8, 4).permute(1, 0, 2, 3).to(torch.int64)  # t kt r j
    z_lane = z[group].reshape(tiles_k, tiles_n, 8, 4).permute(1, 0, 2, 3).to(torch.int64)
    out = []
    for half in (0, 1):  # a: lo nibble then hi nibble
        codes = lo if half == 0 else hi
        sj = s_lane[..., 2 * half : 2 * half + 2][:, :, :, None, None, :]  # t kt r 1 1 b
        zj = z_lane[..., 2 * half : 2 * half + 2][:, :, :, None, None, :]
        prod = (codes * sj) & _WORD_MASK  # one 32-bit multiply by the zero-extended s2 byte
        res = _vadd4(prod, zj * 0x01010101)  # + replicated -(z*s2) byte, wrapping per byte
        out.append(torch.stack([(res >> (8 * e)) & 0xFF for e in range(4)], dim=-1))  # t kt r c p b e
    w8 = torch.stack(out, dim=-2).to(torch.uint8)  # t kt r c p b a e
    w8 = w8.permute(0, 6, 5, 2, 1, 4, 3, 7).reshape(n, k)  # t a b r kt p c e
    return w8.contiguous().view(torch.int8)


def _round(x: torch.Tensor, rounding: str) -> torch.Tensor:
    """Round to nearest: ties to even (torch.round) or ties toward +inf (floor(x + 0.5))."""
    if rounding == "half_even":
        return torch.round(x)
    if rounding == "half_up":
        return torch.floor(x + 0.5)
    raise ValueError(f"rounding must be 'half_even' or 'half_up', got {rounding!r}")


def progressive_quantize_reference(
    w: torch.Tensor,
    group_size: int = 128,
    protective: int = 119,
    *,
    rounding: Literal["half_even", "half_up"] = "half_even",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """QoQ progressive group quantization reference: (codes uint8 [N,K], s1 fp32 [N], s2 int32 [N,G], zero int32)."""
    # Level 1 (per output channel, symmetric INT8 with protective range):
    #   s1 = fp16(max|row| / protective) (1 for all-zero rows), x = clamp(w / s1, -protective, protective),
    #   x deliberately NOT rounded to integers (lmquant: only (q - z)*s2 ever exists as an INT8 value).
    # Level 2 (per group of `group_size` columns, Eq. 7 with integer scale and UINT4 zero, on x's group min/max):
    #   s2 = max(round((max - min) / 15), 1), z = clamp(round(0 - min / s2), 0, 15),
    #   q = clamp(round(x / s2 + z), 0, 15); dequantization is W8 = (q - z) * s2, W ~= s1 * W8.
    # `rounding` selects ties-to-even (default, torch.round) or ties-up (the paper's worked example).
    # With protective = 119 every (q - z)*s2 lies in [-128, 127]; with 127 it can reach 128 (group [-113, 120]).
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if group_size <= 0 or w.shape[1] % group_size:
        raise ValueError(f"K={w.shape[1]} must be a positive multiple of group_size={group_size}")
    if not 1 <= protective <= 127:
        raise ValueError(f"protective range must be in 1..127, got {protective}")
    x = w.to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("w contains non-finite values")
    n, k = x.shape
    amax = x.abs().amax(dim=1)
    s1 = (amax / protective).to(torch.float16).to(torch.float32)
    s1 = torch.where(amax == 0, torch.ones_like(s1), s1.clamp(min=2.0**-24, max=65504.0))
    x = (x / s1[:, None]).clamp(-protective, protective)
    xg = x.reshape(n, k // group_size, group_size)
    gmin, gmax = xg.amin(dim=2), xg.amax(dim=2)
    s2 = _round((gmax - gmin) / 15, rounding).clamp(min=1)
    zero = _round(0 - gmin / s2, rounding).clamp(0, 15)
    q = _round(xg / s2[..., None] + zero[..., None], rounding).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), s1, s2.to(torch.int32), zero.to(torch.int32)


__all__ = [
    "emulate_group_dequant",
    "pack_group_params",
    "pack_qweight",
    "progressive_quantize_reference",
    "s2_order",
    "unpack_group_params",
    "unpack_qweight",
]
