"""The accuracy benchmarks' harness (bench/_common.py): what a user asks of it is what it measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def report(script: str, *args: str) -> subprocess.CompletedProcess:
    """bench/SCRIPT --report (the tables from the ledger alone: no model, no data) with `args`."""
    return subprocess.run([sys.executable, str(BENCH / script), "--report", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(BENCH.parent)}, timeout=120)


def test_only_takes_every_label_given_and_refuses_one_no_row_has():
    """--only repeated adds rows (it had kept the last one alone, so a run measured half of what was asked); a label
    no row has, a typo, is refused with the script's rows, where it measured only the FP16 reference, silently."""
    both = report("w4a8.py", "--only", "RTN W4A8 (per channel)", "--only", "QoQ W4A8 (per channel)")
    assert both.returncode == 0, both.stderr
    rows = [line.split("|")[1].strip() for line in both.stdout.splitlines() if line.startswith("| ")][1:]
    assert rows == ["FP16", "RTN W4A8 (per channel)", "QoQ W4A8 (per channel)"]
    typo = report("w4a8.py", "--only", "QoQ W4A8 (per chanel)")
    assert typo.returncode == 2 and "no row is labelled 'QoQ W4A8 (per chanel)'" in typo.stderr
    assert "'LiquidQuant (g64)'" in typo.stderr
    for script, label in [("ablation_qoq.py", "+ reorder"), ("atom_anyprec.py", "SqueezeLLM 5-bit"),
                          ("accuracy.py", "GPTQ (static act-order)")]:
        done = report(script, "--only", label)
        assert done.returncode == 0 and label in done.stdout, done.stderr


def test_remeasure_all_quantizes_again_but_once_a_run(tmp_path, monkeypatch):
    """A finished artifact of the same command and code serves its recorded wall time, except where the ledger
    measures anew (--remeasure all): that had compared a fresh llm-compressor time with quantkit's of hours before.
    An artifact this process quantized serves the rows that share it either way."""
    monkeypatch.syspath_prepend(str(BENCH))
    import _common

    calls = []

    def fake_quantkit(*args: str) -> float:
        out = Path(args[args.index("-o") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "quantkit_manifest.json").write_text("{}")
        calls.append(args)
        return 10.0 * len(calls)

    monkeypatch.setattr(_common, "quantkit", fake_quantkit)
    monkeypatch.setattr(_common, "_QUANTIZED_NOW", set())
    model, out = tmp_path / "model.gguf", tmp_path / "work" / "row"
    assert _common.quantize_cached(model, out, "--recipe", "qqq") == 10.0
    monkeypatch.setattr(_common, "_QUANTIZED_NOW", set())  # a later run of the bench
    assert _common.quantize_cached(model, out, "--recipe", "qqq") == 10.0 and len(calls) == 1  # reused
    assert _common.quantize_cached(model, out, "--recipe", "qqq", reuse=False) == 20.0 and len(calls) == 2
    assert _common.quantize_cached(model, out, "--recipe", "qqq", reuse=False) == 20.0 and len(calls) == 2


def test_perplexity_is_reused_only_for_the_same_command_code_and_model(tmp_path, monkeypatch):
    """eval_ppl reuses a row's eval JSON only where the same command and quantkit code wrote it after the model was
    last written. It had reused any JSON newer than the model's quantkit manifest, and any JSON at all where there
    is none: the FP16 GGUF's and llm-compressor's, whose perplexity then outlived a change of the eval code or a
    fresh llm-compressor run."""
    monkeypatch.syspath_prepend(str(BENCH))
    import _common

    calls = []

    def fake_quantkit(*args: str) -> float:
        calls.append(args)
        out = Path(args[args.index("--output-json") + 1])
        out.write_text(json.dumps({"results": {"wikitext": {"perplexity": float(len(calls))}}}))
        return 1.0

    monkeypatch.setattr(_common, "quantkit", fake_quantkit)
    monkeypatch.setattr(_common, "_code_digest", lambda: "code-a")
    model, result = tmp_path / "model.gguf", tmp_path / "FP16.json"
    model.write_bytes(b"weights")
    os.utime(model, (1_000_000, 1_000_000))

    def ppl(*extra: str) -> float:
        return _common.eval_ppl(model, tmp_path, 40, 2048, result, *extra)

    assert ppl() == 1.0 and ppl() == 1.0 and len(calls) == 1  # reused
    assert ppl("--bits", "3") == 2.0  # another command
    assert ppl("--bits", "3") == 2.0 and len(calls) == 2
    monkeypatch.setattr(_common, "_code_digest", lambda: "code-b")  # the eval code changed
    assert ppl("--bits", "3") == 3.0
    os.utime(result, (999_000, 999_000))  # the model written again after the JSON
    assert ppl("--bits", "3") == 4.0 and ppl("--bits", "3") == 4.0 and len(calls) == 4
    folder = tmp_path / "llmcompressor-out"  # a model folder without a manifest: its newest file counts
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"w")
    os.utime(folder / "model.safetensors", (1_000_000, 1_000_000))
    assert _common.eval_ppl(folder, tmp_path, 40, 2048, tmp_path / "lc.json") == 5.0
    assert _common.eval_ppl(folder, tmp_path, 40, 2048, tmp_path / "lc.json") == 5.0
    os.utime(tmp_path / "lc.json", (999_000, 999_000))  # llm-compressor ran again after the JSON
    assert _common.eval_ppl(folder, tmp_path, 40, 2048, tmp_path / "lc.json") == 6.0
