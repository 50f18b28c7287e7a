"""lm-eval integration: task validation, data checks, template rendering, and offline runs on stories260K."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import shared_path

import quantkit.data
from quantkit.eval import lmeval
from quantkit.eval.lmeval import (
    LM_EVAL_TASKS,
    EvalDataError,
    UnknownEvalTaskError,
    check_task_data,
    render_task_configs,
    run_lm_eval,
)
from quantkit.resources import data_path

ALL_TASKS = ["piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "wikitext_lm"]


def _needs_hf_backend() -> None:
    """Skip unless lm-eval's Hugging Face backend (lm-eval[hf]: accelerate, ...) imports."""
    try:
        import lm_eval.models.huggingface  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"lm-eval's HF backend does not import ({exc}); install quantkit[eval] / lm-eval[hf]")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any attempt to open a network connection fails the test, even one the code under test swallows."""
    attempts: list[tuple[object, ...]] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise OSError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield
    assert not attempts, f"network access attempted: {attempts}"


@pytest.fixture
def stories(stories260k: Path) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(stories260k)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def _synthetic_data(root: Path) -> Path:
    """Tiny files in each task's layout; ARC-Challenge in the original AI2 layout, to test its conversion."""
    _write_jsonl(
        root / "piqa/validation.jsonl",
        [
            {"goal": "Open a jar.", "sol1": "Twist the lid.", "sol2": "Eat the lid.", "label": 0},
            {"goal": "Dry wet hands.", "sol1": "Use a rock.", "sol2": "Use a towel.", "label": 1},
        ],
    )
    _write_jsonl(
        root / "arc/ARC-Easy-Test.jsonl",
        [
            {
                "id": "e1",
                "question": "What is wet?",
                "answerKey": "B",
                "choices": {"text": ["sand", "water", "fire"], "label": ["A", "B", "C"]},
            },
            {
                "id": "e2",
                "question": "What is hot?",
                "answerKey": "1",
                "choices": {"text": ["the sun", "ice"], "label": ["1", "2"]},
            },
        ],
    )
    _write_jsonl(
        root / "arc/ARC-Challenge-Test.jsonl",
        [
            {
                "id": "c1",
                "answerKey": "A",
                "question": {
                    "stem": "What flies?",
                    "choices": [{"text": "a bird", "label": "A"}, {"text": "a stone", "label": "B"}],
                },
            },
            {
                "id": "c2",
                "answerKey": "D",
                "question": {
                    "stem": "Which is a color?",
                    "choices": [
                        {"text": "dog", "label": "A"},
                        {"text": "run", "label": "B"},
                        {"text": "up", "label": "C"},
                        {"text": "red", "label": "D"},
                    ],
                },
            },
        ],
    )
    endings = ["goes home.", "eats the [title] moon.", "sleeps.", "sings a song."]
    _write_jsonl(
        root / "hellaswag/validation.jsonl",
        [
            {
                "ind": i,
                "activity_label": "Playing",
                "ctx_a": "A girl plays with a ball.",
                "ctx_b": "she",
                "ctx": "A girl plays with a ball. she",
                "endings": endings,
                "source_id": "x",
                "split": "val",
                "split_type": "indomain",
                "label": str(i),
            }
            for i in range(2)
        ],
    )
    _write_jsonl(
        root / "winogrande/validation.jsonl",
        [
            {
                "sentence": "Tom gave Ben a ball because _ was kind.",
                "option1": "Tom",
                "option2": "Ben",
                "answer": "1",
            },
            {
                "sentence": "The cup fell on the rug because _ was slippery.",
                "option1": "cup",
                "option2": "rug",
                "answer": "2",
            },
        ],
    )
    _write_jsonl(
        root / "wikitext-2-raw-v1/document_level_test.jsonl",
        [
            {"page": " = Lily = \n \n Lily was a little girl . She liked to play outside in the park . \n"},
            {"page": " = Tom = \n \n Tom had a big red ball @-@ it was fun , and he was happy . \n"},
        ],
    )
    return root


# ------------------------------------------------------------------------------------------ names & data


