// QQQ W4A8 GEMM on the `qqq` layout (quantkit/formats/qqq.py; vLLM's QQQ method, Marlin-derived tiles):
// out[M, N] (fp16) = fp16((acc * s_channel[n]) * s_x[m]), acc = sum_k x_int8[m, k] W8[k, n], INT8 mma.m16n8k16.
//
// `B` int32 [K/16, 2N]: row i is the k tile 16 i .. 16 i + 15; its words come in chunks of 128 covering 64 output
// channels (four 16 x 16 tiles), and lane l = 4 col + r of a warp holds words 4 l .. 4 l + 3 of a chunk (one 128-bit
// load), word `tile` with the eight codes of rows 4r .. 4r + 3 of columns col (elements 0-3) and col + 8 (elements
// 4-7) of tile `tile`: exactly the B fragments of two m16n8k16 MMAs.
//  - per channel: codes are two's complement in [-7, 7]; w & 0xF0F0F0F0 gives elements 0-3 as INT8 16 q and
//    (w << 4) & 0xF0F0F0F0 elements 4-7 (s_channel holds the scale / 16);
//  - per group (128): codes are q + 8; each is expanded with the 0x6400 fp16 trick to q and turned into the INT8
//    round(q * r) by one fp16 FMA q * r + 1536, whose low byte it is (the sum lies where the fp16 ulp is 1, and its
//    bits are 0x6600 + round(q * r)), r the fp16 ratio of the group scale to the channel's INT8 scale (`s_group`).
// One warp computes 16 tokens x 64 channels; grid (N / 64, ceil(M / 16)). For small M the block holds `splits`
// warps on the same tile, each taking every splits-th k tile with four tiles' loads in flight, and their int32
// accumulators meet in shared memory before the epilogue (split-K, qk_common.cuh: bit-identical to one warp). No
// shared-memory staging of the operands yet; quantkit's warp simulator runs the same functions.
#include "qk_common.cuh"

