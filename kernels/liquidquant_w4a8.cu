// LiquidQuant W4A8 GEMM on quantkit's `liquidquant` layout "lqq_dual64" (quantkit/formats/liquidquant.py,
// digest-liquidgemm-qqq §A3): out[M, N] (fp16) = fp16((acc * s1[n]) * s_x[m]), acc = sum_k W8[n, k] x_int8[m, k].
//
// The weights are the MMA's A operand (16 output channels x 32 k per mma.m16n8k32), the activations its B operand
// (32 k x 8 tokens). The 4 warps of a 64 x 64 weight block share its K step: thread t makes one
// 128-bit load of bytes 16t.. of the block and holds four registers, register 2j + h with the codes of row
// r_h = 16 w + g (+ 8 for h = 1) at k = 32 j + 4 q + e (low nibbles) and 32 j + 16 + 4 q + e (high nibbles). Each
// register becomes eight INT8 weights with LiquidQuant's five integer instructions (Eq. 12): two masks, one IMAD
// per four lanes (u * s + a with a = 128 + min of the row's group) and one XOR 0x80808080. The low and high
// results of registers 2j and 2j + 1 are exactly the A fragment {a0, a1, a2, a3} of MMA j.
// Each warp computes 16 channels x 32 tokens (four n8 blocks; one, with twice the loads in flight, up to 8 tokens);
// a small-M block holds `splits` copies of QK_LQQ_TILE_WARPS of those warps (lqq_tile: one, grid (N / 16,
// ceil(M / 32))), each copy taking every splits-th K step with several steps' loads in flight, and their int32
// accumulators meet in shared memory before the epilogue (split-K, qk_common.cuh: bit-identical).
// quantkit's warp simulator runs the same functions.
#include "qk_common.cuh"

