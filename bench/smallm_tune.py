"""Tune the small-M (decode) kernels on a GPU: their look-ahead and split-K budget, side by side in one run.

Every W4A8 small-M kernel (QServe per channel and g128, LiquidQuant, QQQ per channel and g128) and Atom's on
Llama-3-8B's shapes at M = 1 and 16, under each configuration of
  - QK_SMALLM_AHEAD: K steps' loads per round into registers (compile time, kernels/qk_common.cuh
    pipelined_steps),
  - SPLITK_WARPS and SPLITK_MIN_STEPS: how far split-K spreads a small grid (quantkit/kernels.py, per launch).
Each configuration runs in a process of its own (NVRTC builds the kernels once per process, with
QUANTKIT_NVRTC_DEFINES), on synthetic tensors made once for all of them (in parallel). It first checks each kernel
against the emulation bit for bit at a split shape, then times it as `quantkit bench` does (CUDA-graph replays,
operands rotating past the L2 cache). Prints one table (microseconds; the fastest configuration of each row
marked) and the total per configuration; --json keeps it all.

    PYTHONPATH=. python3 bench/smallm_tune.py [--json FILE] [--ms 1,16] [--configs NAME,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name: (compile-time defines, SPLITK_WARPS, SPLITK_MIN_STEPS); the first is the built-in default. Six H200 runs
# (README, "CUDA kernels"; bench/results/kernels_h200_smallm_tune.json) also tried the next round's register loads
# issued before this round's MMAs (look-aheads 2 and 4), split budgets of 1024, 3072 and 4096 warps and at least 16
# steps a warp, cp.async into per-thread shared-memory slots (4 or 6 steps ahead), rounds of equal size, the
# epilogue's scales prefetched to L2 and the activations loaded at their step's MMAs (8, 12 or 16 steps a round):
# none was faster than 8 plain loads a round over 2048 warps of at least 8 steps (16 steps: the same within 0.3%),
# and they are gone. (Per kernel, 6 a round is 2% faster in total for QServe per channel, and 6% at K = 14336.)
CONFIGS: dict[str, tuple[dict[str, int], int, int]] = {
    "U8": ({"QK_SMALLM_AHEAD": 8}, 2048, 8),
    "U6": ({"QK_SMALLM_AHEAD": 6}, 2048, 8),
    "U8-pc6": ({"QK_SMALLM_AHEAD": 8, "QK_QSERVE_PC_AHEAD": 6}, 2048, 8),  # QServe per channel: rounds of 6
}
CHECK_SHAPE = (256, 4096)  # (N, K): few tiles and many K steps, so the check runs split


def variants():
    """The tuned kernels: each variant of quantkit bench on its small-M path (Any-Precision's GEMV left out)."""
    from dataclasses import replace

    from quantkit.kernel_bench import PATHS, VARIANTS

    return [replace(v, path="small-M") for v in VARIANTS if "small-M" in PATHS[v.fmt]]


def make_tensors(job: tuple[int, int, int, Path]) -> None:
    """Synthetic tensors of variant i at (N, K), saved under `cache` (a pool worker)."""
    import torch

    from quantkit.kernel_bench import synthetic

    i, n, k, cache = job
    v = variants()[i]
    torch.save(synthetic(v.fmt, n, k, seed=3 if (n, k) == CHECK_SHAPE else 0, group=v.group),
               cache / f"{i}-{n}x{k}.pt")


def worker(name: str, ms: tuple[int, ...], cache: Path) -> dict:
    """One configuration, in this process (its defines already in the environment): check, then time."""
    import numpy as np
    import torch

    from quantkit import kernel_bench, kernels
    from quantkit.kernel_bench import emulated_out, rotation, timing, variant_launch, weight_bytes

    _, warps, min_steps = CONFIGS[name]
    kernels.SPLITK_WARPS, kernels.SPLITK_MIN_STEPS = warps, min_steps
    results, checked, threads = {}, {}, {}
    for i, v in enumerate(variants()):
        n, k = CHECK_SHAPE
        tensors = torch.load(cache / f"{i}-{n}x{k}.pt")
        launch = variant_launch(v, tensors, 3, k, seed=4)
        out = kernels.run(launch, "cuda").view(np.uint16)
        checked[v.label] = bool(np.array_equal(out, emulated_out(v.fmt, tensors, launch)))
        for n, k in kernel_bench.SHAPE_SETS["llama3-8b"]:
            tensors = torch.load(cache / f"{i}-{n}x{k}.pt")
            for m in ms:
                launch = variant_launch(v, tensors, m, k)
                call = rotation(lambda _, launch=launch: kernels.upload(launch), weight_bytes(tensors, v))
                seconds, _ = timing(call, 10, 50)
                results[f"{v.label}|{n}x{k}|{m}"] = seconds
                threads[f"{v.label}|{n}x{k}|{m}"] = launch.block  # 32 x warps: the split count shows here
    return {"config": name, "checked": checked, "seconds": results, "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write every configuration's times here")
    parser.add_argument("--ms", default="1,16", help="token counts (default 1,16)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which configurations, by name")
    parser.add_argument("--limit", type=float, default=120, help="seconds per configuration before it is skipped")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/quantkit-smallm-tune"),
                        help="where the synthetic tensors are kept between the configurations")
    parser.add_argument("--best", type=Path, help="write the fastest configuration's QUANTKIT_NVRTC_DEFINES here "
                        "(the one with the least total time among those that match the emulation; empty when it is "
                        "the built-in default, whose builds are cached already)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ms = tuple(int(m) for m in args.ms.split(","))
    if args.worker:
        print(json.dumps(worker(args.worker, ms, args.cache)))
        return
    from concurrent.futures import ProcessPoolExecutor

    from quantkit.kernel_bench import SHAPE_SETS

    args.cache.mkdir(parents=True, exist_ok=True)
    jobs = [(i, n, k, args.cache) for i in range(len(variants())) for n, k in (*SHAPE_SETS["llama3-8b"], CHECK_SHAPE)
            if not (args.cache / f"{i}-{n}x{k}.pt").exists()]
    with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1) or 1) as pool:
        list(pool.map(make_tensors, jobs))
    runs = []
    for name in args.configs.split(","):
        defines = " ".join(f"{key}={value}" for key, value in CONFIGS[name][0].items())
        env = {**os.environ, "PYTHONPATH": str(REPO), "QUANTKIT_NVRTC_DEFINES": defines}
        try:
            done = subprocess.run([sys.executable, __file__, "--worker", name, "--ms", args.ms, "--cache",
                                   str(args.cache)], env=env, capture_output=True, text=True, timeout=args.limit,
                                  cwd=REPO)
        except subprocess.TimeoutExpired:
            print(f"{name}: over {args.limit:.0f} s, skipped", flush=True)
            continue
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-3000:]}", flush=True)
            continue
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        bad = [label for label, ok in runs[-1]["checked"].items() if not ok]
        print(f"{name} ({defines}, SPLITK_WARPS {CONFIGS[name][1]}, SPLITK_MIN_STEPS {CONFIGS[name][2]}): "
              f"{'MISMATCH ' + ', '.join(bad) if bad else 'every kernel matches the emulation'}", flush=True)
    if not runs:
        sys.exit(1)
    names = [r["config"] for r in runs]
    print("\nmicroseconds per call (CUDA-graph replays); in brackets the block's threads (32 x warps)")
    print("\n| kernel | N x K | M | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for key in runs[0]["seconds"]:
        times = [r["seconds"].get(key) for r in runs]
        best = min(t for t in times if t is not None)
        label, shape, m = key.split("|")
        cells = ["-" if t is None else f"{'**' if t == best else ''}{t * 1e6:.1f}{'**' if t == best else ''} "
                 f"[{r['threads'][key]}]" for t, r in zip(times, runs, strict=True)]
        print(f"| {label} | {shape} | {m} | " + " | ".join(cells) + " |")
    print("\n| config | total us (every row) |\n|---|---|")
    for r in runs:
        print(f"| {r['config']} | {sum(r['seconds'].values()) * 1e6:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    good = [r for r in runs if all(r["checked"].values())]
    if args.best and good:
        best = min(good, key=lambda r: sum(r["seconds"].values()))
        defines = CONFIGS[best["config"]][0]
        args.best.write_text("" if best["config"] == next(iter(CONFIGS))
                             else " ".join(f"{key}={value}" for key, value in defines.items()))
        print(f"\nfastest: {best['config']}")
    sys.exit(any(not ok for r in runs for ok in r["checked"].values()))


if __name__ == "__main__":
    main()
