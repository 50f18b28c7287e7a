// quantkit's warp simulator: runs the kernels' own lane functions (the .cu files, built with QK_HOST) on the CPU,
// one simulated warp at a time, with the tensor-core MMA computed from the lanes' fragments exactly as the PTX ISA
// defines them. The GPU-only parts (launch, the mma.sync instruction itself) are what it cannot check.
//   g++ -O2 -std=c++17 -ffp-contract=off -fPIC -shared host_sim.cpp -o libqk_host.so
#define QK_HOST
#include "anyprec_gemv.cu"
#include "atom_w4a4.cu"
#include "liquidquant_w4a8.cu"
#include "qqq_w4a8.cu"
#include "qserve_w4a8.cu"

#include <algorithm>
#include <cstring>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

namespace {

// A kernel doing what the simulator cannot model is a bug in the kernel source: the twin stops, and its entry point
// (guarded) hands `what` to quantkit.kernels, which raises it, so that one launch fails and not the whole process.
struct SimFailure {
  const char* what;
};
[[noreturn]] void fail(const char* what) { throw SimFailure{what}; }

// Why the last twin this thread called stopped (qk_sim_failure), empty when it ran to the end: per thread, as
// ctypes releases the GIL for the call.
thread_local std::string last_failure;

// Runs a twin's body, catching what stops it (fail, or the allocator) into last_failure: a C++ exception must not
// cross the extern "C" boundary into ctypes.
template <class Body>
void guarded(Body body) noexcept {
  last_failure.clear();
  try {
    body();
  } catch (const SimFailure& failure) {
    last_failure = failure.what;
  } catch (const std::exception& error) {
    last_failure = error.what();
  }
}

// Copies into a slot of a bulk kernel's host twin: each checked to stay inside the slot in 16-byte units from a
// 16-byte-aligned source, as cp.async.bulk requires.
void bulk_copy_host(std::vector<uint8_t>& slot, int offset, const void* src, int bytes) {
  if (offset < 0 || offset % 16 || bytes <= 0 || bytes % 16 || offset + bytes > (int)slot.size() ||
      reinterpret_cast<uintptr_t>(src) % 16)
    fail("bulk: a copy outside its slot, or not in 16-byte units");
  std::memcpy(slot.data() + offset, src, (size_t)bytes);
}

// The host side of bulk_steps: copy i of `copies` walks its range of `steps` (copy_range) in chunks of `chunk`, each
// chunk's copies (copies(s0, cnt, emit)) done into `slot`, first filled with garbage so that a step reading a byte no
// copy wrote shows, then run(s0, u) for each of its steps.
template <class Copies, class Run>
void bulk_walk_host(std::vector<uint8_t>& slot, int chunk, int i, int n_copies, int steps, Copies copies, Run run) {
  int begin, end;
  qk::copy_range(i, n_copies, steps, begin, end);
  for (int s0 = begin; s0 < end; s0 += chunk) {
    const int cnt = std::min(chunk, end - s0);
    std::fill(slot.begin(), slot.end(), 0xA5);
    copies(s0, cnt, [&](int offset, const void* src, int bytes) { bulk_copy_host(slot, offset, src, bytes); });
    for (int u = 0; u < cnt; ++u) run(s0, u);
  }
}

// A copy's K steps first, first + stride, ... < steps through the kernels' own pipelined_steps<U>, in its rounds and
// order: run(step) for each. Each step's "loads" (its index) are checked to be of a step that exists (the kernel's
// would read past its arrays) and to be the ones its computation reads.
template <int U, class Run>
void walk_steps(int first, int stride, int steps, Run run) {
  ::pipelined_steps<U, int>(
      first, stride, steps,
      [&](int step, int& loaded) {
        if (step < 0 || step >= steps) fail("pipelined_steps: loads of a step past the last");
        loaded = step;
      },
      [&](int step, const int& loaded) {
        if (loaded != step) fail("pipelined_steps: a step computed from another step's loads");
        run(step);
      });
}

// The meeting of a block's `splits` copies as splitk_begin and splitk_reduce hold it (RED: QK_SPLITK_RED for the
// register kernels; the bulk ones store), through the kernels' own phases on as many slots as they meet in (one under
// RED, else one a copy but the first: splitk_slots): mine(copy, t) points at thread t's COUNT sums in a copy, and
// copy 0's become the block's. The slots start as garbage (a slot RED did not clear shows), with the words up to a
// copy's slot for every copy after them kept as a canary (a post outside the slots shows).
template <int COUNT, bool RED, class Mine>
void splitk_meet_host(int threads, int splits, Mine mine) {
  if (splits == 1) return;
  constexpr int32_t garbage = (int32_t)0xA5A5A5A5u, canary = 0x5A5A5A5A;
  const size_t words = (size_t)qk::splitk_slots(splits, RED) * COUNT * threads;
  std::vector<int32_t> partials((size_t)splits * COUNT * threads, canary);
  std::fill(partials.begin(), partials.begin() + (std::ptrdiff_t)words, garbage);
  if (RED)
    for (int t = 0; t < threads; ++t) qk::splitk_clear<COUNT>(partials.data(), t, threads);
  for (int copy = 1; copy < splits; ++copy)
    for (int t = 0; t < threads; ++t) qk::splitk_post<COUNT, RED>(partials.data(), mine(copy, t), t, copy, threads);
  if (std::any_of(partials.begin() + (std::ptrdiff_t)words, partials.end(), [&](int32_t w) { return w != canary; }))
    fail("split-K: a copy's sums posted outside the block's slots");
  for (int t = 0; t < threads; ++t) qk::splitk_collect<COUNT, RED>(mine(0, t), partials.data(), t, threads, splits);
}

// How a small-M launch splits K over a tile's blocks: `zsplit` blocks (blockIdx.z), meeting in `sums` and `arrived`
// (quantkit.kernels.meeting_point; null when zsplit is 1, and for a cluster build, whose blocks meet in the leader's
// shared memory: the simulator meets those through a workspace of its own).
struct BlockSplit {
  int zsplit;
  int32_t* sums;
  int32_t* arrived;
};

// The blocks of a small-M launch of gx x gy tiles, each tile split over split.zsplit blocks, run in the order z, then
// tile, so that every tile's first blocks have met in the workspace before any tile's last: block(bx, by, z) computes
// block z of tile (bx, by), meets its copies and returns lane(l), where copy 0's lane l holds its COUNT sums; those
// meet through splitk_blocks's own phases (slots and count by splitk_tile, the last block takes the totals), and
// store(bx, by) runs in the tile's last block. The workspace must be zero before the launch and is checked to be left
// zero for the next.
template <int COUNT, class Block, class Store>
void block_split_host(int gx, int gy, BlockSplit split, Block block, Store store) {
  const size_t words = (size_t)gx * gy * COUNT * 32, counts = (size_t)gx * gy;
  std::vector<int32_t> own;
  if (split.zsplit > 1 && split.sums == nullptr) {
    own.assign(words + counts, 0);
    split.sums = own.data();
    split.arrived = own.data() + words;
  }
  const auto zero = [&]() {
    return split.zsplit == 1 || (std::all_of(split.sums, split.sums + words, [](int32_t w) { return w == 0; }) &&
                                 std::all_of(split.arrived, split.arrived + counts, [](int32_t c) { return c == 0; }));
  };
  if (!zero()) fail("split-K across blocks: the launch's workspace is not zero");
  for (int z = 0; z < split.zsplit; ++z)
    for (int by = 0; by < gy; ++by)
      for (int bx = 0; bx < gx; ++bx) {
        const auto lane = block(bx, by, z);
        if (split.zsplit > 1) {
          const int tile = qk::splitk_tile((unsigned)bx, (unsigned)by, (unsigned)gx);
          if (tile < 0 || tile >= gx * gy) fail("split-K across blocks: a tile's slots outside the workspace");
          int32_t* mine = qk::splitk_tile_sums<COUNT>(split.sums, tile);
          for (int l = 0; l < 32; ++l) qk::splitk_blocks_post<COUNT>(mine, lane(l), l);
          if (!qk::splitk_blocks_arrive(split.arrived, tile, split.zsplit)) continue;
          for (int l = 0; l < 32; ++l) qk::splitk_blocks_take<COUNT>(lane(l), mine, split.arrived, tile, l);
        }
        store(bx, by);
      }
  if (!zero()) fail("split-K across blocks: the workspace is not left zero for the next launch");
}

int8_t byte_of(uint32_t word, int e) { return (int8_t)((word >> (8 * e)) & 0xFFu); }

// D = A B + C for one warp's mma.m16n8k32.row.col.s32.s8.s8.s32, from the fragment definitions of the PTX ISA:
// A element a_i (i = 0..15, byte i % 4 of register i / 4): row = group (+8 when 4 <= i < 8 or i >= 12),
// col = 4 * quad + (i & 3) (+16 when i >= 8); B element b_i (i = 0..7): row = 4 * quad + (i & 3) (+16 when
// i >= 4), col = group; C element c_i: row = group (+8 when i >= 2), col = 2 * quad + (i & 1). The int32 sums wrap.
void mma_warp(int32_t c[32][4], const uint32_t a[32][4], const uint32_t b[32][2]) {
  int8_t A[16][32], B[32][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 16; ++i) {
      const int row = g + (((i >= 4 && i < 8) || i >= 12) ? 8 : 0), col = 4 * q + (i & 3) + (i >= 8 ? 16 : 0);
      A[row][col] = byte_of(a[lane][i / 4], i % 4);
    }
    for (int i = 0; i < 8; ++i) B[4 * q + (i & 3) + (i >= 4 ? 16 : 0)][g] = byte_of(b[lane][i / 4], i % 4);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0), col = 2 * q + (i & 1);
      uint32_t sum = (uint32_t)c[lane][i];
      for (int k = 0; k < 32; ++k) sum += (uint32_t)((int32_t)A[row][k] * (int32_t)B[k][col]);
      c[lane][i] = (int32_t)sum;
    }
  }
}

