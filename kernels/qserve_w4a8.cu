// QServe / QoQ W4A8 GEMM on quantkit's `qserve` layout (quantkit/formats/qserve_layout.py, digest-qserve §3.2-3.4):
// out[M, N] (fp16) = epilogue(x_int8[M, K] @ W8[N, K]^T), with INT8 tensor-core MMAs (mma.m16n8k32 s8, sm_80+).
//
// One warp computes a 16 x 32 output tile and walks K in 32-wide steps. Per step, each lane
//  - loads its A fragment (4 words of row-major int8 activations: rows g and g + 8, columns 4q.. and 16 + 4q..);
//  - makes one 128-bit load of its 16 bytes of the 32 x 32 weight tile, stored in exactly the order the B
//    fragments need: word j = 2p + b holds, per byte e, the codes of channels 32t + 8b + g (low nibble) and
//    32t + 16 + 8b + g (high nibble) at k = 32kt + 16p + 4q + e;
//  - per channel: feeds the UINT4 codes to the MMA as they are (the zero point goes to the epilogue, Eq. 13);
//    per group: turns each word of four codes into INT8 with one 32-bit multiply by the zero-extended s2 byte and
//    one vadd4 of the replicated -(z * s2) byte (subtraction after multiplication, §3.4).
// The epilogue is float32 in a fixed order, rounded once to fp16: (acc * s1[n]) * s_x[m] (- s1_szeros[n] * t_x[m]).
// For small M the block holds `splits` warps on the same output tile, each taking every splits-th K step with four
// steps' loads in flight, and their int32 accumulators are summed in shared memory before the epilogue (split-K,
// qk_common.cuh: bit-identical to one warp walking all of K). No shared-memory staging of the operands yet, so large
// M re-reads them from L2. quantkit's warp simulator runs the same functions on the CPU.
#include "qk_common.cuh"

