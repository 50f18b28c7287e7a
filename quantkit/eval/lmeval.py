"""Offline lm-eval harness integration: run standard zero-shot tasks on an in-memory (quantized) model.

The task configs in the bundled `eval/` folder (package data `quantkit.data.eval`) mirror lm-eval's own
configs for piqa, arc_easy, arc_challenge, hellaswag, winogrande and wikitext, but read local JSON-lines
files (`dataset_path: json`) instead of Hub datasets. They are templates: the data directory is only known at
run time, so `run_lm_eval` renders them into a temporary directory and points lm-eval's TaskManager there.
Nothing touches the network: the Hub/datasets offline switches are on for the whole call.

User-facing task names and their data files (relative to the data directory) are in `LM_EVAL_TASKS`.
`wikitext_lm` is lm-eval's document-level word/byte perplexity, not the GPTQ/AWQ paper perplexity protocol.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import QuantkitError, not_a_directory
from quantkit.files import DATA_DIR_ENV, json_objects, resolve_data_dir
from quantkit.resources import data_path

__all__ = [
    "DATA_DIR_ENV",
    "LM_EVAL_TASKS",
    "EvalDataError",
    "TaskInfo",
    "UnknownEvalTaskError",
    "check_task_data",
    "render_task_configs",
    "require_lm_eval",
    "resolve_data_dir",
    "run_lm_eval",
]

# Module written next to the rendered configs; their `!function quantkit_task_utils.<fn>` tags resolve to it
# (lm-eval looks for `<module>.py` beside the YAML), and it re-exports the helpers defined below.
_UTILS_MODULE = "quantkit_task_utils"
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


class EvalDataError(QuantkitError):
    """A task's local data file (or the data directory itself) is missing."""


class UnknownEvalTaskError(QuantkitError, ValueError):
    """A task name that quantkit's lm-eval integration does not support."""


def _not_text(row: dict[str, Any], *fields: str) -> str:
    """"field 'goal' is not text" for those of `fields` that are not strings, or ""."""
    bad = [field for field in fields if not isinstance(row[field], str)]
    return f"field {', '.join(map(repr, bad))} is not text" if bad else ""


def _not_index(row: dict[str, Any], field: str, count: int, base: int = 0) -> str:
    """What is wrong with `field` as an index base..base+count-1 (an int or its digits, as lm-eval's int() reads
    it), or ""."""
    value = row[field]
    ok = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value.isdecimal())
    if ok and base <= int(value) < base + count:
        return ""
    return f"field {field!r} is {value!r}, not one of {base}..{base + count - 1}"


def _arc_problem(row: dict[str, Any]) -> str:
    """An ARC row must hold its question as text and its choices as texts with labels, one each, in either layout
    (HF, or the AI2 original), and its answer key must be one of those labels."""
    question = row["question"]
    if isinstance(question, dict):  # the original layout: {"stem", "choices": [{"text", "label"}, ...]}
        choices = question.get("choices")
        if not isinstance(question.get("stem"), str):
            return "the question object's 'stem' is missing or not text"
        if not (isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices)):
            return "the question object's 'choices' is not a list of {text, label} objects"
        texts, labels = [c.get("text") for c in choices], [c.get("label") for c in choices]
    elif isinstance(question, str) and isinstance(row.get("choices"), dict):
        texts, labels = row["choices"].get("text"), row["choices"].get("label")
        if not (isinstance(texts, list) and isinstance(labels, list) and texts and len(texts) == len(labels)):
            return "field 'choices' does not hold lists 'text' and 'label' of one length"
    else:
        return "no choices (HF layout: question and choices {text, label}; or the AI2 original's question object)"
    if not all(isinstance(t, str) for t in texts + labels):
        return "a choice's text or label is not text"
    return "" if row["answerKey"] in labels else f"answerKey {row['answerKey']!r} is none of the labels {labels}"


def _winogrande_problem(row: dict[str, Any]) -> str:
    """The sentence holds the blank `_` that each option fills (lm-eval splits it there)."""
    problem = _not_text(row, "sentence", "option1", "option2") or _not_index(row, "answer", 2, 1)
    return problem or ("" if "_" in row["sentence"] else "field 'sentence' has no blank '_' for the options to fill")


