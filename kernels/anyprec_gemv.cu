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

// 32-bit words of a channel's shared table (fill_table): 2 x 4^BITS fp16 pairs up to 4 bits, else 2^BITS floats.
constexpr int AP_TABLE_WORDS = 512;

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

// Channel n's table at width BITS into `table` (AP_TABLE_WORDS words). For BITS <= 4, the table of code pairs:
// pair p = (c0 << BITS) | c1 as the fp16 pair lut[n, c0] | lut[n, c1] << 16, held twice, interleaved (word
// 2 p + copy), lane l reading copy l % 2. A warp's 32 lookups then fall into two halves of 16 banks each, about 3
// wavefronts, where one copy of float32 pairs (one 64-bit load, two banks a lookup) took about 6. Above 4 bits,
// entry e = lut[n, e] as float32. Lanes share the work.
template <int BITS>
QK_FN void fill_table(const AnyPrecArgs& a, int n, int lane, float* table) {
  const qk_half* lut = a.lut + (size_t)n * (1 << BITS);
  if (BITS <= 4) {
    uint32_t* pairs = reinterpret_cast<uint32_t*>(table);
    for (int w = lane; w < 2 << (2 * BITS); w += 32) {
      const int p = w / 2;
      pairs[w] = (uint32_t)lut[p >> BITS] | (uint32_t)lut[p & ((1 << BITS) - 1)] << 16;
    }
  } else {
    for (int e = lane; e < 1 << BITS; e += 32) table[e] = half_to_float(lut[e]);
  }
}

// How many chunks of AP_CHUNK columns K makes, and the width of chunk c (the last may be narrower).
QK_FN int chunk_count(const AnyPrecArgs& a) { return (a.k + AP_CHUNK - 1) / AP_CHUNK; }
QK_FN int chunk_width(const AnyPrecArgs& a, int c) {
  const int full = a.k / AP_CHUNK;
  return c < full ? AP_CHUNK : a.k - full * AP_CHUNK;
}

// Thread `lane`'s word of each of the first BITS planes of channel n in chunk c (zeros for idle threads of a narrow
// last chunk): the loads, apart from the arithmetic, so that a warp can have several chunks' loads in flight.
template <int BITS>
QK_FN void chunk_words(const AnyPrecArgs& a, int n, int c, int lane, uint32_t words[BITS]) {
  const bool active = 32 * lane < chunk_width(a, c);
#pragma unroll
  for (int j = 0; j < BITS; ++j)
    words[j] = active ? a.planes[((size_t)j * a.n + n) * (a.k / 32) + 32 * c + lane] : 0u;
}

