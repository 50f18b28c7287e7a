"""W4A8 methods side by side on SmolLM2-135M: RTN, SmoothQuant-style smoothing, QQQ, LiquidQuant, QoQ.

Protocol (issue #4): WikiText-2 perplexity over the first 40 windows of 2048 tokens; calibration on the first 128
windows of 2048 tokens of shared/data/c4. Every row runs per-token INT8 activations. SmolLM2's width 576 is not a
multiple of 128, so the QQQ rows cannot use the qqq layout (K % 128) and QQQ's groups are simulated at 64; they
export quantkit's simulation artifact, as do the RTN and SmoothQuant rows. LiquidQuant exports its own layout.
QoQ runs without its KV4 cache here, so every row is the same W4A8 problem. Each measured row is kept in the
ledger bench/results/w4a8.json (see _common.Ledger), so the table is built over several sessions; artifacts
are kept under --work.

    python bench/w4a8.py [--work DIR] [--windows 40] [--only LABEL ...] [--remeasure none|stale|all] [--report]
"""

from __future__ import annotations

from _common import ppl_cells, smollm2_job, smollm2_row, table

A8 = ["--set", "activations={bits: 8, symmetric: true, granularity: token}"]
QQQ_CHANNEL = ["--set", "weights={bits: 4, symmetric: true, granularity: channel, narrow_range: true}"]
SIM = ["--set", "export.format=quantkit"]


def _passes(*entries: str) -> list[str]:
    return ["--set", "passes=[" + ", ".join(entries) + "]"]


SMOOTHQUANT = "{name: smooth, method: alpha, targets: [qkv, gate_up], alphas: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]}"

# (label, recipe, overrides)
ROWS: list[tuple[str, str, list[str]]] = [
    ("RTN W4A8 (per channel)", "qqq", [*QQQ_CHANNEL, *A8, *_passes("{name: rtn}"), *SIM]),
    ("QQQ (per channel)", "qqq", [*SIM]),
    ("LiquidQuant (g64)", "lqq-g64", []),
    ("QQQ (g64, sim.)", "qqq-g128", ["--set", "weights.group_size=64", *SIM]),
    ("SmoothQuant-style W4A8 (per channel)", "qqq", [*QQQ_CHANNEL, *A8, *_passes(SMOOTHQUANT, "{name: rtn}"), *SIM]),
    ("QoQ W4A8 (per channel)", "qoq", ["--set", "kv_cache=null", *SIM]),
]


def main() -> None:
    job = smollm2_job(__doc__, "quantkit-w4a8-", [label for label, _, _ in ROWS])
    common = ["--calib", str(job.c4), "--num-samples", "128", "--seq-len", "2048",
              "--set", "calibration.sampling=first", "--overwrite"]
    fp_row = smollm2_row(job, "FP16", [])
    fp = fp_row["ppl"] if fp_row else float("nan")
    rows, labels = [["FP16", *ppl_cells(fp_row), "-", "-", job.ledger.provenance("FP16")]], ["FP16"]
    for label, recipe, extra in ROWS:
        if job.args.only and label not in job.args.only:
            continue
        r = smollm2_row(job, label, ["--recipe", recipe, *extra, *common])
        rows.append([label, *ppl_cells(r, fp), f"{r['wall']:.0f} s" if r else "-", job.ledger.provenance(label)])
        labels.append(label)
    print(f"\nSmolLM2-135M W4A8, WikiText-2 ppl, first {job.args.windows} x 2048; calib 128 x 2048 c4")
    print(table(["method", "wikitext2 ppl", "vs FP16", "quantize wall", "measured with"], rows))
    print(job.ledger.note(labels))


if __name__ == "__main__":
    main()