def _hellaswag_problem(row: dict[str, Any]) -> str:
    endings = row["endings"]
    if not (isinstance(endings, list) and endings and all(isinstance(e, str) for e in endings)):
        return "field 'endings' is not a list of texts"
    return _not_text(row, "activity_label", "ctx_a", "ctx_b") or _not_index(row, "label", len(endings))


@dataclass(frozen=True)
class TaskInfo:
    """One supported lm-eval task: user-facing name, lm-eval task name, config template and data files."""

    name: str
    lm_eval_name: str
    config: str
    data_files: tuple[str, ...]
    metrics: tuple[str, ...]
    description: str
    fields: tuple[str, ...]  # what every row of its data files must hold (checked before any model time)
    row_problem: Callable[[dict[str, Any]], str]  # what is wrong with a row's values (lm-eval would fail or misscore)


LM_EVAL_TASKS: dict[str, TaskInfo] = {
    info.name: info
    for info in (
        TaskInfo(
            "piqa",
            "quantkit_piqa",
            "quantkit_piqa.yaml",
            ("piqa/validation.jsonl",),
            ("acc", "acc_norm"),
            "PIQA validation (1838), 0-shot; HF layout goal/sol1/sol2/label",
            ("goal", "sol1", "sol2", "label"),
            lambda row: _not_text(row, "goal", "sol1", "sol2") or _not_index(row, "label", 2),
        ),
        TaskInfo(
            "arc_easy",
            "quantkit_arc_easy",
            "quantkit_arc_easy.yaml",
            ("arc/ARC-Easy-Test.jsonl",),
            ("acc", "acc_norm"),
            "AI2 ARC-Easy test (2376), 0-shot; HF allenai/ai2_arc layout question/choices/answerKey",
            ("question", "answerKey"),
            _arc_problem,
        ),
        TaskInfo(
            "arc_challenge",
            "quantkit_arc_challenge",
            "quantkit_arc_challenge.yaml",
            ("arc/ARC-Challenge-Test.jsonl",),
            ("acc", "acc_norm"),
            "AI2 ARC-Challenge test (1172), 0-shot; HF allenai/ai2_arc layout question/choices/answerKey",
            ("question", "answerKey"),
            _arc_problem,
        ),
        TaskInfo(
            "hellaswag",
            "quantkit_hellaswag",
            "quantkit_hellaswag.yaml",
            ("hellaswag/validation.jsonl",),
            ("acc", "acc_norm"),
            "HellaSwag validation (10042), 0-shot; HF Rowan/hellaswag layout ctx_a/ctx_b/endings/label",
            ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
            _hellaswag_problem,
        ),
        TaskInfo(
            "winogrande",
            "quantkit_winogrande",
            "quantkit_winogrande.yaml",
            ("winogrande/validation.jsonl",),
            ("acc",),
            "WinoGrande validation (1267), 0-shot partial scoring; HF layout sentence/option1/option2/answer",
            ("sentence", "option1", "option2", "answer"),
            _winogrande_problem,
        ),
        TaskInfo(
            "wikitext_lm",
            "quantkit_wikitext",
            "quantkit_wikitext.yaml",
            ("wikitext-2-raw-v1/document_level_test.jsonl",),
            ("word_perplexity", "byte_perplexity", "bits_per_byte"),
            "lm-eval's document-level WikiText-2 test perplexity (62 pages, rolling windows); field page",
            ("page",),
            lambda row: _not_text(row, "page"),
        ),
    )
}
"""Supported tasks, by user-facing name. Data files are relative to the data directory."""


def _supported() -> str:
    return ", ".join(LM_EVAL_TASKS)


def _task_infos(tasks: Sequence[str]) -> list[TaskInfo]:
    """Validate user task names (duplicates dropped, order kept) before anything runs."""
    if isinstance(tasks, str):
        tasks = [tasks]
    if not tasks:
        raise UnknownEvalTaskError(f"no lm-eval tasks given; supported: {_supported()}")
    unknown = [t for t in tasks if t not in LM_EVAL_TASKS]
    if unknown:
        hint = ""
        if "wikitext" in unknown:
            hint = " (lm-eval's document-level wikitext perplexity is called 'wikitext_lm')"
        raise UnknownEvalTaskError(
            f"unknown lm-eval task(s): {', '.join(map(repr, unknown))}{hint}; supported: {_supported()}"
        )
    return [LM_EVAL_TASKS[t] for t in dict.fromkeys(tasks)]