namespace qk {

struct QQQArgs {
  const int8_t* x;         // [M, K]
  const float* s_x;        // [M]
  const uint32_t* b;       // [K/16, 2N]
  const float* s_channel;  // [N], in scale_perm_single order within each 32
  const qk_half* s_group;  // [K/128, N] in scale_perm order within each 64, or nullptr (per channel)
  qk_half* out;            // [M, N]
  int m, n, k;
};

// Where channel n's per-channel scale is stored (scale_perm_single: position 8 i + j holds 2 i + (0,1,8,9,...)[j]).
QK_FN int channel_scale_slot(int n) {
  const int c = n & 31;
  return (n - c) + 8 * ((c & 7) >> 1) + 2 * (c >> 3) + (c & 1);
}

// Two codes of a per-group word in fp16x2 lanes with exponent 0x6400 (the value 1024 + mantissa), the code at bit
// 0 (SHIFT 0: 1024 + code) or at bit 4 (SHIFT 4: 1024 + 16 code) of the mantissa -> per lane q = code - 8, exactly:
// (1024 + code) - 1032, or (1024 + 16 code) / 16 - 72 as one FMA whose product and sum are exact. Taking the odd
// nibbles where they sit saves their shifts. The host twin computes each lane's q from its code.
template <int SHIFT>
QK_FN uint32_t group_codes(uint32_t lanes) {
#if defined(__CUDA_ARCH__)
  __half2 h = *reinterpret_cast<__half2*>(&lanes);
  if (SHIFT == 0) {
    h = __hsub2(h, __halves2half2(__ushort_as_half(0x6408u), __ushort_as_half(0x6408u)));  // - 1032
  } else {
    h = __hfma2(h, __halves2half2(__ushort_as_half(0x2C00u), __ushort_as_half(0x2C00u)),    // * 1/16
                __halves2half2(__ushort_as_half(0xD480u), __ushort_as_half(0xD480u)));      // - 72
  }
  return *reinterpret_cast<uint32_t*>(&h);
#else
  uint32_t out = 0;
  for (int i = 0; i < 2; ++i) {
    const int code = (int)((lanes >> (16 * i + SHIFT)) & 0xFu);
    out |= (uint32_t)float_to_half((float)(code - 8)) << (16 * i);  // a small integer: exact in fp16
  }
  return out;
#endif
}

// Two fp16 q (group_codes') -> per lane the fp16 bits of q * r + 1536 rounded once (fp16 FMA, round to nearest
// even). Its low byte is round(q * r) as two's complement: with |round(q * r)| <= 127 the sum lies in [1408, 1664),
// where the fp16 ulp is 1 (so the FMA's rounding is the integer rounding, ties to even as 1536 is even) and the bits
// of 1536 + v are 0x6600 + v. (The paper's 1152 = 0x6480 put 0x80 + v in the low byte, which took an XOR 0x80 a
// byte to undo.) The host twin rounds each lane's exact value the same way.
QK_FN uint32_t group_fma2(uint32_t q2, qk_half r) {
#if defined(__CUDA_ARCH__)
  const __half2 bias = __halves2half2(__ushort_as_half(0x6600u), __ushort_as_half(0x6600u));  // 1536
  const __half2 r2 = __halves2half2(__ushort_as_half(r), __ushort_as_half(r));
  __half2 h = *reinterpret_cast<__half2*>(&q2);
  h = __hfma2(h, r2, bias);
  return *reinterpret_cast<uint32_t*>(&h);
#else
  uint32_t out = 0;
  for (int i = 0; i < 2; ++i) {
    const double q = (double)half_to_float((qk_half)(q2 >> (16 * i)));
    const double exact = q * (double)half_to_float(r) + 1536.0;  // exact in double
    const double ulp = std::ldexp(1.0, std::ilogb(exact) - 10);  // fp16 has 10 fraction bits
    out |= (uint32_t)float_to_half((float)(std::nearbyint(exact / ulp) * ulp)) << (16 * i);
  }
  return out;
#endif
}

// A per-group word -> its two halves' INT8 weights, elements 4 half + e in byte e of frag[half], with the ratio of
// the half's column (low or high half of ratio_pair, load_ratio_pair's). Element j sits in nibble (j % 2) 4 + j / 2
// (the interleave [0, 2, 4, 6, 1, 3, 5, 7]), so nibbles n and n + 4 (elements 2 n and 2 n + 1) make one fp16x2
// register with one mask and 0x6400 in each lane: nibbles 0 and 2 at mantissa bit 0, 1 and 3 at bit 4, from the word
// and the word shifted right by 8 (group_codes). Lane by lane the arithmetic is each code's alone; the low bytes of
// two registers (lanes e = 0, 1 and 2, 3), already the INT8 weights (group_fma2), are gathered by one byte permute.
QK_FN void group_word(uint32_t word, uint32_t ratio_pair, uint32_t frag[2]) {
  for (int half = 0; half < 2; ++half) {
    const uint32_t bytes = word >> (8 * half);  // nibbles 2 half, 2 half + 1 and their partners 4 above, at 0 and 4
    const qk_half r = (qk_half)(ratio_pair >> (16 * half));
    const uint32_t even = group_codes<0>(and_or(bytes, 0x000F000Fu, 0x64006400u));  // elements 4 half, 4 half + 1
    const uint32_t odd = group_codes<4>(and_or(bytes, 0x00F000F0u, 0x64006400u));   // 4 half + 2, 4 half + 3
    frag[half] = prmt(group_fma2(even, r), group_fma2(odd, r), 0x6420u);
  }
}

// The lane's four words of chunk c (channels 64 c ..) at k tile i: one 128-bit load.
QK_FN void load_b_raw(const QQQArgs& a, int c, int i, int lane, uint32_t w[4]) {
  load_u128(a.b + (size_t)i * 2 * a.n + 128 * c + 4 * lane, w);
}

// The 64 group ratios of chunk c (channels 64 c ..) at k tile i, or nullptr per channel.
QK_FN const qk_half* ratio_row(const QQQArgs& a, int c, int i) {
  return a.s_group == nullptr ? nullptr : a.s_group + (size_t)(16 * i / 128) * a.n + 64 * c;
}

// The ratio pair of the lane's columns of tile `tile` (col = 16 tile + g and col + 8 of the chunk whose 64 ratios
// `ratios` points to; unpack_tile_with's ratio_pair): scale_perm stores channel c of each 64 at 8 (c % 8) + c / 8,
// which puts them at 8 g + 2 tile and 8 g + 2 tile + 1, so they are one 32-bit load, col in the low half.
QK_FN uint32_t load_ratio_pair(const qk_half* ratios, int lane, int tile) {
  return load_u32(ratios + 8 * frag_group(lane) + 2 * tile);
}

// All four ratio pairs of the lane (load_ratio_pair's for tiles 0..3, pair t in word t): the 8 halves from 8 g on, one
// 16-byte load.
QK_FN void load_ratios(const qk_half* ratios, int lane, uint32_t r[4]) {
  load_u128(ratios + 8 * frag_group(lane), r);
}

// Word `tile` of a lane's four -> the B fragments of n8 blocks 2 tile (frag[0]) and 2 tile + 1 (frag[1]), per group
// with the tile's ratio pair (load_ratio_pair's).
QK_FN void unpack_tile_with(bool grouped, uint32_t ratio_pair, uint32_t word, uint32_t frag[2]) {
  if (!grouped) {
    frag[0] = word & 0xF0F0F0F0u;         // elements 0-3: column col
    frag[1] = (word << 4) & 0xF0F0F0F0u;  // elements 4-7: column col + 8
    return;
  }
  group_word(word, ratio_pair, frag);
}

// A lane's four words -> B fragments: frag[2 tile + half] for n8 block 2 tile + half, per group with its four ratio
// pairs (load_ratios').
QK_FN void unpack_words(bool grouped, const uint32_t pairs[4], const uint32_t w[4], uint32_t frag[8]) {
  for (int tile = 0; tile < 4; ++tile) unpack_tile_with(grouped, pairs[tile], w[tile], frag + 2 * tile);
}

// The same with the pairs loaded from the chunk's ratios (ratio_row's, or a stage's copy), per group only: a stage's
// pointer stays a shared one (a pointer that may be null made every ratio a generic load behind an address-space
// test).
QK_FN void unpack_b(bool grouped, const qk_half* ratios, int lane, const uint32_t w[4], uint32_t frag[8]) {
  uint32_t pairs[4] = {};
  if (grouped) load_ratios(ratios, lane, pairs);
  unpack_words(grouped, pairs, w, frag);
}

// The lane's A fragment at k tile i (of 16 columns; from its act_rows): rows g and g + 8, k 16 i + 4 q ...
QK_FN void load_a16(const ActRows& rows, int i, uint32_t frag[2]) {
  for (int h = 0; h < 2; ++h) frag[h] = rows.at(h, 16 * i);
}

// The output of token `row`, channel `col` from its int32 sum: (acc * s_channel) * s_x.
QK_FN qk_half out_value(const QQQArgs& a, int32_t acc, int row, int col) {
  return epilogue(acc, a.s_channel[channel_scale_slot(col)], a.s_x[row]);
}

// The lane's accumulators of n8 block nb of chunk c: c0, c1 at token g, channels 2q, 2q + 1; c2, c3 at token g + 8,
// each output value(acc, h, i, row, col) for its token row g + 8 h and channel col + i. The two adjacent outputs of a
// row go out as one 32-bit store.
template <class Value>
QK_FN void store_by(const QQQArgs& a, int mt, int c, int nb, int lane, const int32_t acc[4], Value value) {
  const int g = frag_group(lane), q = frag_quad(lane), col = 64 * c + 8 * nb + 2 * q;
  for (int h = 0; h < 2; ++h) {
    const int row = 16 * mt + g + 8 * h;
    if (row >= a.m) continue;
    const qk_half y0 = value(acc[2 * h], h, 0, row, col), y1 = value(acc[2 * h + 1], h, 1, row, col + 1);
    store_u32(a.out + (size_t)row * a.n + col, (uint32_t)y0 | ((uint32_t)y1 << 16));
  }
}
// ... with the epilogue's parameters loaded where they are used (out_value).
QK_FN void store(const QQQArgs& a, int mt, int c, int nb, int lane, const int32_t acc[4]) {
  store_by(a, mt, c, nb, lane, acc, [&](int32_t v, int, int, int row, int col) { return out_value(a, v, row, col); });
}

// The epilogue's parameters of a lane of tile (mt, c), loaded ahead (by the decode kernels once their K loop is done,
// before the split-K meeting, under QK_EPILOGUE_MID, qk_common.cuh): s_channel of columns 2q, 2q + 1 of each n8
// block, s_x of rows g and g + 8 (past M, the last row's: never stored).
struct QQQEpilogue {
  float s_channel[8][2], s_x[2];
};
// Whether a decode kernel loads them so (per group only with QK_EPILOGUE_MID_QQQ_GROUP: slower on three of four
// shapes on the H200).
QK_FN constexpr bool qqq_epilogue_mid(bool grouped) {
  return QK_EPILOGUE_MID && (!grouped || QK_EPILOGUE_MID_QQQ_GROUP);
}
// The decode kernels' K steps a round (pipelined_steps): per group, whose stages are larger and their unpacking
// longer, half the look-ahead (measured faster). The warp simulator's twin walks its steps in the same rounds.
QK_FN constexpr int qqq_ahead(bool grouped) { return grouped ? (QK_SMALLM_AHEAD + 1) / 2 : QK_SMALLM_AHEAD; }
QK_FN QQQEpilogue epilogue_params(const QQQArgs& a, int mt, int c, int lane) {
  QQQEpilogue e{};
  const int g = frag_group(lane), q = frag_quad(lane);
  for (int nb = 0; nb < 8; ++nb)
    for (int i = 0; i < 2; ++i)
      e.s_channel[nb][i] = load_f32(a.s_channel + channel_scale_slot(64 * c + 8 * nb + 2 * q + i));
  for (int h = 0; h < 2; ++h) e.s_x[h] = load_f32(a.s_x + imin(16 * mt + g + 8 * h, a.m - 1));
  return e;
}
// store's outputs from those parameters: the same arithmetic, so the same bits.
QK_FN void store_with(const QQQArgs& a, const QQQEpilogue& e, int mt, int c, int nb, int lane, const int32_t acc[4]) {
  store_by(a, mt, c, nb, lane, acc, [&](int32_t v, int h, int i, int, int) {
    return epilogue(v, e.s_channel[nb][i], e.s_x[h]);
  });
}

// The bulk decode kernel's slot (qqq_w4a8_bulk, Hopper): a chunk of up to `chunk` k16 steps of a 64-channel chunk
// of channels (c) for its 16-token tile (mt), from the stored tensors: per step the chunk's 512 bytes of B, each
// token's activations over the chunk in one run (16 bytes a step; a row every 16 chunk + 16 bytes, so that a
// fragment's eight rows fall in distinct banks) and, per group, the chunk's 64 ratios of each group the chunk
// touches (128 bytes each).
struct QQQBulk {
  int chunk, rows;  // rows: the activation rows a slot holds, min(16, M)
  bool grouped;

