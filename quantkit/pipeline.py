"""The layer-streaming quantization run: calibrate, quantize and pack one decoder block at a time.

Only one block's weights (plus its Hessians and the activation cache) are ever in memory. Block i is
calibrated on the outputs of the already-quantized blocks 0..i-1 (GPTQ's sequential mode), written as its
own safetensors shard, and recorded in a journal; `resume` replays the written shards to rebuild the
activation cache and continues bit-identically (with as many CPU threads) from the first missing block.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit import __version__, memory, simulate
from quantkit.artifact import (
    JOURNAL,
    LOCK,
    MANIFEST,
    RECIPE,
    OutputDir,
    RunIdentity,
    atomic_save_safetensors,
    manifest_digest,
    new_journal,
    read_safetensors,
    sha256_file,
    shard_name,
)
from quantkit.calib import (
    CalibrationError,
    CalibrationSet,
    generate_calibration,
    load_calibration,
    named_sets,
    names_a_set,
    resolve_named_set,
)
from quantkit.errors import QuantkitError, dtype_name
from quantkit.eval.perplexity import WIKITEXT_FILE
from quantkit.files import atomic_write
from quantkit.fisher import cached_diagonal_fisher
from quantkit.formats import Packer, get_packer
from quantkit.formats.base import ExportError
from quantkit.models.adapters import ROLES
from quantkit.models.block import BlockRunner, build_block, run_by_role
from quantkit.models.source import (
    FiniteScan,
    ModelEdges,
    ModelSource,
    check_safetensors,
    load_tokenizer,
    open_model,
)
from quantkit.passes import LayerWork, get_pass
from quantkit.passes.base import Pass
from quantkit.quantizers import QuantSpec
from quantkit.recipe import Recipe, blame_overrides, to_yaml

log = logging.getLogger("quantkit")

CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ShapeError(QuantkitError):
    """A layer's shape does not fit the recipe (e.g. a group size that does not divide its input width)."""


@dataclass
class LayerReport:
    index: int
    rel_error: float
    seconds: float
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    replayed: bool = False
    step_seconds: dict[str, float] = field(default_factory=dict)  # wall time of each pass, and of packing+check
    replay_seconds: float = 0.0  # a replayed layer: this run's time rebuilding it from its shard (`seconds`: the
    # unfinished run's time quantizing it)


@dataclass
class RunSummary:
    output: Path
    seconds: float  # this run's wall time, from job.started (the command's start) where given
    peak_rss_bytes: int
    output_bytes: int  # every file of the output directory, the manifest included
    calibration: dict[str, Any]
    layers: list[LayerReport]  # a resumed run's layers of the unfinished run too (`replayed`, with their seconds)
    notes: list[str]
    format_notes: list[str]  # the export format's caveats: who loads the artifact, what they cannot run
    # the manifest's: this run's layers, steps and phases apart from the unfinished run's it resumed (_timings)
    timings: dict[str, Any] = field(default_factory=dict)
    peak_rss_while: str | None = None  # what the process was doing when its RSS peaked, where one phase explains it


class Reporter:
    """Progress sink; the CLI renders it with rich, tests use this silent default."""

    def start(self, total: int, description: str) -> None: ...
    def layer_done(self, report: LayerReport) -> None: ...
    def phase(self, description: str, done: int, total: int) -> None:
        """Progress of a preparatory phase (e.g. the Fisher pass) before the layer loop."""

    def warn(self, message: str) -> None:
        log.warning(message)


@dataclass
class QuantizeJob:
    model: str
    recipe: Recipe
    output: Path
    calib: str | None = None
    data_dir: Path | None = None
    device: str = "cpu"
    resume: bool = False
    overwrite: bool = False
    trust_remote_code: bool = False
    # the --set values, and the recipe with only some of them, so that an error the model's shapes raise names the
    # overrides that caused it (the recipe file alone fits the model)
    overrides: tuple[str, ...] = ()
    recipe_with: Callable[[tuple[str, ...]], Recipe] | None = None
    # the artifact's dtype for unquantized tensors and scales: "auto" (the checkpoint's; float16 where the format's
    # engines take nothing else), "float16" or "bfloat16"
    dtype: str = "auto"
    # when the run began (time.time()): the CLI passes its command's start, so that the run's time includes the
    # imports of torch and transformers; now where None
    started: float | None = None


def plan_specs(source: ModelSource, recipe: Recipe, packer: Packer) -> dict[str, QuantSpec]:
    """The quantization spec of each target role, checked against every layer's real shapes up front."""
    adapter = source.adapter
    specs: dict[str, QuantSpec] = {}
    grouped = recipe.weights.spec().outliers
    widths = sorted({source.shape(f"{adapter.layer_prefix(0)}{name}.weight")[1] - grouped
                     for _, name in adapter.linear_names(recipe.targets)})  # what one group size must divide
    for role, name in adapter.linear_names(recipe.targets):
        module = f"{adapter.layer_prefix(0)}{name}"
        n, k = source.shape(module + ".weight")
        spec = recipe.weights.spec()
        normal = k - spec.outliers  # Atom: the columns left for the groups once the outliers are set apart
        if spec.outliers >= k:
            raise ShapeError(f"{module}: weights.outliers={spec.outliers} leaves no columns of its {k} to group")
        if spec.granularity == "group" and normal % spec.group_size:
            what = (f"the {normal} input columns left after its {spec.outliers} outliers (input width {k}, output "
                    f"width {n})" if spec.outliers else f"its input width {k} (output width {n})")
            if recipe.weights.indivisible != "per_channel":
                raise ShapeError(
                    f"{module}: group size {spec.group_size} does not divide {what}; choose a group size "
                    f"dividing every grouped input width ({', '.join(map(str, widths))}), or set "
                    "weights.indivisible=per_channel to quantize such layers per channel"
                )
            spec = recipe.weights.spec("channel")
        act = recipe.activations
        if act is not None and act.group_size is not None and (k - act.outliers) % act.group_size:
            raise ShapeError(f"{module}: activation groups of {act.group_size} do not divide its "
                             f"{k - act.outliers} input columns (input width {k}, {act.outliers} outliers); "
                             "set activations.group_size to a divisor")
        if n % spec.row_block:
            raise ShapeError(f"{module}: weights.row_block={spec.row_block} does not divide its output width {n}")
        if role in specs and specs[role] != spec:
            raise ShapeError(f"linears of role {role} need different specs; this architecture is not supported")
        specs[role] = spec
        for i in range(source.num_layers):
            layer_name = f"{adapter.layer_prefix(i)}{name}"
            packer.check(layer_name, spec, source.shape(layer_name + ".weight"))
    return specs


