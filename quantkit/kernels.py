"""The CUDA kernels of `kernels/` (shipped as quantkit.data.kernels): on a GPU through CuPy, and on the CPU through
quantkit's warp simulator, which compiles the same sources with the host C++ compiler (kernels/host_sim.cpp) so
that the kernels' own index and integer arithmetic is checked bit for bit against quantkit.emulate without a GPU.

Every kernel takes one linear's stored tensors exactly as the packer wrote them, plus its activations as the
producing kernel leaves them: per-token INT8 codes and scales for the W4A8 GEMMs (`gemm`; for QServe per channel
also the per-token sums of the unquantized activations), reordered INT4/INT8 codes and per-group scales for Atom
(`atom_gemm`), fp16 for the Any-Precision GEMV (`anyprec_gemv`). A `Launch` describes one call; `run` runs it
on either device.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.files import atomic_write, atomic_write_with
from quantkit.models.source import default_cache_dir
from quantkit.resources import data_path


class KernelUnavailable(QuantkitError):
    """The kernels cannot run here (no CUDA device or CuPy; no host C++ compiler for the simulator)."""


class SimulatorFailure(QuantkitError):
    """A kernel did what its warp-simulator twin refuses (loads of a K step past the last, a copy outside its slot,
    sums posted outside the split-K slots, a workspace not zero, a missing argument): a bug in the kernel source or
    its launch, raised for that launch alone."""


def source_dir() -> Path:
    """Where the kernel sources are: quantkit/data/kernels when installed, the repository's kernels/ in a checkout."""
    return data_path("kernels")


_HOST: ctypes.CDLL | None = None