namespace qk {

struct QServeArgs {
  const int8_t* x;         // [M, K] per-token INT8 activations
  const float* s_x;        // [M] their scales
  const float* t_x;        // [M] per-token sums of the unquantized activations (per channel only)
  const uint8_t* qweight;  // [N, K/2] compute-aware order
  const qk_half* s1;       // [N] s1_scales
  const qk_half* szero;    // [N] s1_szeros (per channel) or nullptr
  const int8_t* s2;        // [K/G, N] s2_scales in the tile order (per group) or nullptr
  const int8_t* z2;        // [K/G, N] s2_zeros = -(z * s2), same order
  qk_half* out;            // [M, N]
  int m, n, k;
  GroupSize group;         // of s2 and z2 (per group)
};

// The lane's A fragment at k-tile kt (from its act_rows): {row g k 4q.., row g+8 k 4q.., row g k 16+4q.., row g+8 k 16+4q..}.
QK_FN void load_a(const ActRows& rows, int kt, uint32_t frag[4]) {
  for (int i = 0; i < 4; ++i) frag[i] = rows.at(i & 1, 32 * kt + 16 * (i >> 1));
}

// The lane's 16 bytes of weight tile (nt, kt): one 128-bit load.
QK_FN void load_b_raw(const QServeArgs& a, int nt, int kt, int lane, uint32_t w[4]) {
  load_u128(a.qweight + (((size_t)nt * (a.k / 32) + kt) * 32 + lane) * 16, w);
}

// Per group, the lane's s2 and -(z * s2) of one 32-channel tile, four bytes each from the tile's 32 bytes of the
// s2 and z2 rows: byte b and 2 + b for channels 32t + 8b + g and 32t + 16 + 8b + g.
QK_FN void group_params_at(const int8_t* s2, const int8_t* z2, int lane, uint32_t& s, uint32_t& z) {
  s = load_u32(s2 + 4 * frag_group(lane));
  z = load_u32(z2 + 4 * frag_group(lane));
}

// Those of n tile nt at k tile kt (zero per channel).
QK_FN void load_group_params(const QServeArgs& a, int nt, int kt, int lane, uint32_t& s, uint32_t& z) {
  s = z = 0;
  if (a.s2 != nullptr) {
    const size_t row = (size_t)div_group(32 * kt, a.group) * a.n + 32 * nt;
    group_params_at(a.s2 + row, a.z2 + row, lane, s, z);
  }
}

// One weight word -> the four INT8 weights of half h (0: its low nibbles, channels 32t + 8b + g; 1: its high
// nibbles, 32t + 16 + 8b + g): per group, q * s2 + (-(z * s2)) per byte lane, wrapping (subtraction after
// multiplication), with the s2 and z2 bytes 2 h + b of the lane's group parameters.
// The bytes are picked by byte permutes: s2's zero-extended, z2's replicated into all four byte lanes, one
// instruction each where shifts, masks and a multiply took five, for a half h known only at run time (the wgmma
// kernels' warps) as for a constant one.
QK_FN uint32_t dequant_half(const QServeArgs& a, uint32_t codes, uint32_t s, uint32_t z, int h, int b) {
  if (a.s2 == nullptr) return codes;
  const uint32_t i = 2 * h + b;  // the byte lane of s and z
  return vadd4(codes * prmt(s, 0, 0x4440u | i), prmt(z, 0, 0x1111u * i));
}
QK_FN uint32_t unpack_half(const QServeArgs& a, uint32_t word, uint32_t s, uint32_t z, int h, int b) {
  return dequant_half(a, (word >> (4 * h)) & 0x0F0F0F0Fu, s, z, h, b);  // h ? hi_nibbles : lo_nibbles
}

// A word's high nibbles as four bytes, given its low ones: the word less them (no borrow) shifted right by 4, as a
// multiply-high by 2^28 (shift_or), which the GPU runs on the FMA pipe (IMAD.HI; the subtraction an IMAD too) where
// a shift and a mask take the half-rate integer ALU twice. Main loop (sm_90a): the per-group decode kernel 568 ALU
// instructions of 884 to 440 of 889, the per-channel one 153 of 255 to 95 of 256.
QK_FN uint32_t high_nibbles(uint32_t word, uint32_t low) { return shift_or<true>(word - low, 4, 0u); }

// The lane's 16 weight bytes and group parameters -> B fragments of the 4 n8 blocks: frag[nb][p], nb = 2 h + b.
QK_FN void unpack_b(const QServeArgs& a, const uint32_t w[4], uint32_t s, uint32_t z, uint32_t frag[4][2]) {
  for (int b = 0; b < 2; ++b)
    for (int p = 0; p < 2; ++p) {
      const uint32_t low = w[2 * p + b] & 0x0F0F0F0Fu;
      frag[b][p] = dequant_half(a, low, s, z, 0, b);
      frag[2 + b][p] = dequant_half(a, high_nibbles(w[2 * p + b], low), s, z, 1, b);
    }
}

// The output of token `row`, channel `col` from its int32 sum: (acc * s1) * s_x (- s1_szeros * t_x per channel).
QK_FN qk_half out_value(const QServeArgs& a, int32_t acc, int row, int col) {
  const float s_w = half_to_float(a.s1[col]);
  return a.szero != nullptr ? epilogue_zero(acc, s_w, a.s_x[row], half_to_float(a.szero[col]), a.t_x[row])
                            : epilogue(acc, s_w, a.s_x[row]);
}

// Write the lane's accumulators of n8 block nb: c0, c1 at row g, columns 2q, 2q + 1; c2, c3 at row g + 8, each
// output value(acc, h, i, row, col) for its accumulator 2 h + i. The two adjacent outputs of a row go out as one
// 32-bit store.
template <class Value>
QK_FN void store_by(const QServeArgs& a, int mt, int nt, int nb, int lane, const int32_t acc[4], Value value) {
  const int g = frag_group(lane), q = frag_quad(lane), col = 32 * nt + 8 * nb + 2 * q;
  for (int h = 0; h < 2; ++h) {
    const int row = 16 * mt + g + 8 * h;
    if (row >= a.m) continue;
    const qk_half y[2] = {value(acc[2 * h], h, 0, row, col), value(acc[2 * h + 1], h, 1, row, col + 1)};
    store_u32(a.out + (size_t)row * a.n + col, (uint32_t)y[0] | ((uint32_t)y[1] << 16));
  }
}
// ... with the epilogue's parameters loaded where they are used (out_value).
QK_FN void store(const QServeArgs& a, int mt, int nt, int nb, int lane, const int32_t acc[4]) {
  store_by(a, mt, nt, nb, lane, acc, [&](int32_t v, int, int, int row, int col) { return out_value(a, v, row, col); });
}

// The 32-channel tile of slice sl of small-M block x, `slices` neighbouring tiles a warp (the *16 kernels: two, grid
// N / 64; they add sl to slice 0's tile). The warp simulator's twin maps its tiles with it. Unsigned, as blockIdx.x.
QK_FN int slice_tile(unsigned block, int slices, int sl) { return (int)(slices * block) + sl; }

// The epilogue's parameters of a lane of tile (mt, nt), loaded ahead (by the per-channel decode kernel before its K
// loop under QK_EPILOGUE_EARLY, qk_common.cuh: 12 a lane, 112 -> 120 registers, no spills; the per-group kernel has
// no registers to spare, and under QK_EPILOGUE_MID loads them after its K loop, before the split-K meeting): s1 (and
// s1_szeros per channel) of columns 2q, 2q + 1 of n8 block nb as one word each, s_x (and t_x) of rows g and g + 8
// (past M, the last row's: never stored).
struct QServeEpilogue {
  uint32_t s1[4], szero[4];
  float s_x[2], t_x[2];
};
QK_FN QServeEpilogue epilogue_params(const QServeArgs& a, int mt, int nt, int lane) {
  QServeEpilogue e{};
  const int g = frag_group(lane), q = frag_quad(lane);
  for (int nb = 0; nb < 4; ++nb) {
    e.s1[nb] = load_u32(a.s1 + 32 * nt + 8 * nb + 2 * q);
    if (a.szero != nullptr) e.szero[nb] = load_u32(a.szero + 32 * nt + 8 * nb + 2 * q);
  }
  for (int h = 0; h < 2; ++h) {
    const int row = imin(16 * mt + g + 8 * h, a.m - 1);
    e.s_x[h] = load_f32(a.s_x + row);
    if (a.szero != nullptr) e.t_x[h] = load_f32(a.t_x + row);
  }
  return e;
}
// store's outputs from those parameters: the same arithmetic in the same order, so the same bits.
QK_FN void store_with(const QServeArgs& a, const QServeEpilogue& e, int mt, int nt, int nb, int lane,
                      const int32_t acc[4]) {
  store_by(a, mt, nt, nb, lane, acc, [&](int32_t v, int h, int i, int, int) {
    const float s_w = half_to_float((qk_half)(e.s1[nb] >> (16 * i)));
    return a.szero != nullptr
               ? epilogue_zero(v, s_w, e.s_x[h], half_to_float((qk_half)(e.szero[nb] >> (16 * i))), e.t_x[h])
               : epilogue(v, s_w, e.s_x[h]);
  });
}

// The bulk decode kernel's slot (qserve_w4a8_bulk, Hopper): a chunk of up to `chunk` K steps of a 32-channel tile
// (nt) for its 16-token tile (mt), each part copied as one contiguous run of the stored tensors: the weights (512
// bytes a step, consecutive steps adjacent in the compute-aware order), each token's activations (32 bytes a step; a
// row every 32 chunk + 16 bytes, so that a fragment's eight rows fall in distinct banks) and, per group, the tile's
// 32 bytes of the s2 and of the z2 row of every group the chunk touches.
struct QServeBulk {
  int chunk, rows;  // rows: the activation rows a slot holds, min(16, M)
  bool grouped;