def require_lm_eval() -> None:
    """Raise a QuantkitError naming the extra to install unless lm-eval and its Hugging Face backend import."""
    try:
        import lm_eval  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401
        from lm_eval.tasks import TaskManager  # noqa: F401
    except ImportError as exc:
        raise QuantkitError(
            f"lm-eval tasks need lm-eval with its Hugging Face backend ({exc}); "
            "install the extra: pip install 'quantkit[eval]'"
        ) from exc


def check_task_data(tasks: Sequence[str], data_dir: str | Path | None = None) -> Path:
    """Check task names and that every task's data file exists; return the resolved data directory.

    Checks all tasks first so that one error lists every missing file, before any model time is spent.
    """
    infos = _task_infos(tasks)
    root = resolve_data_dir(data_dir)
    how = f"pass --data-dir DIR or set {DATA_DIR_ENV}=DIR, with DIR holding the files named above"
    if root is None:
        needed = "\n".join(f"  {info.name}: DIR/{f}" for info in infos for f in info.data_files)
        raise EvalDataError(
            f"lm-eval tasks read local data files, but no data directory was given:\n{needed}\n{how}"
        )
    missing = [(info.name, root / f) for info in infos for f in info.data_files if not (root / f).is_file()]
    if missing:
        lines = "\n".join(f"  task {name}: missing data file {path}" for name, path in missing)
        note = "" if root.is_dir() else f" (data directory {root} {not_a_directory(root)})"
        raise EvalDataError(f"lm-eval data not found{note}:\n{lines}\n{how}")
    problems = [problem for info in infos for name in info.data_files if (problem := _file_problem(info, root / name))]
    if problems:  # every task's, so that one run finds them all
        raise EvalDataError("\n".join(problems) if len(problems) == 1 else
                            "lm-eval data that the tasks cannot read:\n" + "\n".join(f"  {p}" for p in problems))
    return root