namespace qk {

struct LiquidArgs {
  const int8_t* x;         // [M, K] per-token INT8 activations
  const float* s_x;        // [M]
  const uint8_t* qweight;  // [N/64, K/64, 2048]
  const uint8_t* s2a;      // [N/64, K/64, 64, 2]: step s, byte a = 128 + min
  const qk_half* s1;       // [N]
  qk_half* out;            // [M, N]
  int m, n, k;
};

// u * s + a on four byte lanes with one 32-bit multiply-add (`a4`: byte a in all four lanes, a * 0x01010101), then
// the carry-free "- 128" (the XOR).
QK_FN uint32_t lqq_lanes(uint32_t codes, uint32_t s, uint32_t a4) { return (codes * s + a4) ^ 0x80808080u; }

// Thread t's 16 bytes of the block (nt, kt) (one 128-bit load) and the step s and byte a of its rows
// 16 w + g (+ 8 for h = 1): sa[h] = s | a << 8, the row's two bytes as one 16-bit load (little-endian).
QK_FN void load_weights_at(const uint8_t* block, const uint8_t* params, int t, uint32_t r[4], uint32_t sa[2]) {
  load_u128(block + 16 * t, r);
  for (int h = 0; h < 2; ++h) sa[h] = load_u16(params + 2 * (16 * (t / 32) + frag_group(t % 32) + 8 * h));
}

// Those of block (nt, kt) as stored.
QK_FN void load_weights_raw(const LiquidArgs& a, int nt, int kt, int t, uint32_t r[4], uint32_t sa[2]) {
  const size_t block = (size_t)nt * (a.k / 64) + kt;
  load_weights_at(a.qweight + block * 2048, a.s2a + block * 128, t, r, sa);
}

// Those bytes -> the thread's A fragments: frag[j] for MMA j (k 32 j .. 32 j + 31) of its warp's 16 rows.
QK_FN void unpack_weights(const uint32_t r[4], const uint32_t sa[2], uint32_t frag[2][4]) {
  for (int h = 0; h < 2; ++h) {
    const uint32_t s = sa[h] & 0xFFu, off = prmt(sa[h], 0, 0x1111u);  // a in every byte lane: one byte permute
    for (int j = 0; j < 2; ++j) {
      frag[j][h] = lqq_lanes(lo_nibbles(r[2 * j + h]), s, off);      // a0 / a1: k 4q + e
      frag[j][2 + h] = lqq_lanes(hi_nibbles(r[2 * j + h]), s, off);  // a2 / a3: k 16 + 4q + e
    }
  }
}

// The lane's activation row of token block tb: token 8 tb + g (past M: the last; act_row), at its column 4q.
QK_FN const uint8_t* token_row(const LiquidArgs& a, int tb, int lane) {
  return act_row(a.x, a.m, a.k, 8 * tb + frag_group(lane), 4 * frag_quad(lane));
}

// The lane's B fragment (activations) from that row for MMA j of K step kt: k 4q.. and 16 + 4q...
QK_FN void load_tokens(const uint8_t* row, int kt, int j, uint32_t frag[2]) {
  for (int i = 0; i < 2; ++i) frag[i] = load_u32(row + 64 * kt + 32 * j + 16 * i);
}

// The same from the kernel arguments, zero past M (the four-block kernel, which has no registers to hold its rows).
QK_FN void load_tokens_checked(const LiquidArgs& a, int tb, int kt, int j, int lane, uint32_t frag[2]) {
  const int token = 8 * tb + frag_group(lane), q = frag_quad(lane);
  for (int i = 0; i < 2; ++i) {
    frag[i] = token < a.m
        ? load_u32(reinterpret_cast<const uint8_t*>(a.x) + (size_t)token * a.k + 64 * kt + 32 * j + 16 * i + 4 * q)
        : 0u;
  }
}

// A small-M block covers `warps` (4, or 1) of the four warps of a 64-channel block, each with its 16 channels: its
// thread `local` is thread t of block nt's 128 (rows 16 (t / 32) + g ..). One warp a block gives N / 16 blocks, so
// that a narrow N (N = 4096: 64 blocks of 64 channels) still fills every SM. With `slices` 16-channel slices a warp
// (liquidquant_w4a8_gemm16 under QK_LQQ16_SLICES), the warp's slice s is slice slices w + s among the N / 16, w the
// warp's index among the N / (16 slices), and t is the thread of that slice.
// The small-M kernels' warps a block: QK_LQQ_TILE_WARPS, a compile-time knob for tuning on a GPU (4 in every H200
// run; on an H100 four took 0.98-1.63x one's time, bench/results/kernels_h100_smallm_tune.json). It changes no bit
// of any output.
#ifndef QK_LQQ_TILE_WARPS
#define QK_LQQ_TILE_WARPS 1
#endif
// The 16-channel slices a warp of liquidquant_w4a8_gemm16 computes (below, at that kernel).
#ifndef QK_LQQ16_SLICES
#define QK_LQQ16_SLICES 2
#endif
QK_FN void lqq_tile(int block, int local, int warps, int& nt, int& t, int slices = 1, int s = 0) {
  const int first = slices * (block * warps + local / 32);  // the warp's first slice among the N / 16
  nt = first / 4;
  t = 32 * (first % 4 + s) + local % 32;  // slices divides 4: the warp's slices share block nt
}
// The small-M kernels' K steps a round (pipelined_steps) for TB token blocks a tile and `slices` slices a warp: up to
// 8 tokens QK_LQQ_AHEAD (by default QK_SMALLM_AHEAD; bench/smallm_tune.py's LQQ-A10 takes 10), two blocks 3/4 of
// QK_SMALLM_AHEAD with one slice and half with two, four blocks half (their activations take registers too; the
// kernels below say what each costs). The warp simulator's twins walk their steps in the same rounds.
#ifndef QK_LQQ_AHEAD
#define QK_LQQ_AHEAD QK_SMALLM_AHEAD
#endif
QK_FN constexpr int lqq_ahead(int tb, int slices) {
  return tb == 1 ? QK_LQQ_AHEAD : tb == 2 ? (slices == 1 ? 3 * QK_SMALLM_AHEAD / 4 : QK_SMALLM_AHEAD / 2)
                                          : (QK_SMALLM_AHEAD + 1) / 2;
}

// The lane's accumulators of token block tb: c0, c1 at channel g, tokens 2q, 2q + 1; c2, c3 at channel g + 8, each
// output value(acc, i, token, channel) for its accumulator i.
template <class Value>
QK_FN void store_by(const LiquidArgs& a, int nt, int tb, int t, const int32_t acc[4], Value value) {
  const int lane = t % 32, g = frag_group(lane), q = frag_quad(lane);
  for (int i = 0; i < 4; ++i) {
    const int channel = 64 * nt + 16 * (t / 32) + g + 8 * (i >> 1), token = 8 * tb + 2 * q + (i & 1);
    if (token < a.m) a.out[(size_t)token * a.n + channel] = value(acc[i], i, token, channel);
  }
}
// ... with the epilogue's parameters loaded where they are used.
QK_FN void store(const LiquidArgs& a, int nt, int tb, int t, const int32_t acc[4]) {
  store_by(a, nt, tb, t, acc, [&](int32_t v, int, int token, int channel) {
    return epilogue(v, half_to_float(a.s1[channel]), a.s_x[token]);
  });
}

// The same lane's epilogue parameters, loaded ahead (QK_EPILOGUE_EARLY, the one-token-block kernel; under
// QK_EPILOGUE_MID the others, once their K loop is done): s1 of its channels g (low half) and g + 8, s_x of its tokens
// 2q and 2q + 1 (past M, the last token's: never stored).
struct LiquidEpilogue {
  uint32_t s1;
  float s_x[2];
};
QK_FN LiquidEpilogue epilogue_params(const LiquidArgs& a, int nt, int tb, int t) {
  const int lane = t % 32, channel = 64 * nt + 16 * (t / 32) + frag_group(lane), token = 8 * tb + 2 * frag_quad(lane);
  LiquidEpilogue e{};
  e.s1 = (uint32_t)load_u16(a.s1 + channel) | ((uint32_t)load_u16(a.s1 + channel + 8) << 16);
  for (int i = 0; i < 2; ++i) e.s_x[i] = load_f32(a.s_x + imin(token + i, a.m - 1));
  return e;
}
// store's outputs from them: the same arithmetic, so the same bits.
QK_FN void store_with(const LiquidArgs& a, const LiquidEpilogue& e, int nt, int tb, int t, const int32_t acc[4]) {
  store_by(a, nt, tb, t, acc, [&](int32_t v, int i, int, int) {
    return epilogue(v, half_to_float((qk_half)(e.s1 >> (16 * (i >> 1)))), e.s_x[i & 1]);
  });
}

// The bulk decode kernel's slot (liquidquant_w4a8_bulk8, Hopper, up to 8 tokens): a chunk of up to `chunk` K steps
// of one warp's 16 channels (n16: rows 16 (n16 % 4) .. of 64-channel block n16 / 4), from the stored tensors: per
// step the warp's 512 bytes of the weight block and its 32 bytes of step and offset bytes, and each token's
// activations over the chunk in one run (64 bytes a step; a row every 64 chunk + 16 bytes, so that a fragment's
// eight rows fall in distinct banks).
struct LiquidBulk {
  int chunk, rows;  // rows: the activation rows a slot holds, min(8, M)