  QK_FN int row_bytes() const { return 32 * chunk + 16; }
  QK_FN int act_offset() const { return 512 * chunk; }
  QK_FN int param_offset() const { return act_offset() + rows * row_bytes(); }
  QK_FN int slot_bytes() const { return param_offset() + (grouped ? 64 * (chunk + 1) : 0); }  // chunk + 1 groups

  QK_FN static int first_group(const QServeArgs& a, int s0) { return div_group(32 * s0, a.group); }

  // emit(offset in the slot, source, bytes) for each copy of steps [s0, s0 + cnt) of tile (mt, nt).
  template <class Emit>
  QK_FN void copies(const QServeArgs& a, int mt, int nt, int s0, int cnt, Emit&& emit) const {
    emit(0, a.qweight + ((size_t)nt * (a.k / 32) + s0) * 512, 512 * cnt);
    for (int r = 0; r < rows && 16 * mt + r < a.m; ++r)
      emit(act_offset() + r * row_bytes(), a.x + (size_t)(16 * mt + r) * a.k + 32 * s0, 32 * cnt);
    if (!grouped) return;
    for (int g = first_group(a, s0); g <= div_group(32 * (s0 + cnt) - 1, a.group); ++g) {
      const size_t row = (size_t)g * a.n + 32 * nt;
      emit(param_offset() + 64 * (g - first_group(a, s0)), a.s2 + row, 32);
      emit(param_offset() + 64 * (g - first_group(a, s0)) + 32, a.z2 + row, 32);
    }
  }

