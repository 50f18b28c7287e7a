// Any-Precision LUT GEMV on the bitplane layout (quantkit/formats/anyprec_layout.py; Any-Precision LLM §5):
// out[m, n] (fp16) = sum_k x[m, k] * lut_b[n, code_b(n, k)], reading only the first b planes (b = 1..8) of one
// artifact, from fp16 activations. A warp owns one output channel (a block of 8 warps, 8 consecutive channels) and
// walks K in chunks of 1024 columns (the last chunk may be narrower). Per chunk, thread t loads word 32 c + t of each
// of the b planes (coalesced), bit-transposes them into its 32 codes (four 4-bit lanes per word for b <= 4, four
// 8-bit lanes above; the paper's IBT) and looks them up in the channel's table, which the warp first copies to
// shared memory as float32: for b <= 4 as the table of all 4^b code pairs, so that one 64-bit load serves two
// adjacent codes (the paper's table-lookup merging). Byte j of a word holds 8 consecutive columns j W / 4 + 8 t ..,
// so each token's activations come in one 16-byte load per byte, coalesced across the warp (the paper's weight
// layout). The products x * w of two fp16 values are exact in float32, so each thread's fused multiply-adds, in word
// order, equal a float32 sum of exact products; the 32 partial sums are reduced by an xor-shuffle tree
// (16, 8, 4, 2, 1) and added to the channel's sum in chunk order, and the result is rounded once to fp16.
// grid (ceil(N / 8), ceil(M / 8)), block 256: each warp serves up to 8 tokens. No split-K: the channels alone give
// N warps (thousands for an LLM's linears).
#include "qk_common.cuh"

namespace qk {

constexpr int AP_CHUNK = 1024, AP_TOKENS = 8, AP_WARPS = 8;

// Floats of a channel's shared table at width BITS: the 4^BITS pairs (two floats each) up to 4 bits, else 2^BITS.
template <int BITS>
constexpr int table_floats() { return BITS <= 4 ? 2 << (2 * BITS) : 1 << BITS; }
constexpr int AP_TABLE_FLOATS = 512;  // the largest: 4-bit pairs

struct AnyPrecArgs {
  const qk_half* x;       // [M, K] activations (fp16)
  const uint32_t* planes; // [P, N, K/32] bitplanes, plane 0 the most significant bit
  const qk_half* lut;     // [N, 2^bits] the table of this width
  qk_half* out;           // [M, N]
  int m, n, k, bits;
};

// x * w + acc where the product is exact (two fp16 values): one FMA on the GPU, and the same bits as a float32
// multiply then add.
QK_FN float fma_exact(float x, float w, float acc) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(x, w, acc);
#else
  return fadd(fmul(x, w), acc);
#endif
}

// Two consecutive floats of shared memory (p 8-byte aligned): one 64-bit load on the GPU.
QK_FN void load_pair(const float* p, float& a, float& b) {
#if defined(__CUDA_ARCH__)
  const float2 v = *reinterpret_cast<const float2*>(p);
  a = v.x;
  b = v.y;
#else
  a = p[0];
  b = p[1];
#endif
}

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

// Channel n's table at width BITS, as float32, into `table` (AP_TABLE_FLOATS floats): entry e = lut[n, e], or for
// BITS <= 4 pair p = (c0 << BITS) | c1 as table[2 p], table[2 p + 1] = lut[n, c0], lut[n, c1]. Lanes share the work.
template <int BITS>
QK_FN void fill_table(const AnyPrecArgs& a, int n, int lane, float* table) {
  const qk_half* lut = a.lut + (size_t)n * (1 << BITS);
  if (BITS <= 4) {
    for (int p = lane; p < 1 << (2 * BITS); p += 32) {
      table[2 * p] = half_to_float(lut[p >> BITS]);
      table[2 * p + 1] = half_to_float(lut[p & ((1 << BITS) - 1)]);
    }
  } else {
    for (int e = lane; e < 1 << BITS; e += 32) table[e] = half_to_float(lut[e]);
  }
}

