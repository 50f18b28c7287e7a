"""Helpers shared by the benchmarks: run the CLI in a subprocess, read results, print tables."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from quantkit.files import atomic_write

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QUANTKIT_SHARED", REPO.parent / "shared"))


@dataclass
class SmolLM2Job:
    """What every SmolLM2-135M benchmark starts from: its arguments, the shared files and the work dir."""

    args: argparse.Namespace
    model: Path  # the GGUF, dequantized by quantkit: the FP16 baseline
    data: Path  # shared/data (eval data and calibration text)
    c4: Path
    work: Path
    ledger: Ledger


def smollm2_job(doc: str, prefix: str, rows: list[str], extra: Callable[[argparse.ArgumentParser], None] | None = None
                ) -> SmolLM2Job:
    """Parse `--work`, `--windows`, `--only` (labels among `rows`, the script's; one no row has is refused with the
    list) and what `extra` adds, and check the shared model and data are present."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="keep artifacts and results here; a rerun reuses them "
                        "(default: a fresh temp dir)")
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--only", nargs="+", action="extend", metavar="LABEL",
                        help="run only the rows with these labels (repeatable; the FP16 reference always runs)")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results" / f"{Path(sys.argv[0]).stem}.json",
                        help="the ledger of measured rows, kept in the repository (default: %(default)s)")
    parser.add_argument("--remeasure", choices=["none", "stale", "all"], default="none",
                        help="which rows already in the ledger to measure again: none, those measured with other "
                        "quantkit code (stale), or all")
    parser.add_argument("--report", action="store_true",
                        help="measure nothing: print the tables from the ledger alone (rows it lacks show as "
                        "not measured)")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    unknown = [label for label in args.only or [] if label not in rows]
    if unknown:  # a typo would measure nothing but the reference, and say nothing
        parser.error(f"--only: no row is labelled {', '.join(map(repr, unknown))}; the rows: "
                     + ", ".join(map(repr, rows)))
    check = (lambda path: path) if args.report else need
    model = check(SHARED / "models/smollm2-135m-instruct-q4_1/SmolLM2-135M-Instruct.Q4_1.gguf")
    data = check(SHARED / "data")
    c4 = check(data / "c4/c4-train.00000-of-01024.first800.jsonl")
    if args.report:  # commands are keyed with $WORK for the work dir, so any path names the same rows
        work = args.work or Path("WORK")
    else:
        work = args.work or Path(tempfile.mkdtemp(prefix=prefix))
        work.mkdir(parents=True, exist_ok=True)
    return SmolLM2Job(args, model, data, c4, work, Ledger(args.results, work, args.remeasure, args.report))


def need(path: Path) -> Path:
    if not path.exists():
        sys.exit(f"missing {path}: the benchmark reads the project's shared/ folder (set QUANTKIT_SHARED)")
    return path


def ppl_cells(result: dict | None, reference: float | None = None) -> list[str]:
    """A row's perplexity (and its difference to `reference` when given) as table cells; '-' if not measured."""
    if result is None:
        return ["not measured"] + (["-"] if reference is not None else [])
    cells = [f"{result['ppl']:.2f}"]
    if reference is not None:
        cells.append(f"{result['ppl'] - reference:+.2f}" if reference == reference else "-")  # nan: no FP16 row
    return cells


def quantkit(*args: str) -> float:
    """Run `quantkit ARGS` in a fresh process (so its peak RSS is its own); returns wall seconds."""
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "quantkit.cli", *args], check=True)
    return time.time() - t0


def manifest(out: Path) -> dict:
    return json.loads((out / "quantkit_manifest.json").read_text())


def _recipe_digest(args: tuple[str, ...]) -> str | None:
    """sha256 of the bundled recipe file that `--recipe NAME` names, so an edited recipe is not served stale."""
    if "--recipe" not in args:
        return None
    name = args[args.index("--recipe") + 1]
    path = REPO / "recipes" / f"{name}.yaml"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _code_digest() -> str:
    """sha256 over the quantkit package's Python sources: any code change invalidates cached artifacts."""
    h = hashlib.sha256()
    for path in sorted((REPO / "quantkit").rglob("*.py")):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def slug(label: str) -> str:
    """A table row's label as a file name: every non-alphanumeric character becomes _."""
    return "".join(c if c.isalnum() else "_" for c in label).strip("_")


