// Atom W4A4 GEMM with INT8 outliers on the `atom` layout (quantkit/formats/atom.py; Atom's LinearInt4):
// out[M, N] (fp16) = fp16(sum over groups g, in order, outliers last, of float(P_g) * (s_x[m, g] * s_w[g, n])),
// P_g the exact int32 product of group g's codes: INT4 mma.m16n8k64 on each group of 128 normal columns (two MMAs;
// on Hopper, which has no INT4 tensor cores, each as two INT8 MMAs on the sign-extended codes: mma_int4),
// INT8 mma.m16n8k32 on the 128 outlier columns (four MMAs). Each partial is scaled as soon as its group is done
// (Atom's partial-sum dequantization: a float32 accumulator beside the int32 one), in float32 without contraction.
//
// Activations arrive as the producing kernel leaves them: reordered by `reorder_index`, the normal columns as
// two's-complement INT4 (even column in the low nibble) [M, (K - 128) / 2], the outliers INT8 [M, 128], and the
// per-(token, group) scales s_x [M, G + 1]. The activations are the MMA's A operand (16 tokens), the weights its
// B operand read straight from `weight_int4` / `weight_int8` rows. One warp computes 16 tokens x 16 channels;
// grid (N / 16, ceil(M / 16)). A group's product is an exact integer sum, so the MMAs may take its columns in any
// order that A and B share: lane (g, q) takes columns 32 q .. 32 q + 31 of the group for every row it serves, one
// 16-byte load per row (32 bytes for the INT8 outliers), and feeds its registers 2 s and 2 s + 1 to MMA step s.
// For small M the block holds `splits` copies of the warp: in each round copy c takes group r splits + c, and
// copy 0 scales the round's int32 products into its float32 sums in group order (the others hand theirs over in
// shared memory), so the bits equal one warp walking every group. quantkit's warp simulator runs the same
// functions.
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

// Lane (g, q)'s bytes of group gi (gi < G: its INT4 codes; gi == G: the 128 INT8 outliers), columns 32 q .. 32 q + 31
// of the group, for the rows it serves: tokens 16 mt + g and + 8 (x[0], x[1]; zero past M) and channels
// 16 nt + 8 nb + g (w[nb]). INT4: 16 bytes a row (registers 0-3), INT8: 32 (registers 0-7).
struct AtomLane {
  uint32_t x[2][8], w[2][8];
};

QK_FN void load_group(const AtomArgs& a, int mt, int nt, int gi, int lane, AtomLane& r) {
  const int groups = (a.k - ATOM_OUTLIERS) / ATOM_GROUP, q = frag_quad(lane), g = frag_group(lane);
  const bool int4 = gi < groups;
  const size_t row_bytes = int4 ? (size_t)(a.k - ATOM_OUTLIERS) / 2 : ATOM_OUTLIERS;
  const size_t col = int4 ? (size_t)ATOM_GROUP / 2 * gi + 16 * q : 32 * q;
  const uint8_t* xs = int4 ? a.x4 : reinterpret_cast<const uint8_t*>(a.x8);
  const uint8_t* ws = int4 ? a.w4 : reinterpret_cast<const uint8_t*>(a.w8);
  for (int h = 0; h < 2; ++h) {
    const int token = 16 * mt + g + 8 * h;
    for (int c = 0; c < (int4 ? 1 : 2); ++c) {
      if (token < a.m) load_u128(xs + (size_t)token * row_bytes + col + 16 * c, r.x[h] + 4 * c);
      else r.x[h][4 * c] = r.x[h][4 * c + 1] = r.x[h][4 * c + 2] = r.x[h][4 * c + 3] = 0u;
      load_u128(ws + (size_t)(16 * nt + 8 * h + g) * row_bytes + col + 16 * c, r.w[h] + 4 * c);
    }
  }
}

// MMA step s's fragments from those registers: A {x0[2s], x1[2s], x0[2s+1], x1[2s+1]} (rows g, g + 8; k halves),
// B of n8 block nb {w[nb][2s], w[nb][2s+1]}. Steps 0-1 (INT4 mma.m16n8k64) or 0-3 (INT8 mma.m16n8k32).
QK_FN void step_fragments(const AtomLane& r, int s, uint32_t fa[4], uint32_t fb[2][2]) {
  fa[0] = r.x[0][2 * s];
  fa[1] = r.x[1][2 * s];
  fa[2] = r.x[0][2 * s + 1];
  fa[3] = r.x[1][2 * s + 1];
  for (int nb = 0; nb < 2; ++nb) {
    fb[nb][0] = r.w[nb][2 * s];
    fb[nb][1] = r.w[nb][2 * s + 1];
  }
}