  QK_FN int row_bytes() const { return 64 * chunk + 16; }
  QK_FN int param_offset() const { return 512 * chunk; }
  QK_FN int token_offset() const { return param_offset() + 32 * chunk; }
  QK_FN int slot_bytes() const { return token_offset() + rows * row_bytes(); }

  // emit(offset in the slot, source, bytes) for each copy of steps [s0, s0 + cnt) of 16-channel tile n16.
  template <class Emit>
  QK_FN void copies(const LiquidArgs& a, int n16, int s0, int cnt, Emit&& emit) const {
    for (int u = 0; u < cnt; ++u) {
      const size_t block = (size_t)(n16 / 4) * (a.k / 64) + s0 + u;
      emit(512 * u, a.qweight + block * 2048 + 512 * (n16 % 4), 512);
      emit(param_offset() + 32 * u, a.s2a + block * 128 + 32 * (n16 % 4), 32);
    }
    for (int r = 0; r < rows && r < a.m; ++r)
      emit(token_offset() + r * row_bytes(), a.x + (size_t)r * a.k + 64 * s0, 64 * cnt);
  }
  // The lane's weight bytes and group parameters of step s0 + u (load_weights_raw's for its warp, from the slot).
  QK_FN void load_weights(const uint8_t* slot, int u, int lane, uint32_t r[4], uint32_t sa[2]) const {
    load_weights_at(slot + 512 * u, slot + param_offset() + 32 * u, lane, r, sa);
  }
  // The lane's B fragment of MMA j of step s0 + u (load_tokens' for token block 0, from the slot).
  QK_FN void load_tokens(const LiquidArgs& a, const uint8_t* slot, int u, int j, int lane, uint32_t frag[2]) const {
    const int token = frag_group(lane), q = frag_quad(lane);
    for (int i = 0; i < 2; ++i)
      frag[i] = token < a.m ? load_u32(slot + token_offset() + token * row_bytes() + 64 * u + 32 * j + 16 * i + 4 * q)
                            : 0u;
  }
};

// The large-M path: a block of 8 warps computes 128 channels x 128 tokens, 4 x 2 warps of 32 channels (two m16
// slices, rows 16 w .. of a 64 x 64 weight block) x 64 tokens (eight n8 blocks), K in steps of 64 staged in shared
// memory 4 deep (qk_common.cuh tiled_gemm; BN counts channels, BM tokens). A stage holds the swizzled activations
// [128, 64] (the B operands, two n8 blocks per ldmatrix.x4) and the block's two 64 x 64 weight blocks and their
// 128 bytes of group parameters, as stored.
struct LiquidTiled {
  static constexpr int BM = 128, BN = 128, BK = 64, STAGES = 4, THREADS = 256, WARPS_C = BN / 32;
  static constexpr int W_OFF = BM * BK, P_OFF = W_OFF + BN / 64 * 2048, STAGE_BYTES = P_OFF + BN / 64 * 128;
  struct Acc { int32_t c[2][8][4]; };  // [m16 slice][n8 token block][4]

