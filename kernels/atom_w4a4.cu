// Atom W4A4 GEMM with INT8 outliers on the `atom` layout (quantkit/formats/atom.py; Atom's LinearInt4):
// out[M, N] (fp16) = fp16(sum over groups g, in order, outliers last, of float(P_g) * (s_x[m, g] * s_w[g, n])),
// P_g the exact int32 product of group g's codes: INT4 mma.m16n8k64 on each group of 128 normal columns (two MMAs;
// on Hopper, which has no INT4 tensor cores, each as two INT8 MMAs on 16 times the codes: mma_int4),
// INT8 mma.m16n8k32 on the 128 outlier columns (four MMAs). Each partial is scaled as soon as its group is done
// (Atom's partial-sum dequantization: a float32 accumulator beside the int32 one), in float32 without contraction.
//
// Activations arrive as the producing kernel leaves them: reordered by `reorder_index`, the normal columns as
// two's-complement INT4 (even column in the low nibble) [M, (K - 128) / 2], the outliers INT8 [M, 128], and the
// per-(token, group) scales s_x [M, G + 1]. The activations are the MMA's A operand (16 tokens), the weights its
// B operand read straight from `weight_int4` / `weight_int8` rows.
// Small M (atom_w4a4_gemm): one warp computes 16 tokens x 16 channels, grid (N / 16, ceil(M / 16)), one K step a
// group of 128 INT4 columns or a half of the outliers (64 bytes a row either way: lane (g, q) loads 16 of them a row).
// The block holds `splits` copies of the warp taking turns at the steps, each with QK_ATOM_AHEAD steps' loads in
// flight. A float32 sum depends on its order, so the copies do not fold: each puts its groups' terms
// float(P_g) * (s_x * s_w) in shared memory, and at the end of the round each output's owner adds them in group
// order, the bits of one warp walking every group. quantkit's warp simulator runs the same functions.
#include "qk_common.cuh"

namespace qk {

struct AtomArgs {
  const uint8_t* x4;         // [M, (K - 128) / 2]
  const int8_t* x8;          // [M, 128]
  const float* s_x;          // [M, G + 1]
  const uint8_t* w4;         // weight_int4 [N, (K - 128) / 2]
  const int8_t* w8;          // weight_int8 [N, 128]
  const qk_half* scale_int4; // [G, 4 N], fragment layout
  const qk_half* scale_int8; // [4 N]
  qk_half* out;              // [M, N]
  int m, n, k;
};

constexpr int ATOM_GROUP = 128, ATOM_OUTLIERS = 128;

// Row r's scale in Atom's fragment layout (the first of its four copies).
QK_FN int atom_scale_slot(int r) { return (r / 16) * 64 + (r % 8) * 8 + (r / 8) % 2; }

// ---- The small-M path (atom_w4a4_gemm) ----
// A K step is one INT4 group (its 128 columns) or one half of the 128 INT8 outliers (64 columns), 64 bytes of a row
// either way. Lane (g, q) loads bytes 16 q .. 16 q + 15 of the step's run in each of its rows: tokens 16 mt + g and
// + 8 (x[0], x[1]) and channels 16 nt + g and + 8 (w[0], w[1]), and the step's scales (the outliers' for both
// halves): s_x of its two tokens, and the fp16 pairs of the weight scales of channels (2 q, 8 + 2 q) and
// (2 q + 1, 9 + 2 q), adjacent in Atom's fragment layout (atom_scale_slot): one 32-bit load each. A token past M
// loads the last token's row: an MMA's rows are independent, and no row past M is put in shared memory.
struct AtomStep {
  uint32_t x[2][4], w[2][4], s_w[2];
  float s_x[2];
};

QK_FN int atom_groups(const AtomArgs& a) { return (a.k - ATOM_OUTLIERS) / ATOM_GROUP; }

// A lane's runs of INT4 group 0, as 32-bit offsets from x4, w4, s_x and scale_int4 (fewer registers held through the
// loop; atom_launch checks that they fit): group s is 64 s bytes further, its scales s and 4 N s values.
struct AtomRows {
  uint32_t x[2], w[2], s_x[2], s_w;
};

QK_FN AtomRows atom_rows(const AtomArgs& a, int mt, int nt, int lane) {
  const int groups = atom_groups(a), q = frag_quad(lane), g = frag_group(lane);
  const uint32_t row_bytes = (uint32_t)(a.k - ATOM_OUTLIERS) / 2;
  AtomRows r;
  for (int h = 0; h < 2; ++h) {
    const int token = imin(16 * mt + g + 8 * h, a.m - 1);
    r.x[h] = (uint32_t)token * row_bytes + 16 * q;
    r.w[h] = (uint32_t)(16 * nt + 8 * h + g) * row_bytes + 16 * q;
    r.s_x[h] = (uint32_t)token * (groups + 1);
  }
  r.s_w = 64 * nt + 16 * q;
  return r;
}

// v, as the compiler cannot see through on the device (an empty volatile move), so that the addresses made from it
// are made where they are used: a step's at each load, not as a 64-bit induction pointer for each load of each step
// in flight, and the sums' at a round's end, not hoisted out of the round loop and held through it. Without them
// sm_80 spills at 2 steps in flight; sm_90 takes 126 registers at 3, where 4 took 208 (170 with them).
QK_FN uint32_t atom_opaque(int v) {
  uint32_t u = (uint32_t)v;
#if defined(__CUDA_ARCH__)
  asm volatile("mov.u32 %0, %0;" : "+r"(u));
#endif
  return u;
}

QK_FN void atom_load_group(const AtomArgs& a, const AtomRows& r, int s, AtomStep& st) {
  const uint32_t step = atom_opaque(s);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    load_u128(a.x4 + (r.x[h] + 64 * step), st.x[h]);
    load_u128(a.w4 + (r.w[h] + 64 * step), st.w[h]);
    st.s_x[h] = load_f32(a.s_x + (r.s_x[h] + step));
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) st.s_w[p] = load_u32(a.scale_int4 + (r.s_w + step * 4 * a.n + 8 * p));
}

