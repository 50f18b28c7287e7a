"""The CUDA kernels of `kernels/` (shipped as quantkit.data.kernels): on a GPU through CuPy, and on the CPU through
quantkit's warp simulator, which compiles the same sources with the host C++ compiler (kernels/host_sim.cpp) so
that the kernels' own index and integer arithmetic is checked bit for bit against quantkit.emulate without a GPU.

Both entry points take one linear's stored tensors exactly as the packer wrote them, plus per-token INT8
activations and their scales (and, for QServe per channel, the per-token sums of the unquantized activations).
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.models.source import default_cache_dir
from quantkit.resources import data_path

HOST_SOURCES = ("host_sim.cpp", "qk_common.cuh", "qserve_w4a8.cu")


class KernelUnavailable(QuantkitError):
    """The kernels cannot run here (no CUDA device or CuPy; no host C++ compiler for the simulator)."""


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
    digest = hashlib.sha256(b"".join((src / name).read_bytes() for name in HOST_SOURCES)).hexdigest()[:16]
    lib = default_cache_dir() / "kernels" / f"libqk_host-{digest}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{digest}.tmp")
        cmd = [compiler, "-O2", "-std=c++17", "-ffp-contract=off", "-fPIC", "-shared", str(src / "host_sim.cpp"),
               "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelUnavailable(f"building the warp simulator failed:\n{done.stderr[-2000:]}")
        tmp.replace(lib)
    _HOST = ctypes.CDLL(str(lib))
    return _HOST


def _ptr(a: np.ndarray | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if a is None else a.ctypes.data)


def _qserve_operands(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray | int | None]:
    """The stored QServe tensors as the kernel reads them (contiguous, bit patterns kept)."""
    qweight = tensors["qweight"].contiguous().view(torch.uint8).numpy()
    n, k = qweight.shape[0], qweight.shape[1] * 2
    grouped = "s2_scales" in tensors

    def half_bits(t: torch.Tensor) -> np.ndarray:
        return np.ascontiguousarray(t.to(torch.float16).view(torch.int16).numpy().view(np.uint16))

    return {
        "qweight": np.ascontiguousarray(qweight), "s1": half_bits(tensors["s1_scales"]),
        "szero": None if grouped else half_bits(tensors["s1_szeros"]),
        "s2": np.ascontiguousarray(tensors["s2_scales"].numpy()) if grouped else None,
        "z2": np.ascontiguousarray(tensors["s2_zeros"].numpy()) if grouped else None,
        "n": n, "k": k, "group": k // tensors["s2_scales"].shape[0] if grouped else 0,
    }


def qserve_gemm_host(tensors: dict[str, torch.Tensor], x_int8: np.ndarray, s_x: np.ndarray,
                     t_x: np.ndarray | None = None) -> np.ndarray:
    """The QServe W4A8 kernel (kernels/qserve_w4a8.cu) run by the warp simulator: fp16 out [M, N]."""
    ops = _qserve_operands(tensors)
    x = np.ascontiguousarray(x_int8, dtype=np.int8)
    m = x.shape[0]
    if x.shape[1] != ops["k"]:
        raise ValueError(f"activations have {x.shape[1]} columns, the weight {ops['k']}")
    s_x = np.ascontiguousarray(s_x, dtype=np.float32)
    t_x = None if ops["szero"] is None else np.ascontiguousarray(t_x, dtype=np.float32)
    out = np.zeros((m, ops["n"]), dtype=np.uint16)
    host_library().qserve_w4a8_gemm_host(
        _ptr(x), _ptr(s_x), _ptr(t_x), _ptr(ops["qweight"]), _ptr(ops["s1"]), _ptr(ops["szero"]), _ptr(ops["s2"]),
        _ptr(ops["z2"]), _ptr(out), ctypes.c_int(m), ctypes.c_int(ops["n"]), ctypes.c_int(ops["k"]),
        ctypes.c_int(ops["group"]))
    return out.view(np.float16)


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


def _module(name: str):
    """The CuPy RawModule of kernels/NAME.cu (compiled by NVRTC on first use, cached by CuPy)."""
    if not cuda_available():
        raise KernelUnavailable("the CUDA kernels need CuPy (pip install 'quantkit[cuda]') and a CUDA device")
    import cupy

    src = source_dir()
    return cupy.RawModule(code=(src / f"{name}.cu").read_text(), options=("-std=c++17", f"-I{src}"))


NULL = np.uint64(0)  # a null pointer argument for a CuPy kernel


def qserve_gemm_cuda(tensors: dict[str, torch.Tensor], x_int8: np.ndarray, s_x: np.ndarray,
                     t_x: np.ndarray | None = None) -> np.ndarray:
    """The QServe W4A8 kernel on the GPU: fp16 out [M, N] (copied back to the host)."""
    import cupy

    ops = _qserve_operands(tensors)
    m, n, k = x_int8.shape[0], ops["n"], ops["k"]
    t_x = None if ops["szero"] is None else np.ascontiguousarray(t_x, dtype=np.float32)

    def dev(a: np.ndarray | None):
        return NULL if a is None else cupy.asarray(a)

    out = cupy.zeros((m, n), dtype=cupy.uint16)
    kernel = _module("qserve_w4a8").get_function("qserve_w4a8_gemm")
    kernel((n // 32, (m + 15) // 16), (32,),
           (dev(np.ascontiguousarray(x_int8, dtype=np.int8)), dev(np.ascontiguousarray(s_x, dtype=np.float32)),
            dev(t_x), dev(ops["qweight"]), dev(ops["s1"]), dev(ops["szero"]), dev(ops["s2"]), dev(ops["z2"]), out,
            np.int32(m), np.int32(n), np.int32(k), np.int32(ops["group"])))
    return cupy.asnumpy(out).view(np.float16)
