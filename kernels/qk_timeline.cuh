// The phase timeline of the small-M kernels (bench/timeline.py): where a decode GEMM's time goes between launch and
// the last store, which neither CUDA events (one number a launch) nor Nsight Compute's counters (totals) show.
// Built with QK_TIMELINE, lane 0 of each warp writes, at each phase it reaches, %globaltimer (ns, one clock for all
// SMs) at slot `phase` and %clock64 (its SM's cycles) at QK_T_CLOCK + phase, and its SM's id at QK_T_SM, into
// qk_timeline[(block * QK_TIMELINE_WARPS + warp) * QK_TIMELINE_SLOTS + ...] (block: blockIdx's linear index), which
// the host points at a zeroed buffer (null: nothing is written). Without QK_TIMELINE every stamp is nothing, so no
// other build changes by a byte. The stamps are volatile asm, ordered with the MMAs (volatile asm too): a stamp after
// a compute follows the issue of its MMAs, which wait for their operands' loads.
#pragma once

#if defined(QK_TIMELINE) && defined(__CUDA_ARCH__)
#define QK_TIMELINE_WARPS 16  // the most warps of a small-M block (512 threads)
#define QK_TIMELINE_SLOTS 16
// START: the K loop entered; FIRST: the first step's MMAs issued (its loads returned); LOOP: the K loop done;
// REDUCED: the block's split-K partial sums added (copy 0); MET: the tile's blocks met (its last block); STORED: the
// outputs' stores issued.
enum { QK_T_START, QK_T_FIRST, QK_T_LOOP, QK_T_REDUCED, QK_T_MET, QK_T_STORED, QK_T_SM = 7, QK_T_CLOCK = 8 };

extern "C" {
__device__ unsigned long long* qk_timeline;
}

__device__ __forceinline__ void qk_stamp(int phase) {
  if (qk_timeline == nullptr || threadIdx.x % 32 != 0) return;
  unsigned long long ns, cycles;
  unsigned sm;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns));
  asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(cycles));
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned warp = threadIdx.x / 32 % QK_TIMELINE_WARPS;
  unsigned long long* slot = qk_timeline + ((unsigned long long)block * QK_TIMELINE_WARPS + warp) * QK_TIMELINE_SLOTS;
  slot[phase] = ns;
  slot[QK_T_CLOCK + phase] = cycles;
  slot[QK_T_SM] = sm;
}
#define QK_STAMP(phase) qk_stamp(phase)
#else
#define QK_STAMP(phase) ((void)0)
#endif
