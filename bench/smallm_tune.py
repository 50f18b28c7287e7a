"""Tune the small-M (decode) kernels on a GPU: their look-ahead and split-K budget, side by side in one run.

Every W4A8 small-M kernel (QServe per channel and g128, LiquidQuant, QQQ per channel and g128), Atom's and
Any-Precision's tensor-core kernel at 3 bits on Llama-3-8B's shapes at M = 1 and 16 (--formats picks layouts),
under each configuration of
  - QK_SMALLM_AHEAD: K steps' loads per round into registers (compile time, kernels/qk_common.cuh
    pipelined_steps),
  - SPLITK_WARPS and SPLITK_MIN_STEPS: how far split-K spreads a small grid (quantkit/kernels.py, per launch).
With --large it tunes the Hopper (wgmma) kernels at M = 1024 instead, over their ring of shared-memory stages
(QK_WGMMA_STAGES deep, copies QK_WGMMA_LEAD steps ahead). Each configuration runs in a process of its own (NVRTC
builds the kernels once per process, with QUANTKIT_NVRTC_DEFINES), on synthetic tensors made once for all of them
(in parallel). It first checks each kernel against the emulation at M = 3 and 13 (--large: 200; bit for bit,
Any-Precision's within its bound), then times it as `quantkit bench` does (CUDA-graph replays, operands rotating
past the L2 cache). A configuration times only the layouts its knobs change (SCOPES; the default times all), so
that a short lease fits more of them.
Prints one table (microseconds; the fastest configuration of each row marked) and the total per configuration and
layout; --json keeps it all, and --best writes the fastest per layout, merged (`fastest`); both are written after
every configuration, so that a run cut short keeps what it timed.

    PYTHONPATH=. python3 bench/smallm_tune.py [--json FILE] [--ms 1,16] [--configs NAME,...] [--formats F,...]
                                              [--large]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

from quantkit.files import atomic_write

REPO = Path(__file__).resolve().parent.parent

# name: (compile-time defines, settings of quantkit.kernels); the first is the built-in default. Eight H200 runs
# (bench/results/KERNELS.md and kernels_h200_smallm_tune.json) also tried the next round's register loads
# issued before this round's MMAs (look-aheads 2 and 4), split budgets of 1024, 3072 and 4096 warps and at least 16
# steps a warp, cp.async into per-thread shared-memory slots (4 or 6 steps ahead), rounds of equal size, the
# epilogue's scales prefetched to L2 and the activations loaded at their step's MMAs (8, 12 or 16 steps a round):
# none was faster than 8 plain loads a round over 2048 warps of at least 8 steps (16 steps: the same within 0.3%),
# and they are gone. 6 a round for QServe per channel alone was 5% faster at K = 14336 and 2-5% slower at M = 1 on
# the other shapes (run 7). For Any-Precision's tensor-core kernel, run 7 measured its 3-bit tables in shared
# memory (1.04-1.52x the time of tables in registers), 3 blocks an SM (80 registers with spills: 2-7% faster at
# N = 6144 and 28672, 3-6% slower at 4096) and two accumulator sets (no faster, up to 32% slower at M = 16); run 8
# blocks that take several tiles each, the next tile's words loaded during this one's (4% faster at N = 28672, 10%
# slower at 6144).
# An H100 run (bench/results/kernels_h100_smallm_tune.json, run 1; times against U8, the defaults then) made three of
# its configurations the defaults: the bit transpose's shifts (AP-SHIFTS, 0.94-0.97x on all eight Any-Precision
# rows), two token blocks for LiquidQuant's 9 to 16 tokens (LQQ-16, 0.79-0.99x at M = 16) and split-K across blocks
# (ZSPLIT, 0.46-1.17x), narrowed to the tiles whose copies a block cannot hold (split_plan). The 3-bit tables in
# shared memory were slower again (AP-SMEM 1.04-1.68x, AP-HYBRID 1.00-1.39x), and so were the bulk-copy kernels
# (BULK, up to 5.2x); QS-PC10, QS-PC12 and LQQ-A10 came within 0.91-1.05x, too close to call in one run.
# Run 3 (H100) made 4-warp blocks the default where 8 would leave a warp a single K step (AP-W4 took 0.79-0.90x on
# 6144 x 4096 and at M = 1 on 28672 x 4096, and 1.05-1.12x at K = 14336; anyprec_tc_warps). LQQ-A10 came within
# 0.96-1.00x, inside the run's noise: LQQ-4B's rows at M = 1 run the same kernel as U8 and took 0.94-0.97x.
# The built-in defines (8 steps' loads a round: QK_SMALLM_AHEAD) and split budget, which the other configurations
# vary. No define at all, so that the default configuration runs the default build, the one the tests and the bench
# load, and not a second build of the same kernels under another cache key.
U8: dict[str, int] = {}
SPLIT = {"SPLITK_WARPS": 2048, "SPLITK_MIN_STEPS": 8}
CONFIGS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "U8": (U8, SPLIT),
    "U6": ({"QK_SMALLM_AHEAD": 6}, SPLIT),
    # LiquidQuant from 9 to 16 tokens with four token blocks a tile, not two (liquidquant_w4a8_gemm16)
    "LQQ-4B": (U8, {**SPLIT, "LIQUIDQUANT_GEMM16": False}),
    # QServe's and QQQ's small-M kernels with each tile one block, not split across up to 4 (split_plan), or across
    # up to 2: on an H100 QQQ per channel on 6144 x 4096 took 0.93x the time in one block (runs 1 and 3), where QQQ
    # g128 took 1.22x; Z2 gives both 8 copies in each of 2 blocks a tile, between Z1's 8 in one and 4 in each of 4
    "Z1": (U8, {**SPLIT, "SPLITK_BLOCKS_MAX": 1}),
    "Z2": (U8, {**SPLIT, "SPLITK_BLOCKS_MAX": 2}),
    # LiquidQuant's register kernels on four warps a block (one 64-channel weight block), as measured until now
    "LQQ-W4": ({**U8, "QK_LQQ_TILE_WARPS": 4}, SPLIT),
    # the bulk-copy kernels on Hopper (qserve_w4a8_bulk, qqq_w4a8_bulk, liquidquant_w4a8_bulk8), two or three
    # chunks in flight a warp
    "BULK": (U8, {**SPLIT, "BULK_DECODE": True}),
    "BULK-3": (U8, {**SPLIT, "BULK_DECODE": True, "BULK_SLOTS": 3}),
    # QServe's per-channel decode kernel (qserve_w4a8_gemm_pc, 98 registers at 8) with 10 or 12 steps a round
    # (124 and 128 registers, no spills); the other kernels keep 8
    "QS-PC10": ({**U8, "QK_QSERVE_PC_AHEAD": 10}, SPLIT),
    "QS-PC12": ({**U8, "QK_QSERVE_PC_AHEAD": 12, "QK_EPILOGUE_EARLY": 0}, SPLIT),  # its parameters early spill
    # LiquidQuant's decode kernel (liquidquant_w4a8_gemm8, 110 registers at 8) with 10 steps a round (128, no spill)
    "LQQ-A10": ({**U8, "QK_LQQ_AHEAD": 10}, SPLIT),
    # Any-Precision's tensor-core kernels with bounds-checked loads everywhere (as measured until now), and the fast
    # ones with the next step's words loaded during word 3 of 4 at every width (the default: word 2 up to 3 bits)
    "AP-CHECKED": (U8, {**SPLIT, "ANYPREC_TC_FAST": False}),
    "AP-W3": ({**U8, "QK_AP_PREFETCH_WORD": 3}, SPLIT),
    # Any-Precision at 3 bits with both channel groups' tables in shared memory (one byte permute and one shared
    # load a pair of codes, and up to 8 tokens pair mode's B operand without permutes: 253 integer-ALU instructions
    # a step where the registers' lookups take 430), or one group's in registers and the other's in shared memory
    # (367; half the loads in flight)
    "AP-SMEM": ({**U8, "QK_AP_REG_GROUPS": 0}, SPLIT),
    "AP-HYBRID": ({**U8, "QK_AP_REG_GROUPS": 1}, SPLIT),
    # Any-Precision's bit transpose at 3 bits with multiply-adds on the FMA pipe (shift_or), not shifts and ORs on the
    # integer ALU (3-6% slower on an H100; the H200, where the profile found the ALU binding, has not timed it)
    "AP-FMA": ({**U8, "QK_AP_FMA_SHIFTS": 1}, SPLIT),
    # Any-Precision's tensor-core blocks of 4 or 2 warps everywhere, not 8: more steps a warp (its next step's words
    # in flight during this one's decode) and more, smaller blocks an SM; and AP-W8, blocks of 8 everywhere, not 4
    # where a warp of 8 would have a single step (anyprec_tc_warps: at K = 4096 up to 3 bits)
    "AP-W4": ({**U8, "QK_AP_TC_WARPS": 4}, SPLIT),
    "AP-W2": ({**U8, "QK_AP_TC_WARPS": 2}, SPLIT),
    "AP-W8": (U8, {**SPLIT, "ANYPREC_TC_FEW": False}),
    # Any-Precision from 9 tokens on (two token blocks) up to 3 bits: the second block's activations of a word loaded
    # before its A fragments' decode, in flight meanwhile, not after the first block's MMAs (tc_early_runs)
    "AP-EARLY": ({**U8, "QK_AP_EARLY_RUNS": 3}, SPLIT),
    # Any-Precision's register lookups at 3 bits with the upper half's codes (t >> 16) taken by a multiply-high on the
    # FMA pipe, not shifted on the integer ALU (tc_reg_lookup; the default until run 6, AP-SHF16 then 0.93-1.00x)
    "AP-MULHI": ({**U8, "QK_AP_LOOKUP_FMA": 1}, SPLIT),
    # LiquidQuant from 9 to 16 tokens with 16 channels a warp, 6 steps a round, not 32 channels (two 16-channel
    # slices, one load of the activations) and 4 (the default until run 6, LQQ-S2 then 0.66-0.91x at M = 16)
    "LQQ-S1": ({**U8, "QK_LQQ16_SLICES": 1}, SPLIT),
    # the W4A8 register kernels' split-K meeting with copy 0 adding every copy's stored sums after the block's
    # barrier, not each copy adding its own by shared-memory atomics as it finishes (the default until run 6)
    "NO-RED": ({**U8, "QK_SPLITK_RED": 0}, SPLIT),
    # the W4A8 register kernels' copies a block planned by a slot of sums a copy everywhere (SLOT-PLAN,
    # SPLITK_RED_PLAN 0), or by the one slot they meet in under RED everywhere (RED-ALL, 2), not only where that
    # makes a tile one block (the default, 1). In run 9 (H200) RED-ALL against SLOT-PLAN took QQQ at 6144 x 4096
    # from 4 blocks of 4 copies a tile to one of 16 (0.86-0.94x), at 4096 x 4096 from 4 blocks of 8 to 2 of 16
    # (1.01-1.02x), at 4096 x 14336 the same (0.98-1.05x)
    "SLOT-PLAN": (U8, {**SPLIT, "SPLITK_RED_PLAN": 0}),
    "RED-ALL": (U8, {**SPLIT, "SPLITK_RED_PLAN": 2}),
    # the meeting of a tile's blocks in device memory fenced by fence.acq_rel.gpu, not __threadfence's fence.sc.gpu
    # (QK_SPLITK_FENCE_SC; QQQ at N = 4096 and 6144, where a tile is 4 blocks)
    "MEET-ACQREL": ({**U8, "QK_SPLITK_FENCE_SC": 0}, SPLIT),
    # the decode kernels without registers for their epilogue's parameters across the K loop (QServe per group, QQQ
    # per channel, LiquidQuant from 9 tokens) loading them after the split-K meeting, not once their K loop is done,
    # in flight while the copies meet (QK_EPILOGUE_MID 0, the default until run 9, where EPI-MID took 0.88-1.00x);
    # and QQQ per group loading them before the meeting too (QK_EPILOGUE_MID_QQQ_GROUP; in run 9 1.00-1.10x on three
    # shapes, 0.96-0.99x at 4096 x 4096)
    "EPI-AFTER": ({**U8, "QK_EPILOGUE_MID": 0}, SPLIT),
    "EPI-MID-QG": ({**U8, "QK_EPILOGUE_MID_QQQ_GROUP": 1}, SPLIT),
    # QServe's and QQQ's tiles split over 2 or 4 blocks as one thread-block cluster, meeting in the first block's
    # shared memory, not in device memory by atomics, a fence and a count (SPLITK_CLUSTER; QQQ at N = 4096 and 6144)
    "CLUSTER": (U8, {**SPLIT, "SPLITK_CLUSTER": True}),
    # QServe per channel's and LiquidQuant's decode kernels with the epilogue's scales (and zero points, token sums)
    # loaded after the split-K meeting, not in registers from before the K loop (QK_EPILOGUE_EARLY; until run 6)
    "EPI-LATE": ({**U8, "QK_EPILOGUE_EARLY": 0}, SPLIT),
    # QServe from 9 to 16 tokens with two 32-channel tiles a warp, one load of the activations for both
    # (QSERVE_GEMM16: qserve_w4a8_gemm16, _pc16), as QK_LQQ16_SLICES = 2 for LiquidQuant
    "QS-S2": (U8, {**SPLIT, "QSERVE_GEMM16": True}),
    # and never (QS-S1: the default until stop 41, which takes them where N K >= 2^25 after runs 9 and 12b)
    "QS-S1": (U8, {**SPLIT, "QSERVE_GEMM16": False}),
    # Atom's small-M kernel (terms in shared memory, added in group order at a round's end) with 2 groups' loads in
    # flight a copy, not 3 (QK_ATOM_AHEAD: 102 registers, not 126; the default's first timing)
    "ATOM-A2": ({**U8, "QK_ATOM_AHEAD": 2}, SPLIT),
}
# The layouts whose kernels a configuration's knobs change: it times only those (the first, the default, times
# them all), so that a short device lease fits more configurations; --best then picks the fastest per layout.
W4A8 = ("qserve", "liquidquant", "qqq")
SCOPES: dict[str, tuple[str, ...]] = {
    "U6": W4A8, "ATOM-A2": ("atom",),
    "LQQ-4B": ("liquidquant",), "LQQ-W4": ("liquidquant",), "LQQ-A10": ("liquidquant",), "LQQ-S1": ("liquidquant",),
    "Z1": ("qserve", "qqq"), "Z2": ("qqq",), "NO-RED": W4A8, "EPI-AFTER": W4A8, "EPI-MID-QG": ("qqq",),
    "SLOT-PLAN": ("qqq",), "RED-ALL": ("qqq",),  # QServe's and LiquidQuant's blocks are bound by 512 threads either way
    "CLUSTER": ("qqq",), "MEET-ACQREL": ("qqq",),  # QServe splits no tile over blocks here
    "EPI-LATE": ("qserve", "liquidquant"), "QS-S2": ("qserve",), "QS-S1": ("qserve",),
    "BULK": W4A8, "BULK-3": W4A8,
    "QS-PC10": ("qserve",), "QS-PC12": ("qserve", "liquidquant"),  # its early epilogue off changes LiquidQuant's
    "AP-CHECKED": ("anyprec",), "AP-W3": ("anyprec",), "AP-SMEM": ("anyprec",), "AP-HYBRID": ("anyprec",),
    "AP-FMA": ("anyprec",), "AP-W4": ("anyprec",), "AP-W2": ("anyprec",), "AP-W8": ("anyprec",),
    "AP-EARLY": ("anyprec",), "AP-MULHI": ("anyprec",),
}


def scope(name: str, large: bool = False) -> tuple[str, ...] | None:
    """The layouts configuration `name` can change (None: all, as for the default and the --large ring)."""
    return None if large else SCOPES.get(name)


# --large: the Hopper kernels (kernels/qk_common.cuh WgmmaTiles) at M = 1024, the first the default. Each step's copy
# goes LEAD steps ahead into a ring of STAGES (LEAD = STAGES - 1 is the most the loop allows); WIDE takes the
# 256-channel kernels (*_wgmma2: one block of 17 KiB stages an SM, where the 128-channel kernel fits two of 13 KiB).
CP_ASYNC = {"QK_WGMMA_TMA": 0}  # the activation tiles by cp.async, as the weights
CP_ASYNC_W5L3 = {**CP_ASYNC, "QK_WGMMA_STAGES": 5, "QK_WGMMA_LEAD": 3}  # the default ring until run 10
LARGE_CONFIGS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    # the built-in ring: each stage's activation tile by one TMA copy from x's tensor map, completing on the stage's
    # mbarrier, so the loop needs no proxy fence (QK_WGMMA_TMA), 8 stages with copies 6 steps ahead (no define: the
    # default build). Run 10 (H200) took it as the default: 0.72-0.91x the cp.async ring's time (W5L3) per channel and
    # for LiquidQuant, 0.96-1.01x per group; TMA with W5L3's ring took 0.73-1.04x, with OVERLAP's retirement 0.82-1.05x.
    # Since run 11 it takes the 256-token blocks where their grid fills the waves (TALL, below), as every default
    # launch does; the ring's configurations below change whichever kernel that is
    "TMA-W8L6": ({}, {}),
    "TMA-W8L7": ({"QK_WGMMA_LEAD": 7}, {}),
    "TMA-W5L3": ({"QK_WGMMA_STAGES": 5, "QK_WGMMA_LEAD": 3}, {}),
    "TMA-OVERLAP": ({"QK_WGMMA_RETIRE": 2}, {}),
    # the activation tiles by cp.async, with the proxy fence before each step's barrier (the default until run 10),
    # with the ring 5 deep and copies 3 steps ahead (W5L3, the default then), and other rings
    "W5L3": (CP_ASYNC_W5L3, {}),
    "W5L4": ({**CP_ASYNC, "QK_WGMMA_STAGES": 5, "QK_WGMMA_LEAD": 4}, {}),
    "W8L6": ({**CP_ASYNC, "QK_WGMMA_STAGES": 8, "QK_WGMMA_LEAD": 6}, {}),
    "W8L7": ({**CP_ASYNC, "QK_WGMMA_STAGES": 8, "QK_WGMMA_LEAD": 7}, {}),
    # 256 tokens a block (one block an SM, 128 accumulators a thread): each warpgroup's dequantized weights feed two
    # m64n128 wgmmas, so the main loop issues 0.53-0.56x the instructions a multiply-add (QServe 198 a step for 256
    # tokens where 128 took 182, QQQ 198 and 186, LiquidQuant 156 and 140); with the ring of 8 stages of 21 KiB,
    # or of 10 (210 KiB). By default a launch takes it where its grid fills the waves (kernels.WGMMA_TALL None; run
    # 11: 0.74-0.96x on three shapes, 1.00-1.12x on 6144 x 4096); TALL takes it on every shape, SQUARE on none
    "TALL": ({}, {"WGMMA_TALL": True}),
    "SQUARE": ({}, {"WGMMA_TALL": False}),
    "TALL-W10L8": ({"QK_WGMMA_STAGES": 10, "QK_WGMMA_LEAD": 8}, {"WGMMA_TALL": True}),
    # the per-group 256-token kernels (QServe g128, QQQ per group) on the common ring of 8, not their own of 10
    # (QK_WGMMA_TALL_GROUP_STAGES since stop 41; until then TALL-W10L8 alone gave them 10: runs 11 and 12,
    # 0.96-0.99x TALL's time)
    "TALL-G8L6": ({"QK_WGMMA_TALL_GROUP_STAGES": 8, "QK_WGMMA_TALL_GROUP_LEAD": 6}, {}),
    # the 256-token kernels on every shape with the stream-K tail (QK_WGMMA_STREAMK): where the whole tiles leave a
    # last wave at most half full (6144 x 4096: 192 tiles on 132 SMs), its tiles split in two along K, meeting in an
    # int32 workspace. The check's 2 and 4 tiles at N = 256 are all split, so the device checks the meeting first
    "TALL-SK": ({"QK_WGMMA_STREAMK": 1}, {"WGMMA_TALL": True}),
    # 256 channels a block (one block an SM), with the default ring and deeper ones
    "WIDE": ({}, {"WGMMA_WIDE": True}),
    "WIDE8": ({"QK_WGMMA_STAGES": 8, "QK_WGMMA_LEAD": 7}, {"WGMMA_WIDE": True}),
    "WIDE12": ({"QK_WGMMA_STAGES": 12, "QK_WGMMA_LEAD": 11}, {"WGMMA_WIDE": True}),
    # when the cp.async ring's wgmmas retire (QK_WGMMA_RETIRE; by default just before the next step's fragments,
    # after its barrier and copy issue: RETIRE-LATE, 0.85-0.95x on every row of run 5): at the end of the next step,
    # while its fragments are unpacked into a second register set; or at the end of their own step (the default
    # until run 5)
    "OVERLAP": ({**CP_ASYNC_W5L3, "QK_WGMMA_RETIRE": 2}, {}),
    "RETIRE-END": ({**CP_ASYNC_W5L3, "QK_WGMMA_RETIRE": 0}, {}),
    # diagnostic (DIAGNOSTIC): the cp.async ring without the proxy fence of the completed copies, what its MEMBAR
    # costs a step (0.80-0.99x in run 5; TMA needs none)
    "NOFENCE": ({**CP_ASYNC_W5L3, "QK_WGMMA_PROXY_FENCE": 0}, {}),
}
# Configurations timed to learn what holds a kernel back, never to be run: `fastest` passes over them.
DIAGNOSTIC = frozenset({"NOFENCE"})
CHECK_SHAPE = (256, 4096)  # (N, K): few tiles and many K steps, so the check runs split
# The token counts each configuration is checked at before it is timed: small M the decode kernels (3) and those of
# two token blocks, the second partial (13: LiquidQuant's gemm16, Any-Precision's tensor-core kernel with NB = 2);
# --large two 128-token tiles, the second partial (TALL: one 256-token block's second half partial), and 300 (TALL:
# two blocks, the second one's second half all past M).
CHECK_MS = {False: (3, 13), True: (200, 300)}


def configs(large: bool) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    return LARGE_CONFIGS if large else CONFIGS


# The plan for the next lent GPU: the default that stop 41 replaced (QS-S1) and the one it adopted everywhere (QS-S2),
# then MEET-ACQREL and EPI-MID-QG (in run 12b both 0.95-0.96x on QQQ per channel's small shapes, which EPI-MID-QG's
# knob does not reach: the first configuration after the default timed faster than it), then the settings that runs
# 5, 6 and 9 replaced (EPI-AFTER, SLOT-PLAN, NO-RED, EPI-LATE, LQQ-S1, AP-MULHI), then those within noise or mixed.
# `--configs pending` times them after the default in this order, so that a run cut short still has the first.
PENDING: tuple[str, ...] = ("QS-S1", "QS-S2", "MEET-ACQREL", "EPI-MID-QG", "EPI-AFTER", "SLOT-PLAN", "RED-ALL",
                            "NO-RED", "EPI-LATE", "LQQ-S1", "AP-MULHI", "AP-EARLY", "CLUSTER", "AP-W8", "Z2", "ATOM-A2")
# --large --configs pending: the stream-K tail (TALL-SK, never run on a GPU: the fix for 6144 x 4096's last wave), the
# per-group 256-token kernels back on the common ring (TALL-G8L6, the setting stop 41 replaced), then the 256-token
# blocks on every shape (the per-group ones on 6144 x 4096 too, where their ring of 10
# took 0.97-0.98x the 128-token kernel's time for QQQ in runs 11 and 12) and the 128-token ones on every shape,
# against the default's choice by wave fill. Not again: TMA-W8L7 (1.2-1.5x), WIDE (1.5x on 6144 x 4096, equal
# elsewhere), TMA-W5L3 (0.99-1.06x in run 12), TALL-W10L8 for the per-channel and LiquidQuant kernels (0.96-1.15x).
LARGE_PENDING: tuple[str, ...] = ("TALL-SK", "TALL-G8L6", "TALL", "SQUARE")


def config_names(text: str, large: bool = False) -> list[str]:
    """The configurations that `--configs TEXT` names: a comma-separated list, "all", or "pending" (the default and
    PENDING); a ValueError names any unknown one."""
    table = configs(large)
    if text == "all":
        return list(table)
    if text == "pending":
        return [next(iter(table)), *(LARGE_PENDING if large else PENDING)]
    chosen = list(filter(None, text.split(",")))
    if unknown := [name for name in chosen if name not in table]:
        raise ValueError(f"unknown configurations {', '.join(unknown)}; {'--large ' if large else ''}has "
                         f"{', '.join(table)} (or all, or pending)")
    return chosen


def defines_of(name: str, large: bool = False) -> str:
    """Configuration `name`'s compile-time knobs as QUANTKIT_NVRTC_DEFINES takes them (NAME=VALUE, space-separated;
    also the key of their cached build, so bench/build_kernels.py makes them the same way)."""
    return " ".join(f"{key}={value}" for key, value in configs(large)[name][0].items())


def variants(large: bool = False):
    """The tuned kernels: each variant of quantkit bench on its small-M path, and Any-Precision's tensor-core kernel
    (its GEMV left out); with `large`, the W4A8 variants on their Hopper (wgmma) path."""
    from dataclasses import replace

    from quantkit.kernel_bench import PATHS, VARIANTS

    if large:
        return [replace(v, path="wgmma") for v in VARIANTS if "wgmma" in PATHS[v.fmt]]
    return [replace(v, path="small-M" if "small-M" in PATHS[v.fmt] else "tensor cores") for v in VARIANTS
            if "small-M" in PATHS[v.fmt] or v.fmt == "anyprec"]


def matches(v, tensors, launch, out) -> bool:
    """The kernel's output against the emulation: bit for bit, or for Any-Precision's tensor-core kernel within
    `anyprec_tc_bound`."""
    import numpy as np

    from quantkit.emulate import within_anyprec_tc_bound
    from quantkit.kernel_bench import emulated_out

    reference = emulated_out(v.fmt, tensors, launch, v.bits)
    if v.fmt != "anyprec":
        return bool(np.array_equal(out, reference))
    return within_anyprec_tc_bound(tensors, launch.args[0].view(np.float16), v.bits, out.view(np.float16),
                                   reference.view(np.float16))


def tensor_file(cache: Path, v, n: int, k: int) -> Path:
    """Where the synthetic tensors of variant v's layout at (N, K) are kept (shared by its paths)."""
    return cache / f"{v.fmt}-{v.group}-{v.bits}-{n}x{k}.pt"