  // The lane's A fragment of step s0 + u (load_a's, from the slot; rows past M are zero).
  QK_FN void load_a(const QServeArgs& a, const uint8_t* slot, int mt, int u, int lane, uint32_t frag[4]) const {
    const int g = frag_group(lane), q = frag_quad(lane);
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i & 1), col = 32 * u + 16 * (i >> 1) + 4 * q;
      frag[i] = 16 * mt + row < a.m ? load_u32(slot + act_offset() + row * row_bytes() + col) : 0u;
    }
  }
  // Its 16 weight bytes and group parameters of step s0 + u (load_b_raw's and load_group_params').
  QK_FN void load_b(const QServeArgs& a, const uint8_t* slot, int s0, int u, int lane, uint32_t w[4], uint32_t& s,
                    uint32_t& z) const {
    load_u128(slot + 512 * u + 16 * lane, w);
    s = z = 0;
    if (grouped) {
      const uint8_t* p = slot + param_offset() + 64 * (div_group(32 * (s0 + u), a.group) - first_group(a, s0));
      group_params_at(reinterpret_cast<const int8_t*>(p), reinterpret_cast<const int8_t*>(p + 32), lane, s, z);
    }
  }
};

// The large-M path: a block of 8 warps computes 128 tokens x 128 channels, 2 x 4 warps of 64 x 32 (four m16 tiles
// by one 32-channel weight tile), K in steps of 64 staged in shared memory 4 deep (qk_common.cuh tiled_gemm).
// A stage holds the swizzled activations [128, 64], the 4 x 2 weight tiles as stored (each n tile's two k tiles
// are 1 KiB contiguous in qweight) and, per group, the s2 and z2 rows of its two k tiles (128 bytes each).
struct QServeTiled {
  static constexpr int BM = 128, BN = 128, BK = 64, STAGES = 4, THREADS = 256, WARPS_N = BN / 32;
  static constexpr int W_OFF = BM * BK, P_OFF = W_OFF + BN * BK / 2, P_BYTES = (BK / 32) * BN;
  static constexpr int STAGE_BYTES = P_OFF + 2 * P_BYTES;
  struct Acc { int32_t c[4][4][4]; };  // [m16 tile][n8 block][4]

  QK_FN static int steps(const QServeArgs& a) { return a.k / BK; }

  QK_FN static void copy_stage(const QServeArgs& a, uint8_t* stage, int m0, int n0, int kt, int tid) {
    copy_activations<BM, BK, THREADS>(stage, a.x, a.m, a.k, m0, kt, tid);
    copy_weights<THREADS>(a, stage, n0, kt, tid);
  }
  // The stage's weights of channels n0 .. n0 + BN - 1 and their group parameters (from W_OFF on), THREADS copying.
  template <int COPIERS>
  QK_FN static void copy_weights(const QServeArgs& a, uint8_t* stage, int n0, int kt, int tid) {
    copy_runs<BN / 32, (BK / 32) * 512, COPIERS>(
        stage + W_OFF, a.qweight + ((size_t)(n0 / 32) * (a.k / 32) + (size_t)kt * (BK / 32)) * 512,
        (size_t)(a.k / 32) * 512, tid);
    if (a.s2 == nullptr || tid >= 2 * P_BYTES / 16) return;
    const int c = tid, which = c / (P_BYTES / 16), kk = (c % (P_BYTES / 16)) / (BN / 16), chunk = c % (BN / 16);
    const int8_t* src = which ? a.z2 : a.s2;  // row kk of s2 (then of z2): k tile BK / 32 kt + kk
    copy_async<16>(stage + P_OFF + which * P_BYTES + kk * BN + 16 * chunk,
                   src + (size_t)div_group(kt * BK + 32 * kk, a.group) * a.n + n0 + 16 * chunk, true);
  }
  static_assert(2 * P_BYTES / 16 <= THREADS, "one group-parameter chunk a thread at most");

  // Warp (wm, wn) = (warp / 4, warp % 4): rows 64 wm + 16 i, weight tile wn.
  QK_FN static int a_row(int warp, int i, int kk, int lane) {
    return ldsm_a_row<BK>(64 * (warp / WARPS_N) + 16 * i, 2 * kk, lane);
  }

  // The lane's 16 bytes of weight tile nt at k tile kk of the stage, and per group its s2 and -(z * s2) words.
  QK_FN static void load_raw(const QServeArgs& a, const uint8_t* stage, int nt, int kk, int lane, uint32_t w[4],
                             uint32_t& s, uint32_t& z) {
    load_u128(stage + W_OFF + (nt * (BK / 32) + kk) * 512 + 16 * lane, w);
    s = z = 0;
    if (a.s2 != nullptr) {
      const uint8_t* p = stage + P_OFF + kk * BN + 32 * nt;
      group_params_at(reinterpret_cast<const int8_t*>(p), reinterpret_cast<const int8_t*>(p + P_BYTES), lane, s, z);
    }
  }