def test_task_table() -> None:
    assert list(LM_EVAL_TASKS) == ALL_TASKS
    lm_names = [info.lm_eval_name for info in LM_EVAL_TASKS.values()]
    assert len(set(lm_names)) == len(lm_names)
    assert all(name.startswith("quantkit_") for name in lm_names)
    for info in LM_EVAL_TASKS.values():
        template = (data_path("eval") / info.config).read_text(encoding="utf-8")
        assert f"task: {info.lm_eval_name}\n" in template
        for rel in info.data_files:
            assert f'"{{data_dir}}/{rel}"' in template  # the YAML and the table name the same file


def test_unknown_task_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(UnknownEvalTaskError) as err:
        run_lm_eval(torch.nn.Linear(1, 1), None, ["piqa", "mmlu"], data_dir=tmp_path)
    message = str(err.value)
    assert "'mmlu'" in message
    for name in ALL_TASKS:
        assert name in message
    with pytest.raises(UnknownEvalTaskError, match="wikitext_lm"):
        check_task_data(["wikitext"], tmp_path)
    with pytest.raises(UnknownEvalTaskError, match="no lm-eval tasks"):
        check_task_data([], tmp_path)


def test_missing_data_file_names_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lmeval.DATA_DIR_ENV, raising=False)
    _write_jsonl(tmp_path / "piqa/validation.jsonl", [])
    with pytest.raises(EvalDataError) as err:
        run_lm_eval(torch.nn.Linear(1, 1), None, ["piqa", "hellaswag", "arc_easy"], data_dir=tmp_path)
    message = str(err.value)
    assert str(tmp_path.resolve() / "hellaswag/validation.jsonl") in message
    assert str(tmp_path.resolve() / "arc/ARC-Easy-Test.jsonl") in message
    assert "task hellaswag" in message and "task arc_easy" in message
    assert "piqa" not in message  # present, so not reported
    assert "--data-dir DIR" in message and "QUANTKIT_DATA_DIR" in message


def test_no_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lmeval.DATA_DIR_ENV, raising=False)
    with pytest.raises(EvalDataError) as err:
        check_task_data(["piqa", "wikitext_lm"])
    message = str(err.value)
    assert "DIR/piqa/validation.jsonl" in message
    assert "DIR/wikitext-2-raw-v1/document_level_test.jsonl" in message
    assert "--data-dir DIR" in message and "QUANTKIT_DATA_DIR" in message


def test_data_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _synthetic_data(tmp_path)
    monkeypatch.setenv(lmeval.DATA_DIR_ENV, str(tmp_path))
    assert check_task_data(ALL_TASKS) == tmp_path.resolve()
    other = tmp_path / "elsewhere"
    with pytest.raises(EvalDataError, match="does not exist"):
        check_task_data(["piqa"], other)  # the argument wins over the environment


@pytest.mark.parametrize(("task", "file", "field", "value", "message"), [
    ("piqa", "piqa/validation.jsonl", "label", 2, "field 'label' is 2, not one of 0..1"),
    ("winogrande", "winogrande/validation.jsonl", "answer", "3", "field 'answer' is '3', not one of 1..2"),
    ("winogrande", "winogrande/validation.jsonl", "answer", "0", "field 'answer' is '0', not one of 1..2"),
    ("hellaswag", "hellaswag/validation.jsonl", "label", "4", "field 'label' is '4', not one of 0..3"),
])
def test_a_gold_index_just_past_the_choices_is_refused(tmp_path: Path, task, file, field, value, message) -> None:
    """A gold index one past the last choice (PIQA's label 2 of two solutions, WinoGrande's answer 3 or 0 of options
    1 and 2, HellaSwag's label 4 of four endings) is refused with its file and line before any model time: lm-eval
    would fail on it, or score the question against no answer."""
    root = _synthetic_data(tmp_path)
    path = root / file
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1][field] = value
    _write_jsonl(path, rows)
    with pytest.raises(EvalDataError, match=rf"validation\.jsonl, line 2: {message} \(task {task}\)"):
        check_task_data([task], root)


@pytest.mark.parametrize(("task", "file", "gold"), [("piqa", "piqa/validation.jsonl", "label"),
                                                   ("hellaswag", "hellaswag/validation.jsonl", "label"),
                                                   ("winogrande", "winogrande/validation.jsonl", "answer")])
