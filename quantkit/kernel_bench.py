"""`quantkit bench`: time every packed-layout kernel against cuBLAS FP16 (torch.matmul) and cuBLAS INT8
(torch._int_mm, and cublasGemmEx: the faster sets the bar) on the same shapes in the same run, with CUDA events,
warm-up and medians, and report time, TOPS, achieved GB/s against the device's measured copy bandwidth, and the
speedups.

The kernels time the GEMM alone, from INT8 (INT4 for Atom) activations already quantized, as the engines run them
(the activation quantization is fused into the producing kernel). Kernels and baselines cycle through copies of
their operands larger than twice the L2 cache, so the weights come from device memory in every timed call.
Also here: synthetic stored tensors of every layout at any shape (random codes over each layout's whole range),
shared with the kernel tests.
"""

from __future__ import annotations

import ctypes
import logging
import re
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.kernels import LAUNCHES, Launch, anyprec_launch, atom_launch, multiprocessors, tuning

# (N, K) of a model's linears: fused qkv, o, fused gate_up, down. Issue #6's bars are set on Llama-3-8B's (which
# Mistral-7B shares); `quantkit bench` applies the same rules to the others.
SHAPE_SETS: dict[str, tuple[tuple[int, int], ...]] = {
    "llama3-8b": ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
    "llama2-7b": ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)),
    "llama3-70b": ((10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)),
    "qwen2-7b": ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)),
}
SHAPE_MULTIPLE = 128  # of N and K in a shape of one's own: every layout's kernels (wgmma tiles, Atom's groups) fit it


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """The (N, K) shapes `--shapes` names: a set of SHAPE_SETS, or shapes of one's own as "NxK,NxK,..." (N output
    channels, K input; both multiples of SHAPE_MULTIPLE, so that every layout's kernels take them)."""
    if text in SHAPE_SETS:
        return SHAPE_SETS[text]
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part in SHAPE_SETS:  # sets and shapes of one's own mix: "llama3-8b,qwen2-7b", "llama3-8b,"
            shapes.extend(SHAPE_SETS[part])
            continue
        n, sep, k = part.lower().partition("x")
        if not (sep and n.isascii() and n.isdigit() and k.isascii() and k.isdigit()):  # not "²" and the like
            raise ValueError(f"{part!r} is neither a shape set ({', '.join(SHAPE_SETS)}) nor NxK (e.g. 4096x14336)")
        if int(n) % SHAPE_MULTIPLE or int(k) % SHAPE_MULTIPLE or not int(n) or not int(k):
            raise ValueError(f"{part}: N and K must be positive multiples of {SHAPE_MULTIPLE}, so that every layout's "
                             "kernels take the shape")
        shapes.append((int(n), int(k)))
    if not shapes:
        raise ValueError(f"no shapes in {text!r}: name a set ({', '.join(SHAPE_SETS)}) or give NxK,NxK,...")
    return tuple(dict.fromkeys(shapes))  # each shape once, in the order named


@dataclass(frozen=True)
class Variant:
    """One kernel configuration: its label, layout and options (group, width, and `path`: one of the layout's
    PATHS, or None for the one its launch picks by M and shape)."""

    label: str
    fmt: str
    group: int | None = None
    bits: int | None = None
    path: str | None = None


VARIANTS = (
    Variant("QServe W4A8 per channel", "qserve"),
    Variant("QServe W4A8 g128", "qserve", group=128),
    Variant("LiquidQuant W4A8 g64", "liquidquant", group=64),
    Variant("QQQ W4A8 per channel", "qqq"),
    Variant("QQQ W4A8 g128", "qqq", group=128),
    Variant("Atom W4A4 g128 + 128 INT8", "atom", group=128),
    Variant("Any-Precision 3-bit GEMV", "anyprec", bits=3),
)
LAYOUTS = tuple(sorted({v.fmt for v in VARIANTS}))  # the layouts bench times (--formats, an OUTPUT's format)

# The kernels a layout has, by path: the launch keyword that forces each.
PATHS: dict[str, dict[str, dict[str, bool]]] = {
    **{f: {"small-M": {"tiled": False}, "tiled": {"tiled": True}, "wgmma": {"wgmma": True}}
       for f in ("qserve", "qqq", "liquidquant")},
    "atom": {"small-M": {"tiled": False}, "tiled": {"tiled": True}},
    "anyprec": {"CUDA cores": {"tc": False}, "tensor cores": {"tc": True}},
}


def with_paths(variants: tuple[Variant, ...], hopper: bool = True) -> tuple[Variant, ...]:
    """Each variant once per kernel of its layout (`quantkit bench --paths all`), to set the M thresholds; the
    Hopper (wgmma) kernels only with `hopper`."""
    return tuple(replace(v, label=f"{v.label} [{path}]", path=path) if v.fmt in PATHS else v
                 for v in variants for path in PATHS.get(v.fmt, {None: {}}) if hopper or path != "wgmma")