// Outlier half `half`, and the outliers' scales (which the first half's lanes put in shared memory).
QK_FN void atom_load_outliers(const AtomArgs& a, int mt, int nt, int half, int lane, AtomStep& st) {
  const int groups = atom_groups(a), q = frag_quad(lane), g = frag_group(lane);
  const uint8_t* x8 = reinterpret_cast<const uint8_t*>(a.x8);
  const uint8_t* w8 = reinterpret_cast<const uint8_t*>(a.w8);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int token = imin(16 * mt + g + 8 * h, a.m - 1);
    load_u128(x8 + (size_t)token * ATOM_OUTLIERS + 64 * half + 16 * q, st.x[h]);
    load_u128(w8 + (size_t)(16 * nt + 8 * h + g) * ATOM_OUTLIERS + 64 * half + 16 * q, st.w[h]);
    st.s_x[h] = a.s_x[(size_t)token * (groups + 1) + groups];
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) st.s_w[p] = load_u32(a.scale_int8 + 64 * nt + 16 * q + 8 * p);
}

// The first outlier half copy `copy` of `splits` takes (2 or more: none): the halves are the turns' steps G and G + 1,
// so copy (G + h) % splits takes half h.
QK_FN int atom_first_half(int copy, int groups, int splits) { return ((copy - groups) % splits + splits) % splits; }

// MMA u (0, 1) of a step from its registers: A {x0[2u], x1[2u], x0[2u+1], x1[2u+1]} (tokens g, g + 8), B of n8 block
// nb {w[nb][2u], w[nb][2u+1]}. The step's product is an exact integer sum, so the MMAs may take its columns in any
// order that A and B share: these registers are the same columns on both sides (INT4 m16n8k64, INT8 m16n8k32).
QK_FN void atom_fragments(const AtomStep& st, int u, uint32_t fa[4], uint32_t fb[2][2]) {
  fa[0] = st.x[0][2 * u];
  fa[1] = st.x[1][2 * u];
  fa[2] = st.x[0][2 * u + 1];
  fa[3] = st.x[1][2 * u + 1];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    fb[nb][0] = st.w[nb][2 * u];
    fb[nb][1] = st.w[nb][2 * u + 1];
  }
}

