"""Where a decode kernel's time goes, phase by phase: the small-M kernels built with QK_TIMELINE
(kernels/qk_timeline.cuh), each warp stamping %globaltimer when it enters its K loop, when its first step's MMAs
issue (its first loads returned), when the loop ends, when its block's split-K sums are added, when the tile's
blocks meet and when its stores issue.

`quantkit bench` says how long a kernel takes and Nsight Compute what its units did in total; neither says whether
the microseconds a small kernel spends beyond a plain read of its weights (at 4096 x 4096 and M = 1, some 2.7 us of
QServe per channel's 7.5 on an H100) go to the launch, the first loads' latency, the stream, the split-K reductions
or the epilogue. Each case runs `--reps` single launches, each after a write of twice the L2 cache (so the weights
come from device memory); its row is the median, over the launches, of each phase's median and latest warp, in us
from the earliest warp's start. The read floor (`quantkit bench`'s stream_read, stamped the same way) comes first.
The instrumented kernels' outputs are checked against the emulation at the first shape, as bench/smallm_tune.py
checks its configurations.

    PYTHONPATH=. python3 bench/timeline.py [--shapes 4096x4096,28672x4096] [--ms 1,16] [--formats F,...]
                                           [--reps 20] [--json FILE]

Needs a CUDA GPU and CuPy; bench/build_kernels.py --defines QK_TIMELINE=1 builds its modules ahead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from quantkit.files import atomic_write

DEFINE = "QK_TIMELINE=1"
WARPS, SLOTS = 16, 16  # qk_timeline.cuh: QK_TIMELINE_WARPS, QK_TIMELINE_SLOTS
PHASES = ("start", "first", "loop", "reduced", "met", "stored")  # slots 0 .. 5 (QK_T_START ..)
SM_SLOT, CLOCK_SLOT = 7, 8  # QK_T_SM, QK_T_CLOCK
STAMPED = ("qserve", "liquidquant", "qqq", "anyprec")  # the layouts whose small-M kernels stamp (not Atom's)


def floor_source() -> str:
    """quantkit bench's read floor (stream_read) with the kernels' phase stamps."""
    from quantkit.kernel_bench import STREAM_READ

    return '#include "qk_timeline.cuh"\n' + STREAM_READ


def summarize(stamps: np.ndarray) -> dict:
    """One launch's stamps ([blocks, WARPS, SLOTS] uint64, zero where no warp wrote) -> per phase the median and
    latest warp in us from the earliest start (None where no warp reached it), the warps and SMs that ran, the most
    warps on one SM, the median cycles from a warp's start to its first step's MMAs and to its loop's end, and the
    finest step between globaltimer values seen (its resolution, or an upper bound on it)."""
    warps = stamps.reshape(-1, SLOTS)
    warps = warps[warps[:, 0] != 0]
    if not len(warps):
        raise ValueError("no warp stamped its start: was the kernel built with QK_TIMELINE?")
    t0 = int(warps[:, 0].min())
    out: dict = {"warps": len(warps)}
    for p, name in enumerate(PHASES):
        reached = warps[warps[:, p] != 0, p].astype(np.int64) - t0
        out[name] = [float(np.median(reached)) / 1e3, float(reached.max()) / 1e3] if len(reached) else None
    sms = warps[:, SM_SLOT].astype(np.int64)
    out["sms"] = len(np.unique(sms))
    out["warps_per_sm"] = int(np.bincount(sms).max())
    for p, name in ((1, "first_cycles"), (2, "loop_cycles")):
        both = warps[(warps[:, p] != 0) & (warps[:, CLOCK_SLOT + p] != 0)]
        out[name] = float(np.median(both[:, CLOCK_SLOT + p].astype(np.int64) - both[:, CLOCK_SLOT].astype(np.int64))
                          ) if len(both) else None
    times = np.unique(warps[:, :len(PHASES)][warps[:, :len(PHASES)] != 0])
    out["resolution_ns"] = int(np.diff(times).min()) if len(times) > 1 else None
    return out


def combine(launches: list[dict]) -> dict:
    """The median over launches of each number of their summaries (a phase no launch reached stays None)."""
    out = {}
    for key in launches[0]:
        values = [s[key] for s in launches if s[key] is not None]
        if not values:
            out[key] = None
        elif isinstance(values[0], list):
            out[key] = [float(np.median([v[i] for v in values])) for i in range(len(values[0]))]
        else:
            out[key] = float(np.median(values))
    return out


def table(rows: list[dict]) -> str:
    """The rows as markdown: each phase as median / latest warp, us from the earliest start."""
    head = ["kernel", "N x K", "M", "grid x block", "SMs", "event us", *PHASES, "first, loop (cycles)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = r["summary"]
        cells = [f"{s[p][0]:.2f} / {s[p][1]:.2f}" if s[p] else "-" for p in PHASES]
        cycles = ", ".join("-" if s[c] is None else f"{s[c]:.0f}" for c in ("first_cycles", "loop_cycles"))
        lines.append(f"| {r['kernel']} | {r['n']} x {r['k']} | {r['m']} | {r['grid']} x {r['block']} | "
                     f"{s['sms']:.0f} ({s['warps_per_sm']:.0f} warps) | {r['event_us']:.2f} | {' | '.join(cells)} | "
                     f"{cycles} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x4096,28672x4096", help="NxK,... (default 4096x4096,28672x4096)")
    parser.add_argument("--ms", default="1,16", help="token counts (default 1,16)")
    parser.add_argument("--formats", help=f"comma-separated layouts (default all that stamp: {', '.join(STAMPED)})")
    parser.add_argument("--reps", type=int, default=20, help="launches per case (default 20)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    # before quantkit.kernels builds a module: the stamps are compiled in
    os.environ["QUANTKIT_NVRTC_DEFINES"] = " ".join([*os.environ.get("QUANTKIT_NVRTC_DEFINES", "").split(), DEFINE])
    import cupy
    from smallm_tune import matches, variants

    from quantkit import kernels
    from quantkit.kernel_bench import l2_bytes, parse_shapes, synthetic, variant_launch

    if not kernels.cuda_available():
        sys.exit("needs a CUDA GPU and CuPy (pip install 'quantkit[cuda]')")
    flush = cupy.empty(2 * l2_bytes(), dtype=cupy.uint8)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def run(module, call, blocks: int) -> tuple[dict, float]:
        """`call` launched --reps times, each after an L2 flush, its stamps in a buffer `module`'s qk_timeline
        points at: (combined summary, median event us)."""
        buf = cupy.zeros(blocks * WARPS * SLOTS, dtype=cupy.uint64)
        pointer = cupy.ndarray((1,), cupy.uint64, memptr=module.get_global("qk_timeline"))
        pointer[0] = buf.data.ptr
        summaries, times = [], []
        for _ in range(args.reps):
            buf.fill(0)
            flush.fill(1)
            start.record()
            call()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
            summaries.append(summarize(buf.get().reshape(blocks, WARPS, SLOTS)))
        pointer[0] = 0  # the module's other kernels write nothing
        return combine(summaries), float(np.median(times))

    arch = f"sm_{cupy.cuda.Device().compute_capability}"
    with tempfile.TemporaryDirectory() as tmp:  # loaded (get_function) while the file is there
        cubin = Path(tmp) / "floor.cubin"
        cubin.write_bytes(kernels.compile_source(floor_source(), "stream_read.cu", arch, (DEFINE,)))
        floor = cupy.RawModule(path=str(cubin))
        read = floor.get_function("stream_read")
    read_blocks = 4 * kernels.multiprocessors()

    def read_call(size: int):
        """A launch of the stamped floor over `size` bytes of weights, four blocks of 512 threads an SM."""
        src, sink = cupy.zeros(size, dtype=cupy.uint8), cupy.zeros(1, dtype=cupy.uint32)
        return lambda: read((read_blocks,), (512,), (src, cupy.uint64(size // 16), sink))

    rows, failed = [], 0
    formats = set(args.formats.split(",")) if args.formats else set(STAMPED)
    for index, (n, k) in enumerate(parse_shapes(args.shapes)):
        summary, event = run(floor, read_call(n * k // 2), read_blocks)
        rows.append({"kernel": "stream_read (floor)", "n": n, "k": k, "m": 0, "grid": f"({read_blocks},)",
                     "block": 512, "event_us": event, "summary": summary})
        for v in variants():
            if v.fmt not in formats & set(STAMPED):
                continue
            tensors = synthetic(v.fmt, n, k, group=v.group)
            for m in (int(x) for x in args.ms.split(",")):
                launch = variant_launch(v, tensors, m, k)
                call = kernels.upload(launch)
                module = kernels.launch_module(launch)
                summary, event = run(module, call, int(np.prod(launch.grid)))
                # the emulation on the CPU takes seconds a case at 28672 x 4096: the first shape's cases alone
                ok = matches(v, tensors, launch, call.result()) if index == 0 else None
                failed += ok is False
                rows.append({"kernel": launch.kernel, "label": v.label, "n": n, "k": k, "m": m,
                             "grid": str(tuple(launch.grid)), "block": launch.block, "event_us": event,
                             "summary": summary, "matches": ok})
                print(f"{v.label}: {launch.kernel} {n} x {k} M = {m}: {event:.1f} us, stored by "
                      f"{summary['stored'][1] if summary['stored'] else float('nan'):.2f} us"
                      f"{', OUTPUT DIFFERS FROM THE EMULATION' if ok is False else ''}", flush=True)
    print(f"\n{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: phases as median / latest warp, us from "
          "the earliest warp's start (first: the first step's MMAs issued; reduced: the block's split-K sums; met: "
          "the tile's blocks)\n")
    print(table(rows))
    if args.json:
        atomic_write(args.json, json.dumps({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                            "reps": args.reps, "rows": rows}, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
