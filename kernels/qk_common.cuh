// Shared by every quantkit kernel: the integer lane operations and epilogue of the packed layouts, written once
// as __host__ __device__ functions so that the same source runs on the GPU (nvcc / NVRTC through CuPy) and, built
// with a host C++ compiler (QK_HOST), under quantkit's warp simulator on the CPU (kernels/host_sim.cpp), where the
// tests check it bit for bit against the numpy emulation (quantkit/emulate.py).
#pragma once

#ifdef QK_HOST
#include <cmath>
#include <cstdint>
#include <cstring>
#define QK_FN inline
#define __global__
#define __restrict__
typedef uint16_t qk_half;  // fp16 bits; the host build never does arithmetic on it
#else
#include <cuda_fp16.h>
#define QK_FN __host__ __device__ __forceinline__
typedef unsigned short qk_half;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef unsigned long long uint64_t;
#endif
#include "qk_timeline.cuh"

// QK_EPILOGUE_EARLY = 1 (the default since H100 tuning run 6, 0.89-1.01x the time of 0; 0 is bench/smallm_tune.py's
// EPI-LATE, as before): the decode kernels that have the registers (QServe per channel, LiquidQuant up to 8 tokens)
// have copy 0 load its epilogue's scales (and zero points and token sums) into registers before the K loop, in flight
// with the weights, not after the split-K meeting, where each is a round trip to device memory that every tile of a
// small grid waits on at its end. An H200 run found them prefetched to L2 no faster; bench/timeline.py shows what the
// epilogue costs. The same arithmetic in the same order: the same bits (the warp simulator's twins take the same path
// when built with the knob).
#ifndef QK_EPILOGUE_EARLY
#define QK_EPILOGUE_EARLY 1
#endif
// QK_EPILOGUE_MID = 1: the decode kernels without the registers to hold their epilogue's parameters across the K
// loop (QServe per group, QQQ per channel, LiquidQuant from 9 tokens) have copy 0 load them as soon as its own K loop
// is done, before the split-K meeting, so that they are in flight while it waits for the block's other copies (and
// the tile's other blocks), not issued after (0, smallm_tune's EPI-AFTER). The phase timeline of the H100
// (bench/results/kernels_h100_timeline.json, M = 1, 4096 x 4096) put 0.9-1.2 us between QQQ's meeting and its stores;
// the H200 run of 35670a6 (kernels_h200_smallm_tune.json, run 9) timed it at 0.88-0.97x for QQQ per channel,
// 0.91-1.00x for QServe per group and LiquidQuant at 16 tokens. QQQ per group takes it only with
// QK_EPILOGUE_MID_QQQ_GROUP = 1 (EPI-MID-QG): 1.00-1.10x on three of the four shapes in that run. The same arithmetic
// in the same order: the same bits.
#ifndef QK_EPILOGUE_MID
#define QK_EPILOGUE_MID 1
#endif
#ifndef QK_EPILOGUE_MID_QQQ_GROUP
#define QK_EPILOGUE_MID_QQQ_GROUP 0
#endif

namespace qk {

// The smaller of two ints, written out: NVRTC's headers need not declare min().
QK_FN int imin(int a, int b) { return a < b ? a : b; }

// A group size and the reciprocal div_group multiplies by, ceil(2^32 / size), computed once where a kernel makes its
// arguments: a division takes some 20 instructions, and a loop that needs it inside a branch (the stage copies'
// group parameters, made by some threads only) would pay them every step. 0 for no groups.
struct GroupSize {
  uint32_t magic;
  QK_FN GroupSize(int d = 0) : magic(d > 0 ? 0xFFFFFFFFu / (uint32_t)d + 1u : 0u) {}
};

// col / d as one multiply-high by ceil(2^32 / d): exact while col * d < 2^32, which quantkit.kernels checks at
// launch (K times the group size).
QK_FN int div_group(int col, GroupSize d) {
#if defined(__CUDA_ARCH__)
  return (int)__umulhi((uint32_t)col, d.magic);
#else
  return (int)(((uint64_t)(uint32_t)col * d.magic) >> 32);
#endif
}

// The bulk kernels' split-K: copy i of a tile's `copies` walks the contiguous K steps [begin, end) of its `steps`.
QK_FN void copy_range(int i, int copies, int steps, int& begin, int& end) {
  begin = i * steps / copies;
  end = (i + 1) * steps / copies;
}

// The m16n8k32 s8 fragment coordinates (PTX ISA, "Matrix Fragments for mma.m16n8k32"): lane = 4 * group + quad.
QK_FN int frag_group(int lane) { return lane >> 2; }
QK_FN int frag_quad(int lane) { return lane & 3; }

// A compile-time width, so that a run-time `bits` picks one instantiation of a template per width.
template <int B>
struct Width {
  static constexpr int value = B;
};

// fn(Width<bits>{}) for bits 1..8 (above 8: 8).
#pragma nv_exec_check_disable
template <class Fn>
QK_FN void with_width(int bits, Fn fn) {
  switch (bits) {
    case 1: fn(Width<1>{}); break;
    case 2: fn(Width<2>{}); break;
    case 3: fn(Width<3>{}); break;
    case 4: fn(Width<4>{}); break;
    case 5: fn(Width<5>{}); break;
    case 6: fn(Width<6>{}); break;
    case 7: fn(Width<7>{}); break;
    default: fn(Width<8>{}); break;
  }
}

// Four of the eight bytes of b:a (a the low four), byte i of the result the one selector nibble i names (its low
// three bits): CUDA __byte_perm without the sign-replicating mode, which no kernel uses.
QK_FN uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, selector);
#else
  const uint64_t both = (uint64_t)b << 32 | a;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) out |= (uint32_t)(both >> (8 * ((selector >> (4 * i)) & 7)) & 0xFF) << (8 * i);
  return out;
#endif
}

// PTX prmt.b32 in its default mode: byte i of the result is byte (nibble i & 7) of b:a, its sign replicated into
// all 8 bits where the nibble's bit 3 is set; only the selector's low 16 bits count. For a selector computed at run
// time, where __byte_perm (byte_perm) first masks it with 0x7777 (one instruction more): the caller keeps bit 3 of
// each nibble clear, and the host twin replicates the sign as the device does, so that the simulator shows a set bit.
QK_FN uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
  return out;
#else
  const uint64_t both = (uint64_t)b << 32 | a;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (selector >> (4 * i)) & 0xF;
    uint32_t byte = (uint32_t)(both >> (8 * (nibble & 7))) & 0xFF;
    if (nibble & 8) byte = byte & 0x80 ? 0xFF : 0x00;
    out |= byte << (8 * i);
  }
  return out;
#endif
}

// 2^i, which the GPU reads from the constant bank, so that the compiler cannot turn a multiply-add by it back into
// a shift (the warp simulator reads the same table).
#if defined(__CUDA_ARCH__)
__constant__
#else
static const
#endif
uint32_t qk_pow2[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,  1u << 8,  1u << 9,  1u << 10,
    1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15, 1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21,
    1u << 22, 1u << 23, 1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

// acc | part shifted right by `shift` (left where it is negative), part's bits disjoint from acc's. With FMA, one
// multiply-add by a power of two from qk_pow2, the add being the OR: IMAD, or IMAD.HI for a right shift, which
// issue on the FMA pipe, where a shift and an OR (or a LEA, which the compiler makes of a multiply-add by a
// constant it can see) take the half-rate integer ALU. It costs registers for the factors (and the IMAD.HI's
// addend pairs), so a kernel takes it where its registers allow: QServe's high nibbles (high_nibbles), and
// Any-Precision's bit transpose up to 3 bits behind QK_AP_FMA_SHIFTS (anyprec_gemm_tc8_3_fast's main loop 430
// integer-ALU instructions of 682, against 478 of 656 with shifts, but 3-6% slower on an H100, so off; at 4, 6 and
// 7 bits its tensor-core kernels spill with it).
template <bool FMA>
QK_FN uint32_t shift_or(uint32_t part, int shift, uint32_t acc) {
  if (!FMA || shift == 0) return acc | (shift < 0 ? part << -shift : part >> shift);
  if (shift < 0) return part * qk_pow2[-shift] + acc;
#if defined(__CUDA_ARCH__)
  return __umulhi(part, qk_pow2[32 - shift]) + acc;
#else
  return (uint32_t)((uint64_t)part * qk_pow2[32 - shift] >> 32) + acc;
#endif
}

// Per-byte add modulo 256 of two words of four bytes, no carries between bytes (CUDA __vadd4).
QK_FN uint32_t vadd4(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vadd4(a, b);
#else
  uint32_t low7 = (a & 0x7F7F7F7Fu) + (b & 0x7F7F7F7Fu);
  return low7 ^ ((a ^ b) & 0x80808080u);
#endif
}

// (a & mask) | bits as one LOP3, mask and bits constants: a SASS LOP3 takes one immediate, and left to itself the
// compiler gives the AND and the OR an instruction each; from PTX's lop3 it keeps `bits` in a register made once.
QK_FN uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
#if defined(__CUDA_ARCH__)
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(a), "r"(mask), "r"(bits));
  return out;
#else
  return (a & mask) | bits;
#endif
}

QK_FN uint32_t lo_nibbles(uint32_t v) { return v & 0x0F0F0F0Fu; }
QK_FN uint32_t hi_nibbles(uint32_t v) { return (v >> 4) & 0x0F0F0F0Fu; }

