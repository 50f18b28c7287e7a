"""The CUDA kernels of kernels/: their lane arithmetic run by the warp simulator on the CPU against the numpy
emulation (bit for bit), and, on a machine with a CUDA device and CuPy, the GPU kernels against the same."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from quantkit import kernels
from quantkit.emulate import emulate
from quantkit.formats import qserve_layout
from quantkit.kernel_bench import SHAPE_SETS, synthetic

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="the warp simulator compiles the kernels with a host C++ compiler "
                                    "(g++ or c++), and none is on PATH")
_gpu_skip = pytest.mark.skipif(not kernels.cuda_available(),
                               reason="needs a CUDA device and CuPy (pip install 'quantkit[cuda]')")
_hopper_skip = pytest.mark.skipif(not kernels.hopper_available(),
                                  reason="needs a Hopper GPU (sm_90a) and CuPy for the wgmma kernels")


def needs_gpu(test):
    """A test of the CUDA kernels on the device: marked `gpu` (what bench/gpu_check.py runs) and skipped without one."""
    return pytest.mark.gpu(_gpu_skip(test))


def needs_hopper(test):
    """A test of the *_wgmma kernels on the device: marked `gpu` and `hopper`, skipped on other machines."""
    return pytest.mark.hopper(pytest.mark.gpu(_hopper_skip(test)))


def extreme_qserve_group(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """Stored QServe g128 tensors at the ends of their ranges: codes 0 and 15, -z * s2 = -120, and a group whose
    (15 - 1) * 127 wraps in its byte lane (as the reference models)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.where(torch.rand(n, k, generator=g) < 0.5, 0, 15)
    s2, zero = torch.full((n, k // 128), 8), torch.full((n, k // 128), 15)
    s2[0], zero[0] = 127, 1
    tensors = {"qweight": qserve_layout.pack_qweight(codes), "s1_scales": (torch.rand(n, generator=g) * 0.02).half()}
    tensors["s2_scales"], tensors["s2_zeros"] = qserve_layout.pack_group_params(s2, zero)
    return tensors


def activations(m: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.integers(0, k, 3)] *= 20  # outlier channels
    if m > 2:
        x[1] = 0.0  # an all-zero token (scale 1)
    return x


@needs_compiler
@pytest.mark.parametrize("group", [None, 128, 64, 32])
@pytest.mark.parametrize("m,n,k", [(1, 32, 128), (5, 64, 256), (16, 96, 128), (33, 32, 384)])
def test_qserve_kernel_matches_the_emulation(m, n, k, group):
    tensors = synthetic("qserve", n, k, seed=m + n + k, group=group)
    x = activations(m, k, seed=k)
    reference = emulate("qserve", tensors, x)
    t_x = x.sum(axis=1, dtype=np.float32)
    out = kernels.gemm("qserve", tensors, reference.x_int8, reference.s_x, t_x)
    assert out.dtype == np.float16 and out.shape == (m, n)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize("group", [None, 128, 64, 32])
@pytest.mark.parametrize(("m", "k", "splits", "chunk", "slots"), [
    (1, 384, 1, 8, 2),  # 12 steps: one warp, a partial last chunk
    (1, 384, 5, 8, 2),  # ranges of 2, 2, 3, 2 and 3 steps: chunks that start inside a group of 128 or 64
    (3, 768, 5, 3, 2),  # 24 steps over 5 warps, chunks of 3: more chunks than slots, each slot reused
    (16, 384, 2, 4, 3),  # a full 16-token tile
    (20, 256, 2, 1, 1),  # two token tiles, the second of 4 rows; one slot of one step
])
def test_qserve_bulk_kernel_matches_the_emulation(group, m, k, splits, chunk, slots):
    """qserve_w4a8_bulk (each warp's contiguous K range in chunks of bulk copies: weights, activation rows, the
    groups' s2 and z2 rows) gives the emulation's bits. The simulator fills each slot with garbage before its copies,
    so a step reading a byte no copy wrote, or a copy past its slot or not in 16-byte units, shows."""
    n = 64
    tensors = synthetic("qserve", n, k, seed=m + k + splits, group=group)
    x = activations(m, k, seed=splits)
    reference = emulate("qserve", tensors, x)
    launch = kernels.qserve_launch(tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   splits=splits, bulk=True)
    assert launch.name == "qserve_w4a8_bulk" and launch.block == 32 * splits
    assert launch.args[-2:] == [8 if m <= 4 else 4, kernels.BULK_SLOTS]
    launch.args[-2:] = [chunk, slots]
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


@needs_compiler
def test_simulator_failure_is_raised_for_its_launch_alone():
    """A twin that stops (fail(): here a bulk launch with no slot, a per-group launch without its s2 and z2) raises
    SimulatorFailure with the simulator's reason, rather than aborting the process; the next launch runs clean."""
    tensors = synthetic("qserve", 64, 256, seed=3, group=128)
    x = activations(3, 256, seed=3)
    reference = emulate("qserve", tensors, x)

    def launch(**kw):
        return kernels.qserve_launch(tensors, reference.x_int8, reference.s_x, splits=2, **kw)

    bulk = launch(bulk=True)
    bulk.args[-1] = 0
    with pytest.raises(kernels.SimulatorFailure, match="qserve_w4a8_bulk: bulk: no slot"):
        kernels.run(bulk, "cpu")
    grouped = launch(bulk=False)
    grouped.args[6] = None
    with pytest.raises(kernels.SimulatorFailure, match="per group, needs s2 and z2"):
        kernels.run(grouped, "cpu")
    np.testing.assert_array_equal(kernels.run(launch(bulk=False), "cpu"), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize(("m", "k", "splits", "chunk", "slots"), [
    (1, 512, 1, 8, 2),  # 8 steps of 64: one chunk
    (1, 1344, 1, 8, 2),  # 21 steps: three chunks in two slots, the last partial
    (3, 1024, 3, 2, 2),  # ranges of 5, 5 and 6 steps in chunks of 2
    (8, 768, 2, 4, 1),  # a full token block, one slot reused
])
def test_liquidquant_bulk_kernel_matches_the_emulation(m, k, splits, chunk, slots):
    """liquidquant_w4a8_bulk8 (a warp per 16-channel tile on its contiguous K range: per step its 512 weight bytes
    and 32 parameter bytes, each token's row over the chunk) gives the emulation's bits, from slots the simulator
    fills with garbage before their copies."""
    n = 128
    tensors = synthetic("liquidquant", n, k, seed=m + k)
    x = activations(m, k, seed=splits)
    reference = emulate("liquidquant", tensors, x)
    launch = kernels.liquidquant_launch(tensors, reference.x_int8, reference.s_x, splits=splits, bulk=True)
    assert launch.name == "liquidquant_w4a8_bulk8" and launch.grid == (n // 16, 1) and launch.block == 32 * splits
    launch.args[-2:] = [chunk, slots]
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize(("m", "k", "splits", "chunk", "slots"), [
    (1, 384, 1, 8, 2),  # 24 k16 steps: three chunks in two slots
    (1, 384, 5, 8, 2),  # ranges of 4 and 5 steps: chunks inside a group, and across two
    (16, 512, 3, 3, 2),  # a full token tile, chunks of 3
    (20, 256, 2, 16, 1),  # two token tiles; a chunk over two groups, one slot
])
def test_qqq_bulk_kernel_matches_the_emulation(group, m, k, splits, chunk, slots):
    """qqq_w4a8_bulk (each warp's contiguous range of k16 steps in chunks of bulk copies: the chunk's words a step,
    each token's row, the groups' 64 ratios) gives the emulation's bits, from garbage-filled slots."""
    n = 128
    tensors = synthetic("qqq", n, k, seed=m + k + splits, group=group)
    x = activations(m, k, seed=splits)
    reference = emulate("qqq", tensors, x)
    launch = kernels.qqq_launch(tensors, reference.x_int8, reference.s_x, splits=splits, bulk=True)
    assert launch.name == "qqq_w4a8_bulk" and launch.block == 32 * splits
    launch.args[-2:] = [chunk, slots]
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize(("fmt", "group", "m", "k", "splits", "zsplit"), [
    ("qqq", None, 1, 512, 3, 2), ("qqq", 128, 5, 768, 2, 4),
    ("qqq", None, 20, 400, 1, 3),  # 25 k16 steps over 3 blocks of one warp
    ("qserve", None, 1, 416, 3, 2), ("qserve", 128, 20, 768, 2, 3),  # 13 k32 steps over 6 copies; two token tiles
])
def test_block_split_matches_the_emulation(fmt, group, m, k, splits, zsplit, bulk):
    """QServe's and QQQ's small-M kernels with K split across `zsplit` blocks of a tile as well (their copies
    interleaved, or contiguous ranges for the bulk kernels): the emulation's bits. The simulator meets the blocks
    through splitk_blocks's own phases in the launch's workspace, every tile's first blocks before any tile's last (so
    tiles that shared slots or a count would mix), and the workspace is left zero: a second launch on it gives the
    same bits."""
    n = 128
    tensors = synthetic(fmt, n, k, seed=m + k + zsplit, group=group)
    x = activations(m, k, seed=zsplit)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   splits=splits, zsplit=zsplit, bulk=bulk)
    width, count = (64, 32) if fmt == "qqq" else (32, 16)  # channels and accumulators a lane of a tile's warp
    tiles = n // width * -(-m // 16)
    assert launch.grid == (n // width, -(-m // 16), zsplit)
    sums, arrived = launch.args[-4:-2] if bulk else launch.args[-2:]
    assert sums.shape == (tiles * count * 32,) and arrived.shape == (tiles,)
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))
    assert not sums.any() and not arrived.any()
    launch.out[:] = 0
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize("dirty", ["sums", "arrived"])
def test_block_split_refuses_a_workspace_not_zero(dirty):
    """splitk_blocks needs its workspace zero at launch (each tile's last block leaves it so): the simulator stops a
    launch given one that is not, naming it."""
    tensors = synthetic("qqq", 64, 512, seed=1)
    x = activations(1, 512, seed=1)
    reference = emulate("qqq", tensors, x)
    launch = kernels.qqq_launch(tensors, reference.x_int8, reference.s_x, splits=2, zsplit=2, bulk=False)
    sums, arrived = launch.args[-2:]
    {"sums": sums, "arrived": arrived}[dirty][-1] = 1
    with pytest.raises(kernels.SimulatorFailure, match="workspace is not zero"):
        kernels.run(launch, "cpu")


CLUSTER_CASES = [("qqq", None, 1, 512, 3, 2), ("qqq", 128, 5, 768, 2, 4), ("qqq", None, 20, 1024, 4, 4),
                 ("qserve", None, 1, 416, 3, 2), ("qserve", 128, 20, 768, 2, 4)]


@needs_compiler
@pytest.mark.parametrize(("fmt", "group", "m", "k", "splits", "zsplit"), CLUSTER_CASES)
def test_cluster_launch_meets_in_shared_memory(fmt, group, m, k, splits, zsplit, monkeypatch):
    """SPLITK_CLUSTER: a tile split over 2 or 4 blocks runs their cluster build (`name`_zC, its Z blocks one
    thread-block cluster), with no workspace in device memory and the leader's inbox ((Z - 1) warps' sums) after the
    partial sums in shared memory; the host twin is the same one, so the same bits. Other block counts, the bulk
    kernels and an inbox past 48 KiB keep splitk_blocks' meeting in device memory."""
    monkeypatch.setattr(kernels, "SPLITK_CLUSTER", True)
    n, count = 128, 32 if fmt == "qqq" else 16  # a lane's sums of its tile
    tensors = synthetic(fmt, n, k, seed=m + k + zsplit, group=group)
    x = activations(m, k, seed=zsplit)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   splits=splits, zsplit=zsplit, bulk=False)
    assert launch.cluster == zsplit and launch.kernel == f"{launch.name}_z{zsplit}" and launch.args[-2:] == [None, None]
    partials = kernels.splitk_shared(splits, 32 * count * 4, kernels.SPLITK_RED)
    assert launch.shared_mem == partials + (zsplit - 1) * 32 * count * 4
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))
    for other in (dict(zsplit=3), dict(zsplit=zsplit, bulk=True), dict(zsplit=1)):
        kept = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                     splits=splits, **{"bulk": False, **other})
        assert kept.cluster == 1 and kept.kernel == kept.name, other
    monkeypatch.setattr(kernels, "SPLITK_MAX_SHARED", partials)  # no room for the inbox
    kept = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                 splits=splits, zsplit=zsplit, bulk=False)
    assert kept.cluster == 1 and kept.args[-1] is not None


QSERVE16_CASES = [(None, 9, 512, None), (128, 16, 1024, None), (None, 13, 768, 3), (128, 12, 512, 5)]


@needs_compiler
@pytest.mark.parametrize(("group", "m", "k", "splits"), QSERVE16_CASES)
def test_qserve_two_tile_launch(group, m, k, splits, monkeypatch):
    """QSERVE_GEMM16: from 9 tokens on, QServe's decode kernels with two 32-channel tiles a warp (*16: grid N / 64,
    32 sums a lane, 4 KiB of partial sums a copy), the emulation's bits in the simulator (whose twin maps a warp's
    two tiles with the kernels' slice_tile; test_qserve_two_tile_gpu_kernel runs them on the device); up to 8
    tokens, an N that 64 does not divide, or the bulk kernel, the one-tile launch."""
    monkeypatch.setattr(kernels, "QSERVE_GEMM16", True)
    n = 192
    tensors = synthetic("qserve", n, k, seed=m + k, group=group)
    x = activations(m, k, seed=m)
    reference = emulate("qserve", tensors, x)
    t_x = x.sum(axis=1, dtype=np.float32)
    launch = kernels.qserve_launch(tensors, reference.x_int8, reference.s_x, t_x, splits=splits, tiled=False)
    assert launch.name == ("qserve_w4a8_gemm16" if group else "qserve_w4a8_gemm_pc16")
    assert launch.grid[0] == n // 64
    assert launch.shared_mem == kernels.splitk_shared(launch.block // 32, 4096, kernels.SPLITK_RED)
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))
    few = emulate("qserve", tensors, x[:8])
    one_tile = [kernels.qserve_launch(tensors, few.x_int8, few.s_x, t_x[:8], tiled=False),
                kernels.qserve_launch(tensors, reference.x_int8, reference.s_x, t_x, tiled=False, bulk=True)]
    narrow = synthetic("qserve", 96, k, seed=1, group=group)
    one_tile.append(kernels.qserve_launch(narrow, reference.x_int8, reference.s_x, t_x, tiled=False))
    assert all(not launch.name.endswith("16") for launch in one_tile), [launch.name for launch in one_tile]


def test_qserve_two_tile_kernels_by_default_on_large_weights(monkeypatch):
    """QSERVE_GEMM16 None (the default): the two-tile kernels from 9 tokens on where N K >= 2^25 (Llama-3-8B's 28672 x
    4096 and 4096 x 14336, where an H200 timed them faster), the one-tile ones on 6144 x 4096 and 4096 x 4096 (slower
    there), up to 8 tokens, on the bulk path, and where 64 does not divide N; True and False override the size."""
    monkeypatch.setattr(kernels, "QSERVE_GEMM16", None)
    monkeypatch.setattr(kernels, "BULK_DECODE", False)
    use = kernels.use_qserve_gemm16
    assert [use(16, n, k, None) for n, k in SHAPE_SETS["llama3-8b"]] == [False, False, True, True]
    assert use(9, 28672, 4096, None) and not use(8, 28672, 4096, None)
    assert not use(16, 28672, 4096, True)  # the bulk kernel has no two-tile form
    assert not use(16, 28672 + 32, 4096, None)
    assert use(16, 8192, 4096, None) and not use(16, 8192 - 64, 4096, None)  # 2^25 weights and fewer
    monkeypatch.setattr(kernels, "QSERVE_GEMM16", False)
    assert not use(16, 28672, 4096, None)
    monkeypatch.setattr(kernels, "QSERVE_GEMM16", True)
    assert use(16, 4096, 4096, None)


def test_split_plan_spreads_the_blocks_evenly(monkeypatch):
    """split_plan: a tile is one block of split_count's copies where they are all SPLITK_WARPS asks for; where a block
    cannot hold them (the partial sums' shared memory), the blocks a tile that spread the grid most evenly over the
    SMs, within the warp budget and SPLITK_MIN_STEPS steps a copy; none with SPLITK_BLOCKS_MAX = 1."""
    assert kernels.split_plan(192, 128, 2048) == (8, 1)  # QServe 6144 x 4096: not 384 blocks for the spread alone
    assert kernels.split_plan(128, 128, 2048) == (16, 1)  # QServe 4096 x 4096
    assert kernels.split_plan(896, 128, 2048) == (2, 1)  # QServe 28672 x 4096
    assert kernels.split_plan(448, 256, 4096) == (4, 1)  # QQQ 28672 x 4096: 1792 warps in one block a tile
    assert kernels.split_plan(64, 256, 4096) == (8, 4)  # QQQ 4096 x 4096: 32 copies a tile over four blocks (16
    # copies' partial sums would pass the 48 KiB a block may take without opting in)
    assert kernels.split_plan(64, 128, 4096) == (8, 2)  # but not below 8 steps a copy
    assert kernels.split_plan(96, 256, 4096) == (4, 4)  # QQQ 6144 x 4096: 16 copies as 384 blocks (3 or 2 an SM),
    # not 192 blocks of 8 (2 or 1)
    # counting the one slot of sums the copies add into under QK_SPLITK_RED (SPLITK_RED_PLAN), a QQQ block holds 16
    # copies: two blocks a tile at N = 4096, one at 6144; QServe's blocks are bound by their 512 threads either way
    assert kernels.split_plan(64, 256, 4096, red=True) == (16, 2)
    assert kernels.split_plan(96, 256, 4096, red=True) == (16, 1)
    assert kernels.split_plan(448, 256, 4096, red=True) == (4, 1)
    assert kernels.split_plan(128, 128, 2048, red=True) == (16, 1)
    # a register kernel takes the one-slot plan where it makes a tile one block (SPLITK_RED_PLAN 1), or everywhere (2)
    assert [kernels.register_split_plan(t, 256, 4096) for t in (64, 96, 448)] == [(8, 4), (16, 1), (4, 1)]
    assert kernels.register_split_plan(64, 896, 4096) == (8, 4)  # QQQ 4096 x 14336: (16, 2) was slower
    monkeypatch.setattr(kernels, "SPLITK_RED_PLAN", 2)
    assert [kernels.register_split_plan(t, 256, 4096) for t in (64, 96, 448)] == [(16, 2), (16, 1), (4, 1)]
    monkeypatch.setattr(kernels, "SPLITK_RED_PLAN", 0)
    assert [kernels.register_split_plan(t, 256, 4096) for t in (64, 96, 448)] == [(8, 4), (4, 4), (4, 1)]
    monkeypatch.setattr(kernels, "SPLITK_BLOCKS_MAX", 1)
    assert kernels.split_plan(64, 256, 4096) == (8, 1)
    assert kernels.split_plan(96, 256, 4096) == (8, 1)
    assert abs(kernels.block_balance(192) - 192 / 264) < 1e-12 and kernels.block_balance(132) == 1.0


@pytest.mark.parametrize("red", [True, False])
def test_register_launches_reserve_the_shared_memory_their_meeting_takes(red, monkeypatch):
    """A register kernel's block reserves the split-K slots its compiled meeting uses (kernels/qk_common.cuh
    splitk_slots): one that every copy adds into under QK_SPLITK_RED, else one a copy but the first. SPLITK_RED_PLAN
    plans QQQ's copies by that one slot where a tile then needs no meeting across blocks (16 a block at N = 6144, not
    4 blocks of 4; at 4096 the old plan), or everywhere (2), only under RED and off the bulk kernels, which always
    store their sums."""
    monkeypatch.setattr(kernels, "SPLITK_RED", red)
    assert [kernels.splitk_shared(s, 4096, red) for s in (1, 2, 8)] == ([0, 4096, 4096] if red else [0, 4096, 28672])

    def qqq(n: int, bulk: bool = False) -> kernels.Launch:  # M = 1, K = 4096 (256 k16 steps)
        out = np.zeros((1, n), np.uint16)
        return kernels.warp_tile_launch("qqq_w4a8", [], out, 1, n, 64, 32, 256, None, None, bulk,
                                        lambda c: kernels.qqq_bulk_slot_bytes(c, 1, False), "gemm_pc")

    launch = qqq(6144)  # SPLITK_RED_PLAN 1: one block of 16 copies a tile under RED, no meeting in device memory
    assert (launch.block, launch.grid[2]) == ((512, 1) if red else (128, 4))
    assert launch.shared_mem == (4096 if red else 3 * 4096)
    assert (launch.args[-1] is None) == red  # one block a tile: no workspace in device memory to meet in
    assert (qqq(4096).block, qqq(4096).grid[2]) == (256, 4)  # 2 blocks of 16 would still meet in device memory
    assert qqq(6144, bulk=True).block == 128  # the bulk kernel's plan counts a slot a copy
    monkeypatch.setattr(kernels, "SPLITK_RED_PLAN", 0)
    launch = qqq(6144)
    assert (launch.block, launch.grid[2], launch.shared_mem) == (128, 4, 4096 if red else 3 * 4096)
    monkeypatch.setattr(kernels, "SPLITK_RED_PLAN", 2)
    assert (qqq(4096).block, qqq(4096).grid[2]) == ((512, 2) if red else (256, 4))


@needs_compiler
def test_bulk_slots_mirror_the_kernels():
    """quantkit.kernels sizes the bulk kernels' shared memory from their slots: they must be the kernels', and a
    launch's plan must fit the block's shared memory."""
    library = kernels.host_library()
    for chunk in (1, 3, 4, 8):
        for rows in (1, 5, 8, 16):
            for grouped in (False, True):
                compiled = library.qserve_bulk_slot_bytes(chunk, rows, int(grouped))
                assert kernels.qserve_bulk_slot_bytes(chunk, rows, grouped) == compiled
                compiled = library.qqq_bulk_slot_bytes(chunk, rows, int(grouped))
                assert kernels.qqq_bulk_slot_bytes(chunk, rows, grouped) == compiled
            assert kernels.liquidquant_bulk_slot_bytes(chunk, rows) == library.liquidquant_bulk_slot_bytes(chunk, rows)
    for splits in (1, 4, 16):
        for rows in (1, 16):
            def slot(chunk: int, rows: int = rows) -> int:
                return kernels.qserve_bulk_slot_bytes(chunk, rows, True)

            chunk, slots, shared = kernels.bulk_plan(splits, 2048, slot, 8)
            assert chunk >= 1 and slots == kernels.BULK_SLOTS and shared <= kernels.BULK_MAX_SHARED
            assert shared >= splits * slots * slot(chunk) + (splits - 1) * 2048


@needs_compiler
@pytest.mark.parametrize(("fmt", "group", "k", "m", "partial_bytes"), [
    ("qserve", None, 416, 7, 2048), ("qserve", 128, 384, 7, 2048),  # 13 and 12 k tiles of 32
    ("qqq", None, 400, 7, 4096), ("qqq", 128, 384, 7, 4096),  # 25 and 24 k tiles of 16
    ("liquidquant", 64, 448, 7, 512), ("liquidquant", 64, 448, 20, 2048),  # 7 k blocks of 64; 1 and 4 token blocks
])
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_k_matches_the_emulation(fmt, group, k, m, partial_bytes, splits):
    """Warps splitting K (each every splits-th step) and meeting in the block's partial sums give the emulation's
    bits: step counts 13, 25 and 7 divide by no split count (copies with a step more than others), 12 and 24 by 2
    and 3 (equal shares), 25 by 5."""
    n = 64
    tensors = synthetic(fmt, n, k, seed=splits, group=group)
    x = activations(m, k, seed=splits)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   splits=splits)
    small_m = ("_gemm8" if fmt == "liquidquant" and m <= 8 else "_gemm_pc" if fmt in ("qserve", "qqq") and not group
               else "_gemm")
    assert launch.name.endswith(small_m)
    warps = kernels.LQQ_TILE_WARPS if fmt == "liquidquant" else 1  # LiquidQuant: each warp its 16 channels
    assert launch.block == 32 * warps * splits
    assert launch.shared_mem == kernels.splitk_shared(splits, warps * partial_bytes, kernels.SPLITK_RED)
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


LARGE_M_LAYOUTS = [("qserve", None), ("qserve", 128), ("qserve", 64), ("qserve", 32), ("qqq", None), ("qqq", 128),
                   ("liquidquant", 64)]