// Thread `lane`'s partial sums of chunk c for the tokens m0 .. m0 + 7 at width BITS from its plane words (the
// channel's table filled; 0 for idle threads of a narrow last chunk and for tokens past M).
template <int BITS>
QK_FN void partials_of_words(const AnyPrecArgs& a, const float* table, const uint32_t words[BITS], int c, int m0,
                             int lane, float partial[AP_TOKENS]) {
#pragma unroll
  for (int i = 0; i < AP_TOKENS; ++i) partial[i] = 0.0f;
  const int start = c * AP_CHUNK, width = chunk_width(a, c);
  if (32 * lane >= width) return;
  uint32_t codes[32];
  transpose_planes<BITS>(words, codes);
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // byte j: columns start + j W / 4 + 8 lane + e, weights u = 8 j + e
    float w[8];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const uint32_t c0 = codes[8 * j + e], c1 = codes[8 * j + e + 1];
      if (BITS <= 4) {  // the pair's two fp16 values: one 32-bit load from the lane's copy
        const uint32_t pair = reinterpret_cast<const uint32_t*>(table)[2 * ((c0 << BITS) | c1) + (lane & 1)];
        w[e] = half_to_float((qk_half)(pair & 0xFFFFu));
        w[e + 1] = half_to_float((qk_half)(pair >> 16));
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

// Both: thread `lane`'s partial sums of chunk c for channel n.
template <int BITS>
QK_FN void thread_partials_at(const AnyPrecArgs& a, const float* table, int n, int c, int m0, int lane,
                              float partial[AP_TOKENS]) {
  uint32_t words[BITS];
  chunk_words<BITS>(a, n, c, lane, words);
  partials_of_words<BITS>(a, table, words, c, m0, lane, partial);
}

// ---- The tensor-core path (anyprec_gemm_tc), for more than a token or two. ----
// A block owns 128 channels (8 warps of 16: two n8 blocks each), one 1024-column chunk and 16 tokens; grid
// (ceil(N / 128), chunks, ceil(M / 16)). It stages the 16 tokens' activations of its chunk in shared memory and
// its channels' tables (fp16 pairs up to 3 bits, single fp16 entries above). Lane (g, q) of a warp decodes words
// t = 8 q + v (v = 0..7) of channels g and 8 + g of its warp: the 32 codes of a word are four weights for each of
// 8 mma.m16n8k16 (s = 0..7), weights u = 4 s .. 4 s + 3 being its k = 2 q, 2 q + 1, 2 q + 8, 2 q + 9. Those are 4
// consecutive columns (byte s / 2, bits 4 (s % 2) ..), so the A lane (g', q') reads them for token g' (and g' + 8)
// as one 8-byte load: the activation tile keeps each 4-column group of word t at [token][s][v][q] (an 8-byte
// slot), rows 2080 bytes apart, so that a warp's 8-byte loads fill 32 banks twice. The chunks' float32 partial
// sums meet in a workspace [chunks, M, N]; the block that finishes a tile last (a counter per tile) adds them in
// chunk order and rounds once to fp16, so the result is deterministic. Not bit-exact against the emulation: the
// tensor cores' float32 accumulation has its own order and rounding (quantkit.kernels checks it within a bound).
constexpr int APT_WARPS = 8, APT_CHANNELS = 16 * APT_WARPS, APT_TOKENS = 16, APT_THREADS = 32 * APT_WARPS;
constexpr int APT_ROW_BYTES = 2 * AP_CHUNK + 32, APT_X_BYTES = APT_TOKENS * APT_ROW_BYTES;

// Up to 3 bits a lookup reads one fp16 pair of 4 bytes, and the tables are interleaved: per group of 8 channels (an
// n8 block, channel 8 G + g), pair p of channel g is word (G 4^BITS + p) 8 + g, held APT_COPIES times side by side,
// lane (g, q) reading copy q % APT_COPIES. A lookup of the warp then lands in bank (16 p + 2 g + q % 2) % 32:
// lanes of different g never collide and the four of one g at most in pairs, so it takes 2 wavefronts, where
// channel-major tables (bank p % 32 for every lane) take the most of 32 random draws in 32 banks, about 3.5.
constexpr int APT_COPIES = 2;

// Bytes of one channel's table: 4^BITS fp16 pairs, APT_COPIES times, up to 3 bits; else 2^BITS fp16.
template <int BITS>
QK_FN constexpr int tc_table_bytes() { return BITS <= 3 ? APT_COPIES * (4 << (2 * BITS)) : 2 << BITS; }

// The byte offset in the block's tables of entry e (a pair up to 3 bits) of its channel ch (0..127), copy `copy`.
template <int BITS>
QK_FN int tc_table_offset(int ch, int e, int copy) {
  if (BITS > 3) return ch * tc_table_bytes<BITS>() + 2 * e;
  return 4 * ((((ch / 8) * (1 << (2 * BITS)) + e) * 8 + ch % 8) * APT_COPIES + copy);
}

struct AnyPrecTcArgs {
  AnyPrecArgs a;
  float* partials;  // [chunks, M, N] when chunks > 1
  int* counters;    // [ceil(M / 16) * ceil(N / 128)], zero; each tile's last block resets its counter
};

QK_FN int tc_words(const AnyPrecArgs& a, int c) { return chunk_width(a, c) / 32; }

// The activations of tokens m0 .. m0 + 15 (zero past M) in chunk c, into the tile: threads tid, tid + threads, ...
// each copy 8-byte slots (a 4-column group).
QK_FN void tc_stage_x(const AnyPrecArgs& a, uint8_t* xs, int m0, int c, int tid, int threads) {
  const int words = tc_words(a, c), width = 32 * words;
  for (int i = tid; i < APT_TOKENS * 4 * words * 2; i += threads) {
    const int h = i & 1, t = (i >> 1) % words, j = (i >> 1) / words % 4, r = (i >> 1) / words / 4;
    const int token = m0 + r < a.m ? m0 + r : 0;
    const qk_half* src = a.x + (size_t)token * a.k + (size_t)c * AP_CHUNK + j * (width / 4) + 8 * t + 4 * h;
    copy_async<8>(xs + r * APT_ROW_BYTES + ((2 * j + h) * 32 + (t % 8) * 4 + t / 8) * 8, src, m0 + r < a.m);
  }
}

// The tables of channels n0 .. n0 + 127 (those below N), at tc_table_offset: pair p = (c0 << BITS) | c1 as the
// fp16 pair lut[c0] | lut[c1] << 16 up to 3 bits, else the fp16 entries as stored.
template <int BITS>
QK_FN void tc_fill_tables(const AnyPrecArgs& a, uint8_t* tables, int n0, int tid, int threads) {
  constexpr int entries = BITS <= 3 ? 1 << (2 * BITS) : 1 << BITS;
  for (int i = tid; i < APT_CHANNELS * entries; i += threads) {
    const int ch = i / entries, e = i % entries;
    if (n0 + ch >= a.n) continue;
    const qk_half* lut = a.lut + (size_t)(n0 + ch) * (1 << BITS);
    if (BITS <= 3) {
      const uint32_t pair = (uint32_t)lut[e >> BITS] | ((uint32_t)lut[e & ((1 << BITS) - 1)] << 16);
      for (int copy = 0; copy < APT_COPIES; ++copy) store_u32(tables + tc_table_offset<BITS>(ch, e, copy), pair);
    } else {
      store_u16(tables + tc_table_offset<BITS>(ch, e, 0), lut[e]);
    }
  }
}

// Lane (g, q)'s words 8 q .. 8 q + 7 of chunk c of `channel`, every plane (zero past the chunk or past N).
template <int BITS>
QK_FN void tc_load_words(const AnyPrecArgs& a, int channel, int c, int lane, uint32_t words[BITS][8]) {
  const int q = frag_quad(lane), valid = channel < a.n ? tc_words(a, c) - 8 * q : 0;
  const bool whole = valid >= 8 && a.k % 128 == 0;  // two 16-byte loads per plane (16-byte aligned rows)
#pragma unroll
  for (int p = 0; p < BITS; ++p) {
    const uint32_t* src = a.planes + ((size_t)p * a.n + (channel < a.n ? channel : 0)) * (a.k / 32) + 32 * c + 8 * q;
    if (whole) {
      load_u128(src, words[p]);
      load_u128(src + 4, words[p] + 4);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) words[p][i] = i < valid ? src[i] : 0u;
    }
  }
}

// Word v's B fragments for lane `lane` of the warp: b[s] for MMA s, the fp16 weights of u = 4 s, 4 s + 1 and
// 4 s + 2, 4 s + 3 (`ch`: the block's channel the lane decodes, in `tables`).
template <int BITS>
QK_FN void tc_decode_b(const uint8_t* tables, int ch, int lane, const uint32_t words[BITS][8], int v,
                       uint32_t b[8][2]) {
  const int copy = frag_quad(lane) % APT_COPIES;
  uint32_t word[BITS], codes[32];
#pragma unroll
  for (int p = 0; p < BITS; ++p) word[p] = words[p][v];
  transpose_planes<BITS>(word, codes);
#pragma unroll
  for (int s = 0; s < 8; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t c0 = codes[4 * s + 2 * r], c1 = codes[4 * s + 2 * r + 1];
      if (BITS <= 3) {
        b[s][r] = load_u32(tables + tc_table_offset<BITS>(ch, (c0 << BITS) | c1, copy));
      } else {
        b[s][r] = (uint32_t)load_u16(tables + tc_table_offset<BITS>(ch, c0, 0)) |
                  ((uint32_t)load_u16(tables + tc_table_offset<BITS>(ch, c1, 0)) << 16);
      }
    }
  }
}