// Hopper (and later) has no INT4 tensor cores: mma.sync .s4 runs there at a fraction of the INT8 rate (Atom's
// kernels measured 5-8x slower than the W4A8 ones on an H200). There an INT4 m16n8k64 MMA is done as two INT8
// m16n8k32 MMAs on the codes as bytes of 16 times their value (int4_as_bytes): each product is 256 times the INT4
// one, so the int32 sums are 2^QK_INT4_SHIFT times the exact INT4 sums, which the kernels shift back (exactly: the
// sums are multiples of 256) once a group, where its products are complete. A group's sums stay within 2^21 (128
// products of at most 64, times 256). The warp simulator takes this path too, so the tests check it against the
// emulation.
#if defined(QK_HOST) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
#define QK_INT4_AS_INT8 1
#define QK_INT4_SHIFT 8
#else
#define QK_INT4_AS_INT8 0
#define QK_INT4_SHIFT 0
#endif

// The even (nibbles 0, 2, 4, 6) or odd (1, 3, 5, 7) two's-complement INT4 codes of w as four INT8 bytes of 16 times
// their value: the nibble moved to a byte's top half (the odd ones are there already), whose low half is zero. One
// or two instructions a word, where sign-extending the codes took four (the tiled kernel's main loop 1009 -> 786).
QK_FN uint32_t int4_as_bytes(uint32_t w, bool odd) { return (odd ? w : w << 4) & 0xF0F0F0F0u; }

// The exact INT4 sum from the int32 sum of INT4 MMAs (mma_int4) on the INT8 path.
QK_FN int32_t int4_sum(int32_t c) { return c >> QK_INT4_SHIFT; }

// Half h (k 32 h .. 32 h + 31) of an INT4 m16n8k64 MMA's fragments as an INT8 m16n8k32 MMA's. INT4 A register r
// holds k 8 q .. 8 q + 7 (+ 32 for r >= 2) of row g (+ 8 for r odd), B register r k 8 q .. (+ 32 r) of column g;
// INT8 A registers 0, 1 fill k slots 4 q .. 4 q + 3 of rows g, g + 8 and 2, 3 slots 16 + 4 q .., B registers 0, 1
// the same slots. The even codes go to the first slots and the odd ones to the second, in A and B alike, so each
// slot pairs the same k of both operands and the two halves together cover the 64 k once.
QK_FN void int4_half_as_int8(const uint32_t a[4], const uint32_t b[2], int h, uint32_t a8[4], uint32_t b8[2]) {
  a8[0] = int4_as_bytes(a[2 * h], false);
  a8[1] = int4_as_bytes(a[2 * h + 1], false);
  a8[2] = int4_as_bytes(a[2 * h], true);
  a8[3] = int4_as_bytes(a[2 * h + 1], true);
  b8[0] = int4_as_bytes(b[h], false);
  b8[1] = int4_as_bytes(b[h], true);
}

// Float32 operations the compiler must not contract into FMAs: the epilogue order is part of the contract.
QK_FN float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;
  return r;
#endif
}
QK_FN float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  volatile float r = a + b;
  return r;
#endif
}
QK_FN float fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  volatile float r = a - b;
  return r;
#endif
}

// fp16 bits -> float (exact) and float -> fp16 bits, round to nearest even (__float2half_rn).
QK_FN float half_to_float(qk_half h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400u));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

QK_FN qk_half float_to_half(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return (qk_half)(sign | 0x7E00u);  // NaN
  if (ax >= 0x477FF000u) return (qk_half)(sign | 0x7C00u);  // rounds to inf
  if (ax < 0x38800000u) {  // subnormal half (or zero): round |f| * 2^24 to an integer, ties to even
    float scaled = std::fabs(f) * 16777216.0f;  // exact: a power-of-two scaling of a small float
    float r = std::nearbyint(scaled);
    return (qk_half)(sign | (uint32_t)r);
  }
  uint32_t mant = ax + 0xC8000000u;  // rebias exponent from 127 to 15 (-112 << 23)
  uint32_t rounded = mant + 0x0FFFu + ((mant >> 13) & 1u);  // round to nearest even at bit 13
  return (qk_half)(sign | (rounded >> 13));
#endif
}

// The W4A8 epilogue: fp16((float(acc) * s_w) * s_x), and minus szero * t_x for QServe per channel.
QK_FN qk_half epilogue(int32_t acc, float s_w, float s_x) { return float_to_half(fmul(fmul((float)acc, s_w), s_x)); }
QK_FN qk_half epilogue_zero(int32_t acc, float s_w, float s_x, float szero, float t_x) {
  return float_to_half(fsub(fmul(fmul((float)acc, s_w), s_x), fmul(szero, t_x)));
}

// One 128-bit store of four little-endian 32-bit words (p 16-byte aligned).
QK_FN void store_u128(void* p, const uint32_t w[4]) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
#else
  std::memcpy(p, w, 16);
#endif
}

// One 128-bit load (a single LDG.128 on the GPU) of four little-endian 32-bit words.
QK_FN void load_u128(const void* p, uint32_t w[4]) {
#if defined(__CUDA_ARCH__)
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
#else
  std::memcpy(w, p, 16);
#endif
}

// Loads of a float and of 2 bytes (p aligned to their size).
QK_FN float load_f32(const void* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const float*>(p);
#else
  float v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}
QK_FN qk_half load_u16(const void* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const qk_half*>(p);
#else
  qk_half v;
  std::memcpy(&v, p, 2);
  return v;
#endif
}

// Stores of 4 and 2 bytes (p aligned to their size).
QK_FN void store_u32(void* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint32_t*>(p) = v;
#else
  std::memcpy(p, &v, 4);
#endif
}
QK_FN void store_u16(void* p, qk_half v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<qk_half*>(p) = v;
#else
  std::memcpy(p, &v, 2);
#endif
}

// One 32-bit load of four bytes (p 4-byte aligned), the first byte in the low bits.
QK_FN uint32_t load_u32(const void* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}

// A lane's activation rows in the small-M kernels (act_row: one; ActRows: tokens g and g + 8 of a 16-token tile,
// from `row0`), as pointers to its column `col` of each, made once before the K loop; tokens past M are clamped to
// the last. An MMA's row of D depends on its own row of A alone, and the stores skip rows past M, so a clamped row
// costs only its loads (the same addresses as a real row's: one transaction) and saves each load a test, a zero
// and the address arithmetic that the kernels otherwise redid per load (a 64-bit multiply and add from the kernel
// parameters).
QK_FN const uint8_t* act_row(const void* x, int m, int k, int row, int col) {
  return static_cast<const uint8_t*>(x) + (size_t)imin(row, m - 1) * k + col;
}
struct ActRows {
  const uint8_t* p[2];
  QK_FN ActRows(const void* x, int m, int k, int row0, int col) {
    for (int h = 0; h < 2; ++h) p[h] = act_row(x, m, k, row0 + 8 * h, col);
  }
  // The 4 bytes at `offset` of row h (g, g + 8).
  QK_FN uint32_t at(int h, int offset) const { return load_u32(p[h] + offset); }
};
// Those of a lane's m16 A fragment (QServe's and QQQ's small-M kernels): tokens 16 mt + g and + 8 of x [M, K]
// (Args' x, m, k), at its column 4q.
template <class Args>
QK_FN ActRows act_rows(const Args& a, int mt, int lane) {
  return ActRows(a.x, a.m, a.k, 16 * mt + frag_group(lane), 4 * frag_quad(lane));
}

// Split-K across the warps of a block. The block holds `splits` copies of the T threads that compute one output
// tile; copy s takes K steps s, s + splits, s + 2 splits, ..., so that the copies read neighbouring weight tiles at
// the same time. Their int32 accumulators meet in shared memory: copy s > 0 stores its `count` accumulators at
// splitk_slot(s, j, t) (consecutive threads in consecutive banks) and copy 0 adds them in the order of s, wrapping
// as the MMA does, then alone runs the epilogue. Integer sums: the split changes no bit of the output.
QK_FN int splitk_slot(int s, int j, int t, int count, int threads) { return ((s - 1) * count + j) * threads + t; }

// acc[j] += the accumulator j of thread t in copies 1 .. splits - 1, in order (wrapping int32 adds).
QK_FN void splitk_add(int32_t* acc, const int32_t* partials, int t, int count, int threads, int splits) {
  for (int s = 1; s < splits; ++s)
    for (int j = 0; j < count; ++j)
      acc[j] = (int32_t)((uint32_t)acc[j] + (uint32_t)partials[splitk_slot(s, j, t, count, threads)]);
}

// The large-M path (the *_tiled kernels) stages each K step's operand tiles in shared memory, STAGES steps deep.
// Activations [rows, BK] int8 sit row-major with their 16-byte chunks XOR-swizzled, so that the eight row reads of
// one ldmatrix (and the 16-byte copies of a warp) fall in eight different bank groups; BK is 64 or 128 bytes.
template <int BK>
QK_FN int swizzled(int row, int chunk) {
  constexpr int chunks = BK / 16;  // 4 or 8 per row
  return row * BK + 16 * (chunk ^ ((row / (8 / chunks)) % chunks));
}

// The byte offset, in a swizzled [rows, BK] tile, of the row that lane gives to an ldmatrix.x4 of 16 rows x 32
// bytes at (row0, 16-byte chunk chunk0): lanes 8j .. 8j + 7 address matrix j. As an MMA's A operand (row-major
// 16 x 32), matrix j is rows 8 (j & 1) .., chunk j >> 1: registers {a0, a1, a2, a3}. As B operands (two n8 blocks,
// each 8 rows of 32 k), matrix j is rows 8 (j >> 1) .., chunk j & 1: {b0, b1} of block 0, then of block 1.
template <int BK>
QK_FN int ldsm_a_row(int row0, int chunk0, int lane) {
  const int j = lane >> 3;
  return swizzled<BK>(row0 + 8 * (j & 1) + (lane & 7), chunk0 + (j >> 1));
}
template <int BK>
QK_FN int ldsm_b_row(int row0, int chunk0, int lane) {
  const int j = lane >> 3;
  return swizzled<BK>(row0 + 8 * (j >> 1) + (lane & 7), chunk0 + (j & 1));
}