// The block's shared memory, in slots of the tile's rows x 16 outputs (rows = min(16, M - 16 mt)), 4 bytes each:
// a round's per_round terms (float32), then the two outlier halves' products (int32), the outliers' scale and the
// running sums (float32). A slot is written by the lane whose MMA entry it is, and read by the output's owner.
constexpr int ATOM_P0 = 0, ATOM_P1 = 1, ATOM_SCALE = 2, ATOM_SUM = 3, ATOM_EXTRA_SLOTS = 4;
static_assert(ATOM_SUM + 1 == ATOM_EXTRA_SLOTS, "the slots after a round's terms (quantkit.kernels.ATOM_EXTRA_SLOTS)");
QK_FN int atom_slot(int slot, int row, int channel, int rows) { return (slot * rows + row) * 16 + channel; }

// The lane's entry i of n8 block nb: its row of the tile, channel and fp16 weight scale from the step's pairs.
QK_FN int atom_row(int lane, int i) { return frag_group(lane) + 8 * (i >> 1); }
QK_FN int atom_channel(int lane, int nb, int i) { return 8 * nb + 2 * frag_quad(lane) + (i & 1); }
QK_FN float atom_scale(const AtomStep& st, int nb, int i) {
  const uint32_t pair = st.s_w[i & 1];
  return fmul(st.s_x[i >> 1], half_to_float((qk_half)(nb ? pair >> 16 : pair & 0xFFFFu)));
}

// The lane's products of INT4 group s (of the round from group s0) as the terms float(P) * (s_x * s_w), exactly
// the emulation's, so that adding them in group order is its fold.
QK_FN void atom_put_terms(const AtomStep& st, int s, int s0, int rows, int lane, const int32_t partial[2][4],
                          float* smem) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (atom_row(lane, i) < rows)
        smem[atom_slot(s - s0, atom_row(lane, i), atom_channel(lane, nb, i), rows)] =
            fmul((float)partial[nb][i], atom_scale(st, nb, i));
}

// The lane's products of outlier half `half` as they are, and with half 0 the outliers' scales s_x * s_w.
QK_FN void atom_put_outliers(const AtomStep& st, int half, int rows, int per_round, int lane,
                             const int32_t partial[2][4], float* smem) {
  int32_t* products = reinterpret_cast<int32_t*>(smem);
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = atom_row(lane, i), channel = atom_channel(lane, nb, i);
      if (row >= rows) continue;
      products[atom_slot(per_round + (half ? ATOM_P1 : ATOM_P0), row, channel, rows)] = partial[nb][i];
      if (half == 0) smem[atom_slot(per_round + ATOM_SCALE, row, channel, rows)] = atom_scale(st, nb, i);
    }
}

// Thread t of `threads` owns outputs o = t + u threads (u < ATOM_OWN) of the tile's rows x 16: 256 outputs over the
// 32 threads of one copy at most.
constexpr int ATOM_OWN = 8;

// A round's end for thread t's outputs: the running sum (0 in the first round) plus the round's `count` terms in
// group order, kept for the next round; after the last, plus the outliers' term (their halves' products added:
// exact, as the emulation's one product), rounded once to fp16 and stored.
QK_FN void atom_sum(const AtomArgs& a, int mt, int nt, const float* smem, int count, int rows, int per_round,
                    bool first, bool last, int t, int threads, float* sums) {
  const int32_t* products = reinterpret_cast<const int32_t*>(smem);
#pragma unroll
  for (int u = 0; u < ATOM_OWN; ++u) {
    const int o = t + u * threads, row = o / 16, channel = o % 16;
    if (o >= 16 * rows) continue;
    float acc = first ? 0.0f : sums[o];
    for (int j = 0; j < count; ++j) acc = fadd(acc, smem[atom_slot(j, row, channel, rows)]);
    if (!last) {
      sums[o] = acc;
      continue;
    }
    const int32_t p = (int32_t)((uint32_t)products[atom_slot(per_round + ATOM_P0, row, channel, rows)] +
                                (uint32_t)products[atom_slot(per_round + ATOM_P1, row, channel, rows)]);
    acc = fadd(acc, fmul((float)p, smem[atom_slot(per_round + ATOM_SCALE, row, channel, rows)]));
    a.out[(size_t)(16 * mt + row) * a.n + 16 * nt + channel] = float_to_half(acc);
  }
}