  QK_FN int row_bytes() const { return 16 * chunk + 16; }
  QK_FN int act_offset() const { return 512 * chunk; }
  QK_FN int ratio_offset() const { return act_offset() + rows * row_bytes(); }
  QK_FN int slot_bytes() const { return ratio_offset() + (grouped ? 128 * (chunk / 8 + 2) : 0); }

  QK_FN static int first_group(int s0) { return 16 * s0 / 128; }

  // emit(offset in the slot, source, bytes) for each copy of steps [s0, s0 + cnt) of chunk c, tile mt.
  template <class Emit>
  QK_FN void copies(const QQQArgs& a, int mt, int c, int s0, int cnt, Emit&& emit) const {
    for (int u = 0; u < cnt; ++u) emit(512 * u, a.b + (size_t)(s0 + u) * 2 * a.n + 128 * c, 512);
    for (int r = 0; r < rows && 16 * mt + r < a.m; ++r)
      emit(act_offset() + r * row_bytes(), a.x + (size_t)(16 * mt + r) * a.k + 16 * s0, 16 * cnt);
    if (!grouped) return;
    for (int g = first_group(s0); g <= (16 * (s0 + cnt) - 1) / 128; ++g)
      emit(ratio_offset() + 128 * (g - first_group(s0)), a.s_group + (size_t)g * a.n + 64 * c, 128);
  }
  // The lane's A fragment of step s0 + u (load_a's, from the slot; rows past M are zero).
  QK_FN void load_a(const QQQArgs& a, const uint8_t* slot, int mt, int u, int lane, uint32_t frag[2]) const {
    const int g = frag_group(lane), q = frag_quad(lane);
    for (int h = 0; h < 2; ++h) {
      const int row = g + 8 * h;
      frag[h] = 16 * mt + row < a.m ? load_u32(slot + act_offset() + row * row_bytes() + 16 * u + 4 * q) : 0u;
    }
  }
  // Its four words of step s0 + u (load_b_raw's) and per group its ratio pairs (load_ratios').
  QK_FN void load_b(const uint8_t* slot, int s0, int u, int lane, uint32_t w[4], uint32_t r[4]) const {
    load_u128(slot + 512 * u + 16 * lane, w);
    if (grouped)
      load_ratios(reinterpret_cast<const qk_half*>(slot + ratio_offset() +
                                                   128 * (16 * (s0 + u) / 128 - first_group(s0))),
                  lane, r);
  }
};

// The large-M path: a block of 8 warps computes 128 tokens x 128 channels, 4 x 2 warps of 32 x 64 (two m16 tiles
// by one 64-channel chunk), K in steps of 64 staged in shared memory 4 deep (qk_common.cuh tiled_gemm). A stage
// holds the swizzled activations [128, 64], the four k tiles' words of the block's two chunks as stored (1 KiB
// contiguous per k tile in B) and, per group, the block's 128 ratios of its group.
struct QQQTiled {
  static constexpr int BM = 128, BN = 128, BK = 64, STAGES = 4, THREADS = 256, WARPS_N = BN / 64;
  static constexpr int W_OFF = BM * BK, R_OFF = W_OFF + BN * BK / 2, STAGE_BYTES = R_OFF + 2 * BN;
  struct Acc { int32_t c[2][8][4]; };  // [m16 tile][n8 block][4]

