"""Instruction counts of the kernels' main loops, from their SASS: what the README's and kernels/README.md's
"main loop" counts come from, measured without a GPU.

Builds one module of kernels/ with nvcc (sm_90a; with --hopper, QK_WGMMA too, for the wgmma and bulk kernels),
disassembles it with cuobjdump and prints, per kernel, its instruction count and its main loop's: the span of the
longest backward branch, with the loop's opcodes by count, how many of them are integer-ALU opcodes (ALU) and
integer multiply-adds (IMAD), and which of issue, ALU and IMAD bounds it by a pipe model (`pipe_bound`). The counts
are static: a loop that holds two paths (per channel and per group) counts both. For the wgmma kernels it also lists
every instruction that writes a register of a wgmma still in flight, or reads its sums (`wgmma_hazards`): there
should be none.

    python bench/sass_loops.py MODULE [--hopper] [-D NAME=VALUE ...] [--kernels REGEX] [--cuobjdump PATH]

e.g. `python bench/sass_loops.py qserve_w4a8 --hopper --kernels 'wgmma$|gemm'`. cuobjdump ships with the CUDA
toolkit, or as the pip package nvidia-cuda-cuobjdump (its nvidia/cu13/bin/cuobjdump, which the dev extra installs
and this script finds).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\.\S*)?\s*([^;]*);")


class Instruction(NamedTuple):
    address: int
    opcode: str  # without its modifiers: IMAD for IMAD.WIDE.U32
    modifiers: str  # ".WIDE.U32"
    operands: str


def parse(sass: str) -> dict[str, list[Instruction]]:
    """cuobjdump -sass output as {kernel: [Instruction]}."""
    kernels: dict[str, list[Instruction]] = {}
    name = None
    for line in sass.splitlines():
        if match := re.search(r"Function : (\S+)", line):
            name = match.group(1)
            kernels[name] = []
        elif name and (match := INSTRUCTION.match(line)):
            kernels[name].append(Instruction(int(match.group(1), 16), match.group(2), match.group(3) or "",
                                             match.group(4)))
    return kernels


def branch_target(instruction: Instruction) -> int | None:
    """Where a BRA goes (None for any other instruction)."""
    target = re.search(r"0x([0-9a-f]+)", instruction.operands) if instruction.opcode == "BRA" else None
    return int(target.group(1), 16) if target else None


def main_loop(instructions: list[Instruction]) -> collections.Counter | None:
    """The opcodes of the span of the longest backward branch (None without a loop)."""
    spans = [(target, i.address) for i in instructions if (target := branch_target(i)) is not None
             and target < i.address]
    if not spans:
        return None
    first, last = max(spans, key=lambda span: span[1] - span[0])
    return collections.Counter(i.opcode for i in instructions if first <= i.address <= last)


# Opcodes whose first operand is not a register they write.
NO_DESTINATION = frozenset({"ST", "STS", "STG", "STL", "BRA", "BAR", "WARPGROUP", "IGMMA", "LDGSTS", "DEPBAR",
                            "MEMBAR", "FENCE", "EXIT", "BSYNC", "BSSY", "RED", "NOP", "LDGDEPBAR", "CCTL", "RET"})


def written(instruction: Instruction) -> set[int]:
    """The general registers an instruction writes: its first operand, two wide for .64 and .WIDE forms, four for
    .128, and for LDSM (ldmatrix) as many as its .2 or .4 says (predicates and uniform registers are not general
    registers)."""
    first = re.match(r"R(\d+)\b", instruction.operands.strip())
    if instruction.opcode in NO_DESTINATION or not first:
        return set()
    matrices = re.search(r"\.([24])$", instruction.modifiers) if instruction.opcode == "LDSM" else None
    width = int(matrices.group(1)) if matrices else 4 if ".128" in instruction.modifiers else \
        2 if re.search(r"\.64|\.WIDE", instruction.modifiers) else 1
    return set(range(int(first.group(1)), int(first.group(1)) + width))


def read(instruction: Instruction) -> set[int]:
    """The general registers an instruction reads: every register operand but the one it writes, two for an R.64
    address, and a store's data as wide as the store (.64, .128)."""
    operands = [o.strip() for o in instruction.operands.split(",")]
    if written(instruction):
        operands = operands[1:]
    registers = set()
    for operand in operands:
        for r, wide in re.findall(r"\bR(\d+)(\.64)?", operand):
            registers |= set(range(int(r), int(r) + (2 if wide else 1)))
    store = instruction.opcode in ("ST", "STS", "STG", "STL")
    if store and (data := re.fullmatch(r"R(\d+)", operands[-1])):
        width = 4 if ".128" in instruction.modifiers else 2 if ".64" in instruction.modifiers else 1
        registers |= set(range(int(data.group(1)), int(data.group(1)) + width))
    return registers