// D = A B + C for one warp's mma.m16n8k16.row.col.s32.s8.s8.s32 (PTX ISA fragments): A element a_i (i = 0..7):
// row = group (+8 when i >= 4), col = 4 * quad + (i & 3); B element b_i (i = 0..3): row = 4 * quad + i,
// col = group; C as for m16n8k32.
void mma_warp_k16(int32_t c[32][4], const uint32_t a[32][2], const uint32_t b[32]) {
  int8_t A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 8; ++i) A[g + (i >= 4 ? 8 : 0)][4 * q + (i & 3)] = byte_of(a[lane][i / 4], i % 4);
    for (int i = 0; i < 4; ++i) B[4 * q + i][g] = byte_of(b[lane], i);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0), col = 2 * q + (i & 1);
      uint32_t sum = (uint32_t)c[lane][i];
      for (int k = 0; k < 16; ++k) sum += (uint32_t)((int32_t)A[row][k] * (int32_t)B[k][col]);
      c[lane][i] = (int32_t)sum;
    }
  }
}

int nibble_of(uint32_t word, int e) {  // two's-complement INT4, element e in bits 4e .. 4e + 3
  const int v = (int)((word >> (4 * e)) & 0xFu);
  return v >= 8 ? v - 16 : v;
}

// D = A B + C for one warp's mma.m16n8k64.row.col.s32.s4.s4.s32 (PTX ISA fragments): A element a_i (i = 0..31,
// nibble i % 8 of register i / 8): row = group (+8 when 8 <= i < 16 or i >= 24), col = 8 * quad + (i & 7) (+32 when
// i >= 16); B element b_i (i = 0..15): row = 8 * quad + (i & 7) (+32 when i >= 8), col = group; C as for k32.
void mma_warp_s4(int32_t c[32][4], const uint32_t a[32][4], const uint32_t b[32][2]) {
  int A[16][64], B[64][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 32; ++i) {
      const int row = g + (((i >= 8 && i < 16) || i >= 24) ? 8 : 0), col = 8 * q + (i & 7) + (i >= 16 ? 32 : 0);
      A[row][col] = nibble_of(a[lane][i / 8], i % 8);
    }
    for (int i = 0; i < 16; ++i) B[8 * q + (i & 7) + (i >= 8 ? 32 : 0)][g] = nibble_of(b[lane][i / 8], i % 8);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0), col = 2 * q + (i & 1);
      uint32_t sum = (uint32_t)c[lane][i];
      for (int k = 0; k < 64; ++k) sum += (uint32_t)(A[row][k] * B[k][col]);
      c[lane][i] = (int32_t)sum;
    }
  }
}

// One warp's INT4 MMA as the kernels run it on Hopper and later (QK_INT4_AS_INT8): two INT8 m16n8k32 MMAs on 16
// times the codes (int4_half_as_int8), so c += 2^QK_INT4_SHIFT A B.
void mma_warp_int4(int32_t c[32][4], const uint32_t a[32][4], const uint32_t b[32][2]) {
  for (int h = 0; h < 2; ++h) {
    uint32_t a8[32][4], b8[32][2];
    for (int lane = 0; lane < 32; ++lane) qk::int4_half_as_int8(a[lane], b[lane], h, a8[lane], b8[lane]);
    mma_warp(c, a8, b8);
  }
}

// Why the last twin called stopped, or "" when it ran to the end: quantkit.kernels.run raises it.
extern "C" const char* qk_sim_failure() { return last_failure.c_str(); }

// The host twins of prmt and byte_perm, for tests that hold them to the PTX ISA and CUDA definitions: a selector
// nibble's bit 3 set is one no kernel uses today, so only such a test shows a twin that ignores it.
extern "C" uint32_t qk_prmt(uint32_t a, uint32_t b, uint32_t selector) { return qk::prmt(a, b, selector); }
extern "C" uint32_t qk_byte_perm(uint32_t a, uint32_t b, uint32_t selector) { return qk::byte_perm(a, b, selector); }

// How many of `trials` random INT4 MMAs (fragments from an LCG seeded with `seed`) give other int32 sums through
// mma_warp_int4, shifted back by int4_sum, than through the PTX ISA's mma.m16n8k64 .s4 (mma_warp_s4), or sums
// that are not multiples of 2^QK_INT4_SHIFT: 0 when the INT8 rewrite pairs every k of A with the same k of B.
extern "C" int qk_int4_as_int8_mismatches(int trials, unsigned seed) {
  uint32_t state = seed;
  auto next = [&]() { state = state * 1664525u + 1013904223u; return state; };
  int mismatches = 0;
  for (int t = 0; t < trials; ++t) {
    uint32_t a[32][4], b[32][2];
    int32_t c1[32][4], c2[32][4];
    for (int lane = 0; lane < 32; ++lane) {
      for (int r = 0; r < 4; ++r) a[lane][r] = next();
      for (int r = 0; r < 2; ++r) b[lane][r] = next();
      for (int r = 0; r < 4; ++r) c1[lane][r] = c2[lane][r] = 0;
    }
    mma_warp_s4(c1, a, b);
    mma_warp_int4(c2, a, b);
    bool same = true;
    for (int lane = 0; lane < 32; ++lane)
      for (int r = 0; r < 4; ++r)
        same = same && qk::int4_sum(c2[lane][r]) == c1[lane][r] && c2[lane][r] % (1 << QK_INT4_SHIFT) == 0;
    mismatches += !same;
  }
  return mismatches;
}

// D = A B + C for one warp's mma.m16n8k16.row.col.f32.f16.f16.f32 (PTX ISA fragments: A register r of lane 4 g + q
// holds row g (+8 for r odd) at k 2 q, 2 q + 1 (+8 for r >= 2); B register r holds k 2 q, 2 q + 1 (+8 for r = 1)
// of column g; C as for the integer MMAs). Each sum in double, rounded once to float: a model of the tensor cores,
// whose own float32 accumulation rounds differently, so that kernel is checked within a bound, not bit for bit.
void mma_warp_f16(float c[32][4], const uint32_t a[32][4], const uint32_t b[32][2]) {
  double A[16][16], B[16][8];
  auto half = [](uint32_t reg, int e) { return (double)qk::half_to_float((qk_half)(reg >> (16 * e))); };
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, q = lane & 3;
    for (int r = 0; r < 4; ++r)
      for (int e = 0; e < 2; ++e) A[g + 8 * (r & 1)][2 * q + e + 8 * (r >> 1)] = half(a[lane][r], e);
    for (int r = 0; r < 2; ++r)
      for (int e = 0; e < 2; ++e) B[2 * q + e + 8 * r][g] = half(b[lane][r], e);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i >> 1), col = 2 * q + (i & 1);
      double sum = c[lane][i];
      for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
      c[lane][i] = (float)sum;
    }
  }
}

// One warp's ldmatrix.x4 (PTX ISA): lane l receives, of each matrix j, the 4 bytes 4 (l % 4) .. of the row that
// lane 8 j + l / 4 addressed (`rows`: byte offsets into `smem`).
void ldsm_x4_warp(uint32_t d[32][4], const uint8_t* smem, const int rows[32]) {
  for (int lane = 0; lane < 32; ++lane)
    for (int j = 0; j < 4; ++j) d[lane][j] = qk::load_u32(smem + rows[8 * j + lane / 4] + 4 * (lane % 4));
}

// One ldmatrix.x4 of the warp (A or B fragments): `row_of(lane)` is the offset lane gives.
template <class RowOf>
void ldsm_x4_lanes(uint32_t d[32][4], const uint8_t* smem, RowOf row_of) {
  int rows[32];
  for (int lane = 0; lane < 32; ++lane) rows[lane] = row_of(lane);
  ldsm_x4_warp(d, smem, rows);
}

// acc[lane].c[i][j] += A B for one warp's integer MMA `mma` (mma_warp or one of its kin), through [32][4]
// accumulators.
template <class Mma, class Acc, class A, class B>
void mma_into(Mma mma, Acc* acc, int i, int j, const A& a, const B& b) {
  int32_t c[32][4];
  for (int lane = 0; lane < 32; ++lane) std::memcpy(c[lane], acc[lane].c[i][j], sizeof(c[lane]));
  mma(c, a, b);
  for (int lane = 0; lane < 32; ++lane) std::memcpy(acc[lane].c[i][j], c[lane], sizeof(c[lane]));
}

// The host twin of tiled_gemm (qk_common.cuh): the same ring of T::STAGES stages, each stage's copies complete as
// they are issued (so a copy into a slot still in use would show), then the warps of the block one after another
// (`compute(stage, kt, warp, acc of its 32 lanes)`), then every thread's store.
template <class T, class Args, class Compute>
void tiled_host(const Args& args, Compute compute) {
  constexpr int warps = T::THREADS / 32;
  std::vector<uint8_t> smem((size_t)T::STAGES * T::STAGE_BYTES);
  std::vector<typename T::Acc> acc(T::THREADS);
  const int steps = T::steps(args);
  auto copy = [&](int m0, int n0, int kt) {
    for (int tid = 0; tid < T::THREADS; ++tid)
      T::copy_stage(args, smem.data() + (size_t)(kt % T::STAGES) * T::STAGE_BYTES, m0, n0, kt, tid);
  };
  for (int m0 = 0; m0 < args.m; m0 += T::BM) {
    for (int n0 = 0; n0 < args.n; n0 += T::BN) {
      std::memset(acc.data(), 0, acc.size() * sizeof(acc[0]));
      std::fill(smem.begin(), smem.end(), 0xA5);  // no stage starts from what an earlier block left
      for (int s = 0; s < T::STAGES - 1 && s < steps; ++s) copy(m0, n0, s);
      for (int kt = 0; kt < steps; ++kt) {
        if (kt + T::STAGES - 1 < steps) copy(m0, n0, kt + T::STAGES - 1);
        const uint8_t* stage = smem.data() + (size_t)(kt % T::STAGES) * T::STAGE_BYTES;
        for (int w = 0; w < warps; ++w) compute(stage, kt, w, &acc[32 * w]);
      }
      for (int t = 0; t < T::THREADS; ++t) T::store(args, m0, n0, t / 32, t % 32, acc[t]);
    }
  }
}

