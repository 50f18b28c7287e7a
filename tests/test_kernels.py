"""The CUDA kernels of kernels/: their lane arithmetic run by the warp simulator on the CPU against the numpy
emulation (bit for bit), and, on a machine with a CUDA device and CuPy, the GPU kernels against the same."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from quantkit import kernels
from quantkit.emulate import emulate
from quantkit.formats import qserve_layout

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="the warp simulator compiles the kernels with a host C++ compiler "
                                    "(g++ or c++), and none is on PATH")
needs_gpu = pytest.mark.skipif(not kernels.cuda_available(),
                               reason="needs a CUDA device and CuPy (pip install 'quantkit[cuda]')")


def qserve_tensors(n: int, k: int, group: int | None, seed: int = 0, extreme: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Random stored QServe tensors; `extreme`: codes and scales at the ends of their ranges (z * s2 = 128)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    s1 = (torch.rand(n, generator=g) * 0.02 + 1e-4).half()
    tensors = {"qweight": qserve_layout.pack_qweight(codes), "s1_scales": s1}
    if group is None:
        tensors["s1_szeros"] = (torch.rand(n, generator=g) * 8 * s1.float()).half()
        return tensors
    s2 = torch.randint(1, 18, (n, k // group), generator=g)
    zero = torch.minimum(torch.randint(0, 16, (n, k // group), generator=g), 128 // s2)
    if extreme:
        codes = torch.where(torch.rand(n, k, generator=g) < 0.5, 0, 15)
        tensors["qweight"] = qserve_layout.pack_qweight(codes)
        s2, zero = torch.full_like(s2, 8), torch.full_like(zero, 16).clamp(max=15)  # q*s2 up to 120, -z*s2 = -120
        s2[0], zero[0] = 127, 1  # (15 - 1) * 127 wraps in the byte lane exactly as the reference
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
    tensors = qserve_tensors(n, k, group, seed=m + n + k)
    x = activations(m, k, seed=k)
    reference = emulate("qserve", tensors, x)
    t_x = x.sum(axis=1, dtype=np.float32)
    out = kernels.gemm("qserve", tensors, reference.x_int8, reference.s_x, t_x)
    assert out.dtype == np.float16 and out.shape == (m, n)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_compiler
def test_qserve_group_kernel_wraps_bytes_as_the_reference():
    """Codes at 0 and 15 with the largest scales and zeros: every byte lane of q * s2 - z * s2 at its extremes."""
    tensors = qserve_tensors(64, 256, 128, seed=7, extreme=True)
    x = activations(4, 256, seed=1)
    reference = emulate("qserve", tensors, x)
    out = kernels.gemm("qserve", tensors, reference.x_int8, reference.s_x)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_compiler
def test_simulator_fp16_rounding_is_round_to_nearest_even():
    """The simulator's float -> fp16 conversion (the epilogue's last step) agrees with numpy's on hard cases."""
    tensors = qserve_tensors(32, 128, None, seed=3)
    tensors["s1_scales"] = torch.full((32,), 1.0).half()
    tensors["s1_szeros"] = torch.zeros(32).half()
    x_int8 = np.zeros((3, 128), dtype=np.int8)
    x_int8[:, 0] = 1  # acc = code of column 0 of each channel: s_x then sets the product exactly
    s_x = np.array([2049.0 / 15, 65519.0 / 15, 6e-8], dtype=np.float32)  # ties, overflow edge, subnormals
    codes = qserve_layout.unpack_qweight(tensors["qweight"]).numpy().astype(np.float32)
    expected = ((codes[:, 0][None, :] * np.float32(1.0)) * s_x[:, None]).astype(np.float16)
    out = kernels.gemm("qserve", tensors, x_int8, s_x, np.zeros(3, dtype=np.float32))
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


