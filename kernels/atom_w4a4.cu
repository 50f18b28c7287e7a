// Atom W4A4 GEMM with INT8 outliers on the `atom` layout (quantkit/formats/atom.py; Atom's LinearInt4):
// out[M, N] (fp16) = fp16(sum over groups g, in order, outliers last, of float(P_g) * (s_x[m, g] * s_w[g, n])),
// P_g the exact int32 product of group g's codes: INT4 mma.m16n8k64 on each group of 128 normal columns (two MMAs),
// INT8 mma.m16n8k32 on the 128 outlier columns (four MMAs). Each partial is scaled as soon as its group is done
// (Atom's partial-sum dequantization: a float32 accumulator beside the int32 one), in float32 without contraction.
//
// Activations arrive as the producing kernel leaves them: reordered by `reorder_index`, the normal columns as
// two's-complement INT4 (even column in the low nibble) [M, (K - 128) / 2], the outliers INT8 [M, 128], and the
// per-(token, group) scales s_x [M, G + 1]. The activations are the MMA's A operand (16 tokens), the weights its
// B operand read straight from `weight_int4` / `weight_int8` rows (a lane's B register is 4 consecutive bytes of
// one output channel). One warp computes 16 tokens x 16 channels; grid (N / 16, ceil(M / 16)). A straightforward
// correct kernel (no shared-memory staging yet); quantkit's warp simulator runs the same functions.
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

QK_FN uint32_t load_word(const uint8_t* p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// Row r's scale in Atom's fragment layout (the first of its four copies).
QK_FN int atom_scale_slot(int r) { return (r / 16) * 64 + (r % 8) * 8 + (r / 8) % 2; }

// INT4 A fragment of MMA `step` (k 64 step ..) inside group g: rows g0 = group, g0 + 8; k 8 q .. 8 q + 7 and + 32.
QK_FN void load_a4(const AtomArgs& a, int mt, int g, int step, int lane, uint32_t frag[4]) {
  const int row_bytes = (a.k - ATOM_OUTLIERS) / 2, q = frag_quad(lane);
  for (int i = 0; i < 4; ++i) {
    const int row = 16 * mt + frag_group(lane) + 8 * (i & 1);
    const int col = ATOM_GROUP * g + 64 * step + 32 * (i >> 1) + 8 * q;  // in codes; 2 per byte
    frag[i] = row < a.m ? load_word(a.x4 + (size_t)row * row_bytes + col / 2) : 0u;
  }
}

// INT4 B fragment: output channel 16 nt + 8 nb + group, k 8 q .. 8 q + 7 (register 0) and + 32 (register 1).
QK_FN void load_b4(const AtomArgs& a, int nt, int nb, int g, int step, int lane, uint32_t frag[2]) {
  const int row_bytes = (a.k - ATOM_OUTLIERS) / 2;
  const int channel = 16 * nt + 8 * nb + frag_group(lane);
  for (int i = 0; i < 2; ++i) {
    const int col = ATOM_GROUP * g + 64 * step + 32 * i + 8 * frag_quad(lane);
    frag[i] = load_word(a.w4 + (size_t)channel * row_bytes + col / 2);
  }
}

// INT8 A fragment of the outliers' MMA `step` (k 32 step ..): rows group, group + 8; k 4 q .. and 16 + 4 q ...
QK_FN void load_a8(const AtomArgs& a, int mt, int step, int lane, uint32_t frag[4]) {
  for (int i = 0; i < 4; ++i) {
    const int row = 16 * mt + frag_group(lane) + 8 * (i & 1), col = 32 * step + 16 * (i >> 1) + 4 * frag_quad(lane);
    frag[i] = row < a.m ? load_word(reinterpret_cast<const uint8_t*>(a.x8) + (size_t)row * ATOM_OUTLIERS + col) : 0u;
  }
}

QK_FN void load_b8(const AtomArgs& a, int nt, int nb, int step, int lane, uint32_t frag[2]) {
  const int channel = 16 * nt + 8 * nb + frag_group(lane);
  for (int i = 0; i < 2; ++i) {
    const int col = 32 * step + 16 * i + 4 * frag_quad(lane);
    frag[i] = load_word(reinterpret_cast<const uint8_t*>(a.w8) + (size_t)channel * ATOM_OUTLIERS + col);
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

}  // namespace qk

#ifndef QK_HOST
// grid (N / 16, ceil(M / 16)), block 32.
extern "C" __global__ void atom_w4a4_gemm(const uint8_t* x4, const int8_t* x8, const float* s_x, const uint8_t* w4,
                                          const int8_t* w8, const qk_half* scale_int4, const qk_half* scale_int8,
                                          qk_half* out, int m, int n, int k) {
  const qk::AtomArgs args{x4, x8, s_x, w4, w8, scale_int4, scale_int8, out, m, n, k};
  const int lane = threadIdx.x, nt = blockIdx.x, mt = blockIdx.y;
  const int groups = (k - qk::ATOM_OUTLIERS) / qk::ATOM_GROUP;
  float acc_f[2][4] = {};
  for (int g = 0; g <= groups; ++g) {
    int32_t partial[2][4] = {};
    for (int step = 0; step < (g < groups ? 2 : 4); ++step) {
      uint32_t fa[4];
      if (g < groups) qk::load_a4(args, mt, g, step, lane, fa); else qk::load_a8(args, mt, step, lane, fa);
      for (int nb = 0; nb < 2; ++nb) {
        uint32_t fb[2];
        if (g < groups) {
          qk::load_b4(args, nt, nb, g, step, lane, fb);
          mma_s4(partial[nb], fa, fb);
        } else {
          qk::load_b8(args, nt, nb, step, lane, fb);
          mma_s8(partial[nb], fa, fb);
        }
      }
    }
    for (int nb = 0; nb < 2; ++nb) qk::fold(args, mt, nt, nb, g, lane, partial[nb], acc_f[nb]);
  }
  for (int nb = 0; nb < 2; ++nb) qk::store(args, mt, nt, nb, lane, acc_f[nb]);
}
#endif