// How many INT4 groups a copy has in flight (their loads issued together, pipelined_steps): QK_ATOM_AHEAD, by default
// the most whose 20 words a group fit the 128 registers of a block of 16 warps without spilling (sm_90: 3, 126
// registers, where 4 would take 170; before Hopper, whose INT4 MMA takes more, 2).
#ifndef QK_ATOM_AHEAD
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define QK_ATOM_AHEAD 2
#else
#define QK_ATOM_AHEAD 3
#endif
#endif

// The large-M path: a block of 8 warps computes 128 tokens x 64 channels, 4 x 2 warps of 32 x 32 (the float32
// accumulators beside the int32 ones leave no registers for more), one K step a group (qk_common.cuh tiled_gemm, 4 stages): step g < G stages the group's INT4 codes of the block's tokens and
// channels ([128 or 64, 64 bytes], swizzled, both read by ldmatrix: the activations as A, the weights as B), the
// tokens' scales of the group and the channels' 256 weight scales (their four copies, as stored); steps G and
// G + 1 stage the two halves of the 128 INT8 outliers the same way. Each step runs two MMAs per m16 x n8 tile
// (INT4 k64, or INT8 k32 on the outliers) into int32 partials, which are scaled into the float32 accumulators when
// their group is complete (after every INT4 step, after the second outlier step), in the order of the small-M
// kernel: the same bits.
struct AtomTiled {
  static constexpr int BM = 128, BN = 64, BK = 64, STAGES = 4, THREADS = 256, WARPS_N = BN / 32;
  static constexpr int W_OFF = BM * BK, SX_OFF = W_OFF + BN * BK, SW_OFF = SX_OFF + 4 * BM;
  static constexpr int STAGE_BYTES = SW_OFF + 2 * 4 * BN;
  struct Acc {
    int32_t c[2][4][4];  // [m16 tile][n8 block][4]: the group's exact product
    float f[2][4][4];    // the scaled sum of the groups so far
  };

  QK_FN static int groups(const AtomArgs& a) { return (a.k - ATOM_OUTLIERS) / ATOM_GROUP; }
  QK_FN static int steps(const AtomArgs& a) { return groups(a) + 2; }

  QK_FN static void copy_stage(const AtomArgs& a, uint8_t* stage, int m0, int n0, int kt, int tid) {
    const int G = groups(a), g = kt < G ? kt : G;
    if (kt < G) {
      const size_t row_bytes = (size_t)(a.k - ATOM_OUTLIERS) / 2;
      copy_rows<BM, BK, THREADS>(stage, a.x4, row_bytes, a.m, m0, (size_t)kt * BK, tid);
      copy_rows<BN, BK, THREADS>(stage + W_OFF, a.w4, row_bytes, a.n, n0, (size_t)kt * BK, tid);
    } else {
      copy_rows<BM, BK, THREADS>(stage, a.x8, ATOM_OUTLIERS, a.m, m0, (size_t)(kt - G) * BK, tid);
      copy_rows<BN, BK, THREADS>(stage + W_OFF, a.w8, ATOM_OUTLIERS, a.n, n0, (size_t)(kt - G) * BK, tid);
    }
    for (int r = tid; r < BM; r += THREADS) {
      const float* src = a.s_x + (size_t)(m0 + r < a.m ? m0 + r : 0) * (G + 1) + g;
      copy_async<4>(stage + SX_OFF + 4 * r, src, m0 + r < a.m);
    }
    const qk_half* scales = kt < G ? a.scale_int4 + (size_t)kt * 4 * a.n + 4 * n0 : a.scale_int8 + 4 * n0;
    copy_runs<1, 8 * BN, THREADS>(stage + SW_OFF, reinterpret_cast<const uint8_t*>(scales), 0, tid);
  }