@needs_compiler
@pytest.mark.parametrize(("fmt", "group"), LARGE_M_LAYOUTS)
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (128, 128, 128), (130, 256, 384), (200, 128, 512)])
def test_large_m_path_matches_the_emulation(fmt, group, m, n, k):
    """The tiled kernels (operands staged in shared memory four K steps deep, ldmatrix of the swizzled activations)
    give the emulation's bits: fewer K steps than the pipeline holds, more than its ring of stages, token counts
    that end inside a block tile, several blocks each way."""
    tensors = synthetic(fmt, n, k, seed=m + n + k, group=group)
    x = activations(m, k, seed=k)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   tiled=True)
    assert launch.name.endswith("_tiled") and launch.shared_mem == kernels.TILES[fmt].shared_mem
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize(("fmt", "group"), LARGE_M_LAYOUTS)
@pytest.mark.parametrize("block,m,n,k", [("", 1, 128, 128), ("", 128, 128, 256), ("", 130, 256, 384),
                                         ("", 200, 128, 640), ("wide", 1, 256, 128), ("wide", 130, 512, 384),
                                         ("wide", 200, 256, 640), ("tall", 1, 128, 128), ("tall", 200, 256, 384),
                                         ("tall", 300, 128, 896), ("tall", 520, 256, 128)])
def test_hopper_path_matches_the_emulation(fmt, group, block, m, n, k, monkeypatch):
    """The *_wgmma kernels as the simulator models wgmma (weights as the A operand from registers, activations
    through a 64-byte-swizzle descriptor, the first product of a sum ignoring the garbage accumulators, each step's
    products run as late as the ring allows): the emulation's bits, with fewer K steps than the ring holds, more
    than it holds, and token counts that end inside a block. `wide`: the 256-channel *_wgmma2 kernels (four
    warpgroups on one activation tile, two 128-channel weight regions a stage); `tall`: the 256-token *_wgmma_tall
    (each warpgroup's A fragments through two wgmmas, one a 128-token half of the tile, the second half partial or
    all past M; per group on its own deeper ring, 14 K steps at K = 896 passing its 10 stages); several blocks each
    way."""
    monkeypatch.setattr(kernels, "WGMMA_WIDE", block == "wide")
    monkeypatch.setattr(kernels, "WGMMA_TALL", block == "tall")
    tensors = synthetic(fmt, n, k, seed=m + n + k, group=group)
    x = activations(m, k, seed=k)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   wgmma=True)
    tiles = {"wide": kernels.WGMMA2, "tall": kernels.WGMMA_TALL_TILES}.get(block, kernels.WGMMA)[fmt]
    if block == "tall" and group and fmt != "liquidquant":
        tiles = kernels.WGMMA_TALL_GROUP_TILES[fmt]
    mbarriers = 8 * tiles.stages if kernels.WGMMA_TMA else 0  # the tensor copies complete on one a stage
    assert launch.name.endswith("_" + tiles.kernel) and launch.shared_mem == tiles.shared_mem + mbarriers
    grid = (n // tiles.bn, -(-m // tiles.bm))
    if kernels.WGMMA_STREAMK and block == "tall":  # built with the stream-K tail: one dimension (too few K steps to
        grid = (grid[0] * grid[1],)               # split here)
    assert launch.grid == grid and launch.block == tiles.threads
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


def hopper_case(fmt: str, group: int | None, m: int, n: int, k: int, seeds: tuple[int, int]):
    """The wgmma launch of layout `fmt` on synthetic stored tensors and activations (`seeds`: theirs), as the path
    settings make it, with the emulation it must equal."""
    tensors = synthetic(fmt, n, k, seed=seeds[0], group=group)
    x = activations(m, k, seed=seeds[1])
    reference = emulate(fmt, tensors, x)
    sums = x.sum(axis=1, dtype=np.float32)
    return reference, kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, sums, wgmma=True)


def test_streamk_tail_plan(monkeypatch):
    """WGMMA_STREAMK: the tiles past the whole waves are split in two along K where twice them fit the last wave and
    each half keeps STREAMK_MIN_STEPS K steps (Llama-3-8B's 6144 x 4096 at M = 1024: 192 tiles on 132 SMs, 60 split
    into 120 blocks); the 256-token kernel is then taken by the fill of whole waves and a half one (192 / 198)."""
    monkeypatch.setattr(kernels, "WGMMA_STREAMK", True)
    monkeypatch.setattr(kernels, "multiprocessors", lambda: 132)
    assert kernels.streamk_from(192, 132, 64) == 132
    assert kernels.streamk_from(60, 132, 64) == 0  # one part wave: every tile halved
    assert kernels.streamk_from(128, 132, 64) == 128  # 4096 x 4096: a wave 0.97 full, nothing to split
    assert kernels.streamk_from(264, 132, 64) == 264  # whole waves
    assert kernels.streamk_from(132 + 67, 132, 64) == 199  # 134 halves would pass the wave
    assert kernels.streamk_from(192, 132, 15) == 192 and kernels.streamk_from(192, 132, 16) == 132
    assert kernels.tall_fill(192, 132, 64) == 192 / 198 and kernels.tall_fill(128, 132, 64) == 128 / 132
    assert kernels.wgmma_tiles("qqq", 1024, 6144, 4096) is kernels.WGMMA_TALL_TILES["qqq"]
    monkeypatch.setattr(kernels, "WGMMA_STREAMK", False)
    assert kernels.streamk_from(192, 132, 64) == 192 and kernels.tall_fill(192, 132, 64) == 192 / 264
    assert kernels.wgmma_tiles("qqq", 1024, 6144, 4096) is kernels.WGMMA["qqq"]


@needs_compiler
@pytest.mark.skipif(not kernels.WGMMA_STREAMK, reason="the warp simulator is built without QK_WGMMA_STREAMK here; "
                    "test_compile_time_knobs_keep_the_bits runs this test under it")
@pytest.mark.parametrize(("fmt", "group"), LARGE_M_LAYOUTS)
def test_streamk_tail_matches_the_emulation(fmt, group, monkeypatch):
    """QK_WGMMA_STREAMK: 12 tiles of 256 tokens on 10 SMs, the 2 past the whole wave split in two along K (16 steps:
    8 each), blocks 10-13 meeting in the workspace: the emulation's bits, per channel and per group, and the
    workspace's flags back at zero for the next launch (the twin runs the first tile's halves in order, the second's
    second half first, as either may arrive first on the device); a second launch on the same workspace, the same."""
    monkeypatch.setattr(kernels, "multiprocessors", lambda: 10)
    monkeypatch.setattr(kernels, "WGMMA_TALL", True)
    reference, launch = hopper_case(fmt, group, 700, 512, 1024, (11, 12))
    tail = [a for a in launch.args if not isinstance(a, kernels.TensorMap)][-3:]
    assert launch.name.endswith("_wgmma_tall") and launch.grid == (14,) and tail[0] == 10
    assert tail[1].shape == (2 * 256 * 128,) and tail[2].shape == (4,)
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))
    assert not tail[2].any()
    launch.out[:] = 0
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize(("fmt", "group"), LARGE_M_LAYOUTS)
def test_hopper_launch_with_tensor_copies_passes_x_by_its_map(fmt, group, monkeypatch):
    """QK_WGMMA_TMA: the wgmma launch's last argument is the tensor map of x (argument 0: [M, K] bytes, boxes of the
    128-token x 64-byte activation tile), its shared memory one mbarrier a stage more; the warp simulator's twin,
    which takes no map, still gives the emulation's bits. (The map is encoded by the CUDA driver at upload: a GPU
    test runs the tensor copies.)"""
    monkeypatch.setattr(kernels, "WGMMA_TMA", True)
    m, k = 130, 384
    reference, launch = hopper_case(fmt, group, m, 256, k, (7, 8))
    tiles = kernels.WGMMA[fmt]
    assert launch.args[-1] == kernels.TensorMap(0, m, k, 128, 64)
    np.testing.assert_array_equal(launch.args[0], reference.x_int8)
    assert launch.shared_mem == tiles.shared_mem + 8 * tiles.stages
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))
    monkeypatch.setattr(kernels, "WGMMA_TMA", False)
    plain = hopper_case(fmt, group, m, 256, k, (7, 8))[1]
    assert not any(isinstance(a, kernels.TensorMap) for a in plain.args) and plain.shared_mem == tiles.shared_mem


def test_wide_hopper_kernel_only_where_n_allows_it(monkeypatch):
    """WGMMA_WIDE picks the 256-channel kernel only where N % 256 == 0, elsewhere the 128-channel one; off, never."""
    assert kernels.wgmma_tiles("qserve", 1024, 384, 4096) is kernels.WGMMA["qserve"]
    assert kernels.wgmma_tiles("qserve", 1024, 512, 4096) is kernels.WGMMA["qserve"]
    monkeypatch.setattr(kernels, "WGMMA_WIDE", True)
    assert kernels.wgmma_tiles("qserve", 1024, 384, 4096) is kernels.WGMMA["qserve"]
    assert kernels.wgmma_tiles("qqq", 1024, 512, 4096) is kernels.WGMMA2["qqq"]
    monkeypatch.setattr(kernels, "WGMMA_TALL", True)  # 256 tokens a block, whatever the shape, over WGMMA_WIDE
    assert kernels.wgmma_tiles("qqq", 1024, 512, 4096) is kernels.WGMMA_TALL_TILES["qqq"]
    assert kernels.wgmma_tiles("qserve", 64, 384, 4096) is kernels.WGMMA_TALL_TILES["qserve"]
    # per group (QServe's progressive groups, QQQ per group) on the ring of QK_WGMMA_TALL_GROUP_STAGES; LiquidQuant,
    # whose groups every launch has, on the common one
    assert kernels.wgmma_tiles("qqq", 1024, 512, 4096, grouped=True) is kernels.WGMMA_TALL_GROUP_TILES["qqq"]
    assert kernels.wgmma_tiles("liquidquant", 1024, 512, 4096, grouped=True) is kernels.WGMMA_TALL_TILES["liquidquant"]
    monkeypatch.setattr(kernels, "WGMMA_TALL", False)
    assert kernels.wgmma_tiles("qserve", 1024, 512, 4096, grouped=True) is kernels.WGMMA2["qserve"]


@pytest.mark.parametrize(("m", "n", "tall"), [
    (1024, 4096, True),    # 32 x 4 = 128 blocks: 0.97 of one wave of 132
    (1024, 28672, True),   # 896 blocks in 7 waves: 0.97
    (1024, 6144, False),   # 192 blocks in 2 waves: 0.73 (the H200 took 1.00-1.12x the 128-token kernels' time)
    (1000, 4096, True),    # the last 256-token block partial counts as a block
    (512, 4096, False),    # 64 blocks: half the SMs idle
    (2048, 6144, True),    # 384 blocks in 3 waves: 0.97
    (64, 128, False),
])
def test_tall_hopper_kernel_where_its_grid_fills_the_waves(monkeypatch, m, n, tall):
    """By default (WGMMA_TALL None) a launch takes the 256-token kernel where its grid, one block an SM, fills at
    least TALL_MIN_FILL of its waves on the device's SMs (132 here, an H100 SXM's and an H200's); False never."""
    monkeypatch.setattr(kernels, "multiprocessors", lambda: 132)
    assert kernels.WGMMA_TALL is None
    expected = kernels.WGMMA_TALL_TILES["qserve"] if tall else kernels.WGMMA["qserve"]
    assert kernels.wgmma_tiles("qserve", m, n, 4096) is expected
    monkeypatch.setattr(kernels, "WGMMA_TALL", False)
    assert kernels.wgmma_tiles("qserve", m, n, 4096) is kernels.WGMMA["qserve"]


def test_wave_fill():
    """The share of the slots a grid keeps busy over its waves, the last one partial."""
    assert kernels.wave_fill(132, 132) == 1.0
    assert kernels.wave_fill(192, 132) == 192 / 264
    assert kernels.wave_fill(1, 132) == 1 / 132
    assert kernels.wave_fill(265, 132) == 265 / 396