// One asynchronous copy of BYTES (4, 8 or 16) global -> shared, or BYTES zero bytes when !valid (a row past M:
// the source is then not read). 16-byte copies go through L2 only (cp.async.cg), smaller ones through L1 too.
template <int BYTES>
QK_FN void copy_async(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__)
  const unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
  if (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(valid ? 16 : 0));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(addr), "l"(src), "n"(BYTES),
                 "r"(valid ? BYTES : 0));
#else
  if (valid) std::memcpy(dst, src, BYTES); else std::memset(dst, 0, BYTES);
#endif
}

// 16- and 8-byte loads (load_u128's, load_u64's) where the source puts them: volatile asm, which the compiler keeps
// in order with the other volatile asm (the MMAs), so that a load meant to be in flight during one stretch of MMAs
// is not hoisted above the stretch before, holding its registers that much longer (the Any-Precision kernels'
// unchecked loads, hoisted, made them spill).
QK_FN void load_u128_here(const void* p, uint32_t w[4]) {
#if defined(__CUDA_ARCH__)
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
#else
  std::memcpy(w, p, 16);
#endif
}
QK_FN void load_u64_here(const void* p, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__)
  asm volatile("ld.global.v2.u32 {%0, %1}, [%2];\n" : "=r"(lo), "=r"(hi) : "l"(p));
#else
  std::memcpy(&lo, p, 4);
  std::memcpy(&hi, static_cast<const uint8_t*>(p) + 4, 4);
#endif
}

// Two 32-bit words from one 8-byte load (p 8-byte aligned), the first from the lower address.
QK_FN void load_u64(const void* p, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__)
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  lo = v.x;
  hi = v.y;
#else
  std::memcpy(&lo, p, 4);
  std::memcpy(&hi, static_cast<const uint8_t*>(p) + 4, 4);
#endif
}

// A swizzled [ROWS, BK] byte tile from rows r0 .. r0 + ROWS - 1 of a row-major matrix (`stride` bytes a row, zero
// past row `rows`), bytes `col` .. col + BK - 1 of each. Threads tid, tid + THREADS, ... each copy 16 bytes (tid <
// THREADS, the block). THREADS is a compile-time constant, so that a thread's copies are a fixed unrolled list whose
// rows, chunks and source offsets do not depend on the K step: the kernels compute them once, not per copy and step
// (with a run-time count, each copy of each step redid a division, a swizzle and a 64-bit multiply-add).
template <int ROWS, int BK, int THREADS>
QK_FN void copy_rows(uint8_t* tile, const void* base, size_t stride, int rows, int r0, size_t col, int tid) {
  constexpr int ROW_CHUNKS = BK / 16, CHUNKS = ROWS * ROW_CHUNKS;
  static_assert(THREADS % ROW_CHUNKS == 0, "a thread's chunks sit at one column of the tile");
  const int chunk = tid % ROW_CHUNKS;
#pragma unroll
  for (int j = 0; j < (CHUNKS + THREADS - 1) / THREADS; ++j) {
    const int row = tid / ROW_CHUNKS + j * (THREADS / ROW_CHUNKS);  // chunk tid + j THREADS of the tile
    if (CHUNKS % THREADS != 0 && row >= ROWS) break;
    const bool valid = r0 + row < rows;
    const uint8_t* src = static_cast<const uint8_t*>(base) + (size_t)(valid ? r0 + row : 0) * stride + col + 16 * chunk;
    copy_async<16>(tile + swizzled<BK>(row, chunk), src, valid);
  }
}

// The activation tile of K step kt: rows m0 .. m0 + ROWS - 1 of x [M, K] int8 (zero past M), BK bytes each.
template <int ROWS, int BK, int THREADS>
QK_FN void copy_activations(uint8_t* tile, const int8_t* x, int m, int k, int m0, int kt, int tid) {
  copy_rows<ROWS, BK, THREADS>(tile, x, (size_t)k, m, m0, (size_t)kt * BK, tid);
}

// RUNS runs of RUN_BYTES bytes each, run r from src + r * stride, to consecutive shared memory; THREADS threads
// copying 16 bytes each (a compile-time count, as copy_rows').
template <int RUNS, int RUN_BYTES, int THREADS>
QK_FN void copy_runs(uint8_t* dst, const uint8_t* src, size_t stride, int tid) {
  constexpr int RUN_CHUNKS = RUN_BYTES / 16, CHUNKS = RUNS * RUN_CHUNKS;
#pragma unroll
  for (int j = 0; j < (CHUNKS + THREADS - 1) / THREADS; ++j) {
    const int c = tid + j * THREADS;
    if (CHUNKS % THREADS != 0 && c >= CHUNKS) break;
    const int r = c / RUN_CHUNKS, off = 16 * (c % RUN_CHUNKS);
    copy_async<16>(dst + (size_t)r * RUN_BYTES + off, src + r * stride + off, true);
  }
}

// The Hopper path (the *_wgmma kernels, sm_90a): wgmma.mma_async with the weights as its M operand, from
// registers, and the activations as its N operand, read by the tensor cores from shared memory. A block of 2 W
// warpgroups computes BN = 128 W channels (warp w: channels 16 w .. 16 w + 15) x BM = 128 tokens with one
// m64n128k32 per warpgroup and k32, on the *Tiled policy's stages: the activation tile at offset 0 of a stage is
// already the canonical K-major layout with the 64-byte swizzle (swizzled<64>: 16-byte chunk c of row r at
// 64 r + 16 (c ^ (r / 2 % 4)), 8-row groups 512 bytes apart), so a descriptor names it; the stages are rounded up
// to 1 KiB so that every tile starts where the swizzle pattern does. With W = 2 (the *_wgmma2 kernels) the four
// warpgroups share each activation tile, which the block then reads from L2 once per 256 channels, not 128: a
// stage holds the tile, then the Tiled policy's weight region (its bytes from W_OFF on) once per 128 channels.
// Layout F supplies the Tiled policy (stages, copy_weights), load_a (a warp's A fragments of the stage's two k32
// steps, each {row g k 4q.., row g + 8 k 4q.., row g k 16 + 4q.., row g + 8 k 16 + 4q..} as for mma.m16n8k32, for
// warps 0-7 of one 128-channel region) and out_value (the epilogue of one int32 sum).
//
// The descriptor of a K-major operand with the 64-byte swizzle at shared address addr (PTX ISA, "Matrix
// Descriptor Format"): start address >> 4 in bits 0-13, leading byte offset 16 (unused by swizzled K-major
// layouts) >> 4 in bits 16-29, stride byte offset 512 (between 8-row groups) >> 4 in bits 32-45, base offset 0,
// swizzle mode 2 (64 bytes) in bits 62-63.
QK_FN uint64_t wgmma_desc_sw64(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)(16 >> 4) << 16) | ((uint64_t)(512 >> 4) << 32) |
         ((uint64_t)2 << 62);
}