  QK_FN static int steps(const QQQArgs& a) { return a.k / BK; }

  QK_FN static void copy_stage(const QQQArgs& a, uint8_t* stage, int m0, int n0, int kt, int tid) {
    copy_activations<BM, BK, THREADS>(stage, a.x, a.m, a.k, m0, kt, tid);
    copy_weights<THREADS>(a, stage, n0, kt, tid);
  }
  // The stage's weights of channels n0 .. n0 + BN - 1 and their group ratios (from W_OFF on), THREADS copying.
  template <int COPIERS>
  QK_FN static void copy_weights(const QQQArgs& a, uint8_t* stage, int n0, int kt, int tid) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(a.b);
    copy_runs<BK / 16, BN * 8, COPIERS>(stage + W_OFF, b + ((size_t)kt * (BK / 16) * 2 * a.n + 2 * n0) * 4,
                                         (size_t)2 * a.n * 4, tid);
    if (a.s_group != nullptr)
      copy_runs<1, 2 * BN, COPIERS>(
          stage + R_OFF, reinterpret_cast<const uint8_t*>(a.s_group + (size_t)(kt * BK / 128) * a.n + n0), 0, tid);
  }

  // Warp (wm, wn) = (warp / 2, warp % 2): rows 32 wm + 16 i, chunk wn; ldmatrix kk gives k tiles 2 kk and 2 kk + 1.
  QK_FN static int a_row(int warp, int i, int kk, int lane) {
    return ldsm_a_row<BK>(32 * (warp / WARPS_N) + 16 * i, 2 * kk, lane);
  }

