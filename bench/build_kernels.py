"""Build the kernel modules with NVRTC ahead of a device run, exactly as quantkit.kernels builds them on a GPU, on a
machine with no GPU: every module for the device's architecture (sm_90: H100, H200) and the W4A8 modules also for
sm_90a (the wgmma and bulk kernels), under the built-in knobs and under each named tuning configuration's defines
(bench/smallm_tune.py's tables).

The cubins go to $QUANTKIT_CACHE/kernels, where quantkit.kernels finds them (module_cubin). Carried to a lent device
(QUANTKIT_CACHE a folder of the repository that git ignores, named in the device tool's carry and exported there),
they spare its processes the NVRTC builds: about 40 s of one core a set of knobs, paid again by every tuning
configuration. They are keyed by the sources, the defines and NVRTC's major.minor version: a device whose NVRTC
differs builds its own, as without them. It exits 1 when a module does not build, with NVRTC's log, so it is also
the check that the kernels build with the device's compiler, before the device is spent on finding out.

    PYTHONPATH=. python bench/build_kernels.py [--arch sm_90] [--configs NAME,...] [--large-configs NAME,...]
                                               [--defines "NAME=VALUE ..."] [--modules NAME,...] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from quantkit import kernels


def build(job: tuple[str, str, tuple[str, ...]]) -> tuple[str, float, int, bool]:
    """Build one (module, arch, defines) unless its cubin is cached; return (error or "", seconds, bytes, built)."""
    name, arch, defines = job
    t0 = time.perf_counter()
    try:
        cached = kernels.cubin_path(name, arch, defines).exists()
        cubin = kernels.module_cubin(name, arch, defines)
    except kernels.KernelUnavailable as e:
        return str(e), time.perf_counter() - t0, 0, True
    return "", time.perf_counter() - t0, cubin.stat().st_size, not cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90", help="the device's architecture (default sm_90, an H100 or H200; "
                        "Hopper also gets the sm_90a builds)")
    parser.add_argument("--configs", default="", help="also build under these bench/smallm_tune.py configurations "
                        "(comma-separated names, all, or pending: those not yet timed)")
    parser.add_argument("--large-configs", default="", help="and these of its --large table (sm_90a builds only; "
                        "names, all, or pending)")
    parser.add_argument("--defines", default="", help="and these knobs (NAME=VALUE, space-separated, as "
                        "QUANTKIT_NVRTC_DEFINES takes them), e.g. the merged ones a tuning run found fastest")
    parser.add_argument("--modules", default=",".join(kernels.MODULES), help="the kernels/ modules to build "
                        "(default all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="builds at once (default: every core)")
    args = parser.parse_args()
    try:
        from cupy_backends.cuda.libs import nvrtc

        version = nvrtc.getVersion()
    except Exception as e:  # CuPy absent, or its NVRTC library
        sys.exit(f"needs CuPy with NVRTC: pip install cupy-cuda13x nvidia-cuda-nvrtc==13.0.* ({e})")
    from smallm_tune import config_names, defines_of

    def names(text: str, large: bool) -> list[str]:
        try:
            return config_names(text, large) if text else []
        except ValueError as e:
            parser.error(str(e))

    modules = args.modules.split(",")
    if unknown := sorted(set(modules) - set(kernels.MODULES)):
        parser.error(f"unknown modules {', '.join(unknown)}; there are {', '.join(kernels.MODULES)}")
    # (defines, label, sm_90 too): the built-in knobs, each named configuration's, --defines
    sets = [((), "built-in", True), *((tuple(defines_of(n).split()), n, True) for n in names(args.configs, False)),
            *((tuple(defines_of(n, True).split()), n, False) for n in names(args.large_configs, True))]
    if args.defines:
        sets.append((tuple(args.defines.split()), "--defines", True))
    # each build once, labelled with what takes it: a module's build keeps only the knobs it reads (module_defines),
    # so a configuration of one layout's knobs shares the other modules' builds
    jobs: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
    for defines, label, plain in sets:
        for name in modules:
            archs = [args.arch] if plain else []
            if args.arch == "sm_90" and name in kernels.HOPPER_MODULES:  # Hopper: the wgmma and bulk kernels too
                archs.append(kernels.HOPPER_ARCH)
            for arch in archs:
                jobs.setdefault((name, arch, kernels.module_defines(name, defines)), []).append(label)
    print(f"NVRTC {version[0]}.{version[1]}: {len(jobs)} builds into {kernels.default_cache_dir() / 'kernels'}",
          flush=True)
    failed = 0
    with ProcessPoolExecutor(max(1, min(args.jobs, len(jobs)))) as pool:
        futures = {pool.submit(build, job): job for job in jobs}
        for future in as_completed(futures):
            name, arch, defines = futures[future]
            error, seconds, size, built = future.result()
            label = f"{name} {arch} [{', '.join(dict.fromkeys(jobs[name, arch, defines]))}]"
            if error:
                failed += 1
                print(f"FAILED {label}: {error}", flush=True)
            else:
                print(f"{label}: {f'built in {seconds:.0f} s' if built else 'cached'}, {size / 1024:.0f} KiB",
                      flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