def test_a_row_without_its_gold_field_is_refused(tmp_path: Path, task: str, file: str, gold: str) -> None:
    """A row that lacks the field holding its answer is named as such (file, line, the fields found), not left to a
    KeyError, nor to lm-eval once the model is loaded."""
    root = _synthetic_data(tmp_path)
    path = root / file
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    del rows[0][gold]
    _write_jsonl(path, rows)
    with pytest.raises(EvalDataError, match=rf"line 1: no field '{gold}'"):
        check_task_data([task], root)


def test_an_arc_answer_key_that_is_no_label_is_refused(tmp_path: Path) -> None:
    """An ARC answer key none of its choices' labels is refused with its line, in the HF layout and in the AI2
    original's: lm-eval's `choices.label.index(answerKey)` would fail on it after the model loaded."""
    root = _synthetic_data(tmp_path)
    for task, file in (("arc_easy", "arc/ARC-Easy-Test.jsonl"), ("arc_challenge", "arc/ARC-Challenge-Test.jsonl")):
        rows = [json.loads(line) for line in (root / file).read_text().splitlines()]
        rows[0]["answerKey"] = "E"
        _write_jsonl(root / file, rows)
        message = rf"line 1: answerKey 'E' is none of the labels \['A', 'B'.*\(task {task}\)"
        with pytest.raises(EvalDataError, match=message):
            check_task_data([task], root)


def _edit_row(root: Path, file: str, change) -> None:
    """Apply `change` to the first row of task data file `file`."""
    rows = [json.loads(line) for line in (root / file).read_text().splitlines()]
    change(rows[0])
    _write_jsonl(root / file, rows)


@pytest.mark.parametrize(("task", "file", "change", "message"), [
    ("winogrande", "winogrande/validation.jsonl", lambda r: r.update(sentence=r["sentence"].replace("_", "it")),
     "field 'sentence' has no blank '_' for the options to fill"),
    ("arc_easy", "arc/ARC-Easy-Test.jsonl", lambda r: r["choices"]["text"].pop(),
     "field 'choices' does not hold lists 'text' and 'label' of one length"),
    ("arc_easy", "arc/ARC-Easy-Test.jsonl", lambda r: r["choices"].update(text=[1, 2, 3]),
     "a choice's text or label is not text"),
    ("arc_challenge", "arc/ARC-Challenge-Test.jsonl", lambda r: r["question"].pop("stem"),
     "the question object's 'stem' is missing or not text"),
    ("arc_challenge", "arc/ARC-Challenge-Test.jsonl", lambda r: r["question"]["choices"][1].pop("text"),
     "a choice's text or label is not text"),
    ("arc_challenge", "arc/ARC-Challenge-Test.jsonl", lambda r: r["question"].update(choices="A or B"),
     "the question object's 'choices' is not a list of {text, label} objects"),
])
def test_rows_lm_eval_would_fail_on_are_refused(tmp_path: Path, task, file, change, message) -> None:
    """Rows whose fields are all there but which lm-eval's task code would fail on once the model is loaded (a
    WinoGrande sentence without the blank it splits at, ARC choices whose texts and labels do not pair up, an AI2
    question without its stem or a choice without its text) are refused with their line before any model time."""
    root = _synthetic_data(tmp_path)
    _edit_row(root, file, change)
    with pytest.raises(EvalDataError, match=re.escape(f"line 1: {message} (task {task})")):
        check_task_data([task], root)


def test_every_tasks_data_problem_is_named_at_once(tmp_path: Path) -> None:
    """Bad rows in several tasks' files are all named in one error, each with its file and line, so that one run
    finds every file to mend rather than one per run."""
    root = _synthetic_data(tmp_path)
    _edit_row(root, "piqa/validation.jsonl", lambda r: r.update(label=7))
    _edit_row(root, "winogrande/validation.jsonl", lambda r: r.update(sentence="no blank"))
    (root / "hellaswag/validation.jsonl").write_text("{not json\n")
    with pytest.raises(EvalDataError) as info:
        check_task_data(ALL_TASKS, root)
    text = str(info.value)
    assert text.startswith("lm-eval data that the tasks cannot read:"), text
    for match in ("piqa/validation.jsonl, line 1: field 'label' is 7, not one of 0..1 (task piqa)",
                  "hellaswag/validation.jsonl, line 1: not a JSON object per line",
                  "winogrande/validation.jsonl, line 1: field 'sentence' has no blank '_'"):
        assert match in text, text