  // The lane's B fragments of k tile r (0..3) of the stage.
  QK_FN static void load_b(const QQQArgs& a, const uint8_t* stage, int warp, int r, int lane, uint32_t fb[8]) {
    const int wn = warp % WARPS_N;
    uint32_t w[4];
    load_u128(stage + W_OFF + (r * WARPS_N + wn) * 512 + 16 * lane, w);
    unpack_b(a.s_group != nullptr, reinterpret_cast<const qk_half*>(stage + R_OFF) + 64 * wn, lane, w, fb);
  }

  QK_FN static void store(const QQQArgs& a, int m0, int n0, int warp, int lane, const Acc& acc) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int nb = 0; nb < 8; ++nb)
        qk::store(a, m0 / 16 + 2 * (warp / WARPS_N) + i, n0 / 64 + warp % WARPS_N, nb, lane, acc.c[i][nb]);
  }

#ifndef QK_HOST
  __device__ __forceinline__ static void compute(const QQQArgs& a, const uint8_t* stage, int, int, int, int warp,
                                                 int lane, Acc& acc) {
#pragma unroll
    for (int kk = 0; kk < BK / 32; ++kk) {
      uint32_t fa[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) ldsm_x4(fa[i], stage + a_row(warp, i, kk, lane));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t fb[8];
        load_b(a, stage, warp, 2 * kk + h, lane, fb);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const uint32_t ai[2] = {fa[i][2 * h], fa[i][2 * h + 1]};
#pragma unroll
          for (int nb = 0; nb < 8; ++nb) mma_s8_k16(acc.c[i][nb], ai, fb[nb]);
        }
      }
    }
  }