  // The lane's B fragments of k tile kk of the stage: its 16 bytes of weight tile wn, unpacked.
  QK_FN static void load_b(const QServeArgs& a, const uint8_t* stage, int warp, int kk, int lane, uint32_t fb[4][2]) {
    uint32_t w[4], s, z;
    load_raw(a, stage, warp % WARPS_N, kk, lane, w, s, z);
    unpack_b(a, w, s, z, fb);
  }

  QK_FN static void store(const QServeArgs& a, int m0, int n0, int warp, int lane, const Acc& acc) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int nb = 0; nb < 4; ++nb)
        qk::store(a, m0 / 16 + 4 * (warp / WARPS_N) + i, n0 / 32 + warp % WARPS_N, nb, lane, acc.c[i][nb]);
  }

#ifndef QK_HOST
  __device__ __forceinline__ static void compute(const QServeArgs& a, const uint8_t* stage, int, int, int, int warp,
                                                 int lane, Acc& acc) {
#pragma unroll
    for (int kk = 0; kk < BK / 32; ++kk) {
      uint32_t fa[4][4], fb[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) ldsm_x4(fa[i], stage + a_row(warp, i, kk, lane));
      load_b(a, stage, warp, kk, lane, fb);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int nb = 0; nb < 4; ++nb) mma_s8(acc.c[i][nb], fa[i], fb[nb]);
    }
  }
#endif
};

// The Hopper path (qk_common.cuh WgmmaTiles, QServeTiled's stages): warp w's 16 channels are half w % 2 of weight
// tile w / 2 (low nibbles: the tile's channels 0..15, high: 16..31). A lane still loads all 16 bytes of its tile
// (the other half is its neighbour warp's) and unpacks its half as the small-M kernel does.
struct QServeWgmma {
  using Args = QServeArgs;
  using Tiled = QServeTiled;

  QK_FN static void load_a(const QServeArgs& a, const uint8_t* stage, int warp, int lane, uint32_t fa[2][4]) {
    const int nt = warp / 2, h = warp % 2;
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t w[4], s, z;
      Tiled::load_raw(a, stage, nt, kk, lane, w, s, z);
      for (int b = 0; b < 2; ++b)    // channel g + 8 b: registers a_b (k 4q..) and a_{2+b} (k 16 + 4q..)
        for (int p = 0; p < 2; ++p)  // word 2 p + b, byte lane 2 h + b of the group parameters (unpack_b's order)
          fa[kk][2 * p + b] = unpack_half(a, w[2 * p + b], s, z, h, b);
    }
  }
  QK_FN static qk_half out_value(const QServeArgs& a, int32_t acc, int token, int channel) {
    return qk::out_value(a, acc, token, channel);
  }
};

// The small-M kernels' K steps a round (pipelined_steps): per group QK_SMALLM_AHEAD; per channel QK_QSERVE_PC_AHEAD,
// by default the same (the per-channel kernel has registers to spare for more: bench/smallm_tune.py's QS-PC10,
// QS-PC12); two tiles a warp half the look-ahead (QK_QSERVE16_AHEAD): the same bytes of weights in flight. The warp
// simulator's twins walk their steps in the same rounds.
#ifndef QK_QSERVE_PC_AHEAD
#define QK_QSERVE_PC_AHEAD QK_SMALLM_AHEAD
#endif
#ifndef QK_QSERVE16_AHEAD
#define QK_QSERVE16_AHEAD 4
#endif
QK_FN constexpr int qserve_ahead(bool grouped, int slices) {
  return slices == 2 ? QK_QSERVE16_AHEAD : grouped ? QK_SMALLM_AHEAD : QK_QSERVE_PC_AHEAD;
}

}  // namespace qk