def spec_notes(recipe: Recipe, specs: dict[str, QuantSpec], packer: Packer, source: ModelSource) -> list[str]:
    """What the artifact's specs say beyond the recipe: a dtype other than the checkpoint's, the roles that
    `weights.indivisible: per_channel` took per channel, the width the errors of an Any-Precision model measure, and
    the export format's own caveats (who loads it, what they cannot run)."""
    read, stored = dtype_name(source.dtype), dtype_name(source.checkpoint_dtype)
    converted = ([f"dtype {read}: the weights were read from the {stored} checkpoint as {read}"]
                 if source.converts else [])
    fell_back = [role for role, spec in specs.items()
                 if recipe.weights.granularity == "group" and spec.granularity != "group"]
    per_channel = [f"weights.indivisible=per_channel: {', '.join(fell_back)} quantized per channel, not in groups of "
                   f"{recipe.weights.group_size}, which does not divide their input widths"] if fell_back else []
    widths = sorted({(s.min_bits, s.bits) for s in specs.values() if s.min_bits and s.min_bits < s.bits})
    return converted + per_channel + [f"widths {low}..{high}: the per-layer errors are at the widest, {high} bits "
                                      "(`quantkit eval --bits B` measures another)" for low, high in widths
                                      ] + packer.notes(specs)


def _choose_dtype(job: QuantizeJob, source: ModelSource) -> str:
    """Set the dtype `source` reads floating tensors as, from `job.dtype`: "auto" keeps the source's own (a float16 or
    bfloat16 checkpoint's; float16 for a float32 or float64 one) unless the export format's engines take float16 only.
    Returns the warning that says what is converted and why, or ""."""
    stored = source.checkpoint_dtype
    only_fp16 = get_packer(job.recipe.export.format).float16_only
    if job.dtype != "auto":
        target, why = getattr(torch, job.dtype), f"--dtype {job.dtype}"
    elif only_fp16:
        target, why = torch.float16, f"{job.recipe.export.format} checkpoints are float16: {only_fp16}"
    else:  # ModelSource.dtype's rule: only a float32 or float64 checkpoint converts
        target, why = source.dtype, "quantkit writes float32 and float64 checkpoints as float16"
    source.convert_to(target)
    if not source.converts:
        return ""
    return (f"converting the {dtype_name(stored)} checkpoint to {dtype_name(target)} ({why}); every weight is "
            "checked to fit its range")


def _plan(source: ModelSource, recipe: Recipe, job: QuantizeJob) -> tuple[Packer, dict[str, QuantSpec]]:
    """The export packer and every role's spec, checked against the model's shapes before any work. An error that
    the recipe file alone would not raise names the --set overrides that caused it (`blame_overrides`)."""

    def plan(r: Recipe) -> tuple[Packer, dict[str, QuantSpec]]:
        packer = get_packer(r.export.format)(r, source.dtype)
        packer.check_recipe()
        return packer, plan_specs(source, r, packer)

    try:
        return plan(recipe)
    except (ShapeError, ExportError) as exc:
        variant = job.recipe_with
        if variant is None or not (culprits := blame_overrides(job.overrides, lambda kept: plan(variant(kept)))):
            raise
        raise type(exc)(f"{exc} {culprits}") from None


def _deployed_block(
    source: ModelSource, index: int, shard: dict[str, torch.Tensor], packer: Packer, specs: dict[str, QuantSpec],
    targets: list[str],
) -> tuple[nn.Module, dict[str, simulate.LinearRuntime]]:
    """Block whose weights are exactly what an engine reconstructs from the shard (dequantized in model dtype),
    and what its linears' kernels do beyond their weights (simulate.LinearRuntime), for those that do more."""
    adapter = source.adapter
    prefix = adapter.layer_prefix(index)
    tensors = {k[len(prefix):]: v for k, v in shard.items()}
    state: dict[str, torch.Tensor] = {}
    runtime: dict[str, simulate.LinearRuntime] = {}
    quantized = {name: role for role, name in adapter.linear_names(targets)}
    for name, role in quantized.items():
        weight, info = simulate.deployed(packer.unpack(packer.pop_parts(tensors, name), specs[role]), source.dtype)
        state[f"{name}.weight"] = weight
        if info is not None:
            runtime[name] = info
    state.update(tensors)
    return build_block(source, index, state), runtime