#endif
};

// The Hopper path (qk_common.cuh WgmmaTiles, QQQTiled's stages): warp w's 16 channels are tile w % 4 of chunk w / 4,
// one word of each lane's four per k16 tile, so a lane loads just that word.
struct QQQWgmma {
  using Args = QQQArgs;
  using Tiled = QQQTiled;

  QK_FN static void load_a(const QQQArgs& a, const uint8_t* stage, int warp, int lane, uint32_t fa[2][4]) {
    const int chunk = warp / 4, tile = warp % 4;
    // per group the lane's ratio pair, one load for the step's four k16 tiles (a group spans them all); taken from
    // the stage itself, not through a pointer that may be null, which made every load a generic one with a test
    // of its address space
    const bool grouped = a.s_group != nullptr;
    const uint32_t pair =
        grouped ? load_ratio_pair(reinterpret_cast<const qk_half*>(stage + Tiled::R_OFF) + 64 * chunk, lane, tile) : 0u;
    for (int r = 0; r < 4; ++r) {  // k16 tile r: registers {a0, a1} (r even) or {a2, a3} (r odd) of k32 step r / 2
      const uint32_t word = load_u32(stage + Tiled::W_OFF + (r * Tiled::WARPS_N + chunk) * 512 + 16 * lane + 4 * tile);
      unpack_tile_with(grouped, pair, word, fa[r / 2] + 2 * (r % 2));
    }
  }
  QK_FN static qk_half out_value(const QQQArgs& a, int32_t acc, int token, int channel) {
    return qk::out_value(a, acc, token, channel);
  }
};

}  // namespace qk

#ifndef QK_HOST
// The small-M kernels: grid (N / 64, ceil(M / 16), zsplit), block 32 * splits, dynamic shared memory
// splitk_slots(splits) * 4 KiB. The zsplit blocks of a tile split K too (its copies are blockIdx.z splits + copy of
// splits zsplit), meeting in `sums` and `arrived` (splitk_blocks; null when zsplit is 1). One kernel per layout
// variant, s_group null at compile time per channel, so that neither carries the other's code (per channel: 265
// instructions a round where one kernel for both took 709).
template <bool GROUPED, int Z = 1>
__device__ __forceinline__ void qqq_gemm_at(const int8_t* x, const float* s_x, const uint32_t* b,
                                            const float* s_channel, const qk_half* s_group, qk_half* out, int m, int n,
                                            int k, int splits, int zsplit, int32_t* sums, int32_t* arrived) {
  const qk::QQQArgs args{x, s_x, b, s_channel, GROUPED ? s_group : nullptr, out, m, n, k};
  const int lane = threadIdx.x % 32, c = blockIdx.x, mt = blockIdx.y;
  const int copy = threadIdx.x / 32, copies = splits * zsplit, first = blockIdx.z * splits + copy;
  struct Stage { uint32_t w[4], r[4], a[2]; };  // r: per group, the lane's ratio pairs
  int32_t acc[8][4] = {};
  const qk::ActRows rows = qk::act_rows(args, mt, lane);
  auto load = [&](int i, Stage& st) {
    qk::load_a16(rows, i, st.a);
    qk::load_b_raw(args, c, i, lane, st.w);
    if (GROUPED) qk::load_ratios(qk::ratio_row(args, c, i), lane, st.r);
  };
  auto compute = [&](int, const Stage& st) {
    uint32_t fb[8];
    qk::unpack_words(GROUPED, st.r, st.w, fb);
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) mma_s8_k16(acc[nb], st.a, fb[nb]);
  };
  splitk_begin<32, QK_SPLITK_RED>(lane, copy, 32, splits);
  pipelined_steps<qk::qqq_ahead(GROUPED), Stage>(first, copies, k / 16, load, compute);
  constexpr bool mid = qk::qqq_epilogue_mid(GROUPED);
  qk::QQQEpilogue epi{};
  if (mid && copy == 0) epi = qk::epilogue_params(args, mt, c, lane);  // in flight while the copies meet
  if (!splitk_reduce<32, QK_SPLITK_RED>(&acc[0][0], lane, copy, 32, splits)) return;
  if (!splitk_meet<32, Z>(&acc[0][0], lane, splits, zsplit, sums, arrived)) return;
  for (int nb = 0; nb < 8; ++nb) {
    if (mid) qk::store_with(args, epi, mt, c, nb, lane, acc[nb]);
    else qk::store(args, mt, c, nb, lane, acc[nb]);
  }
  QK_STAMP(QK_T_STORED);
}

