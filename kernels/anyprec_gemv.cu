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

// The bit transpose of one thread's BITS plane words (bit 31 - u of every plane holds weight u) into `lanes` words
// of codes: word r takes bit (lanes - 1 - r) of each lane from every plane, so that lane s of word r (bits
// lanes s ..) holds the code of weight u = lanes (32 / lanes - 1 - s) + r; lanes of 4 bits up to BITS = 4, else 8.
// BITS is a template argument so that every index is a constant and the arrays stay in registers.
template <int BITS>
QK_FN constexpr int transpose_lanes() { return BITS <= 4 ? 4 : 8; }

// Whether the bit transpose of the tensor-core kernels' widths up to 3 bits (the Any-Precision bar's) shifts by
// multiply-adds (shift_or: 430 integer-ALU instructions of a step's 682, against 478 of 656) rather than shifts and
// ORs. Off: on an H100 the shifts were 3-6% faster on all eight rows of the 3-bit bar (run 1 of
// bench/results/kernels_h100_smallm_tune.json, AP-SHIFTS against U8). 1 is bench/smallm_tune.py's AP-FMA.
#ifndef QK_AP_FMA_SHIFTS
#define QK_AP_FMA_SHIFTS 0
#endif

template <int BITS>
QK_FN void transpose_words(const uint32_t words[BITS], uint32_t t[transpose_lanes<BITS>()]) {
  constexpr int lanes = transpose_lanes<BITS>();
#pragma unroll
  for (int r = 0; r < lanes; ++r) {
    const uint32_t mask = (lanes == 4 ? 0x88888888u : 0x80808080u) >> r;
    t[r] = 0;
#pragma unroll
    for (int j = 0; j < BITS; ++j) {
      const int shift = j - r + (lanes - BITS);
      t[r] = shift_or<BITS <= 3 && QK_AP_FMA_SHIFTS>(words[j] & mask, shift, t[r]);
    }
  }
}

// The pair transpose of one thread's BITS plane words (BITS <= 4), for the tensor-core kernels' shared tables in pair
// mode (tc_pairs): word i takes, in each byte (columns v = 0..7 of a run at bits 7 - v), columns 2 i and 2 i + 1 of
// every plane into one index of 2 BITS bits, plane j's two bits at bits 2 (BITS - 1 - j) + 1 (column 2 i) and
// 2 (BITS - 1 - j) (column 2 i + 1): a table of 4^BITS fp16 pairs then gives the two columns' weights in the order
// of the activations' fp16 pair in memory, so the MMA's B operand needs no permute.
template <int BITS>
QK_FN void transpose_pairs(const uint32_t words[BITS], uint32_t t[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t mask = 0xC0C0C0C0u >> (2 * i);
    t[i] = 0;
#pragma unroll
    for (int j = 0; j < BITS; ++j)
      t[i] = shift_or<BITS <= 3 && QK_AP_FMA_SHIFTS>(words[j] & mask, 6 - 2 * i - 2 * (BITS - 1 - j), t[i]);
  }
}

