"""Peak memory of layer-streamed GPTQ on a synthetic 1.1B Llama (TinyLlama shapes), against its fp16 size.

The model is written to disk by this script (about 2.2 GB), quantized by `quantkit quantize` in a fresh
process with a few short calibration windows, and the process's peak RSS is compared with the fp16 size.

    python bench/memory.py [--work DIR] [--num-samples 4] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
from pathlib import Path

from _common import cpu_probe, manifest, quantkit, table

from quantkit.synthetic import TINYLLAMA_1B, write_synthetic_llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--recipe", default="gptq-w4a16-g128")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="quantkit-mem-"))
    model = work / "tinyllama-synthetic"
    if not (model / "config.json").exists():
        write_synthetic_llama(model, TINYLLAMA_1B)
    rng = random.Random(0)
    words = ["the", "model", "layer", "quantized", "weights", "memory", "stream", "token", "of", "and", "a"]
    calib = work / "calib.txt"
    calib.write_text("\n".join(" ".join(rng.choice(words) for _ in range(400)) for _ in range(64)))
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    wall = quantkit("quantize", str(model), "--recipe", args.recipe, "-o", str(out), "--calib", str(calib),
                    "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--overwrite")
    fp16 = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"CPU probe (fp32 2048^3 matmul): {cpu_probe():.0f} GFLOP/s")
    peak = manifest(out)["peak_rss_bytes"]
    print()
    print(table(
        ["model", "params", "fp16 size", "peak RSS", "peak / fp16", "wall"],
        [["synthetic TinyLlama-1.1B", f"{TINYLLAMA_1B.num_parameters / 1e9:.2f} B", f"{fp16 / 2**30:.2f} GiB",
          f"{peak / 2**30:.2f} GiB", f"{peak / fp16:.3f}", f"{wall:.0f} s"]],
    ))


if __name__ == "__main__":
    main()