  // Warp (wm, wn) = (warp / 2, warp % 2): tokens 32 wm + 16 i, channels 32 wn + 16 p (two n8 blocks a ldmatrix).
  QK_FN static int a_row(int warp, int i, int kk, int lane) {
    return ldsm_a_row<BK>(32 * (warp / WARPS_N) + 16 * i, 2 * kk, lane);
  }
  QK_FN static int b_row(int warp, int p, int kk, int lane) {
    return W_OFF + ldsm_b_row<BK>(32 * (warp % WARPS_N) + 16 * p, 2 * kk, lane);
  }
  QK_FN static bool folds_after(const AtomArgs& a, int kt) { return kt < groups(a) || kt == groups(a) + 1; }

  // After step kt (folds_after): acc.f += float(P) * (s_x[token] * s_w[channel]) with the stage's scales, for the
  // lane's entries, P the exact product: acc.c shifted back by QK_INT4_SHIFT after an INT4 group (int4_sum's shift,
  // as a run-time amount: selecting between int4_sum(c) and c took the main loop from 786 to 954 instructions),
  // acc.c as it is after the INT8 outliers; acc.c = 0.
  QK_FN static void fold(const AtomArgs& a, int kt, const uint8_t* stage, int warp, int lane, Acc& acc) {
    const int shift = kt < groups(a) ? QK_INT4_SHIFT : 0;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int nb = 0; nb < 4; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int token = 32 * (warp / WARPS_N) + 16 * i + frag_group(lane) + 8 * (e >> 1);
          const int channel = 32 * (warp % WARPS_N) + 8 * nb + 2 * frag_quad(lane) + (e & 1);
          const float s_x = load_f32(stage + SX_OFF + 4 * token);
          const float s_w = half_to_float(load_u16(stage + SW_OFF + 2 * atom_scale_slot(channel)));
          acc.f[i][nb][e] = fadd(acc.f[i][nb][e], fmul((float)(acc.c[i][nb][e] >> shift), fmul(s_x, s_w)));
          acc.c[i][nb][e] = 0;
        }
  }

  QK_FN static void store(const AtomArgs& a, int m0, int n0, int warp, int lane, const Acc& acc) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int nb = 0; nb < 4; ++nb)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int token = m0 + 32 * (warp / WARPS_N) + 16 * i + frag_group(lane) + 8 * h;
          const int channel = n0 + 32 * (warp % WARPS_N) + 8 * nb + 2 * frag_quad(lane);
          if (token >= a.m) continue;
          const uint32_t y0 = float_to_half(acc.f[i][nb][2 * h]), y1 = float_to_half(acc.f[i][nb][2 * h + 1]);
          store_u32(a.out + (size_t)token * a.n + channel, y0 | (y1 << 16));
        }
  }

#ifndef QK_HOST
  __device__ __forceinline__ static void compute(const AtomArgs& a, const uint8_t* stage, int kt, int, int, int warp,
                                                 int lane, Acc& acc) {
    const bool int4 = kt < groups(a);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t fa[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) ldsm_x4(fa[i], stage + a_row(warp, i, kk, lane));
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        uint32_t b[4];
        ldsm_x4(b, stage + b_row(warp, p, kk, lane));
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          if (int4) {
            mma_int4(acc.c[i][2 * p], fa[i], b);
            mma_int4(acc.c[i][2 * p + 1], fa[i], b + 2);
          } else {
            mma_s8(acc.c[i][2 * p], fa[i], b);
            mma_s8(acc.c[i][2 * p + 1], fa[i], b + 2);
          }
        }
      }
    }
    if (folds_after(a, kt)) fold(a, kt, stage, warp, lane, acc);
  }
#endif
};

}  // namespace qk