_QUANTIZED_NOW: set[Path] = set()  # the artifacts this process quantized (rows that share one reuse it anyway)


def quantize_cached(model: Path, out: Path, *args: str, reuse: bool = True) -> float:
    """`quantkit quantize MODEL -o OUT ARGS`, skipped when OUT holds a finished artifact of the same command, recipe
    file and quantkit code (its measured wall time is kept beside it) from an earlier run (with `reuse`) or from this
    process; returns wall seconds. A run of the same command and code that was interrupted (a session ended)
    continues with --resume; its wall time is then the interrupted part's per-layer times plus the resumed run, and
    the stamp says it was resumed."""
    stamp = out.with_name(out.name + ".wall.json")
    started = out.with_name(out.name + ".started.json")
    cmd = ["quantize", str(model), "-o", str(out), *args]
    key = {"cmd": cmd, "recipe_sha256": _recipe_digest(args), "code_sha256": _code_digest()}
    if (reuse or out in _QUANTIZED_NOW) and stamp.exists() and (out / "quantkit_manifest.json").exists():
        cached = json.loads(stamp.read_text())
        if {k: cached.get(k) for k in key} == key:
            return cached["wall"]
    journal = out.with_name(out.name + ".partial") / "quantkit_journal.json"
    earlier = 0.0
    if journal.exists() and started.exists() and json.loads(started.read_text()) == key:
        earlier = sum(layer["seconds"] for layer in json.loads(journal.read_text())["layers"].values())
        cmd = [a for a in cmd if a != "--overwrite"] + ["--resume"]
    started.parent.mkdir(parents=True, exist_ok=True)  # a first run of a row: its folder under --work is new
    atomic_write(started, json.dumps(key))
    wall = earlier + quantkit(*cmd)
    atomic_write(stamp, json.dumps({**key, "wall": wall, "resumed": earlier > 0}))
    _QUANTIZED_NOW.add(out)
    return wall


def eval_ppl(model: Path, data_dir: Path, windows: int, seq_len: int, json_path: Path, *extra: str) -> float:
    """WikiText-2 perplexity through `quantkit eval` (with `extra` options, e.g. --bits 3); reuses `json_path`
    when an earlier run wrote it with the same command and quantkit code after the model was last written (a
    stamp beside it keeps both), so that an FP16 or llm-compressor model, which has no quantkit manifest, is
    measured again when the eval code changes or the model is written again."""
    cmd = ["eval", str(model), "--tasks", "wikitext", "--limit", str(windows), "--seq-len", str(seq_len),
           "--data-dir", str(data_dir), "--output-json", str(json_path), *extra]
    stamp = json_path.with_name(json_path.name + ".key.json")
    key = {"cmd": cmd, "code_sha256": _code_digest()}
    files = [p for p in model.iterdir() if p.is_file()] if model.is_dir() else [model]
    written = max((p.stat().st_mtime for p in files), default=0.0)
    if (json_path.exists() and stamp.exists() and json.loads(stamp.read_text()) == key
            and json_path.stat().st_mtime > written):
        return json.loads(json_path.read_text())["results"]["wikitext"]["perplexity"]
    quantkit(*cmd)
    atomic_write(stamp, json.dumps(key))
    return json.loads(json_path.read_text())["results"]["wikitext"]["perplexity"]