// Lane (g', q')'s A fragment of MMA s for word group v: tokens g' and g' + 8, the 4 columns of word 8 q' + v at
// u = 4 s ..: {row g' k 0-1, row g' + 8 k 0-1, row g' k 2-3, row g' + 8 k 2-3}; zero for a word past the chunk.
QK_FN void tc_load_a(const uint8_t* xs, int s, int v, int lane, int words, uint32_t a[4]) {
  const int g = frag_group(lane), q = frag_quad(lane);
  if (8 * q + v >= words) {
    a[0] = a[1] = a[2] = a[3] = 0u;
    return;
  }
  const int slot = (s * 32 + v * 4 + q) * 8;
  load_u64(xs + g * APT_ROW_BYTES + slot, a[0], a[2]);
  load_u64(xs + (g + 8) * APT_ROW_BYTES + slot, a[1], a[3]);
}

// The warp's channel of n8 block nb for lane (its B column g).
QK_FN int tc_channel(int n0, int warp, int nb, int lane) { return n0 + 16 * warp + 8 * nb + frag_group(lane); }

// Lane's accumulators of n8 block nb: (token g, channels 2 q, 2 q + 1), (token g + 8, same): fp16 out when K is one
// chunk, else float32 partials of chunk c.
QK_FN void tc_store(const AnyPrecTcArgs& t, int m0, int n0, int c, int warp, int nb, int lane, const float acc[4]) {
  const AnyPrecArgs& a = t.a;
  for (int i = 0; i < 4; ++i) {
    const int token = m0 + frag_group(lane) + 8 * (i >> 1);
    const int channel = n0 + 16 * warp + 8 * nb + 2 * frag_quad(lane) + (i & 1);
    if (token >= a.m || channel >= a.n) continue;
    if (chunk_count(a) == 1) a.out[(size_t)token * a.n + channel] = float_to_half(acc[i]);
    else t.partials[((size_t)c * a.m + token) * a.n + channel] = acc[i];
  }
}