// One warpgroup's wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 with A from registers and B from shared
// memory, from the PTX ISA's definitions (and CUTLASS's ALayout_64x32 / CLayout_64xN, which agree):
//  - A [64 x 32]: thread t (warp w = t / 32, lane 4 g + q), register r, byte e holds row 16 w + g (+ 8 for r odd),
//    k 4 q + e (+ 16 for r >= 2);
//  - B [32 x 128] K-major through descriptor `desc`: element (k, n) at start + (n / 8) SBO + (n % 8) R + k, with
//    R = 64 bytes per row for the 64-byte swizzle (the only mode modelled; LBO unused), then the swizzle of the
//    address bits, bits 4-5 ^= bits 7-8 (CUTLASS Swizzle<2,4,3>);
//  - D [64 x 128]: thread t, register 4 j + 2 h + e: row 16 w + g + 8 h, column 8 j + 2 q + e.
// D = A B, plus D when `accumulate`; the int32 sums wrap.
void wgmma_warpgroup(int32_t d[128][64], const uint32_t a[128][4], const uint8_t* smem, size_t smem_bytes,
                     uint64_t desc, bool accumulate) {
  const uint32_t start = (uint32_t)(desc & 0x3FFFu) << 4, lbo = (uint32_t)((desc >> 16) & 0x3FFFu) << 4;
  const uint32_t sbo = (uint32_t)((desc >> 32) & 0x3FFFu) << 4, base_offset = (uint32_t)(desc >> 49) & 7u;
  const int mode = (int)(desc >> 62);
  if (mode != 2 || lbo != 16 || sbo != 512 || base_offset != 0) fail("wgmma: a descriptor the model does not cover");
  int8_t A[64][32], B[128][32];
  for (int t = 0; t < 128; ++t) {
    const int w = t / 32, g = (t % 32) >> 2, q = t & 3;
    for (int r = 0; r < 4; ++r)
      for (int e = 0; e < 4; ++e) A[16 * w + g + 8 * (r & 1)][4 * q + e + 16 * (r >> 1)] = byte_of(a[t][r], e);
  }
  for (int n = 0; n < 128; ++n) {
    for (int k = 0; k < 32; ++k) {
      uint32_t addr = start + (uint32_t)(n / 8) * sbo + (uint32_t)(n % 8) * 64 + (uint32_t)k;
      addr ^= ((addr >> 7) & 3u) << 4;
      if (addr >= smem_bytes) fail("wgmma: B operand outside shared memory");
      B[n][k] = (int8_t)smem[addr];
    }
  }
  for (int t = 0; t < 128; ++t) {
    const int w = t / 32, g = (t % 32) >> 2, q = t & 3;
    for (int i = 0; i < 64; ++i) {
      const int row = 16 * w + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * q + (i & 1);
      uint32_t sum = accumulate ? (uint32_t)d[t][i] : 0u;
      for (int k = 0; k < 32; ++k) sum += (uint32_t)((int32_t)A[row][k] * (int32_t)B[col][k]);
      d[t][i] = (int32_t)sum;
    }
  }
}

// The host twin of wgmma_gemm (qk_common.cuh) for layout F: the same ring, copies issued LEAD steps ahead, each
// step's A fragments loaded by every thread, and its wgmmas run as late as the kernel allows: when the next step's
// copy has been issued where that copy goes into another step's slot (LEAD <= STAGES - 2; the latest moment
// wgmma_wait<1> would allow), else before it. A copy into a stage still being read would show. Shared
// address 0 is the ring's start (aligned, as the kernel aligns it); the accumulators start as garbage, which the
// first wgmma of each sum must ignore. The accumulators of the tile's 128-token half h (H = 2: 256 tokens a block)
// are acc[h THREADS + t][64] for thread t.
template <class F, int W = 1, int H = 1, int S = QK_WGMMA_STAGES, int L = QK_WGMMA_LEAD>
void wgmma_host(const typename F::Args& args, const qk::StreamK* sk = nullptr) {
  using T = qk::WgmmaTiles<F, W, H, S, L>;
  constexpr int KS = T::BK / 32;
  std::vector<uint8_t> smem((size_t)T::STAGES * T::STAGE_BYTES);
  std::vector<int32_t> acc((size_t)H * T::THREADS * 64);
  std::vector<uint32_t> fa((size_t)T::THREADS * KS * 4);
  const int all_steps = T::steps(args), tiles_n = args.n / T::BN, tiles = tiles_n * ((args.m + T::BM - 1) / T::BM);
  int k0 = 0;
  auto copy = [&](int m0, int n0, int kt) {  // the block's step kt: K step k0 + kt, into its slot of the ring
    for (int tid = 0; tid < T::THREADS; ++tid)
      T::copy_stage(args, smem.data() + (size_t)(kt % T::STAGES) * T::STAGE_BYTES, m0, n0, k0 + kt, tid);
  };
  auto run_wgmmas = [&](int kt) {  // every warpgroup, step kt, from the fragments loaded at step kt
    for (int wg = 0; wg < T::THREADS / 128; ++wg) {
      for (int kk = 0; kk < KS; ++kk) {
        uint32_t a[128][4];
        for (int t = 0; t < 128; ++t) std::memcpy(a[t], &fa[((size_t)(128 * wg + t) * KS + kk) * 4], sizeof(a[t]));
        for (int h = 0; h < H; ++h)
          wgmma_warpgroup(reinterpret_cast<int32_t(*)[64]>(&acc[((size_t)h * T::THREADS + 128 * wg) * 64]), a,
                          smem.data(), smem.size(), T::b_desc((uint32_t)((kt % T::STAGES) * T::STAGE_BYTES), kk, h),
                          kt > 0 || kk > 0);
      }
    }
  };
  // The blocks in grid order: each tile whole, or with `sk` as qk::streamk_work assigns them (the tail's tiles in
  // two halves of their K steps). On the device either half may arrive first: here the first half does on even
  // tiles of the tail, the second on odd ones.
  const int blocks = sk ? sk->from + 2 * (tiles - sk->from) : tiles;
  for (int i = 0; i < blocks; ++i) {
    const int pair = sk && i >= sk->from ? (i - sk->from) / 2 : 0;
    const int b = pair % 2 ? sk->from + 2 * pair + 1 - (i - sk->from) % 2 : i;  // odd tail tiles: second half first
    const qk::BlockWork work = sk ? qk::streamk_work(b, sk->from, all_steps) : qk::BlockWork{b, 0, all_steps, -1};
    const int m0 = T::BM * (work.tile / tiles_n), n0 = T::BN * (work.tile % tiles_n), steps = work.k_end - work.k_begin;
    k0 = work.k_begin;
    std::fill(acc.begin(), acc.end(), 0x5A5A5A5A);
    std::fill(smem.begin(), smem.end(), 0xA5);
    constexpr bool late = T::LEAD <= T::STAGES - 2;
    for (int s = 0; s < T::LEAD && s < steps; ++s) copy(m0, n0, s);
    for (int kt = 0; kt < steps; ++kt) {
      if (!late && kt > 0) run_wgmmas(kt - 1);
      if (kt + T::LEAD < steps) copy(m0, n0, kt + T::LEAD);
      if (late && kt > 0) run_wgmmas(kt - 1);
      const uint8_t* stage = smem.data() + (size_t)(kt % T::STAGES) * T::STAGE_BYTES;
      for (int t = 0; t < T::THREADS; ++t)
        T::load_a(args, stage, t / 32, t % 32, reinterpret_cast<uint32_t(*)[4]>(&fa[(size_t)t * KS * 4]));
    }
    run_wgmmas(steps - 1);
    if (work.split >= 0) {  // streamk_meet: the first arrival stores its sums and leaves, the second adds them
      constexpr int N = 64 * H;
      int32_t* slot = sk->partials + (size_t)work.split * N * T::THREADS;
      int32_t* flags = sk->flags + 2 * work.split;
      if (flags[0]++ == 0) {
        for (int t = 0; t < T::THREADS; ++t)
          for (int i = 0; i < N; ++i) slot[i * T::THREADS + t] = acc[((size_t)(i / 64) * T::THREADS + t) * 64 + i % 64];
        flags[1] = 1;
        continue;
      }
      if (flags[1] != 1) fail("stream-K: the second block of a tile met no stored sums");
      for (int t = 0; t < T::THREADS; ++t)
        for (int i = 0; i < N; ++i) {
          int32_t& d = acc[((size_t)(i / 64) * T::THREADS + t) * 64 + i % 64];
          d = (int32_t)((uint32_t)d + (uint32_t)slot[i * T::THREADS + t]);  // wraps as the device's add
        }
      flags[0] = flags[1] = 0;
    }
    for (int t = 0; t < T::THREADS; ++t) {  // the epilogue's two phases, a barrier between them
      typename T::Acc mine;
      for (int h = 0; h < H; ++h) std::memcpy(mine.d + 64 * h, &acc[((size_t)h * T::THREADS + t) * 64], 64 * 4);
      T::stage_out(args, smem.data(), m0, n0, t / 32, t % 32, mine);
    }
    for (int t = 0; t < T::THREADS; ++t) T::write_out(args, smem.data(), m0, n0, t);
  }
}

}  // namespace