// acc_f[i] += float(partial[i]) * (s_x[token, g] * s_w[g, channel]) for the lane's four accumulator entries of
// n8 block nb; g == groups means the outliers.
QK_FN void fold(const AtomArgs& a, int mt, int nt, int nb, int g, int lane, const int32_t partial[4], float acc_f[4]) {
  const int groups = (a.k - ATOM_OUTLIERS) / ATOM_GROUP;
  for (int i = 0; i < 4; ++i) {
    const int token = 16 * mt + frag_group(lane) + 8 * (i >> 1);
    const int channel = 16 * nt + 8 * nb + 2 * frag_quad(lane) + (i & 1);
    if (token >= a.m) continue;
    const qk_half s = g < groups ? a.scale_int4[(size_t)g * 4 * a.n + atom_scale_slot(channel)]
                                 : a.scale_int8[atom_scale_slot(channel)];
    const float scale = fmul(a.s_x[(size_t)token * (groups + 1) + g], half_to_float(s));
    acc_f[i] = fadd(acc_f[i], fmul((float)partial[i], scale));
  }
}

QK_FN void store(const AtomArgs& a, int mt, int nt, int nb, int lane, const float acc_f[4]) {
  for (int i = 0; i < 4; ++i) {
    const int token = 16 * mt + frag_group(lane) + 8 * (i >> 1);
    const int channel = 16 * nt + 8 * nb + 2 * frag_quad(lane) + (i & 1);
    if (token < a.m) a.out[(size_t)token * a.n + channel] = float_to_half(acc_f[i]);
  }
}

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

  // acc.f += float(acc.c) * (s_x[token] * s_w[channel]) with the stage's scales, for the lane's entries; acc.c = 0.
  QK_FN static void fold(const uint8_t* stage, int warp, int lane, Acc& acc) {
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
          acc.f[i][nb][e] = fadd(acc.f[i][nb][e], fmul((float)acc.c[i][nb][e], fmul(s_x, s_w)));
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
    if (folds_after(a, kt)) fold(stage, warp, lane, acc);
  }
#endif
};

}  // namespace qk

#ifndef QK_HOST
// Warp's int32 products of group gi for its 16 tokens x 16 channels: partial[nb] of n8 block nb.
__device__ __forceinline__ void atom_group_products(const qk::AtomArgs& a, int mt, int nt, int gi, int lane,
                                                    int32_t partial[2][4]) {
  qk::AtomLane r;
  qk::load_group(a, mt, nt, gi, lane, r);
  const bool int4 = gi < (a.k - qk::ATOM_OUTLIERS) / qk::ATOM_GROUP;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    if (int4 && s >= 2) break;
    uint32_t fa[4], fb[2][2];
    qk::step_fragments(r, s, fa, fb);
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      if (int4) mma_int4(partial[nb], fa, fb[nb]);
      else mma_s8(partial[nb], fa, fb[nb]);
    }
  }
}

// grid (N / 16, ceil(M / 16)), block 32 * splits, dynamic shared memory (splits - 1) KiB: copy c of the warp takes
// groups c, c + splits, ...; per round, copy 0 folds the round's products in group order.
extern "C" __global__ void __launch_bounds__(512)
    atom_w4a4_gemm(const uint8_t* x4, const int8_t* x8, const float* s_x, const uint8_t* w4, const int8_t* w8,
                   const qk_half* scale_int4, const qk_half* scale_int8, qk_half* out, int m, int n, int k,
                   int splits) {
  const qk::AtomArgs args{x4, x8, s_x, w4, w8, scale_int4, scale_int8, out, m, n, k};
  const int lane = threadIdx.x % 32, copy = threadIdx.x / 32, nt = blockIdx.x, mt = blockIdx.y;
  const int groups = (k - qk::ATOM_OUTLIERS) / qk::ATOM_GROUP;
  extern __shared__ int32_t qk_partials[];
  float acc_f[2][4] = {};
  for (int g0 = 0; g0 <= groups; g0 += splits) {
    int32_t partial[2][4] = {};
    if (g0 + copy <= groups) atom_group_products(args, mt, nt, g0 + copy, lane, partial);
    if (splits > 1) {
      if (copy > 0) {
#pragma unroll
        for (int j = 0; j < 8; ++j) qk_partials[qk::splitk_slot(copy, j, lane, 8, 32)] = partial[j / 4][j % 4];
      }
      __syncthreads();
    }
    if (copy == 0) {
      for (int c = 0; c < splits && g0 + c <= groups; ++c) {
        int32_t mine[2][4];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          mine[j / 4][j % 4] = c == 0 ? partial[j / 4][j % 4] : qk_partials[qk::splitk_slot(c, j, lane, 8, 32)];
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) qk::fold(args, mt, nt, nb, g0 + c, lane, mine[nb], acc_f[nb]);
      }
    }
    if (splits > 1) __syncthreads();  // the slots are refilled next round
  }
  if (copy == 0)
    for (int nb = 0; nb < 2; ++nb) qk::store(args, mt, nt, nb, lane, acc_f[nb]);
}

// The large-M path: grid (N / 64, ceil(M / 128)), block 256, dynamic shared memory 4 stages of
// AtomTiled::STAGE_BYTES (N % 64 == 0).
extern "C" __global__ void __launch_bounds__(256) atom_w4a4_tiled(
    const uint8_t* x4, const int8_t* x8, const float* s_x, const uint8_t* w4, const int8_t* w8,
    const qk_half* scale_int4, const qk_half* scale_int8, qk_half* out, int m, int n, int k) {
  tiled_gemm<qk::AtomTiled>(qk::AtomArgs{x4, x8, s_x, w4, w8, scale_int4, scale_int8, out, m, n, k});
}
#endif