// QK_WGMMA_TMA = 1, the default: each stage's activation tile arrives by one tensor copy (cp.async.bulk.tensor.2d,
// issued by thread 0 from `x_map`, the tensor map of x [M, K] that quantkit.kernels encodes: a box of 64 bytes x 128
// rows, 64-byte swizzle, zeros past M), which writes through the async proxy and completes on the stage's mbarrier
// (after the ring in shared memory); the weights still come by cp.async. The wgmmas read only the activation tile from
// shared memory, so the loop needs no proxy fence (NOFENCE, the old loop without it, took 0.80-0.99x its time on an
// H100). The TMA's 64-byte swizzle is the layout copy_rows writes (16-byte chunk c of row r at chunk c ^ (r / 2) % 4,
// in stages aligned to 1024 bytes), which the B descriptors read (wgmma_desc_sw64). The kernels take x_map as their
// last argument only when built with the knob. With 0 (smallm_tune --large's W5L3) the activation tiles come by
// cp.async too, and a proxy fence before each step's barrier makes them visible to the wgmmas. The H200 run of 35670a6
// (kernels_h200_smallm_tune.json, run 10) timed TMA-W8L6 (this, eight stages) at 0.72-0.91x W5L3's time per channel and
// for LiquidQuant, 0.96-1.01x per group.
#ifndef QK_WGMMA_TMA
#define QK_WGMMA_TMA 1
#endif
// The ring's depth (QK_WGMMA_STAGES) and how many steps ahead its copies go (QK_WGMMA_LEAD) are compile-time knobs
// for tuning on a GPU (QUANTKIT_NVRTC_DEFINES, bench/smallm_tune.py --large); they change no bit of any output.
// Each step's wgmmas retire before the barrier of the next, so a copy may go into the slot of the step before this
// one: LEAD <= STAGES - 1. Two blocks of five 13 KiB stages fit an SM (W = 1), so would two of eight; W = 2 takes
// 17 KiB a stage, one block an SM (its 512 threads hold all the registers).
#ifndef QK_WGMMA_STAGES
#define QK_WGMMA_STAGES (QK_WGMMA_TMA ? 8 : 5)
#endif
#ifndef QK_WGMMA_LEAD
#define QK_WGMMA_LEAD (QK_WGMMA_STAGES - 2)
#endif
// The per-group variants of the 256-token kernels (QServe's progressive groups, QQQ per group; wgmma_tall_gemm) keep
// a ring of their own: 10 stages of 21 KiB (211 KiB with the alignment slack and mbarriers, one block an SM), copies 8
// steps ahead. On the H200 (kernels_h200_smallm_tune.json runs 11 and 12, TALL-W10L8 against TALL at M = 1024) such a
// ring took 0.96-0.98x the 8-stage one's time for QQQ per group and 0.98-0.99x for QServe g128 on all four shapes,
// 0.96-1.03x per channel and 1.05-1.15x for LiquidQuant, whose kernels keep QK_WGMMA_STAGES.
#ifndef QK_WGMMA_TALL_GROUP_STAGES
#define QK_WGMMA_TALL_GROUP_STAGES 10
#endif
#ifndef QK_WGMMA_TALL_GROUP_LEAD
#define QK_WGMMA_TALL_GROUP_LEAD (QK_WGMMA_TALL_GROUP_STAGES - 2)
#endif
// H = 2 (the *_wgmma_tall kernels): 256 tokens a block, each warpgroup's A fragments (its dequantized weights) fed
// to two m64n128 wgmmas, one a 128-token half of the activation tile, so that each weight is unpacked once per 256
// tokens, not 128: the per-group loops issue about as many instructions a step as the tensor cores take cycles for
// one m64n128 (bench/sass_loops.py: issue-bound), and this halves their issue a multiply-add. One block an SM (128
// accumulators a thread), where the 128-token kernel fits two. S and L: the ring's depth and lead.
template <class F, int W = 1, int H = 1, int S = QK_WGMMA_STAGES, int L = QK_WGMMA_LEAD>
struct WgmmaTiles {
  using Tiled = typename F::Tiled;
  using Args = typename F::Args;
  static constexpr int BM = H * Tiled::BM, BN = W * Tiled::BN, BK = Tiled::BK, THREADS = 256 * W, ALIGN = 1024;
  static constexpr int STAGES = S, LEAD = L;
  // A stage: the activation tile (A_BYTES), then W regions of REGION bytes, each the weights (and group parameters)
  // of 128 channels at the offsets the Tiled policy gives them, from region_at(r) on (the Tiled policy's stage moved
  // by the activation rows it does not hold); W = H = 1 is the Tiled policy's stage.
  static constexpr int A_BYTES = BM * BK, REGION = Tiled::STAGE_BYTES - Tiled::W_OFF;
  static constexpr int STAGE_BYTES = (A_BYTES + W * REGION + ALIGN - 1) / ALIGN * ALIGN;
  static_assert(Tiled::BM == 128 && Tiled::BN == 128 && BK == 64 && Tiled::THREADS == 256, "one m64n128 a warpgroup");
  static_assert(Tiled::W_OFF == Tiled::BM * BK && (W == 1 || W == 2) && (H == 1 || H == 2) && (W == 1 || H == 1),
                "the activation tile first, then the weights; 256 channels or 256 tokens a block, not both");
  static_assert(LEAD >= 1 && LEAD <= STAGES - 1, "a copy goes into a slot no warpgroup still reads");
  // d[64 t + 4 j + 2 h + e]: channel 16 warp + g + 8 h, token 128 t + 8 j + 2 q + e
  struct Acc { int32_t d[64 * H]; };
  QK_FN static constexpr int region_at(int r) { return A_BYTES - Tiled::W_OFF + r * REGION; }

  QK_FN static int steps(const Args& a) { return Tiled::steps(a); }
  QK_FN static void copy_stage(const Args& a, uint8_t* stage, int m0, int n0, int kt, int tid) {
    copy_activations<BM, BK, THREADS>(stage, a.x, a.m, a.k, m0, kt, tid);
    copy_weights(a, stage, n0, kt, tid);
  }
  // The stage's weight regions alone (the activation tile comes by a tensor copy: QK_WGMMA_TMA).
  QK_FN static void copy_weights(const Args& a, uint8_t* stage, int n0, int kt, int tid) {
    for (int r = 0; r < W; ++r)
      Tiled::template copy_weights<THREADS>(a, stage + region_at(r), n0 + r * Tiled::BN, kt, tid);
  }
  // Warp w's A fragments: warp w % 8 of the 128 channels of region w / 8.
  QK_FN static void load_a(const Args& a, const uint8_t* stage, int warp, int lane, uint32_t fa[BK / 32][4]) {
    if (W == 1) F::load_a(a, stage + region_at(0), warp, lane, fa);
    else F::load_a(a, stage + region_at(warp / 8), warp % 8, lane, fa);
  }
  // The B descriptor of k32 step kk of the stage at shared address `stage`, tokens 128 t on: 32 kk bytes into each
  // row of the t-th 128-row half of the activation tile.
  QK_FN static uint64_t b_desc(uint32_t stage, int kk, int t = 0) {
    return wgmma_desc_sw64(stage + t * Tiled::W_OFF + 32 * kk);
  }

  // The epilogue goes through shared memory (the ring's, free once every wgmma is done), so that the outputs leave
  // as whole 16-byte stores along each token's row rather than 2-byte stores scattered over four rows a warp.
  // Staged row stride: 2 BN bytes plus 16, so that the four tokens of a warp's 2-byte writes fall in distinct banks.
  static constexpr int OUT_STRIDE = 2 * BN + 16;
  static_assert(BM * OUT_STRIDE <= STAGES * STAGE_BYTES, "the staged outputs fit in the ring");

  // Phase 1: the thread's 64 H outputs into the staged tile [BM tokens][BN channels], in chunks of 16 (8 tokens x 2
  // channels) so that each scale is loaded once a chunk and the chunk's values cost few registers.
  QK_FN static void stage_out(const Args& a, uint8_t* smem, int m0, int n0, int warp, int lane, const Acc& acc) {
    const int g = frag_group(lane), q = frag_quad(lane);
#pragma unroll
    for (int c = 0; c < 64 * H; c += 16) {
      qk_half y[16];
#pragma unroll
      for (int i = c; i < c + 16; ++i) {
        const int token = m0 + 8 * (i / 4) + 2 * q + i % 2, channel = n0 + 16 * warp + g + 8 * (i / 2 % 2);
        y[i - c] = F::out_value(a, acc.d[i], token < a.m ? token : m0, channel);  // past M: staged, not written
      }
#pragma unroll
      for (int i = c; i < c + 16; ++i) {
        const int row = 8 * (i / 4) + 2 * q + i % 2, col = 16 * warp + g + 8 * (i / 2 % 2);
        store_u16(smem + row * OUT_STRIDE + 2 * col, y[i - c]);
      }
    }
  }

  // Phase 2 (after a barrier): the staged rows below M to `out`, 16 bytes a thread, a row's 2 BN bytes contiguous.
  // A thread keeps its 16-byte column of the tile and takes every PASS_ROWS-th row from its first: one pointer of
  // each side, advanced by a constant stride, where a loop over chunk indices made each pass's row and 64-bit
  // address anew (about 100 instructions a pass, 8 passes: as many as 4 K steps of the per-channel main loop).
  static constexpr int CHUNKS = BN / 8, PASS_ROWS = THREADS / CHUNKS;
  static_assert(THREADS % CHUNKS == 0 && BM % PASS_ROWS == 0, "whole rows a pass, whole passes a tile");
  QK_FN static void write_out(const Args& a, const uint8_t* smem, int m0, int n0, int tid) {
    const int row = tid / CHUNKS, rows = a.m - m0;  // rows of the tile below M: at least 1
    const uint8_t* src = smem + row * OUT_STRIDE + 16 * (tid % CHUNKS);
    qk_half* dst = a.out + (size_t)(m0 + row) * a.n + n0 + 8 * (tid % CHUNKS);
    const size_t stride = (size_t)PASS_ROWS * a.n;
#pragma unroll
    for (int p = 0; p < BM / PASS_ROWS; ++p) {
      if (row + p * PASS_ROWS >= rows) break;  // the rows only grow
      uint32_t w[4];
      load_u128(src + p * PASS_ROWS * OUT_STRIDE, w);
      store_u128(dst, w);
      dst += stride;
    }
  }
};

// The stream-K tail of the 256-token kernels (quantkit.kernels.WGMMA_STREAMK): a one-dimensional grid whose blocks
// before `from` take tile b whole (tile t: channels 128 (t % N tiles), tokens 256 (t / N tiles)), and whose blocks
// from `from` on take half a tile's K steps each, two a tile: tile from + (b - from) / 2, its first steps / 2 steps
// or the rest. Where the whole tiles fill all but a part of the last wave, its tiles so take half the time.
// `split`: the tile's index in the tail (its slot of partial sums and its flags), -1 for a whole tile.
// Built only with QK_WGMMA_STREAMK = 1 (smallm_tune --large's TALL-SK; not yet timed on a GPU): the 256-token kernels
// then take the tail's three arguments (before x's tensor map) and a one-dimensional grid. Without it their code is
// the two-dimensional grid's, unchanged.
#ifndef QK_WGMMA_STREAMK
#define QK_WGMMA_STREAMK 0
#endif
#if QK_WGMMA_STREAMK
#define QK_STREAMK_PARAMS , int streamk_from, int32_t *streamk_partials, int32_t *streamk_flags
#define QK_STREAMK qk::StreamK{streamk_from, streamk_partials, streamk_flags}
#else
#define QK_STREAMK_PARAMS
#define QK_STREAMK qk::StreamK{0, nullptr, nullptr}
#endif
struct BlockWork {
  int tile, k_begin, k_end, split;
};
// The tail's first block and its workspace: slot s of `partials` holds a split tile's sums (THREADS x 64 H int32),
// flags[2 s] counts its blocks arrived and flags[2 s + 1] says the first one's sums are there; zeros between launches.
struct StreamK {
  int from;
  int32_t* partials;
  int32_t* flags;
};
QK_FN BlockWork streamk_work(int b, int from, int steps) {
  if (b < from) return {b, 0, steps, -1};
  const int split = (b - from) / 2, second = (b - from) % 2, mid = steps / 2;
  return {from + split, second ? mid : 0, second ? steps : mid, split};
}