// The block tile of a large-M kernel (BM, BN, BK, THREADS, STAGE_BYTES, STAGES) for quantkit.kernels.TILES to be
// checked against; false for a layout without one.
template <class T>
void tiles_of(int out[6]) {
  const int v[6] = {T::BM, T::BN, T::BK, T::THREADS, T::STAGE_BYTES, T::STAGES};
  std::memcpy(out, v, sizeof(v));
}
extern "C" bool qk_tiles(const char* fmt, int out[6]) {
  if (std::strcmp(fmt, "qserve") == 0) tiles_of<qk::QServeTiled>(out);
  else if (std::strcmp(fmt, "qserve-wgmma") == 0) tiles_of<qk::WgmmaTiles<qk::QServeWgmma>>(out);
  else if (std::strcmp(fmt, "qqq-wgmma") == 0) tiles_of<qk::WgmmaTiles<qk::QQQWgmma>>(out);
  else if (std::strcmp(fmt, "liquidquant-wgmma") == 0) tiles_of<qk::WgmmaTiles<qk::LiquidWgmma>>(out);
  else if (std::strcmp(fmt, "qserve-wgmma2") == 0) tiles_of<qk::WgmmaTiles<qk::QServeWgmma, 2>>(out);
  else if (std::strcmp(fmt, "qqq-wgmma2") == 0) tiles_of<qk::WgmmaTiles<qk::QQQWgmma, 2>>(out);
  else if (std::strcmp(fmt, "liquidquant-wgmma2") == 0) tiles_of<qk::WgmmaTiles<qk::LiquidWgmma, 2>>(out);
  else if (std::strcmp(fmt, "qserve-wgmma_tall") == 0) tiles_of<qk::WgmmaTiles<qk::QServeWgmma, 1, 2>>(out);
  else if (std::strcmp(fmt, "qqq-wgmma_tall") == 0) tiles_of<qk::WgmmaTiles<qk::QQQWgmma, 1, 2>>(out);
  else if (std::strcmp(fmt, "liquidquant-wgmma_tall") == 0) tiles_of<qk::WgmmaTiles<qk::LiquidWgmma, 1, 2>>(out);
  else if (std::strcmp(fmt, "qserve-wgmma_tall_group") == 0)
    tiles_of<qk::WgmmaTiles<qk::QServeWgmma, 1, 2, QK_WGMMA_TALL_GROUP_STAGES, QK_WGMMA_TALL_GROUP_LEAD>>(out);
  else if (std::strcmp(fmt, "qqq-wgmma_tall_group") == 0)
    tiles_of<qk::WgmmaTiles<qk::QQQWgmma, 1, 2, QK_WGMMA_TALL_GROUP_STAGES, QK_WGMMA_TALL_GROUP_LEAD>>(out);
  else if (std::strcmp(fmt, "qqq") == 0) tiles_of<qk::QQQTiled>(out);
  else if (std::strcmp(fmt, "liquidquant") == 0) tiles_of<qk::LiquidTiled>(out);
  else if (std::strcmp(fmt, "atom") == 0) tiles_of<qk::AtomTiled>(out);
  else return false;
  return true;
}

// The host twin of qserve_w4a8_tiled.
extern "C" void qserve_w4a8_tiled_host(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight,
                                       const qk_half* s1, const qk_half* szero, const int8_t* s2, const int8_t* z2,
                                       qk_half* out, int m, int n, int k, int group) {
  guarded([&] {
    using T = qk::QServeTiled;
    const qk::QServeArgs args{x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group};
    tiled_host<T>(args, [&](const uint8_t* stage, int, int warp, T::Acc* acc) {
      for (int kk = 0; kk < T::BK / 32; ++kk) {
        uint32_t fa[4][32][4], fb[32][4][2], bn[32][2];
        for (int i = 0; i < 4; ++i) ldsm_x4_lanes(fa[i], stage, [&](int lane) { return T::a_row(warp, i, kk, lane); });
        for (int lane = 0; lane < 32; ++lane) T::load_b(args, stage, warp, kk, lane, fb[lane]);
        for (int nb = 0; nb < 4; ++nb) {
          for (int lane = 0; lane < 32; ++lane) std::memcpy(bn[lane], fb[lane][nb], sizeof(bn[lane]));
          for (int i = 0; i < 4; ++i) mma_into(mma_warp, acc, i, nb, fa[i], bn);
        }
      }
    });
  });
}

// The host twins of the Hopper kernels (*_wgmma).
extern "C" void qserve_w4a8_wgmma_host(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight,
                                       const qk_half* s1, const qk_half* szero, const int8_t* s2, const int8_t* z2,
                                       qk_half* out, int m, int n, int k, int group) {
  guarded([&] {
    wgmma_host<qk::QServeWgmma>(qk::QServeArgs{x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group});
  });
}
extern "C" void qqq_w4a8_wgmma_host(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                                    const qk_half* s_group, qk_half* out, int m, int n, int k) {
  guarded([&] { wgmma_host<qk::QQQWgmma>(qk::QQQArgs{x, s_x, b, s_channel, s_group, out, m, n, k}); });
}
extern "C" void liquidquant_w4a8_wgmma_host(const int8_t* x, const float* s_x, const uint8_t* qweight,
                                            const uint8_t* s2a, const qk_half* s1, qk_half* out, int m, int n, int k) {
  guarded([&] { wgmma_host<qk::LiquidWgmma>(qk::LiquidArgs{x, s_x, qweight, s2a, s1, out, m, n, k}); });
}
extern "C" void qserve_w4a8_wgmma2_host(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight,
                                        const qk_half* s1, const qk_half* szero, const int8_t* s2, const int8_t* z2,
                                        qk_half* out, int m, int n, int k, int group) {
  guarded([&] {
    wgmma_host<qk::QServeWgmma, 2>(qk::QServeArgs{x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group});
  });
}
extern "C" void qqq_w4a8_wgmma2_host(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                                     const qk_half* s_group, qk_half* out, int m, int n, int k) {
  guarded([&] { wgmma_host<qk::QQQWgmma, 2>(qk::QQQArgs{x, s_x, b, s_channel, s_group, out, m, n, k}); });
}
extern "C" void liquidquant_w4a8_wgmma2_host(const int8_t* x, const float* s_x, const uint8_t* qweight,
                                             const uint8_t* s2a, const qk_half* s1, qk_half* out, int m, int n,
                                             int k) {
  guarded([&] { wgmma_host<qk::LiquidWgmma, 2>(qk::LiquidArgs{x, s_x, qweight, s2a, s1, out, m, n, k}); });
}
// The 256-token kernels' twins, per group on their own ring; under QK_WGMMA_STREAMK with the tail's arguments and
// its blocks (wgmma_tall_gemm).
template <class F>
void wgmma_tall_host(const typename F::Args& args, bool grouped, const qk::StreamK& sk) {
  const qk::StreamK* tail = QK_WGMMA_STREAMK ? &sk : nullptr;
  if (grouped) wgmma_host<F, 1, 2, QK_WGMMA_TALL_GROUP_STAGES, QK_WGMMA_TALL_GROUP_LEAD>(args, tail);
  else wgmma_host<F, 1, 2>(args, tail);
}
extern "C" void qserve_w4a8_wgmma_tall_host(const int8_t* x, const float* s_x, const float* t_x,
                                            const uint8_t* qweight, const qk_half* s1, const qk_half* szero,
                                            const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k,
                                            int group QK_STREAMK_PARAMS) {
  guarded([&] {
    wgmma_tall_host<qk::QServeWgmma>(qk::QServeArgs{x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group},
                                     s2 != nullptr, QK_STREAMK);
  });
}
extern "C" void qqq_w4a8_wgmma_tall_host(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                                         const qk_half* s_group, qk_half* out, int m, int n,
                                         int k QK_STREAMK_PARAMS) {
  guarded([&] {
    wgmma_tall_host<qk::QQQWgmma>(qk::QQQArgs{x, s_x, b, s_channel, s_group, out, m, n, k}, s_group != nullptr,
                                  QK_STREAMK);
  });
}
extern "C" void liquidquant_w4a8_wgmma_tall_host(const int8_t* x, const float* s_x, const uint8_t* qweight,
                                                 const uint8_t* s2a, const qk_half* s1, qk_half* out, int m, int n,
                                                 int k QK_STREAMK_PARAMS) {
  guarded([&] {
    wgmma_tall_host<qk::LiquidWgmma>(qk::LiquidArgs{x, s_x, qweight, s2a, s1, out, m, n, k}, false, QK_STREAMK);
  });
}

// The blocks of qserve_w4a8_gemm, its two-tile form (SLICES = 2: qserve_w4a8_gemm16) and qserve_w4a8_bulk: one warp
// a copy, `splits` copies a block and split.zsplit blocks a tile (block z's copies are z splits + copy), each warp
// SLICES 32-channel tiles (slice_tile). For each block, walk(mt, block, copy, step) calls step(fragments) for each of
// the copy's K steps in its order, fragments(lane, nt, fa, fb) giving the lane's A and unpacked B fragments of tile nt;
// then the copies' accumulators (a lane's acc[SLICES][4][4], as the kernels hold them) meet as splitk_reduce adds
// them, the tile's blocks as splitk_blocks does (block_split_host), and copy 0 of the last block stores.
template <int SLICES = 1, bool RED = QK_SPLITK_RED, class Walk>
void qserve_host(const qk::QServeArgs& args, int splits, BlockSplit split, Walk walk) {
  constexpr int count = 16 * SLICES;  // a lane's accumulators
  std::vector<int32_t> acc((size_t)splits * count * 32);
  uint32_t fa[32][4], fb[32][4][2], bn[32][2];
  int32_t c[32][4];
  // accumulator i of slice sl, n8 block nb of a lane of a copy (the kernels' acc[SLICES][4][4])
  auto at = [&](int copy, int lane, int sl, int nb) {
    return &acc[((size_t)copy * 32 + lane) * count + 4 * (4 * sl + nb)];
  };
  auto block_sums = [&](int block, int mt, int z) {
    std::fill(acc.begin(), acc.end(), 0);
    for (int copy = 0; copy < splits; ++copy) {
      walk(mt, block, z * splits + copy, [&](auto&& fragments) {
        for (int sl = 0; sl < SLICES; ++sl) {
          const int nt = qk::slice_tile(block, SLICES, sl);
          for (int lane = 0; lane < 32; ++lane) fragments(lane, nt, fa[lane], fb[lane]);
          for (int nb = 0; nb < 4; ++nb) {
            for (int lane = 0; lane < 32; ++lane) {
              bn[lane][0] = fb[lane][nb][0];
              bn[lane][1] = fb[lane][nb][1];
              std::memcpy(c[lane], at(copy, lane, sl, nb), sizeof(c[lane]));
            }
            mma_warp(c, fa, bn);
            for (int lane = 0; lane < 32; ++lane) std::memcpy(at(copy, lane, sl, nb), c[lane], sizeof(c[lane]));
          }
        }
      });
    }
    splitk_meet_host<count, RED>(32, splits, [&](int copy, int lane) { return at(copy, lane, 0, 0); });
    return [&](int lane) { return at(0, lane, 0, 0); };
  };
  auto store = [&](int block, int mt) {
    for (int lane = 0; lane < 32; ++lane) {
      int32_t mine[SLICES][4][4];
      std::memcpy(&mine[0][0][0], at(0, lane, 0, 0), sizeof(mine));
      // the parameters loaded ahead as the one-tile kernels build: per channel before the K loop, else after it (MID)
      const bool ahead = SLICES == 1 && ((QK_EPILOGUE_EARLY && args.szero != nullptr) || QK_EPILOGUE_MID);
      const qk::QServeEpilogue epi = ahead ? qk::epilogue_params(args, mt, block, lane) : qk::QServeEpilogue{};
      for (int sl = 0; sl < SLICES; ++sl)
        for (int nb = 0; nb < 4; ++nb) {
          if (ahead) qk::store_with(args, epi, mt, block, nb, lane, mine[sl][nb]);
          else qk::store(args, mt, qk::slice_tile(block, SLICES, sl), nb, lane, mine[sl][nb]);
        }
    }
  };
  block_split_host<count>(args.n / (32 * SLICES), (args.m + 15) / 16, split, block_sums, store);
}

