"""W4A16 accuracy on SmolLM2-135M: FP16 vs RTN vs GPTQ (symmetric, group 64), with wall time and peak RSS.

Protocol (issue #2): WikiText-2 perplexity over the first 40 windows of 2048 tokens; calibration on the first
32 windows of 2048 tokens of shared/data/c4 (documents in file order joined with "\\n\\n").

    python bench/accuracy.py [--work DIR] [--windows 40] [--only LABEL ...] [--remeasure none|stale|all] [--report]
                             [--llmcompressor PYTHON]

Each measured row is kept in the ledger bench/results/accuracy.json (see _common.Ledger), with the code, commit
and CPU it was measured on; artifacts are kept under --work.

With --llmcompressor (the python of a virtual environment with llm-compressor 0.14 installed), each GPTQ row
also runs llm-compressor's GPTQModifier on the same token windows (bench/llmcompressor_gptq.py), so the
wall-time ratio is measured on this machine in this run.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from _common import REPO, eval_ppl, manifest, ppl_cells, slug, smollm2_job, smollm2_row, table

from quantkit.files import atomic_write

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
    atomic_write(tokens, json.dumps(windows.tokens.tolist()))
    report = out.with_name(out.name + ".report.json")
    subprocess.run([python, str(REPO / "bench" / "llmcompressor_gptq.py"), "--model", str(source.path),
                    "--tokens", str(tokens), "--out", str(out), "--actorder", actorder, "--report", str(report)],
                   check=True)
    return json.loads(report.read_text())


def main() -> None:
    job = smollm2_job(__doc__, "quantkit-bench-", list(VARIANTS), lambda p: p.add_argument(
        "--llmcompressor", metavar="PYTHON", help="python of a venv with llm-compressor 0.14, for a side-by-side "
        "GPTQ wall-time reference (measured on every run, not kept in the ledger)"))
    args = job.args
    if args.llmcompressor and (args.report or args.remeasure != "all"):  # a ratio of two times measured together
        raise SystemExit("--llmcompressor times llm-compressor now, beside quantkit's row measured in the same run: "
                         "add --remeasure all (and --only the GPTQ rows), without --report")
    common = ["--calib", str(job.c4), "--num-samples", "32", "--seq-len", "2048", "--set", "calibration.sampling=first",
              "--set", "weights.group_size=64", "--overwrite"]
    fp_row = smollm2_row(job, "FP16", [])
    fp = fp_row["ppl"] if fp_row else float("nan")
    rows = [["FP16 (GGUF dequantized)", *ppl_cells(fp_row, fp), "-", "-", job.ledger.provenance("FP16")]]
    labels, ppls = ["FP16"], {}
    for label, extra in VARIANTS.items():
        if args.only and label not in args.only:
            continue
        out = job.work / slug(label)  # the artifact llm-compressor's row reads its calibration windows from
        r = smollm2_row(job, label, [*extra, *common], out=out)
        rows.append([label, *ppl_cells(r, fp), f"{r['wall']:.0f} s" if r else "-", _gib(r and r.get("peak_rss_bytes")),
                     job.ledger.provenance(label)])
        labels.append(label)
        if r is not None:
            ppls[label] = r["ppl"]
        if args.llmcompressor and label.startswith("GPTQ"):
            lc_out = out.with_name("llmcompressor_" + out.name)
            report = llmcompressor_row(args.llmcompressor, job.model, job.c4, out, lc_out,
                                       "none" if "off" in label else "static")
            lc_ppl = eval_ppl(lc_out, job.data, args.windows, 2048, lc_out.with_suffix(".json"))
            rows.append([f"llm-compressor 0.14 {label}", *ppl_cells({"ppl": lc_ppl}, fp), f"{report['wall']:.0f} s",
                         _gib(report["peak_rss_bytes"]), "this run"])
            print(f"{label}: quantkit / llm-compressor wall time = {r['wall'] / report['wall']:.2f}")
    print(f"\nSmolLM2-135M, W4A16 sym g64, WikiText-2 ppl (first {args.windows} x 2048), calib 32 x 2048 c4")
    print(table(["method", "wikitext2 ppl", "vs FP16", "quantize wall", "peak RSS", "measured with"], rows))
    print(job.ledger.note(labels))
    if "RTN" in ppls:
        for label, ppl in ppls.items():
            if label != "RTN":
                print(f"{label}: closes {(ppls['RTN'] - ppl) / (ppls['RTN'] - fp):.0%} of the RTN-to-FP16 gap")


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


if __name__ == "__main__":
    main()