#ifndef QK_HOST
// The small-M kernels: grid (N / 32, ceil(M / 16), zsplit), block 32 * splits, dynamic shared memory
// splitk_slots(splits) * 2 KiB: the warps of a block split K over one 16 x 32 output tile, and so do the zsplit blocks
// of the tile (its copies are blockIdx.z splits + copy of splits zsplit, meeting in `sums` and `arrived`:
// splitk_blocks; null when zsplit is 1). One kernel per layout variant, with the other variant's tensors null at
// compile time, so that neither carries the other's code or registers: per channel the kernel needed 98 registers at 8
// steps a round where one kernel for both took 124 (112 now, 120 with its epilogue's parameters held across the K
// loop; ptxas 13.0, sm_90), which leaves room for more steps in flight (qserve_ahead) or more warps an SM.
// SLICES = 2 (the *16 kernels, 9 to 16 tokens, quantkit.kernels.QSERVE_GEMM16): a warp computes two neighbouring
// 32-channel tiles (block x: tiles 2x and 2x + 1, slice_tile) from one load of the activations a step. A 32-channel
// warp at 16 tokens loads 512 bytes of activations a step beside its 512 bytes of weights, and only where an SM holds
// several tiles does L1 share them (M = 16 took 1.08x M = 1's time at 28672 x 4096 on an H100, 1.29x at 4096 x
// 14336, one tile a block). Steps a round: qserve_ahead.
template <bool GROUPED, int Z = 1, int SLICES = 1>
__device__ __forceinline__ void qserve_gemm_at(const int8_t* x, const float* s_x, const float* t_x,
                                               const uint8_t* qweight, const qk_half* s1, const qk_half* szero,
                                               const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k,
                                               int group, int splits, int zsplit, int32_t* sums, int32_t* arrived) {
  const qk::QServeArgs args{x, s_x, GROUPED ? nullptr : t_x, qweight, s1, GROUPED ? nullptr : szero,
                            GROUPED ? s2 : nullptr, GROUPED ? z2 : nullptr, out, m, n, k, GROUPED ? group : 0};
  if (GROUPED) __builtin_assume(s2 != nullptr);  // the launch's; so no step tests it (load_group_params, unpack_b)
  const int lane = threadIdx.x % 32, copy = threadIdx.x / 32, nt = qk::slice_tile(blockIdx.x, SLICES, 0);
  const int mt = blockIdx.y;
  const int copies = splits * zsplit, first = blockIdx.z * splits + copy;
  constexpr int COUNT = 16 * SLICES;  // int32 sums a lane
  struct Stage { uint32_t w[SLICES][4], s[SLICES], z[SLICES], a[4]; };
  int32_t acc[SLICES][4][4] = {};
  const qk::ActRows rows = qk::act_rows(args, mt, lane);
  constexpr bool early = QK_EPILOGUE_EARLY && !GROUPED && SLICES == 1, mid = QK_EPILOGUE_MID && !early && SLICES == 1;
  qk::QServeEpilogue epi{};
  if (early && copy == 0) epi = qk::epilogue_params(args, mt, nt, lane);
  auto load = [&](int kt, Stage& st) {
    qk::load_a(rows, kt, st.a);
#pragma unroll
    for (int sl = 0; sl < SLICES; ++sl) {
      qk::load_b_raw(args, nt + sl, kt, lane, st.w[sl]);
      qk::load_group_params(args, nt + sl, kt, lane, st.s[sl], st.z[sl]);
    }
  };
  auto compute = [&](int, const Stage& st) {
#pragma unroll
    for (int sl = 0; sl < SLICES; ++sl) {
      uint32_t fb[4][2];
      qk::unpack_b(args, st.w[sl], st.s[sl], st.z[sl], fb);
#pragma unroll
      for (int nb = 0; nb < 4; ++nb) mma_s8(acc[sl][nb], st.a, fb[nb]);
    }
  };
  splitk_begin<COUNT, QK_SPLITK_RED>(lane, copy, 32, splits);
  pipelined_steps<qk::qserve_ahead(GROUPED, SLICES), Stage>(first, copies, k / 32, load, compute);
  if (mid && copy == 0) epi = qk::epilogue_params(args, mt, nt, lane);  // in flight while the copies meet
  if (!splitk_reduce<COUNT, QK_SPLITK_RED>(&acc[0][0][0], lane, copy, 32, splits)) return;
  if (!splitk_meet<COUNT, Z>(&acc[0][0][0], lane, splits, zsplit, sums, arrived)) return;
#pragma unroll
  for (int sl = 0; sl < SLICES; ++sl)
    for (int nb = 0; nb < 4; ++nb) {
      if (early || mid) qk::store_with(args, epi, mt, nt, nb, lane, acc[0][nb]);
      else qk::store(args, mt, nt + sl, nb, lane, acc[sl][nb]);
    }
  QK_STAMP(QK_T_STORED);
}