// The same as 32 codes in word order u.
template <int BITS>
QK_FN void transpose_planes(const uint32_t words[BITS], uint32_t codes[32]) {
  constexpr int lanes = transpose_lanes<BITS>();
  uint32_t t[lanes];
  transpose_words<BITS>(words, t);
#pragma unroll
  for (int r = 0; r < lanes; ++r)
#pragma unroll
    for (int s = 0; s < 32 / lanes; ++s) codes[lanes * (32 / lanes - 1 - s) + r] = (t[r] >> (lanes * s)) & ((1u << lanes) - 1);
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
// The GEMV's chunks in flight (pipelined_steps, after the first ones loaded ahead of the table): the words of 4 chunks
// up to 4 bits, 2 above. The warp simulator's twin walks the chunks in the same rounds.
QK_FN constexpr int ap_ahead(int bits) { return bits <= 4 ? 4 : 2; }

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

// ---- The tensor-core path (anyprec_gemm_tc, anyprec_gemm_tc8 up to 8 tokens), for any number of tokens. ----
// A block owns 16 channels and 16 tokens: the weights are the A operand of mma.m16n8k16 (rows: channels) and the
// activations its B operand (columns: tokens, two n8 blocks, the second skipped up to 8 tokens), so that a decode
// call's lone token costs the seven other columns nothing but zeros. The block walks K in steps of 16 plane words
// (512 columns; 8 words above 4 bits, whose planes take more registers) a channel; warp w of W (8, or 4 for short K:
// below) takes steps w, w + W, ... and the warps' float32 sums meet in shared memory, added in warp order
// (deterministic). grid (ceil(N / 16), 1, ceil(M / 16)), block 32 W.
// Lane (g, q) holds words 16 s + 4 q .. + 3 of channels g and 8 + g (one 16-byte load a plane each; above 4 bits
// 8 s + 2 q, + 1, one 8-byte load) and takes them one at a time: the bit transpose (transpose_words) puts in byte b
// of word T_r the codes of the word's columns e = r and e = r + 4 of the 8-column run j = 3 - b (up to 4 bits both
// in one byte, as nibbles; above, bytes b of T_r and T_{r + 4}). A lookup of that byte in the channel's table
// (registers up to 3 bits, tc_reg_lookup; else shared memory) gives the fp16 pair lut[code(r + 4)] |
// lut[code(r)] << 16, an A register as it stands: k = 2 q, 2 q + 1 are those two columns of lane q's word. MMA
// s = 2 r + h reads bytes b = 2 h (registers a0, a1: rows g, g + 8) and b = 2 h + 1 (a2, a3). The B lane (g', q)
// supplies token g' at the same two columns of the same word (the lanes of one q share it), from its 16-byte load
// of run j by one byte permute. Not bit-exact against the emulation: the tensor cores' float32 accumulation has its
// own order and rounding (quantkit.kernels checks it within a bound).
// The warps of a block (QK_AP_TC_WARPS, 8; 4 or 2 are bench/smallm_tune.py's AP-W4 and AP-W2), which take turns
// at the tile's K steps and add their sums in warp order at the end. At K = 4096 (8 steps a 16-channel tile at
// 3 bits) each of 8 warps has one step: its loads, then its decode, with nothing of its own in flight meanwhile and
// the SM's other block the only overlap. Fewer warps a block give each more steps (the next one's words in flight
// during this one's decode: tc_prefetch) and an SM more, smaller blocks (the same 16 warps), which also spread
// 6144 x 4096's 384 tiles over 132 SMs more evenly. Other float32 sums, so not the same bits: the same bound.
// On an H100 (bench/results/kernels_h100_smallm_tune.json, run 3) 4 warps took 0.79-0.90x the time of 8 at 3 bits
// on 6144 x 4096 and at M = 1 on 28672 x 4096, 1.07x at M = 16 on 4096 x 4096, and 1.05-1.12x at K = 14336 (28
// steps: 3 or 4 a warp already). So the fast kernels up to 3 bits (tables in registers: four blocks an SM need no
// more shared memory) are built again with APT_FEW_WARPS (the *_w4 kernels), which quantkit.kernels launches where
// 8 warps would leave a warp under two steps (anyprec_tc_warps).
#ifndef QK_AP_TC_WARPS
#define QK_AP_TC_WARPS 8
#endif
constexpr int APT_WARPS = QK_AP_TC_WARPS, APT_FEW_WARPS = 4, APT_CHANNELS = 16, APT_TOKENS = 16;
static_assert(APT_WARPS == 2 || APT_WARPS == 4 || APT_WARPS == 8, "QK_AP_TC_WARPS: 2, 4 or 8");

// Every tensor-core kernel, listed once for the device build and the warp simulator's twins: X(NAME, width, token
// blocks, FAST, warps) for anyprec_gemm_tc_B (any M) and anyprec_gemm_tc8_B (M <= 8), each also *_fast, at every
// width, and up to 3 bits the fast ones again in blocks of APT_FEW_WARPS (*_fast_w4).
#define QK_AP_TC_WIDTH(X, B)                                                                                       \
  X(anyprec_gemm_tc_##B, B, 2, false, qk::APT_WARPS)                                                                \
  X(anyprec_gemm_tc8_##B, B, 1, false, qk::APT_WARPS)                                                               \
  X(anyprec_gemm_tc_##B##_fast, B, 2, true, qk::APT_WARPS)                                                          \
  X(anyprec_gemm_tc8_##B##_fast, B, 1, true, qk::APT_WARPS)
#define QK_AP_TC_FEW(X, B)                                                                                         \
  X(anyprec_gemm_tc_##B##_fast_w4, B, 2, true, qk::APT_FEW_WARPS)                                                   \
  X(anyprec_gemm_tc8_##B##_fast_w4, B, 1, true, qk::APT_FEW_WARPS)
#define QK_AP_TC_ALL(X)                                                                                            \
  QK_AP_TC_WIDTH(X, 1) QK_AP_TC_WIDTH(X, 2) QK_AP_TC_WIDTH(X, 3) QK_AP_TC_WIDTH(X, 4) QK_AP_TC_WIDTH(X, 5)          \
  QK_AP_TC_WIDTH(X, 6) QK_AP_TC_WIDTH(X, 7) QK_AP_TC_WIDTH(X, 8) QK_AP_TC_FEW(X, 1) QK_AP_TC_FEW(X, 2)             \
  QK_AP_TC_FEW(X, 3)

// Plane words a lane holds per channel and step, and the step's words per channel (its four quads').
template <int BITS>
QK_FN constexpr int tc_lane_words() { return BITS <= 4 ? 4 : 2; }
template <int BITS>
QK_FN constexpr int tc_step_words() { return 4 * tc_lane_words<BITS>(); }

// Up to 3 bits (the most whose codes a byte permute's selector nibbles index: bit 3 is its sign mode) the tables
// of a lane's channel groups h < QK_AP_REG_GROUPS (of its 2: channels g and 8 + g) live in its registers
// (tc_load_reg_tables), the others' in shared memory, as from 4 bits on. By default both groups' tables are in
// registers: 3 bits from shared memory took 1.04-1.52x the time on an H200 (bench/results/
// kernels_h200_smallm_tune.json run 7) when a lookup's address took a shift and an AND-OR. It now takes one byte
// permute, and bench/smallm_tune.py times shared tables (AP-SMEM, 0) and one group of each (AP-HYBRID, 1).
#ifndef QK_AP_REG_GROUPS
#define QK_AP_REG_GROUPS 2
#endif
template <int BITS>
QK_FN constexpr int tc_reg_groups() { return BITS <= 3 ? QK_AP_REG_GROUPS : 0; }
template <int BITS>
QK_FN constexpr bool tc_reg_tables() { return tc_reg_groups<BITS>() > 0; }
template <int BITS>
QK_FN constexpr bool tc_shared_tables() { return tc_reg_groups<BITS>() < 2; }

// Pair mode (QK_AP_PAIRS, on): in the kernels of one token block (NB = 1, up to 8 tokens), where both channel
// groups' tables are in shared memory and a code has at most 4 bits, the tables are indexed by the pair transpose
// (transpose_pairs: two adjacent columns of a run a lookup, their fp16 weights in the activations' order), so that
// each B register is an activation word as loaded (tc_b_fragments), where the nibble layout's pairs (columns r and
// r + 4) took a byte permute each. The tensor cores then see the columns in another order, so the float32 sums may
// round differently: the same bound, not the same bits. (With two token blocks the loaded words stay live longer and
// the kernels spill.) Its 4^BITS entries fit the nibble layout's tc_entries.
#ifndef QK_AP_PAIRS
#define QK_AP_PAIRS 1
#endif
template <int BITS, int NB>
QK_FN constexpr bool tc_pairs() { return QK_AP_PAIRS && NB == 1 && BITS <= 4 && tc_reg_groups<BITS>() == 0; }

// The tables in shared memory, 256 bytes an entry: entry e of channel c (of the block's 16) at byte
// 256 e + 128 (c / 8) + 16 (c % 8) + 4 copy, held 4 times, lane (g, q) of channel group h reading copy q at
// 256 e + slot, slot = 128 h + 4 lane: the 32 lanes of a lookup fall in 32 distinct banks, and a lookup's address,
// byte b of a transposed word times 256 plus the slot, is one byte permute (tc_entry_address). Entry e is the fp16
// pair of byte e = hi << 4 | lo up to 4 bits, lut[lo] | lut[hi] << 16 (nibble pairs with both codes below 2^BITS
// written; the others unused), else code e's fp16 in the low half.
constexpr int APT_ENTRY_BYTES = 256;
template <int BITS>
QK_FN constexpr int tc_entries() {
  return !tc_shared_tables<BITS>() ? 0 : BITS <= 4 ? 17 * ((1 << BITS) - 1) + 1 : 1 << BITS;
}
// Dynamic shared memory of a block of WARPS warps: the tables, at least the warps' sums (sums[warp][nb][lane][4]
// float32) that reuse it at the end.
template <int BITS, int WARPS>
QK_FN constexpr int tc_shared_bytes() {
  constexpr int tables = tc_entries<BITS>() * APT_ENTRY_BYTES, sums = WARPS * 2 * 32 * 4 * 4;
  return tables > sums ? tables : sums;
}

// A lane's tables in registers (up to 3 bits): for its channel h (g, 8 + g), the low bytes of the fp16 entries
// 0..3 (lo[h][0], byte c = entry c) and 4..7 (lo[h][1]), and likewise their high bytes: one byte permute of each
// pair of words looks up four codes at once, the selector's nibbles being the codes (bit 3, the permute's sign mode,
// is 0 below 4 bits).
struct TcRegTables {
  uint32_t lo[2][2], hi[2][2];
};

template <int BITS>
QK_FN void tc_load_reg_tables(const AnyPrecArgs& a, int n0, int lane, TcRegTables& rt) {
  if constexpr (tc_reg_tables<BITS>()) {
#pragma unroll
    for (int h = 0; h < tc_reg_groups<BITS>(); ++h) {
      const int channel = n0 + 8 * h + frag_group(lane);
      uint32_t e[4] = {0u, 0u, 0u, 0u};  // entries 2 i (low half) and 2 i + 1
      if (channel < a.n) {
        const qk_half* lut = a.lut + (size_t)channel * (1 << BITS);
        if constexpr (BITS == 3) {
          load_u128(lut, e);
        } else {
#pragma unroll
          for (int c = 0; c < 1 << BITS; ++c) e[c / 2] |= (uint32_t)lut[c] << (16 * (c % 2));
        }
      }
#pragma unroll
      for (int part = 0; part < 2; ++part) {
        rt.lo[h][part] = byte_perm(e[2 * part], e[2 * part + 1], 0x6420u);
        rt.hi[h][part] = byte_perm(e[2 * part], e[2 * part + 1], 0x7531u);
      }
    }
  }
}

// The four fp16 pairs of a transposed word t from the registers of channel h: pair b (byte b of t) is
// lut[lo nibble] | lut[hi nibble] << 16, as the shared tables' entries. Two permutes look up four codes' low and high
// bytes, two more interleave them: 9 instructions for 8 weights, no shared memory. The codes are the selectors as
// they stand (prmt, not byte_perm's masked selector): up to 3 bits, bit 3 of each nibble is clear. The permute
// reads its selector's low 4 nibbles, so the upper half's codes are t >> 16: by default a shift on the integer ALU
// (0.93-1.00x the time of the alternative on all eight rows of H100 tuning run 6), QK_AP_LOOKUP_FMA = 1 an IMAD.HI
// on the FMA pipe (bench/smallm_tune.py's AP-MULHI).
#ifndef QK_AP_LOOKUP_FMA
#define QK_AP_LOOKUP_FMA 0
#endif
QK_FN void tc_reg_lookup(const TcRegTables& rt, int h, uint32_t t, uint32_t pairs[4]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#if defined(__CUDA_ARCH__)
    const uint32_t codes = !half ? t : QK_AP_LOOKUP_FMA ? __umulhi(t, 0x10000u) : t >> 16;
#else
    const uint32_t codes = half ? t >> 16 : t;
#endif
    const uint32_t lo = prmt(rt.lo[h][0], rt.lo[h][1], codes), hi = prmt(rt.hi[h][0], rt.hi[h][1], codes);
    pairs[2 * half] = byte_perm(lo, hi, 0x5140u);
    pairs[2 * half + 1] = byte_perm(lo, hi, 0x7362u);
  }
}

// The tables of channels n0 .. n0 + 15 (those below N).
template <int BITS, int NB>
QK_FN void tc_fill_tables(const AnyPrecArgs& a, uint8_t* tables, int n0, int tid, int threads) {
  if constexpr (!tc_shared_tables<BITS>()) return;
  constexpr int items = BITS <= 4 ? 1 << (2 * BITS) : 1 << BITS;  // per channel
  for (int i = tid; i < APT_CHANNELS * items; i += threads) {
    const int ch = i / items, e = i % items;
    if (n0 + ch >= a.n || ch / 8 < tc_reg_groups<BITS>()) continue;  // past N, or a group's tables in registers
    const qk_half* lut = a.lut + (size_t)(n0 + ch) * (1 << BITS);
    uint32_t value, entry;
    if (tc_pairs<BITS, NB>()) {  // index e: plane j's bits of columns 2 i, 2 i + 1 at 2 (BITS - 1 - j) + 1, + 0
      int first = 0, second = 0;
      for (int j = 0; j < BITS; ++j) {
        first |= (e >> (2 * (BITS - 1 - j) + 1) & 1) << (BITS - 1 - j);
        second |= (e >> (2 * (BITS - 1 - j)) & 1) << (BITS - 1 - j);
      }
      value = (uint32_t)lut[first] | ((uint32_t)lut[second] << 16);
      entry = e;
    } else if (BITS <= 4) {
      const int hi = e >> BITS, lo = e & ((1 << BITS) - 1);
      value = (uint32_t)lut[lo] | ((uint32_t)lut[hi] << 16);
      entry = hi << 4 | lo;
    } else {
      value = (uint32_t)lut[e];
      entry = e;
    }
    const uint32_t copies[4] = {value, value, value, value};
    store_u128(tables + entry * APT_ENTRY_BYTES + 128 * (ch / 8) + 16 * (ch % 8), copies);
  }
}

QK_FN int tc_row_words(const AnyPrecArgs& a) { return a.k / 32; }
template <int BITS>
QK_FN int tc_steps(const AnyPrecArgs& a) { return (tc_row_words(a) + tc_step_words<BITS>() - 1) / tc_step_words<BITS>(); }

// Whether the *_fast kernels serve a shape: K a whole number of AP_CHUNK-column chunks, so that every step's words
// and runs load with no bounds checks, as immediate offsets from one address. Past N and past M they load the last
// channel's words and the last token's runs: those rows and columns of the MMAs are garbage that tc_finish never
// stores (a column of the product depends on its own column of B alone, a row on its row of A). Only the columns
// past the row would need zeros, and whole chunks have none. Their indices are 32-bit (fewer registers held across
// the loop: 64-bit row offsets, hoisted, spilled), so the first BITS planes must hold fewer than 2^32 words and the
// activations fewer than 2^32 values.
template <int BITS>
QK_FN bool tc_fast(const AnyPrecArgs& a) {
  return a.k % AP_CHUNK == 0 && (unsigned long long)BITS * a.n * tc_row_words(a) <= 0xFFFFFFFFull &&
         (unsigned long long)a.m * a.k <= 0xFFFFFFFFull;
}

// Lane (g, q)'s words L step + W q .. + W - 1 (W = tc_lane_words, L = 4 W) of channels n0 + g (w[0]) and
// n0 + 8 + g (w[1]), every plane (zero past the row or past N; FAST, in a kernel where tc_fast holds: past N the
// last channel's).
template <int BITS, bool FAST>
QK_FN void tc_load_step(const AnyPrecArgs& a, int n0, int step, int lane, uint32_t w[2][BITS][tc_lane_words<BITS>()]) {
  constexpr int W = tc_lane_words<BITS>();
  const int words = tc_row_words(a), first = tc_step_words<BITS>() * step + W * frag_quad(lane);
  if constexpr (FAST) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t row = (uint32_t)imin(n0 + 8 * h + frag_group(lane), a.n - 1) * words + first;
#pragma unroll
      for (int p = 0; p < BITS; ++p) {
        const uint32_t* src = a.planes + (row + (uint32_t)p * a.n * words);
        if constexpr (W == 4) load_u128_here(src, w[h][p]);
        else load_u64_here(src, w[h][p][0], w[h][p][1]);
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int channel = n0 + 8 * h + frag_group(lane);
#pragma unroll
      for (int p = 0; p < BITS; ++p) {
        const uint32_t* src = a.planes + ((size_t)p * a.n + (channel < a.n ? channel : 0)) * words + first;
        if (channel < a.n && words % W == 0 && first < words) {  // aligned rows
          if constexpr (W == 4) load_u128(src, w[h][p]);
          else load_u64(src, w[h][p][0], w[h][p][1]);
        } else {
#pragma unroll
          for (int i = 0; i < W; ++i) w[h][p][i] = channel < a.n && first + i < words ? src[i] : 0u;
        }
      }
    }
  }
}

// The byte offset in the tables of the entry that byte b of t names, for the lane's slot (below 256): byte b of t
// times 256 plus the slot, one byte permute (the slot's byte 1, zero, fills the top two).
QK_FN uint32_t tc_entry_address(uint32_t t, int b, uint32_t slot) { return byte_perm(t, slot, 0x5504u | b << 4); }

// The A fragments of word i of the lane's step (a[s] for MMA s), from its channels' tables (registers up to 3
// bits, else shared memory). Pair b of T_r holds columns r + 4 (low half) and r of run 3 - b.
template <int BITS, int NB>
QK_FN void tc_a_fragments(const uint8_t* tables, const TcRegTables& rt, int lane,
                          const uint32_t w[2][BITS][tc_lane_words<BITS>()], int i, uint32_t a[8][4]) {
  constexpr int lanes = transpose_lanes<BITS>();
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // channel g (a0, a2) and 8 + g (a1, a3)
    const uint32_t slot = 128 * h + 4 * lane;
    uint32_t word[BITS], t[lanes];
#pragma unroll
    for (int p = 0; p < BITS; ++p) word[p] = w[h][p][i];
    if constexpr (tc_pairs<BITS, NB>()) {  // pair b of T_i: columns 2 i (low half) and 2 i + 1 of run 3 - b
      transpose_pairs<BITS>(word, t);
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int b = 0; b < 4; ++b) a[2 * r + b / 2][2 * (b % 2) + h] = load_u32(tables + tc_entry_address(t[r], b, slot));
      continue;
    }
    transpose_words<BITS>(word, t);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      uint32_t pairs[4];  // byte b of T_r: MMA 2 r + b / 2, register 2 (b % 2) + h
      if (h < tc_reg_groups<BITS>()) {
        tc_reg_lookup(rt, h, t[r], pairs);
      } else {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          if (BITS <= 4) {
            pairs[b] = load_u32(tables + tc_entry_address(t[r], b, slot));
          } else {
            const uint32_t col_r = load_u32(tables + tc_entry_address(t[r], b, slot));
            const uint32_t col_r4 = load_u32(tables + tc_entry_address(t[r + 4], b, slot));
            pairs[b] = byte_perm(col_r4, col_r, 0x5410u);
          }
        }
      }
#pragma unroll
      for (int b = 0; b < 4; ++b) a[2 * r + b / 2][2 * (b % 2) + h] = pairs[b];
    }
  }
}

// The activations of word i of the lane's step for token `token`: run j (0..3) holds columns j W / 4 + 8 t .. + 7
// of the word's chunk (W its width, t the word's index in it), one 16-byte load each; zero past M or past the row
// (FAST, in a kernel where tc_fast holds: past M the last token's). A lane's words of a step lie in one chunk (a
// step's words divide the chunk's 32), so in a fast step word i's runs are 16 i bytes on from its first word's.
template <int BITS, bool FAST>
QK_FN void tc_load_runs(const AnyPrecArgs& a, int step, int lane, int i, int token, uint32_t run[4][4]) {
  const int first = tc_step_words<BITS>() * step + tc_lane_words<BITS>() * frag_quad(lane), word = first + i;
  if constexpr (FAST) {
    const qk_half* row = a.x + ((uint32_t)imin(token, a.m - 1) * a.k + (first / 32) * AP_CHUNK + 8 * (first % 32));
#pragma unroll
    for (int j = 0; j < 4; ++j) load_u128_here(row + 8 * i + j * (AP_CHUNK / 4), run[j]);
  } else if (token >= a.m || word >= tc_row_words(a)) {
#pragma unroll
    for (int j = 0; j < 4; ++j) run[j][0] = run[j][1] = run[j][2] = run[j][3] = 0u;
  } else {
    const int c = word / 32, t = word % 32, width = chunk_width(a, c);
    const qk_half* row = a.x + (size_t)token * a.k + (size_t)c * AP_CHUNK + 8 * t;
#pragma unroll
    for (int j = 0; j < 4; ++j) load_u128(row + j * (width / 4), run[j]);
  }
}

// The B fragments (b[s] for MMA s) from a word's runs: the pair of columns e = r + 4 (low half) and r of run j,
// as the A fragments, is halves r % 2 of its words 2 + r / 2 and r / 2; in pair mode (PAIRS, tc_pairs) columns
// 2 r and 2 r + 1, its word r as loaded.
template <bool PAIRS>
QK_FN void tc_b_fragments(const uint32_t run[4][4], uint32_t b[8][2]) {
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const int r = s / 2;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int j = 3 - (2 * (s % 2) + half);
      b[s][half] = PAIRS ? run[j][r] : byte_perm(run[j][2 + r / 2], run[j][r / 2], r % 2 ? 0x7632u : 0x5410u);
    }
  }
}