def _file_problem(info: TaskInfo, path: Path) -> str:
    """The first thing wrong with task data file `path`, with its line, or "": every row must be of the task's
    layout with values lm-eval can score, which it would find only once the model is loaded."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return f"task {info.name}: cannot read {path} as UTF-8 text ({exc})"
    rows = 0
    try:
        for number, row in json_objects(lines, path, info.fields, EvalDataError,
                                        fix=f"task {info.name} reads rows with fields {', '.join(info.fields)}"):
            if problem := info.row_problem(row):  # values lm-eval would fail on, or score wrongly
                return f"{path}, line {number}: {problem} (task {info.name})"
            rows += 1
    except EvalDataError as exc:
        return str(exc)
    return "" if rows else f"{path} holds no rows (task {info.name})"


def _yaml_string_body(value: str) -> str:
    """`value` escaped for the inside of a YAML double-quoted scalar (JSON escapes are valid YAML ones)."""
    return json.dumps(value)[1:-1]


def render_task_configs(
    tasks: Sequence[str], data_dir: str | Path, out_dir: str | Path, *, cache_dir: str | Path | None = None
) -> list[Path]:
    """Render the bundled config templates of `tasks` into `out_dir`, with the helper module beside them.

    `{data_dir}` becomes the absolute data directory and `{cache_dir}` the `datasets` cache directory
    (default: `out_dir/hf_datasets_cache`, so the call leaves nothing behind). Returns the written YAMLs.
    """
    infos = _task_infos(tasks)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir is not None else out / "hf_datasets_cache"
    values = {
        "{data_dir}": _yaml_string_body(str(Path(data_dir).expanduser().resolve())),
        "{cache_dir}": _yaml_string_body(str(cache.expanduser().resolve())),
    }
    templates = data_path("eval")
    written = []
    for info in infos:
        text = (templates / info.config).read_text(encoding="utf-8")
        for key, value in values.items():
            text = text.replace(key, value)
        path = out / info.config
        path.write_text(text, encoding="utf-8")
        written.append(path)
    helpers = ", ".join(_HELPERS)
    (out / f"{_UTILS_MODULE}.py").write_text(
        '"""Written by quantkit: the `!function` helpers of the task configs beside this file."""\n\n'
        f"from quantkit.eval.lmeval import {helpers}  # noqa: F401\n",
        encoding="utf-8",
    )
    return written


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Force Hub/datasets offline mode for the duration (env vars and the already-imported module flags)."""
    saved_env = {key: os.environ.get(key) for key in _OFFLINE_ENV}
    os.environ.update(dict.fromkeys(_OFFLINE_ENV, "1"))
    saved_attrs: list[tuple[Any, str, Any]] = []
    for module_name, attr in (
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_DATASETS_OFFLINE"),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, attr):
            saved_attrs.append((module, attr, getattr(module, attr)))
            setattr(module, attr, True)
    try:
        yield
    finally:
        for module, attr, value in reversed(saved_attrs):
            setattr(module, attr, value)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _no_retie(model: torch.nn.Module) -> Iterator[None]:
    """Make `model.tie_weights()` a no-op: HFLM calls it, and it would overwrite a separately quantized
    lm_head with the embedding (transformers re-ties whenever `tie_word_embeddings` is set)."""
    own = "tie_weights" in vars(model)
    previous = vars(model).get("tie_weights")
    object.__setattr__(model, "tie_weights", lambda *args, **kwargs: None)
    try:
        yield
    finally:
        if own:
            object.__setattr__(model, "tie_weights", previous)
        else:
            object.__delattr__(model, "tie_weights")


# What HFLM warns of whenever it is given a model object, as quantkit always does: advice for launches quantkit never
# makes (accelerate, parallelize=True, several processes), which reads to a user as a problem with the run.
_IN_MEMORY_MODEL_WARNINGS = ("`pretrained` model kwarg is not of type `str`",
                             "Passed an already-initialized model through `pretrained`")


class _DropWarnings(logging.Filter):
    """Drops the log records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes: Sequence[str]):
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefixes)


@contextlib.contextmanager
def _quiet_in_memory_model_warnings() -> Iterator[None]:
    """HFLM's warnings about an in-memory model, and those alone, kept off the user's terminal for the duration."""
    logger = logging.getLogger("lm_eval.models.huggingface")
    drop = _DropWarnings(_IN_MEMORY_MODEL_WARNINGS)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def _no_git_probe() -> Iterator[None]:
    """lm-eval records `git describe` of the working directory in its results: not quantkit's commit, and outside a
    repository git prints "fatal: not a git repository" into the user's terminal. quantkit's results name their
    artifact instead, so the probe returns nothing for the duration."""
    import lm_eval.evaluator as evaluator

    probe = getattr(evaluator, "get_git_commit_hash", None)
    if probe is None:  # another lm-eval version: nothing to quiet
        yield
        return
    evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = probe


def _metrics(task_result: dict[str, Any]) -> dict[str, float]:
    """lm-eval's `{"acc,none": .., "acc_stderr,none": .., "alias": ..}` -> `{"acc": .., "acc_stderr": ..}`."""
    out: dict[str, float] = {}
    for key, value in task_result.items():
        metric, _, filt = key.partition(",")
        if filt not in ("", "none") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # alias, "N/A" stderrs, other filters
        out[metric] = float(value)
    return out


def run_lm_eval(
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: list[str],
    *,
    data_dir: str | Path | None = None,
    limit: int | None = None,
    batch_size: int = 1,
    max_length: int | None = None,
) -> dict[str, dict[str, float]]:
    """Evaluate the in-memory `model` (used as-is, hooks included) on lm-eval `tasks`, fully offline.

    tasks: user-facing names from `LM_EVAL_TASKS` (piqa, arc_easy, arc_challenge, hellaswag, winogrande,
        wikitext_lm). data_dir: directory holding the tasks' data files; default `$QUANTKIT_DATA_DIR`.
    limit: first N documents per task (smoke tests only). max_length: context length lm-eval may use;
        default the model's `max_position_embeddings`. Every multiple-choice continuation must fit in it
        (a PIQA answer is up to 624 tokens with a 512-piece vocabulary: a 512-context model needs 1024).
    Returns per user task name a dict metric -> value, e.g. {"piqa": {"acc": .., "acc_stderr": ..,
    "acc_norm": .., "acc_norm_stderr": .., "sample_len": 20.0}} (`sample_len`: documents scored);
    perplexity metrics have no stderr. Raises EvalDataError / UnknownEvalTaskError before running anything.
    """
    root = check_task_data(tasks, data_dir)
    infos = _task_infos(tasks)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of documents, got {limit}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    require_lm_eval()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    was_training = model.training
    with (
        _offline(),
        _no_git_probe(),
        tempfile.TemporaryDirectory(prefix="quantkit-lmeval-", ignore_cleanup_errors=True) as tmp,
    ):
        render_task_configs([i.name for i in infos], root, tmp)
        manager = TaskManager(include_path=tmp, include_defaults=False)
        absent = [i.lm_eval_name for i in infos if i.lm_eval_name not in manager.all_tasks]
        if absent:  # a template lm-eval could not parse is skipped silently by its indexer
            raise QuantkitError(
                f"lm-eval did not register quantkit task config(s) {absent} rendered in {tmp}"
            )
        try:
            with _no_retie(model), _quiet_in_memory_model_warnings():
                lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=[i.lm_eval_name for i in infos],
                limit=limit,
                task_manager=manager,
                log_samples=False,
                random_seed=None,  # 0-shot loglikelihood tasks need no seeding; leave global RNGs alone
                numpy_random_seed=None,
                torch_random_seed=None,
            )
        finally:
            model.train(was_training)
    if not results or "results" not in results:
        raise QuantkitError("lm-eval returned no results (not the rank-0 process?)")
    return {i.name: _metrics(results["results"][i.lm_eval_name]) for i in infos}


