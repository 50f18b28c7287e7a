"""Everything issue #6 needs a GPU for, in one command, for a lent device whose time is short.

1. The device tests (pytest -m gpu; CI runs all the others): every GPU kernel must equal the emulation bit for
   bit, the split-K paths included, and a quantize run on the GPU must match the CPU's. The Hopper (wgmma)
   kernels' tests (-m hopper) run first in a process of their own: if they fail, every later step runs with
   QUANTKIT_WGMMA=0, so that a broken wgmma kernel (a sticky CUDA error ends the process's context) costs none of
   the other kernels' results. The cp.async wgmma loop's tests (-m cpasync; QK_WGMMA_TMA=0, the default until
   run 10) and the bulk-copy decode kernel's (-m bulk; off by default) follow, each in a process of their own with
   a short limit, neither gating the later steps. With --kernel sim, the kernel tests of tests/test_kernels.py
   instead. Each test step spreads its tests over --test-workers pytest-xdist workers where that is installed (the
   H200's image has it): the emulation's numpy on the CPU takes most of their time.
2. `quantkit bench --shapes llama3-8b`: every kernel against cuBLAS FP16 and INT8, and the issue's bars (GPU only;
   right after the tests, so that a short lease still brings the bars back).
2a. `quantkit validate --kernel KERNEL` on an artifact of every recipe with a packed layout (--recipes), each
   quantized from a synthetic Llama with 128-multiple widths (hidden 256, intermediate 1024; nothing from
   ../shared, which does not travel to the device). Right after the bench: with the tests and the bars, it is what
   issue #6 asks of a GPU, where the steps after it explore. `--prepare DIR` quantizes them on a machine without a
   GPU and exits (about 20 s each on 2 cores); `--artifacts DIR` then validates those, carried to the device, without
   quantizing there.
2b. bench/timeline.py: the decode kernels built with their phase stamps (kernels/qk_timeline.cuh), where the time
   between launch and the last store goes: the first loads' latency, the stream, the split-K meetings, the stores
   (GPU only; --skip-timeline leaves it out).
2c. With --profile-large, the Hopper (wgmma) kernels at M = 1024 under Nsight Compute (ncu): what holds them back
   (stall reasons, L2 and tensor-pipe throughput), before the tuning whose configurations it is to explain.
2d. bench/smallm_tune.py: with --tune-large first, the Hopper kernels' few configurations at M = 1024; then the
   small-M kernels under each look-ahead and split-K configuration, side by side; with --bench-tuned, `quantkit
   bench` once more under the fastest configuration of each tuning step (bench_tuned.json, whose report names the
   defines and settings it ran); then bench/profile_smallm.py under ncu, where the decode kernels' time goes (GPU
   only; --skip-tune, --skip-profile leave them out).
3. The threshold sweep: `quantkit bench --paths all` at M from 1 to 1024, every kernel of each layout side by side,
   to set TILED_MIN_M and ANYPREC_TC_MIN_M (GPU only; --skip-sweep leaves it out).

The log goes to --out/gpu_check.log (the device tool's $OUT; with bench.json, timeline.json, tune.json,
tune_large.json, bench_tuned.json and sweep.json, seven files: the tool brings back at most eight); a table of the
steps' exit codes is printed last; the script exits 0 only where every step ran and passed.
Each step has a time limit (a hung kernel ends its step with exit code 124, not the whole run), and --budget caps
the whole run: a step gets at most what is left, and one that would get under 30 s is skipped (exit code -1 in the
table). On a machine without a GPU, `--kernel sim` runs steps 1 and 2a with the warp simulator, which checks the
script itself.
A process builds the kernel modules it uses with NVRTC unless their cubins are cached ($QUANTKIT_CACHE/kernels):
about 40 s of one core for each set of knobs, the tuning configurations' included. So the run starts with
bench/build_kernels.py, which builds every module the run will load, on all cores at once; built ahead on a machine
without a GPU and carried to the device with QUANTKIT_CACHE pointing at them, they are found there and cost nothing.

    PYTHONPATH=. python3 bench/gpu_check.py --out $OUT [--kernel cuda|sim] [--budget S] [--skip-tests] [--skip-bench]
        [--skip-timeline] [--skip-tune] [--tune-args ARGS] [--tune-large ARGS] [--tune-seconds S] [--bench-tuned]
        [--skip-profile] [--profile-formats F,...] [--profile-args ARGS] [--profile-large] [--skip-validate]
        [--skip-sweep] [--recipes NAME,...] [--artifacts DIR] [--test-workers N]
    PYTHONPATH=. python3 bench/gpu_check.py --prepare DIR [--recipes NAME,...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROFILE = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats")
PROFILE_LARGE = ("ComputeWorkloadAnalysis", "SchedulerStats", "MemoryWorkloadAnalysis_Tables")
# The warp stall reasons by name (cycles a warp waits per issued instruction, for each reason): the sections above
# print only the total, and the H100 run of 295865a without these metrics could not say what the wgmma kernels wait on.
STALL_METRICS = r"regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$"
RECIPES = ("qoq", "qoq-g128", "qqq", "qqq-g128", "lqq-g64", "atom-w4a4", "anyprec-3to8")


DEADLINE = [float("inf")]  # time.time() by which the whole run ends (--budget)


def step(name: str, cmd: list[str], out: Path, results: list[tuple[str, int, float]], limit: float = 300,
         env: dict[str, str] | None = None) -> int:
    """Run `cmd` from the repository root, its output appended to OUT/gpu_check.log and to the console, for at
    most `limit` seconds or what is left of the budget (then killed: exit code 124); record its exit code. Under
    30 s left: skipped, exit code -1. Every process the step started ends with it."""
    limit = min(limit, DEADLINE[0] - time.time())
    if limit < 30:
        print(f"\n=== {name}: skipped, {max(limit, 0):.0f} s of the budget left", flush=True)
        results.append((name, -1, 0.0))
        return -1
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    with open(out / "gpu_check.log", "a") as log:  # one file: the device tool brings back at most 8
        log.write(f"\n=== {name}: {' '.join(cmd)}\n")
        # a process group of its own, so that a kill takes the step's children too (pytest-xdist's workers, the
        # tuning's per-configuration processes): none may outlive its step and share the GPU with the next one's
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        def reap() -> None:  # once the step's own process is done, what it left running (holding the log's pipe) goes
            proc.wait()
            kill()

        timer = threading.Timer(limit, kill)
        timer.start()
        threading.Thread(target=reap, daemon=True).start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            code = proc.wait()
        finally:  # on time, early (Ctrl-C) or done: whatever of the step still runs ends with it
            timer.cancel()
            kill()
        if time.time() - t0 >= limit:
            code = 124
            print(f"=== {name}: killed after {limit:.0f} s", flush=True)
    results.append((name, code, time.time() - t0))
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="where the logs go (the device tool's $OUT)")
    parser.add_argument("--kernel", choices=["cuda", "sim"], default="cuda", help="where validate runs the kernels")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the device tests (a second run on a "
                        "machine whose first run passed them; with --kernel sim, the simulator's kernel tests)")
    parser.add_argument("--skip-bench", action="store_true", help="leave out `quantkit bench`")
    parser.add_argument("--skip-timeline", action="store_true", help="leave out bench/timeline.py")
    parser.add_argument("--skip-tune", action="store_true", help="leave out bench/smallm_tune.py")
    parser.add_argument("--skip-profile", action="store_true", help="leave out the Nsight Compute profile")
    parser.add_argument("--skip-validate", action="store_true", help="leave out the quantize + validate steps")
    parser.add_argument("--skip-sweep", action="store_true", help="leave out the threshold sweep")
    parser.add_argument("--tune-args", default="", help="arguments for bench/smallm_tune.py (e.g. \"--formats "
                        "anyprec --ms 1,4,16\")")
    parser.add_argument("--profile-formats", default="", help="the layouts to profile (default all; "
                        "bench/profile_smallm.py --formats)")
    parser.add_argument("--profile-args", default="", help="more arguments for bench/profile_smallm.py (e.g. "
                        "\"--shapes 4096x4096,4096x14336 --ms 1,16\")")
    parser.add_argument("--tune-seconds", type=float, default=200, help="the limit of each tuning step (default "
                        "200; its JSON keeps every configuration finished in time)")
    parser.add_argument("--tune-large", metavar="ARGS", help="also run bench/smallm_tune.py --large with these "
                        "arguments (\"\" for its defaults): the Hopper kernels' ring and width at M = 1024")
    parser.add_argument("--profile-large", action="store_true", help="also profile the Hopper (wgmma) kernels at "
                        "M = 1024 under Nsight Compute (bench/profile_smallm.py --large)")
    parser.add_argument("--bench-tuned", action="store_true", help="after the tuning steps, run `quantkit bench` "
                        "again under the fastest configuration each found (bench_tuned.json; its report records "
                        "the defines and settings), unless that is the built-in default")
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds for the whole run")
    parser.add_argument("--test-workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="pytest-xdist workers for the test steps (default: the CPU's cores, at most 8); 1, or "
                        "no pytest-xdist installed, runs them in one process")
    parser.add_argument("--recipes", default=",".join(RECIPES),
                        help="comma-separated recipes to quantize and validate (default: every one that packs)")
    parser.add_argument("--prepare", type=Path, metavar="DIR", help="only quantize the synthetic Llama with each "
                        "recipe into DIR/RECIPE (no GPU needed) and exit: carried to the device, --artifacts DIR "
                        "validates them there")
    parser.add_argument("--artifacts", type=Path, metavar="DIR", help="validate the artifacts --prepare wrote to "
                        "DIR instead of quantizing on the device")
    args = parser.parse_args()
    if args.prepare is not None:
        sys.exit(prepare_artifacts(args.prepare.resolve(), args.recipes.split(",")))
    if args.out is None:
        parser.error("--out is required (unless --prepare)")
    DEADLINE[0] = time.time() + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work" if args.kernel == "sim" else Path("/tmp/quantkit-gpu-check")
    work.mkdir(parents=True, exist_ok=True)
    py, results = sys.executable, []

    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py"]
    many = [*pytest, *xdist_args(args.test_workers)]  # the steps of many tests, spread over the CPU's cores
    env = {}
    if args.kernel == "cuda":  # the device tests only: CI runs the rest (the warp simulator's among them)
        # every kernel module the run will load, built by NVRTC on all cores at once (or found built ahead and
        # carried), not one module at a time inside each timed step
        step("build", [py, "bench/build_kernels.py",
                       "--configs", "" if args.skip_tune else configs_named(args.tune_args),
                       "--large-configs", "" if args.tune_large is None else configs_named(args.tune_large),
                       "--defines", "" if args.skip_timeline else "QK_TIMELINE=1"],
             args.out, results, 180)
        if not args.skip_tests:
            if step("wgmma-tests", [*many, "-m", "hopper and not bulk and not cpasync"], args.out, results, 120) != 0:
                env = {"QUANTKIT_WGMMA": "0"}  # the later steps leave the Hopper kernels out
            # the cp.async ring (the default until run 10) apart too: a failure there must not take the default
            # wgmma kernels out of the later steps
            step("cp-async-tests", [*pytest, "-m", "cpasync"], args.out, results, 90, env)
            # the bulk-copy decode kernel (off by default) apart: a wrong mbarrier count would hang only this step
            step("bulk-tests", [*many, "-m", "bulk"], args.out, results, 60, env)
            step("gpu-tests", [*many, "tests/test_pipeline.py", "-m", "gpu and not hopper"], args.out, results, 240,
                 env)
        if not args.skip_bench:  # the bars first: the validate steps and the sweep may run out of the lease
            step("bench", [py, "-m", "quantkit.cli", "bench", "--shapes", "llama3-8b", "--json",
                           str(args.out / "bench.json")], args.out, results, 360, env)  # 3 rounds
        if not args.skip_validate:
            validate_recipes(args, work, results, env)
        if not args.skip_timeline:  # where the decode kernels' time goes, phase by phase
            step("timeline", [py, "bench/timeline.py", "--json", str(args.out / "timeline.json")], args.out, results,
                 120, env)
        ncu = shutil.which("ncu") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/ncu"))), None)
        if args.profile_large and ncu:  # where the M = 1024 (wgmma) kernels' time goes: before the tuning, whose
            # configurations it is to explain
            step("profile-large", [ncu, "--kernel-name", "regex:_wgmma(2|_tall)?$",
                                   *(f"--section={s}" for s in (*PROFILE, *PROFILE_LARGE)), "--metrics",
                                   STALL_METRICS, py,
                                   "bench/profile_smallm.py", "--large"], args.out, results, 150, env)
        best = [work / "best.json", work / "best_large.json"]  # each tuning step's fastest configuration
        for path in best:
            path.unlink(missing_ok=True)
        # the M = 1024 kernels' short tuning first: a few configurations, where the small-M one has many and a
        # time limit of its own to cut it short
        if args.tune_large is not None and not env:  # the Hopper kernels' configurations at M = 1024
            step("tune-large", [py, "bench/smallm_tune.py", "--large", "--json", str(args.out / "tune_large.json"),
                                "--best", str(best[1]), *shlex.split(args.tune_large)], args.out, results,
                 args.tune_seconds, env)
        if not args.skip_tune:
            step("tune", [py, "bench/smallm_tune.py", "--json", str(args.out / "tune.json"), "--best", str(best[0]),
                          *shlex.split(args.tune_args)], args.out, results, args.tune_seconds, env)
        if args.bench_tuned:  # the bars again, under what the tuning steps found fastest
            tuned = tuned_env([path for path in best if path.exists()])
            if tuned is None:
                print("\n=== bench-tuned: skipped, the built-in defaults were the fastest (or nothing was tuned)",
                      flush=True)
            else:  # any module whose merged knobs no single configuration had, built on all cores first
                step("build-tuned", [py, "bench/build_kernels.py", "--defines", tuned["QUANTKIT_NVRTC_DEFINES"]],
                     args.out, results, 90)
                step("bench-tuned", [py, "-m", "quantkit.cli", "bench", "--shapes", "llama3-8b", "--json",
                                     str(args.out / "bench_tuned.json")], args.out, results, 360, {**env, **tuned})
        if not args.skip_profile and ncu:  # where the decode kernels' time goes, for the next round of tuning
            formats = ["--formats", args.profile_formats] if args.profile_formats else []
            # the decode kernels (Any-Precision's at 3 bits)
            kernels = "regex:_gemm(8|16|_pc)?(_z[24])?$|_bulk8?$|_gemv$|_tc8?_3(_fast)?(_w4)?$"
            step("profile", [ncu, "--kernel-name", kernels, *(f"--section={s}" for s in PROFILE), py,
                             "bench/profile_smallm.py", *formats, *shlex.split(args.profile_args)], args.out, results,
                 100, env)
    else:
        if not args.skip_tests:  # the whole kernel test file on the CPU: about 10 minutes on 2 cores
            step("kernel-tests", many, args.out, results, 1200, env)
        if not args.skip_validate:
            validate_recipes(args, work, results, env)
    if not args.skip_sweep and args.kernel == "cuda":
        step("sweep", [py, "-m", "quantkit.cli", "bench", "--shapes", "llama3-8b", "--paths", "all", "--m",
                       "1,4,16,64,256,1024", "--iters", "10", "--rounds", "1", "--json", str(args.out / "sweep.json")],
             args.out, results, 400, env)

    print("\n| step | exit code | seconds |\n|---|---|---|")
    for name, code, seconds in results:
        print(f"| {name} | {code} | {seconds:.0f} |")
    sys.exit(exit_status(results))


def exit_status(results: list[tuple[str, int, float]]) -> int:
    """0 where every step ran and passed, else 1: a step that failed, timed out (124), was skipped (-1) or was
    killed by a signal (its negative number: a segfault, the OOM killer) checked nothing."""
    return int(any(code != 0 for _, code, _ in results))


def xdist_args(workers: int) -> list[str]:
    """pytest's arguments that spread a step's tests over `workers` processes (pytest-xdist, which the H200's image
    holds), or none where it is not installed or one is asked for. The device tests spend most of their time in the
    emulation's numpy on the CPU, one core each (the H200 lease of 112f7d7 ran 41 of 53 before its limit), and each
    worker's CUDA context is its own, so a kernel's sticky error ends only its worker's tests."""
    import importlib.util

    return ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") is not None else []