# ------------------------------------------------------------------------------------------ rendering


def test_render_from_installed_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Templates are found as package data `quantkit.data.eval` (wheel layout), and the rendered configs load
    in lm-eval with their `!function` helpers resolved from the rendered directory; paths with quotes,
    spaces and backslashes survive the YAML round trip."""
    load_yaml = pytest.importorskip("lm_eval.tasks._yaml_loader").load_yaml

    site = tmp_path / "site" / "quantkit" / "data"
    shutil.copytree(data_path("eval"), site / "eval")
    for yaml_file in (site / "eval").glob("*.yaml"):
        yaml_file.write_text("# installed copy\n" + yaml_file.read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(quantkit.data, "__path__", [str(site), *quantkit.data.__path__])
    assert data_path("eval") == site / "eval"

    data_dir = tmp_path / 'odd "dir" \\ with spaces'
    out = tmp_path / "rendered"
    written = render_task_configs(ALL_TASKS, data_dir, out, cache_dir=tmp_path / "cache")
    assert [p.name for p in written] == [LM_EVAL_TASKS[t].config for t in ALL_TASKS]
    assert (out / "quantkit_task_utils.py").is_file()
    for task, path in zip(ALL_TASKS, written, strict=True):
        text = path.read_text(encoding="utf-8")
        assert text.startswith("# installed copy")
        assert "{data_dir}" not in text and "{cache_dir}" not in text
        cfg = load_yaml(path, resolve_func=True)
        info = LM_EVAL_TASKS[task]
        assert cfg["task"] == info.lm_eval_name
        assert cfg["dataset_path"] == "json"
        (split_path,) = cfg["dataset_kwargs"]["data_files"].values()
        assert split_path == str(data_dir.resolve() / info.data_files[0])
        assert cfg["dataset_kwargs"]["cache_dir"] == str((tmp_path / "cache").resolve())
        functions = [v for v in cfg.values() if callable(v)]
        if task in ("arc_easy", "arc_challenge", "hellaswag", "winogrande", "wikitext_lm"):
            assert functions and all(f.__module__ == "quantkit.eval.lmeval" for f in functions)


def _lm_eval_task_module(relative: str):
    """Load one of lm-eval's own task helper files by path (they are not importable as a package)."""
    import lm_eval

    path = Path(lm_eval.__file__).parent / "tasks" / relative
    if not path.is_file():
        pytest.skip(f"this lm-eval has no {relative}")
    spec = importlib.util.spec_from_file_location(f"_lm_eval_ref_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_data_path_names_only_its_folders_and_says_when_one_is_missing(tmp_path: Path, monkeypatch) -> None:
    """`data_path` serves the four bundled folders only: another name (even one beside them in a checkout, such
    as tests) is a ValueError, not a path into the source tree; and an installation where a folder is neither
    package data nor in a checkout is a FileNotFoundError naming it, not a path that does not exist."""
    import quantkit.resources

    with pytest.raises(ValueError, match="unknown data folder 'tests'"):
        data_path("tests")
    monkeypatch.setattr(quantkit.data, "__path__", [str(tmp_path / "site")])
    monkeypatch.setattr(quantkit.resources, "__file__", str(tmp_path / "bare" / "quantkit" / "resources.py"))
    with pytest.raises(FileNotFoundError, match="quantkit data folder 'eval' is missing from this installation"):
        data_path("eval")


def test_helpers_match_lm_eval(shared_data: Path) -> None:
    """The ported `!function` helpers give exactly what lm-eval's built-in tasks compute."""
    wiki = _lm_eval_task_module("wikitext/preprocess_wikitext.py")
    pages = [
        json.loads(line) for line in (shared_data / "wikitext-2-raw-v1/document_level_test.jsonl").open()
    ]
    for doc in pages:
        assert lmeval.wikitext_detokenizer(doc) == wiki.wikitext_detokenizer(doc)
        assert lmeval.wikitext_process_results(doc, [-123.0]) == wiki.process_results(doc, [-123.0])

    hella = _lm_eval_task_module("hellaswag/utils.py")
    for text in ("A man [title] is on a roof. [step] He  hammers.", "  plain text  "):
        assert lmeval.hellaswag_preprocess(text) == hella.preprocess(text)

    wino = _lm_eval_task_module("winogrande/preprocess_winogrande.py")
    doc = {
        "sentence": "Tom gave Ben a ball because _ was kind.",
        "option1": "Tom",
        "option2": "Ben",
        "answer": "2",
    }
    assert lmeval.winogrande_doc_to_text(doc) == wino.doc_to_text(doc) == 1
    assert lmeval.winogrande_doc_to_target(doc) == wino.doc_to_target(doc)
    assert lmeval.winogrande_doc_to_choice(doc) == wino.doc_to_choice(doc)


# lm-eval's own config of each task, which quantkit's template mirrors (reading local files instead of the Hub)
LM_EVAL_CONFIGS = {
    "piqa": "piqa/piqa.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "winogrande": "winogrande/default.yaml",
    "wikitext_lm": "wikitext/wikitext.yaml",
}


@pytest.mark.parametrize("task", ALL_TASKS)
def test_configs_score_as_lm_evals_own(task: str, tmp_path: Path) -> None:
    """Each rendered config asks lm-eval for what its built-in task does: the same output type, prompt, target,
    choices and metrics (acc and acc_norm where lm-eval reports both), and helpers of the same names where lm-eval
    calls its own; only the data source (and ARC's layout conversion) may differ."""
    load_yaml = pytest.importorskip("lm_eval.tasks._yaml_loader").load_yaml
    import lm_eval

    reference = Path(lm_eval.__file__).parent / "tasks" / LM_EVAL_CONFIGS[task]
    if not reference.is_file():
        pytest.skip(f"this lm-eval has no {reference}")
    theirs = load_yaml(reference, resolve_func=False)
    (ours_path,) = render_task_configs([task], tmp_path / "data", tmp_path / "out")
    ours = load_yaml(ours_path, resolve_func=False)
    for key in ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "process_docs", "process_results",
                "should_decontaminate", "doc_to_decontamination_query", "target_delimiter", "num_fewshot"):
        if key not in theirs:
            assert key not in ours or (key == "process_docs" and task.startswith("arc")), key
        elif str(theirs[key]).startswith(str(reference.parent)):  # a !function: ours is a helper of that name
            assert str(ours[key]).startswith(str(tmp_path / "out" / "quantkit_task_utils.")), key
            assert str(ours[key]).endswith(str(theirs[key]).rsplit(".", 1)[1]), key
        else:
            assert ours.get(key) == theirs[key], key
    assert [m["metric"] for m in ours["metric_list"]] == [m["metric"] for m in theirs["metric_list"]]
    for mine, their in zip(ours["metric_list"], theirs["metric_list"], strict=True):
        assert {k: mine.get(k) for k in their} == their
    assert tuple(m["metric"] for m in ours["metric_list"]) == LM_EVAL_TASKS[task].metrics


