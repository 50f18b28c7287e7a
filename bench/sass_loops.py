"""Instruction counts of the kernels' main loops, from their SASS: what the README's and kernels/README.md's
"main loop" counts come from, measured without a GPU.

Builds one module of kernels/ with nvcc (sm_90a; with --hopper, QK_WGMMA too, for the wgmma and bulk kernels),
disassembles it with cuobjdump and prints, per kernel, its instruction count and its main loop's: the span of the
longest backward branch, with the loop's opcodes by count, how many of them are integer-ALU opcodes (ALU) and
integer multiply-adds (IMAD), and which of issue, ALU and IMAD bounds it by a pipe model (`pipe_bound`). The counts
are static: a loop that holds two paths (per channel and per group) counts both.

    python bench/sass_loops.py MODULE [--hopper] [-D NAME=VALUE ...] [--kernels REGEX] [--cuobjdump PATH]

e.g. `python bench/sass_loops.py qserve_w4a8 --hopper --kernels 'wgmma$|gemm'`. cuobjdump ships with the CUDA
toolkit, or as the pip package nvidia-cuda-cuobjdump (its nvidia/cu13/bin/cuobjdump).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(?:\.\S*)?\s*([^;]*);")


def parse(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """cuobjdump -sass output as {kernel: [(address, opcode, operands)]}."""
    kernels: dict[str, list[tuple[int, str, str]]] = {}
    name = None
    for line in sass.splitlines():
        if match := re.search(r"Function : (\S+)", line):
            name = match.group(1)
            kernels[name] = []
        elif name and (match := INSTRUCTION.match(line)):
            kernels[name].append((int(match.group(1), 16), match.group(2), match.group(3)))
    return kernels


def main_loop(instructions: list[tuple[int, str, str]]) -> collections.Counter | None:
    """The opcodes of the span of the longest backward branch (None without a loop)."""
    spans = []
    for address, opcode, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address:
            spans.append((int(target.group(1), 16), address))
    if not spans:
        return None
    first, last = max(spans, key=lambda span: span[1] - span[0])
    return collections.Counter(opcode for address, opcode, _ in instructions if first <= address <= last)


# Integer-ALU opcodes. A Hopper SM sub-partition has 16 INT32 lanes beside its 32 FP32 ones (the H100 whitepaper's SM:
# 64 INT32 and 128 FP32 units), so these issue at half the rate of FFMA, HFMA2 and HADD2. Integer multiply-adds
# (IMAD, its .HI, .WIDE, .IADD and .MOV forms) run on the FP32 pipe's heavy half alone: half rate as well, but beside
# the ALU, not in it. A loop whose ALU (or IMAD) instructions take more issue cycles, at two a warp instruction,
# than its total or its tensor-core work is held by them. A model for reading the counts; only a profile on a GPU
# measures the pipes.
ALU = frozenset({"LOP3", "SHF", "IADD3", "PRMT", "LEA", "SEL", "ISETP", "PLOP3"})


def alu(loop: collections.Counter) -> int:
    """How many of a loop's instructions are integer-ALU opcodes (ALU)."""
    return sum(n for op, n in loop.items() if op in ALU)


def pipe_bound(loop: collections.Counter) -> str:
    """Which of issue (one warp instruction a cycle), the integer ALU and IMAD (two cycles each) takes the most
    cycles in a loop, by the model above: "issue", "ALU" or "IMAD"."""
    cycles = {"issue": sum(loop.values()), "ALU": 2 * alu(loop), "IMAD": 2 * loop.get("IMAD", 0)}
    return max(cycles, key=cycles.get)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", help="a kernels/*.cu module, e.g. qserve_w4a8 or anyprec_gemv")
    parser.add_argument("--hopper", action="store_true", help="also build the Hopper kernels (-DQK_WGMMA)")
    parser.add_argument("-D", dest="defines", action="append", default=[], help="a compile-time knob, NAME=VALUE")
    parser.add_argument("--kernels", default="", help="only the kernels whose names match this regular expression")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="the cuobjdump to use")
    args = parser.parse_args()
    if not shutil.which("nvcc") or not args.cuobjdump:
        sys.exit("needs nvcc and cuobjdump on PATH (or --cuobjdump PATH; pip install nvidia-cuda-cuobjdump)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-cubin",
                        *(["-DQK_WGMMA"] if args.hopper else []), *(f"-D{d}" for d in args.defines),
                        str(KERNELS / f"{args.module}.cu"), "-o", str(cubin)], check=True)
        sass = subprocess.run([args.cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    for name, instructions in sorted(parse(sass).items()):
        if not re.search(args.kernels, name):
            continue
        loop = main_loop(instructions)
        counts = f"main loop {sum(loop.values())} (ALU {alu(loop)}, IMAD {loop.get('IMAD', 0)}; {pipe_bound(loop)}" \
            "-bound by the model): " + ", ".join(f"{op} {n}" for op, n in loop.most_common(8)) if loop else "no loop"
        print(f"{name}: {len(instructions)} instructions; {counts}")


if __name__ == "__main__":
    main()