// The host twins of qserve_w4a8_gemm (per group) and qserve_w4a8_gemm_pc (per channel), and of their two-tile forms
// (qserve_w4a8_gemm16, _pc16: SLICES = 2), each with the other variant's tensors null as the kernel makes them: copy
// c of a tile's copies takes K steps c, c + copies, ...
template <bool GROUPED, int SLICES>
static void qserve_gemm_host(const qk::QServeArgs& args, int splits, BlockSplit split) {
  const int k = args.k, copies = splits * split.zsplit;
  if (args.n % (32 * SLICES) != 0) fail("qserve_w4a8_gemm: N not a multiple of the block's channels");
  constexpr int ahead = qk::qserve_ahead(GROUPED, SLICES);
  qserve_host<SLICES>(args, splits, split, [&](int mt, int, int copy, auto&& step) {
    walk_steps<ahead>(copy, copies, k / 32, [&](int kt) {
      step([&](int lane, int nt, uint32_t fa[4], uint32_t fb[4][2]) {
        uint32_t w[4], s, z;
        qk::load_a(qk::act_rows(args, mt, lane), kt, fa);
        qk::load_b_raw(args, nt, kt, lane, w);
        qk::load_group_params(args, nt, kt, lane, s, z);
        qk::unpack_b(args, w, s, z, fb);
      });
    });
  });
}
template <int SLICES>
static void qserve_grouped_host(const int8_t* x, const float* s_x, const uint8_t* qweight, const qk_half* s1,
                                const int8_t* s2, const int8_t* z2, qk_half* out, int m, int n, int k, int group,
                                int splits, BlockSplit split) {
  if (s2 == nullptr || z2 == nullptr) fail("qserve_w4a8_gemm: per group, needs s2 and z2");
  qserve_gemm_host<true, SLICES>(qk::QServeArgs{x, s_x, nullptr, qweight, s1, nullptr, s2, z2, out, m, n, k, group},
                                 splits, split);
}
template <int SLICES>
static void qserve_channel_host(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight,
                                const qk_half* s1, const qk_half* szero, qk_half* out, int m, int n, int k, int splits,
                                BlockSplit split) {
  if (szero == nullptr || t_x == nullptr) fail("qserve_w4a8_gemm_pc: per channel, needs s1_szeros and t_x");
  qserve_gemm_host<false, SLICES>(qk::QServeArgs{x, s_x, t_x, qweight, s1, szero, nullptr, nullptr, out, m, n, k, 0},
                                  splits, split);
}
extern "C" void qserve_w4a8_gemm_host(const int8_t* x, const float* s_x, const float*, const uint8_t* qweight,
                                      const qk_half* s1, const qk_half*, const int8_t* s2, const int8_t* z2,
                                      qk_half* out, int m, int n, int k, int group, int splits, int zsplit,
                                      int32_t* sums, int32_t* arrived) {
  guarded([&] {
    qserve_grouped_host<1>(x, s_x, qweight, s1, s2, z2, out, m, n, k, group, splits, {zsplit, sums, arrived});
  });
}
extern "C" void qserve_w4a8_gemm_pc_host(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight,
                                         const qk_half* s1, const qk_half* szero, const int8_t*, const int8_t*,
                                         qk_half* out, int m, int n, int k, int, int splits, int zsplit,
                                         int32_t* sums, int32_t* arrived) {
  guarded([&] {
    qserve_channel_host<1>(x, s_x, t_x, qweight, s1, szero, out, m, n, k, splits, {zsplit, sums, arrived});
  });
}
extern "C" void qserve_w4a8_gemm16_host(const int8_t* x, const float* s_x, const float*, const uint8_t* qweight,
                                        const qk_half* s1, const qk_half*, const int8_t* s2, const int8_t* z2,
                                        qk_half* out, int m, int n, int k, int group, int splits, int zsplit,
                                        int32_t* sums, int32_t* arrived) {
  guarded([&] {
    qserve_grouped_host<2>(x, s_x, qweight, s1, s2, z2, out, m, n, k, group, splits, {zsplit, sums, arrived});
  });
}
extern "C" void qserve_w4a8_gemm_pc16_host(const int8_t* x, const float* s_x, const float* t_x,
                                           const uint8_t* qweight, const qk_half* s1, const qk_half* szero,
                                           const int8_t*, const int8_t*, qk_half* out, int m, int n, int k, int,
                                           int splits, int zsplit, int32_t* sums, int32_t* arrived) {
  guarded([&] {
    qserve_channel_host<2>(x, s_x, t_x, qweight, s1, szero, out, m, n, k, splits, {zsplit, sums, arrived});
  });
}

// The host twin of qserve_w4a8_bulk: copy c walks its contiguous range chunk by chunk, each chunk's bulk copies
// (QServeBulk::copies, as the device issues them) done into a slot first filled with garbage, so that a step reading
// a byte no copy wrote, or a copy outside its slot or misaligned, shows; then its steps read the slot.
extern "C" void qserve_w4a8_bulk_host(const int8_t* x, const float* s_x, const float* t_x, const uint8_t* qweight,
                                      const qk_half* s1, const qk_half* szero, const int8_t* s2, const int8_t* z2,
                                      qk_half* out, int m, int n, int k, int group, int splits, int zsplit,
                                      int32_t* sums, int32_t* arrived, int chunk, int slots) {
  guarded([&] {
    const qk::QServeArgs args{x, s_x, t_x, qweight, s1, szero, s2, z2, out, m, n, k, group};
    const qk::QServeBulk layout{chunk, std::min(16, m), s2 != nullptr};
    if (slots < 1 || chunk < 1) fail("bulk: no slot");
    std::vector<uint8_t> slot((size_t)layout.slot_bytes());
    const int steps = k / 32, copies = splits * zsplit;
    qserve_host<1, false>(args, splits, {zsplit, sums, arrived}, [&](int mt, int nt, int copy, auto&& step) {
      bulk_walk_host(
          slot, chunk, copy, copies, steps,
          [&](int s0, int cnt, auto&& emit) { layout.copies(args, mt, nt, s0, cnt, emit); },
          [&](int s0, int u) {
            step([&](int lane, int, uint32_t fa[4], uint32_t fb[4][2]) {
              uint32_t w[4], s, z;
              layout.load_a(args, slot.data(), mt, u, lane, fa);
              layout.load_b(args, slot.data(), s0, u, lane, w, s, z);
              qk::unpack_b(args, w, s, z, fb);
            });
          });
    });
  });
}

// The bytes of one slot of qserve_w4a8_bulk, for quantkit.kernels to size the launch's shared memory with.
extern "C" int qserve_bulk_slot_bytes(int chunk, int rows, int grouped) {
  return qk::QServeBulk{chunk, rows, grouped != 0}.slot_bytes();
}