@needs_compiler
@pytest.mark.parametrize("m,n,groups", [(1, 64, 1), (128, 64, 2), (130, 128, 3), (200, 192, 5)])
def test_atom_large_m_path_matches_the_emulation(m, n, groups):
    """Atom's tiled kernel: a K step per group of 128 INT4 columns and two for the INT8 outliers, each group's
    int32 partial scaled into the float32 sums once complete, in the small-M kernel's order: the same bits, with
    fewer and more groups than the pipeline's stages."""
    from quantkit.emulate import emulate_atom

    k = 128 * groups + 128
    tensors = synthetic("atom", n, k, seed=m + n)
    x = activations(m, k, seed=groups)
    reference = emulate_atom(tensors, x, 4, 0.9)
    launch = kernels.atom_launch(tensors, reference.x_codes, reference.s_x, tiled=True)
    assert launch.name == "atom_w4a4_tiled" and launch.grid == (n // 64, -(-m // 128))
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize("fmt", sorted(kernels.TILES))
def test_large_m_tiles_mirror_the_kernels(fmt):
    """quantkit.kernels.TILES sizes each tiled launch (grid, threads, shared memory): it must say what the kernel's
    policy was compiled with."""
    import ctypes

    values = (ctypes.c_int * 6)()
    assert kernels.host_library().qk_tiles(fmt.encode(), values)
    t = kernels.TILES[fmt]
    assert list(values) == [t.bm, t.bn, t.bk, t.threads, t.stage_bytes, t.stages]
    for name, table in (("wgmma", kernels.WGMMA), ("wgmma2", kernels.WGMMA2), ("wgmma_tall", kernels.WGMMA_TALL_TILES),
                        ("wgmma_tall_group", kernels.WGMMA_TALL_GROUP_TILES)):
        if fmt in table:
            assert kernels.host_library().qk_tiles(f"{fmt}-{name}".encode(), values)
            t = table[fmt]
            assert list(values) == [t.bm, t.bn, t.bk, t.threads, t.stage_bytes, t.stages]
            assert t.stage_bytes % 1024 == 0 and t.slack == 1024 and t.kernel == name.removesuffix("_group")
    if fmt in kernels.WGMMA_TALL_GROUP_TILES:  # the deeper ring, with its mbarriers, within an SM's 227 KiB
        assert kernels.WGMMA_TALL_GROUP_TILES[fmt].shared_mem + 8 * 10 <= 227 * 1024


@needs_compiler
def test_anyprec_tc_shared_memory_mirrors_the_kernel():
    """quantkit.kernels sizes the tensor-core Any-Precision launch's shared memory: the kernel's tables and warp sums
    (tc_shared_bytes) must fit in it at every width, in blocks of 8 warps and of 4 (the *_fast_w4 kernels); the host
    knows no other block size."""
    host = kernels.host_library().anyprec_tc_shared_bytes
    for bits in range(1, 9):
        assert kernels.anyprec_tc_shared_bytes(bits) == host(bits, kernels.ANYPREC_TC_WARPS), bits
        assert kernels.anyprec_tc_shared_bytes(bits, 4) == host(bits, 4), bits
    assert kernels.anyprec_tc_shared_bytes(3, 4) < kernels.anyprec_tc_shared_bytes(3) and host(3, 2) == -1


@needs_compiler
def test_group_division_by_multiply_high_is_exact_where_the_launch_allows_it():
    """div_group (a column's group as a multiply-high by ceil(2^32 / group), where the division took some 20
    instructions a K step) equals integer division wherever col * group < 2^32, power-of-two groups or not, at the
    edges of every group; qserve_launch refuses K * group past that."""
    div = kernels.host_library().qk_div_group
    for d in (32, 64, 96, 128, 160, 384, 4096):
        top = ((1 << 32) - 1) // d  # the largest col allowed
        cols = {top, top - 1, 0, 1, d - 1, d, d + 1}
        cols |= {q * d + r for q in range(0, top // d + 1, max(1, top // d // 4000)) for r in (0, 1, d - 1)}
        wrong = [c for c in sorted(cols) if c <= top and div(c, d) != c // d]
        assert not wrong, (d, wrong[:5])
    kernels.check_group_division(1 << 20, 4096 - 32)
    with pytest.raises(ValueError, match="K \\* group < 2\\^32"):
        kernels.check_group_division(1 << 20, 4096)


@needs_compiler
def test_anyprec_fast_kernels_serve_the_shapes_the_kernel_allows():
    """quantkit.kernels takes anyprec_gemm_tc*_fast exactly where the kernel's tc_fast holds:
    K a multiple of 1024, and indices within 32 bits; asked for elsewhere, it refuses rather than read past a row."""
    lib = kernels.host_library()
    shapes = [(1, 4096, 4096), (5, 13, 1024), (1, 24, 4128), (3, 40, 2048 + 512), (1, 64, 96), (9, 11008, 11008),
              (1, 1 << 22, 8192), (1 << 19, 16, 8192), (1 << 19, 16, 4096)]
    for m, n, k in shapes:
        for bits in (1, 3, 4, 8):
            assert kernels.anyprec_tc_fast(m, n, k, bits) == bool(lib.anyprec_tc_fast(bits, m, n, k)), (m, n, k, bits)
    assert not kernels.anyprec_tc_fast(1, 1 << 22, 8192, 8) and kernels.anyprec_tc_fast(1, 1 << 22, 8192, 3)
    assert not kernels.anyprec_tc_fast(1 << 19, 16, 8192, 3) and kernels.anyprec_tc_fast(1 << 19, 16, 4096, 3)
    tensors = synthetic("anyprec", 16, 4128, seed=1)
    with pytest.raises(ValueError, match="multiple of 1024"):
        kernels.anyprec_launch(tensors, activations(1, 4128, seed=1), 3, tc=True, fast=True)


@needs_compiler
@pytest.mark.parametrize("m,n,k", [(1, 13, 4096), (5, 130, 1024), (17, 24, 9216), (9, 16, 2048)])
def test_anyprec_fast_kernels_give_the_checked_kernels_bits(m, n, k):
    """The *_fast kernels run the checked kernels' MMAs on the same operands wherever an output is stored, so their
    bits are equal at every width in blocks of the same warps: past N % 16 and past M (whose rows and columns read
    the last channel and token), with more steps than warps (9216: 18 steps) and two token tiles; `fast` is the
    default on these shapes, at 3 bits in blocks of 4 warps below 16 steps (the *_fast_w4 kernels, other sums: the
    bound)."""
    tensors = synthetic("anyprec", n, k, seed=k + n)
    x = activations(m, k, seed=m)
    for bits in range(3, 9):  # the artifact's widths
        launch = kernels.anyprec_launch(tensors, x, bits, tc=True)
        assert launch.name.endswith("_fast_w4" if bits == 3 and k < 8192 else "_fast"), (bits, launch.name)
        if launch.name.endswith("_w4"):
            assert_within_tc_bound(tensors, x, bits, kernels.run(launch, "cpu").view(np.float16))
        fast = kernels.run(kernels.anyprec_launch(tensors, x, bits, tc=True, warps=kernels.ANYPREC_TC_WARPS), "cpu")
        checked = kernels.run(kernels.anyprec_launch(tensors, x, bits, tc=True, fast=False), "cpu")
        np.testing.assert_array_equal(fast, checked, err_msg=f"{bits} bits")
        if bits == 3:
            assert_within_tc_bound(tensors, x, bits, fast.view(np.float16))


def test_anyprec_takes_blocks_of_4_warps_where_8_would_have_a_step_each():
    """anyprec_tc_warps: the fast kernels up to 3 bits take blocks of 4 warps where 8 would leave a warp under two of
    the tile's K steps (512 columns a step up to 4 bits, 256 above), and 8 elsewhere; ANYPREC_TC_FEW off, 8 always."""
    few, warps = kernels.ANYPREC_TC_FEW_WARPS, kernels.ANYPREC_TC_WARPS
    assert (few, warps) == (4, 8)
    assert kernels.anyprec_tc_warps(4096, 3, True) == few  # 8 steps
    assert kernels.anyprec_tc_warps(7680, 3, True) == few  # 15
    assert kernels.anyprec_tc_warps(8192, 3, True) == warps  # 16: two each
    assert kernels.anyprec_tc_warps(14336, 3, True) == warps
    assert kernels.anyprec_tc_warps(1024, 1, True) == few
    assert kernels.anyprec_tc_warps(4096, 3, False) == warps  # the checked kernels come in one size
    assert kernels.anyprec_tc_warps(4096, 4, True) == warps  # 4 bits: tables in shared memory
    try:
        kernels.ANYPREC_TC_FEW = False
        assert kernels.anyprec_tc_warps(4096, 3, True) == warps
    finally:
        kernels.ANYPREC_TC_FEW = True


@needs_compiler
@pytest.mark.parametrize("m,n,k", [(1, 13, 1024), (4, 40, 3072), (17, 24, 2048), (9, 16, 7168)])
def test_anyprec_blocks_of_4_warps_match_the_emulation_within_the_bound(m, n, k):
    """The *_fast_w4 kernels (1 to 3 bits): within the bound, past N % 16 and past M, with warps of one step and of
    several (3072: 6 steps, 7168: 14, the next step's words in flight), one and two token blocks; their launch and
    shared memory are sized for 4 warps, and the sizes no kernel is built with are refused."""
    tensors = synthetic("anyprec", n, k, seed=k + n)
    x = activations(m, k, seed=m)
    launch = kernels.anyprec_launch(tensors, x, 3, tc=True)
    assert launch.name == f"anyprec_gemm_tc{8 if m <= 8 else ''}_3_fast_w4" and launch.block == 128
    assert launch.shared_mem == kernels.anyprec_tc_shared_bytes(3, 4) == 4 * 2 * 32 * 4 * 4
    out = kernels.run(launch, "cpu").view(np.float16)
    reference = assert_within_tc_bound(tensors, x, 3, out)
    assert np.mean(out == reference) > 0.9
    with pytest.raises(ValueError, match="blocks of 8 warps, and of 4"):
        kernels.anyprec_launch(tensors, x, 4, tc=True, warps=4)
    with pytest.raises(ValueError, match="blocks of 8 warps, and of 4"):
        kernels.anyprec_launch(tensors, x, 3, tc=True, warps=2)


def test_kernel_settings_come_from_the_environment_checked():
    """$QUANTKIT_KERNEL_SETTINGS sets the tunable switches at import (what gpu_check --bench-tuned runs the bench
    under) and tuning() reports them; an unknown name or a value of the wrong type is refused, naming it."""
    import os
    import subprocess
    import sys

    code = "from quantkit import kernels; import json; print(json.dumps(kernels.tuning()))"

    def run(settings: str, defines: str = "") -> subprocess.CompletedProcess:
        env = {**os.environ, "QUANTKIT_KERNEL_SETTINGS": settings, "QUANTKIT_NVRTC_DEFINES": defines}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)

    done = run('{"BULK_DECODE": true, "SPLITK_BLOCKS_MAX": 4}', "QK_SMALLM_AHEAD=6")
    assert done.returncode == 0, done.stderr
    tuning = json.loads(done.stdout)
    assert tuning["settings"]["BULK_DECODE"] is True and tuning["settings"]["SPLITK_BLOCKS_MAX"] == 4
    assert tuning["settings"]["ANYPREC_TC_FAST"] is True and tuning["defines"] == ["QK_SMALLM_AHEAD=6"]
    for name in ("WGMMA_TALL", "QSERVE_GEMM16"):  # by default chosen per launch
        assert tuning["settings"][name] is None
        for value in ("false", "null"):
            done = run(f'{{"{name}": {value}}}')
            assert done.returncode == 0 and json.loads(done.stdout)["settings"][name] == json.loads(value)
    for bad, says in [('{"BULK_DECODES": true}', "unknown kernel settings BULK_DECODES"),
                      ('{"SPLITK_BLOCKS_MAX": "4"}', "SPLITK_BLOCKS_MAX takes a int"),
                      ('{"WGMMA_TALL": 1}', "WGMMA_TALL takes a bool or null"),
                      ('{"QSERVE_GEMM16": 0}', "QSERVE_GEMM16 takes a bool or null"), ("[1]", "QUANTKIT_KERNEL")]:
        done = run(bad)
        assert done.returncode != 0 and says in done.stderr, done.stderr[-500:]


def pytest_under_defines(defines: str, selection: str):
    """This file's tests named by `selection` (pytest -k) in a process of their own whose kernels (NVRTC builds and
    the warp simulator alike) are built with `defines` (QUANTKIT_NVRTC_DEFINES)."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selection],
                          env={**os.environ, "QUANTKIT_NVRTC_DEFINES": defines}, capture_output=True, text=True)


def bench_module(name: str):
    """bench/NAME.py, imported: the benchmark scripts are not a package, and find one another on their folder."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parent.parent / "bench")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def test_gpu_check_benches_the_tuning_runs_fastest_configurations(tmp_path):
    """gpu_check --bench-tuned: no second bench where each tuning step's fastest was its default; otherwise the
    union of the steps' defines and settings (the small-M and M = 1024 knobs are disjoint)."""
    tuned_env = bench_module("gpu_check").tuned_env
    small, large = tmp_path / "best.json", tmp_path / "best_large.json"
    small.write_text(json.dumps({"config": "U8", "default": True, "defines": {"QK_SMALLM_AHEAD": 8},
                                 "settings": {"SPLITK_WARPS": 2048}}))
    large.write_text(json.dumps({"config": "W5L3", "default": True, "defines": {"QK_WGMMA_STAGES": 5}, "settings": {}}))
    assert tuned_env([small, large]) is None and tuned_env([]) is None
    tune = bench_module("smallm_tune")
    saved = kernels.tuning()["settings"]
    try:  # every configuration's settings are tunable switches of the right type
        for _, settings in (*tune.CONFIGS.values(), *tune.LARGE_CONFIGS.values()):
            kernels.apply_settings(settings)
    finally:
        kernels.apply_settings(saved)
    large.write_text(json.dumps({"config": "WIDE8", "default": False, "defines": {"QK_WGMMA_STAGES": 8,
                                 "QK_WGMMA_LEAD": 7}, "settings": {"WGMMA_WIDE": True}}))
    env = tuned_env([small, large])
    assert env["QUANTKIT_NVRTC_DEFINES"] == "QK_SMALLM_AHEAD=8 QK_WGMMA_STAGES=8 QK_WGMMA_LEAD=7"
    assert json.loads(env["QUANTKIT_KERNEL_SETTINGS"]) == {"SPLITK_WARPS": 2048, "WGMMA_WIDE": True}


def test_gpu_check_steps_leave_no_process_behind(tmp_path):
    """A step's children end with it (pytest-xdist's workers, the tuning's processes): here a sleep its shell left
    running in the background, which would otherwise outlive the step and share the GPU with the next one."""
    import time
    from pathlib import Path

    gpu_check = bench_module("gpu_check")
    results: list = []
    code = gpu_check.step("orphan", ["sh", "-c", "sleep 60 & echo $!"], tmp_path, results, limit=60)
    assert code == 0 and results[0][:2] == ("orphan", 0)
    pid = int((tmp_path / "gpu_check.log").read_text().split()[-1])

    def running() -> bool:  # a killed orphan is a zombie until its new parent reaps it: ended all the same
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    for _ in range(50):
        if not running():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the step's background sleep (pid {pid}) outlived it")


def test_gpu_check_exits_0_only_where_every_step_ran_and_passed():
    """The exit status took the largest step code, so a step killed by a signal (-11: negative) among passing ones
    exited 0; a skipped step (-1) did too. Only all-zero passes."""
    status = bench_module("gpu_check").exit_status
    assert status([("tests", 0, 1.0), ("bench", 0, 2.0)]) == 0
    for code in (1, 124, -1, -9, -11):
        assert status([("tests", 0, 1.0), ("bench", code, 2.0), ("tune", 0, 3.0)]) == 1, code


def test_gpu_check_spreads_tests_over_workers_only_with_xdist(monkeypatch):
    """The test steps take pytest-xdist's -n where it is installed (the H200's image has it) and more than one
    worker is asked for; without it, or with one, they run in one process as before."""
    import importlib.util

    gpu_check = bench_module("gpu_check")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "xdist" else None)
    assert gpu_check.xdist_args(8) == ["-n", "8"] and gpu_check.xdist_args(1) == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert gpu_check.xdist_args(8) == []


def test_gpu_check_validates_carried_artifacts_and_names_the_missing(tmp_path, monkeypatch):
    """gpu_check --artifacts DIR: each recipe's artifact in DIR is validated (no quantize on the device); a recipe
    without one fails its step by name instead of passing unseen."""
    import argparse

    gpu_check = bench_module("gpu_check")
    artifacts, out = tmp_path / "artifacts", tmp_path / "out"
    (artifacts / "qoq").mkdir(parents=True)
    out.mkdir()
    (artifacts / "qoq" / "config.json").write_text("{}")
    ran: list[list[str]] = []

    def step(name, cmd, out_dir, results, limit=300, env=None):
        ran.append(cmd)
        results.append((name, 0, 0.0))
        return 0

    monkeypatch.setattr(gpu_check, "step", step)
    results: list = []
    args = argparse.Namespace(recipes="qoq,qqq", artifacts=artifacts, kernel="sim", out=out)
    gpu_check.validate_recipes(args, tmp_path / "work", results, {})
    assert [cmd[3:5] for cmd in ran] == [["validate", str(artifacts / "qoq")]]
    assert [(name, code) for name, code, _ in results] == [("validate-qoq", 0), ("validate-qqq", 2)]


def test_tuning_picks_the_fastest_configuration_per_layout():
    """smallm_tune --best: per layout the fastest configuration that matches the emulation, the winners' knobs
    merged only where they agree and slow no layout they change; the default's where nothing beats it. Every
    configuration's scope names real layouts."""
    tune = bench_module("smallm_tune")
    layouts = {v.fmt for v in tune.variants()}
    assert all(set(fmts) <= layouts for fmts in tune.SCOPES.values()) and set(tune.SCOPES) <= set(tune.CONFIGS)
    labels = {v.fmt: v.label for v in tune.variants()}

    def run(config, times, ok=True):  # times: layout -> seconds of its one row
        rows = {f"{labels[f]}|4096x4096|1": t for f, t in times.items()}
        return {"config": config, "checked": {labels[f]: ok for f in times}, "seconds": rows, "threads": {}}

    default = run("U8", {"qserve": 10, "qqq": 10, "liquidquant": 10, "anyprec": 10})
    assert tune.fastest([default])["default"] and tune.fastest([default])["defines"] == {}
    runs = [default,
            run("QS-PC12", {"qserve": 8, "liquidquant": 10}),  # its late epilogue reaches LiquidQuant too
            run("LQQ-A10", {"liquidquant": 9}),
            run("AP-SMEM", {"anyprec": 7}, ok=False),  # fastest but wrong: never picked
            run("AP-HYBRID", {"anyprec": 9}),
            run("BULK", {"qserve": 7, "qqq": 11, "liquidquant": 6})]  # fastest for two layouts, slower for qqq
    best = tune.fastest(runs)
    assert best["formats"] == {"qserve": "QS-PC12", "qqq": "U8", "liquidquant": "LQQ-A10+QS-PC12",
                               "anyprec": "AP-HYBRID"}
    assert best["defines"] == {"QK_QSERVE_PC_AHEAD": 12, "QK_EPILOGUE_EARLY": 0, "QK_LQQ_AHEAD": 10,
                               "QK_AP_REG_GROUPS": 1}
    slower = [r if r["config"] != "QS-PC12" else run("QS-PC12", {"qserve": 8, "liquidquant": 11}) for r in runs]
    assert tune.fastest(slower)["formats"]["qserve"] == "U8"  # it would slow a layout its knobs reach
    assert not best["default"] and "BULK_DECODE" not in best["settings"]
    runs[-1]["seconds"][f"{labels['qqq']}|4096x4096|1"] = 9  # now no slower anywhere: it takes both its layouts
    best = tune.fastest(runs)
    assert best["formats"]["qserve"] == best["formats"]["liquidquant"] == "BULK" and best["settings"]["BULK_DECODE"]
    assert tune.fastest(runs[1:]) is None  # no default run: nothing to compare against


def test_tuning_never_picks_a_diagnostic_configuration():
    """A configuration timed only to learn what holds a kernel back (smallm_tune.DIAGNOSTIC: NOFENCE leaves out a
    fence the memory model asks for) is never the one to bench again, however fast; the next fastest is."""
    tune = bench_module("smallm_tune")
    assert tune.DIAGNOSTIC.issubset(tune.LARGE_CONFIGS)
    rows = [f"{v.label}|4096x4096|1024" for v in tune.variants(True)]

    def run(config, seconds):
        return {"config": config, "checked": {row.split("|")[0]: True for row in rows},
                "seconds": dict.fromkeys(rows, seconds), "threads": {}}

    default = next(iter(tune.LARGE_CONFIGS))
    best = tune.fastest([run(default, 10), run("NOFENCE", 5), run("OVERLAP", 8)], large=True)
    assert best["config"] == "OVERLAP" and best["defines"] == tune.LARGE_CONFIGS["OVERLAP"][0]
    assert best["defines"]["QK_WGMMA_RETIRE"] == 2
    assert tune.fastest([run(default, 10), run("NOFENCE", 5)], large=True)["default"]


def test_tuning_scopes_take_in_every_layout_their_knobs_reach():
    """A small-M configuration is timed only on the layouts of its scope, and --best merges winners on that
    promise: each layout whose kernel source reads one of its knobs is in its scope (QS-PC12's late epilogue reaches
    LiquidQuant too)."""
    import re

    tune = bench_module("smallm_tune")
    modules = {"qserve": "qserve_w4a8", "qqq": "qqq_w4a8", "liquidquant": "liquidquant_w4a8", "atom": "atom_w4a4",
               "anyprec": "anyprec_gemv"}
    sources = {fmt: (kernels.source_dir() / f"{module}.cu").read_text() for fmt, module in modules.items()}
    assert set(modules) == {v.fmt for v in tune.variants()}
    for name, (defines, _) in tune.CONFIGS.items():
        reached = {fmt for fmt, text in sources.items() if any(re.search(rf"\b{d}\b", text) for d in defines)}
        assert reached <= set(tune.scope(name) or modules), (name, reached)


def test_tuning_configurations_are_named_all_pending_or_one_by_one():
    """smallm_tune and build_kernels take --configs as names, "all", or "pending" (the default first, then the
    configurations not yet timed, each a real one whose knobs differ from the default's); an unknown name is an
    error that names it. The token counts each is checked at reach every kernel its knobs can change."""
    tune = bench_module("smallm_tune")
    assert tune.config_names("all") == list(tune.CONFIGS) and tune.config_names("all", True) == list(tune.LARGE_CONFIGS)
    pending = tune.config_names("pending")
    assert pending[0] == "U8" and pending[1:] == list(tune.PENDING) and set(tune.PENDING) <= set(tune.CONFIGS)
    assert all(tune.CONFIGS[name] != tune.CONFIGS["U8"] for name in tune.PENDING)
    assert tune.config_names("pending", True) == ["TMA-W8L6", *tune.LARGE_PENDING]
    assert tune.config_names("U8,AP-EARLY") == ["U8", "AP-EARLY"]
    with pytest.raises(ValueError, match="unknown configurations NOPE"):
        tune.config_names("U8,NOPE")
    # each configuration is checked before it is timed on the kernels of one token block and of two, the second
    # partial (LQQ-S1 and AP-EARLY change only the latter), and at M = 1024 on two token tiles, the second partial
    # (one 256-token block for TALL), and on two 256-token blocks, the last one's second half past M
    small = tune.CHECK_MS[False]
    assert any(m <= kernels.DECODE_MAX_M for m in small)
    assert any(kernels.DECODE_MAX_M < m < 16 for m in small)
    assert any(128 < m < 256 for m in tune.CHECK_MS[True]) and any(256 < m <= 384 for m in tune.CHECK_MS[True])


def test_hopper_kernel_is_the_default_only_once_its_threshold_is_set(monkeypatch):
    """WGMMA_MIN_M None: no launch takes a *_wgmma kernel unasked. Set, a launch that names no path takes it on a
    Hopper GPU from that many tokens, and a named path still wins; never on another GPU."""
    tensors = synthetic("qserve", 128, 256, seed=0, group=128)
    x, s_x = np.zeros((128, 256), dtype=np.int8), np.ones(128, dtype=np.float32)
    monkeypatch.setattr(kernels, "hopper_available", lambda: True)
    monkeypatch.setattr(kernels, "WGMMA_MIN_M", None)
    assert kernels.qserve_launch(tensors, x, s_x).name == "qserve_w4a8_tiled"
    monkeypatch.setattr(kernels, "WGMMA_MIN_M", 128)
    assert kernels.qserve_launch(tensors, x, s_x).name == "qserve_w4a8_wgmma"
    assert kernels.qserve_launch(tensors, x[:-1], s_x[:-1]).name == "qserve_w4a8_tiled"
    assert kernels.qserve_launch(tensors, x, s_x, tiled=True).name == "qserve_w4a8_tiled"
    assert kernels.qserve_launch(tensors, x, s_x, wgmma=False).name == "qserve_w4a8_tiled"
    monkeypatch.setattr(kernels, "hopper_available", lambda: False)
    assert kernels.qserve_launch(tensors, x, s_x).name == "qserve_w4a8_tiled"
    monkeypatch.undo()  # the real hopper_available: QUANTKIT_WGMMA=0 turns the kernels off
    monkeypatch.setenv("QUANTKIT_WGMMA", "0")
    assert not kernels.hopper_available()


def test_launches_take_the_large_m_path_by_m_and_shape(monkeypatch):
    monkeypatch.setattr(kernels, "hopper_available", lambda: False)  # the same on a Hopper GPU, with wgmma for tiled
    tensors = synthetic("qqq", 128, 256, seed=0)
    x, s_x = np.zeros((kernels.TILED_MIN_M, 256), dtype=np.int8), np.ones(kernels.TILED_MIN_M, dtype=np.float32)
    assert kernels.qqq_launch(tensors, x, s_x).name == "qqq_w4a8_tiled"
    assert kernels.qqq_launch(tensors, x[:-1], s_x[:-1]).name == "qqq_w4a8_gemm_pc"  # per channel
    assert kernels.qqq_launch(tensors, x, s_x, tiled=False).name == "qqq_w4a8_gemm_pc"
    narrow = synthetic("qqq", 64, 256, seed=0)  # N = 64: no whole block tile of 128 channels
    assert kernels.qqq_launch(narrow, x, s_x).name == "qqq_w4a8_gemm_pc"
    with pytest.raises(ValueError, match="N % 128 == 0"):
        kernels.qqq_launch(narrow, x, s_x, tiled=True)


def test_split_count_fills_the_gpu_only_when_tiles_are_few():
    from quantkit.kernels import split_count

    assert split_count(blocks=128, warps_per_copy=1, steps=128, partial_bytes=2048) == 16  # 4096 x 4096, M <= 16
    assert split_count(blocks=896, warps_per_copy=1, steps=128, partial_bytes=2048) == 2  # N = 28672
    assert split_count(blocks=128 * 64, warps_per_copy=1, steps=128, partial_bytes=2048) == 1  # M = 1024
    assert split_count(blocks=1, warps_per_copy=1, steps=20, partial_bytes=2048) == 2  # each split >= 8 steps
    assert split_count(blocks=1, warps_per_copy=1, steps=4096, partial_bytes=16384) == 4  # 3 x 16 KiB of partials


@needs_compiler
def test_qserve_group_kernel_wraps_bytes_as_the_reference():
    """Codes at 0 and 15 with the largest scales and zeros: every byte lane of q * s2 - z * s2 at its extremes."""
    tensors = extreme_qserve_group(64, 256, seed=7)
    x = activations(4, 256, seed=1)
    reference = emulate("qserve", tensors, x)
    out = kernels.gemm("qserve", tensors, reference.x_int8, reference.s_x)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_compiler
def test_simulator_fp16_rounding_is_round_to_nearest_even():
    """The simulator's float -> fp16 conversion (the epilogue's last step) agrees with numpy's on hard cases."""
    tensors = synthetic("qserve", 32, 128, seed=3)
    tensors["s1_scales"] = torch.full((32,), 1.0).half()
    tensors["s1_szeros"] = torch.zeros(32).half()
    x_int8 = np.zeros((3, 128), dtype=np.int8)
    x_int8[:, 0] = 1  # acc = code of column 0 of each channel: s_x then sets the product exactly
    s_x = np.array([2049.0 / 15, 65519.0 / 15, 6e-8], dtype=np.float32)  # ties, overflow edge, subnormals
    codes = qserve_layout.unpack_qweight(tensors["qweight"]).numpy().astype(np.float32)
    expected = ((codes[:, 0][None, :] * np.float32(1.0)) * s_x[:, None]).astype(np.float16)
    out = kernels.gemm("qserve", tensors, x_int8, s_x, np.zeros(3, dtype=np.float32))
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


@needs_compiler
def test_simulator_fp16_keeps_a_nan_a_nan():
    """A NaN from the float32 epilogue (here a NaN token scale) comes out of the simulator's float -> fp16
    conversion as a NaN, as from numpy's and the GPU's __float2half_rn, never as an infinity: the rounding edge cases
    above never reach the NaN branch, and a NaN read as an overflow would hide where it came from."""
    tensors = synthetic("qserve", 32, 128, seed=3)
    x_int8 = np.ones((2, 128), dtype=np.int8)
    s_x = np.array([np.nan, 0.5], dtype=np.float32)
    out = kernels.gemm("qserve", tensors, x_int8, s_x, np.zeros(2, dtype=np.float32))
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


@needs_compiler
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (7, 128, 192), (40, 64, 128)])
def test_liquidquant_kernel_matches_the_emulation(m, n, k):
    tensors = synthetic("liquidquant", n, k, seed=m + n + k)
    x = activations(m, k, seed=m)
    reference = emulate("liquidquant", tensors, x)
    out = kernels.gemm("liquidquant", tensors, reference.x_int8, reference.s_x)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (9, 128, 256), (20, 64, 384)])
def test_qqq_kernel_matches_the_emulation(m, n, k, grouped):
    tensors = synthetic("qqq", n, k, seed=m + n + k, group=128 if grouped else None)
    x = activations(m, k, seed=m)
    reference = emulate("qqq", tensors, x)
    out = kernels.gemm("qqq", tensors, reference.x_int8, reference.s_x)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize("m,n,groups", [(1, 16, 1), (6, 32, 2), (19, 48, 3)])
def test_atom_kernel_matches_the_emulation(m, n, groups):
    from quantkit.emulate import emulate_atom

    tensors = synthetic("atom", n, 128 * groups + 128, seed=m + n)
    x = activations(m, 128 * groups + 128, seed=n)
    reference = emulate_atom(tensors, x, 4, 0.9)
    out = kernels.atom_gemm(tensors, reference.x_codes, reference.s_x)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize("groups", [1, 4, 6])
@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("per_round", [None, 1, 4])
def test_atom_split_groups_match_the_emulation(groups, splits, per_round):
    """Copies of the small-M warp taking turns at the steps (a group of 128 INT4 columns or half the outliers, 16
    bytes a row a lane, in an order the MMAs' A and B share), their terms added in group order at each round's end:
    the emulation's bits, with rounds of one group, rounds that end part-way and step counts no split count divides,
    over two token tiles, the second of 3 rows."""
    from quantkit.emulate import emulate_atom

    m, n, k = 19, 32, 128 * groups + 128
    tensors = synthetic("atom", n, k, seed=groups + splits)
    x = activations(m, k, seed=splits)
    reference = emulate_atom(tensors, x, 4, 0.9)
    launch = kernels.atom_launch(tensors, reference.x_codes, reference.s_x, tiled=False, splits=splits,
                                 per_round=per_round)
    assert launch.block == 32 * splits and launch.args[-2:] == [splits, per_round or groups]
    assert launch.shared_mem == ((per_round or groups) + kernels.ATOM_EXTRA_SLOTS) * 16 * 16 * 4
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


@needs_compiler
@pytest.mark.parametrize("m", [1, 5])
def test_atom_small_m_kernel_writes_every_output_once_per_round(m):
    """The shared memory of a round holds exactly min(M, 16) x 16 outputs a step: at M = 1 and 5 each of 4 rounds
    of one group, over 2 copies, gives the emulation's bits (the twin fills every slot with NaN before a round, so an
    output summed from a slot that no lane wrote would show)."""
    from quantkit.emulate import emulate_atom

    n, k = 48, 128 * 4 + 128
    tensors = synthetic("atom", n, k, seed=m)
    x = activations(m, k, seed=m + 1)
    reference = emulate_atom(tensors, x, 4, 0.9)
    launch = kernels.atom_launch(tensors, reference.x_codes, reference.s_x, tiled=False, splits=2, per_round=1)
    assert launch.shared_mem == (1 + kernels.ATOM_EXTRA_SLOTS) * 16 * m * 4
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


@pytest.mark.parametrize(("groups", "m", "per_round"), [(31, 1, 31), (31, 16, 31), (111, 6, 111), (111, 7, 56),
                                                       (111, 16, 37), (0, 16, 1)])
def test_atom_rounds_fit_the_shared_memory_in_equal_parts(groups, m, per_round):
    assert kernels.atom_rounds(groups, m) == per_round
    assert (per_round + kernels.ATOM_EXTRA_SLOTS) * kernels.atom_step_bytes(m) <= kernels.ATOM_MAX_SHARED


@pytest.mark.parametrize("per_round", [0, 45])
def test_atom_rounds_past_the_shared_memory_are_refused(per_round):
    """A round of no group would never end, and one of 45 at M = 16 would need more than 48 KiB of slots."""
    tensors = synthetic("atom", 16, 256, seed=0)
    with pytest.raises(ValueError, match="holds 1 to 44 groups at M=16"):
        kernels.atom_launch(tensors, np.zeros((16, 256), dtype=np.int64), np.ones((16, 2), dtype=np.float32),
                            tiled=False, per_round=per_round)


@needs_compiler
def test_int4_mma_as_two_int8_mmas_gives_the_same_sums():
    """Hopper has no INT4 tensor cores, so there the Atom kernels run each INT4 m16n8k64 MMA as two INT8 m16n8k32
    MMAs on sign-extended codes: over random fragments (every code, accumulators that wrap), the warp simulator's
    PTX-ISA model of the INT4 MMA and the rewrite agree on every int32 output."""
    import ctypes

    lib = kernels.host_library()
    lib.qk_int4_as_int8_mismatches.restype = ctypes.c_int
    assert lib.qk_int4_as_int8_mismatches(ctypes.c_int(200), ctypes.c_uint(12345)) == 0


def _permute_bytes(a: int, b: int, selector: int, sign_mode: bool) -> int:
    """Byte i of the result is byte (nibble i & 7) of the 8 bytes b:a, a the low four (PTX ISA prmt.b32, default
    mode; CUDA __byte_perm); in prmt, a nibble's bit 3 set replaces the byte by its sign bit in all 8 bits."""
    both = (b << 32 | a).to_bytes(8, "little")
    out = []
    for i in range(4):
        nibble = selector >> (4 * i) & 0xF
        byte = both[nibble & 7]
        out.append((0xFF if byte & 0x80 else 0x00) if sign_mode and nibble & 8 else byte)
    return int.from_bytes(bytes(out), "little")


@needs_compiler
def test_simulator_byte_permutes_are_the_ptx_and_cuda_definitions():
    """The warp simulator's prmt and byte_perm, which every kernel's decode runs through on the CPU, are the PTX ISA's
    prmt.b32 and CUDA's __byte_perm: hand-worked cases, then random words and selectors with every nibble's bit 3
    drawn (no kernel sets it today, so no kernel test would show a twin that ignored prmt's sign mode)."""
    import ctypes

    lib = kernels.host_library()
    for fn in (lib.qk_prmt, lib.qk_byte_perm):
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32] * 3
    a, b = 0x11223384, 0x55667788
    assert lib.qk_prmt(a, b, 0x3210) == a and lib.qk_prmt(a, b, 0x7654) == b
    assert lib.qk_prmt(a, b, 0xFFFF3210) == a  # only the low 16 bits select
    assert lib.qk_prmt(a, b, 0x0008) == 0x848484FF  # byte 0 (0x84) negative: its sign, 0xFF, then byte 0 three times
    assert lib.qk_prmt(a, b, 0x000D) == 0x84848400  # byte 5 (0x77, of b) positive: 0x00
    assert lib.qk_byte_perm(a, b, 0x000D) == 0x84848477  # no sign mode: bit 3 ignored, byte 5 itself
    rng = np.random.default_rng(3)
    for a, b, sel in rng.integers(0, 2**32, (2000, 3), dtype=np.uint64).tolist():
        assert lib.qk_prmt(a, b, sel) == _permute_bytes(a, b, sel, sign_mode=True), (hex(a), hex(b), hex(sel))
        assert lib.qk_byte_perm(a, b, sel) == _permute_bytes(a, b, sel, sign_mode=False), (hex(a), hex(b), hex(sel))


@needs_compiler
def test_atom_split_groups_fold_in_group_order():
    """Groups 0 and 1 contribute +H and -H exactly, group 2 a small t: in group order the sum is t, in any other
    order t is lost against H. Copies 0-2 of the warp take one group each, so only terms added in group order give
    the emulation's output, within a round and across rounds."""
    from quantkit.emulate import emulate_atom_quantized

    m, n, k = 5, 16, 128 * 3 + 128
    tensors = synthetic("atom", n, k, seed=7)
    w4 = tensors["weight_int4"].clone()
    w4[:, 64:128] = w4[:, 0:64]  # group 1's weights are group 0's, with its scales
    tensors["weight_int4"] = w4
    scales = tensors["scale_int4"].clone()
    scales[1] = scales[0]
    tensors["scale_int4"] = scales
    rng = np.random.default_rng(0)
    codes = np.zeros((m, k), dtype=np.int64)
    codes[:, :128] = rng.integers(-7, 8, (m, 128))
    codes[:, 128:256] = -codes[:, :128]
    codes[:, 256:384] = rng.integers(-7, 8, (m, 128))
    s_x = np.array([[4096.0, 4096.0, 1e-3, 1.0]] * m, dtype=np.float32)
    reference = emulate_atom_quantized(tensors, codes, s_x)
    assert np.abs(reference.out.astype(np.float32)).max() < 1.0  # t survived: H cancelled before it was added
    for per_round in (None, 1):  # the three groups' terms in one round, and in three
        launch = kernels.atom_launch(tensors, codes, s_x, tiled=False, splits=3, per_round=per_round)
        np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