// How the copies of a block meet (the register kernels; the bulk ones always store): QK_SPLITK_RED = 1 has each copy
// s > 0 add its sums into copy 0's slot (COUNT * threads int32, zeroed before the K loop: splitk_begin) by
// shared-memory atomics as soon as it is done, so that after the block's barrier copy 0 reads COUNT words, where
// with 0 the copies store theirs and copy 0 alone then adds (splits - 1) * COUNT of them one after another (240
// shared loads a lane for QServe's 16 copies, 224 for QQQ's 8) while the rest of the block waits. Integer sums, in
// any order: the same bits. The default since H100 tuning run 6 (0.91-1.03x the time of 0, faster on 31 of 40
// rows; QServe's and QQQ's totals 0.98x); 0 is bench/smallm_tune.py's NO-RED.
#ifndef QK_SPLITK_RED
#define QK_SPLITK_RED 1
#endif

// The slots of COUNT * threads int32 a block's split-K meeting takes at the start of its dynamic shared memory
// (quantkit.kernels splitk_shared mirrors it): under RED the one slot every copy adds into, else one a copy but the
// first (the bulk kernels' copies always store).
QK_FN int splitk_slots(int splits, bool red = QK_SPLITK_RED) { return red ? (splits > 1 ? 1 : 0) : splits - 1; }

// The three phases of the meeting, between the block's barriers (splitk_begin, splitk_reduce; the warp simulator's
// twins run them copy by copy, on the same slots): copy 0 clears the one slot RED adds into; each copy s > 0 posts
// its sums, added into that slot (shared-memory atomics on the device, plain adds in the simulator: integer sums in
// any order) or stored in its own slot s; then copy 0 collects them into its own.
template <int COUNT>
QK_FN void splitk_clear(int32_t* partials, int t, int threads) {
#pragma unroll
  for (int j = 0; j < COUNT; ++j) partials[splitk_slot(1, j, t, COUNT, threads)] = 0;
}
template <int COUNT, bool RED>
QK_FN void splitk_post(int32_t* partials, const int32_t* acc, int t, int copy, int threads) {
#pragma unroll
  for (int j = 0; j < COUNT; ++j) {
    if constexpr (RED) {
#if defined(__CUDA_ARCH__)
      atomicAdd(&partials[splitk_slot(1, j, t, COUNT, threads)], acc[j]);
#else
      int32_t& slot = partials[splitk_slot(1, j, t, COUNT, threads)];
      slot = (int32_t)((uint32_t)slot + (uint32_t)acc[j]);
#endif
    } else {
      partials[splitk_slot(copy, j, t, COUNT, threads)] = acc[j];
    }
  }
}
template <int COUNT, bool RED>
QK_FN void splitk_collect(int32_t* acc, const int32_t* partials, int t, int threads, int splits) {
  if constexpr (RED) {
#pragma unroll
    for (int j = 0; j < COUNT; ++j)
      acc[j] = (int32_t)((uint32_t)acc[j] + (uint32_t)partials[splitk_slot(1, j, t, COUNT, threads)]);
  } else {
    splitk_add(acc, partials, t, COUNT, threads, splits);
  }
}

// The meeting of a tile's zsplit blocks in device memory (splitk_blocks), in phases the warp simulator's twins run
// block by block on the launch's own workspace: tile (bx, by) of a grid gx tiles wide owns COUNT x 32 int32 of `sums`
// (splitk_tile_sums) and one count of `arrived`; each block's copy 0 adds its lanes' sums into the tile's
// (splitk_blocks_post: atomics on the device, plain wrapping adds on the host), counts itself in (splitk_blocks_arrive,
// lane 0: true in the last of the zsplit), and the last takes the totals, leaving slots and count zero for the next
// launch (splitk_blocks_take).
QK_FN int splitk_tile(unsigned bx, unsigned by, unsigned gx) { return by * gx + bx; }
template <int COUNT>
QK_FN int32_t* splitk_tile_sums(int32_t* sums, int tile) { return sums + (size_t)tile * COUNT * 32; }
template <int COUNT>
QK_FN void splitk_blocks_post(int32_t* mine, const int32_t* acc, int lane) {
#pragma unroll
  for (int j = 0; j < COUNT; ++j) {
#if defined(__CUDA_ARCH__)
    atomicAdd(&mine[j * 32 + lane], acc[j]);
#else
    mine[j * 32 + lane] = (int32_t)((uint32_t)mine[j * 32 + lane] + (uint32_t)acc[j]);
#endif
  }
}
QK_FN bool splitk_blocks_arrive(int32_t* arrived, int tile, int zsplit) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(&arrived[tile], 1) == zsplit - 1;
#else
  return arrived[tile]++ == zsplit - 1;
#endif
}
template <int COUNT>
QK_FN void splitk_blocks_take(int32_t* acc, int32_t* mine, int32_t* arrived, int tile, int lane) {
#pragma unroll
  for (int j = 0; j < COUNT; ++j) {
#if defined(__CUDA_ARCH__)
    acc[j] = atomicExch(&mine[j * 32 + lane], 0);
#else
    acc[j] = mine[j * 32 + lane];
    mine[j * 32 + lane] = 0;
#endif
  }
  if (lane == 0) arrived[tile] = 0;
}

}  // namespace qk

// The small-M kernels' look-ahead: U K steps' loads per round (QK_SMALLM_AHEAD). A compile-time knob for tuning on
// a GPU (QUANTKIT_NVRTC_DEFINES, bench/smallm_tune.py); it changes no bit of any output. On an H200, 8 a round was
// the fastest of what was tried (README, "CUDA kernels"): 4 and 6 a round, the next round's loads issued before
// this round's MMAs (two register sets), cp.async into per-thread shared-memory slots (4 or 6 steps ahead), the
// activations loaded at their step's MMAs rather than with the weights (8, 12 or 16 steps a round), and a warp's
// steps in rounds of equal size (28 in 4 of 7, not 8, 8, 8 and 4: 12% slower in total).
#ifndef QK_SMALLM_AHEAD
#define QK_SMALLM_AHEAD 8
#endif