// The blocks of LiquidQuant's small-M kernels: `splits` copies of `warps` warps (lqq_tile: each warp its SLICES
// 16-channel slices), TB token blocks of 8 a tile, split-K as in qserve_host over a thread's SLICES x TB x 4
// accumulators. walk(block, by, copy, step) calls step(weights, tokens) for each of the copy's K steps in its order:
// weights(nt, t, r, sa) gives thread t's (of 64-channel block nt's 128) weight bytes and group parameters (the
// warps of a block of several slices a warp span several nt), tokens(tb, j, lane, fb) the lane's B fragment of
// token block tb for MMA j.
template <int TB, int SLICES = 1, bool RED = QK_SPLITK_RED, class Walk>
void liquidquant_host(const qk::LiquidArgs& args, int splits, int warps, Walk walk) {
  const int threads = 32 * warps;
  constexpr int sums = 4 * TB * SLICES;  // a thread's accumulators
  std::vector<int32_t> acc((size_t)splits * threads * sums);
  uint32_t fa[32][2][4], fb[32][2], aj[32][4], r[4], sa[2];
  // accumulators of copy, thread `local` of the copy, slice s, token block tb (the kernels' acc[SLICES][TB][4])
  auto at = [&](int copy, int local, int s, int tb) {
    return &acc[((size_t)copy * threads + local) * sums + 4 * (TB * s + tb)];
  };
  for (int block = 0; block < args.n / (16 * warps * SLICES); ++block) {
    int nt, t;
    for (int by = 0; by < (args.m + 8 * TB - 1) / (8 * TB); ++by) {
      std::fill(acc.begin(), acc.end(), 0);
      for (int copy = 0; copy < splits; ++copy) {
        walk(block, by, copy, [&](auto&& weights, auto&& tokens) {
          for (int w = 0; w < warps; ++w) {
            for (int s = 0; s < SLICES; ++s) {
              for (int lane = 0; lane < 32; ++lane) {
                qk::lqq_tile(block, 32 * w + lane, warps, nt, t, SLICES, s);
                weights(nt, t, r, sa);
                qk::unpack_weights(r, sa, fa[lane]);
              }
              for (int tb = 0; tb < TB; ++tb) {
                for (int j = 0; j < 2; ++j) {
                  int32_t c[32][4];
                  for (int lane = 0; lane < 32; ++lane) {
                    tokens(TB * by + tb, j, lane, fb[lane]);
                    std::memcpy(aj[lane], fa[lane][j], sizeof(aj[lane]));
                    std::memcpy(c[lane], at(copy, 32 * w + lane, s, tb), sizeof(c[lane]));
                  }
                  mma_warp(c, aj, fb);
                  for (int lane = 0; lane < 32; ++lane)
                    std::memcpy(at(copy, 32 * w + lane, s, tb), c[lane], sizeof(c[lane]));
                }
              }
            }
          }
        });
      }
      splitk_meet_host<sums, RED>(threads, splits, [&](int copy, int local) { return at(copy, local, 0, 0); });
      for (int local = 0; local < threads; ++local) {
        int32_t mine[SLICES][TB][4];
        std::memcpy(&mine[0][0][0], at(0, local, 0, 0), sizeof(mine));
        // the parameters loaded ahead as the kernels build (the same bits either way): the one-token-block,
        // one-slice kernel's before the K loop, the others' after it (MID)
        const bool ahead = (QK_EPILOGUE_EARLY && TB == 1 && SLICES == 1) || QK_EPILOGUE_MID;
        for (int s = 0; s < SLICES; ++s) {
          qk::lqq_tile(block, local, warps, nt, t, SLICES, s);
          for (int tb = 0; tb < TB; ++tb) {
            if (ahead)
              qk::store_with(args, qk::epilogue_params(args, nt, TB * by + tb, t), nt, TB * by + tb, t, mine[s][tb]);
            else qk::store(args, nt, TB * by + tb, t, mine[s][tb]);
          }
        }
      }
    }
  }
}

// The host twin of liquidquant_w4a8_gemm (TB = 4 token blocks a tile), liquidquant_w4a8_gemm8 (TB = 1, up to 8
// tokens) and liquidquant_w4a8_gemm16 (TB = 2, QK_LQQ16_SLICES slices a warp): QK_LQQ_TILE_WARPS warps a block,
// copy c taking K steps c, c + splits, ...
template <int TB, int SLICES = 1>
void liquidquant_gemm_host(const int8_t* x, const float* s_x, const uint8_t* qweight, const uint8_t* s2a,
                           const qk_half* s1, qk_half* out, int m, int n, int k, int splits) {
  const qk::LiquidArgs args{x, s_x, qweight, s2a, s1, out, m, n, k};
  auto walk = [&](int, int, int copy, auto&& step) {
    walk_steps<qk::lqq_ahead(TB, SLICES)>(copy, splits, k / 64, [&](int kt) {
      step([&](int nt, int t, uint32_t r[4], uint32_t sa[2]) { qk::load_weights_raw(args, nt, kt, t, r, sa); },
           [&](int tb, int j, int lane, uint32_t fb[2]) {
             if (TB <= 2) qk::load_tokens(qk::token_row(args, tb, lane), kt, j, fb);
             else qk::load_tokens_checked(args, tb, kt, j, lane, fb);
           });
    });
  };
  liquidquant_host<TB, SLICES>(args, splits, QK_LQQ_TILE_WARPS, walk);
}

// The host twin of liquidquant_w4a8_bulk8: a warp a block (16-channel tile `block`) walks copy c's contiguous range
// chunk by chunk, the chunk's copies (LiquidBulk::copies) done into a slot first filled with garbage, then the
// chunk's steps read from the slot.
extern "C" void liquidquant_w4a8_bulk8_host(const int8_t* x, const float* s_x, const uint8_t* qweight,
                                            const uint8_t* s2a, const qk_half* s1, qk_half* out, int m, int n, int k,
                                            int splits, int chunk, int slots) {
  guarded([&] {
    const qk::LiquidArgs args{x, s_x, qweight, s2a, s1, out, m, n, k};
    const qk::LiquidBulk layout{chunk, std::min(8, m)};
    if (slots < 1 || chunk < 1 || m > 8) fail("bulk8: no slot, or more than 8 tokens");
    std::vector<uint8_t> slot((size_t)layout.slot_bytes());
    liquidquant_host<1, 1, false>(args, splits, 1, [&](int n16, int, int copy, auto&& step) {
      bulk_walk_host(
          slot, chunk, copy, splits, k / 64,
          [&](int s0, int cnt, auto&& emit) { layout.copies(args, n16, s0, cnt, emit); },
          [&](int, int u) {
            step([&](int, int t, uint32_t r[4], uint32_t sa[2]) { layout.load_weights(slot.data(), u, t % 32, r, sa); },
                 [&](int, int j, int lane, uint32_t fb[2]) { layout.load_tokens(args, slot.data(), u, j, lane, fb); });
          });
    });
  });
}

extern "C" int liquidquant_bulk_slot_bytes(int chunk, int rows) { return qk::LiquidBulk{chunk, rows}.slot_bytes(); }

extern "C" void liquidquant_w4a8_gemm_host(const int8_t* x, const float* s_x, const uint8_t* qweight,
                                           const uint8_t* s2a, const qk_half* s1, qk_half* out, int m, int n, int k,
                                           int splits) {
  guarded([&] { liquidquant_gemm_host<4>(x, s_x, qweight, s2a, s1, out, m, n, k, splits); });
}

extern "C" void liquidquant_w4a8_gemm8_host(const int8_t* x, const float* s_x, const uint8_t* qweight,
                                            const uint8_t* s2a, const qk_half* s1, qk_half* out, int m, int n, int k,
                                            int splits) {
  guarded([&] { liquidquant_gemm_host<1>(x, s_x, qweight, s2a, s1, out, m, n, k, splits); });
}

extern "C" void liquidquant_w4a8_gemm16_host(const int8_t* x, const float* s_x, const uint8_t* qweight,
                                             const uint8_t* s2a, const qk_half* s1, qk_half* out, int m, int n, int k,
                                             int splits) {
  guarded([&] { liquidquant_gemm_host<2, QK_LQQ16_SLICES>(x, s_x, qweight, s2a, s1, out, m, n, k, splits); });
}

// The host twin of liquidquant_w4a8_tiled.
extern "C" void liquidquant_w4a8_tiled_host(const int8_t* x, const float* s_x, const uint8_t* qweight,
                                            const uint8_t* s2a, const qk_half* s1, qk_half* out, int m, int n, int k) {
  guarded([&] {
    using T = qk::LiquidTiled;
    const qk::LiquidArgs args{x, s_x, qweight, s2a, s1, out, m, n, k};
    tiled_host<T>(args, [&](const uint8_t* stage, int, int warp, T::Acc* acc) {
      uint32_t fa[2][2][32][4], mine[2][4], b[4][32][4], bn[32][2];
      for (int s = 0; s < 2; ++s) {
        for (int lane = 0; lane < 32; ++lane) {
          T::load_a(stage, warp, s, lane, mine);
          for (int j = 0; j < 2; ++j) std::memcpy(fa[s][j][lane], mine[j], sizeof(mine[j]));
        }
      }
      for (int j = 0; j < 2; ++j) {
        for (int p = 0; p < 4; ++p) {
          ldsm_x4_lanes(b[p], stage, [&](int lane) { return T::b_row(warp, p, j, lane); });
          for (int half = 0; half < 2; ++half) {
            for (int lane = 0; lane < 32; ++lane) std::memcpy(bn[lane], &b[p][lane][2 * half], sizeof(bn[lane]));
            for (int s = 0; s < 2; ++s) mma_into(mma_warp, acc, s, 2 * p + half, fa[s][j], bn);
          }
        }
      }
    });
  });
}

// The blocks of qqq_w4a8_gemm and qqq_w4a8_bulk: walk(mt, c, copy, step) calls step(fragments) for each of the copy's
// k16 steps in its order, fragments(lane, fa, fb) giving the lane's A and unpacked B fragments; then split-K over a
// block's `splits` copies and a tile's split.zsplit blocks as in qserve_host.
template <bool RED = QK_SPLITK_RED, class Walk>
void qqq_host(const qk::QQQArgs& args, int splits, BlockSplit split, Walk walk) {
  std::vector<int32_t> acc((size_t)splits * 32 * 32);
  uint32_t fa[32][2], fb[32][8], bn[32];
  int32_t sums[32][4];
  // accumulators of n8 block nb of a lane of a copy (the kernels' acc[8][4])
  auto at = [&](int copy, int lane, int nb) { return &acc[(((size_t)copy * 32 + lane) * 8 + nb) * 4]; };
  auto block_sums = [&](int c, int mt, int z) {
    std::fill(acc.begin(), acc.end(), 0);
    for (int copy = 0; copy < splits; ++copy) {
      walk(mt, c, z * splits + copy, [&](auto&& fragments) {
        for (int lane = 0; lane < 32; ++lane) fragments(lane, fa[lane], fb[lane]);
        for (int nb = 0; nb < 8; ++nb) {
          for (int lane = 0; lane < 32; ++lane) {
            bn[lane] = fb[lane][nb];
            std::memcpy(sums[lane], at(copy, lane, nb), sizeof(sums[lane]));
          }
          mma_warp_k16(sums, fa, bn);
          for (int lane = 0; lane < 32; ++lane) std::memcpy(at(copy, lane, nb), sums[lane], sizeof(sums[lane]));
        }
      });
    }
    splitk_meet_host<32, RED>(32, splits, [&](int copy, int lane) { return at(copy, lane, 0); });
    return [&](int lane) { return at(0, lane, 0); };
  };
  auto store = [&](int c, int mt) {
    for (int lane = 0; lane < 32; ++lane) {
      int32_t mine[8][4];
      std::memcpy(&mine[0][0], at(0, lane, 0), sizeof(mine));
      const bool mid = qk::qqq_epilogue_mid(args.s_group != nullptr);
      const qk::QQQEpilogue epi = mid ? qk::epilogue_params(args, mt, c, lane) : qk::QQQEpilogue{};
      for (int nb = 0; nb < 8; ++nb) {
        if (mid) qk::store_with(args, epi, mt, c, nb, lane, mine[nb]);  // as the kernels build
        else qk::store(args, mt, c, nb, lane, mine[nb]);
      }
    }
  };
  block_split_host<32>(args.n / 64, (args.m + 15) / 16, split, block_sums, store);
}

