"""llm-compressor's GPTQ on the accuracy benchmark's exact job, timed for a side-by-side wall-time reference.

Runs in its own virtual environment (llm-compressor pins its own dependencies), started by
`bench/accuracy.py --llmcompressor PYTHON`: W4A16 symmetric group 64, block 128, damping 0.01, lm_head kept,
on the very token windows quantkit calibrates with. Writes {"wall", "peak_rss_bytes"} to --report; the wall
time counts the whole process, imports included, as quantkit's does.

    PYTHON bench/llmcompressor_gptq.py --model HF_DIR --tokens TOKENS.json --out DIR --actorder none|static \
        --report REPORT.json
"""

from __future__ import annotations

import time

START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True, help="JSON list of token-id windows")
    parser.add_argument("--out", required=True)
    parser.add_argument("--actorder", choices=["none", "static"], required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--precision", default="float32", help="model dtype for llm-compressor (default float32)")
    args = parser.parse_args()

    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    with open(args.tokens) as f:
        windows = json.load(f)
    data = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    actorder = None if args.actorder == "none" else "static"
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64,
                               actorder=actorder)
    modifier = GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                            ignore=["lm_head"], block_size=128, dampening_frac=0.01, actorder=actorder)
    # float32, as quantkit computes: llm-compressor's default "auto" keeps the checkpoint's fp16, whose CPU
    # matmuls are several times slower (a first attempt needed ~3 min per layer on this job)
    oneshot(model=args.model, dataset=data, recipe=modifier, precision=args.precision,
            max_seq_length=len(windows[0]),
            num_calibration_samples=len(windows), shuffle_calibration_samples=False, output_dir=args.out)
    report = {"wall": time.time() - START,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    tmp = f"{args.report}.{os.getpid()}.tmp"  # then renamed: a report is whole or absent
    with open(tmp, "w") as f:
        json.dump(report, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, args.report)


if __name__ == "__main__":
    main()