  QK_FN static int steps(const LiquidArgs& a) { return a.k / BK; }

  QK_FN static void copy_stage(const LiquidArgs& a, uint8_t* stage, int m0, int n0, int kt, int tid) {
    copy_activations<BM, BK, THREADS>(stage, a.x, a.m, a.k, m0, kt, tid);
    copy_weights<THREADS>(a, stage, n0, kt, tid);
  }
  // The stage's weights of channels n0 .. n0 + BN - 1 and their step and offset bytes (from W_OFF on), THREADS
  // copying.
  template <int COPIERS>
  QK_FN static void copy_weights(const LiquidArgs& a, uint8_t* stage, int n0, int kt, int tid) {
    const size_t block = (size_t)(n0 / 64) * (a.k / 64) + kt;
    copy_runs<BN / 64, 2048, COPIERS>(stage + W_OFF, a.qweight + block * 2048, (size_t)(a.k / 64) * 2048, tid);
    copy_runs<BN / 64, 128, COPIERS>(stage + P_OFF, a.s2a + block * 128, (size_t)(a.k / 64) * 128, tid);
  }

  // Warp (wt, wc) = (warp / 4, warp % 4): weight block wc / 2, its rows 16 w .. for w = 2 (wc % 2) + slice.
  QK_FN static int slice_thread(int warp, int slice, int lane) { return 32 * (2 * (warp % WARPS_C % 2) + slice) + lane; }