#ifndef QK_HOST
// A step's int32 products (INT4: two INT4 m16n8k64 MMAs a block of 8 channels, the group's exact sums once both
// are in, int4_sum; else two INT8 m16n8k32).
template <bool INT4>
__device__ __forceinline__ void atom_step_products(const qk::AtomStep& st, int32_t partial[2][4]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    uint32_t fa[4], fb[2][2];
    qk::atom_fragments(st, u, fa, fb);
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      if (INT4) mma_int4(partial[nb], fa, fb[nb]);
      else mma_s8(partial[nb], fa, fb[nb]);
    }
  }
  if (INT4)
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[nb][e] = qk::int4_sum(partial[nb][e]);
}

// grid (N / 16, ceil(M / 16)), block 32 * splits, dynamic shared memory (per_round + 4) * min(M, 16) * 64 bytes. The
// copies of the tile's warp take the steps in turn: copy (G + h) % splits the outliers' half h first (their slots
// outlast the rounds), then in each round of per_round INT4 groups from s0, copy c groups s0 + c, s0 + c + splits,
// ..., QK_ATOM_AHEAD groups' loads together, each group's terms put in the round's slots. At the round's barrier
// every thread adds its outputs' terms in group order: no copy waits for another before the round ends, and the
// float32 sums are the emulation's (one warp folding every group in order).
extern "C" __global__ void __launch_bounds__(512)
    atom_w4a4_gemm(const uint8_t* x4, const int8_t* x8, const float* s_x, const uint8_t* w4, const int8_t* w8,
                   const qk_half* scale_int4, const qk_half* scale_int8, qk_half* out, int m, int n, int k,
                   int splits, int per_round) {
  const qk::AtomArgs args{x4, x8, s_x, w4, w8, scale_int4, scale_int8, out, m, n, k};
  const int lane = threadIdx.x % 32, copy = threadIdx.x / 32, nt = blockIdx.x, mt = blockIdx.y;
  const int groups = qk::atom_groups(args), rows = qk::imin(16, m - 16 * mt);
  extern __shared__ float qk_atom_smem[];
  pipelined_steps<2, qk::AtomStep>(
      qk::atom_first_half(copy, groups, splits), splits, 2,
      [&](int half, qk::AtomStep& st) { qk::atom_load_outliers(args, mt, nt, half, lane, st); },
      [&](int half, const qk::AtomStep& st) {
        int32_t partial[2][4] = {};
        atom_step_products<false>(st, partial);
        qk::atom_put_outliers(st, half, rows, per_round, lane, partial, qk_atom_smem);
      });
  const qk::AtomRows r = qk::atom_rows(args, mt, nt, lane);
  float* sums = qk_atom_smem + qk::atom_slot(per_round + qk::ATOM_SUM, 0, 0, rows);
  for (int s0 = 0;; s0 += per_round) {
    const int end = qk::imin(s0 + per_round, groups);
    pipelined_steps<QK_ATOM_AHEAD, qk::AtomStep>(
        s0 + copy, splits, end, [&](int s, qk::AtomStep& st) { qk::atom_load_group(args, r, s, st); },
        [&](int s, const qk::AtomStep& st) {
          int32_t partial[2][4] = {};
          atom_step_products<true>(st, partial);
          qk::atom_put_terms(st, s, s0, rows, lane, partial, qk_atom_smem);
        });
    __syncthreads();
    qk::atom_sum(args, mt, nt, qk_atom_smem, end - s0, rows, per_round, s0 == 0, end == groups,
                 (int)qk::atom_opaque(threadIdx.x), 32 * splits, sums);
    if (end == groups) return;
    __syncthreads();  // the slots are refilled next round
  }
}

// The large-M path: grid (N / 64, ceil(M / 128)), block 256, dynamic shared memory 4 stages of
// AtomTiled::STAGE_BYTES (N % 64 == 0).
extern "C" __global__ void __launch_bounds__(256) atom_w4a4_tiled(
    const uint8_t* x4, const int8_t* x8, const float* s_x, const uint8_t* w4, const int8_t* w8,
    const qk_half* scale_int4, const qk_half* scale_int8, qk_half* out, int m, int n, int k) {
  tiled_gemm<qk::AtomTiled>(qk::AtomArgs{x4, x8, s_x, w4, w8, scale_int4, scale_int8, out, m, n, k});
}
#endif