def test_hellaswag_and_arc_documents_as_lm_eval_builds_them() -> None:
    """HellaSwag's query, choices and gold are those of lm-eval's own process_docs (activity label, ctx_b
    capitalized, bracket artifacts removed); an AI2-layout ARC row becomes the HF layout, choices in order."""
    datasets = pytest.importorskip("datasets")
    hella = _lm_eval_task_module("hellaswag/utils.py")
    rows = [{"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
             "endings": ["is using wrap to wrap a pair of skis.", "starts pulling up roofing [title] on a roof."],
             "label": "1"},
            {"activity_label": "Clean", "ctx_a": "A woman  mops.", "ctx_b": "then she", "endings": ["a", "b"],
             "label": "0"}]
    ours = lmeval.hellaswag_process_docs(datasets.Dataset.from_list(rows))
    theirs = hella.process_docs(datasets.Dataset.from_list(rows))
    assert ours.to_list() == theirs.to_list()
    assert ours[0]["query"] == "Roof shingle removal: A man is sitting on a roof. He" and ours[0]["gold"] == 1

    ai2 = [{"id": "c1", "answerKey": "B", "question": {"stem": "What flies?", "choices": [
        {"text": "a stone", "label": "A"}, {"text": "a bird", "label": "B"}, {"text": "a fish", "label": "C"}]}}]
    converted = lmeval.arc_process_docs(datasets.Dataset.from_list(ai2)).to_list()
    assert converted == [{"id": "c1", "answerKey": "B", "question": "What flies?",
                          "choices": {"text": ["a stone", "a bird", "a fish"], "label": ["A", "B", "C"]}}]
    hf = datasets.Dataset.from_list(converted)
    assert lmeval.arc_process_docs(hf).to_list() == converted  # the HF layout passes unchanged