def configs_named(tune_args: str) -> str:
    """The configurations that bench/smallm_tune.py runs with these arguments: its --configs, else all."""
    words = shlex.split(tune_args)
    for i, word in enumerate(words):
        if word == "--configs" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--configs="):
            return word.partition("=")[2]
    return "all"


def tuned_env(best: list[Path]) -> dict[str, str] | None:
    """The environment that runs the kernels under the fastest configurations of the tuning steps (their --best
    files; the small-M and the M = 1024 knobs are disjoint): QUANTKIT_NVRTC_DEFINES and QUANTKIT_KERNEL_SETTINGS, or
    None where every step's fastest was its built-in default."""
    import json

    found = [json.loads(path.read_text()) for path in best]
    for path, run in zip(best, found, strict=True):
        print(f"fastest in {path.name}: {run['config']}{' (the built-in default)' if run['default'] else ''}",
              flush=True)
    if all(run["default"] for run in found):
        return None
    defines = {name: value for run in found for name, value in run["defines"].items()}
    settings = {name: value for run in found for name, value in run["settings"].items()}
    return {"QUANTKIT_NVRTC_DEFINES": " ".join(f"{name}={value}" for name, value in defines.items()),
            "QUANTKIT_KERNEL_SETTINGS": json.dumps(settings)}