def liquidquant_tensors(n: int, k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random stored LiquidQuant tensors: every group's (min, step) drawn over the whole range, its codes up to
    the largest that keeps u * s + 128 + min in the byte (the quantizer's bound)."""
    from quantkit.formats import liquidquant

    rng = np.random.default_rng(seed)
    mins = rng.integers(-128, 128, (n, k // 64))
    steps = rng.integers(1, 17, (n, k // 64))
    bound = np.minimum(15, (127 - mins) // steps)
    u = (rng.random((n, k)) * (np.repeat(bound, 64, axis=1) + 1)).astype(np.int64)
    u[:, ::64] = np.repeat(bound, 1, axis=1)  # every group reaches its bound
    sa = np.stack([steps, 128 + mins], axis=-1).astype(np.uint8).reshape(n // 64, 64, k // 64, 2)
    return {"qweight": torch.from_numpy(liquidquant.pack_codes(u)),
            "s2a": torch.from_numpy(np.ascontiguousarray(sa.transpose(0, 2, 1, 3))),
            "s1_scales": torch.from_numpy(rng.random(n).astype(np.float32) * 0.01 + 1e-4).half()}


@needs_compiler
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (7, 128, 192), (40, 64, 128)])
def test_liquidquant_kernel_matches_the_emulation(m, n, k):
    tensors = liquidquant_tensors(n, k, seed=m + n + k)
    x = activations(m, k, seed=m)
    reference = emulate("liquidquant", tensors, x)
    out = kernels.gemm("liquidquant", tensors, reference.x_int8, reference.s_x)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


def qqq_tensors(n: int, k: int, grouped: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random stored QQQ tensors: codes over their whole range; group ratios up to 127/8, so round(q * r) spans
    the INT8 range, with exact halves (ties) among them."""
    from quantkit.formats import qqq

    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (k, n)) if grouped else rng.integers(-7, 8, (k, n))
    s_channel = (rng.random((1, n)) * 1e-3 + 1e-5).astype(np.float32)
    tensors = {"B": torch.from_numpy(qqq.pack_b(codes, per_group=grouped)),
               "s_channel": torch.from_numpy(qqq.permute_columns(s_channel, qqq.SCALE_PERM_SINGLE))}
    if grouped:
        r = (rng.random((k // 128, n)) * 127 / 8).astype(np.float16)
        r[0, :8] = [0.5, 1.5, 2.5, 15.875, 0.0625, 3.25, 7.5, 0.125]  # q * r lands on .5 for odd q
        tensors["s_group"] = torch.from_numpy(qqq.permute_columns(r, qqq.SCALE_PERM))
    return tensors


@needs_compiler
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (9, 128, 256), (20, 64, 384)])
def test_qqq_kernel_matches_the_emulation(m, n, k, grouped):
    tensors = qqq_tensors(n, k, grouped, seed=m + n + k)
    x = activations(m, k, seed=m)
    reference = emulate("qqq", tensors, x)
    out = kernels.gemm("qqq", tensors, reference.x_int8, reference.s_x)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


def atom_tensors(n: int, groups: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random stored Atom tensors: INT4 codes over [-8, 7], INT8 outliers over [-128, 127], a random reorder."""
    from quantkit.formats import atom

    rng = np.random.default_rng(seed)
    k = 128 * groups + 128
    s4 = (rng.random((groups, n)) * 0.05 + 1e-3).astype(np.float16)
    s8 = (rng.random(n) * 0.01 + 1e-4).astype(np.float16)
    return {"reorder_index": torch.from_numpy(rng.permutation(k)),
            "weight_int4": torch.from_numpy(rng.integers(0, 256, (n, 64 * groups)).astype(np.uint8)),
            "weight_int8": torch.from_numpy(rng.integers(-128, 128, (n, 128)).astype(np.int8)),
            "scale_int4": torch.from_numpy(atom.scatter_scales(s4)),
            "scale_int8": torch.from_numpy(atom.scatter_scales(s8))}


@needs_compiler
@pytest.mark.parametrize("m,n,groups", [(1, 16, 1), (6, 32, 2), (19, 48, 3)])
def test_atom_kernel_matches_the_emulation(m, n, groups):
    from quantkit.emulate import emulate_atom

    tensors = atom_tensors(n, groups, seed=m + n)
    x = activations(m, 128 * groups + 128, seed=n)
    reference = emulate_atom(tensors, x, 4, 0.9)
    out = kernels.atom_gemm(tensors, reference.x_codes, reference.s_x)
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


def anyprec_tensors(n: int, k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random 8-plane bitplanes with a table for every width 3..8."""
    from quantkit.formats.anyprec_layout import pack_planes

    rng = np.random.default_rng(seed)
    tensors = {"qweight": torch.from_numpy(pack_planes(rng.integers(0, 256, (n, k)), 8))}
    for bits in range(3, 9):
        tensors[f"lut{bits}"] = torch.from_numpy(np.sort(rng.standard_normal((n, 1 << bits)), axis=1)
                                                 .astype(np.float16))
    return tensors


@needs_compiler
@pytest.mark.parametrize("m,k", [(1, 96), (3, 1024), (9, 2080), (2, 576)])
def test_anyprec_kernel_matches_the_emulation_at_every_width(m, k):
    from quantkit.emulate import emulate_anyprec

    tensors = anyprec_tensors(8, k, seed=k)
    x = activations(m, k, seed=m)
    for bits in range(3, 9):
        _, reference = emulate_anyprec(tensors, x, bits)
        out = kernels.anyprec_gemv(tensors, x, bits)
        np.testing.assert_array_equal(out.view(np.uint16), reference.view(np.uint16), err_msg=f"{bits} bits")


@needs_gpu
@pytest.mark.parametrize("group", [None, 128])
def test_qserve_gpu_kernel_matches_the_emulation(group):
    tensors = qserve_tensors(256, 512, group, seed=11)
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
    if mma is None:  # a CUDA-core kernel: its warp reduction instead
        assert "shfl.sync.bfly" in ptx.read_text()
        return
    kind = "s4.s4" if mma == "m16n8k64" else "s8.s8"
    assert f"mma.sync.aligned.{mma}.row.col.s32.{kind}.s32" in ptx.read_text()


@needs_gpu
def test_liquidquant_gpu_kernel_matches_the_emulation():
    tensors = liquidquant_tensors(256, 512, seed=5)
    x = activations(40, 512, seed=3)
    reference = emulate("liquidquant", tensors, x)
    out = kernels.gemm("liquidquant", tensors, reference.x_int8, reference.s_x, device="cuda")
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_gpu
@pytest.mark.parametrize("grouped", [False, True])
def test_qqq_gpu_kernel_matches_the_emulation(grouped):
    tensors = qqq_tensors(256, 512, grouped, seed=9)
    x = activations(24, 512, seed=4)
    reference = emulate("qqq", tensors, x)
    out = kernels.gemm("qqq", tensors, reference.x_int8, reference.s_x, device="cuda")
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_gpu
def test_atom_gpu_kernel_matches_the_emulation():
    from quantkit.emulate import emulate_atom

    tensors = atom_tensors(64, 3, seed=1)
    x = activations(20, 512, seed=6)
    reference = emulate_atom(tensors, x, 4, 0.9)
    out = kernels.atom_gemm(tensors, reference.x_codes, reference.s_x, device="cuda")
    np.testing.assert_array_equal(out.view(np.uint16), reference.out.view(np.uint16))


@needs_gpu
def test_anyprec_gpu_kernel_matches_the_emulation():
    from quantkit.emulate import emulate_anyprec

    tensors = anyprec_tensors(64, 2080, seed=2)
    x = activations(11, 2080, seed=8)
    for bits in range(3, 9):
        _, reference = emulate_anyprec(tensors, x, bits)
        out = kernels.anyprec_gemv(tensors, x, bits, device="cuda")
        np.testing.assert_array_equal(out.view(np.uint16), reference.view(np.uint16), err_msg=f"{bits} bits")
