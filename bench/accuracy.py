"""W4A16 accuracy on SmolLM2-135M: FP16 vs RTN vs GPTQ (symmetric, group 64), with wall time and peak RSS.

Protocol (issue #2): WikiText-2 perplexity over the first 40 windows of 2048 tokens; calibration on the first
32 windows of 2048 tokens of shared/data/c4 (documents in file order joined with "\\n\\n").

    python bench/accuracy.py [--work DIR] [--windows 40] [--only LABEL ...] [--llmcompressor PYTHON]

With --llmcompressor (the python of a virtual environment with llm-compressor 0.14 installed), each GPTQ row
also runs llm-compressor's GPTQModifier on the same token windows (bench/llmcompressor_gptq.py), so the
wall-time ratio is measured on this machine in this run.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from _common import REPO, cpu_probe, eval_ppl, manifest, quantize_cached, smollm2_job, table

VARIANTS = {
    "RTN": ["--recipe", "rtn-w4a16-g128"],
    "GPTQ (act-order off)": ["--recipe", "gptq-w4a16-g128", "--set", "passes.gptq.act_order=false"],
    "GPTQ (static act-order)": ["--recipe", "gptq-w4a16-g128"],
    # the diagnostic row: GPTQ as llm-compressor runs it, without the attention-sink weighting
    "plain GPTQ (act-order off)": ["--recipe", "gptq-w4a16-g128", "--set", "passes.gptq.act_order=false",
                                   "--set", "calibration.sink_weight=null"],
}


def llmcompressor_row(python: str, model: Path, c4: Path, artifact: Path, out: Path, actorder: str) -> dict:
    """Run llm-compressor's GPTQ on the token windows `artifact` was calibrated on; returns its report."""
    from transformers import AutoTokenizer

    from quantkit.calib import load_calibration
    from quantkit.models.source import open_model

    source = open_model(model)
    cal = manifest(artifact)["calibration"]
    windows = load_calibration(c4, AutoTokenizer.from_pretrained(source.path), num_samples=cal["num_samples"],
                               seq_len=cal["seq_len"], seed=cal["seed"], sampling=cal["sampling"])
    if windows.sha256 != cal["sha256"]:
        raise SystemExit("could not rebuild the artifact's calibration windows for llm-compressor")
    tokens = out.with_name(out.name + ".tokens.json")
    tokens.write_text(json.dumps(windows.tokens.tolist()))
    report = out.with_name(out.name + ".report.json")
    subprocess.run([python, str(REPO / "bench" / "llmcompressor_gptq.py"), "--model", str(source.path),
                    "--tokens", str(tokens), "--out", str(out), "--actorder", actorder, "--report", str(report)],
                   check=True)
    return json.loads(report.read_text())


def main() -> None:
    job = smollm2_job(__doc__, "quantkit-bench-", list(VARIANTS), lambda p: p.add_argument(
        "--llmcompressor", metavar="PYTHON", help="python of a venv with llm-compressor 0.14, for a side-by-side "
        "GPTQ wall-time reference"))
    args, model, data, c4, work = job.args, job.model, job.data, job.c4, job.work

    probe_start = cpu_probe()
    fp = eval_ppl(model, data, args.windows, 2048, work / "fp16.json")
    rows = [["FP16 (GGUF dequantized)", f"{fp:.2f}", "-", "-", "-"]]
    common = ["--calib", str(c4), "--num-samples", "32", "--seq-len", "2048", "--set", "calibration.sampling=first",
              "--set", "weights.group_size=64", "--overwrite"]
    for name, extra in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        out = work / name.split()[0].lower().replace("(", "") / name.replace(" ", "_").replace("(", "").replace(")", "")
        wall = quantize_cached(model, out, *extra, *common)
        m = manifest(out)
        ppl = eval_ppl(out, data, args.windows, 2048, out.with_suffix(".json"))
        gap = (ppl - fp)
        rows.append([name, f"{ppl:.2f}", f"{wall:.0f} s", f"{m['peak_rss_bytes'] / 2**30:.2f} GiB", f"{gap:+.2f}"])
        if args.llmcompressor and name.startswith("GPTQ"):
            lc_out = out.with_name("llmcompressor_" + out.name)
            report = llmcompressor_row(args.llmcompressor, model, c4, out, lc_out,
                                       "none" if "off" in name else "static")
            lc_ppl = eval_ppl(lc_out, data, args.windows, 2048, lc_out.with_suffix(".json"))
            rows.append([f"llm-compressor 0.14 {name}", f"{lc_ppl:.2f}", f"{report['wall']:.0f} s",
                         f"{report['peak_rss_bytes'] / 2**30:.2f} GiB", f"{lc_ppl - fp:+.2f}"])
            print(f"{name}: quantkit / llm-compressor wall time = {wall / report['wall']:.2f}")
    rtn = next((float(r[1]) for r in rows if r[0] == "RTN"), None)
    print()
    print(f"CPU probe (fp32 2048^3 matmul): {probe_start:.0f} GFLOP/s at the start, {cpu_probe():.0f} at the end; "
          "wall times of cached rows come from earlier runs")
    print(f"SmolLM2-135M, W4A16 sym g64, WikiText-2 ppl (first {args.windows} x 2048), calib 32 x 2048 c4")
    print(table(["method", "wikitext2 ppl", "quantize wall", "peak RSS", "ppl - FP16"], rows))
    if rtn is not None:
        for r in rows[2:]:
            closed = (rtn - float(r[1])) / (rtn - fp)
            print(f"{r[0]}: closes {closed:.0%} of the RTN-to-FP16 gap")


if __name__ == "__main__":
    main()
