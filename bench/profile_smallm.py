"""Launch each decode kernel once per shape, for a profiler to look at (gpu_check runs it under Nsight Compute).

Every small-M kernel of quantkit bench's variants (and the Any-Precision 3-bit GEMV) at M = 1 on (4096, 4096) and
(28672, 4096), once each, on synthetic tensors. Without a profiler it only launches them.

    ncu --kernel-name regex:'_gemm$|_gemv$' --section SpeedOfLight --section WarpStateStats \\
        python3 bench/profile_smallm.py
"""

from __future__ import annotations

from dataclasses import replace

SHAPES = ((4096, 4096), (28672, 4096))


def main() -> None:
    from quantkit import kernels
    from quantkit.kernel_bench import PATHS, VARIANTS, synthetic, variant_launch

    for n, k in SHAPES:
        for v in VARIANTS:
            v = replace(v, path=next(iter(PATHS[v.fmt])))  # the decode kernel (Any-Precision: the GEMV)
            launch = variant_launch(v, synthetic(v.fmt, n, k, group=v.group), 1, k)
            call = kernels.upload(launch)
            call()
            call.result()
            print(f"{v.label}: {launch.name} grid {launch.grid} block {launch.block} on {n} x {k}", flush=True)


if __name__ == "__main__":
    main()
