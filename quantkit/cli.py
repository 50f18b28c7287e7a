"""The `quantkit` command line: quantize, eval, recipes, inspect, validate, bench."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.table import Column, Table
from rich.text import Text

from quantkit.errors import QuantkitError, not_a_directory

console = Console(stderr=True)


def _fail(exc: QuantkitError) -> None:
    console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    sys.exit(2)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler, `docker stop`, systemd), taken as Ctrl-C is, so that a run stops the same way."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated()


class _Group(click.Group):
    """Turns QuantkitError into a one-line message and exit code 2 instead of a traceback, and an interrupt into the
    shell's exit code for its signal (130 for Ctrl-C, 143 for SIGTERM)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except QuantkitError as exc:
            _fail(exc)
        except KeyboardInterrupt as exc:
            console.print("aborted", highlight=False)
            sys.exit(128 + (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="quantkit")
@click.option("-v", "--verbose", is_flag=True,
              help="Log what quantkit resolved and did: the model, the calibration data, each layer's step times and "
                   "metrics, the files written.")
def main(verbose: bool) -> None:
    """quantkit: offline, recipe-driven post-training quantization of Llama-family LLMs.

    \b
    quantkit quantize --recipe gptq-w4a16-g128 MODEL -o OUT   # FP16 HF model in, quantized safetensors out
    quantkit eval OUT --tasks wikitext,piqa --data-dir DATA    # perplexity + zero-shot accuracy
    quantkit recipes                                           # what recipes ship
    quantkit inspect OUT                                       # what an artifact holds
    quantkit validate OUT                                      # packed layers through the kernels' emulation
    quantkit bench [OUT]                                       # the kernels against cuBLAS, on a GPU
    """
    # when the command began (the interpreter and click take a tenth of a second before): a quantize run's time
    # includes the seconds torch and transformers take to import
    click.get_current_context().meta["quantkit.started"] = time.time()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("quantkit").setLevel(logging.DEBUG if verbose else logging.NOTSET)  # libraries stay quiet
    warnings.showwarning = _show_warning
    if not console.is_terminal:  # a log gets quantkit's lines, not the libraries' bars redrawn with carriage returns
        for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
            os.environ.setdefault(name, "1")


def _verbose_too(command: Any) -> Any:
    """-v after the command's name too (`quantkit quantize -v ...`), as after `quantkit`."""
    def log_more(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value:
            logging.getLogger("quantkit").setLevel(logging.DEBUG)

    return click.option("-v", "--verbose", is_flag=True, expose_value=False, callback=log_more,
                        help="Log what quantkit resolved and did (as `quantkit -v`).")(command)


_LIBRARY_SHOWWARNING = warnings.showwarning
_PACKAGE_DIR = str(Path(__file__).resolve().parent)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """quantkit's own warnings as the tool's other warnings ("warning: ..."), not as a source line; the libraries'
    as Python shows them."""
    if str(Path(filename).resolve()).startswith(_PACKAGE_DIR):
        console.print(f"[bold yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
    else:
        _LIBRARY_SHOWWARNING(message, category, filename, lineno, file, line)


def _layer_error(rel_error: float, metrics: dict) -> str:
    """A layer's relative output error, with its attention sink's apart when recorded: "0.0311 (sink 20.80)"."""
    sink = metrics.get("sink_rel_error")
    return f"{rel_error:.4f}" + (f" (sink {sink:.2f})" if sink is not None else "")


def _duration(seconds: float) -> str:
    """A log line's time left: seconds, minutes or hours, so that "0 min" never stands for half a minute."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 90 * 60 else f"{seconds / 3600:.1f} h"


class _Eta(ProgressColumn):
    """The time left: the task's `eta` field, counted down from its `eta_at` (time.monotonic()), where the reporter
    keeps one (the layers' own mean, since a resumed run's replayed layers pass in a blink and would make rich's
    speed estimate a fraction of the truth), else rich's estimate from the task's speed."""

    def render(self, task: Task) -> Text:
        eta = task.fields.get("eta")
        left = task.time_remaining if eta is None else max(eta - (time.monotonic() - task.fields["eta_at"]), 0.0)
        if left is None:
            return Text("ETA -:--:--", style="progress.remaining")
        minutes, seconds = divmod(round(left), 60)
        hours, minutes = divmod(minutes, 60)
        return Text(f"ETA {hours}:{minutes:02d}:{seconds:02d}", style="progress.remaining")


class _Last(ProgressColumn):
    """The task's `last` field (the latest layer and its error), cut with an ellipsis to the width the fixed
    columns leave, where rich would otherwise squeeze every column and cut the counts and times instead."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(ratio=1))

    def render(self, task: Task) -> Text:
        return Text(task.fields.get("last", ""), no_wrap=True, overflow="ellipsis")


class _RichReporter:
    def __init__(self) -> None:
        fixed = Column(no_wrap=True)  # never squeezed: a cut count or time misleads ("0:03…" for 3 minutes)
        self.progress = Progress(
            TextColumn("[bold]{task.description}", table_column=fixed), BarColumn(bar_width=12, table_column=fixed),
            MofNCompleteColumn(table_column=fixed), _Last(), TimeElapsedColumn(table_column=fixed),
            _Eta(table_column=fixed),
            console=console, transient=False,
            disable=not console.is_terminal,  # a log gets the lines below instead, not a bar cut at 80 columns
        )
        self.task = None
        self.phases: dict[str, Any] = {}
        self.phase_started: dict[str, float] = {}

    def start(self, total: int, description: str) -> None:
        self.progress.start()
        self.task = self.progress.add_task(description, total=total, last="")
        self.total, self.done, self.fresh, self.spent, self.recorded = total, 0, 0, 0.0, 0.0

    def phase(self, description: str, done: int, total: int) -> None:
        if description not in self.phases:
            self.progress.start()
            self.phases[description] = self.progress.add_task(description, total=total, last="")
            self.phase_started[description] = time.monotonic()
        self.progress.update(self.phases[description], completed=done)
        if not console.is_terminal and done and done * 10 // total != (done - 1) * 10 // total:  # each tenth, in a log
            spent = time.monotonic() - self.phase_started[description]
            console.print(f"{description}: {done}/{total}, {spent:.0f} s, ETA "
                          f"{_duration(spent / max(done, 1) * (total - done))}", highlight=False)

    def layer_done(self, report) -> None:
        tag = " (resumed)" if report.replayed else ""
        error = _layer_error(report.rel_error, report.metrics)
        self.done += 1
        if not report.replayed:
            self.fresh += 1
            self.spent += report.seconds
        else:  # the journal's time for a layer quantized before the interruption: the estimate until a fresh one
            self.recorded += report.seconds
        # the mean of this run's layers (of the journal's, until this run has one) times the layers left
        eta = (self.spent / self.fresh if self.fresh else self.recorded / self.done) * (self.total - self.done)
        # the tag first: a narrow terminal cuts the text's end
        self.progress.update(self.task, advance=1, last=f"layer {report.index}{tag}: rel. err {error}", eta=eta,
                             eta_at=time.monotonic())
        if not console.is_terminal:  # a log file gets no live bar: one line per layer instead
            console.print(f"layer {report.index} ({self.done}/{self.total}): rel. err {error}, "
                          f"{report.seconds:.0f} s{tag}, ETA {_duration(eta)}", highlight=False)
        for note in report.notes:
            self.progress.console.print(f"  [yellow]layer {report.index}:[/] {note}")

    def warn(self, message: str) -> None:
        console.print(f"[bold yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self.task is not None or self.phases:
            self.progress.stop()


@main.command()
@_verbose_too
@click.argument("model")
@click.option("--recipe", "-r", required=True, metavar="NAME|PATH",
              help="A bundled recipe name (see `quantkit recipes`) or a recipe YAML file.")
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path),
              help="Output directory; written as OUT.partial and renamed to OUT when complete.")
@click.option("--calib", metavar="DATA",
              help="Calibration text: a .txt (a document a line) or .jsonl/.json file (JSON lines, or a .json "
                   "array, of objects with the recipe's calibration.text_field), either optionally .gz or .zst, a "
                   ".parquet file, or a named set (pileval, c4, wikitext2, tinystories). Default: the recipe's set, "
                   "else text generated by the model itself, with a warning.")
@click.option("--num-samples", type=click.IntRange(min=1),
              help="Number of calibration windows (wins over the recipe and over --set calibration.num_samples).")
@click.option("--seq-len", type=click.IntRange(min=2),
              help="Tokens per calibration window (wins over the recipe and --set; capped at the model's "
                   "max_position_embeddings, with a warning).")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override any recipe field, e.g. --set weights.group_size=64 --set passes.gptq.damp=0.05; the "
                   "value is read as YAML (--set 'passes.smooth.targets=[o, down]'), a pass is named or numbered "
                   "(passes.0.alpha). Repeatable; the resolved recipe is saved with the output.")
@click.option("--data-dir", type=click.Path(path_type=Path),
              help="Where named calibration sets are looked up locally (default: $QUANTKIT_DATA_DIR). A set missing "
                   "from a directory given here is an error, not a fallback to self-generated text.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where calibration forwards and GPTQ run; the activation cache stays in CPU memory. "
                   "A --resume must use the device of the interrupted run.")
@click.option("--dtype", type=click.Choice(["auto", "float16", "bfloat16"]), default="auto", show_default=True,
              help="The artifact's dtype for unquantized tensors and scales; the checkpoint is read as it, each "
                   "weight checked to fit its range. auto: the checkpoint's (float16 for a float32 one), except for "
                   "the qserve, qqq and anyprec formats, whose engines take float16 only: a bfloat16 checkpoint "
                   "(Llama 3, Mistral) is converted to float16, with a warning.")
@click.option("--resume", is_flag=True,
              help="Continue an unfinished run (OUT.partial: interrupted, or stopped by an error such as a full disk) "
                   "from its first unwritten layer; the model's files, the resolved recipe, the calibration tokens, "
                   "the device and the dtype must be that run's. Add --overwrite when that run replaces an existing "
                   "OUT.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing OUT (only once the new one is complete), or restart an unfinished run. "
                   "Only quantkit's own output is ever replaced.")
@click.option("--trust-remote-code", is_flag=True,
              help="Allow the model's own Python code from its repository (off by default; never needed for "
                   "Llama, Mistral or Qwen2).")
def quantize(model, recipe, output, calib, num_samples, seq_len, overrides, data_dir, device, dtype, resume,
             overwrite, trust_remote_code) -> None:
    """Quantize MODEL (local HF dir, hub id, or .gguf file) with a recipe into a packed safetensors artifact.

    Caches (a GGUF's dequantized copy, Any-Precision's Fisher information, file digests) live in $QUANTKIT_CACHE,
    by default ~/.cache/quantkit."""
    # SIGTERM stops as Ctrl-C does (the run says how to resume), from before the seconds that importing torch takes
    previous = signal.signal(signal.SIGTERM, _terminate)
    reporter = _RichReporter()
    try:
        from quantkit.pipeline import QuantizeJob, run_quantize
        from quantkit.recipe import load_recipe

        shorthands = [f"calibration.{key}={value}" for key, value in (("num_samples", num_samples),
                                                                      ("seq_len", seq_len)) if value is not None]
        resolved = load_recipe(recipe, [*overrides, *shorthands])
        _check_device(device)
        # the recipe with some of the --set values, to name those that made the model's shapes refuse it
        job = QuantizeJob(model=model, recipe=resolved, output=output, calib=calib, data_dir=data_dir,
                          device=device, resume=resume, overwrite=overwrite, trust_remote_code=trust_remote_code,
                          overrides=tuple(overrides), dtype=dtype,
                          started=click.get_current_context().meta.get("quantkit.started"),
                          recipe_with=lambda kept: load_recipe(recipe, [*kept, *shorthands]))
        summary = run_quantize(job, reporter)
    finally:
        signal.signal(signal.SIGTERM, previous)
        reporter.stop()
    errors = [r.rel_error for r in summary.layers]
    timings = summary.timings
    resumed = timings.get("resumed_layers")
    table = Table(title=f"quantized with {resolved.name}", show_header=False)
    table.add_row("output", str(summary.output))
    table.add_row("time", f"{summary.seconds:.1f} s" + (
        f" (this run; {resumed} of its {len(summary.layers)} layers were quantized by the unfinished run it "
        f"resumed, in {timings['resumed_layer_seconds']:.0f} s)" if resumed else ""))
    table.add_row("peak RSS", f"{summary.peak_rss_bytes / 2**30:.2f} GiB"
                  + (f" (while {summary.peak_rss_while})" if summary.peak_rss_while else ""))
    table.add_row("output size", f"{summary.output_bytes / 2**20:.1f} MiB (every file)")
    cal = summary.calibration
    table.add_row("calibration", _describe_calibration(cal) + f" (sha256 {cal['sha256'][:12]})")
    measured = min(resolved.engine.error_samples or cal["num_samples"], cal["num_samples"])
    table.add_row("layer rel. error", f"mean {sum(errors) / len(errors):.4f}, max {max(errors):.4f} "
                  f"(layer {errors.index(max(errors))}; block outputs on the first {measured} window(s), the "
                  "attention sink apart)")
    sinks = [r.metrics.get("sink_rel_error", 0.0) for r in summary.layers]
    table.add_row("attention sink", f"rel. error max {max(sinks):.4f} (layer {sinks.index(max(sinks))})")
    # where this run's time went, so that a slow recipe says which pass to tune: the layers' steps, the phases
    # around them, and what no step or phase timed (the layers' bookkeeping, writing the artifact)
    total = summary.seconds or 1.0
    timed = {**timings["step_seconds"], **timings["phase_seconds"]}
    spent = {k: v for k, v in sorted(timed.items(), key=lambda kv: -kv[1]) if v >= total / 200}  # >= 1% rounded
    spent["other"] = max(summary.seconds - sum(spent.values()), 0.0)  # the steps under 0.5% each go here too
    table.add_row("time by step", ", ".join(f"{k} {v:.0f} s ({v / total:.0%})" for k, v in spent.items()))
    console.print(table)
    for note in summary.format_notes:
        console.print(f"note: {escape(note)}", highlight=False)


def _check_device(device: str) -> None:
    """Refuse --device cuda where torch sees no GPU, before any work."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise QuantkitError("--device cuda: no CUDA device is visible to torch (install a CUDA build of "
                                "torch, or run with --device cpu)")


def _describe_calibration(cal: dict) -> str:
    text = f"{cal['num_samples']} x {cal['seq_len']} tokens from {cal['source']}"
    if "used_samples" in cal:  # no pass read the data: only the per-layer error's sequences ran
        text += f"; no pass reads them, the first {cal['used_samples']} measured the layer error"
    return text


@main.command(name="eval")
@_verbose_too
@click.argument("model")
@click.option("--tasks", default="wikitext", show_default=True,
              help="Comma-separated: wikitext (paper protocol perplexity), and lm-eval tasks piqa, arc_easy, "
                   "arc_challenge, hellaswag, winogrande, wikitext_lm.")
@click.option("--seq-len", type=click.IntRange(min=2), default=2048, show_default=True,
              help="Perplexity window length (capped at the model's max_position_embeddings, with a note).")
@click.option("--limit", type=click.IntRange(min=1), help="Evaluate only the first N windows / examples per task.")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Windows / requests per forward.")
@click.option("--data-dir", type=click.Path(path_type=Path),
              help="Local evaluation data (default: $QUANTKIT_DATA_DIR); every task's files are checked before the "
                   "model loads, and missing ones are named in the error.")
@click.option("--output-json", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the results here as JSON, instead of printing the JSON line on stdout (the table is "
                   "printed either way).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True, help="Compute dtype for the evaluation forward passes.")
@click.option("--bits", type=click.IntRange(2, 8),
              help="Any-Precision artifacts: evaluate at this width (any from the recipe's min_bits to its bits; "
                   "default: the widest).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the forward passes run (the model is read on the CPU, then moved). On a GPU, float16 "
                   "or bfloat16 halves the memory; scores differ from the CPU's in the last digits.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the model's own Python code (off by default).")
def eval_cmd(model, tasks, seq_len, limit, batch_size, data_dir, output_json, dtype, bits, device,
             trust_remote_code) -> None:
    """Evaluate MODEL (an FP checkpoint or a quantkit artifact, with its recorded A/KV simulation)."""
    import torch

    from quantkit.eval.loading import load_for_eval
    from quantkit.eval.perplexity import wikitext_perplexity
    from quantkit.files import atomic_write

    names, lm_tasks = _task_names(tasks)
    rows = _check_eval_data(names, lm_tasks, data_dir)  # every problem at once, before any model time
    if output_json is not None:
        _check_output_json(output_json, Path(model).expanduser())
    _check_device(device)
    if device == "cpu" and torch.cuda.is_available():
        console.print("note: evaluating on the CPU; --device cuda runs on the GPU", highlight=False)
    console.print(f"loading {model}", highlight=False)  # a large model takes a while before the first window
    loaded = load_for_eval(model, getattr(torch, dtype), trust_remote_code, bits=bits, device=device)
    where = f" on {torch.cuda.get_device_name()}" if device == "cuda" else ""
    console.print(f"evaluating {loaded.description} in {dtype}{where}", highlight=False)
    results: dict[str, dict] = {}
    if "wikitext" in names:
        max_pos = getattr(loaded.model.config, "max_position_embeddings", seq_len)
        window = min(seq_len, max_pos)
        if window < seq_len:
            console.print(f"note: windows of {window} tokens (the model's max_position_embeddings), not {seq_len}")
        reporter = _RichReporter()
        try:
            results["wikitext"] = wikitext_perplexity(
                loaded.model, loaded.tokenizer, rows, window, limit, batch_size,
                progress=lambda done, total: reporter.phase("wikitext windows", done, total),
            ).as_dict()
        finally:
            reporter.stop()
        if math.isnan(results["wikitext"]["perplexity"]):
            raise QuantkitError(f"{model}: the WikiText-2 perplexity is NaN: the model computes non-finite logits "
                                "(a NaN or Inf weight or scale; `quantkit validate` checks a packed artifact)")
    if lm_tasks:
        from quantkit.eval.lmeval import run_lm_eval

        results.update(run_lm_eval(loaded.model, loaded.tokenizer, lm_tasks, data_dir=data_dir, limit=limit,
                                   batch_size=batch_size))
    Console().print(_results_table(loaded.description, results))
    # what the numbers depend on, so that a results file says how it was made
    options = {"tasks": names, "seq_len": seq_len, "limit": limit, "batch_size": batch_size, "dtype": dtype,
               "bits": bits, "device": device}
    # JSON has no NaN or Infinity: a score that is not finite (an inf perplexity) is written as null
    results = {task: {key: None if isinstance(v, float) and not math.isfinite(v) else v for key, v in metrics.items()}
               for task, metrics in results.items()}
    payload = {"model": str(model), "description": loaded.description, "options": options, "results": results}
    if output_json:
        try:
            atomic_write(output_json, json.dumps(payload, indent=2))
        except OSError as exc:  # writable when checked, not now: the results still reach the user
            click.echo(json.dumps(payload))
            raise QuantkitError(f"--output-json: cannot write {output_json} ({exc.strerror or exc}); the results "
                                "are the JSON line above") from None
    else:
        click.echo(json.dumps(payload))


def _task_names(tasks: str) -> tuple[list[str], list[str]]:
    """--tasks as task names, and those of them that lm-eval runs (all but wikitext); unknown ones refused."""
    names = list(dict.fromkeys(t.strip() for t in tasks.split(",") if t.strip()))  # each once, in order
    if not names:
        raise QuantkitError("--tasks names no task")
    lm_tasks = [t for t in names if t != "wikitext"]
    if lm_tasks:
        from quantkit.eval.lmeval import LM_EVAL_TASKS

        unknown = [t for t in lm_tasks if t not in LM_EVAL_TASKS]
        if unknown:
            raise QuantkitError(f"unknown task(s) {', '.join(unknown)}; known: wikitext, {', '.join(LM_EVAL_TASKS)}")
    return names, lm_tasks


def _check_eval_data(names: list[str], lm_tasks: list[str], data_dir: Path | None) -> list[str]:
    """Every task's data, checked before the model loads, with every problem in one error; returns WikiText-2's
    test rows (none where wikitext is not a task)."""
    from quantkit.eval.perplexity import wikitext_rows

    problems, rows = [], []
    if "wikitext" in names:
        try:
            rows = wikitext_rows(data_dir)
        except QuantkitError as exc:
            problems.append(str(exc))
    if lm_tasks:
        from quantkit.eval.lmeval import check_task_data, require_lm_eval

        for check in (require_lm_eval, lambda: check_task_data(lm_tasks, data_dir)):
            try:
                check()
            except QuantkitError as exc:
                problems.append(str(exc))
    if problems:
        raise QuantkitError("\n".join(problems))
    return rows


def _check_output_json(path: Path, model: Path | None, option: str = "--output-json",
                       earlier: tuple[str, ...] = ("model", "results"), writer: str = "quantkit eval") -> None:
    """Refuse, before the model loads (or the GPU is timed), a results file `option` that names no file, lies in no
    writable directory, or would overwrite what it may not (`_check_results_path`)."""
    from quantkit.files import cannot_write

    if path.name in ("", ".", ".."):
        raise QuantkitError(f"{option} {str(path)!r}: name the file to write")
    parent = path.parent
    if not parent.is_dir():
        raise QuantkitError(f"{option}: {parent} {not_a_directory(parent)}")
    if why := cannot_write(path):
        raise QuantkitError(f"{option}: cannot write in {parent} ({why})")
    _check_results_path(path, model, option, earlier, writer)


def _results_table(title: str, results: dict[str, dict]) -> Table:
    """The scores as a table: each task's metrics, with lm-eval's document count and the perplexity's windows."""
    table = Table(title=title)
    table.add_column("task")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for task, metrics in results.items():
        for key, value in metrics.items():
            if key == "sample_len":  # lm-eval's count of the documents scored, not a score
                table.add_row(task, "documents", f"{value:.0f}")
            elif key == "windows":  # what the perplexity averages over
                table.add_row(task, "windows", f"{value} x {metrics['seq_len']} tokens")
            elif isinstance(value, float) and not key.endswith("seconds"):  # 4 decimals, or 6 digits where large
                table.add_row(task, key, f"{value:.4f}" if abs(value) < 1e6 else f"{value:.6g}")
    return table


def _check_results_path(path: Path, model: Path | None, option: str = "--output-json",
                        earlier: tuple[str, ...] = ("model", "results"), writer: str = "quantkit eval") -> None:
    """Refuse a results file that would overwrite the model or artifact in use (a file of its directory, or the GGUF
    file) or an existing file that is not an earlier results file of `writer` (a JSON object with `earlier`'s keys)."""
    if model is not None and model.exists():
        target, home = path.resolve(), model.resolve()
        if target == home or (home.is_dir() and home in target.parents):
            raise QuantkitError(f"{option} {path} is inside {model}, whose files it would overwrite; write the "
                                "results elsewhere")
    if path.exists():
        try:
            content = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            content = None
        if not (isinstance(content, dict) and set(earlier) <= set(content)):
            raise QuantkitError(f"{option}: {path} exists and is not a results file of {writer}; choose another path, "
                                "or delete it")


@main.command()
def recipes() -> None:
    """List the bundled recipes, one line each."""
    from quantkit.recipe import bundled_recipes, load_recipe

    for name in bundled_recipes():
        click.echo(f"{name:24s} {load_recipe(name).description}")


@main.command()
@_verbose_too
@click.argument("output", type=click.Path(path_type=Path))
@click.option("--verify", is_flag=True,
              help="Also hash every file and compare it with the sha256 the manifest recorded (reads every byte), "
              "and the manifest with its own digest; exit 1 naming the files that differ.")
def inspect(output: Path, verify: bool) -> None:
    """Summarize an artifact: format, bits, groups, layers, bytes, recipe, calibration hash, per-layer error."""
    from quantkit.artifact import artifact_config, load_manifest, manifest_digest, read_safetensors, verify_files

    m = load_manifest(output)
    if not verify and "manifest_sha256" in m and manifest_digest(m) != m["manifest_sha256"]:  # costs no file read
        console.print("[bold yellow]warning:[/] the manifest's content differs from its recorded digest: it was "
                      "edited after quantize wrote it, and what it says below may not be what was written "
                      "(--verify checks every file)", highlight=False, soft_wrap=True)
    # what costs no tensor read: the config against the manifest, and every shard's header
    artifact_config(output, m)
    for name in m["files"]:
        if name.endswith(".safetensors"):
            read_safetensors(output / name, header_only=True)
    if verify:
        if changed := verify_files(output, m):
            console.print(f"[bold red]{output}: {len(changed)} file(s) differ from what was written:[/] "
                          f"{escape(', '.join(changed))}", highlight=False, soft_wrap=True)
            sys.exit(1)
        click.echo(f"verified: {len(m['files'])} files match their recorded sha256")
    table = Table(title=str(output), show_header=False)
    table.add_row("model", f"{m['model']} ({m['architecture']}, {m['num_layers']} layers)")
    table.add_row("recipe", m["recipe"])
    table.add_row("format", m["format"])
    for role, w in m["weights"].items():
        table.add_row(f"weights {role}", _describe_weights(w, m["format"]))
    table.add_row("activations", f"{m['activations']['bits']}-bit per token" if m["activations"] else "fp")
    table.add_row("kv cache", f"{m['kv_cache']['bits']}-bit per head" if m["kv_cache"] else "fp")
    cal = m["calibration"]
    table.add_row("calibration", _describe_calibration(cal))
    table.add_row("bytes", f"{sum(f['bytes'] for f in m['files'].values()):,} (the {len(m['files'])} files the "
                  "manifest lists; the manifest itself apart)")
    timings = m["timings"]
    resumed = timings.get("resumed_layers")
    table.add_row("quantization time", f"{timings['total_seconds']:.1f} s" + (
        f" (the last run; the unfinished run it resumed quantized {resumed} layer(s) in "
        f"{timings['resumed_layer_seconds']:.1f} s more)" if resumed else ""))
    Console().print(table)
    click.echo(f"calibration sha256: {cal['sha256']}")
    layers = Table(title="per-layer relative output error (tokens after each sequence's first; the first, the "
                   "attention sink, apart)")
    layers.add_column("layer", justify="right")
    layers.add_column("rel. error", justify="right")
    layers.add_column("sink rel. error", justify="right")
    layers.add_column("seconds", justify="right")
    for r in m["layers"]:
        sink = r["metrics"].get("sink_rel_error")
        layers.add_row(str(r["index"]), f"{r['rel_error']:.5f}", "-" if sink is None else f"{sink:.5f}",
                       f"{r['seconds']:.1f}" + (" (an earlier run)" if r.get("resumed") else ""))
    Console().print(layers)
    for note in m["notes"]:
        Console().print(f"note: {note}", highlight=False)


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A number option that must be finite (click's FloatRange lets NaN and infinity through)."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


@main.command()
@_verbose_too
@click.argument("output", type=click.Path(path_type=Path))
@click.option("--tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Activation rows per check (the GEMM's M); above 8 the kernels (but Atom's) also run on the first "
              "row alone, which takes the decode kernels.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the random activations.")
@click.option("--tolerance", type=click.FloatRange(min=0), default=4e-3, show_default=True, callback=_finite,
              help="Largest accepted |y - y_ref| / max|y_ref| of the fp16 outputs, each token's against its own "
              "(a finite number).")
@click.option("--kernel", type=click.Choice(["auto", "cuda", "sim", "none"]), default="auto", show_default=True,
              help="Also run each linear's CUDA kernels (kernels/) and require their fp16 output to equal the "
              "emulation's bit for bit (Any-Precision's tensor-core kernel: within its stated bound): on the GPU "
              "(cuda), in quantkit's warp simulator on the CPU (sim, needs g++), or not (none); auto takes the GPU "
              "if there is one, else the simulator if it can be built.")
def validate(output: Path, tokens: int, seed: int, tolerance: float, kernel: str) -> None:
    """Check every packed linear of OUTPUT through its kernel's bit-exact CPU emulation: its exact part must match
    (W4A8: the int32 accumulators equal the reference integer product; Atom: every group's int32 sums; Any-Precision:
    the codes decoded from the bitplanes, at every width) and the fp16 outputs the dequantized reference; and
    run the CUDA kernels themselves (on the GPU, or their lane code in the warp simulator), whose output must
    equal the emulation's bit for bit (Any-Precision's tensor-core kernel: within `anyprec_tc_bound`).
    Activations: Gaussian, and Gaussian with a few outlier channels 30x larger. Only the shards' sizes are checked
    against the manifest (`quantkit inspect --verify` hashes them). Exits 1 on any mismatch, naming the linears, and
    2 on an error (no artifact, a damaged one, a kernel that cannot run here)."""
    import numpy as np

    from quantkit import kernels
    from quantkit.artifact import load_manifest
    from quantkit.emulate import EMULATED
    from quantkit.eval.loading import artifact_recipe, packed_linears
    from quantkit.validation import check_linear, exact_part

    manifest = load_manifest(output)
    fmt = manifest["format"]
    if fmt not in EMULATED:
        raise QuantkitError(f"validate: no kernel emulation for format {fmt!r}: validate checks the layouts "
                            f"quantkit's kernels read ({', '.join(sorted(EMULATED))}); a 'quantkit' artifact is "
                            "simulation only, and a 'compressed-tensors' one runs in its engine's kernels")
    recipe = artifact_recipe(output)
    rng = np.random.default_rng(seed)
    device = kernels.resolve_device(kernel)
    where = {"cuda": "GPU", "cpu": "warp simulator", None: "not run"}[device]
    # Short headers, explained in the caption, so that the table fits an 80-column log with whole linear names
    # (long headers squeezed the names to "self_attn.…").
    # The exact column names what is exact: Any-Precision's lookup GEMV has no integer sums, its codes are.
    exact_column, exact_means = exact_part(fmt)
    caption = (f"{exact_column}: {exact_means}; plain, outliers: max |y - y_ref| / max |y_ref| of its fp16 "
               "outputs, each token's against its own and the largest over tokens, on Gaussian activations, and "
               "on the same with a few channels 30x larger")
    if device:
        caption += "; kernel: its output equals the emulation's (Any-Precision's tensor cores: within their bound)"
    table = Table(title=f"{output} ({fmt}): kernel emulation against the reference dequantization; kernel "
                  f"({where}) against the emulation", caption=caption)
    table.add_column("layer", justify="right")
    table.add_column("linear", min_width=len("self_attn.q_proj"), overflow="fold")
    for column in [exact_column, "plain", "outliers"] + (["kernel"] if device else []):
        table.add_column(column, justify="right")
    failures, ran, checked = [], {}, 0
    reporter = _RichReporter()  # a layer's linears take seconds each in the simulator: progress, with an ETA
    layers, previous = manifest["num_layers"], -1
    try:
        reporter.phase("validating layers", 0, layers)  # the clock starts with the first layer, not after it
        for linear in packed_linears(output, kernel_judges=True):  # a lane overflow: the verdict's NO
            if checked and linear.layer != previous:
                reporter.phase("validating layers", previous + 1, layers)
            checked, previous = checked + 1, linear.layer
            result = check_linear(fmt, linear, recipe, rng, tokens, device)
            for label in result.paths:
                ran[label] = ran.get(label, 0) + 1
            if why := result.problems(fmt, tolerance):
                failures.append(f"layer {result.layer} {result.name} ({', '.join(why)})")
            style = "[bold red]" if why else ""
            table.add_row(str(result.layer), result.name, style + ("yes" if result.exact else "NO"),
                          *(f"{style}{e:.2e}" for e in result.errors),
                          *([style + ("yes" if result.kernel_same else "NO")] if device else []))
        if checked:
            reporter.phase("validating layers", previous + 1, layers)
    finally:
        reporter.stop()
    out = Console()  # the verdict goes where the table goes, so that a log of either holds both
    out.print(table)
    if not checked:
        raise QuantkitError(f"{output}: no packed linear to check (its config.json and manifest name none)")
    if ran:
        out.print("kernels run against the emulation: " + ", ".join(f"{label} on {count} linear(s)"
                                                                  for label, count in ran.items()))
    elif device is None:
        out.print("note: no kernel ran (" + ("--kernel none" if kernel == "none" else
                                             "no CUDA device, and no C++ compiler for the warp simulator") +
                  "): the emulation alone was checked", highlight=False)
    if failures:
        out.print(f"[bold red]{len(failures)} linear(s) do not match their reference:[/] " + "; ".join(failures),
                  highlight=False)
        sys.exit(1)
    out.print("every packed linear matches its reference")


def _token_counts(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """--m as positive token counts, refused with the reason before anything runs."""
    parts = [p.strip() for p in value.split(",")]
    if not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
        raise click.BadParameter(f"{value!r}: give positive token counts, comma-separated (e.g. 1,16,1024)")
    return tuple(int(p) for p in parts)


def _bench_formats(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    """--formats as layout names, each one a layout bench has kernels for."""
    if value is None:
        return None
    from quantkit.kernel_bench import LAYOUTS

    names = tuple(p.strip() for p in value.split(",") if p.strip())
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        raise click.BadParameter(f"{', '.join(unknown) if unknown else repr(value)}: not a layout bench times "
                                 f"({', '.join(LAYOUTS)})")
    return names


def _bench_shapes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[tuple[int, int], ...]:
    """--shapes as (N, K) pairs, refused with the reason before anything runs."""
    from quantkit.kernel_bench import parse_shapes

    try:
        return parse_shapes(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@main.command(name="bench")
@_verbose_too
@click.argument("output", type=click.Path(path_type=Path), required=False)
@click.option("--shapes", "shapes", default="llama3-8b", show_default=True, callback=_bench_shapes,
              help="Without OUTPUT, the (N, K) shapes to time, on synthetic tensors of every layout: a model's fused "
              "qkv, o, fused gate_up and down projections (llama3-8b, whose shapes issue #6's bars are set on and "
              "Mistral-7B shares; llama2-7b, llama3-70b, qwen2-7b), or shapes of one's own as NxK,NxK,... (N output "
              "channels, K input, multiples of 128).")
@click.option("--layer", type=click.IntRange(min=0), default=None,
              help="With OUTPUT, the layer whose linears to time [default: 0].")
@click.option("--m", "ms", default="1,4,16,1024", show_default=True, callback=_token_counts,
              help="Comma-separated token counts (the GEMM's M), positive; the Any-Precision GEMV runs only for "
              "M <= 16.")
@click.option("--formats", default=None, callback=_bench_formats,
              help="Without OUTPUT, comma-separated layouts to time (qserve, liquidquant, qqq, atom, anyprec); "
              "default: all.")
@click.option("--paths", type=click.Choice(["auto", "all"]), default="auto", show_default=True,
              help="Without OUTPUT, auto: each layout's kernel as its launch picks it by M and shape; all: every "
              "kernel of a layout at every M (W4A8: small-M, tiled and, on a Hopper GPU, wgmma; Any-Precision: CUDA "
              "cores and tensor cores), to set the thresholds between them.")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True,
              help="Untimed calls before timing each case.")
@click.option("--iters", type=click.IntRange(min=1), default=50, show_default=True,
              help="Timed calls per case; the median is shown.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Times the whole run is repeated (kernels and baselines alike); each row shows the median of its "
              "rounds, so that a slow spell of the device during one round moves no bar. 1 for a quick look.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write every row and bar, with the device and its copy bandwidth, to this JSON file.")
@click.pass_context
def bench_cmd(ctx: click.Context, output: Path | None, shapes: tuple[tuple[int, int], ...], layer: int | None,
              ms: tuple[int, ...], formats: tuple[str, ...] | None, paths: str, warmup: int, iters: int, rounds: int,
              json_path: Path | None) -> None:
    """Time the packed-layout kernels on a GPU against cuBLAS FP16 (torch.matmul) and cuBLAS INT8
    (torch._int_mm and cublasGemmEx; the faster sets the bar) on the same shapes, in one run: CUDA events, warm-up,
    medians (a call under 100 us is timed per call in replayed CUDA graphs, as engines run decode GEMMs, and its
    single-launch time is shown beside); operands rotate past the L2 cache. Prints time, TOPS, achieved GB/s
    against the device's measured copy bandwidth, the speedups and, for decode (M <= 16), the time over a plain
    read of the shape's 4-bit bytes; then issue #6's bars on every row they apply to. OUTPUT: the linears of one
    layer of that artifact, with its own stored tensors; otherwise every layout on synthetic tensors of the
    --shapes set. Needs a CUDA device and CuPy (pip install 'quantkit[cuda]');
    the baselines need a CUDA build of torch."""
    from click.core import ParameterSource

    from quantkit import kernel_bench, kernels
    from quantkit.artifact import load_manifest

    given = {name for name in ("shapes", "formats", "paths")
             if ctx.get_parameter_source(name) != ParameterSource.DEFAULT}
    if output is not None and given:
        raise click.UsageError(f"{', '.join('--' + name for name in sorted(given))}: with OUTPUT, bench times that "
                               "artifact's own linears (its layout, its shapes); leave them out, or OUTPUT")
    if output is None and layer is not None:
        raise click.UsageError("--layer picks a layer of OUTPUT; give the artifact too")
    if output is not None:
        kernel_bench.benchable_format(output)  # what OUTPUT is, before the GPU is asked for
        if layer is not None and not 0 <= layer < (count := load_manifest(output)["num_layers"]):
            raise click.UsageError(f"--layer {layer}: {output} has layers 0..{count - 1}")
    if json_path is not None:  # before minutes of timing: not the artifact's own files, nor another tool's
        _check_output_json(json_path, output, "--json", ("device", "rows", "bars"), "quantkit bench")
    if not kernels.cuda_available():
        raise QuantkitError("quantkit bench needs a CUDA device and CuPy (pip install 'quantkit[cuda]'); on a CPU, "
                            "`quantkit validate` checks the kernels in the warp simulator instead")
    if output is not None:
        cases = kernel_bench.artifact_cases(output, layer or 0)
    else:
        variants = tuple(v for v in kernel_bench.VARIANTS if formats is None or v.fmt in formats)
        if paths == "all":
            variants = kernel_bench.with_paths(variants, hopper=kernels.hopper_available())
        cases = kernel_bench.shape_cases(shapes, variants)
    import cupy

    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    bandwidth = kernel_bench.copy_bandwidth()
    reporter, label = _RichReporter(), f"timing ({rounds} round{'s' if rounds > 1 else ''})"
    try:
        rows = kernel_bench.run_bench(cases, ms, warmup, iters, rounds,
                                      lambda done, total: reporter.phase(label, done, total))
    finally:
        reporter.stop()
    checks = kernel_bench.bars(rows, bandwidth)
    Console().print(kernel_bench.render(rows, bandwidth, device))
    Console().print(kernel_bench.render_bars(checks, device))
    if json_path is not None:
        from quantkit.files import atomic_write

        atomic_write(json_path, json.dumps(kernel_bench.report(rows, checks, bandwidth, device), indent=1))


def _describe_weights(w: dict, fmt: str) -> str:
    """One line for a manifest's weight spec in format `fmt`, e.g. "4-bit sym, group 128, INT8 re-expression
    (QQQ)"."""
    if w.get("codebook"):  # codes index per-row tables of centroids: no symmetry or groups to speak of
        low = w.get("min_bits") or w["bits"]
        widths = f"{low}..{w['bits']}-bit" if low != w["bits"] else f"{w['bits']}-bit"
        stored = "Any-Precision bitplanes" if fmt == "anyprec" else "one int8 code a weight"
        return f"{widths} lookup tables per row (non-uniform, {stored})"
    parts = [f"{w['bits']}-bit {'sym' if w['symmetric'] else 'asym'}",
             f"group {w['group_size']}" if w["granularity"] == "group" else f"per {w['granularity']}"]
    if w.get("outliers"):
        parts.append(f"{w['outliers']} INT8 outlier columns (Atom)")
    if (w.get("row_block") or 1) > 1:
        parts.append(f"a scale per {w['row_block']} rows")
    if w.get("progressive"):
        parts.append("LiquidQuant two-level" if w.get("level2") == "lqq" else "QoQ progressive (INT8 level 1)")
    if w.get("zero_form") == "scaled":
        parts.append("scaled zero")
    if w.get("narrow_range"):
        parts.append(f"narrow range [-{2 ** (w['bits'] - 1) - 1}, {2 ** (w['bits'] - 1) - 1}]")
    if w.get("requant_int8"):
        parts.append("INT8 re-expression (QQQ)")
    return ", ".join(parts)


if __name__ == "__main__":
    main()