def test_metrics_are_read_by_name_with_their_stderr() -> None:
    """lm-eval's result keys `metric,filter` become `metric` for the "none" filter (acc and acc_norm apart, each
    with its stderr); other filters, aliases and "N/A" stderrs are dropped; sample_len is kept."""
    result = {"alias": "quantkit_piqa", "acc,none": 0.625, "acc_stderr,none": 0.125, "acc_norm,none": 0.75,
              "acc_norm_stderr,none": "N/A", "acc,strict": 0.1, "sample_len": 8}
    assert lmeval._metrics(result) == {"acc": 0.625, "acc_stderr": 0.125, "acc_norm": 0.75, "sample_len": 8.0}


# ------------------------------------------------------------------------------------------ real runs


def test_piqa_stories260k(stories, no_network: None) -> None:
    _needs_hf_backend()
    model, tokenizer = stories
    model.train()
    result = run_lm_eval(model, tokenizer, ["piqa"], data_dir=shared_path("data"), limit=20, max_length=1024)
    assert set(result) == {"piqa"}
    piqa = result["piqa"]
    assert 0.0 <= piqa["acc"] <= 1.0 and 0.0 <= piqa["acc_norm"] <= 1.0
    assert piqa["acc_stderr"] > 0
    assert piqa["sample_len"] == 20
    assert model.training  # train/eval state restored


def test_wikitext_lm_stories260k(stories, no_network: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_hf_backend()
    model, tokenizer = stories
    monkeypatch.setenv(lmeval.DATA_DIR_ENV, str(shared_path("data")))
    result = run_lm_eval(model, tokenizer, ["wikitext_lm"], limit=2)
    metrics = result["wikitext_lm"]
    assert metrics["word_perplexity"] > 1
    assert metrics["byte_perplexity"] > 1
    assert metrics["bits_per_byte"] > 0


def test_no_git_probe_or_launch_advice_on_the_terminal(stories, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capfd, caplog) -> None:
    """Run from a directory outside any git repository, lm-eval's `git describe` of the working directory would
    print "fatal: not a git repository" into the user's terminal, and HFLM warns against accelerate launches for
    any in-memory model: quantkit's run keeps both quiet, and lm-eval's own probe and logger are back afterwards."""
    _needs_hf_backend()
    import logging

    import lm_eval.evaluator

    model, tokenizer = stories
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.chdir(outside)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above it either
    probe = lm_eval.evaluator.get_git_commit_hash
    logger = logging.getLogger("lm_eval.models.huggingface")
    filters = list(logger.filters)
    caplog.set_level(logging.WARNING)
    run_lm_eval(model, tokenizer, ["piqa"], data_dir=_synthetic_data(tmp_path), limit=1)
    assert "not a git repository" not in capfd.readouterr().err
    warned = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert not any("accelerate" in m or "already-initialized" in m for m in warned), warned
    assert lm_eval.evaluator.get_git_commit_hash is probe and logger.filters == filters
    logger.warning("Passed an already-initialized model through `pretrained`")  # lm-eval's logger as it was
    assert caplog.records[-1].getMessage().startswith("Passed an already-initialized")


def test_eval_cli_counts_documents(stories260k: Path, tmp_path: Path) -> None:
    """`quantkit eval`'s table gives lm-eval's sample_len as the count of documents scored, not as a score."""
    _needs_hf_backend()
    from helpers import cli_ok

    result = cli_ok("eval", stories260k, "--tasks", "piqa", "--data-dir", _synthetic_data(tmp_path), "--limit", "2")
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in result.output.splitlines() if "│" in line]
    assert ["piqa", "documents", "2"] in rows and not any("sample_len" in row for row in rows)
    payload = json.loads([line for line in result.output.splitlines() if line.strip()][-1])
    assert payload["results"]["piqa"]["sample_len"] == 2  # the JSON keeps lm-eval's name