// The WARPS warps' sums (sums[warp][nb][lane][4], in shared memory) added in warp order: outputs o = tid, tid +
// 32 WARPS, .. of the block's 16 x 16 tile, each rounded once to fp16. Lane (g, q)'s accumulators of n8 block nb:
// (channel g, tokens 2 q, 2 q + 1), (channel 8 + g, the same).
template <int WARPS>
QK_FN void tc_finish(const AnyPrecArgs& a, const float* sums, int n0, int m0, int tid) {
  for (int o = tid; o < APT_CHANNELS * APT_TOKENS; o += 32 * WARPS) {
    const int nb = o / 128, lane = o / 4 % 32, i = o % 4;
    const int channel = n0 + frag_group(lane) + 8 * (i >> 1), token = m0 + 8 * nb + 2 * frag_quad(lane) + (i & 1);
    if (channel >= a.n || token >= a.m) continue;
    float sum = 0.0f;
    for (int warp = 0; warp < WARPS; ++warp) sum = fadd(sum, sums[((warp * 2 + nb) * 32 + lane) * 4 + i]);
    a.out[(size_t)token * a.n + channel] = float_to_half(sum);
  }
}

}  // namespace qk

#ifndef QK_HOST
// NB token blocks of 8 a tile: 1 for the kernels of up to 8 tokens (anyprec_gemm_tc8_*, fewer registers), 2 for
// any number (anyprec_gemm_tc_*). Where the registers allow two steps' words at 2 blocks an SM (tc_prefetch), a
// warp's next step's plane words are in flight while this one's are decoded (H200, 4096 x 14336, M = 1: 16.8-17.3 us
// in two runs against 18.8 us in the run before). Blocks that took several tiles each, the next tile's words in
// flight likewise, were 4% faster at N = 28672 and 10% slower at 6144 (bench/results/kernels_h200_smallm_tune.json,
// run 8), and are not kept.
template <int BITS, int NB>
QK_FN constexpr bool tc_prefetch() { return NB == 1 && BITS <= 4; }
// In the fast kernels the next step's words are loaded during word tc_prefetch_word of this step, not before its
// word 0: their registers then overlap less with this step's, which the fast kernels need to stay within 128
// without spills (word 1 spilled at 3 and 4 bits, word 2 at 4 bits). QK_AP_PREFETCH_WORD sets it for every width.
template <int BITS>
QK_FN constexpr int tc_prefetch_word() {
#ifdef QK_AP_PREFETCH_WORD
  return QK_AP_PREFETCH_WORD;
#else
  return BITS >= 4 ? 3 : 2;
#endif
}