// Per group (s_group given).
extern "C" __global__ void __launch_bounds__(512)
    qqq_w4a8_gemm(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                  const qk_half* s_group, qk_half* out, int m, int n, int k, int splits, int zsplit, int32_t* sums,
                  int32_t* arrived) {
  qqq_gemm_at<true>(x, s_x, b, s_channel, s_group, out, m, n, k, splits, zsplit, sums, arrived);
}
// Per channel (s_group unused).
extern "C" __global__ void __launch_bounds__(512)
    qqq_w4a8_gemm_pc(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                     const qk_half* s_group, qk_half* out, int m, int n, int k, int splits, int zsplit, int32_t* sums,
                     int32_t* arrived) {
  qqq_gemm_at<false>(x, s_x, b, s_channel, s_group, out, m, n, k, splits, zsplit, sums, arrived);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// The same with the tile's zsplit = Z blocks one thread-block cluster, meeting in the leader's shared memory
// (splitk_cluster; `sums` and `arrived` unused), dynamic shared memory (splitk_slots(splits) + Z - 1) * 4 KiB.
#define QK_QQQ_CLUSTER(NAME, GROUPED, Z)                                                                               \
  extern "C" __global__ void __launch_bounds__(512) __cluster_dims__(1, 1, Z)                                          \
      NAME(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel, const qk_half* s_group,       \
           qk_half* out, int m, int n, int k, int splits, int zsplit, int32_t* sums, int32_t* arrived) {               \
    qqq_gemm_at<GROUPED, Z>(x, s_x, b, s_channel, s_group, out, m, n, k, splits, zsplit, sums, arrived);               \
  }
QK_QQQ_CLUSTER(qqq_w4a8_gemm_z2, true, 2)
QK_QQQ_CLUSTER(qqq_w4a8_gemm_z4, true, 4)
QK_QQQ_CLUSTER(qqq_w4a8_gemm_pc_z2, false, 2)
QK_QQQ_CLUSTER(qqq_w4a8_gemm_pc_z4, false, 4)
#endif

#if defined(QK_WGMMA)
// The bulk decode kernel (Hopper): grid (N / 64, ceil(M / 16), zsplit), block 32 * splits, as qqq_w4a8_gemm, but
// copy i = blockIdx.z splits + c of a chunk's splits zsplit takes the contiguous k16 steps [i S / copies, (i + 1) S
// / copies) (S = K / 16), fetched by bulk copies into `slots` slots of `chunk` steps each (QQQBulk; bulk_steps's shared
// memory, partials 4 KiB a copy). At most 80 registers (512 threads fit in 40 K): ptxas took 81, one more for the
// constants the group expansion keeps in registers, and needs no spill at 80.
extern "C" __global__ void __maxnreg__(80)
    qqq_w4a8_bulk(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                  const qk_half* s_group, qk_half* out, int m, int n, int k, int splits, int zsplit, int32_t* sums,
                  int32_t* arrived, int chunk, int slots) {
  const qk::QQQArgs args{x, s_x, b, s_channel, s_group, out, m, n, k};
  const int lane = threadIdx.x % 32, copy = threadIdx.x / 32, c = blockIdx.x, mt = blockIdx.y;
  const bool grouped = s_group != nullptr;
  const qk::QQQBulk layout{chunk, qk::imin(16, m), grouped};
  int32_t acc[8][4] = {};
  bulk_steps(
      splits, zsplit, 4096, slots, layout.slot_bytes(), chunk, k / 16,
      [&](int s0, int cnt, auto&& emit) { layout.copies(args, mt, c, s0, cnt, emit); },
      [&](int s0, int u, const uint8_t* slot) {
        uint32_t fa[2], w[4], r[4] = {}, fb[8];
        layout.load_a(args, slot, mt, u, lane, fa);
        layout.load_b(slot, s0, u, lane, w, r);
        qk::unpack_words(grouped, r, w, fb);
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) mma_s8_k16(acc[nb], fa, fb[nb]);
      });
  if (!splitk_reduce<32>(&acc[0][0], lane, copy, 32, splits)) return;
  if (!splitk_blocks<32>(&acc[0][0], lane, zsplit, sums, arrived)) return;
  for (int nb = 0; nb < 8; ++nb) qk::store(args, mt, c, nb, lane, acc[nb]);
}
#endif