def test_model_used_as_is(stories, shared_data: Path) -> None:
    """Hooks run, and an untied (e.g. separately quantized) lm_head is not re-tied to the embedding."""
    _needs_hf_backend()
    model, tokenizer = stories
    head = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 0.5)
    model.lm_head.weight = head
    calls = []
    handle = model.lm_head.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        run_lm_eval(model, tokenizer, ["piqa"], data_dir=shared_data, limit=2, max_length=1024)
    finally:
        handle.remove()
    assert calls
    assert model.lm_head.weight is head
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert "tie_weights" not in vars(model)  # the temporary no-op is gone


def test_options_and_offline_mode_reach_lm_eval(stories, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_lm_eval hands lm-eval its tasks, limit, batch size and max_length (the model's max_position_embeddings
    when not given), with the Hub and datasets offline for the call and the environment as it was afterwards
    (lm-eval's evaluation itself replaced by a recorder)."""
    _needs_hf_backend()
    import huggingface_hub.constants
    import lm_eval

    model, tokenizer = stories
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    calls = []

    def record(model, tasks, limit, **kwargs):
        calls.append({"tasks": tasks, "limit": limit, "batch_size": model.batch_size, "max_length": model.max_length,
                      "env": [os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")],
                      "hub_offline": huggingface_hub.constants.HF_HUB_OFFLINE})
        return {"results": {"quantkit_piqa": {"acc,none": 0.5}}}

    monkeypatch.setattr(lm_eval, "simple_evaluate", record)
    data = _synthetic_data(tmp_path)
    assert run_lm_eval(model, tokenizer, ["piqa"], data_dir=data, limit=3, batch_size=2, max_length=1024) == {
        "piqa": {"acc": 0.5}}
    run_lm_eval(model, tokenizer, ["piqa"], data_dir=data)
    default = model.config.max_position_embeddings
    assert calls == [
        {"tasks": ["quantkit_piqa"], "limit": 3, "batch_size": 2, "max_length": 1024, "env": ["1", "1"],
         "hub_offline": True},
        {"tasks": ["quantkit_piqa"], "limit": None, "batch_size": 1, "max_length": default, "env": ["1", "1"],
         "hub_offline": True},
    ]
    assert "HF_HUB_OFFLINE" not in os.environ and "HF_DATASETS_OFFLINE" not in os.environ


def test_all_tasks_synthetic(stories, tmp_path: Path, no_network: None) -> None:
    """Every config loads its local layout (ARC-Challenge in the original AI2 layout) and scores."""
    _needs_hf_backend()
    model, tokenizer = stories
    result = run_lm_eval(
        model, tokenizer, ALL_TASKS, data_dir=_synthetic_data(tmp_path), limit=2, batch_size=2
    )
    assert list(result) == ALL_TASKS
    for name in ALL_TASKS:
        for metric in LM_EVAL_TASKS[name].metrics:
            assert metric in result[name], (name, metric)
        if name != "wikitext_lm":
            assert result[name]["acc"] in (0.0, 0.5, 1.0)
        assert result[name]["sample_len"] == 2
    assert result["wikitext_lm"]["word_perplexity"] > 1


def test_every_reader_finds_the_data_dir_alike(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Calibration, WikiText and the lm-eval tasks look their files up in one data dir, by one rule: "~" expanded,
    an empty value unset (WikiText's lookup had kept a literal "~", so one eval found PIQA's files and missed
    WikiText's)."""
    from quantkit.eval.perplexity import wikitext_file

    home = tmp_path / "home"
    (home / "data" / "wikitext-2-raw-v1").mkdir(parents=True)
    rows = home / "data" / "wikitext-2-raw-v1" / "test.jsonl"
    rows.write_text('{"text": "a"}\n')
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv(lmeval.DATA_DIR_ENV, "~/data")
    assert lmeval.resolve_data_dir() == lmeval.resolve_data_dir("") == home / "data"
    assert wikitext_file(None) == wikitext_file("") == rows
    monkeypatch.delenv(lmeval.DATA_DIR_ENV)
    assert lmeval.resolve_data_dir("") is None and lmeval.resolve_data_dir("~/data") == home / "data"