// The host twins of qqq_w4a8_gemm (per group) and qqq_w4a8_gemm_pc (per channel, s_group null as the kernel makes
// it): copy c of a tile's copies takes k16 steps c, c + copies, ...
static void qqq_gemm_host(const qk::QQQArgs& args, int splits, BlockSplit split);
extern "C" void qqq_w4a8_gemm_host(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                                   const qk_half* s_group, qk_half* out, int m, int n, int k, int splits, int zsplit,
                                   int32_t* sums, int32_t* arrived) {
  guarded([&] {
    if (s_group == nullptr) fail("qqq_w4a8_gemm: per group, needs s_group");
    qqq_gemm_host(qk::QQQArgs{x, s_x, b, s_channel, s_group, out, m, n, k}, splits, {zsplit, sums, arrived});
  });
}
extern "C" void qqq_w4a8_gemm_pc_host(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                                      const qk_half*, qk_half* out, int m, int n, int k, int splits, int zsplit,
                                      int32_t* sums, int32_t* arrived) {
  guarded([&] {
    qqq_gemm_host(qk::QQQArgs{x, s_x, b, s_channel, nullptr, out, m, n, k}, splits, {zsplit, sums, arrived});
  });
}
static void qqq_gemm_host(const qk::QQQArgs& args, int splits, BlockSplit split) {
  const int k = args.k, copies = splits * split.zsplit;
  const auto walk = [&](int mt, int c, int copy, auto&& step) {
    const auto run = [&](int i) {
      step([&](int lane, uint32_t fa[2], uint32_t fb[8]) {
        uint32_t w[4];
        qk::load_a16(qk::act_rows(args, mt, lane), i, fa);
        qk::load_b_raw(args, c, i, lane, w);
        qk::unpack_b(args.s_group != nullptr, qk::ratio_row(args, c, i), lane, w, fb);
      });
    };
    if (args.s_group != nullptr) walk_steps<qk::qqq_ahead(true)>(copy, copies, k / 16, run);
    else walk_steps<qk::qqq_ahead(false)>(copy, copies, k / 16, run);
  };
  qqq_host(args, splits, split, walk);
}

// The host twin of qqq_w4a8_bulk: copy c walks its contiguous range chunk by chunk, the chunk's bulk copies
// (QQQBulk::copies) done into a slot first filled with garbage, then its steps read from the slot.
extern "C" void qqq_w4a8_bulk_host(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                                   const qk_half* s_group, qk_half* out, int m, int n, int k, int splits, int zsplit,
                                   int32_t* sums, int32_t* arrived, int chunk, int slots) {
  guarded([&] {
    const qk::QQQArgs args{x, s_x, b, s_channel, s_group, out, m, n, k};
    const bool grouped = s_group != nullptr;
    const qk::QQQBulk layout{chunk, std::min(16, m), grouped};
    if (slots < 1 || chunk < 1) fail("bulk: no slot");
    std::vector<uint8_t> slot((size_t)layout.slot_bytes());
    const int steps = k / 16;
    const int copies = splits * zsplit;
    qqq_host<false>(args, splits, {zsplit, sums, arrived}, [&](int mt, int c, int copy, auto&& step) {
      bulk_walk_host(
          slot, chunk, copy, copies, steps,
          [&](int s0, int cnt, auto&& emit) { layout.copies(args, mt, c, s0, cnt, emit); },
          [&](int s0, int u) {
            step([&](int lane, uint32_t fa[2], uint32_t fb[8]) {
              uint32_t w[4], r[4] = {};
              layout.load_a(args, slot.data(), mt, u, lane, fa);
              layout.load_b(slot.data(), s0, u, lane, w, r);
              qk::unpack_words(grouped, r, w, fb);
            });
          });
    });
  });
}

// The bytes of one slot of qqq_w4a8_bulk.
extern "C" int qqq_bulk_slot_bytes(int chunk, int rows, int grouped) {
  return qk::QQQBulk{chunk, rows, grouped != 0}.slot_bytes();
}

// The host twin of qqq_w4a8_tiled.
extern "C" void qqq_w4a8_tiled_host(const int8_t* x, const float* s_x, const uint32_t* b, const float* s_channel,
                                    const qk_half* s_group, qk_half* out, int m, int n, int k) {
  guarded([&] {
    using T = qk::QQQTiled;
    const qk::QQQArgs args{x, s_x, b, s_channel, s_group, out, m, n, k};
    tiled_host<T>(args, [&](const uint8_t* stage, int, int warp, T::Acc* acc) {
      for (int kk = 0; kk < T::BK / 32; ++kk) {
        uint32_t fa[2][32][4], fb[32][8], ai[32][2], bn[32];
        for (int i = 0; i < 2; ++i) ldsm_x4_lanes(fa[i], stage, [&](int lane) { return T::a_row(warp, i, kk, lane); });
        for (int h = 0; h < 2; ++h) {
          for (int lane = 0; lane < 32; ++lane) T::load_b(args, stage, warp, 2 * kk + h, lane, fb[lane]);
          for (int i = 0; i < 2; ++i) {
            for (int lane = 0; lane < 32; ++lane) {
              ai[lane][0] = fa[i][lane][2 * h];
              ai[lane][1] = fa[i][lane][2 * h + 1];
            }
            for (int nb = 0; nb < 8; ++nb) {
              for (int lane = 0; lane < 32; ++lane) bn[lane] = fb[lane][nb];
              mma_into(mma_warp_k16, acc, i, nb, ai, bn);
            }
          }
        }
      }
    });
  });
}

// One warp's int32 products of an Atom step (the lanes' registers in `st`): INT4 or INT8 MMAs, as the kernel's.
static void atom_step_products_host(const qk::AtomStep st[32], bool int4, int32_t partial[2][32][4]) {
  for (int u = 0; u < 2; ++u) {
    uint32_t fa[32][4], fb[2][32][2], b[2][2];
    for (int lane = 0; lane < 32; ++lane) {
      qk::atom_fragments(st[lane], u, fa[lane], b);
      for (int nb = 0; nb < 2; ++nb) std::memcpy(fb[nb][lane], b[nb], sizeof(b[nb]));
    }
    for (int nb = 0; nb < 2; ++nb) {
      if (int4) mma_warp_int4(partial[nb], fa, fb[nb]);
      else mma_warp(partial[nb], fa, fb[nb]);
    }
  }
  if (int4)
    for (int nb = 0; nb < 2; ++nb)
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 4; ++e) partial[nb][lane][e] = qk::int4_sum(partial[nb][lane][e]);
}

// The host twin of atom_w4a4_gemm, copy by copy in the kernel's assignment: the outlier halves, then per round every
// copy's groups put in the slots (filled with NaN first, so that a slot the round does not write shows), then each
// thread's sums of its outputs in group order.
extern "C" void atom_w4a4_gemm_host(const uint8_t* x4, const int8_t* x8, const float* s_x, const uint8_t* w4,
                                    const int8_t* w8, const qk_half* scale_int4, const qk_half* scale_int8,
                                    qk_half* out, int m, int n, int k, int splits, int per_round) {
  guarded([&] {
    const qk::AtomArgs args{x4, x8, s_x, w4, w8, scale_int4, scale_int8, out, m, n, k};
    const int groups = qk::atom_groups(args);
    std::vector<float> smem((size_t)(per_round + qk::ATOM_EXTRA_SLOTS) * std::min(m, 16) * 16);
    static thread_local qk::AtomStep st[32];
    // One step of one copy: every lane's loads, the warp's MMAs, every lane's put of its products.
    auto step = [&](bool int4, auto load, auto put) {
      static thread_local int32_t partial[2][32][4];
      for (int lane = 0; lane < 32; ++lane) load(lane, st[lane]);
      std::memset(partial, 0, sizeof(partial));
      atom_step_products_host(st, int4, partial);
      for (int lane = 0; lane < 32; ++lane) {
        int32_t mine[2][4];
        for (int nb = 0; nb < 2; ++nb) std::memcpy(mine[nb], partial[nb][lane], sizeof(mine[nb]));
        put(lane, st[lane], mine);
      }
    };
    for (int nt = 0; nt < n / 16; ++nt) {
      for (int mt = 0; mt < (m + 15) / 16; ++mt) {
        const int rows = std::min(16, m - 16 * mt);
        float* sums = smem.data() + qk::atom_slot(per_round + qk::ATOM_SUM, 0, 0, rows);
        qk::AtomRows lane_rows[32];  // made once a tile, as the kernel makes them once a thread
        for (int lane = 0; lane < 32; ++lane) lane_rows[lane] = qk::atom_rows(args, mt, nt, lane);
        std::fill(smem.begin(), smem.end(), std::numeric_limits<float>::quiet_NaN());
        for (int copy = 0; copy < splits; ++copy)
          walk_steps<2>(qk::atom_first_half(copy, groups, splits), splits, 2, [&](int half) {
            step(
                false, [&](int lane, qk::AtomStep& r) { qk::atom_load_outliers(args, mt, nt, half, lane, r); },
                [&](int lane, const qk::AtomStep& r, const int32_t mine[2][4]) {
                  qk::atom_put_outliers(r, half, rows, per_round, lane, mine, smem.data());
                });
          });
        for (int s0 = 0;; s0 += per_round) {
          const int end = std::min(s0 + per_round, groups);
          std::fill(smem.begin(), smem.begin() + qk::atom_slot(per_round, 0, 0, rows),
                    std::numeric_limits<float>::quiet_NaN());
          for (int copy = 0; copy < splits; ++copy)
            walk_steps<QK_ATOM_AHEAD>(s0 + copy, splits, end, [&](int s) {
              step(
                  true, [&](int lane, qk::AtomStep& r) { qk::atom_load_group(args, lane_rows[lane], s, r); },
                  [&](int lane, const qk::AtomStep& r, const int32_t mine[2][4]) {
                    qk::atom_put_terms(r, s, s0, rows, lane, mine, smem.data());
                  });
            });
          for (int t = 0; t < 32 * splits; ++t)
            qk::atom_sum(args, mt, nt, smem.data(), end - s0, rows, per_round, s0 == 0, end == groups, t, 32 * splits,
                         sums);
          if (end == groups) break;
        }
      }
    }
  });
}