def make_tensors(job: tuple[int, int, int, Path, bool]) -> None:
    """Synthetic tensors of variant i at (N, K), saved under `cache` (a pool worker)."""
    import torch

    from quantkit.kernel_bench import synthetic

    i, n, k, cache, large = job
    v = variants(large)[i]
    torch.save(synthetic(v.fmt, n, k, seed=3 if (n, k) == CHECK_SHAPE else 0, group=v.group),
               tensor_file(cache, v, n, k))


@cache
def fmt_of(key: str) -> str:
    """The layout of a timing row "label|NxK|M" (cached: `fastest` and the tables ask for every row many times)."""
    label = key.split("|")[0]
    return next(v.fmt for v in variants() + variants(True) if v.label == label)


def fastest(runs: list[dict], large: bool = False) -> dict | None:
    """The configuration to bench again, from the timed runs (the default's first): per layout, the fastest run over
    that layout's rows among those that match the emulation (DIAGNOSTIC ones left out), time all of them and beat
    the default, kept if its knobs agree with those already kept and it is no slower than the default on any layout
    its knobs change, else the next fastest (layouts taken in order of the time their best saves); the kept runs'
    knobs merged. None without a good default run."""
    table = configs(large)
    default = runs[0] if runs and runs[0]["config"] == next(iter(table)) else None
    if default is None or not all(default["checked"].values()):
        return None
    keys = list(default["seconds"])
    formats = list(dict.fromkeys(fmt_of(key) for key in keys))

    def total(run: dict, fmt: str) -> float | None:
        rows = [run["seconds"].get(key) for key in keys if fmt_of(key) == fmt]
        return None if any(t is None for t in rows) else sum(rows)

    good = [r for r in runs[1:] if all(r["checked"].values()) and r["config"] not in DIAGNOSTIC]
    candidates = {fmt: sorted((r for r in good if (total(r, fmt) or float("inf")) < total(default, fmt)),
                              key=lambda r: total(r, fmt)) for fmt in formats}
    defines, settings = dict(table[default["config"]][0]), dict(table[default["config"]][1])
    kept: list[dict] = []
    for fmt in sorted(formats, key=lambda f: total(candidates[f][0], f) - total(default, f) if candidates[f] else 0):
        for run in candidates[fmt]:
            if run in kept:
                break
            knobs, switches = table[run["config"]]
            agrees = all(defines.get(k, v) == v for k, v in knobs.items()) and \
                all(settings.get(k, v) == v for k, v in switches.items())
            changed = [f for f in scope(run["config"], large) or formats if f in formats]
            if agrees and all((total(run, f) or float("inf")) <= total(default, f) for f in changed):
                defines.update(knobs)
                settings.update(switches)
                kept.append(run)
                break
    names = [run["config"] for run in kept]
    per_layout = {fmt: "+".join(run["config"] for run in kept if fmt in (scope(run["config"], large) or formats))
                  or default["config"] for fmt in formats}
    return {"config": "+".join(names) or default["config"], "default": not names, "defines": defines,
            "settings": settings, "formats": per_layout}