# ---------------------------------------------------------------------------------------------------------
# `!function` helpers of the task configs, re-exported by the rendered `quantkit_task_utils.py`.
# Ported from lm-eval 0.4.x (MIT): tasks/hellaswag/utils.py, tasks/winogrande/preprocess_winogrande.py,
# tasks/wikitext/preprocess_wikitext.py, so scores match lm-eval's built-in tasks.
# ---------------------------------------------------------------------------------------------------------


def hellaswag_preprocess(text: str) -> str:
    """Clean a HellaSwag string (WikiHow bracket artifacts, double spaces), as lm-eval does."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_process_docs(dataset: Any) -> Any:
    """Add lm-eval's `query`, `choices` and `gold` fields to each HellaSwag row."""

    def _process(doc: dict[str, Any]) -> dict[str, Any]:
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [hellaswag_preprocess(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(_process)


def arc_process_docs(dataset: Any) -> Any:
    """Accept the original AI2 ARC jsonl layout too, converting it to the HF one (HF rows pass unchanged)."""
    if not isinstance(dataset.features.get("question"), dict):
        return dataset

    def _convert(doc: dict[str, Any]) -> dict[str, Any]:
        question = doc["question"]
        choices = question["choices"]
        if isinstance(choices, dict):  # datasets may store a list of structs as a struct of lists
            texts, labels = list(choices["text"]), list(choices["label"])
        else:
            texts, labels = [c["text"] for c in choices], [c["label"] for c in choices]
        return {"question": question["stem"], "choices": {"text": texts, "label": labels}}

    return dataset.map(_convert, remove_columns=["question"])


def winogrande_doc_to_text(doc: dict[str, Any]) -> int:
    """Index of the right option: the gold context in lm-eval's partial evaluation."""
    return int(doc["answer"]) - 1


def winogrande_doc_to_target(doc: dict[str, Any]) -> str:
    """The sentence after the blank, the shared continuation scored under each option."""
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def winogrande_doc_to_choice(doc: dict[str, Any]) -> list[str]:
    """The sentence up to the blank, completed with each option: the two contexts."""
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]


def wikitext_detokenizer(doc: dict[str, Any]) -> str:
    """Undo WikiText tokenization artifacts (` @-@ `, spaced punctuation) of a page, as lm-eval does."""
    string = doc["page"]
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    for old, new in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")):
        string = string.replace(old, new)
    for punct in (":", ";", ".", "!", "?", ","):
        string = string.replace(f" {punct} ", f"{punct} ")
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    for old, new in (("= = = =", "===="), ("= = =", "==="), ("= =", "==")):
        string = string.replace(old, new)
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    return string.replace(" 's", "'s")


def wikitext_process_results(doc: dict[str, Any], results: Sequence[float]) -> dict[str, tuple[float, int]]:
    """Per-page (loglikelihood, count) pairs; words and bytes are counted on the page before detokenizing."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["page"]))
    nbytes = len(doc["page"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, nbytes),
        "bits_per_byte": (loglikelihood, nbytes),
    }


_HELPERS = (
    "arc_process_docs",
    "hellaswag_process_docs",
    "wikitext_detokenizer",
    "wikitext_process_results",
    "winogrande_doc_to_choice",
    "winogrande_doc_to_target",
    "winogrande_doc_to_text",
)