def test_atom_splits_fill_the_gpu_for_decode():
    """A decode launch of an Llama-3-8B-sized Atom linear gets enough warps to keep the memory system busy: about
    SPLITK_WARPS, each copy taking at least ATOM_MIN_STEPS steps (33: 31 groups and the outliers' two halves), and a
    block holds every group's terms of its one token in one round."""
    n, k = 4096, 4096
    tensors = {"weight_int4": torch.zeros((n, (k - 128) // 2), dtype=torch.uint8),
               "weight_int8": torch.zeros((n, 128), dtype=torch.int8),
               "scale_int4": torch.zeros((31, 4 * n), dtype=torch.float16),
               "scale_int8": torch.zeros(4 * n, dtype=torch.float16)}
    launch = kernels.atom_launch(tensors, np.zeros((1, k), dtype=np.int64), np.ones((1, 32), dtype=np.float32))
    assert launch.name == "atom_w4a4_gemm" and launch.grid == (256, 1) and launch.block == 32 * 8
    assert launch.grid[0] * launch.block // 32 == kernels.SPLITK_WARPS
    assert launch.args[-1] == 31 and launch.shared_mem == (31 + kernels.ATOM_EXTRA_SLOTS) * 16 * 4


@needs_compiler
@pytest.mark.parametrize("m,k", [(1, 96), (3, 1024), (9, 2080), (2, 576)])
def test_anyprec_kernel_matches_the_emulation_at_every_width(m, k):
    from quantkit.emulate import emulate_anyprec

    tensors = synthetic("anyprec", 13, k, seed=k)  # 13 channels: a block of 8 warps and a partial one
    x = activations(m, k, seed=m)
    for bits in range(3, 9):
        _, reference = emulate_anyprec(tensors, x, bits)
        out = kernels.anyprec_gemv(tensors, x, bits, tc=False)
        np.testing.assert_array_equal(out.view(np.uint16), reference.view(np.uint16), err_msg=f"{bits} bits")


@needs_compiler
@pytest.mark.parametrize("m,splits", [(12, 3), (16, 2), (9, 1)])
def test_liquidquant_two_block_kernel_matches_the_emulation(m, splits, monkeypatch):
    """liquidquant_w4a8_gemm16 (two token blocks a tile, where LIQUIDQUANT_GEMM16 takes it) gives the emulation's
    bits, split or not, with the second block partly past M."""
    monkeypatch.setattr(kernels, "LIQUIDQUANT_GEMM16", True)
    tensors = synthetic("liquidquant", 128, 448, seed=m, group=64)
    x = activations(m, 448, seed=splits)
    reference = emulate("liquidquant", tensors, x)
    launch = kernels.liquidquant_launch(tensors, reference.x_int8, reference.s_x, splits=splits)
    warps, slices = kernels.LQQ_TILE_WARPS, kernels.LQQ16_SLICES
    assert launch.name == "liquidquant_w4a8_gemm16" and launch.grid == (128 // (16 * slices * warps), 1)
    assert launch.shared_mem == kernels.splitk_shared(splits, 32 * warps * 8 * slices * 4, kernels.SPLITK_RED)
    np.testing.assert_array_equal(kernels.run(launch, "cpu"), reference.out.view(np.uint16))


def test_liquidquant_two_slice_launch_is_sized_for_32_channels_a_warp(monkeypatch):
    """QK_LQQ16_SLICES = 2 (the default): liquidquant_w4a8_gemm16's warps take 32 channels each, so the launch has
    half the blocks and twice the split-K partials a copy, and refuses an N that its warps do not tile. (The kernel's
    own slice mapping runs on the device only, in test_liquidquant_gpu_kernel_matches_the_emulation; the warp
    simulator's twin does not depend on it.)"""
    monkeypatch.setattr(kernels, "LIQUIDQUANT_GEMM16", True)
    monkeypatch.setattr(kernels, "LQQ16_SLICES", 2)
    tensors = synthetic("liquidquant", 128, 448, seed=3, group=64)
    reference = emulate("liquidquant", tensors, activations(12, 448, seed=4))
    launch = kernels.liquidquant_launch(tensors, reference.x_int8, reference.s_x, splits=3)
    warps = kernels.LQQ_TILE_WARPS
    assert launch.grid == (128 // (32 * warps), 1)
    assert launch.shared_mem == kernels.splitk_shared(3, 32 * warps * 8 * 2 * 4, kernels.SPLITK_RED)
    decode = kernels.liquidquant_launch(tensors, reference.x_int8[:1], reference.s_x[:1], splits=3)
    assert decode.name == "liquidquant_w4a8_gemm8" and decode.grid == (128 // (16 * warps), 1)  # one slice
    monkeypatch.setattr(kernels, "LQQ_TILE_WARPS", 4)
    wide = synthetic("liquidquant", 192, 448, seed=3, group=64)
    with pytest.raises(ValueError, match="needs N a multiple of 128; got N=192"):
        kernels.liquidquant_launch(wide, reference.x_int8, reference.s_x)


@needs_compiler
@pytest.mark.parametrize("fmt", ["liquidquant", "anyprec", "qserve"])
def test_validate_runs_the_decode_kernels_too(fmt, monkeypatch):
    """`matches_emulation` (quantkit validate's kernel check) from 16 tokens also runs the first token alone, which
    takes the decode kernels (liquidquant_w4a8_gemm8, anyprec_gemm_tc8_*), and says so in its labels."""
    n, k = 128, 512
    tensors = synthetic(fmt, n, k, seed=2, group=64 if fmt == "liquidquant" else None)
    if fmt == "anyprec":
        tensors = {key: value for key, value in tensors.items() if key in ("qweight", "lut3")}
    ran, run = [], kernels.run
    monkeypatch.setattr(kernels, "run", lambda launch, device="cpu": ran.append(launch.name) or run(launch, device))
    assert kernels.matches_emulation(fmt, tensors, activations(16, k, seed=1), "cpu")
    decode = {"liquidquant": "liquidquant_w4a8_gemm8", "anyprec": "anyprec_gemm_tc8_3", "qserve": "qserve_w4a8_gemm_pc"}
    assert decode[fmt] in ran and ran[-1] == decode[fmt]
    assert any("1 token" in label for label in kernels.path_labels(fmt, n, k, "cpu", 16))
    assert not any("1 token" in label for label in kernels.path_labels(fmt, n, k, "cpu", 8))


def assert_within_tc_bound(tensors, x, bits, out):
    from quantkit.emulate import anyprec_tc_bound, emulate_anyprec

    reference = emulate_anyprec(tensors, x, bits)[1]
    bound = anyprec_tc_bound(tensors, x, bits, reference)
    error = np.abs(out.astype(np.float64) - reference)
    assert np.all(error <= bound), f"{bits} bits: {np.sum(error > bound)} outputs past the bound"
    return reference


@needs_compiler
@pytest.mark.parametrize("m,n,k", [(1, 13, 96), (5, 130, 1024), (17, 64, 2080), (9, 40, 8736), (3, 24, 4128)])
def test_anyprec_tensor_core_kernel_matches_the_emulation_within_its_bound(m, n, k):
    """The tensor-core kernel's lane code (the weights as the A operand from nibble-pair lookups, the activations as
    B from byte permutes of the runs; at 4 bits up to 8 tokens pair mode's lookups of adjacent columns, the runs'
    words as B; the warps' sums met in warp order): within `anyprec_tc_bound` of the
    emulation at every width, past N % 16, past 8 and 16 tokens, past the last whole chunk (2080: a chunk of 32
    columns), with more steps than warps (8736: 18 steps of 512 columns) and rows of K / 32 words not a multiple of
    4 (4128: word loads one by one)."""
    tensors = synthetic("anyprec", n, k, seed=k)
    x = activations(m, k, seed=m)
    for bits in range(3, 9):
        launch = kernels.anyprec_launch(tensors, x, bits, tc=True, fast=False)
        assert launch.name == f"anyprec_gemm_tc{8 if m <= 8 else ''}_{bits}"
        assert launch.grid == (-(-n // 16), 1, -(-m // 16))
        out = kernels.run(launch, "cpu").view(np.float16)
        reference = assert_within_tc_bound(tensors, x, bits, out)
        assert np.mean(out == reference) > 0.9  # mostly the same fp16: only rounding differs


@needs_compiler
@pytest.mark.parametrize("knob", ["QK_AP_REG_GROUPS=0", "QK_AP_REG_GROUPS=1", "QK_AP_FMA_SHIFTS=1",
                                  "QK_AP_TC_WARPS=4", "QK_AP_TC_WARPS=2"])
def test_anyprec_3bit_knobs_keep_the_bits_or_the_bound(knob, tmp_path):
    """At 3 bits (an artifact's narrowest width) the tensor-core kernels look codes up in tables held in registers;
    QK_AP_REG_GROUPS=0 (bench/smallm_tune.py's AP-SMEM) puts both channel groups' in shared memory, as above 3 bits,
    each lookup's address one byte permute, and 1 (AP-HYBRID) the second group's; QK_AP_FMA_SHIFTS=1 (AP-FMA)
    bit-transposes with multiply-adds instead of shifts and ORs. Where the A fragments are the same, the outputs must
    be the same bits; the kernels of one token block under AP-SMEM take pair mode (tc_pairs: the MMAs see the columns
    in another order), which must land within the bound, and so must blocks of 4 or 2 warps (QK_AP_TC_WARPS: other
    float32 sums), whose launch and shared memory quantkit.kernels must size as the kernels do. A warp simulator
    built with the knob, in a process of its own, against this one's (checked and fast kernels, one and two token
    blocks)."""
    import os
    import subprocess
    import sys

    cases = [(1, 40, 2080, False), (9, 24, 2048, True), (3, 16, 1024, True)]
    xs = {k: activations(m, k, seed=m) for m, _, k, _ in cases}
    for k, x in xs.items():
        np.save(tmp_path / f"x{k}.npy", x)
    script = f"""
import numpy as np
from quantkit import kernels
from quantkit.kernel_bench import synthetic
for m, n, k, fast in {cases!r}:
    x = np.load("{tmp_path}/x%d.npy" % k)
    tensors = synthetic("anyprec", n, k, seed=k)
    launch = kernels.anyprec_launch(tensors, x, 3, tc=True, fast=fast)
    warps = kernels.anyprec_tc_warps(k, 3, fast)
    assert launch.block == 32 * warps
    for bits in range(1, 9):
        assert kernels.anyprec_tc_shared_bytes(bits, warps) == \
            kernels.host_library().anyprec_tc_shared_bytes(bits, warps), bits
    np.save("{tmp_path}/out_%d_%d.npy" % (m, k), kernels.run(launch, "cpu"))
"""
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "QUANTKIT_NVRTC_DEFINES": knob},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for m, n, k, fast in cases:
        tensors = synthetic("anyprec", n, k, seed=k)
        out, theirs = kernels.run(kernels.anyprec_launch(tensors, xs[k], 3, tc=True, fast=fast), "cpu"), \
            np.load(tmp_path / f"out_{m}_{k}.npy")
        if (knob == "QK_AP_REG_GROUPS=0" and m <= 8) or knob.startswith("QK_AP_TC_WARPS"):  # pair mode, other sums
            assert_within_tc_bound(tensors, xs[k], 3, theirs.view(np.float16))
        else:
            np.testing.assert_array_equal(out, theirs, err_msg=f"M={m}, K={k}")


@needs_compiler
def test_anyprec_tc_bound_catches_one_wrong_weight():
    """The bound is tight enough to matter: one table entry off by its neighbour's distance moves an output past it."""
    from quantkit.emulate import anyprec_tc_bound, emulate_anyprec

    tensors = synthetic("anyprec", 8, 2048, seed=3)
    x = activations(4, 2048, seed=5)
    reference = emulate_anyprec(tensors, x, 3)[1]
    wrong = dict(tensors)
    lut = tensors["lut3"].clone()
    lut[2, 5] = lut[2, 4]
    wrong["lut3"] = lut
    out = kernels.anyprec_gemv(wrong, x, 3, tc=True).astype(np.float64)
    assert np.any(np.abs(out - reference) > anyprec_tc_bound(tensors, x, 3, reference))


@needs_gpu
@pytest.mark.parametrize(("fmt", "group", "splits", "m"), [
    ("qserve", None, 16, 9), ("qserve", 128, 5, 9), ("qqq", None, 8, 9), ("qqq", 128, 3, 9), ("liquidquant", 64, 4, 9),
    ("liquidquant", 64, 4, 3),  # liquidquant_w4a8_gemm8
    ("qqq", None, 16, 9), ("qqq", 128, 16, 9),  # SPLITK_RED_PLAN's 16 copies a QQQ block, meeting in one slot
])
def test_split_k_gpu_kernel_matches_the_emulation(fmt, group, splits, m):
    """The split-K path on the device: the copies' partial sums through shared memory, at split counts up to the
    largest the launch chooses."""
    n, k = 128, 2048
    tensors = synthetic(fmt, n, k, seed=splits, group=group)
    x = activations(m, k, seed=splits)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   splits=splits)
    np.testing.assert_array_equal(kernels.run(launch, "cuda"), reference.out.view(np.uint16))


@needs_gpu
@pytest.mark.skipif(not kernels.hopper_available(), reason="needs a CUDA device of compute capability 9.0 "
                    "(thread-block clusters) and CuPy")
@pytest.mark.parametrize(("fmt", "group", "m", "k", "splits", "zsplit"), CLUSTER_CASES)
def test_cluster_gpu_kernels_match_the_emulation(fmt, group, m, k, splits, zsplit, monkeypatch):
    """The *_z2 / *_z4 kernels on the device: the tile's blocks one cluster, the others' sums written into the
    leader's shared memory before the cluster barrier, the emulation's bits (bench/smallm_tune.py's CLUSTER)."""
    monkeypatch.setattr(kernels, "SPLITK_CLUSTER", True)
    tensors = synthetic(fmt, 128, k, seed=m + k + zsplit, group=group)
    x = activations(m, k, seed=zsplit)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   splits=splits, zsplit=zsplit, bulk=False)
    assert launch.cluster == zsplit
    np.testing.assert_array_equal(kernels.run(launch, "cuda"), reference.out.view(np.uint16))


@needs_gpu
@pytest.mark.parametrize(("group", "m", "k", "splits"), QSERVE16_CASES)
def test_qserve_two_tile_gpu_kernel(group, m, k, splits, monkeypatch):
    """qserve_w4a8_gemm16 / _pc16 on the device: each warp's two tiles, the emulation's bits (QS-S2)."""
    monkeypatch.setattr(kernels, "QSERVE_GEMM16", True)
    tensors = synthetic("qserve", 192, k, seed=m + k, group=group)
    x = activations(m, k, seed=m)
    reference = emulate("qserve", tensors, x)
    launch = kernels.qserve_launch(tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   splits=splits, tiled=False)
    assert launch.name.endswith("16")
    np.testing.assert_array_equal(kernels.run(launch, "cuda"), reference.out.view(np.uint16))


@needs_gpu
def test_timeline_runs_on_the_device(tmp_path):
    """bench/timeline.py on the device: every warp of each stamped kernel stamps its start, the phases come in
    order (a warp's first MMAs after its start, its loop's end after them, the last store after the last loop), the
    instrumented kernels still give the emulation's output, and the read floor is stamped too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(repo / "bench" / "timeline.py"), "--shapes", "1024x2048", "--ms",
                           "1,9", "--reps", "3", "--json", str(tmp_path / "t.json")],
                          env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    floor, stamped = rows[0], rows[1:]
    assert floor["kernel"] == "stream_read (floor)" and floor["summary"]["loop"] is not None
    assert {r["label"] for r in stamped} == {v.label for v in bench_module("smallm_tune").variants()
                                            if v.fmt != "atom"} and len(stamped) == 12
    for r in stamped:
        s = r["summary"]
        blocks = np.prod([int(d) for d in r["grid"].strip("()").split(",") if d.strip()])
        assert r["matches"] is True and s["warps"] == blocks * r["block"] // 32, r
        assert s["start"][0] <= s["first"][0] <= s["loop"][0] and s["stored"][1] >= s["loop"][1], r
        assert s["first_cycles"] > 0 and s["sms"] >= 1, r
    assert "| stream_read (floor) | 1024 x 2048 |" in done.stdout


@needs_gpu
@pytest.mark.parametrize("group", [None, 128])
def test_qserve_gpu_kernel_matches_the_emulation(group):
    tensors = synthetic("qserve", 256, 512, seed=11, group=group)
    x = activations(24, 512, seed=2)
    reference = emulate("qserve", tensors, x)
    out = kernels.gemm("qserve", tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                       device="cuda")
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH to compile the device code to PTX")
@pytest.mark.parametrize("name,mma", [("qserve_w4a8", "m16n8k32"), ("liquidquant_w4a8", "m16n8k32"),
                                      ("qqq_w4a8", "m16n8k16"), ("atom_w4a4", "m16n8k64"), ("anyprec_gemv", None)])
def test_device_code_compiles_for_sm80(name, mma, tmp_path):
    """The GPU half of each kernel (what the warp simulator does not build) compiles, with its MMAs."""
    import subprocess

    src = kernels.source_dir()
    ptx = tmp_path / f"{name}.ptx"
    done = subprocess.run(["nvcc", "-arch=sm_80", "-std=c++17", "-ptx", str(src / f"{name}.cu"), "-o", str(ptx)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if mma is None:  # the Any-Precision GEMV's warp reduction, and its tensor-core kernel's fp16 MMA
        text = ptx.read_text()
        assert "shfl.sync.bfly" in text and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text
        return
    kind = "s4.s4" if mma == "m16n8k64" else "s8.s8"
    text = ptx.read_text()
    assert f"mma.sync.aligned.{mma}.row.col.s32.{kind}.s32" in text
    if name.endswith("w4a8"):  # the large-M kernel: operands staged by cp.async, activations read by ldmatrix
        assert f".entry {name}_tiled(" in text
        assert "cp.async.cg.shared.global" in text and "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH to compile the device code for sm_90")
@pytest.mark.parametrize("name", kernels.MODULES)
def test_device_code_for_hopper_keeps_its_arrays_in_registers(name, tmp_path):
    """Built for sm_90 (the H100/H200 the bench runs on), no kernel spills or indexes an array in local memory: a
    stack frame would put its fragments in slow device memory."""
    import re

    log = ptxas_log(["-arch=sm_90", str(kernels.source_dir() / f"{name}.cu")], tmp_path)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert frames and all(f == ("0", "0", "0") for f in frames), log


@needs_gpu
@pytest.mark.parametrize(("fmt", "group"), LARGE_M_LAYOUTS)
def test_large_m_gpu_kernel_matches_the_emulation(fmt, group):
    """The tiled kernels on the device: cp.async stages, ldmatrix and the barriers between them (what the warp
    simulator cannot check), over several blocks each way and more K steps than stages."""
    m, n, k = 300, 384, 1024
    tensors = synthetic(fmt, n, k, seed=m, group=group)
    x = activations(m, k, seed=n)
    reference = emulate(fmt, tensors, x)
    out = kernels.gemm(fmt, tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                       device="cuda", tiled=True)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_hopper
@pytest.mark.parametrize(("fmt", "group"), LARGE_M_LAYOUTS)
@pytest.mark.parametrize("m", [1, 300])
@pytest.mark.parametrize("block", ["", "wide", "tall"])
def test_hopper_gpu_kernel_matches_the_emulation(fmt, group, m, block, monkeypatch):
    """The *_wgmma kernels (`wide`: the 256-channel *_wgmma2; `tall`: the 256-token *_wgmma_tall) on the device,
    built by NVRTC for sm_90a: what the simulator's model of wgmma (operand layouts, descriptor, swizzle) and of the
    asynchronous ring stands for, over several blocks each way and more K steps than stages."""
    monkeypatch.setattr(kernels, "WGMMA_WIDE", block == "wide")
    monkeypatch.setattr(kernels, "WGMMA_TALL", block == "tall")
    n, k = 512 if block == "wide" else 384, 1024
    tensors = synthetic(fmt, n, k, seed=m, group=group)
    x = activations(m, k, seed=n)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   wgmma=True)
    assert launch.name.endswith({"wide": "_wgmma2", "tall": "_wgmma_tall"}.get(block, "_wgmma"))
    out = kernels.run(launch, "cuda")
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@pytest.mark.cpasync
@needs_hopper
def test_hopper_gpu_kernels_with_cp_async_copies_match_the_emulation():
    """QK_WGMMA_TMA=0 (in a process of its own, whose kernels are built with it): the *_wgmma kernels with each
    activation tile by cp.async, fenced into the async proxy before each step's barrier, give the emulation's bits, as
    test_hopper_gpu_kernel_matches_the_emulation checks the default's tensor copies (encoded by the driver, 64-byte
    swizzle, zeros past M: only the device runs them; the simulator's twins copy the tiles themselves)."""
    done = pytest_under_defines("QK_WGMMA_TMA=0", "test_hopper_gpu_kernel_matches_the_emulation")
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]


@needs_hopper
@pytest.mark.skipif(not kernels.WGMMA_STREAMK, reason="the kernels are built without QK_WGMMA_STREAMK here; "
                    "test_hopper_gpu_streamk_knob runs this test in a process built with it")
@pytest.mark.parametrize(("fmt", "group"), LARGE_M_LAYOUTS)
@pytest.mark.parametrize(("m", "n"), [(700, 512), (1024, 6144)])
def test_streamk_tail_gpu_kernel_matches_the_emulation(fmt, group, m, n, monkeypatch):
    """QK_WGMMA_STREAMK on the device (the meeting's atomics, fences and flags, which the simulator runs in order):
    12 tiles on the GPU's SMs, each split in two, and 6144 x K at M = 1024 (on 132 SMs 60 of 192 tiles split), give
    the emulation's bits; replayed on the same workspace (its flags lowered by each launch), the same again."""
    monkeypatch.setattr(kernels, "WGMMA_TALL", True)
    reference, launch = hopper_case(fmt, group, m, n, 1024, (m, n))
    start = [a for a in launch.args if not isinstance(a, kernels.TensorMap)][-3]
    assert launch.name.endswith("_wgmma_tall") and start < (n // 128) * -(-m // 256)  # some tile split
    call = kernels.upload(launch)
    for _ in range(3):
        call()
        np.testing.assert_array_equal(call.result().view(np.uint16), reference.out.view(np.uint16))


@needs_hopper
def test_hopper_gpu_streamk_knob():
    """The stream-K tail's device test in a process whose kernels are built with QK_WGMMA_STREAMK=1 (TALL-SK)."""
    done = pytest_under_defines("QK_WGMMA_STREAMK=1", "test_streamk_tail_gpu_kernel_matches_the_emulation")
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]


# (layout, group, M, N, K, splits): one warp a tile walking K = 4096 (16 or 64 chunks through 2 slots), ranges that
# start inside groups, a full token tile, two token tiles; splits None: the launch's own.
BULK_GPU_CASES = [
    *((fmt, group, *case) for fmt, cases in (
        ("qserve", [(1, 256, 4096, 1), (3, 96, 1664, 5), (16, 64, 1024, 4), (20, 64, 512, 2)]),
        ("qqq", [(1, 256, 4096, 1), (3, 128, 1664, 5), (20, 64, 512, 2)]),
    ) for group in (None, 128) for case in cases),
    *(("liquidquant", 64, *case) for case in [(1, 256, 4096, None), (5, 128, 1344, 3), (8, 64, 4096, 1)]),
]


@pytest.mark.bulk
@needs_hopper
@pytest.mark.parametrize(("fmt", "group", "m", "n", "k", "splits"), BULK_GPU_CASES)
def test_bulk_gpu_kernel_matches_the_emulation(fmt, group, m, n, k, splits):
    """The bulk kernels on the device (their mbarriers and bulk copies, which the simulator runs as plain copies):
    the emulation's bits, with the launch's own chunks and slots."""
    tensors = synthetic(fmt, n, k, seed=m + k, group=group)
    x = activations(m, k, seed=n)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   splits=splits, bulk=True)
    assert launch.name == {"qserve": "qserve_w4a8_bulk", "qqq": "qqq_w4a8_bulk",
                           "liquidquant": "liquidquant_w4a8_bulk8"}[fmt]
    np.testing.assert_array_equal(kernels.run(launch, "cuda"), reference.out.view(np.uint16))


@needs_gpu
@pytest.mark.parametrize(("fmt", "group"), [("qqq", None), ("qqq", 128), ("qserve", None), ("qserve", 128)])
def test_block_split_gpu_kernel_matches_the_emulation(fmt, group):
    """QServe's and QQQ's register kernels with K split across 4 blocks a tile on the device: the emulation's bits,
    twice in a row from the same workspace, which the last block of each tile leaves zeroed again."""
    n, k, m = 256, 4096, 3
    tensors = synthetic(fmt, n, k, seed=7, group=group)
    x = activations(m, k, seed=8)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   splits=4, zsplit=4, bulk=False)
    call = kernels.upload(launch)
    for _ in range(2):
        call()
        np.testing.assert_array_equal(call.result(), reference.out.view(np.uint16))
    import cupy

    assert not cupy.asnumpy(call.args[-2]).any() and not cupy.asnumpy(call.args[-1]).any()


def test_sass_loop_counter_takes_the_longest_backward_branch():
    """bench/sass_loops.py (the README's main-loop counts): per kernel its instructions, and the opcodes between the
    target and the source of its longest backward branch, predicated instructions included."""
    sass_loops = bench_module("sass_loops")
    alu, main_loop, parse = sass_loops.alu, sass_loops.main_loop, sass_loops.parse
    sass = """
        Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;   /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/               @P0 IMAD R3, R2, R2, RZ ;
        /*0030*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0040*/              @!P1 BRA 0x20 ;
        /*0050*/                   BRA 0x10 ;
        /*0060*/                   EXIT ;
    """
    kernels = parse(sass)
    assert list(kernels) == ["k"] and len(kernels["k"]) == 7
    assert main_loop(kernels["k"]) == {"LDG": 1, "IMAD": 1, "IADD3": 1, "BRA": 2}
    assert alu(main_loop(kernels["k"])) == 1  # IADD3; IMAD goes to the FMA pipe
    assert main_loop(kernels["k"][:3]) is None
    bound = sass_loops.pipe_bound
    assert bound(main_loop(kernels["k"])) == "issue"  # 5 instructions against 2 cycles of ALU and of IMAD
    assert bound({"PRMT": 3, "HMMA": 1}) == "ALU" and bound({"IMAD": 4, "LOP3": 1, "HMMA": 1}) == "IMAD"


def test_wgmma_hazard_check_finds_writes_to_registers_in_flight():
    """bench/sass_loops.py wgmma_hazards: an instruction that writes an A-fragment register or an accumulator of a
    wgmma before the WARPGROUP.DEPBAR that retires it is reported, across the loop's back edge too; a write after
    the retiring DEPBAR, or to another register, is not; DEPBAR.LE gsb0, 0x1 retires a group only once a later one
    has closed."""
    sass_loops = bench_module("sass_loops")

    def hazards(body: str) -> list[str]:
        lines = [f"        /*{16 * k:04x}*/ {text} ;" for k, text in enumerate(body.strip().splitlines())]
        return sass_loops.wgmma_hazards(sass_loops.parse("Function : k\n" + "\n".join(lines))["k"])

    igmma = "IGMMA.64x128x32.S8.S8 R24, R88, gdesc[UR4], R24, gsb0"
    assert hazards(f"LOP3.LUT R88, R1, 0xf, RZ, 0xc0, !PT\n{igmma}\nWARPGROUP.DEPBAR.LE gsb0, 0x0\n"
                   "LOP3.LUT R88, R1, 0xf, RZ, 0xc0, !PT") == []
    # A fragments R88..R91, accumulators R24..R87 (64 registers: m64n128 int32 over 128 threads)
    assert len(hazards(f"{igmma}\nLOP3.LUT R91, R1, 0xf, RZ, 0xc0, !PT\nWARPGROUP.DEPBAR.LE gsb0, 0x0")) == 1
    assert len(hazards(f"{igmma}\nFADD R24, R1, R2\nWARPGROUP.DEPBAR.LE gsb0, 0x0")) == 1
    assert len(hazards(f"{igmma}\nIMAD.WIDE R22, R1, 0x4, RZ\nWARPGROUP.DEPBAR.LE gsb0, 0x0")) == 0  # R22, R23
    assert len(hazards(f"{igmma}\nIMAD.WIDE R23, R1, 0x4, RZ\nWARPGROUP.DEPBAR.LE gsb0, 0x0")) == 1  # R23, R24
    assert hazards(f"{igmma}\nLDS.128 R92, [R1]\nSTS [R88], R1\nISETP.GE.AND P0, PT, R88, R1, PT\n"
                   "WARPGROUP.DEPBAR.LE gsb0, 0x0") == []  # reads are no writes
    assert len(hazards(f"{igmma}\nLDS.64 R86, [R1]\nWARPGROUP.DEPBAR.LE gsb0, 0x0")) == 1
    assert len(hazards(f"{igmma}\nLDSM.16.M88.4 R85, [R1]\nWARPGROUP.DEPBAR.LE gsb0, 0x0")) == 1  # R85..R88
    # reading the sums before they are retired is as wrong (an accumulator spilled, or an epilogue moved up); reading
    # the A fragments is not
    assert len(hazards(f"{igmma}\nI2F R2, R30\nWARPGROUP.DEPBAR.LE gsb0, 0x0")) == 1
    assert len(hazards(f"{igmma}\nSTL.128 [R1+0x10], R84\nWARPGROUP.DEPBAR.LE gsb0, 0x0")) == 1
    assert len(hazards(f"{igmma}\nLDG.E R2, desc[UR4][R86.64]\nWARPGROUP.DEPBAR.LE gsb0, 0x0")) == 1
    assert hazards(f"{igmma}\nSTS.64 [R1], R22\nIADD3 R2, R88, R89, RZ\nWARPGROUP.DEPBAR.LE gsb0, 0x0\nI2F R2, R30") \
        == []
    assert hazards(f"{igmma}\nLDSM.16.M88.2 R92, [R1]\nWARPGROUP.DEPBAR.LE gsb0, 0x0") == []
    # wait_group 1 straight after the commit leaves this wgmma running into the next step, where the loop's
    # back edge reaches the fragments' load before any later group closes
    looped = f"LDS.128 R88, [R1]\n{igmma}\nWARPGROUP.DEPBAR.LE gsb0, 0x1\n@!P0 BRA 0x0"
    assert len(hazards(looped)) == 1
    assert hazards(looped.replace("0x1", "0x0")) == []


def ptxas_log(args: list[str], tmp_path) -> str:
    """nvcc -cubin -Xptxas -v with `args` (architecture, defines, source): ptxas's report of every kernel."""
    import subprocess

    done = subprocess.run(["nvcc", "-std=c++17", "-cubin", "-Xptxas", "-v", *args, "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stderr


def kernel_resources(log: str, kernel: str) -> tuple[tuple[str, str, str], int]:
    """From a ptxas_log, kernel `kernel`'s (stack frame, spill stores, spill loads) bytes and its registers."""
    import re

    entry = log[log.index(f"'{kernel}'"):]
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", entry)
    registers = re.search(r"Used (\d+) registers", entry)
    assert frame and registers, entry[:500]
    return frame.groups(), int(registers.group(1))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH to compile the device code for sm_90")
@pytest.mark.parametrize(("kernel", "knob"), [("qserve_w4a8_gemm_pc", "QK_QSERVE_PC_AHEAD=10"),
                                              ("qserve_w4a8_gemm_pc", "QK_QSERVE_PC_AHEAD=12 QK_EPILOGUE_EARLY=0"),
                                              ("liquidquant_w4a8_gemm8", "QK_LQQ_AHEAD=10")])
def test_decode_kernels_take_more_steps_without_spilling(kernel, knob, tmp_path):
    """The decode kernels with registers to spare (qserve_w4a8_gemm_pc, which carries no group code: 120 registers at
    8 steps a round; liquidquant_w4a8_gemm8: 114) put more steps' loads in flight under their own knob
    (bench/smallm_tune.py's QS-PC10, QS-PC12 and LQQ-A10) within 128 registers and no stack. At 12 steps the
    epilogue's parameters are loaded after the K loop (QK_EPILOGUE_EARLY = 0): held from before it, they spill."""
    module = "_".join(kernel.split("_")[:2])  # qserve_w4a8, liquidquant_w4a8
    defines = [f"-D{d}" for d in knob.split()]
    log = ptxas_log(["-arch=sm_90", *defines, str(kernels.source_dir() / f"{module}.cu")], tmp_path)
    frame, registers = kernel_resources(log, kernel)
    assert frame == ("0", "0", "0") and registers <= 128, log


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH to compile the device code for sm_90a")
@pytest.mark.parametrize(("module", "kernel"), [("qserve_w4a8", "qserve_w4a8_bulk"),
                                                ("liquidquant_w4a8", "liquidquant_w4a8_bulk8"),
                                                ("qqq_w4a8", "qqq_w4a8_bulk")])
def test_bulk_device_code_uses_the_copy_engine(module, kernel, tmp_path):
    """The bulk kernels build for sm_90a with their bulk copies completing on mbarriers whose waits time out, no stack
    frame, and at most 80 registers (nothing waits in registers: the register kernels need 111-128)."""
    import subprocess

    src = kernels.source_dir() / f"{module}.cu"
    log = ptxas_log(["-gencode=arch=compute_90a,code=sm_90a", "-DQK_WGMMA", str(src)], tmp_path)
    frame, registers = kernel_resources(log, kernel)
    assert frame == ("0", "0", "0") and registers <= 80, log
    ptx = subprocess.run(["nvcc", "-arch=compute_90a", "-DQK_WGMMA", "-std=c++17", "-ptx", str(src), "-o", "-"],
                         capture_output=True, text=True).stdout
    body = ptx[ptx.index(f".entry {kernel}("):]
    end = body.find(".entry", 1)
    body = body if end < 0 else body[:end]  # this kernel's alone
    for op in ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "mbarrier.arrive.expect_tx",
               "mbarrier.try_wait.parity", "fence.proxy.async.shared::cta", "mma.sync.aligned.m16n8k",
               "%globaltimer", "trap;"):  # a wait past MBAR_TIMEOUT_NS traps rather than hang the device
        assert op in body, op


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:  # CuPy absent, or its NVRTC library missing
        return False


@pytest.mark.skipif(not _nvrtc_available(), reason="needs CuPy with NVRTC (pip install 'quantkit[cuda]'); no GPU")
@pytest.mark.parametrize("name", kernels.MODULES)
def test_nvrtc_builds_every_module(name):
    """Each kernel module builds with NVRTC exactly as quantkit.kernels builds it on a GPU (compile_module), which
    needs no GPU: NVRTC's headers and defaults are not nvcc's, so a module nvcc builds can still fail there (NVRTC
    13.0 refuses generic lambdas unless device code is the default), and the sm_90a build holds every wgmma and
    bulk kernel."""
    archs = ["sm_90", *([kernels.HOPPER_ARCH] if name in kernels.HOPPER_MODULES else [])]
    for arch in archs:
        assert kernels.compile_module(name, arch)[:4] == b"\x7fELF", arch


@pytest.mark.skipif(not _nvrtc_available(), reason="needs CuPy with NVRTC (pip install 'quantkit[cuda]'); no GPU")
def test_timeline_stamps_are_built_only_under_their_knob():
    """QK_TIMELINE compiles the phase stamps (kernels/qk_timeline.cuh) and their qk_timeline pointer, which
    bench/timeline.py sets, into the small-M kernels and the stamped read floor; every other build has neither
    (its stamps are nothing), and the floor quantkit bench builds still compiles without the header."""
    from quantkit.kernel_bench import STREAM_READ

    timeline = bench_module("timeline")
    for name in ("qserve_w4a8", "liquidquant_w4a8", "qqq_w4a8", "anyprec_gemv"):
        assert kernels.module_defines(name, (timeline.DEFINE,)) == (timeline.DEFINE,), name
    assert b"qk_timeline" in kernels.compile_module("qserve_w4a8", "sm_90", (timeline.DEFINE,))
    assert b"qk_timeline" not in kernels.compile_module("qserve_w4a8", "sm_90")
    floor = kernels.compile_source(timeline.floor_source(), "stream_read.cu", "sm_90", (timeline.DEFINE,))
    assert b"qk_timeline" in floor and b"stream_read" in floor
    plain = kernels.compile_source(STREAM_READ, "stream_read.cu", "sm_90")
    assert b"stream_read" in plain and b"qk_timeline" not in plain


def test_timeline_summary_reads_the_stamps():
    """bench/timeline.py's summary of one launch: each phase's median and latest warp in us from the earliest
    start, phases no warp reached as None, the SMs and the most warps on one, the cycles from a warp's start, and
    the median over launches."""
    timeline = bench_module("timeline")
    stamps = np.zeros((3, timeline.WARPS, timeline.SLOTS), np.uint64)
    t0 = 10**12
    for block in range(2):  # block 2 never ran its warps' stamps (as a kernel whose warps returned early)
        for warp in range(4):
            slot = stamps[block, warp]
            start = t0 + 100 * block + 10 * warp
            slot[0], slot[1], slot[2] = start, start + 1000, start + 3000  # start, first, loop
            if warp == 0:  # copy 0 alone adds the block's sums and stores
                slot[3], slot[5] = start + 3500, start + 4000
            slot[timeline.SM_SLOT] = 7 * block
            slot[timeline.CLOCK_SLOT], slot[timeline.CLOCK_SLOT + 1] = 5000, 5000 + 1700 + warp
            slot[timeline.CLOCK_SLOT + 2] = 5000 + 5100
    s = timeline.summarize(stamps)
    assert s["warps"] == 8 and s["sms"] == 2 and s["warps_per_sm"] == 4
    assert s["start"] == [0.065, 0.13] and s["first"] == [1.065, 1.13] and s["loop"] == [3.065, 3.13]
    assert s["reduced"] == [3.55, 3.6] and s["stored"] == [4.05, 4.1] and s["met"] is None
    assert s["first_cycles"] == 1701.5 and s["loop_cycles"] == 5100 and s["resolution_ns"] == 10
    later = timeline.summarize(np.where(stamps > t0, stamps + 1000, stamps))  # the same launch, the stores later
    later["stored"] = None
    both = timeline.combine([s, later, s])
    assert both["first"] == s["first"] and both["stored"] == s["stored"] and both["warps"] == 8
    assert timeline.combine([later])["stored"] is None and timeline.combine([later, s])["stored"] == s["stored"]
    row = {"kernel": "k", "n": 1, "k": 2, "m": 1, "grid": "(2, 1, 1)", "block": 128, "event_us": 9.5, "summary": s}
    text = timeline.table([row])
    assert "| 3.55 / 3.60 |" in text and "| - |" in text and "1702, 5100" in text
    with pytest.raises(ValueError, match="QK_TIMELINE"):
        timeline.summarize(np.zeros_like(stamps))


@pytest.mark.skipif(not _nvrtc_available(), reason="needs CuPy with NVRTC (pip install 'quantkit[cuda]'); no GPU")
def test_kernels_built_ahead_are_the_ones_a_run_loads(tmp_path, monkeypatch):
    """bench/build_kernels.py puts each build where quantkit.kernels looks for it (module_cubin's cubin_path): once
    for the knobs that several configurations share, a module's build keeping only the knobs it reads (QServe's and
    LiquidQuant's leave QQQ's build the default one), the sm_90a build for the wgmma configurations alone; a second
    run finds them all built, and a module that does not exist is refused."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, str(repo / "bench" / "build_kernels.py"), "--modules", "qqq_w4a8", "--configs",
           "U8,QS-PC10", "--large-configs", "TMA-W8L7", "--defines", "QK_LQQ_AHEAD=10 QK_SMALLM_AHEAD=6"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    built = {path.name for path in (tmp_path / "kernels").iterdir()}
    assert kernels.module_defines("qqq_w4a8", ("QK_QSERVE_PC_AHEAD=10", "QK_SMALLM_AHEAD=6")) == ("QK_SMALLM_AHEAD=6",)
    wanted = {kernels.cubin_path("qqq_w4a8", arch, defines).name for arch, defines in [
        ("sm_90", ()), (kernels.HOPPER_ARCH, ()), (kernels.HOPPER_ARCH, ("QK_WGMMA_LEAD=7",)),
        ("sm_90", ("QK_SMALLM_AHEAD=6",)), (kernels.HOPPER_ARCH, ("QK_SMALLM_AHEAD=6",))]}
    assert len(wanted) == 5 and built == wanted, (built, wanted)
    assert "qqq_w4a8 sm_90 [built-in, U8, QS-PC10]" in first.stdout and "sm_90 [TMA-W8L7]" not in first.stdout
    assert "qqq_w4a8 sm_90 [--defines]" in first.stdout
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout.count("cached") == 5 and "built in" not in second.stdout
    bad = subprocess.run([*cmd[:2], "--modules", "nope"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown modules nope" in bad.stderr


# The Hopper ring's knobs (QK_WGMMA_STAGES, QK_WGMMA_LEAD) other than the default that a tuning run may pick: the
# deepest ring that two blocks an SM fit, copies one step behind the slot being read; and copies one step ahead in
# the shallowest ring whose slots hold the 256-channel kernel's staged outputs.
RING_KNOBS = ["QK_WGMMA_STAGES=8 QK_WGMMA_LEAD=7", "QK_WGMMA_STAGES=4 QK_WGMMA_LEAD=1"]


@needs_compiler
@pytest.mark.parametrize(("defines", "tests"), [
    *((knobs, "hopper_path_matches or mirror_the_kernels") for knobs in RING_KNOBS),
    ("QK_LQQ_TILE_WARPS=4", "liquidquant and not bulk or split_k"),  # four warps a LiquidQuant block, as before
    ("QK_EPILOGUE_EARLY=0", "split_k_matches or qserve_kernel_matches or liquidquant_kernel_matches or block_split"),
    ("QK_LQQ16_SLICES=1", "liquidquant and (two_block or split_k)"),  # 16 channels a warp from 9 tokens, as before
    # the decode kernels' parameters loaded after the split-K meeting (QServe per group, QQQ per channel,
    # LiquidQuant from 9 tokens), as before; and QQQ per group's loaded before it too
    ("QK_EPILOGUE_MID=0", "split_k_matches or kernel_matches_the_emulation or block_split or two_block"),
    ("QK_EPILOGUE_MID_QQQ_GROUP=1", "qqq and (split_k_matches or kernel_matches_the_emulation or block_split)"),
    ("QK_WGMMA_STREAMK=1", "hopper_path_matches or streamk_tail or mirror_the_kernels"),  # TALL-SK
    # other look-aheads of the decode kernels (bench/smallm_tune.py's QS-PC10, LQQ-A10 and the like), whose rounds
    # divide few step counts: the twins walk their steps through the kernels' pipelined_steps in those rounds
    ("QK_SMALLM_AHEAD=6 QK_QSERVE_PC_AHEAD=10 QK_QSERVE16_AHEAD=3 QK_LQQ_AHEAD=10 QK_ATOM_AHEAD=2",
     "(split_k_matches or kernel_matches_the_emulation or two_block or two_tile_launch or block_split) and not bulk"),
    # the register kernels' copies storing their sums for copy 0 to add (smallm_tune's NO-RED), as before RED: the
    # twins meet through the kernels' splitk_post and splitk_collect either way
    ("QK_SPLITK_RED=0", "split_k or kernel_matches_the_emulation or two_block or two_tile_launch or block_split"),
], ids=["ring-8-7", "ring-4-1", "lqq-four-warps", "epilogue-late", "lqq-one-slice", "epilogue-after",
        "epilogue-mid-qqq-group", "streamk-tail", "look-ahead", "no-red"])
def test_compile_time_knobs_keep_the_bits(defines, tests):
    """Under each tuning knob (a warp simulator built with the same defines, in a process of its own), the kernels
    still give the emulation's bits and quantkit.kernels sizes their launches from the compiled policies. The
    simulator runs each step's wgmmas as late as the ring allows, so a copy into a slot still being read would show
    (running them after the copy at LEAD = STAGES - 1 fails these tests)."""
    done = pytest_under_defines(defines, f"({tests}) and not knobs_keep")  # never this test again
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:]
    if "QK_WGMMA_STREAMK=1" in defines:  # the tests that skip without it (-ra lists why) ran: the defines reached them
        assert "built without QK_WGMMA_STREAMK" not in done.stdout, done.stdout[-3000:]


@pytest.mark.skipif(shutil.which("nvcc") is None or bench_module("sass_loops").find_cuobjdump() is None,
                    reason="needs nvcc on PATH to compile the device code for sm_90a, and cuobjdump with nvdisasm (the "
                    "dev extra's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm) to read its SASS")
@pytest.mark.parametrize("defines", ["", *RING_KNOBS, "QK_WGMMA_RETIRE=0", "QK_WGMMA_RETIRE=2", "QK_WGMMA_TMA=0",
                                     "QK_WGMMA_TMA=0 QK_WGMMA_RETIRE=2", "QK_WGMMA_STREAMK=1"])
@pytest.mark.parametrize("name", ["qserve_w4a8", "liquidquant_w4a8", "qqq_w4a8"])
def test_hopper_device_code_pipelines_its_wgmmas(name, defines, tmp_path):
    """The *_wgmma kernels build for sm_90a with wgmma.mma_async, keep their accumulators and fragments in
    registers (no stack frame, at most 128 registers so that two blocks of 256 threads share an SM; the 256-token
    *_wgmma_tall, one block an SM, at most 255), and ptxas does
    not serialize the wgmmas (which it does, with a warning, when other instructions touch their registers while
    they are in flight); under each ring setting, each other retirement of a step's wgmmas and the tensor copies
    too. In the SASS no instruction writes a register of a wgmma in flight (the simulator cannot see that; the H200
    did, as wrong rows), and the main loop fences its copies into the async proxy (a MEMBAR) unless the activation
    tiles come by tensor copies (UTMALDG), which need no fence. With the stream-K tail (QK_WGMMA_STREAMK) the
    256-token kernels, their 128 sums live through the meeting and the epilogue, may spill up to 16 bytes there, but
    none in the main loop."""
    import subprocess

    src = kernels.source_dir()
    knobs = [f"-D{d}" for d in defines.split()]
    log = ptxas_log(["-gencode=arch=compute_90a,code=sm_90a", "-DQK_WGMMA", *knobs, str(src / f"{name}.cu")], tmp_path)
    assert "serialized" not in log, log
    # 2 blocks of 256 threads an SM, or 1 of 512; the 256-token kernel 1 of 256, with 128 accumulators a thread
    streamk = "QK_WGMMA_STREAMK=1" in defines
    for kernel, most in ((f"{name}_wgmma", 128), (f"{name}_wgmma2", 128), (f"{name}_wgmma_tall", 255)):
        frame, registers = kernel_resources(log, kernel)
        spill = streamk and kernel.endswith("_tall")
        assert (max(map(int, frame)) <= 16 if spill else frame == ("0", "0", "0")) and registers <= most, log
    sass_loops = bench_module("sass_loops")
    sass = sass_loops.parse(sass_loops.sass_of(name, True, defines.split(), sass_loops.find_cuobjdump()))
    tma = "QK_WGMMA_TMA=0" not in defines  # the activation tiles by tensor copies: no proxy fence (MEMBAR) a step
    for kernel in (f"{name}_wgmma", f"{name}_wgmma2", f"{name}_wgmma_tall"):
        assert any(i.opcode == "IGMMA" for i in sass[kernel]), kernel
        assert sass_loops.wgmma_hazards(sass[kernel]) == [], kernel
        loop = sass_loops.main_loop(sass[kernel])
        assert (loop["MEMBAR"] == 0) == tma and (loop["UTMALDG"] > 0) == tma, (kernel, loop)
        assert loop["LDL"] == loop["STL"] == 0, (kernel, loop)
    ptx = subprocess.run(["nvcc", "-arch=compute_90a", "-DQK_WGMMA", *knobs, "-std=c++17", "-ptx",
                          str(src / f"{name}.cu"), "-o", "-"], capture_output=True, text=True).stdout
    assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8" in ptx
    assert ("cp.async.bulk.tensor.2d" in ptx) == tma and "fence.proxy.async.shared::cta" in ptx


@needs_gpu
@pytest.mark.parametrize("m,two", [(40, False), (5, False), (12, True)])  # 4, 1 and 2 token blocks a tile
def test_liquidquant_gpu_kernel_matches_the_emulation(m, two, monkeypatch):
    monkeypatch.setattr(kernels, "LIQUIDQUANT_GEMM16", two)
    tensors = synthetic("liquidquant", 256, 512, seed=5)
    x = activations(m, 512, seed=3)
    reference = emulate("liquidquant", tensors, x)
    out = kernels.gemm("liquidquant", tensors, reference.x_int8, reference.s_x, device="cuda")
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_gpu
@pytest.mark.parametrize("grouped", [False, True])
def test_qqq_gpu_kernel_matches_the_emulation(grouped):
    tensors = synthetic("qqq", 256, 512, seed=9, group=128 if grouped else None)
    x = activations(24, 512, seed=4)
    reference = emulate("qqq", tensors, x)
    out = kernels.gemm("qqq", tensors, reference.x_int8, reference.s_x, device="cuda")
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_gpu
@pytest.mark.parametrize(("tiled", "m", "splits", "per_round"),
                         [(False, 20, 1, None), (False, 20, 3, None), (False, 1, 3, 2), (False, 20, 5, 1),
                          (True, 300, None, None)])
def test_atom_gpu_kernel_matches_the_emulation(tiled, m, splits, per_round):
    """Atom's kernels on the device; the small-M one with its groups' terms in one round and in several (barriers
    between a round's puts and its sums, and before the slots are refilled: what the simulator cannot check)."""
    from quantkit.emulate import emulate_atom

    tensors = synthetic("atom", 192, 128 * 6 + 128, seed=1)
    x = activations(m, 128 * 6 + 128, seed=6)
    reference = emulate_atom(tensors, x, 4, 0.9)
    launch = kernels.atom_launch(tensors, reference.x_codes, reference.s_x, tiled=tiled, splits=splits,
                                 per_round=per_round)
    np.testing.assert_array_equal(kernels.run(launch, "cuda"), reference.out.view(np.uint16))


def test_products_of_two_fp16_values_are_exact_in_float32():
    """Why the Any-Precision kernel may fuse its multiply-adds: an fp16 activation times an fp16 table entry has at
    most 22 significant bits and an exponent well inside float32's range, so the product is exact and an FMA rounds
    the same as a float32 multiply then add (the warp simulator computes the latter, the GPU the former)."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, (2, 200_000), dtype=np.uint64).astype(np.uint16)
    a, b = bits.view(np.float16)
    extremes = np.array([65504, -65504, 6.1035e-05, 5.96e-08, -5.96e-08, 1.0009766, 2047, 0], dtype=np.float16)
    a, b = np.concatenate([a, np.repeat(extremes, 8)]), np.concatenate([b, np.tile(extremes, 8)])
    finite = np.isfinite(a) & np.isfinite(b)
    a, b = a[finite].astype(np.float64), b[finite].astype(np.float64)
    np.testing.assert_array_equal((a.astype(np.float32) * b.astype(np.float32)).astype(np.float64), a * b)


@needs_gpu
def test_anyprec_gpu_kernel_matches_the_emulation():
    from quantkit.emulate import emulate_anyprec

    tensors = synthetic("anyprec", 61, 2080, seed=2)  # the last block of 8 channels is partial
    x = activations(11, 2080, seed=8)
    for bits in range(3, 9):
        _, reference = emulate_anyprec(tensors, x, bits)
        out = kernels.anyprec_gemv(tensors, x, bits, device="cuda", tc=False)
        np.testing.assert_array_equal(out.view(np.uint16), reference.view(np.uint16), err_msg=f"{bits} bits")


@needs_gpu
@pytest.mark.parametrize("k,m", [(1024, 20), (4096, 20), (2080, 20), (4096, 5), (2080, 1), (8736, 3)])
def test_anyprec_tensor_core_gpu_kernel_is_within_its_bound_and_deterministic(k, m):
    """On the device: within the bound at every width, and the same bits on every call (the warps' sums meet in
    shared memory in warp order), with 20 tokens (both n8 blocks of a tile, and a second tile), up to 8 (the
    one-block kernels, tables in registers at 3 bits, the next step's words loaded during this one's), K past a
    whole step (2080) and warps of several steps (8736)."""
    tensors = synthetic("anyprec", 300, k, seed=k)
    x = activations(m, k, seed=1)
    for bits in range(3, 9):
        call = kernels.upload(kernels.anyprec_launch(tensors, x, bits, tc=True))
        call()
        first = call.result().copy()
        call()
        np.testing.assert_array_equal(call.result(), first, err_msg=f"{bits} bits: not deterministic")
        assert_within_tc_bound(tensors, x, bits, first.view(np.float16))


@needs_gpu
@pytest.mark.parametrize("k,m", [(4096, 1), (4096, 8), (1024, 20), (9216, 3)])
def test_anyprec_fast_gpu_kernels_give_the_checked_kernels_bits(k, m):
    """On the device, the *_fast kernels (unchecked loads, the next step's words loaded during this step's word 2 or
    3, past N and M the last channel's and token's) give the checked kernels' bits at every width: 300 channels
    (a partial tile), one and two token blocks, and warps of several steps (9216: 18 steps)."""
    tensors = synthetic("anyprec", 300, k, seed=k + m)
    x = activations(m, k, seed=m)
    for bits in range(3, 9):
        fast = kernels.upload(kernels.anyprec_launch(tensors, x, bits, tc=True, fast=True,
                                                     warps=kernels.ANYPREC_TC_WARPS))
        checked = kernels.upload(kernels.anyprec_launch(tensors, x, bits, tc=True, fast=False))
        fast()
        checked()
        np.testing.assert_array_equal(fast.result(), checked.result(), err_msg=f"{bits} bits")


_bench = __import__("quantkit.kernel_bench", fromlist=["VARIANTS"])


@needs_compiler
@pytest.mark.parametrize("variant", _bench.VARIANTS + _bench.with_paths(_bench.VARIANTS), ids=lambda v: v.label)
def test_every_bench_variant_launches_and_matches_the_emulation(variant):
    """What `quantkit bench` times is the kernel the tests check: each variant's launch (each path of `--paths
    all` too), on a small shape, gives the emulation's output in the warp simulator."""
    n, k, m = 128, 256, 5
    tensors = synthetic(variant.fmt, n, k, seed=1, group=variant.group)
    launch = assert_bench_launch_matches(variant, tensors, m, n, k, seed=2)
    if variant.path in ("tiled", "tensor cores", "wgmma"):
        ending = {"tiled": "_tiled", "tensor cores": f"_tc8_{variant.bits}", "wgmma": "_wgmma"}[variant.path]  # m 5
        assert launch.name.endswith(ending)
    elif variant.path is not None:
        assert not launch.name.endswith(("_tiled", "_tc", "_wgmma"))


def assert_bench_launch_matches(variant, tensors, m, n, k, seed):
    """`quantkit bench`'s launch of `variant` at M tokens, run in the warp simulator, against the emulation from the
    launch's own inputs (Atom: the same reordered codes and scales; Any-Precision's tensor cores within the bound)."""
    from quantkit.kernel_bench import emulated_out, variant_launch

    launch = variant_launch(variant, tensors, m, k, seed=seed)
    out = kernels.run(launch, "cpu").view(np.float16)
    assert out.shape == (m, n) and np.isfinite(out).all()
    if launch.name.startswith("anyprec_gemm_tc"):
        assert_within_tc_bound(tensors, launch.args[0].view(np.float16), variant.bits, out)
    else:
        np.testing.assert_array_equal(out.view(np.uint16), emulated_out(variant.fmt, tensors, launch, variant.bits))
    return launch


def test_bench_needs_a_gpu_and_says_so():
    if kernels.cuda_available():
        pytest.skip("this machine has a GPU: the refusal is what a CPU-only machine sees")
    from helpers import cli

    result = cli("bench")
    assert result.exit_code == 2
    assert "needs a CUDA device and CuPy (pip install 'quantkit[cuda]')" in " ".join(result.output.split())


def test_bench_shapes_are_named_sets_or_ones_own_and_refused_with_the_reason():
    """--shapes: a named set (every shape a multiple of 128), or NxK,NxK,... of one's own; anything else is refused
    before anything runs, even on a machine without a GPU, naming the sets and the rule."""
    from helpers import cli

    from quantkit.kernel_bench import SHAPE_MULTIPLE, SHAPE_SETS, parse_shapes

    assert parse_shapes("llama3-8b") == ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    assert all(n % SHAPE_MULTIPLE == 0 and k % SHAPE_MULTIPLE == 0 for shapes in SHAPE_SETS.values()
               for n, k in shapes)
    assert parse_shapes("4096x14336, 384X640") == ((4096, 14336), (384, 640))
    # sets mix with shapes of one's own, each shape once; a trailing comma is nothing
    assert parse_shapes("llama3-8b,") == parse_shapes("llama3-8b")
    assert parse_shapes("4096x4096,llama3-8b") == ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336))
    for bad, says in (("llama9", "neither a shape set"), ("4096x100", "multiples of 128"), ("0x128", "positive"),
                      (",", "no shapes")):
        with pytest.raises(ValueError, match=says):
            parse_shapes(bad)
    result = cli("bench", "--shapes", "4096x100")
    assert result.exit_code == 2 and "multiples of 128" in " ".join(result.output.split())


@needs_compiler
def test_every_bench_variant_takes_a_shape_of_ones_own():
    """A shape of one's own that is a multiple of 128 but of no power of two (384 x 640): every layout's kernel, as
    `quantkit bench` launches it, gives the emulation's output in the warp simulator."""
    n, k, m = 384, 640, 5
    for variant in _bench.VARIANTS:
        tensors = synthetic(variant.fmt, n, k, seed=2, group=variant.group)
        assert_bench_launch_matches(variant, tensors, m, n, k, seed=3)


def test_bench_table_computes_rates_and_speedups():
    from rich.console import Console

    from quantkit.kernel_bench import READ_FLOOR, Row, Variant, render

    rows = [Row(4096, 4096, 16, "cuBLAS FP16 (torch.matmul)", 100e-6, 2 * 4096 * 4096),
            Row(4096, 4096, 16, READ_FLOOR, 10e-6, 4096 * 4096 // 2),
            Row(4096, 4096, 16, "QServe W4A8 per channel", 25e-6, 4096 * 4096 // 2,
                variant=Variant("QServe W4A8 per channel", "qserve"))]
    assert rows[2].tops == pytest.approx(2 * 16 * 4096 * 4096 / 25e-6 / 1e12)
    assert rows[2].gbps == pytest.approx(4096 * 4096 / 2 / 25e-6 / 1e9)
    console = Console(width=250, record=True)
    console.print(render(rows, bandwidth=3000.0, device="test GPU"))
    text = console.export_text()
    kernel_line = next(line for line in text.splitlines() if "QServe" in line)
    assert "4.00x" in kernel_line and "2.50x" in kernel_line  # vs FP16; over the read floor
    assert "1.00x" in text and "test GPU" in text


def test_bench_bars_apply_the_issue_thresholds():
    from quantkit.kernel_bench import FP16, INT8, INT8_GEMMEX, Row, Variant, bars

    qserve, anyprec = Variant("QServe W4A8 g128", "qserve", group=128), Variant("AP 3-bit", "anyprec", bits=3)
    n, k = 4096, 4096
    rows = [Row(n, k, 16, FP16, 100e-6, 2 * n * k), Row(n, k, 1024, INT8, 50e-6, n * k),
            Row(n, k, 16, "qs", 39e-6, n * k // 2, "qserve_w4a8_gemm", qserve),  # 2.56x; 8.4 MB / 39 us
            Row(n, k, 16, "ap", 34e-6, n * k * 3 // 8, "anyprec_gemm_tc", anyprec),  # 2.94x
            Row(n, k, 1024, "qs", 62e-6, n * k // 2, "qserve_w4a8_tiled", qserve)]  # 0.81x INT8
    checks = {(c.row.label, c.row.m, c.requirement): c for c in bars(rows, bandwidth=300.0)}
    assert checks[("qs", 16, ">= 2.5x cuBLAS FP16")].met
    assert checks[("qs", 16, ">= 60% of copy bandwidth")].met  # 215 GB/s of 300
    assert not checks[("ap", 16, ">= 3.0x cuBLAS FP16")].met
    assert checks[("qs", 1024, ">= 0.8x cuBLAS INT8")].met
    assert len(checks) == 4  # no bandwidth bar for Any-Precision, no INT8 bar at M = 16
    low = bars(rows, bandwidth=400.0)  # 215 GB/s of 400 is 54%
    assert not next(c for c in low if "bandwidth" in c.requirement).met
    # a faster INT8 baseline (a direct cublasGemmEx) sets the bar: 0.81x of _int_mm is 0.65x of it
    faster = bars([*rows, Row(n, k, 1024, INT8_GEMMEX, 40e-6, n * k)], bandwidth=300.0)
    int8_bar = next(c for c in faster if "INT8" in c.requirement)
    assert not int8_bar.met and int8_bar.measured == "0.65x"


def test_bench_rounds_report_each_rows_median_and_make_tensors_once(monkeypatch):
    """`quantkit bench --rounds 3`: kernels and baselines are timed once a round and each row reports the median of
    its rounds, so a slow spell in one round (a baseline 3x slower, a kernel 2x) moves no ratio; every round's time
    is kept (the JSON's round_seconds), the stored tensors are made once for all rounds, a progress callback counts
    every kernel timing against the total, and no round is refused."""
    from quantkit import kernel_bench as kb

    monkeypatch.setattr(kernels, "upload", lambda launch: lambda: None)
    monkeypatch.setattr(kb, "l2_bytes", lambda: 1 << 20)
    round_of = {"now": 0}
    kernel_times = {0: 1e-5, 1: 2e-5, 2: 1.1e-5}  # round 1 slow for the kernel
    fp16_times = {0: 4e-5, 1: 4.4e-5, 2: 12e-5}  # round 2 slow for cuBLAS
    monkeypatch.setattr(kb, "timing", lambda call, warmup, iters, torch_graph=False:
                        (kernel_times[round_of["now"]], 2 * kernel_times[round_of["now"]]))

    def baselines(m, n, k, warmup, iters):
        if (n, k, m) == (256, 640, 1) and made["count"]:  # the first baseline of a round after the first
            round_of["now"] += 1
        return [kb.Row(n, k, m, kb.FP16, fp16_times[round_of["now"]], 1)]

    monkeypatch.setattr(kb, "baselines", baselines)
    made = {"count": 0}
    cases = kb.shape_cases(((256, 640),), tuple(v for v in kb.VARIANTS if v.fmt in ("qserve", "anyprec")))
    cases = [kb.Case(c.label, c.n, c.k, c.variant,
                     lambda make=c.tensors: made.__setitem__("count", made["count"] + 1) or make()) for c in cases]
    progress = []
    rows = kb.run_bench(cases, ms=(1, 4), rounds=3, on_timed=lambda done, total: progress.append((done, total)))
    assert round_of["now"] == 2 and made["count"] == len(cases)
    assert progress == [(i + 1, 3 * 2 * len(cases)) for i in range(3 * 2 * len(cases))]  # every kernel timing
    fp16 = [r for r in rows if r.label == kb.FP16]
    kernels_rows = [r for r in rows if r.variant is not None]
    assert len(fp16) == 2 and len(kernels_rows) == 2 * len(cases)  # one row per (shape, M, kernel), not per round
    assert all(r.seconds == 4.4e-5 and r.round_seconds == (4e-5, 4.4e-5, 12e-5) for r in fp16)
    assert all(r.seconds == 1.1e-5 and r.launch_seconds == 2.2e-5 for r in kernels_rows)
    data = kb.report(rows, kb.bars(rows, 1e9), 1e9, "test GPU")
    assert {tuple(r["round_seconds"]) for r in data["rows"] if r["label"] != kb.FP16} == {(1e-5, 2e-5, 1.1e-5)}
    assert data["software"]["torch"] == torch.__version__  # the versions the times depend on, beside them
    kernel_times[3], fp16_times[3] = 1e-5, 4e-5  # one more round
    one = kb.run_bench(cases[:1], ms=(1,))  # a single round: the row as timed, no rounds recorded
    assert one[-1].round_seconds == () and "round_seconds" not in kb.report(one, [], 1e9, "x")["rows"][-1]
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        kb.run_bench(cases, ms=(1,), rounds=0)


def test_bench_times_every_path_and_names_the_function_that_ran(monkeypatch):
    """`quantkit bench --paths all` without a GPU: the device calls stubbed, what is timed, under which label and
    CUDA function, and which bars apply."""
    from quantkit import kernel_bench as kb

    monkeypatch.setattr(kernels, "upload", lambda launch: lambda: None)
    monkeypatch.setattr(kb, "l2_bytes", lambda: 1 << 20)
    monkeypatch.setattr(kb, "median_time", lambda fn, warmup, iters: 1e-5)
    graphs = []  # short kernels are timed again in CUDA graphs that cover every operand copy
    monkeypatch.setattr(kb, "graph_time", lambda fn, calls, replays, torch_graph=False:
                        graphs.append((calls, fn.copies, torch_graph)) or 0.8e-5)
    monkeypatch.setattr(kb, "baselines", lambda m, n, k, warmup, iters: [kb.Row(n, k, m, kb.FP16, 4e-5, 1)])
    rows = kb.run_bench(kb.shape_cases(((256, 640),), kb.with_paths(kb.VARIANTS)), ms=(4, 64))
    ran = {(r.label, r.m): r.kernel for r in rows}
    assert all(r.seconds == 0.8e-5 and r.launch_seconds == 1e-5 for r in rows if r.variant is not None)
    assert graphs and all(calls >= max(copies, 10) for calls, copies, _ in graphs)  # >= 100 us of 10-us calls
    assert {torch_graph for _, _, torch_graph in graphs} == {False}  # the baselines are stubbed here
    assert ran[("QServe W4A8 g128 [tiled]", 4)] == "qserve_w4a8_tiled"
    assert ran[("QServe W4A8 g128 [small-M]", 64)] == "qserve_w4a8_gemm"
    assert ran[("LiquidQuant W4A8 g64 [wgmma]", 64)] == "liquidquant_w4a8_wgmma"
    assert not any(v.path == "wgmma" for v in kb.with_paths(kb.VARIANTS, hopper=False))  # not on other GPUs
    assert ran[("Atom W4A4 g128 + 128 INT8 [tiled]", 4)] == "atom_w4a4_tiled"
    assert ran[("Any-Precision 3-bit GEMV [tensor cores]", 4)] == "anyprec_gemm_tc8_3"  # up to 8 tokens
    assert ran[("Any-Precision 3-bit GEMV [CUDA cores]", 4)] == "anyprec_gemv"
    assert ("Any-Precision 3-bit GEMV [CUDA cores]", 64) not in ran  # decode batches only
    checks = kb.bars(rows, bandwidth=1e9)
    assert {c.row.label for c in checks} >= {"QQQ W4A8 g128 [small-M]", "Any-Precision 3-bit GEMV [tensor cores]"}
    assert all(c.row.m == 4 for c in checks)  # no bar at M = 64
    data = json.loads(json.dumps(kb.report(rows, checks, 1e9, "test GPU")))  # `quantkit bench --json`
    assert data["device"] == "test GPU" and len(data["rows"]) == len(rows) and len(data["bars"]) == len(checks)
    wgmma = next(r for r in data["rows"] if r["path"] == "wgmma")
    assert wgmma["function"].endswith("_wgmma") and (wgmma["seconds"], wgmma["launch_seconds"]) == (0.8e-5, 1e-5)
    assert wgmma["format"] in kb.PATHS
    assert {b["met"] for b in data["bars"]} <= {True, False}
    table = kb.markdown_bars(data)  # bench/kernels_table.py: the README's tables from that file
    assert table.startswith("test GPU, copy bandwidth 1000000000 GB/s") and table.count("\n| ") == len(checks) + 1
    assert ("tuned" in table.splitlines()[0]) == bool(data["tuning"]["defines"] or data["tuning"]["environment"])
    knobs = {"defines": ["QK_SMALLM_AHEAD=6"], "environment": {"BULK_DECODE": True}}
    tuned = {**data, "tuning": {**data["tuning"], **knobs}}
    assert kb.markdown_bars(tuned).splitlines()[0].endswith("bars met (tuned: QK_SMALLM_AHEAD=6 BULK_DECODE=True).")
    sweep = kb.markdown_sweep(data).splitlines()
    assert any(line.startswith("| QServe W4A8 g128 | 4 |") for line in sweep)
    assert all(line.count("|") == sweep[0].count("|") for line in sweep)
    grid = kb.markdown_grid(data, 4).splitlines()  # the README's per-M tables: baselines first, then the kernels
    assert grid[0] == "| M = 4 | 256 x 640 |" and grid[2] == "| cuBLAS FP16 (torch.matmul) | 40.0 us |"
    assert "| QServe W4A8 g128 [small-M] | 8.0 us: 5.00x FP16, 0% BW |" in grid  # 10 us launches, 8 us replayed
    assert len(grid) == 2 + 1 + len({r.label for r in rows if r.m == 4 and r.variant is not None})


def test_stream_fit_splits_a_kernels_time_into_rate_and_fixed_cost():
    """bench/kernels_table.py --fit: per kernel at one M, the least-squares line time = fixed + bytes / rate over its
    shapes (the read floor's too, the baselines' not), its largest residual, and no line through fewer than three
    distinct sizes."""
    from quantkit import kernel_bench as kb

    def row(label, function, fmt, m, size, seconds):
        return {"label": label, "function": function, "format": fmt, "m": m, "bytes_moved": size, "seconds": seconds}

    sizes = [8e6, 12e6, 28e6, 56e6]
    rows = [*(row("QServe", "q_pc", "qserve", 1, b, 4.5e-6 + b / 2.8e12) for b in sizes),
            *(row(kb.READ_FLOOR, "stream_read", None, 1, b, 1.9e-6 + b / 3e12) for b in sizes),
            *(row(kb.FP16, "cuBLAS", None, 1, 4 * b, 1e-6 + b / 1e12) for b in sizes),
            *(row("QQQ", "qqq", "qqq", 1, b, t) for b, t in zip(sizes, [9e-6, 10e-6, 16e-6, 25e-6], strict=True)),
            *(row("LQQ", "lqq", "liquidquant", 1, b, 5e-6) for b in sizes[:2]),  # two shapes: no line
            row("QServe", "q_pc", "qserve", 16, 8e6, 9e-6)]
    fits = {f["label"]: f for f in kb.stream_fit({"rows": rows}, 1)}
    assert set(fits) == {"QServe", kb.READ_FLOOR, "QQQ"}
    assert fits["QServe"]["rate_tbps"] == pytest.approx(2.8) and fits["QServe"]["fixed_us"] == pytest.approx(4.5)
    assert fits["QServe"]["residual_us"] < 1e-6 and fits["QServe"]["shapes"] == 4
    assert fits[kb.READ_FLOOR]["fixed_us"] == pytest.approx(1.9) and fits["QQQ"]["residual_us"] > 0.1
    table = kb.markdown_fit({"rows": rows}, 1).splitlines()
    assert table[0].startswith("| M = 1 |") and "| QServe | `q_pc` | 4 | 2.80 | 4.50 | 0.00 |" in table
    assert kb.stream_fit({"rows": rows}, 16) == []


def test_bar_counts_and_changes_between_two_reports():
    """bench/kernels_table.py's summaries: per kernel and requirement the bars met of those it has, and between two
    reports the bars whose verdict flipped (both ways), with the two totals."""
    def bar(label, requirement, m, measured, met):
        return {"n": 4096, "k": 4096, "m": m, "label": label, "requirement": requirement, "measured": measured,
                "met": met}

    from quantkit import kernel_bench as kb

    fp16, bandwidth, ap = ">= 2.5x cuBLAS FP16", ">= 60% of copy bandwidth", ">= 3.0x cuBLAS FP16"
    before = {"bars": [bar("QQQ", fp16, 1, "2.4x", False), bar("QQQ", fp16, 4, "2.6x", True),
                       bar("QQQ", bandwidth, 1, "61%", True), bar("AP", ap, 1, "2.0x", False)]}
    after = {"bars": [bar("QQQ", fp16, 1, "2.7x", True), bar("QQQ", fp16, 4, "2.6x", True),
                      bar("QQQ", bandwidth, 1, "59%", False), bar("AP", ap, 1, "2.1x", False)]}
    counts = kb.markdown_bar_counts(before).splitlines()
    assert counts[0] == "| kernel | >= 2.5x cuBLAS FP16 | >= 60% of copy bandwidth | >= 3.0x cuBLAS FP16 | met |"
    assert counts[2:] == ["| QQQ | 1 of 2 | 1 of 1 | - | 2 |", "| AP | - | - | 0 of 1 | 0 |"]
    changes = kb.markdown_bar_changes(before, after).splitlines()
    assert changes[0] == "2 -> 2 bars met (1 in both)"
    assert changes[4:] == ["| 4096 x 4096 | 1 | QQQ | >= 2.5x cuBLAS FP16 | 2.4x NO | 2.7x yes |",
                           "| 4096 x 4096 | 1 | QQQ | >= 60% of copy bandwidth | 61% yes | 59% NO |"]


def test_bars_against_the_fastest_baselines_of_several_runs():
    """with_fastest_baselines (kernels_table.py --fastest-baselines): each cuBLAS row at its fastest in any run, the
    bars against those times, so a slow cuBLAS in this run meets no bar that a fast one in another would not; the
    kernels' rows and the bandwidth bars stay this run's."""
    from quantkit import kernel_bench as kb

    def row(label, m, us, fmt=None):
        return {"n": 4096, "k": 4096, "m": m, "label": label, "format": fmt, "function": fmt or "cuBLAS",
                "seconds": us * 1e-6}

    def bar(m, us, requirement, measured, met):
        return {**row("QQQ", m, us, "qqq"), "requirement": requirement, "measured": measured, "met": met}

    this = {"device": "GPU", "copy_bandwidth_gbps": 3000,
            "rows": [row(kb.FP16, 1, 20), row(kb.INT8, 1024, 50), row(kb.INT8_GEMMEX, 1024, 70),
                     row("QQQ", 1, 7.5, "qqq"), row("QQQ", 1024, 60, "qqq")],
            "bars": [bar(1, 7.5, ">= 2.5x cuBLAS FP16", "2.67x", True),
                     bar(1, 7.5, ">= 60% of copy bandwidth", "61%", True),
                     bar(1024, 60, ">= 0.8x cuBLAS INT8", "0.83x", True)]}
    other = {"rows": [row(kb.FP16, 1, 17), row(kb.INT8, 1024, 52), row(kb.INT8_GEMMEX, 1024, 45),
                      row("QQQ", 1, 5.0, "qqq")]}  # a faster kernel elsewhere changes nothing here
    judged = kb.with_fastest_baselines(this, [other])
    assert [(b["measured"], b["met"]) for b in judged["bars"]] == [("2.27x", False), ("61%", True), ("0.75x", False)]
    assert [r["seconds"] * 1e6 for r in judged["rows"]] == pytest.approx([17, 50, 45, 7.5, 60])
    assert kb.markdown_bars(judged).startswith("GPU, copy bandwidth 3000 GB/s: 1 of 3 bars met against cuBLAS at "
                                               "its fastest of 2 runs.")
    assert [b["met"] for b in kb.with_fastest_baselines(this, [])["bars"]] == [True, True, True]


def test_bench_replays_short_kernels_in_cuda_graphs(monkeypatch):
    """A single launch's event time carries microseconds of launch overhead, as much as a decode GEMM takes: below
    GRAPH_BELOW a kernel is timed per call in CUDA-graph replays covering every operand copy; a long kernel, or one
    that cannot be captured, by its single launches."""
    from quantkit import kernel_bench as kb

    asked = []
    monkeypatch.setattr(kb, "graph_time", lambda fn, calls, replays, torch_graph=False: asked.append(calls) or 3e-6)

    def call():
        pass

    call.copies = 40
    monkeypatch.setattr(kb, "median_time", lambda fn, warmup, iters: 5e-6)
    assert kb.timing(call, 1, 8) == (3e-6, 5e-6) and asked == [40]  # 20 calls make 100 us; 40 copies to cover
    call.copies = 1
    assert kb.timing(call, 1, 8) == (3e-6, 5e-6) and asked[-1] == 20
    monkeypatch.setattr(kb, "median_time", lambda fn, warmup, iters: 2e-4)
    assert kb.timing(call, 1, 8) == (2e-4, 2e-4) and len(asked) == 2  # long enough alone
    monkeypatch.setattr(kb, "median_time", lambda fn, warmup, iters: 5e-6)
    monkeypatch.setattr(kb, "graph_time", lambda fn, calls, replays, torch_graph=False: None)
    assert kb.timing(call, 1, 8) == (5e-6, 5e-6)  # capture failed: single launches


def test_bench_rotates_operands_past_the_l2_cache():
    from quantkit.kernel_bench import rotation

    made, ran = [], []
    call = rotation(lambda i: made.append(i) or (lambda: ran.append(i)), bytes_each=30, l2=100)
    assert made == list(range(7))  # 7 x 30 bytes >= 2 x 100
    for _ in range(9):
        call()
    assert ran == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    made.clear()
    rotation(lambda i: made.append(i) or (lambda: None), bytes_each=10**9, l2=100)
    assert made == [0]  # operands larger than the cache: one copy


def test_bench_bars_are_met_at_exactly_their_thresholds():
    """Issue #6 says "at least": a kernel exactly 2.5x (3x) cuBLAS FP16, exactly 60% of the copy bandwidth or
    exactly 0.8x cuBLAS INT8 meets its bar. Times are binary fractions so that each ratio is exact."""
    from quantkit.kernel_bench import FP16, INT8, Row, Variant, bars

    qqq, ap = Variant("QQQ W4A8 per channel", "qqq"), Variant("AP 3-bit", "anyprec", bits=3)
    n, k, t = 4096, 4096, 2.0 ** -14
    rows = [Row(n, k, 1, FP16, 15 * t, 1), Row(n, k, 1024, INT8, 4 * t, 1),
            Row(n, k, 1, "qqq", 6 * t, 1, "qqq_w4a8_gemm_pc", qqq),  # 15 / 6 = 2.5x FP16
            Row(n, k, 1, "ap", 5 * t, 1, "anyprec_gemm_tc8_3", ap),  # 15 / 5 = 3x FP16
            Row(n, k, 1024, "qqq", 5 * t, 1, "qqq_w4a8_tiled", qqq)]  # 4 / 5 = 0.8x INT8
    checks = {(c.row.label, c.requirement): (c.measured, c.met) for c in bars(rows, bandwidth=1.0)}
    assert checks[("qqq", ">= 2.5x cuBLAS FP16")] == ("2.50x", True)
    assert checks[("ap", ">= 3.0x cuBLAS FP16")] == ("3.00x", True)
    assert checks[("qqq", ">= 0.8x cuBLAS INT8")] == ("0.80x", True)
    # 60%: 0.6 GB in one second against a copy bandwidth of 1 GB/s
    share = bars([Row(n, k, 1, "qqq", 1.0, 6 * 10**8, "qqq_w4a8_gemm_pc", qqq)], bandwidth=1.0)
    assert [(c.measured, c.met) for c in share] == [("60%", True)]


def test_bench_bars_judge_the_unrounded_ratio():
    """A verdict comes from the ratio itself, not from the two decimals it is shown with: 2.496x shows as 2.50x but
    misses 2.5x; 59.6% shows as 60% but misses 60%; 0.796x misses 0.8x; and the same in with_fastest_baselines."""
    from quantkit import kernel_bench as kb

    qs = kb.Variant("QServe W4A8 g128", "qserve", group=128)
    n, k = 4096, 4096
    rows = [kb.Row(n, k, 16, kb.FP16, 249.6e-6, 1), kb.Row(n, k, 1024, kb.INT8, 79.6e-6, 1),
            kb.Row(n, k, 16, "qs", 100e-6, 59.6e3, "qserve_w4a8_gemm", qs),  # 596 MB/s of 1000
            kb.Row(n, k, 1024, "qs", 100e-6, 1, "qserve_w4a8_tiled", qs)]
    checks = [(c.requirement, c.measured, c.met) for c in kb.bars(rows, bandwidth=1.0)]
    assert checks == [(">= 2.5x cuBLAS FP16", "2.50x", False), (">= 60% of copy bandwidth", "60%", False),
                      (">= 0.8x cuBLAS INT8", "0.80x", False)]
    report = kb.report(rows, kb.bars(rows, 1.0), 1.0, "GPU")
    judged = kb.with_fastest_baselines(report, [report])
    assert [(b["measured"], b["met"]) for b in judged["bars"]] == [("2.50x", False), ("60%", False), ("0.80x", False)]
    # and exactly at the threshold, met there too (0.8 = 4 / 5)
    exact = [kb.Row(n, k, 1024, kb.INT8, 4 * 2.0 ** -14, 1), kb.Row(n, k, 1024, "qs", 5 * 2.0 ** -14, 1, "t", qs)]
    judged = kb.with_fastest_baselines(kb.report(exact, kb.bars(exact, 1.0), 1.0, "GPU"), [])
    assert [(b["measured"], b["met"]) for b in judged["bars"]] == [("0.80x", True)]


def test_bench_bars_apply_only_where_the_issue_sets_them():
    """The INT8 bar is set at M = 1024 alone (not at 64 or 2048, though cuBLAS INT8 is timed there); the 3x bar at
    Any-Precision's 3-bit width alone (not 2 or 4 bits); Atom (W4A4) has no bar; the FP16 and bandwidth bars reach
    M = 16 but not 17."""
    from quantkit.kernel_bench import FP16, INT8, INT8_GEMMEX, Row, Variant, bars

    n, k = 4096, 4096
    qqq, atom = Variant("QQQ", "qqq"), Variant("Atom", "atom", group=128)
    rows = []
    for m in (1, 16, 17, 64, 1024, 2048):
        rows += [Row(n, k, m, FP16, 1e-3, 1), Row(n, k, m, INT8, 1e-3, 1), Row(n, k, m, INT8_GEMMEX, 1e-3, 1),
                 Row(n, k, m, "qqq", 1e-4, 10**9, "qqq_w4a8_gemm_pc", qqq),
                 Row(n, k, m, "atom", 1e-4, 10**9, "atom_w4a4_gemm", atom)]
    for bits in (2, 3, 4):
        rows.append(Row(n, k, 1, f"ap{bits}", 1e-4, 1, "anyprec_gemv", Variant(f"ap{bits}", "anyprec", bits=bits)))
    got = sorted((c.row.label, c.row.m, c.requirement) for c in bars(rows, bandwidth=1.0))
    assert got == sorted([("ap3", 1, ">= 3.0x cuBLAS FP16"), ("qqq", 1024, ">= 0.8x cuBLAS INT8"),
                          *(("qqq", m, r) for m in (1, 16) for r in (">= 2.5x cuBLAS FP16",
                                                                        ">= 60% of copy bandwidth"))])


def test_bench_bars_take_the_baselines_of_their_own_shape():
    """A bar compares a kernel with cuBLAS on the same (N, K, M): with both [N, K] and its transpose [K, N] timed
    (28672 x 4096 and 4096 x 28672), each kernel row is judged against its own shape's baselines."""
    from quantkit.kernel_bench import FP16, INT8, Row, Variant, bars

    qqq = Variant("QQQ", "qqq")
    a, b = (28672, 4096), (4096, 28672)
    rows = [Row(*a, 1, FP16, 300e-6, 1), Row(*b, 1, FP16, 100e-6, 1),
            Row(*a, 1024, INT8, 200e-6, 1), Row(*b, 1024, INT8, 400e-6, 1),
            Row(*a, 1, "qqq", 100e-6, 1, "g", qqq), Row(*b, 1, "qqq", 100e-6, 1, "g", qqq),
            Row(*a, 1024, "qqq", 200e-6, 1, "t", qqq), Row(*b, 1024, "qqq", 200e-6, 1, "t", qqq)]
    got = {(c.row.n, c.row.m, c.requirement): c.measured for c in bars(rows, 1.0) if "cuBLAS" in c.requirement}
    assert got == {(28672, 1, ">= 2.5x cuBLAS FP16"): "3.00x", (4096, 1, ">= 2.5x cuBLAS FP16"): "1.00x",
                   (28672, 1024, ">= 0.8x cuBLAS INT8"): "1.00x", (4096, 1024, ">= 0.8x cuBLAS INT8"): "2.00x"}


def test_bench_rows_count_the_bytes_each_layout_moves(monkeypatch):
    """A kernel row's bytes (its GB/s, the 60% bar): the stored tensors it reads (Any-Precision: only its width's
    planes and table; Atom: not the reorder index, which the producing kernel applies), its activations (INT8 a
    value, Any-Precision's fp16 two) and its fp16 output. At N = 256, K = 640, M = 4 by hand:
    QServe g128: 256 x 320 codes + 512 (s1) + 2 x 5 x 256 (s2, z2) = 84,992, + 2,560 + 2,048;
    Any-Precision 3-bit: 3 planes of 256 x 640 / 8 + 256 x 8 x 2 (lut3) = 65,536, + 5,120 + 2,048."""
    from quantkit import kernel_bench as kb

    monkeypatch.setattr(kernels, "upload", lambda launch: lambda: None)
    monkeypatch.setattr(kb, "l2_bytes", lambda: 1 << 20)
    monkeypatch.setattr(kb, "timing", lambda call, warmup, iters, torch_graph=False: (1e-5, 1e-5))
    monkeypatch.setattr(kb, "baselines", lambda m, n, k, warmup, iters: [])
    variants = tuple(v for v in kb.VARIANTS if v.label in ("QServe W4A8 g128", "Any-Precision 3-bit GEMV"))
    moved = {r.label: r.bytes_moved for r in kb.run_bench(kb.shape_cases(((256, 640),), variants), ms=(4,))}
    assert moved == {"QServe W4A8 g128": 84992 + 2560 + 2048, "Any-Precision 3-bit GEMV": 65536 + 5120 + 2048}
    atom = kb.synthetic("atom", 256, 640, group=128)
    weights = 256 * 256 + 256 * 128 + 4 * 4 * 256 * 2 + 4 * 256 * 2  # INT4 pairs, INT8, scales' fragment layout
    assert kb.weight_bytes(atom, kb.Variant("Atom", "atom", group=128)) == weights


def test_bench_weight_bytes_of_any_precision_at_the_width_it_launches():
    """An Any-Precision variant that names no width launches at 3 bits (variant_launch): its bytes are those of 3
    planes and lut3 (256 x 640 / 8 x 3 + 256 x 8 x 2 = 65,536), not a KeyError for 'lutNone'."""
    from quantkit import kernel_bench as kb

    tensors = kb.synthetic("anyprec", 256, 640)
    assert kb.variant_launch(kb.Variant("AP", "anyprec"), tensors, 1, 640).name.endswith("_3")
    assert kb.weight_bytes(tensors, kb.Variant("AP", "anyprec")) == 65536
    assert kb.weight_bytes(tensors, kb.Variant("AP", "anyprec", bits=3)) == 65536


def test_bench_baselines_count_their_operands_and_apply_where_torch_takes_the_shape(monkeypatch):
    """The baselines without a GPU (timings stubbed): cuBLAS FP16 moves 2 bytes an element of [M, K], [K, N] and the
    output; cuBLAS INT8 one of each input and 4 of its int32 output, timed only above M = 16 (M a multiple of 8); the
    read floor reads the 4-bit weights' N K / 2 bytes, at M <= 16 only. FP16 rotates 2 K N bytes of weights a copy,
    INT8 K N."""
    from quantkit import kernel_bench as kb

    rotated = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kb, "rotation", lambda make, bytes_each, l2=None: rotated.append(bytes_each) or (lambda: None))
    monkeypatch.setattr(kb, "timing", lambda call, warmup, iters, torch_graph=False: (1e-4, 2e-4))
    n, k = 256, 640
    small = {r.label: r.bytes_moved for r in kb.baselines(16, n, k, 1, 1)}
    assert small == {kb.READ_FLOOR: 81920, kb.FP16: 2 * (16 * 640 + 640 * 256 + 16 * 256)}
    assert rotated == [81920, 2 * 640 * 256]
    large = {r.label: r.bytes_moved for r in kb.baselines(24, n, k, 1, 1)}
    assert large == {kb.FP16: 2 * (24 * 640 + 640 * 256 + 24 * 256), kb.INT8: 24 * 640 + 640 * 256 + 4 * 24 * 256,
                     kb.INT8_GEMMEX: 24 * 640 + 640 * 256 + 4 * 24 * 256}
    assert rotated[2:] == [2 * 640 * 256, 640 * 256, 640 * 256]
    assert {r.label for r in kb.baselines(17, n, k, 1, 1)} == {kb.FP16, kb.INT8_GEMMEX}  # _int_mm: M % 8 == 0


def test_copy_bandwidth_counts_the_read_and_the_write(monkeypatch):
    """The 60% bar's denominator: a device-to-device copy of S bytes reads S and writes S, so 1 GB copied in 0.5 s
    is 4 GB/s (CuPy faked, the timing stubbed)."""
    import sys
    import types

    from quantkit import kernel_bench as kb

    fake = types.SimpleNamespace(empty=lambda size, dtype: bytearray(0), uint8="uint8")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(kb, "median_time", lambda fn, warmup, iters: 0.5)
    assert kb.copy_bandwidth(size=10**9) == pytest.approx(4.0)


def test_median_time_is_the_median_of_the_timed_calls(monkeypatch):
    """median_time (CuPy faked): the warm-up calls run untimed, then each call between its own events; the result
    is the median of their times in seconds, so that one slow call (9 ms among 1 and 2 ms) moves nothing."""
    import sys
    import types

    from quantkit import kernel_bench as kb

    elapsed = iter([2.0, 9.0, 1.0])  # ms, one per timed call

    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

    device = types.SimpleNamespace(synchronize=lambda: None)
    cuda = types.SimpleNamespace(Device=lambda: device, Event=Event, get_elapsed_time=lambda a, b: next(elapsed))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    calls = []
    assert kb.median_time(lambda: calls.append(1), warmup=4, iters=3) == pytest.approx(2e-3)
    assert len(calls) == 7


def test_bench_timing_edges_of_the_graph_replays(monkeypatch):
    """A kernel of exactly GRAPH_BELOW is timed by its single launches (only shorter ones are replayed); a very
    short one gets at most 64 calls a replay (the rotation's most copies), not the 100,000 that 100 us would take."""
    from quantkit import kernel_bench as kb

    asked = []
    monkeypatch.setattr(kb, "graph_time", lambda fn, calls, replays, torch_graph=False: asked.append(calls) or 1e-9)

    def call():
        pass

    monkeypatch.setattr(kb, "median_time", lambda fn, warmup, iters: kb.GRAPH_BELOW)
    assert kb.timing(call, 1, 8) == (kb.GRAPH_BELOW, kb.GRAPH_BELOW) and asked == []
    monkeypatch.setattr(kb, "median_time", lambda fn, warmup, iters: 1e-9)
    kb.timing(call, 1, 8)
    assert asked == [64]


def test_markdown_bars_say_which_bars_are_met():
    """The README's bar table: 'yes' on a met bar's line, 'NO' on a missed one's, whatever it measured."""
    from quantkit import kernel_bench as kb

    def bar(m, measured, met):
        return {"n": 4096, "k": 4096, "m": m, "label": "QQQ", "function": "qqq_w4a8_gemm_pc", "seconds": 1e-5,
                "requirement": ">= 2.5x cuBLAS FP16", "measured": measured, "met": met}

    table = kb.markdown_bars({"device": "GPU", "copy_bandwidth_gbps": 3000,
                              "bars": [bar(1, "2.60x", True), bar(4, "2.40x", False)]}).splitlines()
    assert table[0] == "GPU, copy bandwidth 3000 GB/s: 1 of 2 bars met."
    assert table[4:] == ["| 4096 x 4096 | 1 | QQQ | `qqq_w4a8_gemm_pc` | 10.0 | >= 2.5x cuBLAS FP16 | 2.60x | yes |",
                         "| 4096 x 4096 | 4 | QQQ | `qqq_w4a8_gemm_pc` | 10.0 | >= 2.5x cuBLAS FP16 | 2.40x | NO |"]


def _grid_report():
    """A report at M = 16 and 1024 on one shape: the baselines, the read floor and two kernels, with TOPS and GB/s
    worked by hand (2 M N K / s; bytes / s)."""
    from quantkit import kernel_bench as kb

    n = k = 4096

    def row(label, m, us, fmt=None, moved=0):
        s = us * 1e-6
        return {"n": n, "k": k, "m": m, "label": label, "format": fmt, "function": fmt or "cuBLAS", "path": None,
                "seconds": s, "tops": 2 * m * n * k / s / 1e12, "gbps": moved / s / 1e9, "bytes_moved": moved}

    return {"device": "GPU", "copy_bandwidth_gbps": 2000, "bars": [],
            "rows": [row(kb.READ_FLOOR, 16, 5, moved=8 * 10**6),  # 1600 GB/s: 80%
                     row(kb.FP16, 16, 40), row("QQQ", 16, 10, "qqq", 10**7),  # 1000 GB/s: 50%
                     row("AP", 16, 8, "anyprec", 10**7),
                     row(kb.FP16, 1024, 2 * n * k * 1024 / 500e12 * 1e6),  # 500 TOPS: 68.7 us
                     row(kb.INT8, 1024, 2 * n * k * 1024 / 800e12 * 1e6),  # 800 TOPS: 42.9 us
                     row(kb.INT8_GEMMEX, 1024, 2 * n * k * 1024 / 1000e12 * 1e6),  # 1000 TOPS: 34.4 us
                     row("QQQ", 1024, 2 * n * k * 1024 / 1200e12 * 1e6, "qqq")]}  # 1200 TOPS: 28.6 us


def test_markdown_grid_at_decode_and_at_large_m():
    """The README's per-M tables: at M = 16 times alone for cuBLAS, the read floor's and W4A8 kernels' share of the
    copy bandwidth (none for Any-Precision); at M = 1024 cuBLAS's TOPS and each kernel's speedup over FP16 and the
    faster INT8 baseline (cublasGemmEx here: 1200 / 1000 TOPS is 1.20x)."""
    from quantkit import kernel_bench as kb

    report = _grid_report()
    assert kb.markdown_grid(report, 16).splitlines()[2:] == [
        f"| {kb.READ_FLOOR} | 5.0 us, 80% BW |", f"| {kb.FP16} | 40.0 us |",
        "| QQQ | 10.0 us: 4.00x FP16, 50% BW |", "| AP | 8.0 us: 5.00x FP16 |"]
    assert kb.markdown_grid(report, 1024).splitlines()[2:] == [
        f"| {kb.FP16} | 68.7 us (500 TOPS) |", f"| {kb.INT8} | 42.9 us (800 TOPS) |",
        f"| {kb.INT8_GEMMEX} | 34.4 us (1000 TOPS) |", "| QQQ | 28.6 us: 2.40x FP16, 1.20x INT8 |"]


def test_markdown_sweep_sums_each_path_over_the_shapes_and_names_the_fastest():
    """`--paths all`'s table: per variant and M each path's time summed over the shapes, the fastest by that sum
    (here small-M on one shape and tiled on the other, 5 + 30 = 35 us against 20 + 10 = 30 us: tiled)."""
    from quantkit import kernel_bench as kb

    def row(n, path, us):
        return {"n": n, "k": 4096, "m": 16, "label": f"QQQ W4A8 g128 [{path}]", "path": path, "seconds": us * 1e-6}

    report = {"rows": [row(4096, "small-M", 5), row(4096, "tiled", 20), row(28672, "small-M", 30),
                       row(28672, "tiled", 10), {"n": 4096, "k": 4096, "m": 16, "label": kb.FP16, "path": None,
                                                 "seconds": 1e-3}]}
    assert kb.markdown_sweep(report).splitlines()[2:] == ["| QQQ W4A8 g128 | 16 | 35.0 | 30.0 | tiled |"]


def test_fastest_baselines_leave_the_read_floor_and_the_kernels_as_run():
    """with_fastest_baselines takes the cuBLAS rows alone at their fastest: a faster read floor in another run
    changes nothing in this one (the floor is no baseline of a bar)."""
    from quantkit import kernel_bench as kb

    report = _grid_report()
    other = {"rows": [{**r, "seconds": r["seconds"] / 2} for r in report["rows"]]}
    rows = {(r["label"], r["m"]): r["seconds"] for r in kb.with_fastest_baselines(report, [other])["rows"]}
    assert [rows[(kb.READ_FLOOR, 16)], rows[("QQQ", 16)], rows[(kb.FP16, 16)]] == pytest.approx([5e-6, 10e-6, 20e-6])


def test_fastest_baselines_keep_each_rows_rates_with_its_time():
    """A cuBLAS row taken at its fastest time from another run carries that time's rates: the grid's '68.7 us (500
    TOPS)' stays consistent, not the slower run's 250 TOPS beside the faster run's time."""
    from quantkit import kernel_bench as kb

    report = _grid_report()
    slow = {**report, "rows": [{**r, "seconds": 2 * r["seconds"], "tops": r["tops"] / 2, "gbps": r["gbps"] / 2}
                               if r["format"] is None else r for r in report["rows"]]}
    judged = kb.with_fastest_baselines(slow, [report])
    fp16 = next(r for r in judged["rows"] if r["label"] == kb.FP16 and r["m"] == 1024)
    assert fp16["tops"] == pytest.approx(500) and fp16["seconds"] == pytest.approx(2 * 4096 ** 2 * 1024 / 500e12)
    assert f"| {kb.FP16} | 68.7 us (500 TOPS) |" in kb.markdown_grid(judged, 1024).splitlines()


def test_bench_rows_count_atoms_packed_activations(monkeypatch):
    """Atom's row reads its activations as the producing kernel leaves them: INT4 codes two a byte and the 128
    INT8 outliers, M ((K - 128) / 2 + 128) bytes (4 x 384 = 1,536 at K = 640, M = 4), beside its weights (INT4
    pairs 256 x 256, INT8 256 x 128, the scales' four copies 4 x 4 x 256 and 4 x 256 fp16: 108,544) and its fp16
    output (2,048)."""
    from quantkit import kernel_bench as kb

    monkeypatch.setattr(kernels, "upload", lambda launch: lambda: None)
    monkeypatch.setattr(kb, "l2_bytes", lambda: 1 << 20)
    monkeypatch.setattr(kb, "timing", lambda call, warmup, iters, torch_graph=False: (1e-5, 1e-5))
    monkeypatch.setattr(kb, "baselines", lambda m, n, k, warmup, iters: [])
    atom = tuple(v for v in kb.VARIANTS if v.fmt == "atom")
    [row] = kb.run_bench(kb.shape_cases(((256, 640),), atom), ms=(4,))
    assert row.bytes_moved == 108544 + 1536 + 2048


def test_kernels_table_judges_both_reports_against_the_same_baselines(tmp_path, monkeypatch, capsys):
    """kernels_table.py --against with --fastest-baselines: both reports' bars against the same fastest cuBLAS
    times, so that two identical runs show no flipped bar. Here a kernel at 7.5 us against cuBLAS FP16 at 20 us
    (2.67x) in both runs, and 17 us in another (2.27x: missed in both, by the same baseline)."""
    def row(label, us, fmt=None):
        return {"n": 4096, "k": 4096, "m": 1, "label": label, "format": fmt, "function": fmt or "cuBLAS",
                "seconds": us * 1e-6}

    fp16 = "cuBLAS FP16 (torch.matmul)"
    run = {"device": "GPU", "copy_bandwidth_gbps": 3000, "rows": [row(fp16, 20), row("QQQ", 7.5, "qqq")],
           "bars": [{**row("QQQ", 7.5, "qqq"), "requirement": ">= 2.5x cuBLAS FP16", "measured": "2.67x",
                     "met": True}]}
    paths = {name: tmp_path / f"{name}.json" for name in ("a", "b", "other")}
    for name, data in (("a", run), ("b", run), ("other", {"rows": [row(fp16, 17)]})):
        paths[name].write_text(json.dumps(data))
    main = bench_module("kernels_table").main
    monkeypatch.setattr("sys.argv", ["kernels_table.py", str(paths["a"]), "--against", str(paths["b"]),
                                     "--fastest-baselines", str(paths["other"])])
    main()
    out = capsys.readouterr().out
    assert "0 -> 0 bars met (0 in both)" in out and "| 2.27x | NO |" in out and "2.67x" not in out


@pytest.mark.parametrize(("sms", "m", "n", "tall"), [
    (114, 1024, 4096, False),  # an H100 PCIe: 128 blocks take 2 waves of 114, 0.56 full
    (132, 1024, 4096, True),   # an H100 SXM: 0.97 of one wave
    (114, 1024, 14592, True),  # 114 x 4 = 456 blocks: 4 whole waves of 114
    (10, 256, 1152, True),     # 9 blocks on 10 SMs: exactly TALL_MIN_FILL (0.9), which is enough
    (10, 256, 1024, False),    # 8 of 10: 0.8
])
def test_tall_hopper_kernel_by_the_devices_own_sm_count(monkeypatch, sms, m, n, tall):
    """The wave fill that picks the 256-token kernel counts the SMs of the device it runs on (multiprocessors), not
    the 132 of the split-K plans' H100 SXM; a fill of exactly TALL_MIN_FILL takes it ("at least")."""
    monkeypatch.setattr(kernels, "multiprocessors", lambda: sms)
    assert kernels.wave_fill(9, 10) == 0.9 == kernels.TALL_MIN_FILL
    expected = kernels.WGMMA_TALL_TILES["qqq"] if tall else kernels.WGMMA["qqq"]
    assert kernels.wgmma_tiles("qqq", m, n, 4096) is expected


def test_bar_changes_count_in_both_only_bars_both_reports_have():
    """markdown_bar_changes' "(N in both)": a bar met after but absent before (a shape or M the first run did not
    time) is met in one report, not both."""
    from quantkit import kernel_bench as kb

    def bar(m, met):
        return {"n": 4096, "k": 4096, "m": m, "label": "QQQ", "requirement": ">= 2.5x cuBLAS FP16",
                "measured": "2.6x" if met else "2.4x", "met": met}

    changes = kb.markdown_bar_changes({"bars": [bar(1, True)]}, {"bars": [bar(1, True), bar(4, True)]})
    assert changes.splitlines()[0] == "1 -> 2 bars met (1 in both)"


def test_stream_fit_counts_shapes_of_the_same_size():
    """stream_fit's "shapes" counts the rows it fits, two shapes of equal bytes (4096 x 14336 and 14336 x 4096) as
    two: 4 rows of 3 distinct sizes."""
    from quantkit import kernel_bench as kb

    rows = [{"label": "QQQ", "function": "q", "format": "qqq", "m": 1, "bytes_moved": b, "seconds": 1e-6 + b / 2e12}
            for b in (8e6, 12e6, 28e6, 28e6)]
    [fit] = kb.stream_fit({"rows": rows}, 1)
    assert fit["shapes"] == 4 and fit["rate_tbps"] == pytest.approx(2.0)


def test_large_m_grid_and_forced_path_checks():
    """Tiles.grid: a block a 128-channel tile and a 128-token block, the last partial (256 tokens: 2 blocks, 257:
    3); forcing the large-M path checks K (Atom's: its INT4 columns, K - 128) against the block's 64-column step,
    and refuses a K that does not fit even where N does."""
    tiles = kernels.TILES["qserve"]
    assert tiles.grid(256, 4096) == (32, 2) and tiles.grid(257, 4096) == (32, 3) and tiles.grid(1, 128) == (1, 1)
    with pytest.raises(ValueError, match="K % 64 == 0"):
        kernels.use_tiles("qserve", 64, 128, 96, True)
    with pytest.raises(ValueError, match="K % 64 == 0"):
        kernels.use_tiles("atom", 64, 128, 128 + 96, True)
    assert kernels.use_tiles("atom", 64, 128, 128 + 512, True)


def test_small_m_kernels_by_token_count(monkeypatch):
    """LiquidQuant's small-M kernel by M: up to 8 tokens the one-block kernel (gemm8), up to 16 the two-block one
    (gemm16, two 16-channel slices a warp: N / 32 blocks), from 17 the four-block one; QServe at 16 tokens is one
    row of 16-token tiles (4096 x 4096: 128 tiles, 16 copies of 8 K steps each, 512 threads), not two."""
    monkeypatch.setattr(kernels, "hopper_available", lambda: False)
    lqq = synthetic("liquidquant", 256, 640, seed=0)
    names = {}
    for m in (8, 9, 16, 17):
        launch = kernels.liquidquant_launch(lqq, np.zeros((m, 640), np.int8), np.ones(m, np.float32))
        names[m] = (launch.name, launch.grid)
    assert names == {8: ("liquidquant_w4a8_gemm8", (16, 1)), 9: ("liquidquant_w4a8_gemm16", (8, 1)),
                     16: ("liquidquant_w4a8_gemm16", (8, 1)), 17: ("liquidquant_w4a8_gemm", (16, 1))}
    qs = synthetic("qserve", 4096, 4096, seed=0, group=128)
    launch = kernels.qserve_launch(qs, np.zeros((16, 4096), np.int8), np.ones(16, np.float32), bulk=False)
    assert (launch.name, launch.grid, launch.block) == ("qserve_w4a8_gemm", (128, 1, 1), 512)


def test_atom_small_m_plan_counts_the_outlier_steps_and_a_tile_of_16_tokens():
    """Atom's small-M launch: a K step is a group of 128 INT4 columns or half the outliers, so K = 640 has 4 + 2 =
    6 steps: two copies of 3 (ATOM_MIN_STEPS), not one; a block's tile is at most 16 tokens, so a K step's terms
    take 4 x 16 x 16 bytes of shared memory at M = 64 as at 16, and a round holds 48 KiB / 1 KiB - 4 = 44 groups."""
    n, k = 256, 640
    tensors = {"weight_int4": torch.zeros((n, (k - 128) // 2), dtype=torch.uint8),
               "weight_int8": torch.zeros((n, 128), dtype=torch.int8),
               "scale_int4": torch.zeros((4, 4 * n), dtype=torch.float16),
               "scale_int8": torch.zeros(4 * n, dtype=torch.float16)}
    launch = kernels.atom_launch(tensors, np.zeros((1, k), np.int64), np.ones((1, 5), np.float32), tiled=False)
    assert launch.grid == (16, 1) and launch.block == 64
    assert kernels.atom_step_bytes(64) == kernels.atom_step_bytes(16) == 1024 and kernels.atom_round_limit(64) == 44


def test_split_and_bulk_plans_at_their_limits():
    """split_plan where a copy's sums (50,000 bytes) pass the 48 KiB a block may share: one copy a block, and the
    copies SPLITK_WARPS asks for (4: 128 steps / 4 >= 8) as 4 blocks a tile. bulk_plan keeps its chunk where the
    block's shared memory is exactly BULK_MAX_SHARED (16 bytes of barriers for 2 slots of 8, two slots filling
    the rest), and halves it one byte past."""
    assert kernels.split_plan(8, 128, 50000) == (1, 4)
    room = (kernels.BULK_MAX_SHARED - 16) // 2
    assert kernels.bulk_plan(1, 0, lambda c: room if c == 8 else 1000, 8) == (8, 2, kernels.BULK_MAX_SHARED)
    assert kernels.bulk_plan(1, 0, lambda c: room + 1 if c == 8 else 1000, 8) == (4, 2, 16 + 2 * 1000)


def test_timing_replays_at_least_graph_below_in_at_least_five_replays(monkeypatch):
    """A replay covers at least GRAPH_BELOW of calls (30-us calls: 4, not the 3 that make 90 us), and the replays
    number iters / 4, at least 5."""
    from quantkit import kernel_bench as kb

    asked = []
    monkeypatch.setattr(kb, "graph_time", lambda fn, calls, replays, torch_graph=False:
                        asked.append((calls, replays)) or 1e-6)
    monkeypatch.setattr(kb, "median_time", lambda fn, warmup, iters: 3e-5)

    def call() -> None:
        """A kernel call of one operand copy."""

    assert kb.timing(call, 1, 8) == (1e-6, 3e-5) and kb.timing(call, 1, 40) == (1e-6, 3e-5)
    assert asked == [(4, 5), (4, 10)]


def test_streamk_tail_splits_a_last_wave_exactly_half_full(monkeypatch):
    """A last wave exactly half full (66 tiles past 132) is split: its 132 halves fill the wave (198 / 198); one
    tile more is not."""
    monkeypatch.setattr(kernels, "WGMMA_STREAMK", True)
    assert kernels.streamk_from(198, 132, 64) == 132 and kernels.tall_fill(198, 132, 64) == 1.0
    assert kernels.streamk_from(199, 132, 64) == 199


def test_streamk_launch_grid_counts_two_blocks_a_split_tile(monkeypatch):
    """A stream-K launch (no simulator needed): 12 tiles of 256 tokens on 10 SMs, the 2 past the whole wave split, so a
    one-dimensional grid of 10 + 2 x 2 blocks, the tail starting at block 10, a workspace for 2 tiles."""
    monkeypatch.setattr(kernels, "WGMMA_STREAMK", True)
    monkeypatch.setattr(kernels, "WGMMA_TALL", True)
    monkeypatch.setattr(kernels, "multiprocessors", lambda: 10)
    m, n, k = 700, 512, 1024
    tensors = synthetic("qqq", n, k, seed=0)
    launch = kernels.qqq_launch(tensors, np.zeros((m, k), np.int8), np.ones(m, np.float32), wgmma=True)
    start, sums, flags = [a for a in launch.args if not isinstance(a, kernels.TensorMap)][-3:]
    assert launch.name == "qqq_w4a8_wgmma_tall" and launch.grid == (14,) and start == 10
    assert sums.shape == (2 * 128 * 256,) and flags.shape == (4,)


def test_cluster_inbox_fits_exactly_the_shared_memory(monkeypatch):
    """SPLITK_CLUSTER: the leader's inbox of (Z - 1) warps' sums after the partial sums may fill SPLITK_MAX_SHARED
    exactly (12 KiB a copy, 4 blocks: 12 + 3 x 12 = 48 KiB); one byte less and the blocks meet in device memory."""
    monkeypatch.setattr(kernels, "SPLITK_CLUSTER", True)
    monkeypatch.setattr(kernels, "SPLITK_RED", True)
    out = np.zeros((1, 128), np.uint16)

    def launch() -> kernels.Launch:
        """M = 1, N = 128 in 64-channel tiles of 96 sums a lane, 2 copies a block and 4 blocks a tile."""
        return kernels.warp_tile_launch("qqq_w4a8", [], out, 1, 128, 64, 96, 256, 2, 4, False, lambda c: 0)

    assert (launch().cluster, launch().shared_mem, launch().args[-2:]) == (4, 48 * 1024, [None, None])
    monkeypatch.setattr(kernels, "SPLITK_MAX_SHARED", 48 * 1024 - 1)
    assert launch().cluster == 1 and launch().shared_mem == 12 * 1024 and launch().args[-1] is not None


def test_group_division_refuses_k_times_group_of_exactly_2_to_the_32():
    """check_group_division without the simulator: K * group = 2^32 is past the multiply-high, one group less is
    not."""
    kernels.check_group_division(1 << 25, 127)
    with pytest.raises(ValueError, match="K \\* group < 2\\^32"):
        kernels.check_group_division(1 << 25, 128)


def test_stream_fit_reports_the_largest_residual_not_the_mean():
    """Three shapes of 1, 2 and 3 MB at 1, 3 and 2 us: the line 1 us + 0.5 us a MB (2 TB/s), residuals -0.5, 1 and
    -0.5 us, the largest 1 us (their mean of magnitudes would be 0.67)."""
    from quantkit import kernel_bench as kb

    rows = [{"label": "QQQ", "function": "q", "format": "qqq", "m": 1, "bytes_moved": b * 10**6, "seconds": us * 1e-6}
            for b, us in ((1, 1), (2, 3), (3, 2))]
    [fit] = kb.stream_fit({"rows": rows}, 1)
    assert fit["rate_tbps"] == pytest.approx(2.0) and fit["fixed_us"] == pytest.approx(1.0)
    assert fit["residual_us"] == pytest.approx(1.0)


def test_bench_single_round_holds_no_cases_tensors_past_its_timing(monkeypatch):
    """With one round, a case's stored tensors are dropped once it is timed: while the second case is timed the
    first's are gone (with several rounds they are kept, made once)."""
    import weakref

    from quantkit import kernel_bench as kb

    monkeypatch.setattr(kernels, "upload", lambda launch: lambda: None)
    monkeypatch.setattr(kb, "l2_bytes", lambda: 1 << 20)
    monkeypatch.setattr(kb, "baselines", lambda m, n, k, warmup, iters: [])
    refs: list[weakref.ref] = []
    alive: list[list[bool]] = []

    def timing(call, warmup: int, iters: int, torch_graph: bool = False) -> tuple[float, float]:
        """Record which cases' tensors are alive at each timing."""
        alive.append([ref() is not None for ref in refs])
        return 1e-5, 1e-5

    def make(v: kb.Variant) -> dict[str, torch.Tensor]:
        """The case's tensors, watched."""
        tensors = kb.synthetic(v.fmt, 256, 640, group=v.group)
        refs.append(weakref.ref(tensors["qweight"]))
        return tensors

    monkeypatch.setattr(kb, "timing", timing)
    cases = [kb.Case(v.label, 256, 640, v, lambda v=v: make(v)) for v in kb.VARIANTS if v.fmt == "qserve"]
    kb.run_bench(cases, ms=(1,))
    assert alive == [[True], [False, True]]


def test_graph_time_is_the_replays_median_per_captured_call(monkeypatch):
    """graph_time (CuPy's stream capture faked): `fn` runs once to warm, then `calls` times under capture; the result
    is the median replay time over the calls (2^-10 s a replay of 16 calls: 2^-14 s a call)."""
    import sys
    import types

    from quantkit import kernel_bench as kb

    class Stream:
        """A stream that records nothing: capture returns a graph whose launch does nothing."""

        def __init__(self, non_blocking: bool = False) -> None:
            self.captured = types.SimpleNamespace(launch=lambda: None)

        def __enter__(self) -> Stream:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def synchronize(self) -> None:
            """Nothing to wait for."""

        def begin_capture(self) -> None:
            """Capture starts."""

        def end_capture(self) -> types.SimpleNamespace:
            return self.captured

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=Stream)))
    asked = []
    monkeypatch.setattr(kb, "median_time", lambda fn, warmup, iters: asked.append((warmup, iters)) or 2.0 ** -10)
    calls = []
    assert kb.graph_time(lambda: calls.append(1), 16, 5) == 2.0 ** -14
    assert len(calls) == 17 and asked == [(1, 5)]


def test_bench_times_any_precision_up_to_16_tokens(monkeypatch):
    """Any-Precision is timed at decode batches only: M = 16 is one (and takes its 3x bar), M = 17 is not."""
    from quantkit import kernel_bench as kb

    monkeypatch.setattr(kernels, "upload", lambda launch: lambda: None)
    monkeypatch.setattr(kb, "l2_bytes", lambda: 1 << 20)
    monkeypatch.setattr(kb, "timing", lambda call, warmup, iters, torch_graph=False: (1e-5, 1e-5))
    monkeypatch.setattr(kb, "baselines", lambda m, n, k, warmup, iters: [kb.Row(n, k, m, kb.FP16, 4e-5, 1)])
    variants = tuple(v for v in kb.VARIANTS if v.fmt == "anyprec")
    rows = kb.run_bench(kb.shape_cases(((256, 1024),), variants), ms=(16, 17))
    assert sorted((r.m, r.label) for r in rows if r.variant) == [(16, "Any-Precision 3-bit GEMV")]
    assert [(c.row.m, c.requirement, c.met) for c in kb.bars(rows, 1.0)] == [(16, ">= 3.0x cuBLAS FP16", True)]


def test_decode_launches_at_exactly_decode_max_m_tokens():
    """At DECODE_MAX_M (8) tokens Any-Precision takes its one-n8-block kernel (tc8), at 9 the two-block one; the
    LiquidQuant bulk kernel's copies split K's 64-column steps (K = 1024: 16 steps, two copies of 8)."""
    tensors = synthetic("anyprec", 128, 1024)
    names = [kernels.anyprec_launch(tensors, np.zeros((m, 1024), np.float32), 3).name for m in (8, 9)]
    assert names == ["anyprec_gemm_tc8_3_fast_w4", "anyprec_gemm_tc_3_fast_w4"]
    lqq = synthetic("liquidquant", 256, 1024)
    launch = kernels.liquidquant_launch(lqq, np.zeros((1, 1024), np.int8), np.ones(1, np.float32), bulk=True)
    assert (launch.name, launch.grid, launch.block, launch.args[-3]) == ("liquidquant_w4a8_bulk8", (16, 1), 64, 2)


def guarded_copy(a: np.ndarray, before: bool = False) -> np.ndarray:
    """A copy of `a` that ends where a page that can be neither read nor written begins (`before`: that starts where
    such a page ends): the warp simulator reading or writing one byte past it (before it) faults, where a plain array
    would lend it the heap's bytes."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    body = -(-a.nbytes // page) * page
    buf = mmap.mmap(-1, body + page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + (0 if before else body)), ctypes.c_size_t(page), 0) == 0  # PROT_NONE
    copy = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=page if before else body - a.nbytes)
    copy = copy.reshape(a.shape)
    copy[...] = a
    return copy


def run_guarded(launch: kernels.Launch, before: bool, expected: np.ndarray | None = None) -> int | None:
    """Run `launch` in the warp simulator with each of its arrays (inputs and output) a guarded_copy, in a forked
    child, so that a fault (or a store past an array that corrupts the heap) fails the caller rather than ending the
    test run: the child's exit code, 0 when its output is `expected` (by default the plain launch's, run in the child
    after the guarded one), 3 when the bits differ, a negative signal number when it faulted, None when it did not
    end within 2 minutes."""
    import multiprocessing

    copies = {id(a): guarded_copy(a, before) for a in launch.args if isinstance(a, np.ndarray)}
    guarded = kernels.Launch(**{**launch.__dict__, "args": [copies.get(id(a), a) for a in launch.args],
                                "out": copies[id(launch.out)]})

    def child() -> None:
        out = kernels.run(guarded).copy()
        raise SystemExit(0 if np.array_equal(out, kernels.run(launch) if expected is None else expected) else 3)

    kernels.host_library()  # built (or loaded) before the fork
    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(120)
    if process.is_alive():  # hung (a lock held across the fork, say): stop it, and fail with None
        process.kill()
        process.join()
        return None
    return process.exitcode


@needs_compiler
@pytest.mark.parametrize("before", [False, True], ids=["after", "before"])
@pytest.mark.parametrize("path", ["decode", "decode16", "tiled", "wgmma"])
@pytest.mark.parametrize(("fmt", "group"), [("qserve", None), ("qserve", 128), ("qqq", None), ("qqq", 128),
                                            ("liquidquant", 64)])
def test_w4a8_kernels_touch_no_byte_outside_their_arrays(fmt, group, path, before, monkeypatch):
    """At M = 5 (a 16-token tile, a 128-token stage, mostly past M), with every array of the launch ending where an
    inaccessible page begins (or beginning where one ends), every W4A8 path (decode, large M, Hopper) gives the
    emulation's bits and reads or writes no byte outside its arrays. Rows past M are clamped to the last
    (act_row) or zero-filled (copy_rows) and never stored: a kernel that read or stored row M instead would give the
    same outputs from the heap's bytes, and on the GPU fault where the array ends its allocation. decode16: M = 13,
    QServe's and LiquidQuant's kernels of 9 to 16 tokens (two tiles or slices a warp)."""
    m, n, k = 13 if path == "decode16" else 5, 128, 256
    monkeypatch.setattr(kernels, "QSERVE_GEMM16", True)
    tensors = synthetic(fmt, n, k, seed=11, group=group)
    x = activations(m, k, seed=5)
    reference = emulate(fmt, tensors, x)
    tiled, wgmma = {"decode": (False, False), "decode16": (False, False), "tiled": (True, False),
                    "wgmma": (None, True)}[path]
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   tiled=tiled, wgmma=wgmma)
    if path == "decode16" and fmt != "qqq":
        assert launch.name.endswith("16"), launch.name
    code = run_guarded(launch, before, reference.out.view(np.uint16))
    assert code == 0, f"{launch.name}: exit code {code} (1: the simulator stopped it; 3: not the emulation's bits; " \
        "negative: a fault)"


@needs_compiler
@pytest.mark.parametrize("before", [False, True], ids=["after", "before"])
@pytest.mark.parametrize("bulk", [False, True], ids=["registers", "bulk"])
@pytest.mark.parametrize(("fmt", "group"), [("qserve", None), ("qserve", 128), ("qqq", None), ("qqq", 128)])
def test_block_split_touches_no_word_outside_its_workspace(fmt, group, bulk, before):
    """A tile's blocks meeting in device memory (zsplit 2), the workspace's `sums` and `arrived` guarded as every
    other array: the simulator's meeting, through the kernels' own phases, adds into and takes from no slot and
    counts in no tile past them, at M = 20 (two token tiles, so the last tile's slots end the array)."""
    m, n, k = 20, 128, 256
    tensors = synthetic(fmt, n, k, seed=13, group=group)
    x = activations(m, k, seed=6)
    reference = emulate(fmt, tensors, x)
    launch = kernels.LAUNCHES[fmt](tensors, reference.x_int8, reference.s_x, x.sum(axis=1, dtype=np.float32),
                                   splits=2, zsplit=2, bulk=bulk)
    sums, arrived = launch.args[-4:-2] if bulk else launch.args[-2:]
    assert sums is not None and arrived is not None
    code = run_guarded(launch, before, reference.out.view(np.uint16))
    assert code == 0, f"{launch.name}: exit code {code} (1: the simulator stopped it; 3: other bits; negative: a fault)"


@needs_compiler
@pytest.mark.parametrize("before", [False, True], ids=["after", "before"])
@pytest.mark.parametrize(("m", "tiled", "splits"), [(5, False, 2), (5, False, 5), (19, False, 3), (5, True, None)])
def test_atom_kernels_touch_no_byte_outside_their_arrays(m, tiled, splits, before):
    """Atom's small-M kernel (copies taking turns at 6 groups and the two outlier halves, so that copy - groups is
    negative for every copy) and its large-M kernel, every array guarded as in the W4A8 test above: the emulation's
    bits, no byte read or written outside the arrays (an outlier half at a negative index would read 64 bytes before
    the outliers' first row, and give the same outputs from them)."""
    from quantkit.emulate import emulate_atom

    n, k = 32 if not tiled else 64, 128 * 6 + 128
    tensors = synthetic("atom", n, k, seed=m)
    reference = emulate_atom(tensors, activations(m, k, seed=3), 4, 0.9)
    launch = kernels.atom_launch(tensors, reference.x_codes, reference.s_x, tiled=tiled, splits=splits)
    code = run_guarded(launch, before, reference.out.view(np.uint16))
    assert code == 0, f"{launch.name}: exit code {code} (1: the simulator stopped it; 3: not the emulation's bits; " \
        "negative: a fault)"


@needs_compiler
@pytest.mark.parametrize("before", [False, True], ids=["after", "before"])
@pytest.mark.parametrize(("m", "k", "tc"), [(1, 96, False), (9, 2080, False), (1, 2080, True), (13, 1024, True),
                                            (17, 2080, True)])
def test_anyprec_kernels_touch_no_byte_outside_their_arrays(m, k, tc, before):
    """The Any-Precision GEMV (a last chunk of 96 and of 32 columns: lanes past its width hold no words) and the
    tensor-core kernels (checked and fast, one and two token blocks) at every width, every array guarded as in the
    W4A8 test above: the bits of plain arrays, no byte read or written outside the arrays (a lane past the chunk's
    width that loaded its words would read one word past the last channel's last plane, and use none of them)."""
    tensors = synthetic("anyprec", 13, k, seed=k)  # 13 channels: a partial block
    x = activations(m, k, seed=m)
    for bits in range(3, 9):
        launch = kernels.anyprec_launch(tensors, x, bits, tc=tc)
        code = run_guarded(launch, before)
        assert code == 0, f"{launch.name}: exit code {code} (3: other bits than unguarded; negative: a fault)"