def prepare_artifacts(root: Path, recipes: list[str], results: list[tuple[str, int, float]] | None = None,
                      out: Path | None = None) -> int:
    """Quantize the synthetic Llama with each recipe into ROOT/RECIPE (on whatever device quantize picks); the
    exit code is 1 if any recipe failed. Run alone (--prepare), its log goes to ROOT/gpu_check.log."""
    from quantkit.synthetic import SyntheticLlama, write_calibration_text, write_synthetic_llama

    root.mkdir(parents=True, exist_ok=True)
    results = [] if results is None else results
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:  # the model and text stay behind: only the artifacts travel
        # intermediate 1024: down_proj's K takes the Any-Precision kernels' fast twins (K a multiple of 1024)
        model = write_synthetic_llama(Path(tmp) / "model", SyntheticLlama(hidden_size=256, intermediate_size=1024,
                                                                            num_hidden_layers=2))
        calib = write_calibration_text(Path(tmp) / "calib.txt")
        for recipe in recipes:
            failed |= step(f"quantize-{recipe}", [sys.executable, "-m", "quantkit.cli", "quantize", str(model),
                                                  "--recipe", recipe, "-o", str(root / recipe), "--calib", str(calib),
                                                  "--num-samples", "8", "--seq-len", "128", "--overwrite"],
                           out or root, results, 300) != 0
    return int(failed)


def validate_recipes(args: argparse.Namespace, work: Path, results: list[tuple[str, int, float]],
                     env: dict[str, str]) -> None:
    """Validate each recipe's artifact with the kernels: those --prepare wrote to --artifacts, else ones quantized
    here from the synthetic Llama."""
    recipes = args.recipes.split(",")
    root = args.artifacts and args.artifacts.resolve()  # the steps run from the repository's root, not from here
    if root is None:
        root = work / "artifacts"
        prepare_artifacts(root, recipes, results, args.out)
    for recipe in recipes:
        artifact = root / recipe
        if not (artifact / "config.json").is_file():
            print(f"\n=== validate-{recipe}: no artifact at {artifact}", flush=True)
            results.append((f"validate-{recipe}", 2, 0.0))
            continue
        step(f"validate-{recipe}", [sys.executable, "-m", "quantkit.cli", "validate", str(artifact), "--kernel",
                                    args.kernel], args.out, results, 300, env)


if __name__ == "__main__":
    main()