// Per group (s2, z2 given; s1_szeros and t_x unused).
extern "C" __global__ void __launch_bounds__(512)
    qserve_w4a8_gemm(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight, const qk_half* s1,
                     const qk_half* szero, const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k,
                     int group, int splits, int zsplit, int32_t* sums, int32_t* arrived) {
  qserve_gemm_at<true>(x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group, splits, zsplit, sums, arrived);
}
// Per channel (s1_szeros and t_x given; s2, z2 unused).
extern "C" __global__ void __launch_bounds__(512)
    qserve_w4a8_gemm_pc(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight,
                        const qk_half* s1, const qk_half* szero, const int8_t* s2, const int8_t* z2, qk_half* out,
                        int m, int n, int k, int group, int splits, int zsplit, int32_t* sums, int32_t* arrived) {
  qserve_gemm_at<false>(x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group, splits, zsplit, sums, arrived);
}

// Two tiles a warp, 9 to 16 tokens (SLICES above): grid (N / 64, ceil(M / 16), zsplit), block 32 * splits, dynamic
// shared memory splitk_slots(splits) * 4 KiB.
extern "C" __global__ void __launch_bounds__(512)
    qserve_w4a8_gemm16(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight, const qk_half* s1,
                       const qk_half* szero, const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k,
                       int group, int splits, int zsplit, int32_t* sums, int32_t* arrived) {
  qserve_gemm_at<true, 1, 2>(x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group, splits, zsplit, sums,
                             arrived);
}
extern "C" __global__ void __launch_bounds__(512)
    qserve_w4a8_gemm_pc16(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight,
                          const qk_half* s1, const qk_half* szero, const int8_t* s2, const int8_t* z2, qk_half* out,
                          int m, int n, int k, int group, int splits, int zsplit, int32_t* sums, int32_t* arrived) {
  qserve_gemm_at<false, 1, 2>(x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group, splits, zsplit, sums,
                              arrived);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// The same with the tile's zsplit = Z blocks one thread-block cluster, meeting in the leader's shared memory
// (splitk_cluster; `sums` and `arrived` unused), dynamic shared memory (splitk_slots(splits) + Z - 1) * 2 KiB.
#define QK_QSERVE_CLUSTER(NAME, GROUPED, Z)                                                                            \
  extern "C" __global__ void __launch_bounds__(512) __cluster_dims__(1, 1, Z)                                          \
      NAME(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight, const qk_half* s1,             \
           const qk_half* szero, const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k, int group,     \
           int splits, int zsplit, int32_t* sums, int32_t* arrived) {                                                  \
    qserve_gemm_at<GROUPED, Z>(x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group, splits, zsplit, sums,     \
                               arrived);                                                                               \
  }
QK_QSERVE_CLUSTER(qserve_w4a8_gemm_z2, true, 2)
QK_QSERVE_CLUSTER(qserve_w4a8_gemm_z4, true, 4)
QK_QSERVE_CLUSTER(qserve_w4a8_gemm_pc_z2, false, 2)
QK_QSERVE_CLUSTER(qserve_w4a8_gemm_pc_z4, false, 4)
#endif

#if defined(QK_WGMMA)
// The bulk decode kernel (Hopper): grid (N / 32, ceil(M / 16), zsplit), block 32 * splits, as qserve_w4a8_gemm, but
// copy i = blockIdx.z splits + c of a tile's splits zsplit takes the contiguous K steps [i S / copies, (i + 1) S /
// copies) (S = K / 32), fetched by bulk copies into `slots` slots of `chunk` steps each (QServeBulk). Dynamic shared
// memory: the split-K partials ((splits - 1) * 2 KiB), then 8 bytes of mbarrier per slot of every warp (rounded up
// to 16), then each warp's slots.
extern "C" __global__ void __launch_bounds__(512)
    qserve_w4a8_bulk(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight, const qk_half* s1,
                     const qk_half* szero, const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k,
                     int group, int splits, int zsplit, int32_t* sums, int32_t* arrived, int chunk, int slots) {
  const qk::QServeArgs args{x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group};
  const int lane = threadIdx.x % 32, copy = threadIdx.x / 32, nt = blockIdx.x, mt = blockIdx.y;
  const qk::QServeBulk layout{chunk, qk::imin(16, m), s2 != nullptr};
  int32_t acc[4][4] = {};
  bulk_steps(
      splits, zsplit, 2048, slots, layout.slot_bytes(), chunk, k / 32,
      [&](int s0, int cnt, auto&& emit) { layout.copies(args, mt, nt, s0, cnt, emit); },
      [&](int s0, int u, const uint8_t* slot) {
        uint32_t fa[4], w[4], sc, z, fb[4][2];
        layout.load_a(args, slot, mt, u, lane, fa);
        layout.load_b(args, slot, s0, u, lane, w, sc, z);
        qk::unpack_b(args, w, sc, z, fb);
#pragma unroll
        for (int nb = 0; nb < 4; ++nb) mma_s8(acc[nb], fa, fb[nb]);
      });
  if (!splitk_reduce<16>(&acc[0][0], lane, copy, 32, splits)) return;
  if (!splitk_blocks<16>(&acc[0][0], lane, zsplit, sums, arrived)) return;
  for (int nb = 0; nb < 4; ++nb) qk::store(args, mt, nt, nb, lane, acc[nb]);
}
#endif

// The large-M path: grid (N / 128, ceil(M / 128)), block 256, dynamic shared memory 4 stages of
// QServeTiled::STAGE_BYTES (N % 128 == 0, K % 64 == 0; groups of 32, 64 or 128). Two blocks an SM: 128 registers at
// most, which the kernel fits with no spill (left to itself, ptxas took 140, one block an SM).
// The large-M kernels serve both variants. One branch at entry, on which the arguments are, so that each path is
// compiled with its group tensors known to be there or known null (and t_x, s1_szeros the other way round), where
// every step of one path for both tested them.
template <class Run>
__device__ __forceinline__ void qserve_variant(const int8_t* x, const float* s_x, const float* t_x,
                                               const uint8_t* qweight, const qk_half* s1, const qk_half* szero,
                                               const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k,
                                               int group, Run run) {
  if (s2 != nullptr) {
    __builtin_assume(z2 != nullptr);
    run(qk::QServeArgs{x, s_x, nullptr, qweight, s1, nullptr, s2, z2, out, m, n, k, group});
  } else {
    __builtin_assume(szero != nullptr && t_x != nullptr);
    run(qk::QServeArgs{x, s_x, t_x, qweight, s1, szero, nullptr, nullptr, out, m, n, k, 0});
  }
}

extern "C" __global__ void __launch_bounds__(256, 2) qserve_w4a8_tiled(
    const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight, const qk_half* s1,
    const qk_half* szero, const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k, int group) {
  qserve_variant(x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group,
                 [](const qk::QServeArgs& args) { tiled_gemm<qk::QServeTiled>(args); });
}

#if defined(QK_WGMMA)
// The Hopper path (sm_90a): grid (N / 128, ceil(M / 128)), block 256, dynamic shared memory QK_WGMMA_STAGES (5)
// stages of WgmmaTiles<QServeWgmma>::STAGE_BYTES plus 1 KiB of alignment slack (N % 128 == 0, K % 64 == 0).
extern "C" __global__ void __launch_bounds__(256) qserve_w4a8_wgmma(
    const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight, const qk_half* s1,
    const qk_half* szero, const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k,
    int group QK_X_MAP_PARAM) {
  qserve_variant(x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group,
                 [=](const qk::QServeArgs& args) { wgmma_gemm<qk::QServeWgmma>(args, QK_X_MAP); });
}
// The same on 256 channels a block: grid (N / 256, ceil(M / 128)), block 512, stages of
// WgmmaTiles<QServeWgmma, 2>::STAGE_BYTES (N % 256 == 0).
extern "C" __global__ void __launch_bounds__(512) qserve_w4a8_wgmma2(
    const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight, const qk_half* s1,
    const qk_half* szero, const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k,
    int group QK_X_MAP_PARAM) {
  qserve_variant(x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group,
                 [=](const qk::QServeArgs& args) { wgmma_gemm<qk::QServeWgmma, 2>(args, QK_X_MAP); });
}
// The same on 256 tokens a block: grid (N / 128, ceil(M / 256)), block 256, one block an SM (128 accumulators a
// thread), stages of WgmmaTiles<QServeWgmma, 1, 2>::STAGE_BYTES; QK_WGMMA_TALL_GROUP_STAGES of them per group.
// Under QK_WGMMA_STREAMK: a one-dimensional grid of the (N / 128) ceil(M / 256) tiles, those from `streamk_from` on
// split in two along K (wgmma_tall_gemm; the tail's partial sums and flags, zeros, null where none is split).
extern "C" __global__ void __launch_bounds__(256, 1) qserve_w4a8_wgmma_tall(
    const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight, const qk_half* s1,
    const qk_half* szero, const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k, int group
    QK_STREAMK_PARAMS QK_X_MAP_PARAM) {
  qserve_variant(x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group, [=](const qk::QServeArgs& args) {
    wgmma_tall_gemm<qk::QServeWgmma>(args, args.s2 != nullptr, QK_X_MAP, QK_STREAMK);
  });
}
#endif
#endif
