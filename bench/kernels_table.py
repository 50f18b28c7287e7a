"""The README's kernel tables from `quantkit bench --json` output (bench/gpu_check.py writes bench.json and
sweep.json to its --out folder), as Markdown:

1. issue #6's bars, one line per (shape, M, kernel) they apply to, with the device and its copy bandwidth, then
   how many each kernel meets per requirement;
2. with --against OTHER.json (another run or configuration of the same bars), the bars whose verdict differs;
3. with --grid M,...: per M, every row against the shapes (times, speedups, bandwidth shares);
4. with --sweep, per layout and M, the fastest of its kernels and its time against each other path's, which is
   what TILED_MIN_M, ANYPREC_TC_MIN_M and the wgmma default are set from;
5. with --fit M,...: per kernel and M, the line time = fixed + bytes / rate through its shapes (stream_fit), beside
   the read floor's: whether a kernel loses to the floor by its stream or by its fixed cost;
6. with --fastest-baselines OTHER.json ...: the bars (1 and 2) judged against each cuBLAS row's fastest time in
   this run and the others (runs of the same shapes), so that a slow spell of cuBLAS in one run raises no count.

    PYTHONPATH=. python bench/kernels_table.py OUT/bench.json [--against OUT/bench_tuned.json] [--grid 1,16,1024]
        [--sweep OUT/sweep.json] [--fit 1,16] [--fastest-baselines OTHER.json ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quantkit.kernel_bench import (
    markdown_bar_changes,
    markdown_bar_counts,
    markdown_bars,
    markdown_fit,
    markdown_grid,
    markdown_sweep,
    with_fastest_baselines,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", type=Path, help="quantkit bench --json output (the default paths)")
    parser.add_argument("--against", type=Path, help="another report of the same bars: the bars whose verdict "
                        "differs from this one's (e.g. bench_tuned.json against bench.json)")
    parser.add_argument("--grid", help="token counts to tabulate against the shapes, e.g. 1,16,1024")
    parser.add_argument("--sweep", type=Path, help="quantkit bench --paths all --json output")
    parser.add_argument("--fit", help="token counts at which to fit each kernel's time to its bytes, e.g. 1,16")
    parser.add_argument("--fastest-baselines", type=Path, nargs="+", metavar="OTHER",
                        help="other runs' quantkit bench --json output: judge the bars against each cuBLAS row's "
                        "fastest time in any of the runs")
    args = parser.parse_args()
    report = json.loads(args.bench.read_text())
    against = json.loads(args.against.read_text()) if args.against else None
    if args.fastest_baselines:
        # both reports' bars against the same fastest baselines (of every run named), so that a verdict that
        # differs between them is the kernels' doing, not the baselines'
        others = [json.loads(p.read_text()) for p in args.fastest_baselines]
        if against is not None:
            report, against = (with_fastest_baselines(report, [against, *others]),
                               with_fastest_baselines(against, [report, *others]))
        else:
            report = with_fastest_baselines(report, others)
    print(markdown_bars(report))
    print()
    print(markdown_bar_counts(report))
    if against is not None:
        print()
        print(markdown_bar_changes(report, against))
    for m in (int(v) for v in args.grid.split(",")) if args.grid else ():
        print()
        print(markdown_grid(report, m))
    for m in (int(v) for v in args.fit.split(",")) if args.fit else ():
        print()
        print(markdown_fit(report, m))
    if args.sweep:
        print()
        print(markdown_sweep(json.loads(args.sweep.read_text())))


if __name__ == "__main__":
    main()