// Steps first, first + stride, ... < steps, computed in that order, their loads issued in rounds of U: a round's U
// loads go out before the first of its computations (the loads per thread in flight that a memory-bound small M
// needs), the last round's too when fewer than U steps are left. The warp simulator's twins walk their copies' steps
// through it as well (host_sim.cpp walk_steps).
#pragma nv_exec_check_disable
template <int U, typename Stage, typename Load, typename Compute>
QK_FN void pipelined_steps(int first, int stride, int steps, Load load, Compute compute) {
  QK_STAMP(QK_T_START);
  int step = first;
  for (; step + (U - 1) * stride < steps; step += U * stride) {
    Stage stage[U];
#pragma unroll
    for (int u = 0; u < U; ++u) load(step + u * stride, stage[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      compute(step + u * stride, stage[u]);
      if (u == 0 && step == first) QK_STAMP(QK_T_FIRST);
    }
  }
  if (step < steps) {  // the rest, fewer than U steps, still all in flight together
    Stage stage[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (step + u * stride < steps) load(step + u * stride, stage[u]);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (step + u * stride < steps) {
        compute(step + u * stride, stage[u]);
        if (u == 0 && step == first) QK_STAMP(QK_T_FIRST);
      }
  }
  QK_STAMP(QK_T_LOOP);
}

#ifndef QK_HOST
// Before the K loop, every thread of the block: under RED, copy 0 zeroes the slot the others will add into, and a
// barrier orders the zeros before any add.
template <int COUNT, bool RED>
__device__ __forceinline__ void splitk_begin(int t, int copy, int threads, int splits) {
  if (!RED || splits == 1) return;
  extern __shared__ int32_t qk_partials[];
  if (copy == 0) qk::splitk_clear<COUNT>(qk_partials, t, threads);
  __syncthreads();
}

// The split-K meeting point (see splitk_slot): dynamic shared memory of (splits - 1) * COUNT * threads int32 (RED:
// COUNT * threads, after splitk_begin). Returns true for the threads of copy 0, which then hold the block's sums;
// every thread of the block must call it.
template <int COUNT, bool RED = false>
__device__ __forceinline__ bool splitk_reduce(int32_t* acc, int t, int copy, int threads, int splits) {
  if (splits == 1) {
    QK_STAMP(QK_T_REDUCED);
    return true;
  }
  extern __shared__ int32_t qk_partials[];
  if (copy > 0) qk::splitk_post<COUNT, RED>(qk_partials, acc, t, copy, threads);
  __syncthreads();
  if (copy > 0) return false;
  qk::splitk_collect<COUNT, RED>(acc, qk_partials, t, threads, splits);
  QK_STAMP(QK_T_REDUCED);
  return true;
}

// The fence of the meeting of a tile's blocks in device memory (splitk_blocks): QK_SPLITK_FENCE_SC = 1, the default
// as measured, __threadfence (fence.sc.gpu: MEMBAR.SC.GPU); 0 fence.acq_rel.gpu (MEMBAR.ALL.GPU), all that the
// meeting asks of the PTX memory model: a fence.acq_rel then a strong write is a release pattern (this block's sums
// before its count), a strong read then a fence.acq_rel an acquire pattern (the others' counts before their sums);
// the sequential consistency of fence.sc orders nothing more here. bench/smallm_tune.py's MEET-ACQREL, not yet timed:
// the meeting took about 2 us of QQQ's 13 us call on 4096 x 4096 (H100 phase timeline).
#ifndef QK_SPLITK_FENCE_SC
#define QK_SPLITK_FENCE_SC 1
#endif
__device__ __forceinline__ void splitk_fence() {
  if (QK_SPLITK_FENCE_SC) __threadfence();
  else asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}

// Split-K across the `zsplit` blocks (blockIdx.z) of one output tile, after each block's own splitk_reduce: copy 0's
// warp adds its COUNT sums a lane into the tile's int32 slots of `sums` (COUNT x 32 a tile; atomics, since integer
// sums do not depend on their order), and the last block to count itself in `arrived` takes the totals, zeroing the
// slots and the count for the next launch (the phases above, which the warp simulator runs too; the fences, lane 0's
// count broadcast by shuffle and the atomics are the device's alone). Returns true in that block, whose acc then holds
// the tile's sums; call with copy 0's warp only.
template <int COUNT>
__device__ __forceinline__ bool splitk_blocks(int32_t* acc, int lane, int zsplit, int32_t* sums, int32_t* arrived) {
  if (zsplit == 1) {
    QK_STAMP(QK_T_MET);
    return true;
  }
  const int tile = qk::splitk_tile(blockIdx.x, blockIdx.y, gridDim.x);
  int32_t* mine = qk::splitk_tile_sums<COUNT>(sums, tile);
  qk::splitk_blocks_post<COUNT>(mine, acc, lane);
  splitk_fence();  // this block's sums before its count: every lane's, once the warp has met
  __syncwarp();
  int last = 0;
  if (lane == 0) last = qk::splitk_blocks_arrive(arrived, tile, zsplit);
  if (!__shfl_sync(0xFFFFFFFFu, last, 0)) return false;
  splitk_fence();  // the others' sums after their counts
  qk::splitk_blocks_take<COUNT>(acc, mine, arrived, tile, lane);
  QK_STAMP(QK_T_MET);
  return true;
}

// Split-K across the Z blocks of a thread-block cluster (the *_z2 and *_z4 kernels, built with __cluster_dims__(1, 1,
// Z), which quantkit.kernels launches for a tile split over Z blocks when SPLITK_CLUSTER is set), after each block's
// splitk_reduce, with copy 0's warp: the blocks of rank 1 .. Z - 1 write their COUNT sums a lane into slot rank - 1
// of the leader's (rank 0) inbox, `offset` int32 into its dynamic shared memory ((Z - 1) x COUNT x 32 int32), by
// distributed shared memory, and arrive at the cluster's barrier (release); the leader arrives, waits (acquire) and
// adds the slots in rank order. No global workspace, atomics or fences, where splitk_blocks meets in device memory
// (its adds and its count, a fence, and the last block's exchanges: round trips to L2). The other warps have exited,
// which the cluster barrier counts as arrived. Integer sums: the same bits. Returns true in the leader.
template <int COUNT, int Z>
__device__ __forceinline__ bool splitk_cluster(int32_t* acc, int lane, int offset) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters are sm_90's: no _z kernel is built for an older device
  return false;
#else
  extern __shared__ int32_t qk_partials[];
  int32_t* inbox = qk_partials + offset;
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  if (rank != 0) {
    const unsigned mine = (unsigned)__cvta_generic_to_shared(inbox + (rank - 1) * COUNT * 32 + lane);
    unsigned leader;
    asm volatile("mapa.shared::cluster.u32 %0, %1, 0;\n" : "=r"(leader) : "r"(mine));
#pragma unroll
    for (int j = 0; j < COUNT; ++j)
      asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(leader + 128 * j), "r"(acc[j]) : "memory");
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    return false;
  }
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");  // the leader has nothing to publish
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#pragma unroll
  for (int z = 0; z < Z - 1; ++z)
#pragma unroll
    for (int j = 0; j < COUNT; ++j) acc[j] = (int32_t)((uint32_t)acc[j] + (uint32_t)inbox[(z * COUNT + j) * 32 + lane]);
  QK_STAMP(QK_T_MET);
  return true;
#endif
}

// Split-K across a tile's blocks, after each block's splitk_reduce (copy 0's warp): in the leader's shared memory
// where the kernel is a cluster build of Z blocks (splitk_cluster, the inbox after the block's splitk_slots), else
// in device memory (splitk_blocks; nothing to meet when zsplit is 1). Returns true where the tile's sums are whole.
template <int COUNT, int Z>
__device__ __forceinline__ bool splitk_meet(int32_t* acc, int lane, int splits, int zsplit, int32_t* sums,
                                            int32_t* arrived) {
  if constexpr (Z > 1) return splitk_cluster<COUNT, Z>(acc, lane, qk::splitk_slots(splits) * COUNT * 32);
  return splitk_blocks<COUNT>(acc, lane, zsplit, sums, arrived);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ldmatrix.x4 of b16 8 x 8 matrices: lane l gives the address of row l % 8 of matrix l / 8 and receives, of each
// matrix j, the 4 bytes 4 (l % 4) .. of its row l / 4 in d[j] (PTX ISA, "ldmatrix").
__device__ __forceinline__ void ldsm_x4(uint32_t d[4], const void* row) {
  const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

// The large-M GEMM of tile policy T: block (blockIdx.x, blockIdx.y) computes output channels BN blockIdx.x .. and
// tokens BM blockIdx.y ..; T::STAGES K steps of operands in flight in shared memory (cp.async), the copy of step
// kt + STAGES - 1 issued before the MMAs of step kt. At the barrier of step kt every warp is done with step kt - 1,
// whose slot the new copy reuses. T supplies steps (how many), copy_stage (every thread), compute (one warp, one
// stage) and store.
template <class T, class Args>
__device__ __forceinline__ void tiled_gemm(const Args& args) {
  extern __shared__ uint4 qk_stages[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(qk_stages);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, steps = T::steps(args);
  const int n0 = T::BN * blockIdx.x, m0 = T::BM * blockIdx.y;
  typename T::Acc acc = {};
#pragma unroll
  for (int s = 0; s < T::STAGES - 1; ++s) {
    if (s < steps) T::copy_stage(args, smem + s * T::STAGE_BYTES, m0, n0, s, tid);
    cp_async_commit();
  }
  for (int kt = 0; kt < steps; ++kt) {
    cp_async_wait<T::STAGES - 2>();
    __syncthreads();
    const int next = kt + T::STAGES - 1;
    if (next < steps) T::copy_stage(args, smem + (next % T::STAGES) * T::STAGE_BYTES, m0, n0, next, tid);
    cp_async_commit();
    T::compute(args, smem + (kt % T::STAGES) * T::STAGE_BYTES, kt, m0, n0, warp, lane, acc);
  }
  T::store(args, m0, n0, warp, lane, acc);
}

// The tensor-core MMAs the kernels use (PTX mma.sync, sm_80+): D = A B + D on int32 accumulators.
__device__ __forceinline__ void mma_s8(int32_t c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_s8_k16(int32_t c[4], const uint32_t a[2], uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(b));
}

// D = A B + D with fp16 operands and float32 accumulators (mma.m16n8k16 .f32.f16.f16.f32): A registers {row g,
// k 2q..; row g + 8, k 2q..; row g, k 2q + 8..; row g + 8, k 2q + 8..}, B {k 2q.., k 2q + 8..} of column g, each
// register two fp16, the lower k in the low half.
__device__ __forceinline__ void mma_f16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_s4(int32_t c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k64.row.col.s32.s4.s4.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D = 2^QK_INT4_SHIFT A B + C for INT4 fragments: mma.sync .s4 where the tensor cores have INT4 (shift 0), else two
// INT8 MMAs on 16 times the codes (QK_INT4_AS_INT8, int4_half_as_int8; int4_sum takes the shift back).
__device__ __forceinline__ void mma_int4(int32_t c[4], const uint32_t a[4], const uint32_t b[2]) {
#if QK_INT4_AS_INT8
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t a8[4], b8[2];
    qk::int4_half_as_int8(a, b, h, a8, b8);
    mma_s8(c, a8, b8);
  }
#else
  mma_s4(c, a, b);
#endif
}
#if defined(QK_WGMMA)
// The wgmma primitives (PTX ISA 8.0+, sm_90a only: built into the *_wgmma kernels when QK_WGMMA is defined).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Ties a register to this point of the program, so that no read of an accumulator moves above a wgmma_wait.
__device__ __forceinline__ void fence_operand(int32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
// The same for a warp's A fragments of one step: live (unchanged, none of their registers reused) up to here.
template <int KS>
__device__ __forceinline__ void fence_operands(uint32_t (&fa)[KS][4]) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(fa[kk][i])::"memory");
}

// The mbarriers of the bulk and tensor copies (the TMA engine's): a phase completes once its arrivals and the bytes
// its copies announced (expect_tx) have come.
__device__ __forceinline__ uint32_t shared_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_addr(bar)), "r"(bytes)
               : "memory");
}
// Until the phase of the given parity has completed (acquire: the bytes its copies wrote are visible after). A wait
// that lasts MBAR_TIMEOUT_NS (a phase whose byte count never arrives: a wrong expect-tx count or a copy that failed)
// traps, so that the launch fails with an error instead of hanging the device; the first try is the whole fast path,
// the clock is read only once it fails.
constexpr uint64_t MBAR_TIMEOUT_NS = 2000000000ull;
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n.reg .u64 start, now;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@done bra DONE;\n"
      "mov.u64 start, %%globaltimer;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@done bra DONE;\n"
      "mov.u64 now, %%globaltimer;\n"
      "sub.u64 now, now, start;\n"
      "setp.lt.u64 done, now, %2;\n"
      "@done bra WAIT;\n"
      "trap;\n"
      "DONE:\n}\n" ::"r"(shared_addr(bar)),
      "r"(parity), "l"(MBAR_TIMEOUT_NS)
      : "memory");
}
// One TMA copy of a 2-D box: the box of tensor map `map` (in global memory, 128 bytes) at coordinates (c0 innermost,
// c1) into shared memory at `dst`, completing on mbarrier `bar` (its bytes announced there beforehand).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(shared_addr(bar))
      : "memory");
}
// A tensor map that the host wrote into global memory, acquired for the tensor copies that read it.
__device__ __forceinline__ void tensormap_acquire(const void* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
}