def wgmma_hazards(instructions: list[Instruction]) -> list[str]:
    """Instructions that write a register of a wgmma still in flight (IGMMA, whose A fragments are its second
    operand's four registers and its accumulators its first operand's N / 2 for m64nNk32), or read one of its
    accumulators, before the WARPGROUP.DEPBAR that retires it: the PTX ISA leaves a wgmma's registers undefined
    while it runs, so any such access is a wrong result (a later IGMMA of the same sums is not one). A wgmma's group
    closes at the first IGMMA carrying gsb0; DEPBAR.LE gsb0, n retires it once n groups have closed after it. The
    walk follows each backward branch once (the loop's next step)."""
    at = {i.address: k for k, i in enumerate(instructions)}
    found = []
    for k, wgmma in enumerate(instructions):
        shape = re.match(r"\.64x(\d+)x", wgmma.modifiers) if wgmma.opcode == "IGMMA" else None
        if not shape:
            continue
        acc, a = (int(r) for r in re.findall(r"\bR(\d+)\b", wgmma.operands)[:2])
        sums = set(range(acc, acc + int(shape.group(1)) // 2))
        held = set(range(a, a + 4)) | sums
        closed, after, taken, j = "gsb0" in wgmma.operands, 0, set(), k + 1
        while j < len(instructions):
            i = instructions[j]
            if i.opcode == "IGMMA" and "gsb0" in i.operands:
                after, closed = after + closed, True
            depth = re.search(r"gsb0, 0x([0-9a-f]+)", i.operands) if i.modifiers.startswith(".DEPBAR") else None
            if depth and closed and after >= int(depth.group(1), 16):
                break
            if i.opcode != "IGMMA" and (clash := written(i) & held):
                found.append(f"{i.address:#06x} {i.opcode}{i.modifiers} writes R{min(clash)} of the wgmma at "
                             f"{wgmma.address:#06x}")
            elif i.opcode != "IGMMA" and (clash := read(i) & sums):
                found.append(f"{i.address:#06x} {i.opcode}{i.modifiers} reads R{min(clash)} of the wgmma at "
                             f"{wgmma.address:#06x}")
            target = branch_target(i)
            if target is not None and target < i.address and i.address not in taken:
                taken.add(i.address)
                j = at[target]
                continue
            j += 1
    return found


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


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, else from the nvidia-cuda-cuobjdump wheel (the dev extra installs it and, for its -sass,
    nvidia-cuda-nvdisasm); None without."""
    if found := shutil.which("cuobjdump"):
        return found
    try:
        import nvidia
    except ImportError:
        return None
    return next((str(p) for root in nvidia.__path__ for p in sorted(Path(root).glob("cu*/bin/cuobjdump"))), None)


def sass_of(module: str, hopper: bool, defines: list[str], cuobjdump: str) -> str:
    """The SASS of kernels/MODULE.cu built by nvcc for sm_90a (with QK_WGMMA when `hopper`) under `defines`."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-cubin",
                        *(["-DQK_WGMMA"] if hopper else []), *(f"-D{d}" for d in defines),
                        str(KERNELS / f"{module}.cu"), "-o", str(cubin)], check=True)
        # cuobjdump -sass runs nvdisasm, which the wheels put beside it
        env = {**os.environ, "PATH": f"{Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        return subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True,
                              env=env).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", help="a kernels/*.cu module, e.g. qserve_w4a8 or anyprec_gemv")
    parser.add_argument("--hopper", action="store_true", help="also build the Hopper kernels (-DQK_WGMMA)")
    parser.add_argument("-D", dest="defines", action="append", default=[], help="a compile-time knob, NAME=VALUE")
    parser.add_argument("--kernels", default="", help="only the kernels whose names match this regular expression")
    parser.add_argument("--cuobjdump", default=find_cuobjdump(), help="the cuobjdump to use (default: PATH's, else "
                        "the nvidia-cuda-cuobjdump wheel's)")
    args = parser.parse_args()
    if not shutil.which("nvcc") or not args.cuobjdump:
        sys.exit("needs nvcc on PATH and cuobjdump with nvdisasm (on PATH, --cuobjdump PATH, or pip install "
                 "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    sass = sass_of(args.module, args.hopper, args.defines, args.cuobjdump)
    for name, instructions in sorted(parse(sass).items()):
        if not re.search(args.kernels, name):
            continue
        loop = main_loop(instructions)
        counts = f"main loop {sum(loop.values())} (ALU {alu(loop)}, IMAD {loop.get('IMAD', 0)}; {pipe_bound(loop)}" \
            "-bound by the model): " + ", ".join(f"{op} {n}" for op, n in loop.most_common(8)) if loop else "no loop"
        hazards = wgmma_hazards(instructions)
        if any(i.opcode == "IGMMA" for i in instructions):
            counts += f"; {len(hazards)} accesses to a wgmma's registers in flight"
            counts += "".join(f"\n  {h}" for h in hazards)
        print(f"{name}: {len(instructions)} instructions; {counts}")


if __name__ == "__main__":
    main()