def synthetic(fmt: str, n: int, k: int, seed: int = 0, group: int | None = None) -> dict[str, torch.Tensor]:
    """Random stored tensors of layout `fmt` for an [N, K] linear: every code and scale over its whole stored range
    (QServe groups up to z * s2 = 128, LiquidQuant codes up to each group's byte bound, QQQ ratios up to 127/8 with
    exact ties among their products). Some QServe groups are ones no quantizer makes ((q - z) * s2 wraps its byte
    lane): kernels and emulation must agree on them too, but compare with a reference dequant only tensors a
    quantizer could have made."""
    rng = np.random.default_rng(seed)
    if fmt == "qserve":
        from quantkit.formats import qserve_layout

        codes = torch.from_numpy(rng.integers(0, 16, (n, k)))
        s1 = torch.from_numpy(rng.random(n).astype(np.float32) * 0.02 + 1e-4).half()
        tensors = {"qweight": qserve_layout.pack_qweight(codes), "s1_scales": s1}
        if group is None:
            tensors["s1_szeros"] = (torch.from_numpy(rng.random(n).astype(np.float32)) * 8 * s1.float()).half()
            return tensors
        s2 = torch.from_numpy(rng.integers(1, 18, (n, k // group)))
        zero = torch.minimum(torch.from_numpy(rng.integers(0, 16, (n, k // group))), 128 // s2)
        tensors["s2_scales"], tensors["s2_zeros"] = qserve_layout.pack_group_params(s2, zero)
        return tensors
    if fmt == "liquidquant":
        from quantkit.formats import liquidquant

        mins = rng.integers(-128, 128, (n, k // 64))
        steps = rng.integers(1, 17, (n, k // 64))
        bound = np.minimum(15, (127 - mins) // steps)
        u = (rng.random((n, k)) * (np.repeat(bound, 64, axis=1) + 1)).astype(np.int64)
        u[:, ::64] = bound  # every group reaches its bound
        sa = np.stack([steps, 128 + mins], axis=-1).astype(np.uint8).reshape(n // 64, 64, k // 64, 2)
        return {"qweight": torch.from_numpy(liquidquant.pack_codes(u)),
                "s2a": torch.from_numpy(np.ascontiguousarray(sa.transpose(0, 2, 1, 3))),
                "s1_scales": torch.from_numpy(rng.random(n).astype(np.float32) * 0.01 + 1e-4).half()}
    if fmt == "qqq":
        from quantkit.formats import qqq

        codes = rng.integers(0, 16, (k, n)) if group else rng.integers(-7, 8, (k, n))
        s_channel = (rng.random((1, n)) * 1e-3 + 1e-5).astype(np.float32)
        tensors = {"B": torch.from_numpy(qqq.pack_b(codes, per_group=bool(group))),
                   "s_channel": torch.from_numpy(qqq.permute_columns(s_channel, qqq.SCALE_PERM_SINGLE))}
        if group:
            r = (rng.random((k // group, n)) * 127 / 8).astype(np.float16)
            r[0, :8] = [0.5, 1.5, 2.5, 15.875, 0.0625, 3.25, 7.5, 0.125][:min(8, n)]  # q * r lands on .5: ties
            tensors["s_group"] = torch.from_numpy(qqq.permute_columns(r, qqq.SCALE_PERM))
        return tensors
    if fmt == "atom":
        from quantkit.formats import atom

        groups = (k - atom.OUTLIERS) // atom.GROUP
        s4 = (rng.random((groups, n)) * 0.05 + 1e-3).astype(np.float16)
        s8 = (rng.random(n) * 0.01 + 1e-4).astype(np.float16)
        return {"reorder_index": torch.from_numpy(rng.permutation(k).astype(np.int16)),
                "weight_int4": torch.from_numpy(rng.integers(0, 256, (n, (k - atom.OUTLIERS) // 2)).astype(np.uint8)),
                "weight_int8": torch.from_numpy(rng.integers(-128, 128, (n, atom.OUTLIERS)).astype(np.int8)),
                "scale_int4": torch.from_numpy(atom.scatter_scales(s4)),
                "scale_int8": torch.from_numpy(atom.scatter_scales(s8))}
    if fmt == "anyprec":
        from quantkit.formats.anyprec_layout import pack_planes

        tensors = {"qweight": torch.from_numpy(pack_planes(rng.integers(0, 256, (n, k)), 8))}
        for bits in range(3, 9):
            tensors[f"lut{bits}"] = torch.from_numpy(np.sort(rng.standard_normal((n, 1 << bits)), axis=1)
                                                     .astype(np.float16))
        return tensors
    raise ValueError(f"no synthetic tensors for format {fmt!r}")


def variant_launch(variant: Variant, tensors: dict[str, torch.Tensor], m: int, k: int, seed: int = 0) -> Launch:
    """The kernel call of `variant` on `tensors` with random activations of M tokens."""
    rng = np.random.default_rng(seed)
    force = PATHS[variant.fmt][variant.path] if variant.path else {}
    if variant.fmt == "anyprec":
        return anyprec_launch(tensors, rng.standard_normal((m, k)).astype(np.float32), variant.bits or 3, **force)
    if variant.fmt == "atom":
        codes = np.concatenate([rng.integers(-8, 8, (m, k - 128)), rng.integers(-128, 128, (m, 128))], axis=1)
        return atom_launch(tensors, codes, rng.random((m, (k - 128) // 128 + 1)).astype(np.float32), **force)
    x = rng.integers(-128, 128, (m, k)).astype(np.int8)
    s_x = rng.random(m).astype(np.float32)
    return LAUNCHES[variant.fmt](tensors, x, s_x, rng.standard_normal(m).astype(np.float32), **force)


def emulated_out(fmt: str, tensors: dict[str, torch.Tensor], launch: Launch, bits: int | None = None) -> np.ndarray:
    """The emulation's fp16 output (uint16 bits) from the very inputs a bit-exact launch of `variant_launch` holds
    (not the Any-Precision tensor-core kernel's, which is checked within a bound): Any-Precision's fp16
    activations at width `bits`, Atom's reordered INT4 and INT8 codes and scales, or the W4A8 layouts' INT8
    activations, scales (and sums, QServe)."""
    from quantkit.emulate import emulate_anyprec, emulate_atom_quantized, emulate_quantized

    if fmt == "anyprec":
        return emulate_anyprec(tensors, launch.args[0].view(np.float16), bits)[1].view(np.uint16)
    if fmt == "atom":
        x4, x8, s_x = launch.args[:3]
        nibbles = np.stack([x4 & 0xF, x4 >> 4], axis=-1).reshape(x4.shape[0], -1).astype(np.int64)
        codes = np.concatenate([np.where(nibbles >= 8, nibbles - 16, nibbles), x8.astype(np.int64)], axis=1)
        return emulate_atom_quantized(tensors, codes, s_x).out.view(np.uint16)
    return emulate_quantized(fmt, tensors, launch.args[0], launch.args[1],
                             launch.args[2] if fmt == "qserve" else None).out.view(np.uint16)


def weight_bytes(tensors: dict[str, torch.Tensor], variant: Variant) -> int:
    """Bytes of stored weight data the kernel reads (Any-Precision: only the planes and table of its width)."""
    if variant.fmt == "anyprec":
        planes = tensors["qweight"]
        bits = variant.bits or 3  # variant_launch's width where the variant names none
        per_plane = planes[0].numel() * planes.element_size()
        table = tensors[f"lut{bits}"]
        return per_plane * bits + table.numel() * table.element_size()
    return sum(t.numel() * t.element_size() for key, t in tensors.items() if key != "reorder_index")


@dataclass
class Row:
    """One timed (shape, M, kernel or baseline): `kernel` the CUDA function that ran, `variant` what it ran as
    (None for the cuBLAS baselines)."""

    n: int
    k: int
    m: int
    label: str
    seconds: float  # median per call: in a replayed CUDA graph when the kernel is short (see `timing`)
    bytes_moved: int  # weights + activations + outputs
    kernel: str = "cuBLAS"
    variant: Variant | None = None
    launch_seconds: float | None = None  # median of single launches, each between its own CUDA events
    round_seconds: tuple[float, ...] = ()  # with several rounds (`run_bench`), each round's `seconds`

    @property
    def tops(self) -> float:
        return 2 * self.m * self.n * self.k / self.seconds / 1e12

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9


def median_time(fn: Callable[[], None], warmup: int, iters: int) -> float:
    """Median seconds of `fn` on the current CUDA stream, each call between its own pair of CUDA events."""
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(iters):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)


# Below this a single launch's CUDA-event time carries the launch's own overhead (microseconds, as much as a decode
# GEMM takes): such kernels are also timed as an engine runs them, back to back in a replayed CUDA graph.
GRAPH_BELOW = 100e-6


def graph_time(fn: Callable[[], None], calls: int, replays: int, torch_graph: bool = False) -> float | None:
    """Median seconds per call of `fn` captured `calls` times in one CUDA graph (CuPy's stream capture for the
    kernels, torch.cuda.CUDAGraph for the cuBLAS baselines), its replays timed by `median_time` (the first, which
    uploads the graph, as warm-up); None when the calls cannot be captured (said in a warning)."""
    try:
        if torch_graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # warm: cuBLAS handles and workspaces exist before capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
            replay = graph.replay
        else:
            import cupy

            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                fn()
                stream.synchronize()
                stream.begin_capture()
                try:
                    for _ in range(calls):
                        fn()
                finally:
                    captured = stream.end_capture()
            replay = captured.launch  # on the current stream, where median_time's events are
        return median_time(replay, 1, replays) / calls
    except Exception as e:  # a call that cannot be captured is timed by its single launches only
        logging.getLogger(__name__).warning("CUDA graph capture failed (%s): timed by single launches", e)
        return None


def timing(fn: Callable[[], None], warmup: int, iters: int, torch_graph: bool = False) -> tuple[float, float]:
    """(seconds per call, seconds of a single launch) of `fn`, medians: a single launch between CUDA events, and,
    for a kernel shorter than GRAPH_BELOW, the per-call time of CUDA-graph replays covering every operand copy of
    its `rotation` (at least about 100 us of calls per replay), which is what the tables and bars use."""
    single = median_time(fn, warmup, iters)
    if single >= GRAPH_BELOW:
        return single, single
    calls = max(getattr(fn, "copies", 1), min(64, -(-int(GRAPH_BELOW * 1e9) // max(int(single * 1e9), 1))))
    replayed = graph_time(fn, calls, max(5, iters // 4), torch_graph)
    return (single if replayed is None else replayed), single


def l2_bytes() -> int:
    """The current device's L2 cache size in bytes."""
    import cupy

    return int(cupy.cuda.Device().attributes["L2CacheSize"])


def rotation(make: Callable[[int], Callable[[], None]], bytes_each: int, l2: int | None = None
             ) -> Callable[[], None]:
    """A call that cycles through enough copies of its operands (`make(i)` builds copy i, `bytes_each` bytes) that
    together they hold at least twice the L2 cache (`l2`, default the device's; at most 64 copies), so that each
    timed call reads its weights from device memory, as a model's layers do, not from the cache the previous call
    filled."""
    l2 = l2_bytes() if l2 is None else l2
    copies = max(1, min(64, -(-2 * l2 // max(bytes_each, 1))))
    calls = [make(i) for i in range(copies)]
    state = {"next": 0}

    def call() -> None:
        calls[state["next"] % copies]()
        state["next"] += 1

    call.copies = copies  # a CUDA graph of the calls must cover them all (`timing`)
    return call


def copy_bandwidth(size: int = 1 << 30, warmup: int = 3, iters: int = 20) -> float:
    """The device's measured copy bandwidth, GB/s: a device-to-device copy of `size` bytes reads and writes it."""
    import cupy

    src, dst = cupy.empty(size, dtype=cupy.uint8), cupy.empty(size, dtype=cupy.uint8)
    seconds = median_time(lambda: dst.__setitem__(slice(None), src), warmup, iters)
    return 2 * size / seconds / 1e9


# A streaming read of B bytes (four 16-byte loads in flight per thread, a grid-stride loop), the floor of any
# kernel that must read B bytes of weights: at the few MB of a decode GEMM's weights, launch and ramp cost more than
# at the 1 GiB of `copy_bandwidth`, and this row shows how much. Its stamps are nothing here; bench/timeline.py
# builds it after kernels/qk_timeline.cuh, which makes them the kernels' phase stamps.
STREAM_READ = r"""
#ifndef QK_STAMP
#define QK_STAMP(phase)
#endif
extern "C" __global__ void stream_read(const uint4* src, unsigned long long n16, unsigned* sink) {
  QK_STAMP(QK_T_START);
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n16; i += stride) {
    const uint4 a = src[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  QK_STAMP(QK_T_LOOP);
  if (acc == 0x9E3779B9u) sink[0] = acc;  // almost never: it keeps the loads
  QK_STAMP(QK_T_STORED);
}
"""


def stream_read(size: int) -> Callable[[], None]:
    """A call that reads `size` bytes (a multiple of 16) once with STREAM_READ, four blocks of 512 threads per SM."""
    import cupy

    kernel = cupy.RawKernel(STREAM_READ, "stream_read")
    src, sink = cupy.zeros(size, dtype=cupy.uint8), cupy.zeros(1, dtype=cupy.uint32)
    blocks = 4 * multiprocessors()
    return lambda: kernel((blocks,), (512,), (src, cupy.uint64(size // 16), sink))


def read_floor(m: int, n: int, k: int, warmup: int, iters: int) -> Row:
    """The streaming read of a 4-bit [N, K] weight's bytes (N K / 2), rotated past the L2 cache like the kernels:
    how fast a decode GEMM of that shape could be if it did nothing but read its weights."""
    size = n * k // 2
    seconds, single = timing(rotation(lambda _: stream_read(size), size), warmup, iters)
    return Row(n, k, m, READ_FLOOR, seconds, size, kernel="stream_read", launch_seconds=single)


def baselines(m: int, n: int, k: int, warmup: int, iters: int) -> list[Row]:
    """cuBLAS FP16 (torch.matmul) and, where torch takes the shape, cuBLAS INT8 (torch._int_mm and cublasGemmEx)
    on [M, K] x [K, N], each cycling through weight copies that exceed the L2 cache (see `rotation`); for decode
    (M <= 16) also the read floor of the 4-bit weights."""
    rows = []
    if not torch.cuda.is_available():
        return rows
    if m <= 16 and n * k % 32 == 0:
        rows.append(read_floor(m, n, k, warmup, iters))

    def fp16(_: int) -> Callable[[], None]:
        a, b = (torch.randn(m, k, device="cuda", dtype=torch.float16),
                torch.randn(k, n, device="cuda", dtype=torch.float16))
        return lambda: torch.matmul(a, b)

    seconds, single = timing(rotation(fp16, 2 * k * n), warmup, iters, torch_graph=True)
    rows.append(Row(n, k, m, FP16, seconds, 2 * (m * k + k * n + m * n), launch_seconds=single))
    if m > 16 and m % 8 == 0 and k % 8 == 0 and n % 8 == 0:  # torch._int_mm's shape rules
        def int8(_: int) -> Callable[[], None]:
            ai = torch.randint(-128, 128, (m, k), device="cuda", dtype=torch.int8)
            # [K, N] column-major (a linear's [N, K] weight, transposed), as cuBLASLt's INT8 kernels want it: with a
            # row-major B, torch 2.11 on an H200 ran _int_mm at ~120 TOPS, a sixth of cuBLAS FP16
            bi = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8).t()
            return lambda: torch._int_mm(ai, bi)

        seconds, single = timing(rotation(int8, k * n), warmup, iters, torch_graph=True)
        rows.append(Row(n, k, m, INT8, seconds, m * k + k * n + 4 * m * n, launch_seconds=single))
    if m > 16 and k % 4 == 0:
        try:
            seconds, single = timing(rotation(lambda _: gemmex_int8(m, n, k), k * n), warmup, iters,
                                     torch_graph=True)
            rows.append(Row(n, k, m, INT8_GEMMEX, seconds, m * k + k * n + 4 * m * n, launch_seconds=single))
        except Exception as e:  # CuPy without cuBLAS, or a cuBLAS that refuses the shape: torch's row stands alone
            logging.getLogger(__name__).warning("cublasGemmEx INT8 baseline not timed: %s", e)
    return rows


# cublasGemmEx's enums (cuda_runtime's cudaDataType, cublas_api.h's cublasComputeType_t, cublasOperation_t,
# cublasGemmAlgo_t): CUDA_R_8I, CUDA_R_32I, CUBLAS_COMPUTE_32I, CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_GEMM_DEFAULT.
_R_8I, _R_32I, _COMPUTE_32I, _OP_N, _OP_T, _DEFAULT_ALGO = 3, 10, 72, 0, 1, -1


def gemmex_int8(m: int, n: int, k: int) -> Callable[[], None]:
    """cuBLAS's INT8 GEMM called directly (cublasGemmEx, int32 compute, the "TN" layout its IMMA kernels want):
    out[M, N] int32 = x[M, K] @ w[N, K]^T, with random operands, on torch's current stream. Through a cuBLAS handle
    of quantkit's own (`own_cublas`), which CUDA graphs capture like the other rows; CuPy's handle, the fallback
    where that one cannot be made, refuses stream capture (CuPy 14), so `timing` then falls back to single
    launches, which carry a few microseconds of launch overhead. Where torch._int_mm takes the shape, the first
    call's sums are checked against its."""
    x = torch.randint(-128, 128, (m, k), device="cuda", dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
    out = torch.empty(m, n, device="cuda", dtype=torch.int32)
    shape = (_OP_T, _OP_N, n, m, k)  # column-major out^T [N, M] = (w as [K, N])^T @ (x as [K, M])
    try:
        lib, handle, _ = own_cublas()
    except (OSError, RuntimeError) as e:
        logging.getLogger(__name__).info("cuBLAS through CuPy's handle (%s)", e)
        call = _cupy_gemmex(shape, x, w, out)
    else:
        alpha, beta = ctypes.c_int32(1), ctypes.c_int32(0)

        def call() -> None:
            _cublas_check(lib.cublasSetStream_v2(handle, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)),
                          "cublasSetStream")
            _cublas_check(lib.cublasGemmEx(handle, *shape, ctypes.byref(alpha), ctypes.c_void_p(w.data_ptr()), _R_8I,
                                           k, ctypes.c_void_p(x.data_ptr()), _R_8I, k, ctypes.byref(beta),
                                           ctypes.c_void_p(out.data_ptr()), _R_32I, n, _COMPUTE_32I, _DEFAULT_ALGO),
                          "cublasGemmEx")

        call.keep = (x, w, out, alpha, beta)  # the buffers live as long as the call
    if m % 8 == 0 and n % 8 == 0 and k % 8 == 0:  # torch._int_mm's shape rules
        call()
        if not torch.equal(out, torch._int_mm(x, w.t())):
            raise RuntimeError(f"cublasGemmEx's int32 sums differ from torch._int_mm's on {m} x {n} x {k}")
    return call


def _cupy_gemmex(shape: tuple[int, ...], x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """gemmex_int8's call through CuPy's cuBLAS handle, with a workspace of its own."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    (_, _, n, _, k) = shape
    workspace = torch.empty(32 << 20, device="cuda", dtype=torch.uint8)
    alpha, beta = np.ones(1, dtype=np.int32), np.zeros(1, dtype=np.int32)
    handle = cupy.cuda.device.get_cublas_handle()
    if hasattr(cublas, "setWorkspace"):  # CuPy 13+
        cublas.setWorkspace(handle, workspace.data_ptr(), workspace.numel())

    def call() -> None:
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            cublas.gemmEx(handle, *shape, alpha.ctypes.data, w.data_ptr(), _R_8I, k, x.data_ptr(), _R_8I, k,
                          beta.ctypes.data, out.data_ptr(), _R_32I, n, _COMPUTE_32I, _DEFAULT_ALGO)

    call.keep = (x, w, out, workspace, alpha, beta)
    return call


def _cublas_check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed (cublasStatus_t {status})")


@cache
def own_cublas() -> tuple[ctypes.CDLL, ctypes.c_void_p, torch.Tensor]:
    """(libcublas, a handle, its 32 MiB workspace) for gemmex_int8: the cuBLAS that torch loaded (found in the
    process's memory map; else by its soname), a handle of quantkit's own bound to no stream until each call, with
    a fixed workspace, so that a CUDA graph can capture its GEMMs. OSError where there is no cuBLAS to load."""
    path = next((line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if "/libcublas.so" in line), None) if Path("/proc/self/maps").exists() else None
    lib = ctypes.CDLL(path or "libcublas.so.13")
    handle = ctypes.c_void_p()
    _cublas_check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
    workspace = torch.empty(32 << 20, device="cuda", dtype=torch.uint8)
    _cublas_check(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(workspace.data_ptr()),
                                            ctypes.c_size_t(workspace.numel())), "cublasSetWorkspace")
    return lib, handle, workspace


@dataclass
class Case:
    """One linear to time: its label, shape, kernel variant and stored tensors (made on demand)."""

    label: str
    n: int
    k: int
    variant: Variant
    tensors: Callable[[], dict[str, torch.Tensor]]


def shape_cases(shapes: tuple[tuple[int, int], ...], variants: tuple[Variant, ...] = VARIANTS) -> list[Case]:
    """Every variant at every (N, K), on synthetic stored tensors."""
    return [Case(v.label, n, k, v, lambda v=v, n=n, k=k: synthetic(v.fmt, n, k, group=v.group))
            for n, k in shapes for v in variants]


def benchable_format(path) -> str:
    """The format of artifact `path`, one that quantkit has kernels for, else an error saying so."""
    from quantkit.artifact import load_manifest

    fmt = load_manifest(path)["format"]
    if fmt not in LAYOUTS:
        raise QuantkitError(f"{path}: format {fmt!r} has no quantkit kernel to time (those of {', '.join(LAYOUTS)}); "
                            "a 'compressed-tensors' artifact runs in its engine's kernels")
    return fmt


def artifact_cases(path, layer: int = 0) -> list[Case]:
    """The packed linears of one layer of artifact `path`, each with its own format's kernel (Any-Precision: at
    every width it serves)."""
    from quantkit.eval.loading import packed_linears

    fmt = benchable_format(path)
    cases = []
    for linear in packed_linears(path, [layer]):
        n, k = linear.q.codes.shape
        spec = linear.q.spec
        widths = range(spec.min_bits or spec.bits, spec.bits + 1) if fmt == "anyprec" else [None]
        for bits in widths:
            label = f"{linear.name} ({fmt}{f', {bits}-bit' if bits else ''})"
            cases.append(Case(label, n, k, Variant(label, fmt, bits=bits), lambda parts=linear.parts: parts))
    return cases


def run_bench(cases: list[Case], ms: tuple[int, ...], warmup: int = 10, iters: int = 50, rounds: int = 1,
              on_timed: Callable[[int, int], None] | None = None) -> list[Row]:
    """Time every case and, once per (N, K, M), the baselines, side by side in one run; with several `rounds`, the
    whole run again that many times, each row's time the median of its rounds' (its `round_seconds`), so that a
    slow spell of the device or of cuBLAS during one round (on an H100, cuBLAS FP16 once took 101 us where every
    other run took 80-86) moves neither a bar's kernel nor its baseline. `on_timed(done, total)` follows the
    kernels' timings (a progress bar)."""
    from quantkit.kernels import upload

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    # decode batches only for Any-Precision: above a few tokens, dequantize and call cuBLAS (the paper)
    timed_ms = [tuple(m for m in ms if case.variant.fmt != "anyprec" or m <= 16) for case in cases]
    total = rounds * sum(len(kernel_ms) for kernel_ms in timed_ms)
    done = 0
    made: dict[int, dict[str, torch.Tensor]] = {}  # each case's tensors, made once for all rounds
    samples: dict[tuple, list[Row]] = {}
    for _ in range(rounds):
        timed = set()
        for index, case in enumerate(cases):
            for m in ms:
                if (case.n, case.k, m) not in timed:
                    for row in baselines(m, case.n, case.k, warmup, iters):
                        samples.setdefault((row.n, row.k, row.m, row.label, None), []).append(row)
                    timed.add((case.n, case.k, m))
                if m not in timed_ms[index]:
                    continue
                if index not in made:
                    made[index] = case.tensors()
                tensors = made[index]
                launch = variant_launch(case.variant, tensors, m, case.k)
                stored = weight_bytes(tensors, case.variant)
                call = rotation(lambda _, launch=launch: upload(launch), stored)
                # the activations as the kernel reads them: INT8 codes (W4A8), fp16 (Any-Precision), Atom's INT4
                # codes two a byte and its INT8 outliers
                act = (launch.args[0].nbytes + launch.args[1].nbytes if case.variant.fmt == "atom"
                       else m * case.k * (2 if case.variant.fmt == "anyprec" else 1))
                seconds, single = timing(call, warmup, iters)
                samples.setdefault((case.n, case.k, m, case.label, index), []).append(
                    Row(case.n, case.k, m, case.label, seconds, stored + act + 2 * m * case.n, launch.kernel,
                        case.variant, single))
                done += 1
                if on_timed is not None:
                    on_timed(done, total)
            if rounds == 1:
                made.pop(index, None)  # one round: no case's tensors held past its own timing
    return [_median_row(rows) for rows in samples.values()]


def _median_row(rows: list[Row]) -> Row:
    """One row from its rounds: the median time and single-launch time, and every round's time."""
    if len(rows) == 1:
        return rows[0]
    singles = [r.launch_seconds for r in rows if r.launch_seconds is not None]
    return replace(rows[0], seconds=statistics.median(r.seconds for r in rows),
                   launch_seconds=statistics.median(singles) if singles else None,
                   round_seconds=tuple(r.seconds for r in rows))


FP16, INT8, INT8_GEMMEX = "cuBLAS FP16 (torch.matmul)", "cuBLAS INT8 (torch._int_mm)", "cuBLAS INT8 (cublasGemmEx)"
READ_FLOOR = "read of the 4-bit weights' bytes (floor)"


def int8_baseline(case: dict, seconds: Callable = lambda r: r.seconds):
    """Of one (N, K, M)'s rows by label, the faster cuBLAS INT8 baseline (torch._int_mm or cublasGemmEx): the
    bar is set against the best INT8 rate the device showed. Rows are Row objects, or with `seconds` given, a
    `report`'s row dicts."""
    return min((case[label] for label in (INT8, INT8_GEMMEX) if label in case), key=seconds, default=None)


@dataclass(frozen=True)
class Bar:
    """One of issue #6's performance bars applied to one timed row."""

    row: Row
    requirement: str
    measured: str
    met: bool


def bars(rows: list[Row], bandwidth: float) -> list[Bar]:
    """The issue's bars on every row they apply to, against the baselines of the same (N, K, M) in the same run:
    W4A8 at M <= 16 at least 2.5x cuBLAS FP16 and 60% of the copy bandwidth; Any-Precision 3-bit at M <= 16 at
    least 3x cuBLAS FP16; W4A8 at M = 1024 at least 0.8x cuBLAS INT8 (the faster of torch._int_mm and a direct
    cublasGemmEx)."""
    base = {(r.n, r.k, r.m, r.label): r for r in rows if r.variant is None}
    out = []
    for r in rows:
        v = r.variant
        if v is None:
            continue
        fp16 = base.get((r.n, r.k, r.m, FP16))
        int8 = int8_baseline({label: base[(r.n, r.k, r.m, label)] for label in (INT8, INT8_GEMMEX)
                              if (r.n, r.k, r.m, label) in base})
        w4a8 = v.fmt in ("qserve", "qqq", "liquidquant")
        if r.m <= 16 and fp16 and (w4a8 or (v.fmt == "anyprec" and v.bits == 3)):
            need = 2.5 if w4a8 else 3.0
            speedup = fp16.seconds / r.seconds
            out.append(Bar(r, f">= {need}x cuBLAS FP16", f"{speedup:.2f}x", speedup >= need))
        if r.m <= 16 and w4a8:
            share = r.gbps / bandwidth
            out.append(Bar(r, ">= 60% of copy bandwidth", f"{100 * share:.0f}%", share >= 0.6))
        if r.m == 1024 and w4a8 and int8:
            ratio = int8.seconds / r.seconds
            out.append(Bar(r, ">= 0.8x cuBLAS INT8", f"{ratio:.2f}x", ratio >= 0.8))
    return out


def software() -> dict:
    """The versions a run's times depend on (torch and its CUDA, CuPy, the driver and NVRTC), for its report: runs of
    different software are not side by side."""
    versions = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    try:
        import cupy
    except ImportError:
        return versions
    versions["cupy"] = cupy.__version__
    try:
        versions["driver"] = cupy.cuda.runtime.driverGetVersion()
        versions["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    except RuntimeError:  # CuPy's CUDA errors: no driver or no NVRTC on this machine
        pass
    return versions


def report(rows: list[Row], checks: list[Bar], bandwidth: float, device: str) -> dict:
    """The run as plain data (`quantkit bench --json`), for the README's tables and later comparisons: every row's
    median seconds and rates, every bar with its verdict, and the knobs and software it ran under."""
    def row(r: Row) -> dict:
        return {"n": r.n, "k": r.k, "m": r.m, "label": r.label, "function": r.kernel,
                "format": r.variant.fmt if r.variant else None, "path": r.variant.path if r.variant else None,
                "seconds": r.seconds, "launch_seconds": r.launch_seconds, "tops": r.tops, "gbps": r.gbps,
                "bytes_moved": r.bytes_moved, **({"round_seconds": list(r.round_seconds)} if r.round_seconds else {})}

    return {"device": device, "copy_bandwidth_gbps": bandwidth, "tuning": tuning(), "software": software(),
            "rows": [row(r) for r in rows],
            "bars": [{**row(c.row), "requirement": c.requirement, "measured": c.measured, "met": c.met}
                     for c in checks]}


def with_fastest_baselines(report: dict, others: list[dict]) -> dict:
    """`report` with each cuBLAS baseline row at its fastest time in it and `others` (other runs of the same shapes,
    on the same kind of device) and its bars judged against those times: a count that no slow spell of cuBLAS in one
    run can raise. The kernels' own rows and the bandwidth bars stay the run's."""
    fastest: dict[tuple, float] = {}
    for run in (report, *others):
        for r in run["rows"]:
            if r["format"] is None and r["label"] in (FP16, INT8, INT8_GEMMEX):
                key = (r["n"], r["k"], r["m"], r["label"])
                fastest[key] = min(fastest.get(key, r["seconds"]), r["seconds"])

    def at_fastest(r: dict) -> dict:
        """A baseline row at its fastest time, its rates (TOPS, GB/s) with it."""
        seconds = fastest.get((r["n"], r["k"], r["m"], r["label"]), r["seconds"])
        return {**r, "seconds": seconds, **{rate: r[rate] * r["seconds"] / seconds for rate in ("tops", "gbps")
                                            if rate in r}}

    rows = [at_fastest(r) if r["format"] is None else r for r in report["rows"]]

    def judged(bar: dict) -> dict:
        need = re.fullmatch(r">= ([\d.]+)x cuBLAS (FP16|INT8)", bar["requirement"])
        if need is None:  # the copy-bandwidth bars
            return bar
        shape = (bar["n"], bar["k"], bar["m"])
        labels = (FP16,) if need.group(2) == "FP16" else (INT8, INT8_GEMMEX)
        base = min(fastest[(*shape, label)] for label in labels if (*shape, label) in fastest)
        ratio = base / bar["seconds"]
        return {**bar, "measured": f"{ratio:.2f}x", "met": ratio >= float(need.group(1))}

    return {**report, "rows": rows, "bars": [judged(b) for b in report["bars"]],
            "baselines": f"cuBLAS at its fastest of {1 + len(others)} runs"}


def markdown_bars(report: dict) -> str:
    """The bars of a `report` (`quantkit bench --json`) as a Markdown table, with the device and how many were
    met: the README's kernel table."""
    bars = report["bars"]
    met = sum(b["met"] for b in bars)
    knobs = report.get("tuning", {})  # reports from before it was recorded have none
    tuned = [*knobs.get("defines", []), *(f"{k}={v}" for k, v in knobs.get("environment", {}).items())]
    against = f" against {report['baselines']}" if "baselines" in report else ""
    lines = [f"{report['device']}, copy bandwidth {report['copy_bandwidth_gbps']:.0f} GB/s: "
             f"{met} of {len(bars)} bars met{against}" + (f" (tuned: {' '.join(tuned)})." if tuned else "."), "",
             "| N x K | M | kernel | function | time (us) | requirement | measured | met |",
             "|---|---|---|---|---|---|---|---|"]
    for b in bars:
        lines.append(f"| {b['n']} x {b['k']} | {b['m']} | {b['label']} | `{b['function']}` | "
                     f"{b['seconds'] * 1e6:.1f} | {b['requirement']} | {b['measured']} | "
                     f"{'yes' if b['met'] else 'NO'} |")
    return "\n".join(lines)


def markdown_bar_counts(report: dict) -> str:
    """How many of a `report`'s bars each kernel meets, per requirement (met / of), as a Markdown table: where the
    bars stand at a glance, beside markdown_bars' line per bar."""
    requirements = list(dict.fromkeys(b["requirement"] for b in report["bars"]))
    counts: dict[str, dict[str, list[int]]] = {}
    for b in report["bars"]:
        tally = counts.setdefault(b["label"], {}).setdefault(b["requirement"], [0, 0])
        tally[0] += b["met"]
        tally[1] += 1
    lines = ["| kernel | " + " | ".join(requirements) + " | met |", "|---|" + "---|" * (len(requirements) + 1)]
    for label, by in counts.items():
        cells = [f"{by[r][0]} of {by[r][1]}" if r in by else "-" for r in requirements]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {sum(t[0] for t in by.values())} |")
    return "\n".join(lines)


def markdown_bar_changes(before: dict, after: dict) -> str:
    """The bars whose verdict differs between two reports of the same bars (`before`, then `after`: another
    configuration, or another run of the same one), as a Markdown table; the counts of both in its first line.
    Across runs a bar near its threshold can flip with no change at all: read it beside the runs' spread."""
    key = lambda b: (b["n"], b["k"], b["m"], b["label"], b["requirement"])  # noqa: E731
    theirs = {key(b): b for b in before["bars"]}
    both = sum(b["met"] and theirs.get(key(b), {}).get("met", False) for b in after["bars"])
    lines = [f"{sum(b['met'] for b in before['bars'])} -> {sum(b['met'] for b in after['bars'])} bars met "
             f"({both} in both)", "",
             "| N x K | M | kernel | requirement | before | after |", "|---|---|---|---|---|---|"]
    for b in after["bars"]:
        a = theirs.get(key(b))
        if a is not None and a["met"] != b["met"]:
            verdicts = [f"{v['measured']} {'yes' if v['met'] else 'NO'}" for v in (a, b)]
            lines.append(f"| {b['n']} x {b['k']} | {b['m']} | {b['label']} | {b['requirement']} | "
                         f"{verdicts[0]} | {verdicts[1]} |")
    return "\n".join(lines)


def markdown_grid(report: dict, m: int) -> str:
    """From a `report`, the rows at one M as a Markdown table with a column per shape: the baselines' times (TOPS at
    M > 16, the read floor's share of the copy bandwidth), then each kernel's time with its speedup over cuBLAS FP16
    and, at M > 16, over the faster INT8 baseline, or at M <= 16 its share of the copy bandwidth (the README's
    kernel tables)."""
    bandwidth = report["copy_bandwidth_gbps"]
    rows = [r for r in report["rows"] if r["m"] == m]
    shapes = list(dict.fromkeys((r["n"], r["k"]) for r in rows))
    by = {(r["label"], r["n"], r["k"]): r for r in rows}

    def cell(label: str, n: int, k: int) -> str:
        r = by.get((label, n, k))
        if r is None:
            return "-"
        text = f"{r['seconds'] * 1e6:.1f} us"
        if r["format"] is None:
            return (f"{text}, {100 * r['gbps'] / bandwidth:.0f}% BW" if label == READ_FLOOR
                    else f"{text} ({r['tops']:.0f} TOPS)" if m > 16 else text)
        fp16 = by.get((FP16, n, k))
        int8 = int8_baseline({lab: by[(lab, n, k)] for lab in (INT8, INT8_GEMMEX) if (lab, n, k) in by},
                             lambda b: b["seconds"])
        parts = [f"{fp16['seconds'] / r['seconds']:.2f}x FP16"] if fp16 else []
        if m > 16 and int8:
            parts.append(f"{int8['seconds'] / r['seconds']:.2f}x INT8")
        elif m <= 16 and r["format"] != "anyprec":
            parts.append(f"{100 * r['gbps'] / bandwidth:.0f}% BW")
        return f"{text}: {', '.join(parts)}" if parts else text

    labels = list(dict.fromkeys(r["label"] for r in rows))
    labels.sort(key=lambda lab: by[next((lab, n, k) for n, k in shapes if (lab, n, k) in by)]["format"] is not None)
    lines = [f"| M = {m} | " + " | ".join(f"{n} x {k}" for n, k in shapes) + " |",
             "|---|" + "---|" * len(shapes)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(cell(label, n, k) for n, k in shapes) + " |")
    return "\n".join(lines)


def stream_fit(report: dict, m: int) -> list[dict]:
    """Per kernel (label and function) at one M, the line time = fixed + bytes / rate through its rows' (bytes
    moved, seconds) over the shapes, least squares: the rate it streams at and the time it spends whatever the
    shape (launch, first loads, meetings, stores), with the largest residual. Kernels with fewer than 3 shapes of
    distinct sizes are left out (a line through two points says nothing of its fit); the read floor is fitted too,
    the baselines are not."""
    points: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for r in report["rows"]:
        if r["m"] == m and r["bytes_moved"] and (r["format"] is not None or r["label"] == READ_FLOOR):
            points[(r["label"], r["function"])].append((r["bytes_moved"], r["seconds"]))
    fits = []
    for (label, function), pts in points.items():
        x, y = (np.array(v, dtype=np.float64) for v in zip(*pts, strict=True))
        if len(np.unique(x)) < 3:
            continue
        slope, fixed = np.polyfit(x, y, 1)
        fits.append({"label": label, "function": function, "shapes": len(pts), "rate_tbps": 1 / slope / 1e12,
                     "fixed_us": fixed * 1e6, "residual_us": float(np.abs(y - (fixed + slope * x)).max()) * 1e6})
    return fits


def markdown_fit(report: dict, m: int) -> str:
    """stream_fit's lines as a Markdown table: where a kernel stands against the read floor, by rate and by the
    fixed time that small shapes feel most."""
    lines = [f"| M = {m} | function | shapes | streams at (TB/s) | fixed (us) | largest residual (us) |",
             "|---|---|---|---|---|---|"]
    for f in stream_fit(report, m):
        lines.append(f"| {f['label']} | `{f['function']}` | {f['shapes']} | {f['rate_tbps']:.2f} | "
                     f"{f['fixed_us']:.2f} | {f['residual_us']:.2f} |")
    return "\n".join(lines)


def markdown_sweep(report: dict) -> str:
    """From a `--paths all` report: per kernel variant and M, each path's time summed over the shapes, and the
    fastest path (what the M thresholds between the paths are set from)."""
    totals: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in report["rows"]:
        if r["path"] is None:
            continue
        variant = r["label"].rsplit(" [", 1)[0]
        totals[(variant, r["m"])][r["path"]] += r["seconds"]
    paths = sorted({p for case in totals.values() for p in case})
    lines = ["| kernel | M | " + " | ".join(f"{p} (us, all shapes)" for p in paths) + " | fastest |",
             "|---|---|" + "---|" * len(paths) + "---|"]
    for (variant, m), case in sorted(totals.items()):
        cells = [f"{case[p] * 1e6:.1f}" if p in case else "-" for p in paths]
        lines.append(f"| {variant} | {m} | " + " | ".join(cells) + f" | {min(case, key=case.get)} |")
    return "\n".join(lines)


def render_bars(checks: list[Bar], device: str):
    """A rich Table of the bars, one line each, and how many were met."""
    from rich.table import Table

    met = sum(c.met for c in checks)
    table = Table(title=f"{device}: issue #6's bars, {met} of {len(checks)} met")
    for column in ("N x K", "M", "kernel", "requirement", "measured", "met"):
        table.add_column(column, justify="right" if column in ("M", "measured") else "left")
    for c in checks:
        table.add_row(f"{c.row.n} x {c.row.k}", str(c.row.m), f"{c.row.label} ({c.row.kernel})", c.requirement,
                      c.measured, "yes" if c.met else "[bold red]NO[/]")
    return table


def render(rows: list[Row], bandwidth: float, device: str):
    """A rich Table of the rows with TOPS, GB/s, share of the copy bandwidth, speedups over the baselines and, for
    decode rows, the time over the read floor of the shape's 4-bit bytes (1.00x: as fast as a plain read)."""
    from rich.table import Table

    table = Table(title=f"{device}: kernels against cuBLAS (medians of CUDA-event timings; under 100 us per call, "
                  "of CUDA-graph replays, as engines run decode GEMMs; 'rounds': the fastest and slowest of the "
                  "run's rounds, whose median is the time; '1 launch': each call alone); copy bandwidth "
                  f"{bandwidth:.0f} GB/s")
    for column in ("N x K", "M", "kernel", "function", "time (us)", "rounds (us)", "1 launch (us)", "TOPS", "GB/s",
                   "% copy BW", "vs FP16", "vs INT8 (faster)", "x read floor"):
        table.add_column(column, justify="left" if column in ("kernel", "function", "N x K") else "right")
    by_case: dict[tuple[int, int, int], dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault((r.n, r.k, r.m), {})[r.label] = r
    for (n, k, m), case in by_case.items():
        fp16, int8, floor = case.get(FP16), int8_baseline(case), case.get(READ_FLOOR)
        for r in case.values():
            single = f"{r.launch_seconds * 1e6:.1f}" if r.launch_seconds is not None else "-"
            spread = (f"{min(r.round_seconds) * 1e6:.1f}-{max(r.round_seconds) * 1e6:.1f}" if r.round_seconds
                      else "-")
            table.add_row(f"{n} x {k}", str(m), r.label, r.kernel, f"{r.seconds * 1e6:.1f}", spread, single,
                          f"{r.tops:.1f}",
                          f"{r.gbps:.0f}", f"{100 * r.gbps / bandwidth:.0f}%",
                          f"{fp16.seconds / r.seconds:.2f}x" if fp16 else "-",
                          f"{int8.seconds / r.seconds:.2f}x" if int8 else "-",
                          f"{r.seconds / floor.seconds:.2f}x" if floor and r.variant else "-")
    return table