  // The lane's A fragments (weights) of both k halves of the stage, for m16 slice `slice`.
  QK_FN static void load_a(const uint8_t* stage, int warp, int slice, int lane, uint32_t fa[2][4]) {
    const int block = warp % WARPS_C / 2;
    uint32_t r[4], sa[2];
    load_weights_at(stage + W_OFF + block * 2048, stage + P_OFF + block * 128, slice_thread(warp, slice, lane), r, sa);
    unpack_weights(r, sa, fa);
  }

  // The ldmatrix.x4 of token blocks 2 p and 2 p + 1 at k half j: tokens 64 wt + 16 p ...
  QK_FN static int b_row(int warp, int p, int j, int lane) {
    return ldsm_b_row<BK>(64 * (warp / WARPS_C) + 16 * p, 2 * j, lane);
  }

  QK_FN static void store(const LiquidArgs& a, int m0, int n0, int warp, int lane, const Acc& acc) {
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
      for (int tb = 0; tb < 8; ++tb)
        qk::store(a, n0 / 64 + warp % WARPS_C / 2, m0 / 8 + 8 * (warp / WARPS_C) + tb, slice_thread(warp, s, lane),
                  acc.c[s][tb]);
  }

#ifndef QK_HOST
  __device__ __forceinline__ static void compute(const LiquidArgs&, const uint8_t* stage, int, int, int, int warp,
                                                 int lane, Acc& acc) {
    uint32_t fa[2][2][4];
#pragma unroll
    for (int s = 0; s < 2; ++s) load_a(stage, warp, s, lane, fa[s]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        uint32_t b[4];
        ldsm_x4(b, stage + b_row(warp, p, j, lane));
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          mma_s8(acc.c[s][2 * p], fa[s][j], b);
          mma_s8(acc.c[s][2 * p + 1], fa[s][j], b + 2);
        }
      }
    }
  }
#endif
};

// The Hopper path (qk_common.cuh WgmmaTiles, LiquidTiled's stages): warpgroup wg computes weight block wg, its
// thread t holding rows 16 (t / 32) + g (+ 8) exactly as the 128 threads of the small-M kernel's block do, so its
// two A fragments are unpack_weights' frag[0] and frag[1], with no byte of the block loaded twice.
struct LiquidWgmma {
  using Args = LiquidArgs;
  using Tiled = LiquidTiled;

  QK_FN static void load_a(const LiquidArgs&, const uint8_t* stage, int warp, int lane, uint32_t fa[2][4]) {
    const int block = warp / 4;
    uint32_t r[4], sa[2];
    load_weights_at(stage + Tiled::W_OFF + block * 2048, stage + Tiled::P_OFF + block * 128, 32 * (warp % 4) + lane,
                    r, sa);
    unpack_weights(r, sa, fa);
  }
  QK_FN static qk_half out_value(const LiquidArgs& a, int32_t acc, int token, int channel) {
    return epilogue(acc, half_to_float(a.s1[channel]), a.s_x[token]);
  }
};

}  // namespace qk

