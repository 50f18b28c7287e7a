// LiquidQuant W4A8 GEMM on quantkit's `liquidquant` layout "lqq_dual64" (quantkit/formats/liquidquant.py,
// digest-liquidgemm-qqq §A3): out[M, N] (fp16) = fp16((acc * s1[n]) * s_x[m]), acc = sum_k W8[n, k] x_int8[m, k].
//
// The weights are the MMA's A operand (16 output channels x 32 k per mma.m16n8k32), the activations its B operand
// (32 k x 8 tokens). A block of 128 threads (4 warps) owns one 64 x 64 weight block per K step: thread t makes one
// 128-bit load of bytes 16t.. of the block and holds four registers, register 2j + h with the codes of row
// r_h = 16 w + g (+ 8 for h = 1) at k = 32 j + 4 q + e (low nibbles) and 32 j + 16 + 4 q + e (high nibbles). Each
// register becomes eight INT8 weights with LiquidQuant's five integer instructions (Eq. 12): two masks, one IMAD
// per four lanes (u * s + a with a = 128 + min of the row's group) and one XOR 0x80808080. The low and high
// results of registers 2j and 2j + 1 are exactly the A fragment {a0, a1, a2, a3} of MMA j.
// Each warp computes 16 channels x 32 tokens (four n8 blocks); grid (N / 64, ceil(M / 32)). For small M the block
// holds `splits` copies of those 4 warps, each copy taking every splits-th K step with four steps' loads in flight,
// and their int32 accumulators meet in shared memory before the epilogue (split-K, qk_common.cuh: bit-identical).
// No shared-memory staging of the operands yet. quantkit's warp simulator runs the same functions.
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

// u * s + a on four byte lanes with one 32-bit multiply-add, then the carry-free "- 128" (the XOR).
QK_FN uint32_t lqq_lanes(uint32_t codes, uint32_t s, uint32_t a) { return (codes * s + a * 0x01010101u) ^ 0x80808080u; }

// Thread t's 16 bytes of the block (nt, kt) (one 128-bit load) and the step s and byte a of its rows
// 16 w + g (+ 8 for h = 1): sa[h] = s | a << 8.
QK_FN void load_weights_raw(const LiquidArgs& a, int nt, int kt, int t, uint32_t r[4], uint32_t sa[2]) {
  const size_t block = (size_t)nt * (a.k / 64) + kt;
  load_u128(a.qweight + block * 2048 + 16 * t, r);
  const uint8_t* params = a.s2a + block * 128;
  for (int h = 0; h < 2; ++h) {
    const int row = 16 * (t / 32) + frag_group(t % 32) + 8 * h;
    sa[h] = (uint32_t)params[2 * row] | ((uint32_t)params[2 * row + 1] << 8);
  }
}

// Those bytes -> the thread's A fragments: frag[j] for MMA j (k 32 j .. 32 j + 31) of its warp's 16 rows.
QK_FN void unpack_weights(const uint32_t r[4], const uint32_t sa[2], uint32_t frag[2][4]) {
  for (int h = 0; h < 2; ++h) {
    const uint32_t s = sa[h] & 0xFFu, off = sa[h] >> 8;
    for (int j = 0; j < 2; ++j) {
      frag[j][h] = lqq_lanes(lo_nibbles(r[2 * j + h]), s, off);      // a0 / a1: k 4q + e
      frag[j][2 + h] = lqq_lanes(hi_nibbles(r[2 * j + h]), s, off);  // a2 / a3: k 16 + 4q + e
    }
  }
}

// The lane's B fragment (activations) of token block tb for MMA j of K step kt: token 8 tb + g, k 4q.. and 16 + 4q...
QK_FN void load_tokens(const LiquidArgs& a, int tb, int kt, int j, int lane, uint32_t frag[2]) {
  const int token = 8 * tb + frag_group(lane), q = frag_quad(lane);
  for (int i = 0; i < 2; ++i) {
    frag[i] = token < a.m
        ? load_u32(reinterpret_cast<const uint8_t*>(a.x) + (size_t)token * a.k + 64 * kt + 32 * j + 16 * i + 4 * q)
        : 0u;
  }
}

// The lane's accumulators of token block tb: c0, c1 at channel g, tokens 2q, 2q + 1; c2, c3 at channel g + 8.
QK_FN void store(const LiquidArgs& a, int nt, int tb, int t, const int32_t acc[4]) {
  const int lane = t % 32, g = frag_group(lane), q = frag_quad(lane);
  for (int i = 0; i < 4; ++i) {
    const int channel = 64 * nt + 16 * (t / 32) + g + 8 * (i >> 1), token = 8 * tb + 2 * q + (i & 1);
    if (token < a.m) a.out[(size_t)token * a.n + channel] = epilogue(acc[i], half_to_float(a.s1[channel]), a.s_x[token]);
  }
}

}  // namespace qk

#ifndef QK_HOST
// grid (N / 64, ceil(M / 32)), block 128 * splits, dynamic shared memory (splits - 1) * 8 KiB: warp w of each copy
// computes channels 64 nt + 16 w .. + 15 for 32 tokens.
extern "C" __global__ void liquidquant_w4a8_gemm(const int8_t* x, const float* s_x, const uint8_t* qweight,
                                                 const uint8_t* s2a, const qk_half* s1, qk_half* out, int m, int n,
                                                 int k, int splits) {
  const qk::LiquidArgs args{x, s_x, qweight, s2a, s1, out, m, n, k};
  const int t = threadIdx.x % 128, copy = threadIdx.x / 128, nt = blockIdx.x, tb0 = 4 * blockIdx.y;
  struct Stage { uint32_t r[4], sa[2], b[4][2][2]; };
  int32_t acc[4][4] = {};
  pipelined_steps<4, Stage>(
      copy, splits, k / 64,
      [&](int kt, Stage& st) {
        qk::load_weights_raw(args, nt, kt, t, st.r, st.sa);
#pragma unroll
        for (int tb = 0; tb < 4; ++tb)
#pragma unroll
          for (int j = 0; j < 2; ++j) qk::load_tokens(args, tb0 + tb, kt, j, t % 32, st.b[tb][j]);
      },
      [&](int, const Stage& st) {
        uint32_t fa[2][4];
        qk::unpack_weights(st.r, st.sa, fa);
#pragma unroll
        for (int tb = 0; tb < 4; ++tb)
#pragma unroll
          for (int j = 0; j < 2; ++j) mma_s8(acc[tb], fa[j], st.b[tb][j]);
      });
  if (!splitk_reduce<16>(&acc[0][0], t, copy, 128, splits)) return;
  for (int tb = 0; tb < 4; ++tb) qk::store(args, nt, tb0 + tb, t, acc[tb]);
}
#endif