// The host twin of atom_w4a4_tiled.
extern "C" void atom_w4a4_tiled_host(const uint8_t* x4, const int8_t* x8, const float* s_x, const uint8_t* w4,
                                     const int8_t* w8, const qk_half* scale_int4, const qk_half* scale_int8,
                                     qk_half* out, int m, int n, int k) {
  guarded([&] {
    using T = qk::AtomTiled;
    const qk::AtomArgs args{x4, x8, s_x, w4, w8, scale_int4, scale_int8, out, m, n, k};
    tiled_host<T>(args, [&](const uint8_t* stage, int kt, int warp, T::Acc* acc) {
      const bool int4 = kt < T::groups(args);
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t fa[2][32][4], b[32][4], bn[32][2];
        for (int i = 0; i < 2; ++i) ldsm_x4_lanes(fa[i], stage, [&](int lane) { return T::a_row(warp, i, kk, lane); });
        for (int p = 0; p < 2; ++p) {
          ldsm_x4_lanes(b, stage, [&](int lane) { return T::b_row(warp, p, kk, lane); });
          for (int half = 0; half < 2; ++half) {
            for (int lane = 0; lane < 32; ++lane) std::memcpy(bn[lane], &b[lane][2 * half], sizeof(bn[lane]));
            for (int i = 0; i < 2; ++i) mma_into(int4 ? mma_warp_int4 : mma_warp, acc, i, 2 * p + half, fa[i], bn);
          }
        }
      }
      if (T::folds_after(args, kt))
        for (int lane = 0; lane < 32; ++lane) T::fold(args, kt, stage, warp, lane, acc[lane]);
    });
  });
}

// The host twin of anyprec_gemv at width BITS: each warp's table, then its chunks with the xor-shuffle tree
// included (each lane adds its partner's value): the first ap_ahead(BITS), loaded before the table, then the rest
// through pipelined_steps, as the kernel walks them.
template <int BITS>
void anyprec_gemv_host_at(const qk::AnyPrecArgs& args) {
  std::vector<float> table(qk::AP_TABLE_WORDS);
  float v[32][qk::AP_TOKENS], next[32][qk::AP_TOKENS];
  constexpr int ahead = qk::ap_ahead(BITS);
  const int chunks = qk::chunk_count(args);
  for (int channel = 0; channel < args.n; ++channel) {
    for (int lane = 0; lane < 32; ++lane) qk::fill_table<BITS>(args, channel, lane, table.data());
    for (int m0 = 0; m0 < args.m; m0 += qk::AP_TOKENS) {
      float sum[qk::AP_TOKENS] = {};
      auto add = [&](int c) {
        for (int lane = 0; lane < 32; ++lane)
          qk::thread_partials_at<BITS>(args, table.data(), channel, c, m0, lane, v[lane]);
        for (int offset = 16; offset > 0; offset >>= 1) {
          for (int lane = 0; lane < 32; ++lane)
            for (int i = 0; i < qk::AP_TOKENS; ++i) next[lane][i] = qk::fadd(v[lane][i], v[lane ^ offset][i]);
          std::memcpy(v, next, sizeof(v));
        }
        for (int i = 0; i < qk::AP_TOKENS; ++i) sum[i] = qk::fadd(sum[i], v[0][i]);
      };
      for (int c = 0; c < std::min(ahead, chunks); ++c) add(c);
      walk_steps<ahead>(ahead, 1, chunks, add);
      for (int i = 0; i < qk::AP_TOKENS && m0 + i < args.m; ++i)
        args.out[(size_t)(m0 + i) * args.n + channel] = qk::float_to_half(sum[i]);
    }
  }
}

extern "C" void anyprec_gemv_host(const qk_half* x, const uint32_t* planes, const qk_half* lut, qk_half* out, int m,
                                  int n, int k, int bits) {
  guarded([&] {
    const qk::AnyPrecArgs args{x, planes, lut, out, m, n, k, bits};
    qk::with_width(bits, [&](auto width) { anyprec_gemv_host_at<decltype(width)::value>(args); });
  });
}

// The host twin of anyprec_gemm_tc at width BITS and NB token blocks a tile (FAST: of the *_fast kernel, whose
// unchecked loads read past N and M from the last channel and token): block by block, warp by warp, each MMA from
// the lanes' fragments.
template <int BITS, int NB, bool FAST, int WARPS>
void anyprec_gemm_tc_host_at(const qk::AnyPrecArgs& a) {
  using namespace qk;
  std::vector<uint8_t> smem(tc_shared_bytes<BITS, WARPS>());
  constexpr int W = tc_lane_words<BITS>();
  std::vector<uint32_t> w((size_t)32 * 2 * BITS * W);
  auto words_of = [&](int lane) { return reinterpret_cast<uint32_t(*)[BITS][W]>(&w[(size_t)lane * 2 * BITS * W]); };
  for (int m0 = 0; m0 < a.m; m0 += APT_TOKENS) {
    for (int n0 = 0; n0 < a.n; n0 += APT_CHANNELS) {
      std::fill(smem.begin(), smem.end(), 0xA5);  // nothing read that the block did not write
      for (int tid = 0; tid < 32 * WARPS; ++tid) tc_fill_tables<BITS, NB>(a, smem.data(), n0, tid, 32 * WARPS);
      TcRegTables rt[32];
      for (int lane = 0; lane < 32; ++lane) tc_load_reg_tables<BITS>(a, n0, lane, rt[lane]);
      std::vector<float> sums((size_t)WARPS * 2 * 32 * 4, 0.0f);
      for (int warp = 0; warp < WARPS; ++warp) {
        float acc[2][32][4] = {};
        for (int step = warp; step < tc_steps<BITS>(a); step += WARPS) {
          for (int lane = 0; lane < 32; ++lane) tc_load_step<BITS, FAST>(a, n0, step, lane, words_of(lane));
          for (int i = 0; i < W; ++i) {
            uint32_t fa[32][8][4], fb[32][8][2], as[32][4], bs[32][2], run[4][4];
            for (int lane = 0; lane < 32; ++lane)
              tc_a_fragments<BITS, NB>(smem.data(), rt[lane], lane, words_of(lane), i, fa[lane]);
            for (int nb = 0; nb < (a.m - m0 > 8 ? NB : 1); ++nb) {
              for (int lane = 0; lane < 32; ++lane) {
                tc_load_runs<BITS, FAST>(a, step, lane, i, m0 + 8 * nb + frag_group(lane), run);
                tc_b_fragments<tc_pairs<BITS, NB>()>(run, fb[lane]);
              }
              for (int s = 0; s < 8; ++s) {
                for (int lane = 0; lane < 32; ++lane) {
                  std::memcpy(as[lane], fa[lane][s], sizeof(as[lane]));
                  std::memcpy(bs[lane], fb[lane][s], sizeof(bs[lane]));
                }
                mma_warp_f16(acc[nb], as, bs);
              }
            }
          }
        }
        for (int nb = 0; nb < 2; ++nb)
          for (int lane = 0; lane < 32; ++lane)
            for (int i = 0; i < 4; ++i) sums[((warp * 2 + nb) * 32 + lane) * 4 + i] = acc[nb][lane][i];
      }
      for (int tid = 0; tid < 32 * WARPS; ++tid) tc_finish<WARPS>(a, sums.data(), n0, m0, tid);
    }
  }
}

// The dynamic shared memory anyprec_gemm_tc_`bits` needs in blocks of `warps` (tc_shared_bytes), for
// quantkit.kernels to be held to.
extern "C" int anyprec_tc_shared_bytes(int bits, int warps) {
  int bytes = -1;  // a block size no kernel is built with
  qk::with_width(bits, [&](auto width) {
    constexpr int B = decltype(width)::value;
    if (warps == qk::APT_WARPS) bytes = qk::tc_shared_bytes<B, qk::APT_WARPS>();
    else if (warps == qk::APT_FEW_WARPS) bytes = qk::tc_shared_bytes<B, qk::APT_FEW_WARPS>();
  });
  return bytes;
}

// qk::div_group, for a test of its multiply-high against a true division.
extern "C" int qk_div_group(int col, int d) { return qk::div_group(col, qk::GroupSize(d)); }

// Whether anyprec_gemm_tc*_`bits`_fast serves a shape (tc_fast), for quantkit.kernels to be held to.
extern "C" int anyprec_tc_fast(int bits, int m, int n, int k) {
  int fast = 0;
  const qk::AnyPrecArgs a{nullptr, nullptr, nullptr, nullptr, m, n, k, bits};
  qk::with_width(bits, [&](auto width) { fast = qk::tc_fast<decltype(width)::value>(a); });
  return fast;
}

// The host twin of each tensor-core kernel (kernels/anyprec_gemv.cu QK_AP_TC_ALL, the device build's list).
#define QK_AP_TC_HOST_ONE(NAME, B, NB, FAST, WARPS)                                                                \
  extern "C" void NAME##_host(const qk_half* x, const uint32_t* planes, const qk_half* lut, qk_half* out, int m,   \
                              int n, int k) {                                                                       \
    guarded([&] { anyprec_gemm_tc_host_at<B, NB, FAST, WARPS>(qk::AnyPrecArgs{x, planes, lut, out, m, n, k, B}); }); \
  }
QK_AP_TC_ALL(QK_AP_TC_HOST_ONE)