// The last block of a tile: out = fp16 of the chunks' partial sums, added in chunk order.
QK_FN void tc_finish(const AnyPrecTcArgs& t, int m0, int n0, int tid, int threads) {
  const AnyPrecArgs& a = t.a;
  for (int e = tid; e < APT_TOKENS * APT_CHANNELS; e += threads) {
    const int token = m0 + e / APT_CHANNELS, channel = n0 + e % APT_CHANNELS;
    if (token >= a.m || channel >= a.n) continue;
    float sum = 0.0f;
    for (int c = 0; c < chunk_count(a); ++c) {
      const float* p = t.partials + ((size_t)c * a.m + token) * a.n + channel;
#if defined(__CUDA_ARCH__)
      sum = fadd(sum, __ldcg(p));  // through L2: other blocks wrote it
#else
      sum = fadd(sum, *p);
#endif
    }
    a.out[(size_t)token * a.n + channel] = float_to_half(sum);
  }
}

}  // namespace qk

#ifndef QK_HOST
template <int BITS>
__device__ __forceinline__ void anyprec_gemm_tc_at(const qk::AnyPrecTcArgs& args, uint8_t* smem) {
  using namespace qk;
  constexpr int AT_ONCE = BITS <= 4 ? 2 : 1;  // n8 blocks whose plane words a lane holds at once
  const AnyPrecArgs& a = args.a;
  uint8_t* xs = smem;
  uint8_t* tables = smem + APT_X_BYTES;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n0 = APT_CHANNELS * blockIdx.x, c = blockIdx.y, m0 = APT_TOKENS * blockIdx.z, words = tc_words(a, c);
  tc_stage_x(a, xs, m0, c, tid, APT_THREADS);
  cp_async_commit();
  tc_fill_tables<BITS>(a, tables, n0, tid, APT_THREADS);
  float acc[2][4] = {};
#pragma unroll
  for (int nb0 = 0; nb0 < 2; nb0 += AT_ONCE) {
    uint32_t w[AT_ONCE][BITS][8];
#pragma unroll
    for (int i = 0; i < AT_ONCE; ++i) tc_load_words<BITS>(a, tc_channel(n0, warp, nb0 + i, lane), c, lane, w[i]);
    if (nb0 == 0) {
      cp_async_wait<0>();
      __syncthreads();
    }
#pragma unroll  // constant indices into w: a run-time v would put it in local memory
    for (int v = 0; v < 8; ++v) {
      uint32_t b[AT_ONCE][8][2];
#pragma unroll
      for (int i = 0; i < AT_ONCE; ++i) {
        const int channel = tc_channel(n0, warp, nb0 + i, lane);
        if (channel < a.n && 8 * frag_quad(lane) + v < words) {
          tc_decode_b<BITS>(tables, channel - n0, lane, w[i], v, b[i]);
        } else {
#pragma unroll
          for (int s = 0; s < 8; ++s) b[i][s][0] = b[i][s][1] = 0u;
        }
      }
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        uint32_t fa[4];
        tc_load_a(xs, s, v, lane, words, fa);
#pragma unroll
        for (int i = 0; i < AT_ONCE; ++i) mma_f16(acc[nb0 + i], fa, b[i][s]);
      }
    }
  }
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) tc_store(args, m0, n0, c, warp, nb, lane, acc[nb]);
  if (chunk_count(a) == 1) return;
  __shared__ int last;
  __threadfence();  // this block's partials before its count
  __syncthreads();
  int* counter = args.counters + blockIdx.z * gridDim.x + blockIdx.x;
  if (tid == 0) last = atomicAdd(counter, 1) == chunk_count(a) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other blocks' partials after their counts
  tc_finish(args, m0, n0, tid, APT_THREADS);
  if (tid == 0) *counter = 0;
}