def host_library() -> ctypes.CDLL:
    """The warp simulator, compiled once per source version into $QUANTKIT_CACHE/kernels."""
    global _HOST
    if _HOST is not None:
        return _HOST
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelUnavailable("the warp simulator needs a C++ compiler (g++ or c++) on PATH")
    src = source_dir()
    defines = tuple(f"-D{d}" for d in nvrtc_defines())  # the same knobs as the GPU build, so the same policies
    lib = _built("libqk_host", ".so", (".cu", ".cuh", ".cpp"), repr(defines).encode() if defines else b"")
    if not lib.exists():
        def build(tmp: str) -> None:
            cmd = [compiler, "-O2", "-std=c++17", "-ffp-contract=off", "-fPIC", "-shared", *defines,
                   str(src / "host_sim.cpp"), "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise KernelUnavailable(f"building the warp simulator failed:\n{done.stderr[-2000:]}")

        atomic_write_with(lib, build)
    _HOST = ctypes.CDLL(str(lib))
    _HOST.qk_sim_failure.restype = ctypes.c_char_p
    return _HOST


def nvrtc_defines() -> tuple[str, ...]:
    """The compile-time tuning knobs (NAME=VALUE) in $QUANTKIT_NVRTC_DEFINES, space-separated (bench/smallm_tune.py
    sets them per configuration), e.g. QK_SMALLM_AHEAD, QK_WGMMA_STAGES, QK_WGMMA_TMA, QK_SPLITK_RED, QK_AP_TC_WARPS."""
    return tuple(os.environ.get("QUANTKIT_NVRTC_DEFINES", "").split())


def _define(name: str, default: int) -> int:
    """The integer value of knob `name` in nvrtc_defines(), else `default`."""
    values = dict(d.partition("=")[::2] for d in nvrtc_defines())
    return int(values[name]) if values.get(name) else default


def _built(stem: str, suffix: str, kinds: tuple[str, ...], salt: bytes = b"") -> Path:
    """Where a build of the kernel sources (the files ending in `kinds`) is cached in $QUANTKIT_CACHE/kernels: named
    by a digest of their names and bytes (and `salt`, the compiler's version), so an edit rebuilds it."""
    sources = sorted(p for p in source_dir().iterdir() if p.suffix in kinds)
    digest = hashlib.sha256(salt + b"".join(p.name.encode() + p.read_bytes() for p in sources)).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"{stem}-{digest}{suffix}"


@dataclass(frozen=True)
class TensorMap:
    """A kernel argument that is the TMA tensor map of argument `of` (a row-major [rows, cols] byte array), boxes of
    `box_rows` x `box_cols` bytes swizzled over a box row's span: encoded once that array is on the GPU (`upload`,
    encode_tensor_map). The warp-simulator twins read the array itself and take no such argument."""

    of: int
    rows: int
    cols: int
    box_rows: int = 128
    box_cols: int = 64


@dataclass
class Launch:
    """One kernel call: the extern "C" kernel `name` of kernels/`module`.cu (its warp-simulator twin is
    `name`_host), its arguments in order (arrays, None for a null pointer, ints, tensor maps), its launch shape, and
    `out`, the argument the kernel writes."""

    module: str
    name: str
    args: list[np.ndarray | int | TensorMap | None]
    grid: tuple[int, ...]
    block: int
    out: np.ndarray
    shared_mem: int = 0  # bytes of dynamic shared memory (the split-K partial sums)
    cluster: int = 1  # blocks a thread-block cluster: the GPU runs `name`_z{cluster} (splitk_cluster), same bits

    @property
    def kernel(self) -> str:
        """The kernel the GPU runs: `name`, or its cluster build `name`_zC (the host twin is `name`'s either way)."""
        return self.name if self.cluster == 1 else f"{self.name}_z{self.cluster}"


def run(launch: Launch, device: str = "cpu") -> np.ndarray:
    """Run `launch` on the GPU (`device` "cuda") or in the warp simulator ("cpu"); returns its output array."""
    if device == "cpu":
        def c_arg(a):
            if a is None or isinstance(a, np.ndarray):
                return ctypes.c_void_p(None if a is None else a.ctypes.data)
            return ctypes.c_int(a)

        twin_args = (c_arg(a) for a in launch.args if not isinstance(a, TensorMap))
        host = host_library()
        getattr(host, launch.name + "_host")(*twin_args)
        if failure := host.qk_sim_failure():
            raise SimulatorFailure(f"warp simulator, {launch.name}: {failure.decode()}")
        return launch.out
    call = upload(launch)
    call()
    return call.result()


@dataclass
class GpuCall:
    """A launch whose arrays live on the GPU: calling it runs the kernel once (asynchronously)."""

    function: Any
    grid: tuple[int, ...]
    block: int
    args: tuple
    out: Any
    shared_mem: int = 0

    def __call__(self) -> None:
        self.function(self.grid, (self.block,), self.args, shared_mem=self.shared_mem)

    def result(self) -> np.ndarray:
        import cupy

        return cupy.asnumpy(self.out)


def hopper_kernel(name: str) -> bool:
    """Whether kernel `name` is built only into the Hopper (sm_90a) module: the *_wgmma* and *_bulk* kernels."""
    return "_wgmma" in name or "_bulk" in name


def launch_module(launch: Launch) -> Any:
    """The loaded CuPy RawModule that holds `launch`'s kernel (its globals too: bench/timeline.py's qk_timeline)."""
    return _module(launch.module, hopper=hopper_kernel(launch.name))


def upload(launch: Launch) -> GpuCall:
    """Copy `launch`'s arrays to the GPU once (for timing, repeated calls then touch only the kernel)."""
    import cupy

    def d_arg(a):
        if a is None or isinstance(a, TensorMap):
            return np.uint64(0)  # a null pointer (a tensor map's is filled in below)
        return cupy.asarray(a) if isinstance(a, np.ndarray) else np.int32(a)

    args = tuple(d_arg(a) for a in launch.args)
    args = tuple(encode_tensor_map(args[a.of], a) if isinstance(a, TensorMap) else d
                 for d, a in zip(args, launch.args, strict=True))
    out = args[next(i for i, a in enumerate(launch.args) if a is launch.out)]
    function = launch_module(launch).get_function(launch.kernel)
    if launch.shared_mem > 48 * 1024:  # beyond the default limit a kernel must opt in
        function.max_dynamic_shared_size_bytes = launch.shared_mem
        # and asks for the largest shared-memory share of the SM's L1, so that as many blocks as its registers allow
        # (two of the wgmma kernels') can share an SM whatever split the driver would pick by itself (not measured)
        function.preferred_shared_memory_carveout = 100
    return GpuCall(function, launch.grid, launch.block, args, out, launch.shared_mem)


# cuTensorMapEncodeTiled's enums (cuda.h): the data type, no interleave, the swizzles by span, L2 promotion.
_TMAP_UINT8, _TMAP_INTERLEAVE_NONE, _TMAP_L2_128B, _TMAP_OOB_ZERO = 0, 0, 2, 0
_TMAP_SWIZZLE = {32: 1, 64: 2, 128: 3}


def encode_tensor_map(array: Any, spec: TensorMap) -> Any:
    """The 128-byte TMA tensor map (CUtensorMap) of `array`, a CuPy uint8 array [spec.rows, spec.cols] row-major,
    as a CuPy array of its bytes in device memory (the kernels read it there: kernels/qk_common.cuh
    tensormap_acquire): boxes of box_rows x box_cols bytes, the swizzle of box_cols bytes, zeros past the array's
    rows. Encoded by the CUDA driver (libcuda's cuTensorMapEncodeTiled, which CuPy does not wrap)."""
    import cupy

    if array.dtype.itemsize != 1 or array.size != spec.rows * spec.cols or spec.cols % 16:
        raise ValueError(f"a tensor map needs a byte array of {spec.rows} x {spec.cols} (cols a multiple of 16), "
                         f"got {array.dtype} {array.shape}")
    encode = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    raw = np.zeros(128 + 64, np.uint8)  # CUtensorMap is 64-byte aligned
    at = -raw.ctypes.data % 64
    dims = (ctypes.c_uint64 * 2)(spec.cols, spec.rows)  # innermost first
    strides = (ctypes.c_uint64 * 1)(spec.cols)  # bytes from one row to the next
    box = (ctypes.c_uint32 * 2)(spec.box_cols, spec.box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    status = encode(ctypes.c_void_p(raw.ctypes.data + at), _TMAP_UINT8, 2, ctypes.c_void_p(array.data.ptr), dims,
                    strides, box, unit, _TMAP_INTERLEAVE_NONE, _TMAP_SWIZZLE[spec.box_cols], _TMAP_L2_128B,
                    _TMAP_OOB_ZERO)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for a {spec.rows} x {spec.cols} byte "
                           f"array, box {spec.box_rows} x {spec.box_cols}")
    return cupy.asarray(raw[at:at + 128])


# Split-K sizing: warps wanted in flight on the whole GPU (an H100 has 132 SMs of up to 64 resident warps; 16 each,
# with four 16-byte loads in flight per thread, keeps ~32 KiB of loads in flight per SM), the fewest K steps a split
# should walk, the shared memory a block may take without opting in to more, and the threads of a block (the
# small-M kernels are built with __launch_bounds__(512), so that any split fits their registers). Read at each
# launch: bench/smallm_tune.py sets them to compare.
SPLITK_WARPS = 2048
SPLITK_MIN_STEPS = 8
SPLITK_MAX_SHARED = 48 * 1024
SPLITK_MAX_THREADS = 512


# How the copies of a register kernel's block meet (kernels/qk_common.cuh QK_SPLITK_RED, a compile-time knob this
# mirrors): with 1, the default, each copy adds its sums into one slot by shared-memory atomics, so the block's
# dynamic shared memory holds that one slot; with 0 (smallm_tune's NO-RED) it holds a slot for every copy but the
# first. The bulk kernels always store theirs (bulk_plan).
SPLITK_RED = _define("QK_SPLITK_RED", 1) != 0
# How the register kernels' split-K plans count a block's slots of partial sums (split_plan's `red`): 0, a slot a copy
# (the plan before QK_SPLITK_RED); 1, the default, by the one slot they meet in under SPLITK_RED where that brings a
# tile's copies into one block, which the slot-a-copy plan spreads over several meeting in device memory (QQQ at
# 6144 x 4096: 16 copies a block, not 4 blocks of 4); 2, by the one slot everywhere (QQQ at 4096 x 4096 then 2
# blocks of 16, not 4 of 8). The H200 run of 35670a6 (bench/results/kernels_h200_smallm_tune.json, run 9) timed 2
# against 0: 0.86-0.94x where a tile came into one block, 0.98-1.05x where it did not.
SPLITK_RED_PLAN = 1


def splitk_shared(splits: int, partial_bytes: int, red: bool) -> int:
    """Bytes of dynamic shared memory a block of `splits` copies meets in (`partial_bytes` a copy's sums): one slot
    all copies add into when they meet by atomics (`red`), else a slot for each copy but the first (qk_common.cuh
    splitk_slots)."""
    return (min(splits - 1, 1) if red else splits - 1) * partial_bytes


def red_plan() -> bool:
    """Whether every register kernel's split-K plan counts one slot of partial sums a block (SPLITK_RED_PLAN 2)."""
    return SPLITK_RED and SPLITK_RED_PLAN == 2


def split_count(blocks: int, warps_per_copy: int, steps: int, partial_bytes: int, max_splits: int = 16,
                min_steps: int | None = None, red: bool = False) -> int:
    """How many copies of a tile's warps split its K steps (a power of two): enough that the grid's `blocks` fill
    the GPU when the output tiles alone are too few (small M), each copy walking at least `min_steps` steps
    (default SPLITK_MIN_STEPS), the partial sums (`partial_bytes` a copy, met as splitk_shared's `red` says)
    fitting in SPLITK_MAX_SHARED and the block in SPLITK_MAX_THREADS."""
    min_steps = SPLITK_MIN_STEPS if min_steps is None else min_steps
    most = min(max_splits, block_copies(partial_bytes, warps_per_copy, red))
    splits = 1
    while (2 * splits <= most and blocks * warps_per_copy * 2 * splits <= SPLITK_WARPS
           and steps // (2 * splits) >= min_steps):
        splits *= 2
    return splits


def block_copies(partial_bytes: int, warps_per_copy: int = 1, red: bool = False) -> int:
    """The most copies of a tile's `warps_per_copy` warps one block holds (a power of two): the block within
    SPLITK_MAX_THREADS, its partial sums (`partial_bytes` a copy, met as splitk_shared's `red` says) within
    SPLITK_MAX_SHARED."""
    copies = 1
    while (32 * warps_per_copy * 2 * copies <= SPLITK_MAX_THREADS
           and splitk_shared(2 * copies, partial_bytes, red) <= SPLITK_MAX_SHARED):
        copies *= 2
    return copies


# Split-K across blocks as well (QServe's and QQQ's small-M kernels): up to SPLITK_BLOCKS_MAX blocks a tile, which
# meet in an int32 workspace that the last block of a tile zeroes again (kernels/qk_common.cuh splitk_blocks). Only
# where a block cannot hold the copies SPLITK_WARPS asks for: QQQ's 64 tiles at N = 4096 (8 warps each; 16 copies'
# partial sums would pass the 48 KiB a block takes without opting in) ran 512 warps on 64 SMs. On an H100 (run 1
# of bench/results/kernels_h100_smallm_tune.json, ZSPLIT against U8) four blocks a tile took QQQ g128 from 41.7 to 19.7
# us at 4096 x 14336, 15.1 to 10.0 at 4096 x 4096 and 15.4 to 12.5 at 6144 x 4096 (M = 1), and QQQ per channel from
# 20.4 to 15.6 at 4096 x 14336, but 10.1 to 10.8 at 6144 x 4096. Blocks a tile for an even spread alone, at the same
# warps, were slower: QServe per channel at 6144 x 4096 8.4 -> 9.8 us (two blocks of 4 copies: 384 blocks, 97% of
# the even spread, against 192 of 8 copies, 73%), QQQ per channel at 28672 x 4096 24.4 -> 27.9.
SPLITK_BLOCKS_MAX = 4
SPLITK_SMS = 132  # an H100 / H200 SXM

# The tile's blocks one thread-block cluster (Hopper), meeting in the first one's shared memory (qk_common.cuh
# splitk_cluster: the *_z2 / *_z4 builds of QServe's and QQQ's register kernels) where by default they meet in
# device memory (splitk_blocks: atomics, a fence, a count and the last block's exchanges, round trips to L2, on the
# path of every tile that QQQ splits over 4 blocks at N = 4096 and 6144). bench/smallm_tune.py's CLUSTER: timed
# on the H100 and the H200 and not taken (README, "Not taken"), so off.
SPLITK_CLUSTER = False
CLUSTER_SIZES = (2, 4)  # the _z kernels built


def block_balance(blocks: int) -> float:
    """The share of the even spread a grid of `blocks` equal blocks gets on SPLITK_SMS SMs, all resident at once."""
    return blocks / (SPLITK_SMS * -(-blocks // SPLITK_SMS))


def split_plan(tiles: int, steps: int, partial_bytes: int, red: bool = False) -> tuple[int, int]:
    """(splits, zsplit) of a small-M launch of `tiles` one-warp tiles of `steps` K steps: split_count's copies a
    tile, doubled past a block's most while the tiles are too few for SPLITK_WARPS; where that adds copies (a block
    could not hold them all), the blocks a tile (a power of two up to SPLITK_BLOCKS_MAX) whose grid spreads most
    evenly (block_balance; the fewest on a tie), the copies shared among them. A tile stays one block when its copies
    fit one: more blocks for the spread alone were slower (SPLITK_BLOCKS_MAX's note). `red`: as block_copies."""
    splits = split_count(tiles, 1, steps, partial_bytes, red=red)
    held = block_copies(partial_bytes, red=red)
    total = splits
    while (2 * total <= held * SPLITK_BLOCKS_MAX and tiles * 2 * total <= SPLITK_WARPS
           and steps // (2 * total) >= SPLITK_MIN_STEPS):
        total *= 2
    if total == splits:
        return splits, 1
    zsplits = [z for z in (1 << i for i in range(SPLITK_BLOCKS_MAX.bit_length())) if z <= total and total // z <= held]
    zsplit = max(zsplits, key=lambda z: (round(block_balance(tiles * z), 6), -z))
    return total // zsplit, zsplit


def register_split_plan(tiles: int, steps: int, partial_bytes: int) -> tuple[int, int]:
    """split_plan for a register kernel, its block's slots counted as SPLITK_RED_PLAN says: by the one slot of sums
    the copies meet in (under SPLITK_RED) where that makes a tile one block, or everywhere with 2."""
    plan = split_plan(tiles, steps, partial_bytes)
    if not SPLITK_RED or SPLITK_RED_PLAN == 0:
        return plan
    one_slot = split_plan(tiles, steps, partial_bytes, red=True)
    return one_slot if SPLITK_RED_PLAN == 2 or one_slot[1] == 1 < plan[1] else plan


def meeting_point(tiles: int, count: int, zsplit: int) -> list[np.ndarray | None]:
    """The workspace of split-K across blocks (splitk_blocks): `count` int32 sums a lane of a warp for each tile and
    a count of the blocks arrived, zeros; nulls when a tile is one block."""
    return [np.zeros(tiles * count * 32, np.int32), np.zeros(tiles, np.int32)] if zsplit > 1 else [None, None]


@dataclass(frozen=True)
class Tiles:
    """The large-M path of a layout (the kernel's *Tiled policy in kernels/): a block of `threads` computes `bm`
    tokens x `bn` channels, walking K in steps of `bk` bytes of each row staged `stages` deep in shared memory."""

    bm: int
    bn: int
    bk: int
    threads: int
    stage_bytes: int
    stages: int = 4
    kernel: str = "tiled"  # the kernel's name is the module's, then _tiled or _wgmma
    slack: int = 0  # extra shared memory the kernel uses to align its stages

    def fits(self, n: int, k: int) -> bool:
        return n % self.bn == 0 and k % self.bk == 0

    def grid(self, m: int, n: int) -> tuple[int, int]:
        return (n // self.bn, -(-m // self.bm))

    @property
    def shared_mem(self) -> int:
        return self.stages * self.stage_bytes + self.slack

    def launch(self, module: str, args: list, m: int, n: int, out: np.ndarray) -> Launch:
        """The call of kernels/`module`.cu's `module`_tiled (or _wgmma) on `args`."""
        return Launch(module, f"{module}_{self.kernel}", args, self.grid(m, n), self.threads, out, self.shared_mem)


# Mirrors of the kernels' policies (QServeTiled, ...): a test checks them against the compiled ones (qk_tiles).
TILES = {
    "qserve": Tiles(128, 128, 64, 256, 128 * 64 + 128 * 64 // 2 + 2 * 2 * 128),
    "qqq": Tiles(128, 128, 64, 256, 128 * 64 + 128 * 64 // 2 + 2 * 128),
    "liquidquant": Tiles(128, 128, 64, 256, 128 * 64 + 2 * 2048 + 2 * 128),
    "atom": Tiles(128, 64, 64, 256, 128 * 64 + 64 * 64 + 4 * 128 + 8 * 64),  # a K step per group of 128 INT4
}
# The Hopper path of the W4A8 layouts (qk_common.cuh WgmmaTiles, sm_90a only): the tiled policy's stages rounded up
# to 1 KiB, QK_WGMMA_STAGES deep, wgmma.mma_async with the weights in registers.
# With QK_WGMMA_TMA (the default) each stage's activation tile comes by a TMA copy of x's tensor map, the kernels' last
# argument, completing on one of the stages' mbarriers after the ring, 8 stages deep; without it, by cp.async, 5 deep.
WGMMA_TMA = bool(_define("QK_WGMMA_TMA", 1))
WGMMA = {fmt: replace(TILES[fmt], stage_bytes=-(-TILES[fmt].stage_bytes // 1024) * 1024,
                      stages=_define("QK_WGMMA_STAGES", 8 if WGMMA_TMA else 5), kernel="wgmma", slack=1024)
         for fmt in ("qserve", "qqq", "liquidquant")}
# The same kernels on 256 channels a block (the *_wgmma2 kernels, WgmmaTiles<F, 2>): four warpgroups share each
# activation tile, which then crosses from L2 once per 256 channels, not 128 (a third less L2 traffic per MAC); a
# stage holds the tile and two 128-channel weight regions. One block of 512 threads an SM, where the 128-channel
# kernel fits two of 256.
WGMMA2 = {fmt: replace(t, bn=256, threads=512, kernel="wgmma2",
                       stage_bytes=-(-(t.bm * t.bk + 2 * (TILES[fmt].stage_bytes - t.bm * t.bk)) // 1024) * 1024)
          for fmt, t in WGMMA.items()}
# Whether a Hopper launch takes the 256-channel kernel where N % 256 == 0. Off: on an H100 it took 0.89-1.57x the
# 128-channel kernels' time at M = 1024, slower on 19 of 20 rows (bench/results/kernels_h100_smallm_tune.json, run
# 2); validate checks whichever a launch would take.
WGMMA_WIDE = False
# The same kernels on 256 tokens a block (the *_wgmma_tall kernels, WgmmaTiles<F, 1, 2>): each warpgroup's
# dequantized weights feed two m64n128 wgmmas, one a 128-token half of a 256-row activation tile, so a weight is
# unpacked once per 256 tokens; one block of 256 threads an SM (128 accumulators a thread).
WGMMA_TALL_TILES = {fmt: replace(t, bm=256, kernel="wgmma_tall",
                                 stage_bytes=-(-(256 * t.bk + TILES[fmt].stage_bytes - 128 * t.bk) // 1024) * 1024)
                    for fmt, t in WGMMA.items()}
# Their per-group variants (QServe's progressive groups, QQQ per group) on a ring of their own, 10 stages deep by
# default, copies 8 ahead (qk_common.cuh QK_WGMMA_TALL_GROUP_STAGES: on the H200 0.96-0.99x the time of 8 stages).
WGMMA_TALL_GROUP_TILES = {fmt: replace(WGMMA_TALL_TILES[fmt], stages=_define("QK_WGMMA_TALL_GROUP_STAGES", 10))
                          for fmt in ("qserve", "qqq")}
# Whether a Hopper launch takes the 256-token kernel (over WGMMA_WIDE's): True always, False never (the tuning's and
# the tests' settings), None (the default) where its grid fills the GPU's waves at least TALL_MIN_FILL of the way
# (`wave_fill`; one block an SM). On the H200 (kernels_h200_smallm_tune.json run 11, M = 1024) it took 0.74-0.96x the
# 128-token kernels' time on 4096 x 4096, 28672 x 4096 and 4096 x 14336, whose 128 and 896 blocks fill 0.97 of their
# waves on 132 SMs, and 1.00-1.12x on 6144 x 4096, whose 192 fill 0.73: there the last wave's blocks run alone, where
# the 128-token kernel's split finer.
WGMMA_TALL: bool | None = None
TALL_MIN_FILL = 0.9
# The stream-K tail of the 256-token kernels (built with QK_WGMMA_STREAMK = 1: smallm_tune --large's TALL-SK; off by
# default, as no GPU has run it yet): where the whole tiles leave a last wave at most half full, its tiles are split
# in two along K, two blocks a tile, which meet in an int32 workspace (qk_common.cuh streamk_meet), so the last wave
# takes half a tile's time. 6144 x 4096 at M = 1024: 192 tiles on 132 SMs, 60 in the second wave, which becomes
# 120 half-tiles: 1.5 tiles' time, not 2 (the 128-token kernels' 384 blocks fill 0.73 of theirs too).
WGMMA_STREAMK = bool(_define("QK_WGMMA_STREAMK", 0))
STREAMK_MIN_STEPS = 8  # the K steps each half takes at least (a K step is 64 columns)


def streamk_from(tiles: int, slots: int, steps: int) -> int:
    """The first block of the stream-K tail of a 256-token launch of `tiles` tiles of `steps` K steps on `slots` SMs
    (those after it take half a tile each), or `tiles` where no tile is split: off, whole waves, a last wave more
    than half full, or too few K steps to halve."""
    tail = tiles % slots
    if not WGMMA_STREAMK or not tail or 2 * tail > slots or steps < 2 * STREAMK_MIN_STEPS:
        return tiles
    return tiles - tail


def tall_fill(tiles: int, slots: int, steps: int) -> float:
    """The share of the SMs that a 256-token launch keeps busy: wave_fill, or with a stream-K tail the tiles' work
    over the whole waves and a half one."""
    start = streamk_from(tiles, slots, steps)
    return wave_fill(tiles, slots) if start == tiles else tiles / ((start // slots + 0.5) * slots)


# From this many tokens on a Hopper GPU, a W4A8 launch that names no path takes the wgmma kernel (None: only when
# asked, `wgmma=True`). Measured on an H200 (2026-11-26, Llama-3-8B shapes): faster than the tiled kernel at every
# M timed (1, 16, 1024; 1.7-2.6x at 1024), slower than the small-M kernel at M <= 16; so it replaces the tiled
# kernel from TILED_MIN_M, itself not yet tuned.
WGMMA_MIN_M: int | None = 64
# From this many tokens on, a launch takes the large-M path where the shape fits it. Not yet tuned on a GPU: the
# small-M kernels re-read each operand tile from L2 once per 16 tokens, the tiled ones once per 128.
TILED_MIN_M = 64


def tiled_k(fmt: str, k: int) -> int:
    """The K the large-M path of layout `fmt` walks: Atom's INT4 columns (its 128 INT8 outliers come on top)."""
    return k - 128 if fmt == "atom" else k


def use_tiles(fmt: str, m: int, n: int, k: int, tiled: bool | None) -> bool:
    """Whether a launch of layout `fmt` takes the large-M path: `tiled` if given (refused where the shape does not
    fit the block tile), else from M and the shape."""
    tiles, k = TILES[fmt], tiled_k(fmt, k)
    if tiled and not tiles.fits(n, k):
        raise ValueError(f"the large-M {fmt} kernel needs N % {tiles.bn} == 0 and K % {tiles.bk} == 0, got N={n}, "
                         f"K={k}")
    return tiles.fits(n, k) and m >= TILED_MIN_M if tiled is None else tiled


def use_wgmma(fmt: str, m: int, n: int, k: int, tiled: bool | None, wgmma: bool | None) -> bool:
    """Whether a W4A8 launch takes the Hopper kernel: `wgmma` if given; with neither it nor `tiled` given, from
    WGMMA_MIN_M tokens on a Hopper GPU where the shape fits (never while WGMMA_MIN_M is None)."""
    if wgmma is not None:
        return wgmma
    return (tiled is None and WGMMA_MIN_M is not None and m >= WGMMA_MIN_M and WGMMA[fmt].fits(n, k)
            and hopper_available())


def streamk_workspace(split: int, threads: int) -> list[np.ndarray | None]:
    """The stream-K tail's workspace for `split` tiles: each one's int32 sums (128 a thread of the 256-token block's
    `threads`) and its two flags, zeros; nulls where no tile is split."""
    if not split:
        return [None, None]
    return [np.zeros(split * 128 * threads, np.int32), np.zeros(2 * split, np.int32)]


def wave_fill(blocks: int, slots: int) -> float:
    """The share of `slots` (an SM each, or a block slot) that `blocks` keep busy over the waves they take."""
    return blocks / (-(-blocks // slots) * slots)


def wgmma_tiles(fmt: str, m: int, n: int, k: int, grouped: bool = False) -> Tiles:
    """The Hopper kernel a launch of layout `fmt` (per group: `grouped`) on [M, K] x [N, K] takes: 256 tokens a block
    where WGMMA_TALL says so (by default, where that grid fills TALL_MIN_FILL of its waves, `tall_fill`; per group on
    its own ring), else 256 channels where WGMMA_WIDE is on and N allows it, else 128 of each."""
    tall = WGMMA_TALL_TILES[fmt]
    blocks = (n // tall.bn) * -(-m // tall.bm)
    if WGMMA_TALL or (WGMMA_TALL is None and tall_fill(blocks, multiprocessors(), k // tall.bk) >= TALL_MIN_FILL):
        return WGMMA_TALL_GROUP_TILES[fmt] if grouped and fmt in WGMMA_TALL_GROUP_TILES else tall
    return WGMMA2[fmt] if WGMMA_WIDE and WGMMA2[fmt].fits(n, k) else WGMMA[fmt]


def large_m_launch(fmt: str, module: str, args: list, m: int, n: int, k: int, out: np.ndarray,
                   tiled: bool | None, wgmma: bool | None, grouped: bool = False) -> Launch | None:
    """The large-M launch of W4A8 layout `fmt` (the Hopper kernel per `use_wgmma`; `grouped`: the per-group
    variant), or None for the small-M kernel."""
    if use_wgmma(fmt, m, n, k, tiled, wgmma):
        if not WGMMA[fmt].fits(n, k):
            raise ValueError(f"the Hopper {fmt} kernel needs N % 128 == 0 and K % 64 == 0, got N={n}, K={k}")
        tiles = wgmma_tiles(fmt, m, n, k, grouped)
        grid = None
        if WGMMA_STREAMK and tiles.kernel == "wgmma_tall":  # a one-dimensional grid, the tail's arguments
            count = math.prod(tiles.grid(m, n))
            start = streamk_from(count, multiprocessors(), k // tiles.bk)
            args = [*args, start, *streamk_workspace(count - start, tiles.threads)]
            grid = (start + 2 * (count - start),)
        if WGMMA_TMA:  # x (the first argument) by tensor copies: its map last, a stage's mbarrier after the ring
            args = [*args, TensorMap(0, m, k, tiles.bm, tiles.bk)]
            tiles = replace(tiles, slack=tiles.slack + 8 * tiles.stages)
        launch = tiles.launch(module, args, m, n, out)
        return replace(launch, grid=grid) if grid else launch
    return TILES[fmt].launch(module, args, m, n, out) if use_tiles(fmt, m, n, k, tiled) else None


def _c(a: np.ndarray, dtype: type) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=dtype)


def _half_bits(t: torch.Tensor) -> np.ndarray:
    return _c(t.to(torch.float16).contiguous().view(torch.int16).numpy().view(np.uint16), np.uint16)


# Whether a small-M launch on a Hopper GPU takes the bulk-copy kernel (qserve_w4a8_bulk, qqq_w4a8_bulk;
# liquidquant_w4a8_bulk8 up to DECODE_MAX_M tokens): each warp's weights, activations and group parameters arrive by
# cp.async.bulk into its own slots of shared memory, BULK_SLOTS chunks in flight, no registers held by loads in
# flight (the register kernels' cap: 8 steps a warp). Off: on an H100 they took 0.99-5.2x the register kernels'
# time, 1.11-1.79x at M = 1 (bench/results/kernels_h100_smallm_tune.json, run 1, BULK against U8).
BULK_DECODE = False
BULK_SLOTS = 2
BULK_MAX_SHARED = 227 * 1024  # an sm_90 block's most dynamic shared memory (opted in)


def qserve_bulk_slot_bytes(chunk: int, rows: int, grouped: bool) -> int:
    """One slot of qserve_w4a8_bulk (kernels/qserve_w4a8.cu QServeBulk): `chunk` steps' weights (512 bytes each),
    `rows` activation rows of 32 chunk + 16 bytes, and per group the s2 and z2 rows of up to chunk + 1 groups."""
    return 512 * chunk + rows * (32 * chunk + 16) + (64 * (chunk + 1) if grouped else 0)


def liquidquant_bulk_slot_bytes(chunk: int, rows: int) -> int:
    """One slot of liquidquant_w4a8_bulk8 (kernels/liquidquant_w4a8.cu LiquidBulk): a warp's 512 weight bytes and
    32 bytes of step and offset a step, and `rows` activation rows of 64 chunk + 16 bytes."""
    return 544 * chunk + rows * (64 * chunk + 16)


def qqq_bulk_slot_bytes(chunk: int, rows: int, grouped: bool) -> int:
    """One slot of qqq_w4a8_bulk (kernels/qqq_w4a8.cu QQQBulk): `chunk` k16 steps' words (512 bytes each), `rows`
    activation rows of 16 chunk + 16 bytes, and per group the 64 ratios (128 bytes) of up to chunk / 8 + 2 groups."""
    return 512 * chunk + rows * (16 * chunk + 16) + (128 * (chunk // 8 + 2) if grouped else 0)


def bulk_plan(splits: int, partial_bytes: int, slot_bytes: Callable[[int], int], chunk: int) -> tuple[int, int, int]:
    """(chunk, slots, shared memory) of a bulk kernel's block of `splits` warps: chunks of `chunk` K steps (their
    bytes `slot_bytes(chunk)`), BULK_SLOTS of them a warp, fewer steps a chunk while the block's shared memory would
    pass BULK_MAX_SHARED (kernels/qk_common.cuh bulk_steps: partials, mbarriers, slots)."""
    barriers = -(-splits * BULK_SLOTS * 8 // 16) * 16  # 8 bytes a slot, rounded up to 16

    def shared(chunk: int) -> int:
        return (splits - 1) * partial_bytes + barriers + splits * BULK_SLOTS * slot_bytes(chunk)

    while chunk > 1 and shared(chunk) > BULK_MAX_SHARED:
        chunk //= 2
    return chunk, BULK_SLOTS, shared(chunk)


def use_bulk(bulk: bool | None) -> bool:
    """Whether a small-M launch takes its bulk-copy kernel: `bulk` if given, else BULK_DECODE on a Hopper GPU."""
    return bulk if bulk is not None else BULK_DECODE and hopper_available()


def warp_tile_launch(module: str, args: list, out: np.ndarray, m: int, n: int, width: int, count: int, steps: int,
                     splits: int | None, zsplit: int | None, bulk: bool | None,
                     slot_bytes: Callable[[int], int], gemm: str = "gemm", clusters: bool = True) -> Launch:
    """The small-M launch of a layout whose warp computes a 16-token x `width`-channel tile with `count` int32 sums
    a lane over `steps` K steps (QServe: 32 channels, 16 sums; QQQ: 64, 32): `module`_`gemm`, or `module`_bulk per
    use_bulk (chunks of 8 steps, 4 KiB of weights, up to 4 tokens, else 4, for their activation rows); `splits`
    copies a block and `zsplit` blocks a tile, default split_plan's (`zsplit` 1 when `splits` is given), those blocks
    one cluster under SPLITK_CLUSTER where the kernel has cluster builds (`clusters`; the inbox in the leader's
    shared memory, no workspace in device memory)."""
    tiles = (n // width) * -(-m // 16)
    partial_bytes = 32 * count * 4  # a warp's sums, for the block's split-K
    bulk = use_bulk(bulk)
    if splits is None:  # the bulk kernels store every copy's sums: a slot a copy
        plan = split_plan if bulk else register_split_plan
        splits, zsplit = plan(tiles, steps, partial_bytes)
    zsplit = zsplit or 1
    grid = (n // width, -(-m // 16), zsplit)
    if bulk:
        chunk, slots, shared = bulk_plan(splits, partial_bytes, slot_bytes, 8 if m <= 4 else 4)
        return Launch(module, f"{module}_bulk", [*args, splits, zsplit, *meeting_point(tiles, count, zsplit), chunk,
                                                 slots], grid, 32 * splits, out, shared)
    shared = splitk_shared(splits, partial_bytes, SPLITK_RED)
    cluster = zsplit if clusters and SPLITK_CLUSTER and zsplit in CLUSTER_SIZES else 1
    if cluster > 1 and shared + (cluster - 1) * partial_bytes <= SPLITK_MAX_SHARED:  # the leader's inbox after
        return Launch(module, f"{module}_{gemm}", [*args, splits, zsplit, None, None], grid, 32 * splits, out,
                      shared + (cluster - 1) * partial_bytes, cluster)
    return Launch(module, f"{module}_{gemm}", [*args, splits, zsplit, *meeting_point(tiles, count, zsplit)], grid,
                  32 * splits, out, shared)


def check_group_division(k: int, group: int) -> None:
    """The kernels find a column's group by a multiply-high by ceil(2^32 / group) (qk_common.cuh div_group), exact
    while K * group < 2^32: refuse a shape past that rather than read the wrong group's parameters."""
    if k * group >= 1 << 32:
        raise ValueError(f"K={k} with groups of {group} is past the kernels' group arithmetic (K * group < 2^32)")


# QServe from 9 to 16 tokens (more than DECODE_MAX_M) with two 32-channel tiles a warp (qserve_w4a8_gemm16, _pc16),
# one load of the activations for both (N a multiple of 64): True always, False never (the tests' settings), None (the
# default) where the weights number at least QSERVE_GEMM16_MIN_WEIGHTS (N K). bench/smallm_tune.py's QS-S2 (True) at
# M = 16 on an H200 (kernels_h200_smallm_tune.json runs 9 and 12b): 0.90-0.98x the one-tile kernels' time on 28672 x
# 4096 and 4096 x 14336, 1.04-1.39x on 6144 x 4096 and 4096 x 4096 (on an H100, run 5: 0.93-1.02x and 1.09-1.23x).
# The threshold lies between the two pairs of shapes; nothing between 25 and 59 million weights was timed.
QSERVE_GEMM16: bool | None = None
QSERVE_GEMM16_MIN_WEIGHTS = 1 << 25


def use_qserve_gemm16(m: int, n: int, k: int, bulk: bool | None) -> bool:
    """Whether a small-M QServe launch of [M, K] x [N, K] takes the two-tile kernels (QSERVE_GEMM16)."""
    if m <= DECODE_MAX_M or n % 64 or use_bulk(bulk):
        return False
    return QSERVE_GEMM16 if QSERVE_GEMM16 is not None else n * k >= QSERVE_GEMM16_MIN_WEIGHTS


def qserve_launch(tensors: dict[str, torch.Tensor], x_int8: np.ndarray, s_x: np.ndarray,
                  t_x: np.ndarray | None = None, splits: int | None = None, tiled: bool | None = None,
                  wgmma: bool | None = None, bulk: bool | None = None, zsplit: int | None = None) -> Launch:
    """kernels/qserve_w4a8.cu on one linear's stored tensors (`t_x`: per-token sums of the unquantized
    activations, needed per channel; `splits`: warps splitting K per output tile on the small-M path and `zsplit`
    blocks doing so, default split_plan's (`zsplit` 1 when `splits` is given); `tiled`: the large-M path, default
    from M and the shape; `wgmma`: the Hopper kernel on or off, default per use_wgmma; `bulk`: the small-M path's
    bulk-copy kernel, default per use_bulk)."""
    qweight = _c(tensors["qweight"].contiguous().view(torch.uint8).numpy(), np.uint8)
    n, k, m = qweight.shape[0], qweight.shape[1] * 2, x_int8.shape[0]
    grouped = "s2_scales" in tensors
    if not grouped and t_x is None:
        raise ValueError("the per-channel QServe kernel needs t_x, the per-token sums of the activations")
    group = k // tensors["s2_scales"].shape[0] if grouped else 0
    if grouped:
        check_group_division(k, group)
    out = np.zeros((m, n), dtype=np.uint16)
    args = [_c(x_int8, np.int8), _c(s_x, np.float32), None if grouped else _c(t_x, np.float32), qweight,
            _half_bits(tensors["s1_scales"]), None if grouped else _half_bits(tensors["s1_szeros"]),
            _c(tensors["s2_scales"].numpy(), np.int8) if grouped else None,
            _c(tensors["s2_zeros"].numpy(), np.int8) if grouped else None,
            out, m, n, k, group]
    if large := large_m_launch("qserve", "qserve_w4a8", args, m, n, k, out, tiled, wgmma, grouped):
        return large
    # per group qserve_w4a8_gemm, per channel qserve_w4a8_gemm_pc: neither carries the other's code or registers;
    # from 9 tokens on, per use_qserve_gemm16, their two-tile kernels (*16: 64 channels a warp, 32 sums a lane)
    gemm = "gemm" if grouped else "gemm_pc"
    if use_qserve_gemm16(m, n, k, bulk):
        return warp_tile_launch("qserve_w4a8", args, out, m, n, 64, 32, k // 32, splits, zsplit, False,
                                lambda c: 0, gemm + "16", clusters=False)
    return warp_tile_launch("qserve_w4a8", args, out, m, n, 32, 16, k // 32, splits, zsplit, bulk,
                            lambda c: qserve_bulk_slot_bytes(c, min(16, m), grouped), gemm)


# Up to this many tokens (one n8 block of the MMAs) the launches take the decode kernels (liquidquant_w4a8_gemm8,
# anyprec_gemm_tc8_*); `matches_emulation` also checks them, on the first token alone, when the activations have more.
DECODE_MAX_M = 8

# LiquidQuant's small-M kernel holds the activations of its tile's token blocks of 8 in registers beside the
# weights' loads: up to 8 tokens one block (liquidquant_w4a8_gemm8: 8 K steps a round, 0.81-0.89x the four-block
# kernel's time at M = 1 on an H200), up to 16 two (liquidquant_w4a8_gemm16, 6 steps a round: at M = 16 on an H100,
# 0.81, 0.79, 0.99 and 0.95x the four-block kernel's time on the four Llama-3-8B shapes, run 1 of
# bench/results/kernels_h100_smallm_tune.json), else four (4 steps a round). False: four blocks from 9 tokens on.
LIQUIDQUANT_GEMM16 = True
# The warps of a LiquidQuant small-M block (kernels/liquidquant_w4a8.cu QK_LQQ_TILE_WARPS): one, each with its 16
# channels, so that N / 16 blocks spread over every SM (at N = 4096 the 64 blocks of four warps, one per 64-channel
# weight block, left half of an H200's 132 SMs idle); 4 as before, through QUANTKIT_NVRTC_DEFINES, for comparison.
LQQ_TILE_WARPS = _define("QK_LQQ_TILE_WARPS", 1)
# The 16-channel slices a warp of liquidquant_w4a8_gemm16 computes from one load of the activations
# (QK_LQQ16_SLICES: 2 since H100 tuning run 6, 0.66-0.91x the time of one at M = 16; 1 is smallm_tune's LQQ-S1).
LQQ16_SLICES = _define("QK_LQQ16_SLICES", 2)


def liquidquant_launch(tensors: dict[str, torch.Tensor], x_int8: np.ndarray, s_x: np.ndarray,
                       t_x: np.ndarray | None = None, splits: int | None = None, tiled: bool | None = None,
                       wgmma: bool | None = None, bulk: bool | None = None) -> Launch:
    """kernels/liquidquant_w4a8.cu on one linear's stored tensors (`splits`: copies of a block's LQQ_TILE_WARPS warps
    splitting K on the small-M path, of the one warp of a 16-channel tile on the bulk path; `tiled`: the
    large-M path, default from M and the shape; `wgmma`: the Hopper kernel on or off, default per use_wgmma;
    `bulk`: up to DECODE_MAX_M tokens the bulk-copy kernel, default per use_bulk)."""
    qweight = _c(tensors["qweight"].numpy(), np.uint8)
    n, k, m = qweight.shape[0] * 64, qweight.shape[1] * 64, x_int8.shape[0]
    out = np.zeros((m, n), dtype=np.uint16)
    args = [_c(x_int8, np.int8), _c(s_x, np.float32), qweight, _c(tensors["s2a"].numpy(), np.uint8),
            _half_bits(tensors["s1_scales"]), out, m, n, k]
    if large := large_m_launch("liquidquant", "liquidquant_w4a8", args, m, n, k, out, tiled, wgmma):
        return large
    if m <= DECODE_MAX_M and use_bulk(bulk):  # a warp a 16-channel tile; chunks of 8 K steps of 64 (4 KiB)
        grid = (n // 16, 1)
        splits = splits or split_count(grid[0], 1, k // 64, 512)
        chunk, slots, shared = bulk_plan(splits, 512, lambda c: liquidquant_bulk_slot_bytes(c, m), 8)
        return Launch("liquidquant_w4a8", "liquidquant_w4a8_bulk8", [*args, splits, chunk, slots], grid, 32 * splits,
                      out, shared)
    blocks = 1 if m <= DECODE_MAX_M else 2 if m <= 16 and LIQUIDQUANT_GEMM16 else 4  # token blocks of 8 a tile
    warps, slices = LQQ_TILE_WARPS, LQQ16_SLICES if blocks == 2 else 1
    if n % (16 * warps * slices):
        raise ValueError(f"liquidquant_w4a8_gemm16 built with {slices} slices a warp and {warps} warps a block "
                         f"needs N a multiple of {16 * warps * slices}; got N={n}")
    grid = (n // (16 * warps * slices), -(-m // (8 * blocks)))
    partial_bytes = 32 * warps * 4 * blocks * slices * 4  # a copy's 4 accumulators a token block and slice a thread
    splits = splits or split_count(grid[0] * grid[1], warps, k // 64, partial_bytes, red=red_plan())
    name = {1: "liquidquant_w4a8_gemm8", 2: "liquidquant_w4a8_gemm16", 4: "liquidquant_w4a8_gemm"}[blocks]
    return Launch("liquidquant_w4a8", name, [*args, splits], grid, 32 * warps * splits, out,
                  splitk_shared(splits, partial_bytes, SPLITK_RED))


def qqq_launch(tensors: dict[str, torch.Tensor], x_int8: np.ndarray, s_x: np.ndarray,
               t_x: np.ndarray | None = None, splits: int | None = None, tiled: bool | None = None,
               wgmma: bool | None = None, bulk: bool | None = None, zsplit: int | None = None) -> Launch:
    """kernels/qqq_w4a8.cu on one linear's stored tensors (`splits`: warps splitting K per output tile on the
    small-M path and `zsplit` blocks doing so, default split_plan's (`zsplit` 1 when `splits` is given); `tiled`:
    the large-M path, default from M and the shape; `wgmma`: the Hopper kernel on or off, default per use_wgmma;
    `bulk`: the small-M path's bulk-copy kernel, default per use_bulk)."""
    b = _c(tensors["B"].numpy().view(np.uint32), np.uint32)
    n, k, m = b.shape[1] // 2, b.shape[0] * 16, x_int8.shape[0]
    out = np.zeros((m, n), dtype=np.uint16)
    grouped = "s_group" in tensors
    args = [_c(x_int8, np.int8), _c(s_x, np.float32), b, _c(tensors["s_channel"].float().numpy().reshape(-1),
                                                                np.float32),
            _half_bits(tensors["s_group"]) if grouped else None, out, m, n, k]
    if large := large_m_launch("qqq", "qqq_w4a8", args, m, n, k, out, tiled, wgmma, grouped):
        return large
    # per group qqq_w4a8_gemm, per channel qqq_w4a8_gemm_pc: neither carries the other's code
    return warp_tile_launch("qqq_w4a8", args, out, m, n, 64, 32, k // 16, splits, zsplit, bulk,
                            lambda c: qqq_bulk_slot_bytes(c, min(16, m), grouped), "gemm" if grouped else "gemm_pc")


# Atom's small-M kernel: the K steps each copy of a tile's warp should have at least (its look-ahead, QK_ATOM_AHEAD,
# is 3), and the shared memory a block may take: slots of 4 bytes an output of the tile's min(M, 16) x 16, one for
# each INT4 group of a round and ATOM_EXTRA_SLOTS more (the outlier halves' products, their scale and the running
# sums; kernels/atom_w4a4.cu atom_slot).
ATOM_MIN_STEPS = 3
ATOM_MAX_SHARED = 48 * 1024
ATOM_EXTRA_SLOTS = 4


def atom_step_bytes(m: int) -> int:
    """Shared memory one K step's terms take in Atom's small-M kernel: a float32 an output of the tile."""
    return 4 * 16 * min(m, 16)


def atom_round_limit(m: int) -> int:
    """The most INT4 groups a round of Atom's small-M kernel can hold: their slots and the ATOM_EXTRA_SLOTS within
    ATOM_MAX_SHARED."""
    return ATOM_MAX_SHARED // atom_step_bytes(m) - ATOM_EXTRA_SLOTS


def atom_rounds(groups: int, m: int) -> int:
    """INT4 groups a round of Atom's small-M kernel holds: all of them where they fit (K = 14336 up to M = 6), else
    rounds of equal size within atom_round_limit."""
    rounds = max(1, -(-groups // atom_round_limit(m)))
    return max(1, -(-groups // rounds))


def atom_launch(tensors: dict[str, torch.Tensor], x_codes: np.ndarray, s_x: np.ndarray, tiled: bool | None = None,
                splits: int | None = None, per_round: int | None = None) -> Launch:
    """kernels/atom_w4a4.cu on one linear's stored tensors, from the activations as the producing kernel leaves
    them: codes [M, K] in `reorder_index` order (INT4 normal columns, INT8 outliers last) and scales [M, G + 1]
    (`tiled`: the large-M kernel, default from M and N; `splits`: copies of the small-M warp taking turns at the
    steps, default split_count's; `per_round`: the INT4 groups whose terms a round of the small-M kernel holds in
    shared memory, default atom_rounds')."""
    from quantkit.formats.atom import OUTLIERS

    x_codes = np.asarray(x_codes, dtype=np.int64)
    m, k = x_codes.shape
    n = tensors["weight_int4"].shape[0]
    nibbles = (x_codes[:, :k - OUTLIERS] & 0xF).astype(np.uint8)
    out = np.zeros((m, n), dtype=np.uint16)
    args = [_c(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), np.uint8), _c(x_codes[:, k - OUTLIERS:], np.int8),
            _c(s_x, np.float32), _c(tensors["weight_int4"].numpy(), np.uint8),
            _c(tensors["weight_int8"].numpy(), np.int8), _half_bits(tensors["scale_int4"]),
            _half_bits(tensors["scale_int8"]), out, m, n, k]
    if use_tiles("atom", m, n, k, tiled):
        return TILES["atom"].launch("atom_w4a4", args, m, n, out)
    if max(m, n) * (k // 2) >= 1 << 32:
        raise ValueError(f"Atom's small-M kernel takes 32-bit offsets into its operands (M, N times K / 2 below 2^32), "
                         f"got M={m}, N={n}, K={k}")
    grid, groups = (n // 16, -(-m // 16)), (k - OUTLIERS) // 128
    # a K step is a group of 128 INT4 columns or half the outliers; a copy's look-ahead wants a few of its own
    splits = splits or split_count(grid[0] * grid[1], 1, groups + 2, 0, min_steps=ATOM_MIN_STEPS)
    per_round = atom_rounds(groups, m) if per_round is None else per_round
    if not 1 <= per_round <= atom_round_limit(m):
        raise ValueError(f"per_round={per_round}: a round of Atom's small-M kernel holds 1 to "
                         f"{atom_round_limit(m)} groups at M={m}")
    return Launch("atom_w4a4", "atom_w4a4_gemm", [*args, splits, per_round], grid, 32 * splits, out,
                  (per_round + ATOM_EXTRA_SLOTS) * atom_step_bytes(m))


def atom_gemm(tensors: dict[str, torch.Tensor], x_codes: np.ndarray, s_x: np.ndarray, device: str = "cpu",
              tiled: bool | None = None, splits: int | None = None) -> np.ndarray:
    """Atom's W4A4 kernel on one linear: fp16 out [M, N] (`tiled`: force the large-M kernel on or off; `splits`:
    the small-M kernel's copies)."""
    return run(atom_launch(tensors, x_codes, s_x, tiled, splits), device).view(np.float16)


ANYPREC_WARPS, ANYPREC_TOKENS = 8, 8  # kernels/anyprec_gemv.cu: channels per block (one a warp), tokens per warp
ANYPREC_TC_CHANNELS, ANYPREC_TC_TOKENS = 16, 16  # anyprec_gemm_tc(8): the m16 tile of channels, two n8 of tokens
# The warps of a tensor-core block (kernels/anyprec_gemv.cu QK_AP_TC_WARPS: 8; 4 and 2 for bench/smallm_tune.py).
ANYPREC_TC_WARPS = _define("QK_AP_TC_WARPS", 8)
# The channel groups (of a lane's 2) whose 3-bit tables the tensor-core kernels hold in registers (QK_AP_REG_GROUPS:
# 2; 0 and 1 put one or both in shared memory, bench/smallm_tune.py's AP-SMEM and AP-HYBRID).
ANYPREC_REG_GROUPS = _define("QK_AP_REG_GROUPS", 2)
# The fast kernels up to 3 bits are also built with blocks of 4 warps (APT_FEW_WARPS, *_fast_w4), which the launch
# takes where ANYPREC_TC_WARPS would leave a warp under two K steps (anyprec_tc_warps): K = 4096 at up to 4 bits is
# 8 steps. On an H100 they took 0.79-0.90x the time on 6144 x 4096 and at M = 1 on 28672 x 4096, and 1.07x at
# M = 16 on 4096 x 4096 (bench/results/kernels_h100_smallm_tune.json, run 3). False: ANYPREC_TC_WARPS everywhere.
ANYPREC_TC_FEW_WARPS = 4
ANYPREC_TC_FEW = True
# From this many tokens on, the Any-Precision launch takes the tensor-core kernel: from the first. On an H200 it took
# 7.0-27.3 us at M = 1 on Llama-3-8B's shapes (bench/results/kernels_h200_bench_8293562.json) where the CUDA-core
# GEMV took 22.1-122.9 us (kernels_h200_anyprec_paths.json); the GEMV stays, bit for bit the emulation's
# arithmetic, for `quantkit validate` and `tc=False`.
ANYPREC_TC_MIN_M = 1


def anyprec_tc_shared_bytes(bits: int, warps: int | None = None) -> int:
    """Dynamic shared memory of anyprec_gemm_tc_`bits` in blocks of `warps` (default ANYPREC_TC_WARPS;
    tc_shared_bytes): where the tables are in shared memory (above 3 bits, and up to 3 unless QK_AP_REG_GROUPS keeps
    both channel groups' in registers, the default), 256 bytes an entry (4 copies of 32 bits for each of the block's
    16 channels: fp16 pairs of nibble-pair bytes up to 4 bits, which also hold pair mode's 4^bits, else one fp16 per
    code), and at least the warps' sums [warps, 2, 32, 4] float32 that reuse it at the end."""
    in_registers = bits <= 3 and ANYPREC_REG_GROUPS >= 2
    entries = 0 if in_registers else 17 * ((1 << bits) - 1) + 1 if bits <= 4 else 1 << bits
    return max(entries * 256, (warps or ANYPREC_TC_WARPS) * 2 * 32 * 4 * 4)


def anyprec_tc_block_sizes(bits: int, fast: bool) -> tuple[int, ...]:
    """The block sizes (warps) the tensor-core kernels at width `bits` are built with: ANYPREC_TC_WARPS, and
    ANYPREC_TC_FEW_WARPS too for the fast ones up to 3 bits (*_fast_w4)."""
    return (ANYPREC_TC_WARPS, ANYPREC_TC_FEW_WARPS) if fast and bits <= 3 else (ANYPREC_TC_WARPS,)


def anyprec_tc_warps(k: int, bits: int, fast: bool) -> int:
    """The warps of a tensor-core block for K at width `bits`: ANYPREC_TC_FEW_WARPS where the kernel is built with
    it and ANYPREC_TC_WARPS would leave a warp under two of the tile's K steps (512 columns a step up to 4 bits, 256
    above: tc_steps), so that each warp's next step is in flight during this one's decode and an SM holds twice the
    blocks; else ANYPREC_TC_WARPS."""
    steps = -(-(k // 32) // (16 if bits <= 4 else 8))
    few = (ANYPREC_TC_FEW and ANYPREC_TC_FEW_WARPS < ANYPREC_TC_WARPS
           and ANYPREC_TC_FEW_WARPS in anyprec_tc_block_sizes(bits, fast))
    return ANYPREC_TC_FEW_WARPS if few and steps < 2 * ANYPREC_TC_WARPS else ANYPREC_TC_WARPS


# The tensor-core kernels with unchecked loads (anyprec_gemm_tc*_fast) where a shape allows them (anyprec_tc_fast):
# the same MMAs on the same operands, so the same bits, with 27-31% fewer instructions a step (sm_90a SASS of the
# 3- and 4-bit kernels' main loops). False takes the checked kernels everywhere, to time the two side by side.
ANYPREC_TC_FAST = True


def anyprec_tc_fast(m: int, n: int, k: int, bits: int) -> bool:
    """Whether anyprec_gemm_tc*_`bits`_fast serves [M, K] x [N, K] (tc_fast): K a multiple of the 1024-column
    chunk, so that no step needs bounds checks, and 32-bit indices (the first `bits` planes under 2^32 words, the
    activations under 2^32 values)."""
    return k % 1024 == 0 and bits * n * (k // 32) <= 0xFFFFFFFF and m * k <= 0xFFFFFFFF


def anyprec_launch(tensors: dict[str, torch.Tensor], x: np.ndarray, bits: int, tc: bool | None = None,
                   fast: bool | None = None, warps: int | None = None) -> Launch:
    """kernels/anyprec_gemv.cu at width `bits` on one linear's bitplanes and table `lut{bits}`, from activations x
    [M, K] (rounded to fp16, the kernel's input): the CUDA-core GEMV (bit-exact against the emulation) or, with
    `tc` (default: from ANYPREC_TC_MIN_M tokens on), the tensor-core kernel (within `anyprec_tc_bound`); `fast`
    (default: ANYPREC_TC_FAST where anyprec_tc_fast allows) its unchecked-load twin, in blocks of `warps` (default
    anyprec_tc_warps; ANYPREC_TC_FEW_WARPS only for the fast kernels up to 3 bits)."""
    planes = _c(tensors["qweight"].numpy().view(np.uint32), np.uint32)
    if not 1 <= bits <= planes.shape[0] or f"lut{bits}" not in tensors:
        raise ValueError(f"this artifact serves widths up to {planes.shape[0]} with tables "
                         f"{sorted(k for k in tensors if k.startswith('lut'))}; asked for {bits}")
    x16 = _half_bits(torch.from_numpy(np.ascontiguousarray(x)))  # the engine's fp16 activations
    m, n, k = x16.shape[0], planes.shape[1], planes.shape[2] * 32
    out = np.zeros((m, n), dtype=np.uint16)
    lut = _half_bits(tensors[f"lut{bits}"])
    if m >= ANYPREC_TC_MIN_M if tc is None else tc:
        if fast is None:
            fast = ANYPREC_TC_FAST and anyprec_tc_fast(m, n, k, bits)
        elif fast and not anyprec_tc_fast(m, n, k, bits):
            raise ValueError(f"the fast Any-Precision kernels need K a multiple of 1024 and 32-bit indices; "
                             f"got M={m}, N={n}, K={k} at {bits} bits")
        if warps is None:
            warps = anyprec_tc_warps(k, bits, fast)
        elif warps not in anyprec_tc_block_sizes(bits, fast):
            raise ValueError(f"the tensor-core kernels come in blocks of {ANYPREC_TC_WARPS} warps, and of "
                             f"{ANYPREC_TC_FEW_WARPS} for the fast ones up to 3 bits; got {warps} at {bits} bits")
        # one n8 block up to DECODE_MAX_M tokens, fewer registers
        name = (f"anyprec_gemm_tc{8 if m <= DECODE_MAX_M else ''}_{bits}{'_fast' if fast else ''}"
                f"{f'_w{warps}' if warps != ANYPREC_TC_WARPS else ''}")
        return Launch("anyprec_gemv", name, [x16, planes, lut, out, m, n, k],
                      (-(-n // ANYPREC_TC_CHANNELS), 1, -(-m // ANYPREC_TC_TOKENS)), 32 * warps, out,
                      anyprec_tc_shared_bytes(bits, warps))
    args = [x16, planes, lut, out, m, n, k, bits]
    return Launch("anyprec_gemv", "anyprec_gemv", args, (-(-n // ANYPREC_WARPS), -(-m // ANYPREC_TOKENS)),
                  32 * ANYPREC_WARPS, out)


def anyprec_gemv(tensors: dict[str, torch.Tensor], x: np.ndarray, bits: int, device: str = "cpu",
                 tc: bool | None = None) -> np.ndarray:
    """The Any-Precision LUT GEMV at width `bits`: fp16 out [M, N] (`tc`: force the tensor-core kernel on or off)."""
    return run(anyprec_launch(tensors, x, bits, tc), device).view(np.float16)


def anyprec_matches(tensors: dict[str, torch.Tensor], x: np.ndarray, bits: int, device: str,
                    gemv: bool = True) -> bool:
    """The Any-Precision kernels at width `bits` against the emulation: the GEMV bit for bit (unless not `gemv`),
    the tensor-core kernel within `emulate.anyprec_tc_bound`."""
    from quantkit import emulate

    reference = emulate.emulate_anyprec(tensors, x, bits)[1]
    exact = not gemv or np.array_equal(anyprec_gemv(tensors, x, bits, device, tc=False).view(np.uint16),
                                       reference.view(np.uint16))
    return exact and emulate.within_anyprec_tc_bound(tensors, x, bits, anyprec_gemv(tensors, x, bits, device, tc=True),
                                                     reference)


LAUNCHES = {"qserve": qserve_launch, "liquidquant": liquidquant_launch, "qqq": qqq_launch}


def gemm(fmt: str, tensors: dict[str, torch.Tensor], x_int8: np.ndarray, s_x: np.ndarray,
         t_x: np.ndarray | None = None, device: str = "cpu", tiled: bool | None = None,
         wgmma: bool | None = None) -> np.ndarray:
    """The W4A8 kernel of layout `fmt` on one linear: fp16 out [M, N] from INT8 activations and their scales
    (`tiled`: force the large-M path on or off, default from M and the shape; `wgmma`: the Hopper kernel on or
    off, default per use_wgmma)."""
    if fmt not in LAUNCHES:
        raise KernelUnavailable(f"no kernel for format {fmt!r} yet (kernels: {', '.join(sorted(LAUNCHES))})")
    return run(LAUNCHES[fmt](tensors, x_int8, s_x, t_x, tiled=tiled, wgmma=wgmma), device).view(np.float16)


def compiler_available() -> bool:
    """True when a host C++ compiler for the warp simulator is on PATH."""
    return (shutil.which("g++") or shutil.which("c++")) is not None


def resolve_device(kernel: str) -> str | None:
    """Where `quantkit validate --kernel` runs the kernels: "cuda", "cpu" (the warp simulator) or None (not at all).
    "auto" takes the GPU when there is one, else the simulator when a compiler is there."""
    if kernel == "none":
        return None
    if kernel == "cuda" or (kernel == "auto" and cuda_available()):
        if not cuda_available():
            raise KernelUnavailable("--kernel cuda: needs CuPy (pip install 'quantkit[cuda]') and a CUDA device")
        return "cuda"
    if kernel == "sim" or (kernel == "auto" and compiler_available()):
        if not compiler_available():
            raise KernelUnavailable("--kernel sim: the warp simulator needs a C++ compiler (g++ or c++) on PATH")
        return "cpu"
    return None


def paths(fmt: str, n: int, k: int, device: str = "cpu") -> tuple[dict[str, bool], ...]:
    """The launch options of every kernel a linear [N, K] of layout `fmt` can run with on `device`: the small-M
    kernel, the large-M one where the shape fits it, and the Hopper one where it also fits and the device can run
    it (the warp simulator always can)."""
    found = [{"tiled": False}]
    if TILES[fmt].fits(n, tiled_k(fmt, k)):
        found.append({"tiled": True})
    if fmt in WGMMA and WGMMA[fmt].fits(n, k) and (device == "cpu" or hopper_available()):
        found.append({"wgmma": True})
    return tuple(found)


def path_labels(fmt: str, n: int, k: int, device: str, m: int = 1) -> list[str]:
    """What `matches_emulation` runs for a linear [N, K] of layout `fmt` on `device` from M tokens, in words."""
    decode = m > DECODE_MAX_M and fmt != "atom"
    if fmt == "anyprec":
        return ["CUDA-core GEMV (bit for bit)", "tensor cores (within anyprec_tc_bound)"] + (
            ["tensor cores, 1 token"] if decode else [])
    names = {"tiled": "tiled (large-M)", "wgmma": "wgmma (Hopper)"}
    labels = [next((names[key] for key, on in path.items() if on), "small-M") for path in paths(fmt, n, k, device)]
    return labels + (["small-M, 1 token"] if decode else [])


def matches_emulation(fmt: str, tensors: dict[str, torch.Tensor], x: np.ndarray, device: str, act_bits: int = 4,
                      clip_ratio: float = 1.0) -> bool:
    """Run the kernel of layout `fmt` on activations x [M, K] and compare its fp16 output with the CPU emulation's,
    bit for bit (Any-Precision: at every width the artifact serves, the GEMV bit for bit and the tensor-core kernel
    within its bound; W4A8: the small- and, where the shape fits it, the large-M kernel, whatever M). Past
    DECODE_MAX_M tokens the small-M kernels (Any-Precision's tensor-core one) also run on the first token alone,
    which takes the decode kernels."""
    from quantkit import emulate

    k = x.shape[1]
    if fmt == "atom":
        reference = emulate.emulate_atom(tensors, x, act_bits, clip_ratio)
        return all(np.array_equal(atom_gemm(tensors, reference.x_codes, reference.s_x, device, **path).view(np.uint16),
                                  reference.out.view(np.uint16))
                   for path in paths(fmt, reference.out.shape[1], k, device))
    if fmt == "anyprec":
        widths = sorted(int(key[3:]) for key in tensors if key.startswith("lut"))
        return (all(anyprec_matches(tensors, x, b, device) for b in widths)
                and (x.shape[0] <= DECODE_MAX_M or all(anyprec_matches(tensors, x[:1], b, device, gemv=False)
                                                       for b in widths)))

    def same(xs: np.ndarray, path_list: tuple[dict[str, bool], ...] | None = None) -> bool:
        reference = emulate.emulate(fmt, tensors, xs)
        t_x = np.asarray(xs, dtype=np.float32).sum(axis=1, dtype=np.float32)
        return all(np.array_equal(gemm(fmt, tensors, reference.x_int8, reference.s_x, t_x, device, **path)
                                  .view(np.uint16), reference.out.view(np.uint16))
                   for path in path_list or paths(fmt, reference.out.shape[1], k, device))

    return same(x) and (x.shape[0] <= DECODE_MAX_M or same(x[:1], ({"tiled": False},)))


def cuda_available() -> bool:
    """True when CuPy imports and sees a CUDA device."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


# The SMs of the GPUs the Hopper kernels are built for (an H100 SXM's and an H200's), for choices made without one
# (the warp simulator's runs).
HOPPER_SMS = 132


def multiprocessors() -> int:
    """The CUDA device's SM count, or HOPPER_SMS without one."""
    if not cuda_available():
        return HOPPER_SMS
    import cupy

    return _device_multiprocessors(cupy.cuda.runtime.getDevice())


@cache
def _device_multiprocessors(device: int) -> int:
    import cupy

    return cupy.cuda.Device(device).attributes["MultiProcessorCount"]


def hopper_available() -> bool:
    """True when the CUDA device is a Hopper GPU (compute capability 9.0), which runs the *_wgmma kernels, and
    QUANTKIT_WGMMA=0 does not turn them off (validate and bench then leave them out)."""
    if os.environ.get("QUANTKIT_WGMMA") == "0" or not cuda_available():
        return False
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


NVRTC_OPTIONS = ("-std=c++17", "--device-as-default-execution-space")
HOPPER_ARCH = "sm_90a"  # the build with the *_wgmma and bulk kernels, which CuPy's own compile cannot target
MODULES = ("qserve_w4a8", "qqq_w4a8", "liquidquant_w4a8", "atom_w4a4", "anyprec_gemv")
HOPPER_MODULES = ("qserve_w4a8", "qqq_w4a8", "liquidquant_w4a8")  # those with *_wgmma kernels


def module_defines(name: str, defines: tuple[str, ...]) -> tuple[str, ...]:
    """The knobs among `defines` (NAME=VALUE) that kernels/NAME.cu can read: those whose name its source or a shared
    header mentions. The others change none of its bits, so a build and its cache key leave them out, and a tuning
    configuration of one layout's knobs shares the other modules' builds."""
    src = source_dir()
    text = (src / f"{name}.cu").read_text() + "".join(p.read_text() for p in sorted(src.glob("*.cuh")))
    return tuple(d for d in defines if re.search(rf"\b{re.escape(d.partition('=')[0])}\b", text))


def compile_module(name: str, arch: str, defines: tuple[str, ...] = ()) -> bytes:
    """NVRTC's cubin of kernels/NAME.cu for `arch` ("sm_90"; "sm_90a" adds the *_wgmma and bulk kernels, QK_WGMMA),
    with the tuning knobs `defines` (NAME=VALUE). The options are those CuPy gives its own RawModule builds: its
    include directories (cuda_fp16.h from the CUDA toolkit or its wheels) and device code by default, without which
    NVRTC 13.0 refuses the kernels' generic lambdas. NVRTC needs no GPU, so bench/build_kernels.py can build ahead."""
    return compile_source((source_dir() / f"{name}.cu").read_text(), f"{name}.cu", arch,
                          module_defines(name, defines))


def compile_source(code: str, filename: str, arch: str, defines: tuple[str, ...] = ()) -> bytes:
    """NVRTC's cubin of CUDA source `code` (named `filename` in its messages) as compile_module builds a module:
    kernels/ on the include path, QK_WGMMA for sm_90a, the knobs `defines` (NAME=VALUE)."""
    from cupy._core import core
    from cupy_backends.cuda.libs import nvrtc

    options = core.assemble_cupy_compiler_options((
        *NVRTC_OPTIONS, f"-I{source_dir()}", f"--gpu-architecture={arch}",
        *(("-DQK_WGMMA",) if arch == HOPPER_ARCH else ()), *(f"-D{d}" for d in defines)))
    prog = nvrtc.createProgram(code, filename, [], [])
    try:
        nvrtc.compileProgram(prog, list(options))
        return nvrtc.getCUBIN(prog)
    except nvrtc.NVRTCError as e:
        raise KernelUnavailable(f"NVRTC could not build {filename} for {arch}: {e}\n"
                                f"{nvrtc.getProgramLog(prog)[-3000:]}") from e
    finally:
        nvrtc.destroyProgram(prog)


def cubin_path(name: str, arch: str, defines: tuple[str, ...] = ()) -> Path:
    """Where module_cubin keeps a build in $QUANTKIT_CACHE/kernels: named by a digest of the sources, NVRTC's
    version and options, and the defines the module reads (module_defines)."""
    from cupy_backends.cuda.libs import nvrtc

    salt = repr((nvrtc.getVersion(), NVRTC_OPTIONS, module_defines(name, defines))).encode()
    return _built(f"{name}-{arch}", ".cubin", (".cu", ".cuh"), salt)


def module_cubin(name: str, arch: str, defines: tuple[str, ...] = ()) -> Path:
    """compile_module's cubin, built once per machine (cubin_path), or ahead of time elsewhere
    (bench/build_kernels.py)."""
    cubin = cubin_path(name, arch, defines)
    if not cubin.exists():
        atomic_write(cubin, compile_module(name, arch, defines))
    return cubin


@cache
def _module(name: str, hopper: bool = False) -> Any:
    """The CuPy RawModule of kernels/NAME.cu for this GPU, built by NVRTC on first use (module_cubin); with
    `hopper`, the sm_90a build with the *_wgmma kernels. QUANTKIT_NVRTC_DEFINES (space-separated NAME=VALUE) passes
    compile-time tuning knobs such as QK_SMALLM_AHEAD (bench/smallm_tune.py)."""
    if not cuda_available():
        raise KernelUnavailable("the CUDA kernels need CuPy (pip install 'quantkit[cuda]') and a CUDA device")
    if hopper and not hopper_available():
        raise KernelUnavailable("the *_wgmma kernels need a Hopper GPU (compute capability 9.0, sm_90a)")
    import cupy

    arch = HOPPER_ARCH if hopper else f"sm_{cupy.cuda.Device().compute_capability}"
    return cupy.RawModule(path=str(module_cubin(name, arch, nvrtc_defines())))


# The run-time switches a tuning run varies (bench/smallm_tune.py's configurations). $QUANTKIT_KERNEL_SETTINGS, a
# JSON object of some of them, sets them at import, so that a benchmark process can take what a tuning run found
# fastest (bench/gpu_check.py --bench-tuned) without an edit here; `quantkit bench --json` records them (tuning()).
TUNABLE = ("SPLITK_WARPS", "SPLITK_MIN_STEPS", "SPLITK_BLOCKS_MAX", "SPLITK_CLUSTER", "SPLITK_RED_PLAN", "BULK_DECODE",
           "BULK_SLOTS", "WGMMA_WIDE", "WGMMA_TALL", "LIQUIDQUANT_GEMM16", "QSERVE_GEMM16", "ANYPREC_TC_FAST",
           "ANYPREC_TC_FEW")
# The types each switch takes: its default's, and bool or None for WGMMA_TALL and QSERVE_GEMM16 (None: the choice
# made per launch).
SWITCH_TYPES = {name: (type(globals()[name]),) for name in TUNABLE} | {
    name: (bool, type(None)) for name in ("WGMMA_TALL", "QSERVE_GEMM16")}


def apply_settings(settings: dict[str, bool | int]) -> None:
    """Set the switches named in `settings` (names from TUNABLE, values of each switch's type)."""
    if unknown := sorted(set(settings) - set(TUNABLE)):
        raise ValueError(f"unknown kernel settings {', '.join(unknown)}; the tunable ones are {', '.join(TUNABLE)}")
    for name, value in settings.items():
        if type(value) not in SWITCH_TYPES[name]:
            types = " or ".join("null" if t is type(None) else t.__name__ for t in SWITCH_TYPES[name])
            raise ValueError(f"kernel setting {name} takes a {types}, got {value!r}")
        globals()[name] = value


def tuning() -> dict:
    """The compile-time knobs and run-time switches in effect, and those of the switches set from the environment,
    for a benchmark's report."""
    return {"defines": list(nvrtc_defines()), "settings": {name: globals()[name] for name in TUNABLE},
            "environment": json.loads(os.environ.get("QUANTKIT_KERNEL_SETTINGS") or "{}")}


if os.environ.get("QUANTKIT_KERNEL_SETTINGS"):
    try:
        apply_settings(json.loads(os.environ["QUANTKIT_KERNEL_SETTINGS"]))
    except (ValueError, AttributeError) as e:  # AttributeError: JSON that is not an object
        # a QuantkitError, so that the CLI command that imports this module reports it as one line, not a traceback
        raise KernelUnavailable(f"$QUANTKIT_KERNEL_SETTINGS: {e}") from None
