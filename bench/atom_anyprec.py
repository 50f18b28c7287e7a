"""Any-Precision on SmolLM2-135M: one upscaled artifact read at every width 3..8, beside SqueezeLLM quantized
directly at that width and per-channel RTN at that width, plus the artifact's size against six separate models.

Protocol (issue #5): WikiText-2 perplexity over the first 40 windows of 2048 tokens. SqueezeLLM's Fisher
information comes from 100 random windows of 512 tokens of shared/data/c4 (the authors' setting); it is
computed once and cached ($QUANTKIT_CACHE/fisher), so the direct SqueezeLLM runs reuse it. The issue's bar:
every upscaled width within 5% of the directly quantized SqueezeLLM perplexity. Artifacts and results are kept
under --work and reused by a rerun of the same command, recipe and quantkit code. (Atom's W4A4 rows join this
table when its recipe lands.)

    python bench/atom_anyprec.py [--work DIR] [--windows 40] [--only LABEL ...]
"""

from __future__ import annotations

from pathlib import Path

from _common import cpu_probe, eval_ppl, quantize_cached, smollm2_job, table

WIDTHS = range(3, 9)


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