// grid (ceil(N / 128), ceil(K / 1024), ceil(M / 16)), block 256, dynamic shared memory APT_X_BYTES + 128 channels'
// tables (33,280 + 128 tc_table_bytes<bits>()).
extern "C" __global__ void __launch_bounds__(256) anyprec_gemm_tc(const qk_half* x, const uint32_t* planes,
                                                                  const qk_half* lut, qk_half* out, float* partials,
                                                                  int* counters, int m, int n, int k, int bits) {
  extern __shared__ uint4 qk_apt_smem[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(qk_apt_smem);
  const qk::AnyPrecTcArgs args{{x, planes, lut, out, m, n, k, bits}, partials, counters};
  qk::with_width(bits, [&](auto width) { anyprec_gemm_tc_at<decltype(width)::value>(args, smem); });
}

template <int BITS>
__device__ __forceinline__ void anyprec_gemv_at(const qk::AnyPrecArgs& args, float (*tables)[qk::AP_TABLE_WORDS]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int channel = qk::AP_WARPS * blockIdx.x + warp, m0 = qk::AP_TOKENS * blockIdx.y;
  if (channel >= args.n) return;  // no block-wide barrier follows: each warp has its own table
  // The plane words of AP_AHEAD chunks are loaded before the first of them is used (a decode GEMV is bound by how
  // many bytes are in flight), the first AP_AHEAD's even before the table is filled, so that the two fetches
  // overlap. The chunks are still summed in order, and only the tokens below M are reduced across the warp (a
  // decode call has one of the warp's eight): the bits do not change.
  struct Words { uint32_t w[BITS]; };
  constexpr int AP_AHEAD = BITS <= 4 ? 4 : 2;
  const int chunks = qk::chunk_count(args), tokens = args.m - m0;
  float sum[qk::AP_TOKENS] = {};
  auto load = [&](int c, Words& st) { qk::chunk_words<BITS>(args, channel, c, lane, st.w); };
  auto add = [&](int c, const Words& st) {
    float partial[qk::AP_TOKENS];
    qk::partials_of_words<BITS>(args, tables[warp], st.w, c, m0, lane, partial);
#pragma unroll
    for (int i = 0; i < qk::AP_TOKENS; ++i) {
      if (i >= tokens) break;
      float v = partial[i];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) v = qk::fadd(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
      sum[i] = qk::fadd(sum[i], v);
    }
  };
  Words head[AP_AHEAD];
#pragma unroll
  for (int u = 0; u < AP_AHEAD; ++u)
    if (u < chunks) load(u, head[u]);
  qk::fill_table<BITS>(args, channel, lane, tables[warp]);
  __syncwarp();
#pragma unroll
  for (int u = 0; u < AP_AHEAD; ++u)
    if (u < chunks) add(u, head[u]);
  pipelined_steps<AP_AHEAD, Words>(AP_AHEAD, 1, chunks, load, add);
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
  __shared__ __align__(16) float tables[qk::AP_WARPS][qk::AP_TABLE_WORDS];  // 16 KiB: one table a warp
  const qk::AnyPrecArgs args{x, planes, lut, out, m, n, k, bits};
  // one instantiation per width: constant indices, registers only
  qk::with_width(bits, [&](auto width) { anyprec_gemv_at<decltype(width)::value>(args, tables); });
}
#endif
