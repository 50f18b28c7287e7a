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

// The bit transpose of one thread's BITS plane words into its 32 codes, in word order u (bit 31 - u of every plane
// holds weight u): output word r takes bit (lanes - 1 - r) of each lane from every plane. BITS is a template
// argument so that every index is a constant and the arrays stay in registers.
template <int BITS>
QK_FN void transpose_planes(const uint32_t words[BITS], uint32_t codes[32]) {
  constexpr int lanes = BITS <= 4 ? 4 : 8;
#pragma unroll
  for (int r = 0; r < lanes; ++r) {
    const uint32_t mask = (lanes == 4 ? 0x88888888u : 0x80808080u) >> r;
    uint32_t t = 0;
#pragma unroll
    for (int j = 0; j < BITS; ++j) {
      const int shift = j - r + (lanes - BITS);
      const uint32_t part = words[j] & mask;
      t |= shift < 0 ? part << (-shift) : part >> shift;
    }
#pragma unroll
    for (int s = 0; s < 32 / lanes; ++s) codes[lanes * (32 / lanes - 1 - s) + r] = (t >> (lanes * s)) & ((1u << lanes) - 1);
  }
}

// Thread `lane`'s partial sum of chunk c for channel n and the tokens m0 .. m0 + 7 at width BITS (0 for idle
// threads of a narrow last chunk and for tokens past M).
template <int BITS>
QK_FN void thread_partials_at(const AnyPrecArgs& a, int n, int c, int m0, int lane, float partial[AP_TOKENS]) {
#pragma unroll
  for (int i = 0; i < AP_TOKENS; ++i) partial[i] = 0.0f;
  const int full = a.k / AP_CHUNK, start = c * AP_CHUNK;
  const int width = c < full ? AP_CHUNK : a.k - full * AP_CHUNK;
  if (32 * lane >= width) return;
  uint32_t words[BITS], codes[32];
#pragma unroll
  for (int j = 0; j < BITS; ++j) words[j] = a.planes[((size_t)j * a.n + n) * (a.k / 32) + 32 * c + lane];
  transpose_planes<BITS>(words, codes);
  const qk_half* table = a.lut + (size_t)n * (1 << BITS);
#pragma unroll
  for (int u = 0; u < 32; ++u) {
    const int col = start + (u / 8) * (width / 4) + 8 * lane + (u % 8);
    const float w = half_to_float(table[codes[u]]);
#pragma unroll
    for (int i = 0; i < AP_TOKENS; ++i)
      if (m0 + i < a.m) partial[i] = fadd(partial[i], fmul(a.x[(size_t)(m0 + i) * a.k + col], w));
  }
}

// thread_partials_at for the artifact's width a.bits (1..8).
QK_FN void thread_partials(const AnyPrecArgs& a, int n, int c, int m0, int lane, float partial[AP_TOKENS]) {
  switch (a.bits) {
    case 1: thread_partials_at<1>(a, n, c, m0, lane, partial); break;
    case 2: thread_partials_at<2>(a, n, c, m0, lane, partial); break;
    case 3: thread_partials_at<3>(a, n, c, m0, lane, partial); break;
    case 4: thread_partials_at<4>(a, n, c, m0, lane, partial); break;
    case 5: thread_partials_at<5>(a, n, c, m0, lane, partial); break;
    case 6: thread_partials_at<6>(a, n, c, m0, lane, partial); break;
    case 7: thread_partials_at<7>(a, n, c, m0, lane, partial); break;
    default: thread_partials_at<8>(a, n, c, m0, lane, partial); break;
  }
}

}  // namespace qk

#ifndef QK_HOST
template <int BITS>
__device__ __forceinline__ void anyprec_gemv_at(const qk::AnyPrecArgs& args) {
  const int lane = threadIdx.x, channel = blockIdx.x, m0 = qk::AP_TOKENS * blockIdx.y;
  float sum[qk::AP_TOKENS] = {};
  for (int c = 0; c < (args.k + qk::AP_CHUNK - 1) / qk::AP_CHUNK; ++c) {
    float partial[qk::AP_TOKENS];
    qk::thread_partials_at<BITS>(args, channel, c, m0, lane, partial);
#pragma unroll
    for (int i = 0; i < qk::AP_TOKENS; ++i) {
      float v = partial[i];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) v = qk::fadd(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
      sum[i] = qk::fadd(sum[i], v);
    }
  }
  if (lane < qk::AP_TOKENS && m0 + lane < args.m) {
#pragma unroll
    for (int i = 0; i < qk::AP_TOKENS; ++i)
      if (i == lane) args.out[(size_t)(m0 + i) * args.n + channel] = qk::float_to_half(sum[i]);
  }
}

extern "C" __global__ void anyprec_gemv(const float* x, const uint32_t* planes, const qk_half* lut, qk_half* out,
                                        int m, int n, int k, int bits) {
  const qk::AnyPrecArgs args{x, planes, lut, out, m, n, k, bits};
  switch (bits) {  // one instantiation per width: constant indices, registers only
    case 1: anyprec_gemv_at<1>(args); break;
    case 2: anyprec_gemv_at<2>(args); break;
    case 3: anyprec_gemv_at<3>(args); break;
    case 4: anyprec_gemv_at<4>(args); break;
    case 5: anyprec_gemv_at<5>(args); break;
    case 6: anyprec_gemv_at<6>(args); break;
    case 7: anyprec_gemv_at<7>(args); break;
    default: anyprec_gemv_at<8>(args); break;
  }
}
#endif