// The large-M path: grid (N / 128, ceil(M / 128)), block 256, dynamic shared memory 4 stages of
// QQQTiled::STAGE_BYTES (N % 128 == 0, K % 64 == 0).
// The large-M kernels serve both variants: one branch at entry, so that each path is compiled with s_group known to
// be there or known null, where every step of one path for both tested it.
template <class Run>
__device__ __forceinline__ void qqq_variant(const qk::QQQArgs& a, Run run) {
  if (a.s_group != nullptr) run(a);
  else run(qk::QQQArgs{a.x, a.s_x, a.b, a.s_channel, nullptr, a.out, a.m, a.n, a.k});
}

// Two blocks an SM: at most 128 registers (one path for both variants took 121; the two paths, 129 unbounded).
extern "C" __global__ void __launch_bounds__(256, 2)
    qqq_w4a8_tiled(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                   const qk_half* s_group, qk_half* out, int m, int n, int k) {
  qqq_variant(qk::QQQArgs{x, s_x, b, s_channel, s_group, out, m, n, k},
              [](const qk::QQQArgs& args) { tiled_gemm<qk::QQQTiled>(args); });
}

#if defined(QK_WGMMA)
// The Hopper path (sm_90a): grid (N / 128, ceil(M / 128)), block 256, dynamic shared memory QK_WGMMA_STAGES (5)
// stages of WgmmaTiles<QQQWgmma>::STAGE_BYTES plus 1 KiB of alignment slack (N % 128 == 0, K % 64 == 0).
extern "C" __global__ void __launch_bounds__(256) qqq_w4a8_wgmma(const int8_t* x, const float* s_x, const uint32_t* b,
                                                                 const float* s_channel, const qk_half* s_group,
                                                                 qk_half* out, int m, int n, int k QK_X_MAP_PARAM) {
  qqq_variant(qk::QQQArgs{x, s_x, b, s_channel, s_group, out, m, n, k},
              [=](const qk::QQQArgs& args) { wgmma_gemm<qk::QQQWgmma>(args, QK_X_MAP); });
}
// The same on 256 channels a block: grid (N / 256, ceil(M / 128)), block 512, stages of
// WgmmaTiles<QQQWgmma, 2>::STAGE_BYTES (N % 256 == 0).
extern "C" __global__ void __launch_bounds__(512) qqq_w4a8_wgmma2(const int8_t* x, const float* s_x, const uint32_t* b,
                                                                  const float* s_channel, const qk_half* s_group,
                                                                  qk_half* out, int m, int n, int k QK_X_MAP_PARAM) {
  qqq_variant(qk::QQQArgs{x, s_x, b, s_channel, s_group, out, m, n, k},
              [=](const qk::QQQArgs& args) { wgmma_gemm<qk::QQQWgmma, 2>(args, QK_X_MAP); });
}
// The same on 256 tokens a block: grid (N / 128, ceil(M / 256)), block 256, one block an SM, stages of
// WgmmaTiles<QQQWgmma, 1, 2>::STAGE_BYTES; QK_WGMMA_TALL_GROUP_STAGES of them per group (QK_WGMMA_STREAMK: as
// qserve_w4a8_wgmma_tall).
extern "C" __global__ void __launch_bounds__(256, 1)
    qqq_w4a8_wgmma_tall(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                        const qk_half* s_group, qk_half* out, int m, int n, int k QK_STREAMK_PARAMS QK_X_MAP_PARAM) {
  qqq_variant(qk::QQQArgs{x, s_x, b, s_channel, s_group, out, m, n, k}, [=](const qk::QQQArgs& args) {
    wgmma_tall_gemm<qk::QQQWgmma>(args, args.s_group != nullptr, QK_X_MAP, QK_STREAMK);
  });
}
#endif
#endif