def worker(name: str, ms: tuple[int, ...], cache: Path, formats: tuple[str, ...] = (), large: bool = False) -> dict:
    """One configuration, in this process (its defines already in the environment): check, then time."""
    import numpy as np
    import torch

    from quantkit import kernel_bench, kernels
    from quantkit.kernel_bench import rotation, timing, variant_launch, weight_bytes

    kernels.apply_settings(configs(large)[name][1])
    results, checked, threads, registers = {}, {}, {}, {}
    for v in variants(large):
        if formats and v.fmt not in formats:
            continue
        n, k = CHECK_SHAPE
        tensors = torch.load(tensor_file(cache, v, n, k))
        checked[v.label] = True
        for m in CHECK_MS[large]:
            launch = variant_launch(v, tensors, m, k, seed=4)
            out = kernels.run(launch, "cuda").view(np.uint16)
            checked[v.label] = checked[v.label] and matches(v, tensors, launch, out)
        for n, k in kernel_bench.SHAPE_SETS["llama3-8b"]:
            tensors = torch.load(tensor_file(cache, v, n, k))
            for m in ms:
                launch = variant_launch(v, tensors, m, k)
                call = rotation(lambda _, launch=launch: kernels.upload(launch), weight_bytes(tensors, v))
                seconds, _ = timing(call, 10, 50)
                results[f"{v.label}|{n}x{k}|{m}"] = seconds
                threads[f"{v.label}|{n}x{k}|{m}"] = launch.block  # 32 x warps: the split count shows here
                if launch.kernel not in registers:  # spills show as local memory
                    function = kernels.upload(launch).function
                    registers[launch.kernel] = (function.num_regs, function.local_size_bytes)
    return {"config": name, "checked": checked, "seconds": results, "threads": threads, "registers": registers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write every configuration's times here")
    parser.add_argument("--large", action="store_true", help="tune the Hopper (wgmma) kernels' ring instead, at "
                        "M = 1024 unless --ms says otherwise (configurations " + ", ".join(LARGE_CONFIGS) + ")")
    parser.add_argument("--ms", help="token counts (default 1,16; with --large 1024)")
    parser.add_argument("--configs", help="which configurations, by name (default all: " + ", ".join(CONFIGS) +
                        "), or pending: the default and those not yet timed (" + ", ".join(PENDING) + ")")
    parser.add_argument("--formats", default="", help="only these layouts (qserve, liquidquant, qqq, atom, anyprec; "
                        "default all)")
    parser.add_argument("--limit", type=float, default=120, help="seconds per configuration before it is skipped")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/quantkit-smallm-tune"),
                        help="where the synthetic tensors are kept between the configurations")
    parser.add_argument("--best", type=Path, help="write the fastest configuration here as JSON: per layout the one "
                        "with the least total time among those that match the emulation, their knobs merged where "
                        "they agree and slow no layout (`fastest`): its name, whether it is the built-in default "
                        "(the table's first), its defines (QUANTKIT_NVRTC_DEFINES), its settings "
                        "(QUANTKIT_KERNEL_SETTINGS) and each layout's configuration")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    table = configs(args.large)
    args.ms = args.ms or ("1024" if args.large else "1,16")
    ms = tuple(int(m) for m in args.ms.split(","))
    formats = tuple(filter(None, args.formats.split(",")))
    if args.worker:
        print(json.dumps(worker(args.worker, ms, args.cache, formats, args.large)))
        return
    try:
        names = config_names(args.configs or "all", args.large)
    except ValueError as e:
        parser.error(str(e))
    from concurrent.futures import ProcessPoolExecutor

    from quantkit.kernel_bench import SHAPE_SETS

    args.cache.mkdir(parents=True, exist_ok=True)
    jobs = [(i, n, k, args.cache, args.large) for i, v in enumerate(variants(args.large))
            if not formats or v.fmt in formats
            for n, k in (*SHAPE_SETS["llama3-8b"], CHECK_SHAPE) if not tensor_file(args.cache, v, n, k).exists()]
    with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1) or 1) as pool:
        list(pool.map(make_tensors, jobs))
    runs = []
    for name in names:
        defines = defines_of(name, args.large)
        env = {**os.environ, "PYTHONPATH": str(REPO), "QUANTKIT_NVRTC_DEFINES": defines}
        mine = scope(name, args.large)  # the layouts this configuration can change, within --formats
        timed = ",".join(f for f in mine if not formats or f in formats) if mine else args.formats
        if mine and not timed:
            print(f"{name}: changes none of the layouts asked for ({', '.join(mine)}), skipped", flush=True)
            continue
        try:
            done = subprocess.run([sys.executable, __file__, "--worker", name, "--ms", args.ms, "--cache",
                                   str(args.cache), "--formats", timed, *(["--large"] if args.large else [])],
                                  env=env, capture_output=True,
                                  text=True, timeout=args.limit,
                                  cwd=REPO)
        except subprocess.TimeoutExpired:
            print(f"{name}: over {args.limit:.0f} s, skipped", flush=True)
            continue
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-3000:]}", flush=True)
            continue
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if args.json:  # after every configuration, so that a run cut short keeps what it timed
            atomic_write(args.json, json.dumps(runs, indent=1))
        if args.best and (best := fastest(runs, args.large)):  # and its fastest so far
            atomic_write(args.best, json.dumps(best))
        bad = [label for label, ok in runs[-1]["checked"].items() if not ok]
        registers = ", ".join(f"{kernel} {regs} ({local} B local)"
                              for kernel, (regs, local) in runs[-1]["registers"].items())
        settings = ", ".join(f"{setting} {value}" for setting, value in table[name][1].items())
        print(f"{name} ({defines}, {settings}): "
              f"{'MISMATCH ' + ', '.join(bad) if bad else 'every kernel matches the emulation'}; registers "
              f"{registers}", flush=True)
    if not runs:
        sys.exit(1)
    names = [r["config"] for r in runs]
    print("\nmicroseconds per call (CUDA-graph replays); in brackets the block's threads (32 x warps)")
    print("\n| kernel | N x K | M | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for key in dict.fromkeys(key for r in runs for key in r["seconds"]):
        times = [r["seconds"].get(key) for r in runs]
        best = min(t for t in times if t is not None)
        label, shape, m = key.split("|")
        cells = ["-" if t is None else f"{'**' if t == best else ''}{t * 1e6:.1f}{'**' if t == best else ''} "
                 f"[{r['threads'][key]}]" for t, r in zip(times, runs, strict=True)]
        print(f"| {label} | {shape} | {m} | " + " | ".join(cells) + " |")
    formats_timed = list(dict.fromkeys(fmt_of(key) for r in runs for key in r["seconds"]))
    print("\ntotal us per layout (its rows; - where a configuration does not change it)\n")
    print("| config | " + " | ".join(formats_timed) + " |\n|---|" + "---|" * len(formats_timed))
    for r in runs:
        cells = []
        for fmt in formats_timed:
            rows = [t for key, t in r["seconds"].items() if fmt_of(key) == fmt]
            cells.append(f"{sum(rows) * 1e6:.1f}" if rows else "-")
        print(f"| {r['config']} | " + " | ".join(cells) + " |")
    best = fastest(runs, args.large)
    if args.best and best:
        print(f"\nfastest: {best['config']} ({', '.join(f'{f} {c}' for f, c in best['formats'].items())})")
    sys.exit(any(not ok for r in runs for ok in r["checked"].values()))


if __name__ == "__main__":
    main()
