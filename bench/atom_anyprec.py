"""Atom W4A4 and Any-Precision on SmolLM2-135M.

Atom: RTN W4A4 per channel against Atom W4A4 (INT4 groups of 64, since 576 - 128 outliers is not a multiple of
128, so a simulation artifact), both with the pre-RoPE KV4 cache, calibrated on the first 32 windows of 2048
tokens of shared/data/c4 (as bench/accuracy.py; Atom's authors use 128 windows of WikiText-2 train).
Any-Precision: one upscaled artifact read at every width 3..8, beside SqueezeLLM quantized directly at that
width and per-channel RTN at that width, plus the artifact's size against six separate models. SqueezeLLM's
Fisher information comes from 100 random windows of 512 tokens of c4 (the authors' setting); it is computed once
and cached ($QUANTKIT_CACHE/fisher), so the direct SqueezeLLM runs reuse it. The issue's bar: every upscaled
width within 5% of the directly quantized SqueezeLLM perplexity.

Protocol (issue #5): WikiText-2 perplexity over the first 40 windows of 2048 tokens. Each measured row is kept in
the ledger bench/results/atom_anyprec.json (see _common.Ledger), so the tables are built over several sessions.
The artifact-size line needs all the artifacts in one --work dir.

    python bench/atom_anyprec.py [--work DIR] [--windows 40] [--only LABEL ...] [--remeasure none|stale|all]
    [--report]
"""

from __future__ import annotations

from pathlib import Path

from _common import ppl_cells, smollm2_job, smollm2_row, table

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


def width_label(method: str, bits: int) -> str:
    """The label of a width row: what --only names and the ledger keys."""
    return f"{method} {bits}-bit"


def main() -> None:
    job = smollm2_job(__doc__, "quantkit-anyprec-", [label for label, _ in ATOM_ROWS] + [
        width_label(method, b) for b in WIDTHS for method in ("Any-Precision", "SqueezeLLM", "RTN")])
    args, work = job.args, job.work
    calib = ["--calib", str(job.c4), "--overwrite"]
    fp_row = smollm2_row(job, "FP16", [])
    fp = fp_row["ppl"] if fp_row else float("nan")
    measured = ["FP16"]

    def row(label: str, quantize_args: list[str], *eval_args: str, out: Path | None = None) -> dict | None:
        if args.only and label not in args.only:
            return None
        measured.append(label)
        return smollm2_row(job, label, quantize_args, eval_args, out=out)

    atom_rows = []
    for label, extra in ATOM_ROWS:
        r = row(label, ["--recipe", "atom-w4a4", "--num-samples", "32", "--seq-len", "2048",
                        "--set", "calibration.sampling=first", *extra, *calib])
        if r:
            atom_rows.append([label, f"{r['ppl']:.2f}", f"{r['ppl'] - fp:+.2f}", f"{r['wall']:.0f} s",
                              job.ledger.provenance(label)])
        else:
            atom_rows.append([label, *ppl_cells(None, fp), "-", "-"])

    anyprec = work / "anyprec-3to8"
    results: dict[tuple[str, int], dict] = {}
    for b in WIDTHS:
        r = row(width_label("Any-Precision", b), ["--recipe", "anyprec-3to8", *calib], "--bits", str(b), out=anyprec)
        if r:
            results["Any-Precision", b] = r
        r = row(width_label("SqueezeLLM", b), ["--recipe", "squeezellm-w3", "--set", f"weights.bits={b}",
                                               "--set", f"weights.min_bits={b}", *calib], out=work / f"squeezellm-{b}")
        if r:
            results["SqueezeLLM", b] = r
        r = row(width_label("RTN", b), ["--recipe", "rtn-w4a16-g128", "--set",
                                        f"weights={{bits: {b}, symmetric: false, granularity: channel}}",
                                        "--num-samples", "16", "--seq-len", "512", *calib], out=work / f"rtn-{b}")
        if r:
            results["RTN", b] = r

    if not args.only or any(label in args.only for label, _ in ATOM_ROWS):
        print(f"\nSmolLM2-135M W4A4, WikiText-2 ppl (first {args.windows} x 2048); calib 32 x 2048 c4")
        print(table(["method", "wikitext2 ppl", "vs FP16", "quantize wall", "measured with"],
                    [["FP16", *ppl_cells(fp_row), "-", "-", job.ledger.provenance("FP16")], *atom_rows]))
    rows = []
    for b in WIDTHS:
        cells = [f"{b}"]
        for method in ("Any-Precision", "SqueezeLLM", "RTN"):
            cells.append(f"{results[method, b]['ppl']:.2f}" if (method, b) in results else ppl_cells(None)[0])
        if ("Any-Precision", b) in results and ("SqueezeLLM", b) in results:
            cells.append(f"{results['Any-Precision', b]['ppl'] / results['SqueezeLLM', b]['ppl'] - 1:+.1%}")
        else:
            cells.append("-")
        rows.append(cells)
    print(f"\nSmolLM2-135M, WikiText-2 ppl (first {args.windows} x 2048; FP16 {fp:.2f}); Fisher on 100 x 512 c4")
    print(table(["bits", "Any-Precision (one artifact)", "SqueezeLLM (direct)", "RTN per channel",
                 "upscaled vs direct"], rows))
    direct = [work / f"squeezellm-{b}" for b in WIDTHS]
    if anyprec.exists() and all(d.exists() for d in direct):
        one, six = _bytes(anyprec), sum(_bytes(d) for d in direct)
        print(f"artifact bytes: Any-Precision {one:,} vs six SqueezeLLM models {six:,} ({one / six:.0%})")
    for (method, b), r in sorted(results.items()):
        if method != "RTN" and (method == "SqueezeLLM" or b == WIDTHS[0]):
            print(f"quantize wall {method}{'' if method == 'Any-Precision' else f' {b}-bit'}: {r['wall']:.0f} s")
    print(job.ledger.note(measured))


if __name__ == "__main__":
    main()
