"""Launch each decode kernel once per shape, for a profiler to look at (gpu_check runs it under Nsight Compute).

Every small-M kernel of quantkit bench's variants (and both Any-Precision 3-bit kernels, the GEMV and the
tensor-core one) at M = 1 on (4096, 4096) and (28672, 4096), once each, on synthetic tensors; --formats keeps some
layouts only, --shapes and --ms set the shapes and token counts (M = 16 against M = 1 on 4096 x 14336 shows what
re-reading 16 rows of activations a step costs); --large the Hopper (wgmma) kernels at M = 1024 instead. Without a
profiler it only launches them.

    ncu --kernel-name regex:'_gemm(8|16|_pc)?(_z[24])?$|_gemv$|_tc8?_3(_fast)?(_w4)?$' --section SpeedOfLight \\
        --section WarpStateStats python3 bench/profile_smallm.py [--formats anyprec,...] [--shapes NxK,...]
        [--ms 1,16] [--large]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

SHAPES = "4096x4096,28672x4096"


def main() -> None:
    from quantkit import kernels
    from quantkit.kernel_bench import PATHS, VARIANTS, parse_shapes, synthetic, variant_launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", help="comma-separated layouts (qserve, qqq, liquidquant, atom, anyprec)")
    parser.add_argument("--shapes", default=SHAPES, help=f"NxK,... or a set quantkit bench knows (default {SHAPES})")
    parser.add_argument("--ms", default="1", help="token counts of the decode kernels (default 1)")
    parser.add_argument("--large", action="store_true", help="the Hopper (wgmma) kernels at M = 1024 instead")
    args = parser.parse_args()
    formats, ms = args.formats, [1024] if args.large else [int(m) for m in args.ms.split(",")]
    for n, k in parse_shapes(args.shapes):
        for v in VARIANTS:
            if formats and v.fmt not in formats.split(","):
                continue
            if args.large:
                paths = ["wgmma"] if "wgmma" in PATHS[v.fmt] else []
            else:  # the decode kernel (the first path); for Any-Precision both, the GEMV and the tensor-core kernel
                paths = list(PATHS[v.fmt]) if v.fmt == "anyprec" else [next(iter(PATHS[v.fmt]))]
            tensors = synthetic(v.fmt, n, k, group=v.group) if paths else None
            for path, m in ((path, m) for path in paths for m in ms):
                launch = variant_launch(replace(v, path=path), tensors, m, k)
                call = kernels.upload(launch)
                call()
                call.result()
                print(f"{v.label} ({path}): {launch.kernel} grid {launch.grid} block {launch.block} on {n} x {k}, "
                      f"M = {m}", flush=True)


if __name__ == "__main__":
    main()