// The second token block's activations of a word (kernels of two token blocks, 9 tokens on), loaded before the
// word's A fragments are decoded, in flight during the decode, where they were loaded after the first block's
// MMAs and waited for (the fast kernels' loads are volatile asm, which the compiler keeps in place): up to
// QK_AP_EARLY_RUNS bits (0 by default: bench/smallm_tune.py's AP-EARLY, 3). Above 3 bits the fast kernels then
// spill (sm_90a, nvcc 13.0); at 3 the same 128 registers. The same MMAs on the same operands: the same bits.
#ifndef QK_AP_EARLY_RUNS
#define QK_AP_EARLY_RUNS 0
#endif
template <int BITS, int NB>
QK_FN constexpr bool tc_early_runs() { return NB == 2 && BITS <= QK_AP_EARLY_RUNS; }

// FAST (the anyprec_gemm_tc*_fast kernels, where tc_fast holds): every step with the unchecked loaders. A kernel
// of its own, not a branch in one kernel: the two loops in one kernel took 128 registers and spilled. WARPS: the
// block's warps, which take turns at the tile's K steps.
template <int BITS, int NB, bool FAST, int WARPS>
__device__ __forceinline__ void anyprec_gemm_tc_at(const qk::AnyPrecArgs& a, uint8_t* smem) {
  using namespace qk;
  constexpr int W = tc_lane_words<BITS>();
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n0 = APT_CHANNELS * blockIdx.x, m0 = APT_TOKENS * blockIdx.z, steps = tc_steps<BITS>(a);
  const int blocks_n = a.m - m0 > 8 ? NB : 1, token0 = m0 + frag_group(lane);
  uint32_t w[2][BITS][W], run[4][4];
  TcRegTables rt;
  QK_STAMP(QK_T_START);
  if (warp < steps) {  // in flight while the tables fill
    tc_load_step<BITS, FAST>(a, n0, warp, lane, w);
    tc_load_runs<BITS, FAST>(a, warp, lane, 0, token0, run);
  }
  tc_load_reg_tables<BITS>(a, n0, lane, rt);
  if constexpr (tc_shared_tables<BITS>()) {
    tc_fill_tables<BITS, NB>(a, smem, n0, tid, 32 * WARPS);
    __syncthreads();
  }
  float acc[2][4] = {};
  for (int step = warp; step < steps; step += WARPS) {
    const bool more = step + WARPS < steps;
    uint32_t next[2][BITS][W];
    if constexpr (!tc_prefetch<BITS, NB>()) {
      if (step != warp) tc_load_step<BITS, FAST>(a, n0, step, lane, w);
    } else if constexpr (!FAST) {
      if (more) tc_load_step<BITS, FAST>(a, n0, step + WARPS, lane, next);
    }
#pragma unroll
    for (int i = 0; i < W; ++i) {
      if constexpr (tc_prefetch<BITS, NB>() && FAST) {
        if (i == tc_prefetch_word<BITS>() && more) tc_load_step<BITS, FAST>(a, n0, step + WARPS, lane, next);
      }
      uint32_t fa[8][4], fb[8][2];
      tc_b_fragments<tc_pairs<BITS, NB>()>(run, fb);
      // the first token block's activations of the lane's next word, in flight during this word's MMAs: this
      // step's next word or the first of the warp's next step (H200: 1.5-5% faster than loading each word's when
      // its MMAs need them, bench/results/kernels_h200_anyprec_xahead.json)
      if (i + 1 < W) tc_load_runs<BITS, FAST>(a, step, lane, i + 1, token0, run);
      else if (more) tc_load_runs<BITS, FAST>(a, step + WARPS, lane, 0, token0, run);
      uint32_t run1[4][4];  // tokens 8 .. 15 of the tile
      if constexpr (tc_early_runs<BITS, NB>()) {
        if (blocks_n == 2) tc_load_runs<BITS, FAST>(a, step, lane, i, token0 + 8, run1);
      }
      tc_a_fragments<BITS, NB>(smem, rt, lane, w, i, fa);
#pragma unroll
      for (int s = 0; s < 8; ++s) mma_f16(acc[0], fa[s], fb[s]);
      if (NB == 2 && blocks_n == 2) {
        if constexpr (!tc_early_runs<BITS, NB>()) tc_load_runs<BITS, FAST>(a, step, lane, i, token0 + 8, run1);
        tc_b_fragments<tc_pairs<BITS, NB>()>(run1, fb);
#pragma unroll
        for (int s = 0; s < 8; ++s) mma_f16(acc[1], fa[s], fb[s]);
      }
      if (i == 0 && step == warp) QK_STAMP(QK_T_FIRST);
    }
    if constexpr (tc_prefetch<BITS, NB>()) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int p = 0; p < BITS; ++p)
#pragma unroll
          for (int i = 0; i < W; ++i) w[h][p][i] = next[h][p][i];
    }
  }
  QK_STAMP(QK_T_LOOP);
  if constexpr (tc_shared_tables<BITS>()) __syncthreads();  // the tables' last reader done: the sums take their place
  float* sums = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) sums[((warp * 2 + nb) * 32 + lane) * 4 + i] = acc[nb][i];
  __syncthreads();
  QK_STAMP(QK_T_REDUCED);
  tc_finish<WARPS>(a, sums, n0, m0, tid);
  QK_STAMP(QK_T_STORED);
}