#ifndef QK_HOST
// The small-M kernels: block (x, y) is `splits` copies of `warps` warps (lqq_tile: 4, the whole 64-channel block x,
// or 1, the 16 channels 16 x ..), each warp computing its 16 channels for TB token blocks of 8 (tokens 8 TB y ..),
// AHEAD K steps' loads in flight a round. Its K steps are 64 columns wide, so a thread's 16 bytes of weights a step
// are a QServe thread's of a 32-column step. With SLICES = 2 a warp computes 32 channels, two 16-channel slices of
// one 64-channel block, from one load of the activations (grid N / (32 warps)): the activations a warp re-reads per
// weight byte halve (a 16-channel warp at 16 tokens loads 1 KiB of them a step beside its 512 bytes of weights).
template <int TB, int SLICES = 1>
__device__ __forceinline__ void liquidquant_gemm_at(const qk::LiquidArgs& args, int splits) {
  static_assert(SLICES == 1 || SLICES == 2, "one or two 16-channel slices a warp");
  constexpr int warps = QK_LQQ_TILE_WARPS;
  const int local = threadIdx.x % (32 * warps), copy = threadIdx.x / (32 * warps), tb0 = TB * blockIdx.y;
  int nt, t[SLICES];
#pragma unroll
  for (int s = 0; s < SLICES; ++s) qk::lqq_tile(blockIdx.x, local, warps, nt, t[s], SLICES, s);
  struct Stage { uint32_t r[SLICES][4], sa[SLICES][2], b[TB][2][2]; };
  // token blocks of this tile with a token below M (1 for decode): at least the first, as the grid has no tile without
  // one, so that block is never tested (a test made each K step of the one-block kernel a branch of its own)
  const int blocks = (args.m - 8 * tb0 + 7) / 8;
  int32_t acc[SLICES][TB][4] = {};
  constexpr bool early = QK_EPILOGUE_EARLY && TB == 1 && SLICES == 1, mid = QK_EPILOGUE_MID && !early;
  qk::LiquidEpilogue epi[SLICES][TB]{};
  if (early && copy == 0) epi[0][0] = qk::epilogue_params(args, nt, tb0, t[0]);
  // up to 2 token blocks each lane's rows made once (4 blocks: checked per load; 4 row pointers, or 32-bit offsets,
  // held across the loop spilled)
  const uint8_t* rows[TB];
#pragma unroll
  for (int tb = 0; tb < TB; ++tb) rows[tb] = TB <= 2 ? qk::token_row(args, tb0 + tb, t[0] % 32) : nullptr;
  splitk_begin<4 * TB * SLICES, QK_SPLITK_RED>(local, copy, 32 * warps, splits);
  pipelined_steps<qk::lqq_ahead(TB, SLICES), Stage>(
      copy, splits, args.k / 64,
      [&](int kt, Stage& st) {
#pragma unroll
        for (int s = 0; s < SLICES; ++s) qk::load_weights_raw(args, nt, kt, t[s], st.r[s], st.sa[s]);
#pragma unroll
        for (int tb = 0; tb < TB; ++tb)
          if (tb == 0 || tb < blocks)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              if (TB <= 2) qk::load_tokens(rows[tb], kt, j, st.b[tb][j]);
              else qk::load_tokens_checked(args, tb0 + tb, kt, j, t[0] % 32, st.b[tb][j]);
            }
      },
      [&](int, const Stage& st) {
#pragma unroll
        for (int s = 0; s < SLICES; ++s) {
          uint32_t fa[2][4];
          qk::unpack_weights(st.r[s], st.sa[s], fa);
#pragma unroll
          for (int tb = 0; tb < TB; ++tb)  // blocks past M would only multiply zeros into sums never stored
            if (tb == 0 || tb < blocks)
#pragma unroll
              for (int j = 0; j < 2; ++j) mma_s8(acc[s][tb], fa[j], st.b[tb][j]);
        }
      });
  if (mid && copy == 0) {  // in flight while the copies meet
#pragma unroll
    for (int s = 0; s < SLICES; ++s)
#pragma unroll
      for (int tb = 0; tb < TB; ++tb) epi[s][tb] = qk::epilogue_params(args, nt, tb0 + tb, t[s]);
  }
  if (!splitk_reduce<4 * TB * SLICES, QK_SPLITK_RED>(&acc[0][0][0], local, copy, 32 * warps, splits)) return;
#pragma unroll
  for (int s = 0; s < SLICES; ++s)
    for (int tb = 0; tb < TB; ++tb) {
      if (early || mid) qk::store_with(args, epi[s][tb], nt, tb0 + tb, t[s], acc[s][tb]);
      else qk::store(args, nt, tb0 + tb, t[s], acc[s][tb]);
    }
  QK_STAMP(QK_T_STORED);
}