def _quantize_by_role(
    work: LayerWork, quantizer: Pass, packer: Packer, dtype: torch.dtype, out: torch.Tensor,
    act_sim: simulate.ActivationSim | None, kv_sim: simulate.KVSim | None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Quantize the block role by role in one forward (GPTQ's true-sequential mode): each role's Hessian comes
    from the block with the earlier roles already deployed (dequantized weights, activation and KV simulation),
    and the deployed block's outputs land in `out`. Returns each linear's packed tensors."""
    block, names_by_role = work.block, {}
    for name, role in work.linears.items():
        names_by_role.setdefault(role, []).append(name)
    simulate.attach([block], [], work.config, None, kv_sim, adapter=work.adapter)
    acc = work.hessian_accumulator()
    runtime: dict[str, simulate.LinearRuntime] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}

    def role_input(role: str, x: torch.Tensor) -> None:
        if role in names_by_role:
            acc.add(role, x)

    def role_done(role: str) -> None:
        # every input of `role` is computed, so the role before it has run for the last time: drop its weights
        # (already packed), which keeps the block's float32 weights out of the down_proj factorization's peak
        previous = ROLES[ROLES.index(role) - 1] if role != ROLES[0] else None
        for name in names_by_role.get(previous, []):
            weight = work.module(name).weight
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        if role not in names_by_role:
            return
        work.hessians.update(acc.finish())
        quantizer.quantize(work, names_by_role[role])
        for name in names_by_role[role]:
            q = work.results.pop(name).finished()  # the packed tensors are what is kept
            packed[name] = packer.pack(q.to("cpu"))
            weight, info = simulate.deployed(packer.unpack(dict(packed[name]), q.spec), dtype)
            work.module(name).weight.data.copy_(weight)
            if info is not None:
                runtime[name] = info
        simulate.attach([block], names_by_role[role], work.config, act_sim, None, runtime=[runtime])
        work.hessians.pop(role, None)  # quantizers may consume it themselves

    run_by_role(work.runner, block, work.adapter, work.inputs, out, role_input, role_done)
    return packed


def resolve_calibration(
    job: QuantizeJob, source: ModelSource, tokenizer: Any, reporter: Reporter
) -> CalibrationSet:
    """Token windows from --calib, else the recipe's named set, else (offline, no data) self-generated text.

    Only an unreachable named set falls back to generation, and only when the user named no data dir: a set
    missing from an explicit --data-dir (a typo, an unmounted disk) is an error, as is a reachable but unusable
    set (too short, empty) and any problem with an explicit --calib.
    """
    cal = job.recipe.calibration
    kwargs = dict(num_samples=cal.num_samples, seq_len=cal.seq_len, seed=cal.seed)
    if job.calib is None and cal.dataset in named_sets():
        try:
            resolve_named_set(cal.dataset, job.data_dir)
        except CalibrationError as exc:
            if job.data_dir is not None:
                msg = f"{exc}\nNo fallback to self-generated text, since --data-dir was given."
                raise CalibrationError(msg) from exc
            reporter.warn(
                f"{exc}\nFalling back to calibration text generated by the model itself (data-free, as in "
                "LLM-QAT); pass --calib FILE for results comparable to the papers."
            )
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
            return generate_calibration(model, tokenizer, **kwargs)
    return load_calibration(
        job.calib, tokenizer, sampling=cal.sampling, text_field=cal.text_field,
        data_dir=job.data_dir, default_set=cal.dataset, **kwargs,
    )


def fit_context(recipe: Recipe, source: ModelSource, reporter: Reporter) -> Recipe:
    """Cap calibration windows at the model's context length, saying so (the saved recipe records the cap)."""
    max_pos = getattr(source.config, "max_position_embeddings", None)
    if max_pos is None or recipe.calibration.seq_len <= max_pos:
        return recipe
    reporter.warn(
        f"calibration.seq_len {recipe.calibration.seq_len} exceeds the model's context "
        f"(max_position_embeddings {max_pos}); using windows of {max_pos} tokens"
    )
    return replace(recipe, calibration=replace(recipe.calibration, seq_len=max_pos))


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _check_cache_fits(recipe: Recipe, source: ModelSource) -> None:
    """Refuse, before any work, calibration whose token windows and activation cache alone would not fit in the
    memory available (a run would be killed, or fail deep in sampling, with no word of why)."""
    calibration = recipe.calibration
    cached = calibration.num_samples  # windows in the cache: all, or only the error's where no pass reads them
    if recipe.engine.error_samples is not None and not any(
            get_pass(p.name).reads_activations for p in recipe.passes if p.enabled):
        cached = min(cached, recipe.engine.error_samples)
    width = source.config.hidden_size * CACHE_DTYPES[recipe.engine.cache_dtype].itemsize
    need = calibration.seq_len * (8 * calibration.num_samples + width * cached)
    available = memory.available_bytes()
    if available is not None and need > available:
        raise QuantkitError(
            f"calibration on {calibration.num_samples} windows of {calibration.seq_len} tokens keeps "
            f"{need / 2**30:.1f} GiB of activations (hidden size {source.config.hidden_size}, "
            f"{recipe.engine.cache_dtype}), more than the {available / 2**30:.1f} GiB of memory available; lower "
            "--num-samples or --seq-len, or set engine.cache_dtype=bfloat16")


def run_quantize(job: QuantizeJob, reporter: Reporter | None = None) -> RunSummary:
    """Quantize `job.model` with `job.recipe` into `job.output`; see the module docstring."""
    reporter = reporter or Reporter()
    entered = time.time()
    t0 = entered if job.started is None else min(job.started, entered)
    phases = {"start-up": entered - t0} if entered > t0 else {}
    memory.return_freed_memory()
    out = OutputDir(Path(job.output))
    model_path = Path(job.model).expanduser()
    protect = (model_path,) if model_path.exists() else ()  # a local model: never the output to replace
    out.check(resume=job.resume, overwrite=job.overwrite, protect=protect)
    with _timed(phases, "model"):
        source, opening = _open_source(job)
    conversion = _choose_dtype(job, source)  # said once the format has taken the dtype (in _plan)
    job = _resolved_job(job, source, reporter)
    recipe = job.recipe
    packer, specs = _plan(source, recipe, job)
    _check_cache_fits(recipe, source)
    if conversion:
        reporter.warn(conversion)
    with _timed(phases, "calibration data"):
        tokenizer = load_tokenizer(source.path, job.trust_remote_code, source.origin)
        calib = _calibration(job, source, tokenizer, reporter)
    journal = out.prepare(resume=job.resume, overwrite=job.overwrite, protect=protect)
    recipe_yaml = to_yaml(recipe)
    with _stops_reported(out, reporter):
        calib_info = {
            "source": calib.source, "sampling": calib.sampling, "seed": calib.seed,
            "num_samples": int(calib.tokens.shape[0]), "seq_len": int(calib.tokens.shape[1]),
            "sha256": calib.sha256,
        }
        identity = RunIdentity(model=source.origin, weights=_weights_stamp(source), recipe=recipe_yaml,
                               calibration_sha256=calib.sha256, device=job.device, dtype=dtype_name(source.dtype))
        journal = _journal_for(out, journal, identity, reporter)
        passes = [get_pass(p.name)(p.config) for p in recipe.passes if p.enabled]
        edges = _prepared_edges(source, passes)
        tokens = calib.tokens
        if not any(p.reads_activations for p in passes) and recipe.engine.error_samples is not None:
            tokens = tokens[:recipe.engine.error_samples]  # only the per-layer error reads them
            calib_info["used_samples"] = int(tokens.shape[0])
        embed = edges.embed if edges else source.read([source.adapter.embed + ".weight"]).popitem()[1]
        cache = embed[tokens].to(CACHE_DTYPES[recipe.engine.cache_dtype])
        del embed
        # a NaN/Inf weight (or one past the range of the dtype the checkpoint is read as) anywhere stops the run at
        # the next layer, of the Fisher passes or of the quantization, not at its own
        scan = FiniteScan(source)
        try:
            fisher = None
            if passes[-1].needs_fisher:
                def progress(phase: str, done: int, total: int) -> None:
                    reporter.phase(f"Fisher ({phase})", done, total)
                    scan.raise_if_bad()  # a NaN found meanwhile stops the run after this layer

                with _timed(phases, "Fisher"):
                    fisher = cached_diagonal_fisher(
                        source, calib.tokens, [name for _, name in source.adapter.linear_names(recipe.targets)],
                        progress)
            layers = _run_layers(job, source, packer, specs, calib, out, journal, reporter, cache, passes, scan,
                                 fisher)
            if replay := sum(r.replay_seconds for r in layers):  # a resume's rebuilding of the finished layers
                phases["replay"] = replay
        finally:
            scan.stop()
        manifest = _finalize(job, source, packer, specs, out, calib_info, layers, recipe_yaml, t0, tokenizer, edges,
                             phases, opening)
        out.commit()
    log.info("wrote %s (%s format)", out.final, packer.name)
    return RunSummary(  # the peak and the timings as the manifest records them
        output=out.final, seconds=time.time() - t0, peak_rss_bytes=manifest["peak_rss_bytes"],
        output_bytes=_tree_bytes(out.final), calibration=calib_info, layers=layers, notes=manifest["notes"],
        format_notes=spec_notes(recipe, specs, packer, source), timings=manifest["timings"],
        peak_rss_while=manifest.get("peak_rss_while"),
    )


def _open_source(job: QuantizeJob) -> tuple[ModelSource, tuple[int, int]]:
    """The model to quantize, refused if it is quantized already, and the peak RSS before and after opening it
    (`_peak_while`)."""
    peak_before = memory.peak_rss_bytes()
    source = open_model(job.model, trust_remote_code=job.trust_remote_code)
    # ru_maxrss only grows: raised by the opening and no higher at the end, the run's peak was the opening's
    opening = (peak_before, memory.peak_rss_bytes())
    log.info("model %s: %s, %d layers, %s, weights in %s", source.origin, source.adapter.model_type,
             source.num_layers, dtype_name(source.checkpoint_dtype), source.path)
    artifact = (source.path / MANIFEST).is_file()
    if artifact or getattr(source.config, "quantization_config", None) is not None:
        what = "a quantkit artifact" if artifact else "its config.json has a quantization_config"
        raise QuantkitError(f"{source.origin} is already quantized ({what}); quantize the original floating-point "
                            "checkpoint")
    return source, opening


def _resolved_job(job: QuantizeJob, source: ModelSource, reporter: Reporter) -> QuantizeJob:
    """`job` with the recipe that the run saves: its windows capped at the model's context (`fit_context`), and
    its dataset the --calib data calibrated on, so that the saved recipe reproduces the run."""
    job = replace(job, recipe=fit_context(job.recipe, source, reporter))
    chosen = job.recipe.calibration.dataset if job.calib is None else str(job.calib)
    # a file's path made absolute (from the recipe, --set or --calib alike), so the saved recipe reads it from anywhere
    dataset = chosen if names_a_set(chosen) else str(Path(chosen).expanduser().resolve())
    return replace(job, recipe=replace(job.recipe, calibration=replace(job.recipe.calibration, dataset=dataset)))


def _calibration(job: QuantizeJob, source: ModelSource, tokenizer: Any, reporter: Reporter) -> CalibrationSet:
    """The run's token windows (`resolve_calibration`), with a warning where they come from the text eval measures."""
    calib = resolve_calibration(job, source, tokenizer, reporter)
    if calib.source.endswith(WIKITEXT_FILE):
        reporter.warn(f"calibrating on the WikiText-2 test split ({calib.source}), the text `quantkit eval` measures "
                      "perplexity on: that perplexity will be optimistic; provide the train split "
                      "(<data dir>/wikitext-2-raw-v1/train.jsonl) for results comparable to the papers")
    log.info("calibration: %s, %s sampling, %d x %d tokens, sha256 %s", calib.source, calib.sampling,
             calib.tokens.shape[0], calib.tokens.shape[1], calib.sha256)
    return calib


def _journal_for(out: OutputDir, journal: dict[str, Any] | None, identity: RunIdentity,
                 reporter: Reporter) -> dict[str, Any]:
    """The journal this run records its layers in: a resumed run's (`journal`), refused where the interrupted run
    differs from `identity`, else a new one, saved."""
    threads = torch.get_num_threads()  # float sums (matmuls, reductions) are split by thread: the bits depend on it
    if journal is None:
        journal = new_journal(identity, threads)
        out.save_journal(journal)
        return journal
    if differences := identity.differences(journal):
        raise QuantkitError(f"--resume: the interrupted run differs from this one: {'; '.join(differences)}; "
                            "rerun with --overwrite to start afresh, or resume with what it used")
    if journal.get("threads", threads) != threads:  # a warning, not a refusal: the result is as good
        reporter.warn(f"--resume: the interrupted run used {journal['threads']} CPU threads, this one "
                      f"{threads}: torch splits float sums by thread, so the layers from here on may differ "
                      "in their last bits from an uninterrupted run's (set OMP_NUM_THREADS to match)")
    return journal


def _prepared_edges(source: ModelSource, passes: list[Pass]) -> ModelEdges | None:
    """The model's embeddings, final norm and lm_head as the passes' `prepare` rewrites them, or None where no pass
    does (they are read only at the end then, when _finalize copies them from the checkpoint)."""
    if all(type(p).prepare is Pass.prepare for p in passes):
        return None
    edges = source.edges()
    for p in passes:
        p.prepare(edges, source.config)
    return edges


@contextlib.contextmanager
def _stops_reported(out: OutputDir, reporter: Reporter) -> Iterator[None]:
    """Around the work that writes `out`: a run stopped by Ctrl-C, by a QuantkitError or by its machine (a full
    disk) says what it leaves for --resume, and lets go of the work dir at once (an embedding caller goes on)."""
    try:
        yield
    except KeyboardInterrupt:
        if out.work.exists():  # else the commit's rename went through: the output is complete
            if _drop_if_empty(out):  # stopped before its first layer: a --resume would find nothing to continue
                reporter.warn("interrupted before any layer was finished: nothing is kept; rerun to start again")
            else:
                again = "--resume --overwrite" if out.final.exists() else "--resume"
                reporter.warn(f"interrupted: finished layers are kept in {out.work}; rerun with {again} to continue")
        raise
    except (QuantkitError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in _MACHINE_ERRNOS:
            _drop_if_empty(out)
            raise
        note = _unfinished(out)
        if isinstance(exc, OSError):  # the disk filled, say: the message, not a traceback
            raise QuantkitError(f"{exc.strerror}" + (f" ({exc.filename})" if exc.filename else "") + note) from None
        exc.args = (f"{exc}{note}",)
        raise
    except Exception:  # a bug's traceback: a work dir without a finished layer would only block the next run
        _drop_if_empty(out)
        raise
    finally:
        out.release()


def _peak_while(source: ModelSource, peak: int, opening: tuple[int, int]) -> str | None:
    """What set the run's peak RSS where opening the model did (the peak before and after it in `opening`): a
    GGUF's conversion, which a rerun skips."""
    if source.converted and opening[0] < opening[1] == peak:
        return "opening the model: the GGUF's one-time conversion, which holds it in float32; a rerun reads the copy"
    return None


@contextlib.contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to `phases[name]`."""
    start = time.time()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.time() - start


# The errors of the machine a run writes on rather than of quantkit or its input: a run stopped by one is reported
# in a line, its finished layers kept for --resume.
_MACHINE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG}


def _layers_kept(out: OutputDir) -> int | None:
    """How many finished layers the work dir's journal records: 0 where it has none yet (stopped before its journal
    was written, or before its first layer), None where the journal cannot be read."""
    try:
        return len(json.loads((out.work / JOURNAL).read_text())["layers"])
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _drop_if_empty(out: OutputDir) -> bool:
    """Remove the work dir of a run stopped before its first layer (nothing to resume); whether it did."""
    if out.work.exists() and _layers_kept(out) == 0:
        shutil.rmtree(out.work, ignore_errors=True)
        return True
    return False


def _unfinished(out: OutputDir) -> str:
    """What a run stopped by an error leaves, said after its message: the work dir holding the layers its journal
    records, or nothing where it records none (the work dir is removed, as an error found before any layer leaves
    none)."""
    if not out.work.exists():  # committed: the error came after the output was complete
        return ""
    done = _layers_kept(out)
    if done is None:  # not readable now: keep it, for a look
        return f"; the run's files are kept in {out.work}"
    if _drop_if_empty(out):
        return ""
    return (f"; {out.work} keeps the {done} layer(s) finished before it: --resume continues from them where the "
            "model and recipe are unchanged, --overwrite starts afresh")


# The files of a checkpoint folder that shape a run: the weights, the config every block's forward reads (norm
# epsilon, RoPE) and the tokenizer that turns the calibration text into tokens (its JSON, a SentencePiece model, BPE
# merges and vocabularies).
CHECKPOINT_FILES = ("*.safetensors", "*.json", "*.model", "merges.txt", "vocab.*")


def _weights_stamp(source: ModelSource) -> dict[str, list[int]]:
    """Each checkpoint file's size and mtime (CHECKPOINT_FILES): what a resumed run checks, so that weights or a
    config changed since the interruption (a checkpoint mended in place, say) are not mixed with layers quantized
    from the old ones. A stat per file, where hashing a 70B checkpoint would read all of it. A GGUF model by its own
    file, which holds its config and tokenizer too, not by the dequantized copy in the cache (which a cleared cache
    rebuilds with a new mtime)."""
    origin = Path(source.origin)
    if origin.suffix == ".gguf" and origin.is_file():
        files = [origin]
    else:
        files = sorted({f for pattern in CHECKPOINT_FILES for f in source.path.glob(pattern) if f.is_file()})
    stats = {f.name: f.stat() for f in files}
    return {name: [stat.st_size, stat.st_mtime_ns] for name, stat in stats.items()}


def _run_layers(
    job: QuantizeJob, source: ModelSource, packer: Packer, specs: dict[str, QuantSpec],
    calib: CalibrationSet, out: OutputDir, journal: dict[str, Any], reporter: Reporter, x: torch.Tensor,
    passes: list[Pass], scan: FiniteScan, fisher: list[Path] | None = None,
) -> list[LayerReport]:
    """Calibrate, quantize and write every block; `x` (the embedded calibration tokens) becomes each block's
    inputs in turn. `scan` (checking the checkpoint ahead of the run) is consulted between layers."""
    recipe, adapter = job.recipe, source.adapter
    runner = BlockRunner(source, calib.tokens.shape[1], recipe.engine.batch_size, job.device)
    act_sim, kv_sim = simulate.sims_for(recipe)
    if not recipe.engine.simulate_activations:
        act_sim = kv_sim = None
    *prep, quantizer = passes
    linear_names = [name for _, name in adapter.linear_names(recipe.targets)]

    ctx = _LayerContext(job, source, packer, specs, runner, act_sim, kv_sim, prep, quantizer, linear_names, fisher)
    reports: list[LayerReport] = []
    reporter.start(source.num_layers, "quantizing layers")
    for i in range(source.num_layers):
        scan.raise_if_bad()
        reports.append(_run_layer(ctx, i, out, journal, x))
        reporter.layer_done(reports[-1])
    scan.raise_if_bad()
    return reports


def _run_layer(ctx: _LayerContext, i: int, out: OutputDir, journal: dict[str, Any], x: torch.Tensor) -> LayerReport:
    """Replay layer `i` from its shard when the journal has it, else calibrate, quantize and record it."""
    total = ctx.source.num_layers + 1
    t_layer = time.time()
    shard_path = out.work / shard_name(i + 1, total)
    done = journal["layers"].get(str(i))
    intact = done is not None and shard_path.is_file() and sha256_file(shard_path) == done["sha256"]
    if done is not None and not intact:
        log.warning("layer %d: its shard %s is not what the journal recorded; quantizing the layer again", i,
                    shard_path)
    if intact:
        _replay_layer(ctx, i, shard_path, x)
        report = LayerReport(i, done["rel_error"], done["seconds"], done["notes"], done["metrics"], replayed=True,
                             step_seconds=done.get("step_seconds", {}), replay_seconds=time.time() - t_layer)
    else:
        rel, notes, metrics, steps = _quantize_layer(ctx, i, shard_path, x)
        report = LayerReport(i, rel, time.time() - t_layer, notes, metrics, step_seconds=steps)
        journal["layers"][str(i)] = {
            "shard": shard_path.name, "sha256": sha256_file(shard_path), "rel_error": rel,
            "seconds": report.seconds, "notes": notes, "metrics": metrics, "step_seconds": steps,
        }
        out.save_journal(journal)
    log.debug("layer %d%s: rel. error %.5f; steps %s; metrics %s", i, " (replayed)" if report.replayed else "",
              report.rel_error, {k: round(v, 2) for k, v in report.step_seconds.items()}, report.metrics)
    return report


@dataclass
class _LayerContext:
    """What every layer's calibration shares."""

    job: QuantizeJob
    source: ModelSource
    packer: Packer
    specs: dict[str, QuantSpec]
    runner: BlockRunner
    act_sim: simulate.ActivationSim | None
    kv_sim: simulate.KVSim | None
    prep: list[Pass]
    quantizer: Pass
    linear_names: list[str]
    fisher: list[Path] | None = None  # per layer: the diagonal Fisher file (quantizers that need it)


def _replay_layer(ctx: _LayerContext, i: int, shard_path: Path, x: torch.Tensor) -> None:
    """Rebuild a finished layer from its shard and run it on `x` in place (resume). With `engine.propagate: float`
    the next layer read the full-precision outputs of the block as its transforms left it, which the shard does not
    hold: that block is rebuilt from the checkpoint and the transforms run again on `x` (deterministic, so the same
    bits)."""
    recipe = ctx.job.recipe
    if recipe.engine.propagate == "float":
        work = _prepared_work(ctx, i, x, transforms_only=True)
        ctx.runner.run(work.block, x, out=x)
        return
    ctx.runner.run(_simulated_block(ctx, i, read_safetensors(shard_path)), x, out=x)


def _simulated_block(ctx: _LayerContext, i: int, shard: dict[str, torch.Tensor]) -> nn.Module:
    """Block `i` as an engine runs it from its shard (_deployed_block), on the run's device, with the recipe's
    activation and KV simulation attached: what the next block's inputs come from, in a run and in its resume."""
    block, runtime = _deployed_block(ctx.source, i, shard, ctx.packer, ctx.specs, ctx.job.recipe.targets)
    block.to(ctx.job.device)
    simulate.attach([block], ctx.linear_names, ctx.source.config, ctx.act_sim, ctx.kv_sim, runtime=[runtime],
                    adapter=ctx.source.adapter)
    return block


def _round_kept(block: nn.Module, linears: dict[str, str], dtype: torch.dtype) -> None:
    """Round the block's tensors that are written as they are (norm weights, biases) to the checkpoint's `dtype`,
    in place: a pass that folds a scale into a norm leaves it in float32, and the next block's inputs must come from
    exactly what the shard holds (what an engine computes, and what --resume replays)."""
    quantized = {f"{name}.weight" for name in linears}
    with torch.no_grad():
        for key, t in block.state_dict().items():
            if key not in quantized and t.is_floating_point():
                t.copy_(t.to(dtype))


def _prepared_work(ctx: _LayerContext, i: int, x: torch.Tensor, lap: Callable[[str], None] = lambda step: None,
                   transforms_only: bool = False) -> LayerWork:
    """Block `i` from the checkpoint with the passes before the quantizer run on inputs `x` (only those that rewrite
    it with `transforms_only`) and its kept tensors rounded: the block whose full-precision outputs are the
    reference, and that the quantizer reads."""
    job, source, recipe, adapter = ctx.job, ctx.source, ctx.job.recipe, ctx.source.adapter
    block = build_block(source, i).to(job.device)
    work = LayerWork(
        index=i, block=block, linears={name: role for role, name in adapter.linear_names(recipe.targets)},
        specs={}, scale_dtype=source.dtype, inputs=x, runner=ctx.runner, adapter=adapter, config=source.config,
        act_bits=ctx.act_sim.bits if ctx.act_sim else None, kv=ctx.kv_sim,
        sink_weight=recipe.calibration.sink_weight, token_cap=recipe.calibration.token_cap,
        hessian_sim=simulate.sims_for(recipe)[0] if recipe.calibration.hessian_inputs == "quantized" else None,
    )
    work.specs = {name: ctx.specs[role] for name, role in work.linears.items()}
    if ctx.fisher is not None and not transforms_only:
        work.fisher = {name: t.to(job.device, torch.float32) for name, t in read_safetensors(ctx.fisher[i]).items()}
    lap("load")
    for p in ctx.prep:
        if transforms_only and not p.transforms:
            continue
        p.run(work)
        lap(p.name)
        if p.transforms:
            work.hessians.clear()
    _round_kept(block, work.linears, source.dtype)
    return work


def _quantize_layer(
    ctx: _LayerContext, i: int, shard_path: Path, x: torch.Tensor
) -> tuple[float, list[str], dict[str, float], dict[str, float]]:
    """Calibrate and quantize block `i` on inputs `x`, write its shard, and replace `x` by the next block's
    inputs; returns the relative output error, the passes' notes and metrics, and the seconds each step took.
    A function of its own so that everything of this block is freed before the next one is read."""
    steps: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(step: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        steps[step] = steps.get(step, 0.0) + now - clock
        clock = now

    job, source, packer, runner = ctx.job, ctx.source, ctx.packer, ctx.runner
    recipe, adapter, quantizer = job.recipe, source.adapter, ctx.quantizer
    work = _prepared_work(ctx, i, x, lap=lap)
    block = work.block
    n_err = min(recipe.engine.error_samples or x.shape[0], x.shape[0])  # sequences the error is measured on
    by_role = (recipe.engine.true_sequential and quantizer.needs_hessian and not work.hessians
               and recipe.engine.propagate == "quantized")
    if by_role:
        y_ref = runner.run(block, x[:n_err])
        packed = _quantize_by_role(work, quantizer, packer, source.dtype, x, ctx.act_sim, ctx.kv_sim)
        lap(quantizer.name)  # Hessians, quantization and packing, role by role
    else:
        if quantizer.needs_hessian and not work.hessians:
            y_ref = work.collect_hessians()
            lap("hessians")
        else:
            y_ref = runner.run(block, x if recipe.engine.propagate == "float" else x[:n_err])
        quantizer.run(work)
        lap(quantizer.name)
        packed = {name: packer.pack(q.finished().to("cpu")) for name, q in work.results.items()}
    missing = set(work.linears) - set(packed)
    if missing:
        raise QuantkitError(f"layer {i}: no pass quantized {sorted(missing)}")
    work.results.clear()
    work.hessians.clear()
    notes, metrics = work.notes, work.metrics

    shard = _layer_shard(adapter.layer_prefix(i), packed, block, source.dtype)
    atomic_save_safetensors(shard, shard_path)

    if by_role:
        y_q = x[:n_err]
    else:
        del block, work
        block = _simulated_block(ctx, i, shard)
        if recipe.engine.propagate == "quantized":
            y_q = runner.run(block, x, out=x)[:n_err]
        else:
            y_q = runner.run(block, x[:n_err])
            x.copy_(y_ref)
    rel, metrics["sink_rel_error"] = _finite_errors(i, y_q, y_ref[:n_err])
    lap("pack+propagate")
    return rel, notes, metrics, steps


def _layer_shard(prefix: str, packed: dict[str, dict[str, torch.Tensor]], block: nn.Module,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A layer's shard: each quantized linear's packed tensors, and the block's other tensors (biases, norms) as
    they are, in the checkpoint's `dtype`, under the layer's `prefix`."""
    shard = {f"{prefix}{name}.{key}": t for name, parts in packed.items() for key, t in parts.items()}
    quantized = {f"{name}.weight" for name in packed}
    for key, t in block.state_dict().items():
        if key not in quantized:
            shard[prefix + key] = t.to("cpu", dtype)
    return shard


def _finite_errors(i: int, y_q: torch.Tensor, y_ref: torch.Tensor) -> tuple[float, float]:
    """Layer `i`'s output errors (`output_errors`), or an error that stops the run where they are not finite: an
    unusable artifact, whose layer is not recorded as done."""
    rel, sink = output_errors(y_q, y_ref)
    if not (math.isfinite(rel) and math.isfinite(sink)):
        whose = ("the unquantized block's outputs overflow on the calibration text"
                 if not bool(torch.isfinite(y_ref).all()) else
                 "the block rebuilt from its packed shard gives non-finite outputs (a scale or table overflowed)")
        raise QuantkitError(f"layer {i}: relative output error {rel:g}: {whose}; the layer is not recorded as done")
    return rel, sink


def output_errors(y_q: torch.Tensor, y_ref: torch.Tensor) -> tuple[float, float]:
    """A layer's relative output error ||Y_q - Y|| / ||Y|| over [sequences, tokens, hidden] outputs: over every
    token but each sequence's first, and at the first, the attention sink, apart. The sink's output can be orders
    of magnitude larger or smaller than the rest (massive activations), so in one norm it alone would set the
    number; a single-token sequence has only its sink."""
    diff, ref = (y_q.float() - y_ref.float()), y_ref.float()

    def rel(d: torch.Tensor, r: torch.Tensor) -> float:
        nd, nr = torch.linalg.vector_norm(d), torch.linalg.vector_norm(r)
        if bool(torch.isfinite(nd) & torch.isfinite(nr)):
            return float(nd / nr.clamp(min=1e-30))
        return _scaled_norm(d) / max(_scaled_norm(r), 1e-30)  # squares past float32's range (values past 1e19)

    sink = rel(diff[:, 0], ref[:, 0])
    return (rel(diff[:, 1:], ref[:, 1:]) if ref.shape[1] > 1 else sink), sink


def _scaled_norm(t: torch.Tensor) -> float:
    """||t|| of finite values whose squares float32 cannot hold, taken over t / max|t| (inf where t is not finite)."""
    top = t.abs().amax()
    if not bool(torch.isfinite(top)) or top == 0:
        return float(torch.linalg.vector_norm(t))
    return float(torch.linalg.vector_norm(t / top)) * float(top)


def _finalize(
    job: QuantizeJob, source: ModelSource, packer: Packer, specs: dict[str, QuantSpec], out: OutputDir,
    calib_info: dict[str, Any], layers: list[LayerReport], recipe_yaml: str, t0: float, tokenizer: Any,
    edges: ModelEdges | None, phases: dict[str, float], opening: tuple[int, int],
) -> dict[str, Any]:
    """Write the non-layer shard (with the passes' rewritten edges, if any), index, config, tokenizer, recipe
    and manifest into the work dir; returns the manifest."""
    untied = _write_rest(source, packer, out, edges)
    _write_index(source, out)
    _write_config(source, packer, specs, out, untied)
    tokenizer.save_pretrained(out.work)
    atomic_write(out.work / RECIPE, recipe_yaml)
    manifest = _manifest(job, source, packer, specs, out, calib_info, layers, t0, phases, opening)
    atomic_write(out.work / MANIFEST, json.dumps(manifest, indent=2))
    return manifest


def _write_rest(source: ModelSource, packer: Packer, out: OutputDir, edges: ModelEdges | None) -> bool:
    """Write the last shard: the tensors outside the layers (the embeddings, final norm and lm_head as the passes
    rewrote them, where they did). Returns whether a tied lm_head came apart from the embeddings."""
    total = source.num_layers + 1
    a = source.adapter
    rest = {name: t.to(source.dtype) if t.is_floating_point() else t
            for name, t in source.read(source.non_layer_names()).items()}
    untied = False
    if edges is not None:
        rest[a.embed + ".weight"] = edges.embed.to(source.dtype).contiguous()
        rest[a.final_norm + ".weight"] = edges.final_norm.to(source.dtype).contiguous()
        untied = source.tied_embeddings and not torch.equal(edges.lm_head, edges.embed)
        if not source.tied_embeddings or untied:
            rest[a.lm_head + ".weight"] = edges.lm_head.to(source.dtype).contiguous()
    if packer.writes_lm_head and a.lm_head + ".weight" not in rest:  # a copy of the tied embedding, for engines
        # that never tie (the config still says tied, so that transformers and quantkit's eval tie as before)
        rest[a.lm_head + ".weight"] = rest[a.embed + ".weight"].clone()
    atomic_save_safetensors(rest, out.work / shard_name(total, total))
    return untied


def _write_index(source: ModelSource, out: OutputDir) -> None:
    """model.safetensors.index.json over every shard, from their headers."""
    total = source.num_layers + 1
    weight_map: dict[str, str] = {}
    tensor_bytes = 0  # total_size: the tensors' bytes, as transformers' own indexes count it (headers apart)
    for i in range(total):
        name = shard_name(i + 1, total)
        for key, entry in check_safetensors(out.work / name).items():
            weight_map[key] = name
            start, stop = entry["data_offsets"]
            tensor_bytes += stop - start
    index = {"metadata": {"total_size": tensor_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write(out.work / "model.safetensors.index.json", json.dumps(index, indent=2))


def _write_config(source: ModelSource, packer: Packer, specs: dict[str, QuantSpec], out: OutputDir,
                  untied: bool) -> None:
    """The checkpoint's config.json with the format's quantization_config and entries, and the generation config."""
    a = source.adapter
    config = json.loads((source.path / "config.json").read_text())
    config["quantization_config"] = packer.quantization_config(specs)
    config.update(packer.config_entries(specs, a.layers_prefix, {role: a.linears[role] for role in specs}))
    config["torch_dtype"] = dtype_name(source.dtype)
    if untied or not source.tied_embeddings:  # an lm_head stored apart, as transformers reads a config that ties
        config["tie_word_embeddings"] = False  # but holds both: the stored head, not the embeddings
    config.pop("dtype", None)
    atomic_write(out.work / "config.json", json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (source.path / extra).is_file():
            shutil.copyfile(source.path / extra, out.work / extra)


def _manifest(
    job: QuantizeJob, source: ModelSource, packer: Packer, specs: dict[str, QuantSpec], out: OutputDir,
    calib_info: dict[str, Any], layers: list[LayerReport], t0: float, phases: dict[str, float],
    opening: tuple[int, int],
) -> dict[str, Any]:
    """The manifest of the work dir's files as they stand: what made the artifact, every layer's error and time,
    and each file's size and sha256."""
    import safetensors
    import transformers

    notes = spec_notes(job.recipe, specs, packer, source) + [f"layer {r.index}: {n}" for r in layers for n in r.notes]
    files = sorted(p for p in out.work.iterdir() if p.is_file() and p.name not in (JOURNAL, MANIFEST, LOCK))
    manifest = {
        "quantkit_version": __version__,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "python": platform.python_version()},
        "model": source.origin,
        "architecture": source.adapter.model_type,
        "num_layers": source.num_layers,
        "recipe": job.recipe.name,
        "format": packer.name,
        "weights": {role: asdict(s) for role, s in specs.items()},
        "activations": None if job.recipe.activations is None else {"bits": job.recipe.activations.bits},
        "kv_cache": None if job.recipe.kv_cache is None else {"bits": job.recipe.kv_cache.bits},
        "calibration": calib_info,
        "layers": [{"index": r.index, "rel_error": r.rel_error, "seconds": r.seconds, "metrics": r.metrics,
                    "step_seconds": r.step_seconds, **({"resumed": True} if r.replayed else {})} for r in layers],
        "notes": notes,
        "timings": _timings(time.time() - t0, layers, phases),
        "peak_rss_bytes": (peak := memory.peak_rss_bytes()),
        **({"peak_rss_while": why} if (why := _peak_while(source, peak, opening)) else {}),
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files},
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    return manifest


def _timings(total: float, layers: list[LayerReport], phases: dict[str, float]) -> dict[str, Any]:
    """The manifest's timings, all of this run's: its wall time, its layers' (not those a resume took over from
    the unfinished run, whose count and recorded seconds come apart), their steps' and the phases outside them."""
    fresh = [r for r in layers if not r.replayed]
    resumed = [r for r in layers if r.replayed]
    timings: dict[str, Any] = {"total_seconds": total, "layer_seconds": sum(r.seconds for r in fresh),
                               "step_seconds": step_totals(fresh), "phase_seconds": dict(phases)}
    if resumed:
        timings["resumed_layers"] = len(resumed)
        timings["resumed_layer_seconds"] = sum(r.seconds for r in resumed)
    return timings


def step_totals(layers: list[LayerReport]) -> dict[str, float]:
    """Seconds per step (pass, Hessians, packing) summed over layers, largest first."""
    totals: dict[str, float] = {}
    for r in layers:
        for step, seconds in r.step_seconds.items():
            totals[step] = totals.get(step, 0.0) + seconds
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
