"""Atom W4A4 and Any-Precision on SmolLM2-135M.

Atom: RTN W4A4 per channel against Atom W4A4 (INT4 groups of 64, since 576 - 128 outliers is not a multiple of
128, so a simulation artifact), both with the pre-RoPE KV4 cache, calibrated on the first 32 windows of 2048
tokens of shared/data/c4 (as bench/accuracy.py; Atom's authors use 128 windows of WikiText-2 train).
Any-Precision: one upscaled artifact read at every width 3..8, beside SqueezeLLM quantized directly at that
width and per-channel RTN at that width, plus the artifact's size against six separate models. SqueezeLLM's
Fisher information comes from 100 random windows of 512 tokens of c4 (the authors' setting); it is computed once
and cached ($QUANTKIT_CACHE/fisher), so the direct SqueezeLLM runs reuse it. The issue's bar: every upscaled
width within 5% of the directly quantized SqueezeLLM perplexity.

Protocol (issue #5): WikiText-2 perplexity over the first 40 windows of 2048 tokens. Artifacts and results are
kept under --work and reused by a rerun of the same command, recipe and quantkit code.

    python bench/atom_anyprec.py [--work DIR] [--windows 40] [--only LABEL ...]
"""

from __future__ import annotations

from pathlib import Path

from _common import cpu_probe, eval_ppl, quantize_cached, smollm2_job, table

WIDTHS = range(3, 9)
SIM = ["--set", "export.format=quantkit"]
ATOM_ROWS: list[tuple[str, list[str]]] = [
    ("RTN W4A4 (per channel, KV4)", ["--set", "weights={bits: 4, symmetric: true, granularity: channel}",
                                     "--set", "activations={bits: 4, symmetric: true, granularity: token}",
                                     "--set", "passes=[{name: rtn}]", *SIM]),
    ("Atom W4A4 (g64, sim.)", ["--set", "weights.group_size=64", "--set", "activations.group_size=64", *SIM]),
]


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    job = smollm2_job(__doc__, "quantkit-anyprec-")
    args, model, data, c4, work = job.args, job.model, job.data, job.c4, job.work
    calib = ["--calib", str(c4), "--overwrite"]
    probe = cpu_probe()
    fp = eval_ppl(model, data, args.windows, 2048, work / "fp16.json")

    def wanted(label: str) -> bool:
        return not args.only or label in args.only

    atom_rows = []
    for label, extra in ATOM_ROWS:
        if wanted(label):
            out = work / "".join(c if c.isalnum() else "_" for c in label).strip("_")
            wall = quantize_cached(model, out, "--recipe", "atom-w4a4", "--num-samples", "32", "--seq-len", "2048",
                                   "--set", "calibration.sampling=first", *extra, *calib)
            ppl = eval_ppl(out, data, args.windows, 2048, out.with_suffix(".json"))
            atom_rows.append([label, f"{ppl:.2f}", f"{ppl - fp:+.2f}", f"{wall:.0f} s"])

    anyprec = work / "anyprec-3to8"
    results: dict[tuple[str, int], float] = {}
    walls: dict[str, float] = {}
    if any(wanted(f"Any-Precision {b}-bit") for b in WIDTHS):
        walls["Any-Precision"] = quantize_cached(model, anyprec, "--recipe", "anyprec-3to8", *calib)
    for b in WIDTHS:
        if wanted(f"Any-Precision {b}-bit"):
            results["Any-Precision", b] = eval_ppl(anyprec, data, args.windows, 2048, work / f"anyprec-{b}.json",
                                                   "--bits", str(b))
        if wanted(f"SqueezeLLM {b}-bit"):
            out = work / f"squeezellm-{b}"
            walls[f"SqueezeLLM {b}"] = quantize_cached(model, out, "--recipe", "squeezellm-w3", "--set",
                                                       f"weights.bits={b}", "--set", f"weights.min_bits={b}", *calib)
            results["SqueezeLLM", b] = eval_ppl(out, data, args.windows, 2048, work / f"squeezellm-{b}.json")
        if wanted(f"RTN {b}-bit"):
            out = work / f"rtn-{b}"
            quantize_cached(model, out, "--recipe", "rtn-w4a16-g128", "--set",
                            f"weights={{bits: {b}, symmetric: false, granularity: channel}}",
                            "--num-samples", "16", "--seq-len", "512", *calib)
            results["RTN", b] = eval_ppl(out, data, args.windows, 2048, work / f"rtn-{b}.json")

    if atom_rows:
        print(f"\nSmolLM2-135M W4A4, WikiText-2 ppl (first {args.windows} x 2048); calib 32 x 2048 c4")
        print(table(["method", "wikitext2 ppl", "vs FP16", "quantize wall"], [["FP16", f"{fp:.2f}", "-", "-"],
                                                                             *atom_rows]))
    rows = []
    for b in WIDTHS:
        cells = [f"{b}"]
        for method in ("Any-Precision", "SqueezeLLM", "RTN"):
            cells.append(f"{results[method, b]:.2f}" if (method, b) in results else "-")
        if ("Any-Precision", b) in results and ("SqueezeLLM", b) in results:
            cells.append(f"{results['Any-Precision', b] / results['SqueezeLLM', b] - 1:+.1%}")
        else:
            cells.append("-")
        rows.append(cells)
    print(f"\nSmolLM2-135M, WikiText-2 ppl (first {args.windows} x 2048; FP16 {fp:.2f}); Fisher on 100 x 512 c4; "
          f"CPU probe {probe:.0f} GFLOP/s (fp32 matmul) at the start")
    print(table(["bits", "Any-Precision (one artifact)", "SqueezeLLM (direct)", "RTN per channel",
                 "upscaled vs direct"], rows))
    direct = [work / f"squeezellm-{b}" for b in WIDTHS]
    if anyprec.exists() and all(d.exists() for d in direct):
        one, six = _bytes(anyprec), sum(_bytes(d) for d in direct)
        print(f"artifact bytes: Any-Precision {one:,} vs six SqueezeLLM models {six:,} ({one / six:.0%})")
    for label, wall in walls.items():
        print(f"quantize wall {label}: {wall:.0f} s")



if __name__ == "__main__":
    main()