// warps = QK_LQQ_TILE_WARPS. grid (N / (16 warps), ceil(M / 32)), block 32 warps splits, dynamic shared memory
// splitk_slots(splits) * warps * 2 KiB: 4 token blocks, half QK_SMALLM_AHEAD steps a round (the four blocks'
// activations take registers too).
extern "C" __global__ void __launch_bounds__(512)
    liquidquant_w4a8_gemm(const int8_t* x, const float* s_x, const uint8_t* qweight, const uint8_t* s2a,
                          const qk_half* s1, qk_half* out, int m, int n, int k, int splits) {
  liquidquant_gemm_at<4>(qk::LiquidArgs{x, s_x, qweight, s2a, s1, out, m, n, k}, splits);
}

// Up to 8 tokens (decode): grid (N / (16 warps), 1), block 32 warps splits, dynamic shared memory
// splitk_slots(splits) * warps * 512 bytes: one token block, QK_LQQ_AHEAD steps a round (by default QK_SMALLM_AHEAD,
// the loads in flight of the other layouts' small-M kernels). It needs 114 registers at 8 steps (ptxas 13.0, sm_90),
// so 10 fit in 128 with no spill (12 spill).
extern "C" __global__ void __launch_bounds__(512)
    liquidquant_w4a8_gemm8(const int8_t* x, const float* s_x, const uint8_t* qweight, const uint8_t* s2a,
                           const qk_half* s1, qk_half* out, int m, int n, int k, int splits) {
  liquidquant_gemm_at<1>(qk::LiquidArgs{x, s_x, qweight, s2a, s1, out, m, n, k}, splits);
}

// Up to 16 tokens, where quantkit.kernels.LIQUIDQUANT_GEMM16 takes it (the default: 0.79-0.99x the four-block kernel's
// time at M = 16 on an H100): grid (N / (16 warps slices), 1), block 32 warps splits, dynamic shared memory
// splitk_slots(splits) * warps * slices * 1 KiB: two token blocks, 3/4 of QK_SMALLM_AHEAD steps a round (125 registers
// at 6; 8 spill). QK_LQQ16_SLICES = 2, the default since H100 tuning run 6 (0.66-0.91x the time of one slice at
// M = 16): 32 channels a warp, from one load of the activations, half QK_SMALLM_AHEAD steps a round (the second slice's
// weights take registers too); 1 is bench/smallm_tune.py's LQQ-S1 (defined beside lqq_tile, where the warp simulator
// reads it too).
extern "C" __global__ void __launch_bounds__(512)
    liquidquant_w4a8_gemm16(const int8_t* x, const float* s_x, const uint8_t* qweight, const uint8_t* s2a,
                            const qk_half* s1, qk_half* out, int m, int n, int k, int splits) {
  liquidquant_gemm_at<2, QK_LQQ16_SLICES>(qk::LiquidArgs{x, s_x, qweight, s2a, s1, out, m, n, k}, splits);
}

#if defined(QK_WGMMA)
// The bulk decode kernel (Hopper, up to 8 tokens): grid (N / 16, 1), block 32 * splits: copy c of a block's warps
// computes the 16 channels 16 blockIdx.x .. (warp blockIdx.x % 4 of a 64-channel block in liquidquant_w4a8_gemm8)
// over the contiguous K steps [c S / splits, (c + 1) S / splits) (S = K / 64), fetched by bulk copies into `slots`
// slots of `chunk` steps each (LiquidBulk; bulk_steps's shared memory, partials 512 bytes a copy).
extern "C" __global__ void __launch_bounds__(512)
    liquidquant_w4a8_bulk8(const int8_t* x, const float* s_x, const uint8_t* qweight, const uint8_t* s2a,
                           const qk_half* s1, qk_half* out, int m, int n, int k, int splits, int chunk, int slots) {
  const qk::LiquidArgs args{x, s_x, qweight, s2a, s1, out, m, n, k};
  const int lane = threadIdx.x % 32, copy = threadIdx.x / 32, n16 = blockIdx.x;
  const qk::LiquidBulk layout{chunk, qk::imin(8, m)};
  int32_t acc[4] = {};
  bulk_steps(
      splits, 1, 512, slots, layout.slot_bytes(), chunk, k / 64,
      [&](int s0, int cnt, auto&& emit) { layout.copies(args, n16, s0, cnt, emit); },
      [&](int, int u, const uint8_t* slot) {
        uint32_t r[4], sa[2], fa[2][4], fb[2];
        layout.load_weights(slot, u, lane, r, sa);
        qk::unpack_weights(r, sa, fa);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          layout.load_tokens(args, slot, u, j, lane, fb);
          mma_s8(acc, fa[j], fb);
        }
      });
  if (!splitk_reduce<4>(acc, lane, copy, 32, splits)) return;
  qk::store(args, n16 / 4, 0, 32 * (n16 % 4) + lane, acc);
}
#endif