// D = A B (+ D when `accumulate`), wgmma.mma_async m64n128k32 .s32.s8.s8: A (64 x 32) from the warpgroup's
// registers, B (32 x 128, K-major) from shared memory through descriptor `b`. The first product of a sum starts it
// (accumulate false) rather than adding to zeros, so that no other instruction writes the accumulators while
// wgmmas are in flight (which would make the compiler serialize them).
__device__ __forceinline__ void wgmma_s8_m64n128k32(int32_t d[64], const uint32_t a[4], uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]),
        "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]),
        "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]),
        "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]),
        "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]),
        "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]),
        "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]),
        "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"((int)accumulate));
}

// The Hopper GEMM of layout F (WgmmaTiles): a ring of STAGES stages in shared memory aligned to 1 KiB, filled by
// cp.async as in tiled_gemm, LEAD steps ahead: the copy issued at step kt (after its barrier) is step kt + LEAD's,
// into the slot of step kt + LEAD - STAGES, which every warpgroup finished before the barrier (by default kt - 2, a
// margin from a loop whose wgmmas could still be reading their stage during the next step, wgmma_wait<1>; with each
// step's wgmmas retired below, kt - 1 would do: LEAD = STAGES - 1, a knob until a GPU run measures it). Each thread
// fences its completed copies into the async proxy (the tensor cores' view of shared memory) before the barrier.
//
// When a step's wgmmas retire is a knob (QK_WGMMA_RETIRE, 1 by default: in H100 tuning run 5 mode 1 took 0.85-0.95x
// mode 0's time on all 20 rows at M = 1024, OVERLAP 0.87-1.05x; bench/smallm_tune.py --large's RETIRE-END, 0,
// and OVERLAP, 2):
//  0. at the end of the step: the tensor cores work on a warpgroup's step only while the SM's other warpgroups run
//     their barriers, copies and fragments;
//  1. (RETIRE-LATE) just before the next step's fragments are loaded: they run on through its wait for its copies,
//     its barrier and the issue of its copy;
//  2. (OVERLAP) at the end of the next step (wgmma_wait<1>): they run on while the next step's fragments are
//     unpacked, into the other of two register sets (the loop unrolled by two steps, so that each set keeps its
//     registers), each set tied (fence_operands) past the wait that retires its readers. A loop of this kind needed
//     152-171 registers when each kernel carried both variants' code (one block of 256 threads an SM instead of two)
//     and was slower on an H200, on all 20 rows at M = 1024 (0.23-0.67x cuBLAS INT8 against 0.32-0.95x; raw numbers
//     in bench/results/kernels_h200_wgmma_overlap.json against the same run's kernels_h200_bench.json as of commit
//     f5689c5); each variant's kernel now takes it in 128 registers or fewer, without spills.
// Nothing writes a wgmma's registers while it runs (A fragments and accumulators alike, as the PTX ISA asks):
// bench/sass_loops.py checks the SASS for such writes, which it finds in a loop with one register set and
// wgmma_wait<1> (on an H200 such a loop gave wrong LiquidQuant rows g + 8: the compiler reused registers still being
// read, which the warp simulator cannot show). In modes 1 and 2 a step's stage may still be read during the next
// step, so where LEAD = STAGES - 1 (whose copy goes into the slot of the step before) the loop keeps mode 0.
// QK_WGMMA_PROXY_FENCE = 0 (NOFENCE) leaves out the fence of the completed copies into the async proxy. A diagnostic,
// never a default: the memory model asks for the fence between the copies' generic-proxy writes and the wgmmas'
// async-proxy reads. It times what the fence (a MEMBAR.ALL.CTA in SASS) costs a step, with later steps' copies in
// flight.
#ifndef QK_WGMMA_RETIRE
#define QK_WGMMA_RETIRE 1
#endif
#ifndef QK_WGMMA_PROXY_FENCE
#define QK_WGMMA_PROXY_FENCE 1
#endif
#if QK_WGMMA_TMA
#define QK_X_MAP_PARAM , const void* x_map
#define QK_X_MAP x_map
#else
#define QK_X_MAP_PARAM
#define QK_X_MAP nullptr
#endif
// The stream-K tail's meeting (qk::streamk_work): the first of a split tile's two blocks to count itself in
// flags[2 s] stores its sums in slot s of `partials` (N int32 a thread, thread-major within each index) and raises
// flags[2 s + 1]; the second waits for that flag (the first is running: it has counted, and waits on nothing), adds
// the stored sums to its own, lowers both flags for the next launch and returns true: it runs the epilogue. Integer
// sums: the same bits as one block's. A release by the first (every thread's stores, a fence, the barrier, thread
// 0's fence and flag) and an acquire by the second (thread 0's strong read of the flag, a fence, the barrier).
template <int N, int THREADS>
__device__ __forceinline__ bool streamk_meet(const qk::StreamK& sk, int split, int32_t* d, int tid) {
  __shared__ int first;
  int32_t* slot = sk.partials + (size_t)split * N * THREADS;
  if (tid == 0) first = atomicAdd(&sk.flags[2 * split], 1) == 0;
  __syncthreads();
  if (first) {
#pragma unroll
    for (int i = 0; i < N; ++i) __stcg(&slot[i * THREADS + tid], d[i]);
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      atomicExch(&sk.flags[2 * split + 1], 1);
    }
    return false;
  }
  if (tid == 0) {
    while (*reinterpret_cast<volatile int32_t*>(&sk.flags[2 * split + 1]) == 0) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
  __threadfence();
  // in groups of 16 loads in flight (a compiler barrier between groups): with all N sums live, more would spill
#pragma unroll
  for (int i = 0; i < N; i += 16) {
#pragma unroll
    for (int j = i; j < i + 16; ++j) d[j] += __ldcg(&slot[j * THREADS + tid]);
    asm volatile("" ::: "memory");
  }
  if (tid == 0) sk.flags[2 * split] = sk.flags[2 * split + 1] = 0;
  return true;
}

template <class F, int W = 1, int H = 1, int S = QK_WGMMA_STAGES, int L = QK_WGMMA_LEAD>
__device__ __forceinline__ void wgmma_gemm(const typename F::Args& args, const void* x_map = nullptr,
                                           const qk::StreamK* sk = nullptr) {
  using T = qk::WgmmaTiles<F, W, H, S, L>;
  constexpr int KS = T::BK / 32, RETIRE = T::LEAD <= T::STAGES - 2 ? QK_WGMMA_RETIRE : 0;
  static_assert(QK_WGMMA_RETIRE >= 0 && QK_WGMMA_RETIRE <= 2, "QK_WGMMA_RETIRE is 0, 1 or 2");
  extern __shared__ uint4 qk_stages[];
  const uint32_t raw = (uint32_t)__cvta_generic_to_shared(qk_stages), pad = (T::ALIGN - raw % T::ALIGN) % T::ALIGN;
  uint8_t* smem = reinterpret_cast<uint8_t*>(qk_stages) + pad;
  const uint32_t base = raw + pad;
  // The block's tile and K steps [k0, k0 + steps): by its grid coordinates, or with `sk` (a one-dimensional grid) by
  // streamk_work (whose `split`, the tile's index in the stream-K tail, is worked out again after the loop from the
  // launch's parameters, rather than held in a register through it). Written as the grid's case alone was, so that
  // without `sk` the compiler gets the same code, and the same schedule, as before the tail was added.
  const qk::BlockWork work = sk ? qk::streamk_work(blockIdx.x, sk->from, T::steps(args)) : qk::BlockWork{};
  const int tiles_n = sk ? args.n / T::BN : 0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32,
            steps = sk ? work.k_end - work.k_begin : T::steps(args);
  const int n0 = T::BN * (sk ? work.tile % tiles_n : blockIdx.x),
            m0 = T::BM * (sk ? work.tile / tiles_n : blockIdx.y);
  const int k0 = sk ? work.k_begin : 0;
  // The first wgmma starts the sums (K >= BK: a launch has at least one step), so the accumulators are only
  // declared written here, by no instruction: zeroing them would make ptxas serialize the wgmmas.
  typename T::Acc acc;
#pragma unroll
  for (int i = 0; i < 64 * H; ++i) asm volatile("" : "=r"(acc.d[i]));
  // QK_WGMMA_TMA: a stage's mbarrier (one arrival, thread 0's, and the tile's bytes), after the ring.
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + T::STAGES * T::STAGE_BYTES);
  if (QK_WGMMA_TMA) {
    if (tid == 0) {
      tensormap_acquire(x_map);
      for (int s = 0; s < T::STAGES; ++s) mbar_init(&bars[s], 1);
      mbar_fence_init();
    }
    __syncthreads();
  }
  // The copies of step kt into the slot at offset `at`; with the tensor copies, that slot's mbarrier (a constant
  // divisor: a multiply-high, where a stage index kept beside each offset was state to keep in step).
  auto bar_of = [&](uint32_t at) { return &bars[at / T::STAGE_BYTES]; };
  auto copy = [&](int kt, uint32_t at) {
    if (!QK_WGMMA_TMA) {
      T::copy_stage(args, smem + at, m0, n0, kt, tid);
      return;
    }
    T::copy_weights(args, smem + at, n0, kt, tid);
    if (tid == 0) {
      mbar_arrive_expect_tx(bar_of(at), T::BM * T::BK);
      tma_load_2d(base + at, x_map, kt * T::BK, m0, bar_of(at));
    }
  };
