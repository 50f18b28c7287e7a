// Any-Precision LUT GEMV on the bitplane layout (quantkit/formats/anyprec_layout.py; Any-Precision LLM §5):
// out[m, n] (fp16) = sum_k x[m, k] * lut_b[n, code_b(n, k)], reading only the first b planes (b = 3..8) of one
// artifact. A warp owns one output channel and walks K in chunks of 1024 columns (the last chunk may be narrower);
// thread t loads word 32 c + t of each of the b planes (coalesced), bit-transposes them into its 32 codes (four
// 4-bit lanes per word for b <= 4, four 8-bit lanes for b > 4), looks each up in the channel's table and multiplies
// it by the activation of its column; the four bytes of a word are W/4 columns apart, so each activation load is
// coalesced across the warp. Per chunk the 32 partial sums (float32, word order, no FMA contraction) are reduced by
// an xor-shuffle tree (16, 8, 4, 2, 1) and added to the channel's sum in chunk order; the result is rounded once to
// fp16. grid (N, ceil(M / 8)), block 32: each warp serves up to 8 tokens.
#include "qk_common.cuh"

namespace qk {

constexpr int AP_CHUNK = 1024, AP_TOKENS = 8;

struct AnyPrecArgs {
  const float* x;         // [M, K] activations (float32)
  const uint32_t* planes; // [P, N, K/32] bitplanes, plane 0 the most significant bit
  const qk_half* lut;     // [N, 2^bits] the table of this width
  qk_half* out;           // [M, N]
  int m, n, k, bits;
};

// The bit transpose of one thread's `bits` plane words into its 32 codes, in word order u (bit 31 - u of every
// plane holds weight u): output word r takes bit (lanes - 1 - r) of each lane from every plane.
QK_FN void transpose_planes(const uint32_t* words, int bits, uint32_t codes[32]) {
  const int lanes = bits <= 4 ? 4 : 8;
  for (int r = 0; r < lanes; ++r) {
    const uint32_t mask = (lanes == 4 ? 0x88888888u : 0x80808080u) >> r;
    uint32_t t = 0;
    for (int j = 0; j < bits; ++j) {
      const int shift = j - r + (lanes - bits);
      const uint32_t part = words[j] & mask;
      t |= shift < 0 ? part << (-shift) : part >> shift;
    }
    for (int s = 0; s < 32 / lanes; ++s) codes[lanes * (32 / lanes - 1 - s) + r] = (t >> (lanes * s)) & ((1u << lanes) - 1);
  }
}

// Thread `lane`'s partial sum of chunk c for channel n and the tokens m0 .. m0 + 7 (0 for idle threads of a
// narrow last chunk).
QK_FN void thread_partials(const AnyPrecArgs& a, int n, int c, int m0, int lane, float partial[AP_TOKENS]) {
  for (int i = 0; i < AP_TOKENS; ++i) partial[i] = 0.0f;
  const int full = a.k / AP_CHUNK, start = c * AP_CHUNK;
  const int width = c < full ? AP_CHUNK : a.k - full * AP_CHUNK;
  if (32 * lane >= width) return;
  uint32_t words[8], codes[32];
  for (int j = 0; j < a.bits; ++j) words[j] = a.planes[((size_t)j * a.n + n) * (a.k / 32) + 32 * c + lane];
  transpose_planes(words, a.bits, codes);
  const qk_half* table = a.lut + (size_t)n * (1 << a.bits);
  for (int u = 0; u < 32; ++u) {
    const int col = start + (u / 8) * (width / 4) + 8 * lane + (u % 8);
    const float w = half_to_float(table[codes[u]]);
    for (int i = 0; i < AP_TOKENS && m0 + i < a.m; ++i)
      partial[i] = fadd(partial[i], fmul(a.x[(size_t)(m0 + i) * a.k + col], w));
  }
}

}  // namespace qk

#ifndef QK_HOST
extern "C" __global__ void anyprec_gemv(const float* x, const uint32_t* planes, const qk_half* lut, qk_half* out,
                                        int m, int n, int k, int bits) {
  const qk::AnyPrecArgs args{x, planes, lut, out, m, n, k, bits};
  const int lane = threadIdx.x, channel = blockIdx.x, m0 = qk::AP_TOKENS * blockIdx.y;
  float sum[qk::AP_TOKENS] = {};
  for (int c = 0; c < (k + qk::AP_CHUNK - 1) / qk::AP_CHUNK; ++c) {
    float partial[qk::AP_TOKENS];
    qk::thread_partials(args, channel, c, m0, lane, partial);
    for (int i = 0; i < qk::AP_TOKENS; ++i) {
      float v = partial[i];
      for (int offset = 16; offset > 0; offset >>= 1) v = qk::fadd(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
      sum[i] = qk::fadd(sum[i], v);
    }
  }
  if (lane < qk::AP_TOKENS && m0 + lane < m) {
    for (int i = 0; i < qk::AP_TOKENS; ++i)
      if (i == lane) out[(size_t)(m0 + i) * n + channel] = qk::float_to_half(sum[i]);
  }
}
#endif