// One kernel per width and token blocks, anyprec_gemm_tc_1 .. _8 (any M) and anyprec_gemm_tc8_1 .. _8 (M <= 8), and
// each again as *_fast for K % AP_CHUNK == 0 (tc_fast), so that each has its own register budget (one kernel
// for all widths takes the widest's): at most 128 registers, for 16 warps an SM (2 blocks of 8), where that needs no
// spills (all but 8 bits); the fast ones up to 3 bits also as *_fast_w4, blocks of APT_FEW_WARPS for short K
// (QK_AP_TC_ALL). grid (ceil(N / 16), 1, ceil(M / 16)), block 32 WARPS, dynamic shared memory
// tc_shared_bytes<B, WARPS>().
#define QK_AP_TC_KERNEL(NAME, B, NB, FAST, WARPS)                                                                  \
  extern "C" __global__ void __launch_bounds__(32 * (WARPS), (B <= 7 ? 16 : 8) / (WARPS)) NAME(                   \
      const qk_half* x, const uint32_t* planes, const qk_half* lut, qk_half* out, int m, int n, int k) {            \
    extern __shared__ uint4 qk_apt_smem[];                                                                          \
    anyprec_gemm_tc_at<B, NB, FAST, WARPS>(qk::AnyPrecArgs{x, planes, lut, out, m, n, k, B},                       \
                                           reinterpret_cast<uint8_t*>(qk_apt_smem));                                \
  }
QK_AP_TC_ALL(QK_AP_TC_KERNEL)

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
  constexpr int AP_AHEAD = qk::ap_ahead(BITS);
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