#pragma unroll
  for (int s = 0; s < T::LEAD; ++s) {
    if (s < steps) copy(k0 + s, s * T::STAGE_BYTES);
    cp_async_commit();
  }
  // The ring slots of step kt and of the copy LEAD steps ahead, kept as offsets that wrap, not remade each step
  // from kt by a division; with the tensor copies, the parity of step kt's phase of its slot's mbarrier (its
  // (kt / STAGES)-th), which flips each time the slot wraps.
  uint32_t slot = 0, next_slot = T::LEAD % T::STAGES * T::STAGE_BYTES, parity = 0;
  // Step kt of the block's (K step k0 + kt), its A fragments into `mine`; `other` holds the previous step's (the same
  // array except in mode 2).
  auto step = [&](int kt, uint32_t (&mine)[KS][4], uint32_t (&other)[KS][4]) {
    cp_async_wait<T::LEAD - 1>();  // step kt's copies landed (LEAD + kt groups committed, the last LEAD - 1 pending)
    if (QK_WGMMA_TMA) mbar_wait(bar_of(slot), parity);  // and its activation tile
    else if (QK_WGMMA_PROXY_FENCE) fence_proxy_async();
    __syncthreads();
    const int next = kt + T::LEAD;
    if (next < steps) copy(k0 + next, next_slot);
    cp_async_commit();
    if (RETIRE == 1) {  // the previous step's wgmmas, run on through the barrier and the copies, retire
      wgmma_wait<0>();
      fence_operands(other);
    }
    // This step's A fragments from its stage, then its wgmmas on them, committed as one group.
    T::load_a(args, smem + slot, warp, lane, mine);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int t = 0; t < H; ++t)  // the same A fragments for each 128-token half
        wgmma_s8_m64n128k32(acc.d + 64 * t, mine[kk], T::b_desc(base + slot, kk, t), kt > 0 || kk > 0);
    wgmma_commit();
    if (RETIRE == 0) wgmma_wait<0>();
    if (RETIRE == 2) {  // the previous step's wgmmas retire, this step's run on into the next
      wgmma_wait<1>();
      fence_operands(other);
    }
    constexpr uint32_t RING = T::STAGES * T::STAGE_BYTES;
    slot = slot + T::STAGE_BYTES == RING ? 0 : slot + T::STAGE_BYTES;
    next_slot = next_slot + T::STAGE_BYTES == RING ? 0 : next_slot + T::STAGE_BYTES;
    parity ^= slot == 0;
  };
  uint32_t fa[KS][4], fb[KS][4];
  if (RETIRE != 0) {  // zeros before the first step, so that the ties hold defined values
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) fa[kk][i] = fb[kk][i] = 0;
  }
  if (RETIRE == 2) {
    int kt = 0;
    for (; kt + 1 < steps; kt += 2) {
      step(kt, fa, fb);
      step(kt + 1, fb, fa);
    }
    if (kt < steps) step(kt, fa, fb);
  } else {
    for (int kt = 0; kt < steps; ++kt) step(kt, fa, fa);
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < 64 * H; ++i) fence_operand(acc.d[i]);
  if (sk) {
    const int split = qk::streamk_work(blockIdx.x, sk->from, T::steps(args)).split;
    if (split >= 0 && !streamk_meet<64 * H, T::THREADS>(*sk, split, acc.d, tid)) return;
  }
  if (QK_WGMMA_TMA) fence_proxy_async();  // the tensor copies' writes before the staged outputs' over them
  __syncthreads();  // every warpgroup done with the ring: the outputs are staged where the stages were
  T::stage_out(args, smem, m0, n0, warp, lane, acc);
  __syncthreads();
  T::write_out(args, smem, m0, n0, tid);
}

// The 256-token kernel of layout F (WgmmaTiles<F, 1, 2>): the per-group variant (`grouped`, known at the launch's one
// branch on its group parameters) on the ring of QK_WGMMA_TALL_GROUP_STAGES, the per-channel one on the common ring.
// Under QK_WGMMA_STREAMK a one-dimensional grid, its blocks' work by qk::streamk_work (`sk`; from = the tiles where
// none is split); else the two-dimensional grid, `sk` unread.
template <class F>
__device__ __forceinline__ void wgmma_tall_gemm(const typename F::Args& args, bool grouped, const void* x_map,
                                                const qk::StreamK& sk) {
  const qk::StreamK* tail = QK_WGMMA_STREAMK ? &sk : nullptr;
  if (grouped) wgmma_gemm<F, 1, 2, QK_WGMMA_TALL_GROUP_STAGES, QK_WGMMA_TALL_GROUP_LEAD>(args, x_map, tail);
  else wgmma_gemm<F, 1, 2>(args, x_map, tail);
}

// The bulk decode pipeline (the *_bulk kernels, sm_90: built with the Hopper module). Warp `copy` of a block of
// `splits` is copy blockIdx.z splits + copy of the tile's splits zsplit (copy_range), and walks its contiguous range
// of the tile's `steps` K steps in chunks of `chunk` steps, `nslots` chunks in flight in its own slots of shared
// memory:
// each chunk arrives by bulk copies (cp.async.bulk, the TMA engine's 1-D copies, a handful of instructions for
// kilobytes, no registers held while in flight) that complete on the slot's mbarrier. copies(s0, cnt, emit) names
// the copies of chunk [s0, s0 + cnt) as emit(offset in the slot, source, bytes) (16-byte multiples, both ends
// aligned), the same on every lane; lane 0 posts their byte count on the barrier (arrive.expect_tx), then lane
// i % 32 issues copy i. compute(s0, u, slot) runs step s0 + u from the landed slot. A slot is refilled once every
// lane has read it: each lane fences its reads against the async proxy, the warp meets, then the next copies go.
// The block's dynamic shared memory: the split-K partials first (where splitk_reduce expects them, `partial_bytes`
// a copy), then 8 bytes of mbarrier per slot of every warp (rounded up to 16), then each warp's slots.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   shared_addr(dst)),
               "l"(src), "r"(bytes), "r"(shared_addr(bar))
               : "memory");
}

template <class Copies, class Compute>
__device__ __forceinline__ void bulk_steps(int splits, int zsplit, int partial_bytes, int nslots, int slot_bytes,
                                           int chunk, int steps, Copies copies, Compute compute) {
  const int lane = threadIdx.x % 32, copy = threadIdx.x / 32;
  extern __shared__ uint4 qk_dynamic[];
  uint8_t* base = reinterpret_cast<uint8_t*>(qk_dynamic) + (splits - 1) * partial_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(base) + copy * nslots;
  uint8_t* slots = base + (splits * nslots * 8 + 15) / 16 * 16 + (size_t)copy * nslots * slot_bytes;
  int begin, end;
  qk::copy_range(blockIdx.z * splits + copy, splits * zsplit, steps, begin, end);
  if (lane == 0) {
    for (int r = 0; r < nslots; ++r) mbar_init(&bars[r], 1);
    mbar_fence_init();
  }
  __syncwarp();
  const int chunks = end > begin ? (end - begin + chunk - 1) / chunk : 0;
  auto issue = [&](int j) {
    const int s0 = begin + j * chunk, cnt = qk::imin(chunk, end - s0);
    uint8_t* slot = slots + (size_t)(j % nslots) * slot_bytes;
    uint32_t total = 0;
    copies(s0, cnt, [&](int, const void*, int bytes) { total += bytes; });
    if (lane == 0) mbar_arrive_expect_tx(&bars[j % nslots], total);
    __syncwarp();
    int i = 0;
    copies(s0, cnt, [&](int offset, const void* src, int bytes) {
      if (i++ % 32 == lane) bulk_copy(slot + offset, src, bytes, &bars[j % nslots]);
    });
  };
  for (int j = 0; j < qk::imin(nslots, chunks); ++j) issue(j);
  for (int j = 0; j < chunks; ++j) {
    mbar_wait(&bars[j % nslots], (j / nslots) & 1);
    const int s0 = begin + j * chunk, cnt = qk::imin(chunk, end - s0);
    const uint8_t* slot = slots + (size_t)(j % nslots) * slot_bytes;
    for (int u = 0; u < cnt; ++u) compute(s0, u, slot);
    if (j + nslots < chunks) {
      fence_proxy_async();  // this lane's reads of the slot before the copies that overwrite it
      __syncwarp();
      issue(j + nslots);
    }
  }
}

#endif  // QK_WGMMA
#endif
