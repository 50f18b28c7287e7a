"""W4A8 methods side by side on SmolLM2-135M: RTN, SmoothQuant-style smoothing, QQQ, LiquidQuant, QoQ.

Protocol (issue #4): WikiText-2 perplexity over the first 40 windows of 2048 tokens; calibration on the first 128
windows of 2048 tokens of shared/data/c4. Every row runs per-token INT8 activations. SmolLM2's width 576 is not a
multiple of 128, so the QQQ rows cannot use the qqq layout (K % 128) and QQQ's groups are simulated at 64; they
export quantkit's simulation artifact, as do the RTN and SmoothQuant rows. LiquidQuant exports its own layout.
QoQ runs without its KV4 cache here, so every row is the same W4A8 problem. Artifacts and results are kept
under --work and reused by a rerun of the same command, recipe and quantkit code.

    python bench/w4a8.py [--work DIR] [--windows 40] [--only LABEL ...]
"""

from __future__ import annotations

from _common import cpu_probe, eval_ppl, quantize_cached, smollm2_job, table

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
    job = smollm2_job(__doc__, "quantkit-w4a8-")
    args, model, data, c4, work = job.args, job.model, job.data, job.c4, job.work
    common = ["--calib", str(c4), "--num-samples", "128", "--seq-len", "2048",
              "--set", "calibration.sampling=first", "--overwrite"]
    probe = cpu_probe()
    fp = eval_ppl(model, data, args.windows, 2048, work / "fp16.json")
    rows = [["FP16", f"{fp:.2f}", "-", "-"]]
    for label, recipe, extra in ROWS:
        if args.only and label not in args.only:
            continue
        slug = "".join(c if c.isalnum() else "_" for c in label).strip("_")
        out = work / slug
        wall = quantize_cached(model, out, "--recipe", recipe, *extra, *common)
        ppl = eval_ppl(out, data, args.windows, 2048, work / f"{slug}.json")
        rows.append([label, f"{ppl:.2f}", f"{ppl - fp:+.2f}", f"{wall:.0f} s"])
    print(f"\nSmolLM2-135M W4A8, WikiText-2 ppl, first {args.windows} x 2048; calib 128 x 2048 c4; "
          f"CPU probe {probe:.0f} GFLOP/s (fp32 matmul) at the start")
    print(table(["method", "wikitext2 ppl", "vs FP16", "quantize wall"], rows))


if __name__ == "__main__":
    main()