// Thread `lane`'s partial sums of chunk c for channel n (its table filled) and the tokens m0 .. m0 + 7 at width
// BITS (0 for idle threads of a narrow last chunk and for tokens past M).
template <int BITS>
QK_FN void thread_partials_at(const AnyPrecArgs& a, const float* table, int n, int c, int m0, int lane,
                              float partial[AP_TOKENS]) {
#pragma unroll
  for (int i = 0; i < AP_TOKENS; ++i) partial[i] = 0.0f;
  const int full = a.k / AP_CHUNK, start = c * AP_CHUNK;
  const int width = c < full ? AP_CHUNK : a.k - full * AP_CHUNK;
  if (32 * lane >= width) return;
  uint32_t words[BITS], codes[32];
#pragma unroll
  for (int j = 0; j < BITS; ++j) words[j] = a.planes[((size_t)j * a.n + n) * (a.k / 32) + 32 * c + lane];
  transpose_planes<BITS>(words, codes);
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // byte j: columns start + j W / 4 + 8 lane + e, weights u = 8 j + e
    float w[8];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const uint32_t c0 = codes[8 * j + e], c1 = codes[8 * j + e + 1];
      if (BITS <= 4) {
        load_pair(table + 2 * ((c0 << BITS) | c1), w[e], w[e + 1]);
      } else {
        w[e] = table[c0];
        w[e + 1] = table[c1];
      }
    }
    const size_t col = (size_t)start + j * (width / 4) + 8 * lane;
#pragma unroll
    for (int i = 0; i < AP_TOKENS; ++i) {
      if (m0 + i >= a.m) continue;
      uint32_t h[4];  // the token's 8 activations of this byte: one 16-byte load
      load_u128(a.x + (size_t)(m0 + i) * a.k + col, h);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        partial[i] = fma_exact(half_to_float((qk_half)(h[e / 2] >> (16 * (e % 2)))), w[e], partial[i]);
    }
  }
}

}  // namespace qk

#ifndef QK_HOST
template <int BITS>
__device__ __forceinline__ void anyprec_gemv_at(const qk::AnyPrecArgs& args, float (*tables)[qk::AP_TABLE_FLOATS]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int channel = qk::AP_WARPS * blockIdx.x + warp, m0 = qk::AP_TOKENS * blockIdx.y;
  if (channel >= args.n) return;  // no block-wide barrier follows: each warp has its own table
  qk::fill_table<BITS>(args, channel, lane, tables[warp]);
  __syncwarp();
  float sum[qk::AP_TOKENS] = {};
  for (int c = 0; c < (args.k + qk::AP_CHUNK - 1) / qk::AP_CHUNK; ++c) {
    float partial[qk::AP_TOKENS];
    qk::thread_partials_at<BITS>(args, tables[warp], channel, c, m0, lane, partial);
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

// grid (ceil(N / 8), ceil(M / 8)), block 256.
extern "C" __global__ void __launch_bounds__(256) anyprec_gemv(const qk_half* x, const uint32_t* planes,
                                                               const qk_half* lut, qk_half* out, int m, int n, int k,
                                                               int bits) {
  __shared__ __align__(16) float tables[qk::AP_WARPS][qk::AP_TABLE_FLOATS];  // 16 KiB: one table a warp
  const qk::AnyPrecArgs args{x, planes, lut, out, m, n, k, bits};
  switch (bits) {  // one instantiation per width: constant indices, registers only
    case 1: anyprec_gemv_at<1>(args, tables); break;
    case 2: anyprec_gemv_at<2>(args, tables); break;
    case 3: anyprec_gemv_at<3>(args, tables); break;
    case 4: anyprec_gemv_at<4>(args, tables); break;
    case 5: anyprec_gemv_at<5>(args, tables); break;
    case 6: anyprec_gemv_at<6>(args, tables); break;
    case 7: anyprec_gemv_at<7>(args, tables); break;
    default: anyprec_gemv_at<8>(args, tables); break;
  }
}
#endif