@dataclass
class Ledger:
    """The measured rows of one benchmark, kept in the repository (bench/results/) so that a table that takes
    longer than a session to measure on a CPU is built over several. A row is keyed by its label and the exact
    commands it ran (shared/ and work paths written as $SHARED and $WORK) with the recipe files they read;
    it records the quantkit code digest, commit, date, CPU probe and load average (before and after: a load above
    the bench's own says other work shared the CPU) it was measured with, and a table shows which rows were
    measured with code other than the current."""

    path: Path
    work: Path
    remeasure: str = "none"  # none | stale | all
    report: bool = False  # read only: rows not in the ledger are None, nothing is measured
    rows: dict = field(init=False)

    def __post_init__(self) -> None:
        self.rows = json.loads(self.path.read_text()) if self.path.exists() else {}

    def _portable(self, args: list[str]) -> list[str]:
        return [a.replace(str(self.work), "$WORK").replace(str(SHARED), "$SHARED") for a in args]

    def measure(self, label: str, commands: list[list[str]], run: Callable[[], dict]) -> dict | None:
        """`run()`'s result for row `label`, from the ledger when it holds this row for the same commands (and
        the --remeasure policy keeps it), else measured now and saved at once (atomically); in report mode the
        ledger's row or None."""
        key = {"commands": [self._portable(c) for c in commands],
               "recipes": [_recipe_digest(tuple(c)) for c in commands]}
        row = self.rows.get(label)
        if self.report:
            return row["result"] if row is not None and row["key"] == key else None
        if row is not None and row["key"] == key and not (
                self.remeasure == "all" or (self.remeasure == "stale" and row["code_sha256"] != _code_digest())):
            return row["result"]
        code, probe, load = _code_digest(), cpu_probe(), os.getloadavg()[0]
        result = run()
        self.rows[label] = {"key": key, "result": result, "code_sha256": code, "commit": _commit(),
                            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "cpu_gflops": round(probe),
                            "cpus": os.cpu_count(), "load_1min": [round(load, 1), round(os.getloadavg()[0], 1)]}
        # rows another run of this bench wrote meanwhile are kept: read the ledger again, add this row, replace
        latest = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.rows = {**latest, label: self.rows[label]}
        atomic_write(self.path, json.dumps(self.rows, indent=1, sort_keys=True) + "\n")
        return result

    def provenance(self, label: str) -> str:
        """'current' when row `label` was measured with today's quantkit code, else the commit and date it was."""
        row = self.rows.get(label)
        if row is None:
            return "-"
        if row["code_sha256"] == _code_digest():
            return "current"
        return f"{row['commit']} {row['date']}"

    def note(self, labels: list[str]) -> str:
        """One line that says with what code and on what CPU the `labels` rows were measured."""
        marks = sorted({self.provenance(label) for label in labels if label in self.rows})
        probes = sorted({self.rows[label]["cpu_gflops"] for label in labels if label in self.rows})
        return (f"rows measured with quantkit code: {', '.join(marks) or '-'}; CPU probe at each row's start "
                f"{min(probes, default=0)}-{max(probes, default=0)} GFLOP/s (fp32 matmul)")


def _commit() -> str:
    """HEAD's short hash, with '+' when the quantkit package differs from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+" if git("status", "--porcelain", "--", "quantkit") else "")


def smollm2_row(job: SmolLM2Job, label: str, quantize_args: list[str], eval_args: tuple[str, ...] = (),
                out: Path | None = None) -> dict | None:
    """Quantize SmolLM2 with `quantize_args` (unless empty: the FP16 model itself) and measure WikiText-2
    perplexity (`eval_args`, e.g. --bits 3), through the ledger; returns {"ppl", "wall", "peak_rss_bytes"} (wall
    and peak RSS, the quantize run's, None for FP16; rows measured before peak RSS was recorded lack it), or None
    for a row not in the ledger with --report. Rows that share `out` (one artifact read at several widths)
    quantize it once."""
    out = out or job.work / slug(label)
    windows = job.args.windows
    evaluated = out if quantize_args else job.model
    eval_cmd = ["eval", str(evaluated), "--limit", str(windows), *eval_args]
    quant_cmd = ["quantize", str(job.model), "-o", str(out), *quantize_args] if quantize_args else []

    def run() -> dict:
        # --remeasure all asks for a new measurement: a finished artifact's wall time from an earlier run will not do
        reuse = job.ledger.remeasure != "all"
        wall = quantize_cached(job.model, out, *quantize_args, reuse=reuse) if quantize_args else None
        ppl = eval_ppl(evaluated, job.data, windows, 2048, job.work / f"{slug(label)}.json", *eval_args)
        rss = manifest(out)["peak_rss_bytes"] if quantize_args else None
        return {"ppl": ppl, "wall": wall, "peak_rss_bytes": rss}

    return job.ledger.measure(label, [c for c in (quant_cmd, eval_cmd) if c], run)


def cpu_probe(seconds: float = 3.0) -> float:
    """GFLOP/s of a float32 2048^3 matmul on this machine now: shared hosts vary by tens of percent over a day,
    so wall times are printed beside it."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        runs += 1
    return 2 * 2048**3 * runs / (time.perf_counter() - start) / 1e9


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])
