"""QoQ ablation on SmolLM2-135M, in the style of the QServe paper's Figure 12: one row per cumulative step.

Protocol (issue #3): WikiText-2 perplexity over the first 40 windows of 2048 tokens; calibration on the first
128 windows of 1024 tokens of shared/data/c4. Width 576 is not a multiple of 128, so the group rows use group
64 and are simulation only (exported in quantkit's own format). Each measured row is kept in the ledger
bench/results/ablation_qoq.json (see _common.Ledger), so the table is built over several sessions.

    python bench/ablation_qoq.py [--work DIR] [--windows 40] [--only LABEL ...] [--remeasure none|stale|all]
    [--report]
"""

from __future__ import annotations

from _common import ppl_cells, smollm2_job, smollm2_row, table

W4_CHANNEL = ["--set", "weights={bits: 4, symmetric: false, granularity: channel, zero_form: scaled}"]
W4_SYM = ["--set", "weights={bits: 4, symmetric: true, granularity: channel, narrow_range: true}"]
W4_G64 = ["--set", "weights={bits: 4, symmetric: false, granularity: group, group_size: 64, progressive: true}"]
A8 = ["--set", "activations={bits: 8, symmetric: true, granularity: token}"]
NO_KV = ["--set", "kv_cache=null"]
SIM = ["--set", "export.format=quantkit"]


def _passes(*names: str) -> list[str]:
    return ["--set", "passes=[" + ", ".join(f"{{name: {n}}}" for n in names) + "]"]


# (label, recipe, overrides): each step adds one technique to the row above it.
STEPS: list[tuple[str, str, list[str]]] = [
    ("RTN W8A8", "rtn-w8a8", []),
    ("RTN W4A8 (per channel)", "qoq", [*W4_CHANNEL, *A8, *NO_KV, *_passes("rtn"), *SIM]),
    ("+ rotation", "qoq", [*W4_CHANNEL, *A8, *NO_KV, *_passes("fold_norms", "rotate", "rtn"), *SIM]),
    ("+ clipping", "qoq", [*W4_CHANNEL, *A8, *NO_KV, *_passes("fold_norms", "rotate", "clip", "rtn"), *SIM]),
    ("+ KV4", "qoq", [*W4_CHANNEL, *A8, *_passes("fold_norms", "rotate", "clip", "rtn"), *SIM]),
    ("+ SmoothAttention", "qoq",
     [*W4_CHANNEL, *A8, *_passes("fold_norms", "rotate", "smooth_attention", "clip", "rtn"), *SIM]),
    ("+ output smoothing", "qoq",
     [*W4_CHANNEL, *A8, *_passes("fold_norms", "rotate", "smooth_attention", "smooth", "clip", "rtn"),
      *SIM]),
    ("+ progressive group (g64, sim.)", "qoq-g128",
     [*W4_G64, *_passes("fold_norms", "rotate", "smooth_attention", "smooth", "clip", "rtn"), *SIM]),
    ("+ reorder", "qoq-g128",
     [*W4_G64, *_passes("fold_norms", "rotate", "reorder", "smooth_attention", "smooth", "clip", "rtn"),
      *SIM]),
    ("+ GPTQ (QoQ g64)", "qoq-g128", [*W4_G64, *SIM]),
]
# the gap the issue measures: RTN W4A8KV4 against full QoQ, per channel and with groups
GAP: list[tuple[str, str, list[str]]] = [
    ("RTN W4A8KV4 (per channel)", "qoq", [*W4_CHANNEL, *_passes("rtn"), *SIM]),
    ("QoQ W4A8KV4 (per channel)", "qoq", [*SIM]),
    ("RTN W4A8KV4 (g64, sim.)", "qoq-g128", [*W4_G64, *_passes("rtn"), *SIM]),
    # QServe's per-channel kernel applies the zero point to the unquantized activations' sum in its epilogue, so
    # the activations' rounding error meets the unsigned weights q * s; symmetric INT4 has no zero point and no
    # such term (the grid of bench/w4a8.py's RTN row): the stronger per-channel RTN baseline
    ("RTN W4A8KV4 (per channel, symmetric INT4)", "qoq", [*W4_SYM, *_passes("rtn"), *SIM]),
    # the recipes weight the attention sink in GPTQ's Hessians (calibration.sink_weight: 128); plain GPTQ beside it
    ("QoQ W4A8KV4 (per channel), plain GPTQ", "qoq", ["--set", "calibration.sink_weight=null", *SIM]),
]


def main() -> None:
    job = smollm2_job(__doc__, "quantkit-ablation-", [label for label, _, _ in STEPS + GAP])
    common = ["--calib", str(job.c4), "--num-samples", "128", "--seq-len", "1024",
              "--set", "calibration.sampling=first", "--overwrite"]
    fp_row = smollm2_row(job, "FP16", [])
    fp = fp_row["ppl"] if fp_row else float("nan")
    results: dict[str, dict] = {}
    for label, recipe, extra in STEPS + GAP:
        if job.args.only and label not in job.args.only:
            continue
        r = smollm2_row(job, label, ["--recipe", recipe, *extra, *common])
        if r is not None:
            results[label] = r

    rows = [["FP16", *ppl_cells(fp_row), "-", "-", job.ledger.provenance("FP16")]]
    previous = None
    for label, _, _ in STEPS:
        if label in results:
            ppl, wall = results[label]["ppl"], results[label]["wall"]
            delta = "-" if previous is None else f"{ppl - previous:+.2f}"
            rows.append([label, f"{ppl:.2f}", delta, f"{wall:.0f} s", job.ledger.provenance(label)])
            previous = ppl
        else:  # not measured (--only, or not in the ledger): the next step's delta has no previous step
            if job.args.report:
                rows.append([label, *ppl_cells(None), "-", "-", "-"])
            previous = None
    print(f"\nSmolLM2-135M W4A8KV4 ablation (cumulative), WikiText-2 ppl, first {job.args.windows} x 2048; "
          "calib 128 x 1024 c4")
    print(table(["step", "wikitext2 ppl", "vs previous", "quantize wall", "measured with"], rows))
    pairs = [("per channel", "RTN W4A8KV4 (per channel)", "QoQ W4A8KV4 (per channel)"),
             ("per channel, symmetric INT4 RTN", "RTN W4A8KV4 (per channel, symmetric INT4)",
              "QoQ W4A8KV4 (per channel)"),
             ("per channel, plain GPTQ", "RTN W4A8KV4 (per channel)", "QoQ W4A8KV4 (per channel), plain GPTQ"),
             ("g64", "RTN W4A8KV4 (g64, sim.)", "+ GPTQ (QoQ g64)")]
    for name, rtn, qoq in pairs:
        if rtn in results and qoq in results:
            r, q = results[rtn]["ppl"], results[qoq]["ppl"]
            print(f"{name}: RTN W4A8KV4 {r:.2f} -> QoQ {q:.2f} (FP16 {fp:.2f}): closes {(r - q) / (r - fp):.0%} "
                  f"of the gap")
    print(job.ledger.note(["FP16", *results]))


if __name__ == "__main__":
    main()