// The large-M path: grid (N / 128, ceil(M / 128)), block 256, dynamic shared memory 4 stages of
// LiquidTiled::STAGE_BYTES (N % 128 == 0).
extern "C" __global__ void __launch_bounds__(256) liquidquant_w4a8_tiled(const int8_t* x, const float* s_x,
                                                                         const uint8_t* qweight, const uint8_t* s2a,
                                                                         const qk_half* s1, qk_half* out, int m,
                                                                         int n, int k) {
  tiled_gemm<qk::LiquidTiled>(qk::LiquidArgs{x, s_x, qweight, s2a, s1, out, m, n, k});
}

#if defined(QK_WGMMA)
// The Hopper path (sm_90a): grid (N / 128, ceil(M / 128)), block 256, dynamic shared memory QK_WGMMA_STAGES (5)
// stages of WgmmaTiles<LiquidWgmma>::STAGE_BYTES plus 1 KiB of alignment slack (N % 128 == 0).
extern "C" __global__ void __launch_bounds__(256) liquidquant_w4a8_wgmma(const int8_t* x, const float* s_x,
                                                                         const uint8_t* qweight, const uint8_t* s2a,
                                                                         const qk_half* s1, qk_half* out, int m,
                                                                         int n, int k QK_X_MAP_PARAM) {
  wgmma_gemm<qk::LiquidWgmma>(qk::LiquidArgs{x, s_x, qweight, s2a, s1, out, m, n, k}, QK_X_MAP);
}
// The same on 256 channels a block: grid (N / 256, ceil(M / 128)), block 512, stages of
// WgmmaTiles<LiquidWgmma, 2>::STAGE_BYTES (N % 256 == 0).
extern "C" __global__ void __launch_bounds__(512) liquidquant_w4a8_wgmma2(const int8_t* x, const float* s_x,
                                                                          const uint8_t* qweight, const uint8_t* s2a,
                                                                          const qk_half* s1, qk_half* out, int m,
                                                                          int n, int k QK_X_MAP_PARAM) {
  wgmma_gemm<qk::LiquidWgmma, 2>(qk::LiquidArgs{x, s_x, qweight, s2a, s1, out, m, n, k}, QK_X_MAP);
}
// The same on 256 tokens a block: grid (N / 128, ceil(M / 256)), block 256, one block an SM, stages of
// WgmmaTiles<LiquidWgmma, 1, 2>::STAGE_BYTES (QK_WGMMA_STREAMK: as qserve_w4a8_wgmma_tall).
extern "C" __global__ void __launch_bounds__(256, 1)
    liquidquant_w4a8_wgmma_tall(const int8_t* x, const float* s_x, const uint8_t* qweight, const uint8_t* s2a,
                                const qk_half* s1, qk_half* out, int m, int n, int k QK_STREAMK_PARAMS QK_X_MAP_PARAM) {
  wgmma_tall_gemm<qk::LiquidWgmma>(qk::LiquidArgs{x, s_x, qweight, s2a, s1, out, m, n, k}, false, QK_X_MAP, QK_STREAMK);
}
#endif
#endif
