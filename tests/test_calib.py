"""Calibration data: file formats, named sets, deterministic sampling, errors, and self-generated text."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import shutil
import struct
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import shared_path

from quantkit.calib import (
    CalibrationError,
    CalibrationSet,
    generate_calibration,
    iter_documents,
    load_calibration,
    load_named_set,
    named_sets,
    resolve_named_set,
    sample_windows,
    token_sha256,
)
from quantkit.errors import QuantkitError

DOCS = [
    "Once upon a time there was a little cat named Tom.",
    "Tom liked to play in the garden with his ball.",
    "",  # an empty row: kept verbatim by .jsonl/.parquet, like the HF wikitext rows
    "One day the sun was hot and Tom went to sleep under a big tree.",
    "When he woke up, his friend the dog was there, and they played all day.",
] * 4


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shared_path("models/stories260K"))


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(shared_path("models/stories260K"), dtype=torch.float32)


def encode(tokenizer, docs: list[str]) -> list[int]:
    return tokenizer("\n\n".join(docs), add_special_tokens=False)["input_ids"]


def first_windows(ids: list[int], n: int, seq_len: int) -> torch.Tensor:
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    lines = [json.dumps({field: doc, "id": i}) + "\n" for i, doc in enumerate(docs)]
    path.write_text("".join(lines), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ files


def test_txt_is_one_document_per_line_and_first_matches_manual(tmp_path, tokenizer):
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(DOCS) + "\n\n   \n", encoding="utf-8")  # blank / whitespace-only lines skipped
    docs = [d for d in DOCS if d]
    assert list(iter_documents(path)) == docs
    cal = load_calibration(path, tokenizer, num_samples=3, seq_len=16, sampling="first")
    assert isinstance(cal, CalibrationSet)
    assert cal.tokens.dtype == torch.long and cal.tokens.shape == (3, 16)
    assert torch.equal(cal.tokens, first_windows(encode(tokenizer, docs), 3, 16))
    assert cal.source == str(path.resolve()) and cal.sampling == "first" and cal.seed == 0
    assert cal.tokens[0, 0] != tokenizer.bos_token_id  # no BOS prepended to the stream


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet"])
def test_jsonl_and_parquet_with_configurable_field(tmp_path, tokenizer, fmt):
    path = tmp_path / f"docs.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.table({"id": list(range(len(DOCS))), "story": DOCS}), path)
    elif fmt == "jsonl.gz":
        write_jsonl(tmp_path / "plain.jsonl", DOCS, field="story")
        path.write_bytes(gzip.compress((tmp_path / "plain.jsonl").read_bytes()))
    else:
        write_jsonl(path, DOCS, field="story")
    assert list(iter_documents(path, "story")) == DOCS  # empty rows kept verbatim
    cal = load_calibration(path, tokenizer, num_samples=4, seq_len=20, sampling="first", text_field="story")
    assert torch.equal(cal.tokens, first_windows(encode(tokenizer, DOCS), 4, 20))


def test_json_file_of_one_array_or_of_lines(tmp_path):
    """A .json file holds JSON lines or one array of objects (pretty-printed or not); both give the rows verbatim."""
    rows = [{"text": doc, "id": i} for i, doc in enumerate(DOCS)] + [{"text": None}]  # a null is skipped
    for name, text in [("lines.json", "".join(json.dumps(row) + "\n" for row in rows)),
                       ("array.json", "\n" + json.dumps(rows, indent=2)),
                       ("flat.json", json.dumps(rows))]:
        (tmp_path / name).write_text(text, encoding="utf-8")
        assert list(iter_documents(tmp_path / name)) == DOCS, name
    (tmp_path / "array.json.gz").write_bytes(gzip.compress((tmp_path / "array.json").read_bytes()))
    assert list(iter_documents(tmp_path / "array.json.gz")) == DOCS


@pytest.mark.parametrize(("name", "text", "match"), [
    ("cut.json", '[{"text": "a"},', r"cut\.json opens a JSON array that does not parse"),
    ("mixed.json", '[{"text": "a"}, "b"]', r"mixed\.json, array element 1: no field 'text' \(found str\)"),
    ("field.json", '[{"story": "a"}]', r"array element 0: no field 'text' \(found 'story'\); choose the field"),
    ("number.json", '[{"text": 5}]', r"number\.json, array element 0: field 'text' is int, not text"),
    ("array.jsonl", '[\n{"text": "a"}\n]', r"line 1: not a JSON object per line \(a JSON array\? convert it"),
    ("flat.jsonl", '[{"text": "a"}]', r"line 1: a JSON array, not one object per line; convert it to JSON lines"),
    ("pretty.jsonl", '{\n  "text": "a"\n}', r"line 1: not a JSON object per line \(a pretty-printed JSON object\?"),
    ("text.jsonl", 'just words', r"line 1: not a JSON object per line: Expecting value"),
])
def test_json_that_is_not_rows_names_what_it_is(tmp_path, name, text, match):
    """Each way a JSON file can fail to hold rows gets its own message (the array hint only for an array)."""
    (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(CalibrationError, match=match):
        list(iter_documents(tmp_path / name))


def test_missing_field_names_the_fields_found(tmp_path, tokenizer):
    jsonl = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    with pytest.raises(CalibrationError, match=r"line 1: no field 'story' \(found 'text', 'id'\)"):
        load_calibration(jsonl, tokenizer, num_samples=1, seq_len=8, text_field="story")
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS}), parquet)
    with pytest.raises(CalibrationError, match=r"no column 'story' \(columns: text\)"):
        load_calibration(parquet, tokenizer, num_samples=1, seq_len=8, text_field="story")


def test_unsupported_and_missing_files(tmp_path):
    """Refused by name before any read or tokenization: no tokenizer needed."""
    csv = tmp_path / "docs.csv"
    csv.write_text("a,b\n")
    with pytest.raises(CalibrationError, match="unsupported calibration file type"):
        load_calibration(csv, None, num_samples=1, seq_len=8)
    with pytest.raises(CalibrationError, match="does not exist"):
        load_calibration(tmp_path / "nope.jsonl", None, num_samples=1, seq_len=8)


# ------------------------------------------------------------------------------------------------ sampling


def test_random_sampling_is_deterministic_in_the_seed(tinystories_txt, tokenizer):
    kwargs = dict(num_samples=4, seq_len=64, sampling="random")
    a = load_calibration(tinystories_txt, tokenizer, seed=0, **kwargs)
    b = load_calibration(tinystories_txt, tokenizer, seed=0, **kwargs)
    c = load_calibration(tinystories_txt, tokenizer, seed=1, **kwargs)
    assert torch.equal(a.tokens, b.tokens) and a.sha256 == b.sha256
    assert not torch.equal(a.tokens, c.tokens) and a.sha256 != c.sha256
    assert a.sha256 == token_sha256(a.tokens) and (a.sampling, a.seed, c.seed) == ("random", 0, 1)
    # every window is a contiguous slice of the "\n\n"-joined stream
    docs = [line for line in tinystories_txt.read_text(encoding="utf-8").splitlines() if line.strip()]
    stream = encode(tokenizer, docs)
    starts = {tuple(stream[i: i + 64]) for i in range(len(stream) - 63)}
    assert all(tuple(row.tolist()) in starts for row in a.tokens)


def test_random_windows_are_the_seeded_draws_over_the_whole_stream(tmp_path, tokenizer):
    """GPTQ-style draws worked out by hand: `random.Random(seed)` draws each start uniformly in
    [0, len(stream) - seq_len] of the whole "\n\n"-joined stream (shorter than 4x the request, so all of it is the
    pool), window i from draw i; another seed, other windows."""
    docs = [d for d in DOCS if d]
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    stream = encode(tokenizer, docs)
    num_samples, seq_len = 3, 48
    assert num_samples * seq_len < len(stream) < 4 * num_samples * seq_len  # else the reference would not hold
    for seed in (0, 7):
        rng = random.Random(seed)
        starts = [rng.randrange(len(stream) - seq_len + 1) for _ in range(num_samples)]
        expected = torch.tensor([stream[s: s + seq_len] for s in starts])
        cal = load_calibration(path, tokenizer, num_samples=num_samples, seq_len=seq_len, seed=seed)
        assert torch.equal(cal.tokens, expected), seed


def test_a_stream_of_exactly_the_windows_needed_is_enough():
    """Boundaries: a stream of exactly seq_len tokens is one window (its only start is 0: every random draw takes
    it), and exactly num_samples x seq_len tokens give num_samples "first" windows."""
    ids = list(range(20))
    with pytest.warns(UserWarning, match="necessarily overlap"):
        random_windows = sample_windows(ids[:10], num_samples=3, seq_len=10, seed=0, sampling="random")
    assert random_windows.tolist() == [ids[:10]] * 3
    assert sample_windows(ids, num_samples=2, seq_len=10, seed=0, sampling="first").tolist() == [ids[:10], ids[10:]]
    with pytest.raises(CalibrationError, match="9 tokens found"):
        sample_windows(ids[:9], num_samples=1, seq_len=10, seed=0, sampling="random")


def test_txt_lines_keep_their_spaces(tmp_path):
    """A .txt line is a document verbatim: only its line end goes (spaces at either end are text, as WikiText's
    leading space is)."""
    path = tmp_path / "spaced.txt"
    path.write_bytes(b" = Heading = \r\n\tindented line  \nplain\n")
    assert list(iter_documents(path)) == [" = Heading = ", "\tindented line  ", "plain"]


def test_parquet_nulls_are_skipped(tmp_path):
    """A null in a parquet text column is no document; the rows around it are kept, an empty string included."""
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", None, "", "b"]}), path)
    assert list(iter_documents(path)) == ["a", "", "b"]


def test_zero_samples_or_length_is_refused(tmp_path):
    """num_samples and seq_len must be positive, for the API as for the CLI (whose options refuse 0 themselves),
    before any text is read or tokenized (no tokenizer is needed to be refused)."""
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    for num_samples, seq_len in ((0, 8), (1, 0)):
        for sampling in ("first", "random"):
            with pytest.raises(CalibrationError, match="must be positive"):
                load_calibration(path, None, num_samples=num_samples, seq_len=seq_len, sampling=sampling)


def test_first_mode_on_shared_tinystories_matches_manual(tinystories_txt, tokenizer):
    docs = tinystories_txt.read_text(encoding="utf-8").splitlines()
    cal = load_calibration(tinystories_txt, tokenizer, num_samples=7, seq_len=128, sampling="first", seed=5)
    assert torch.equal(cal.tokens, first_windows(encode(tokenizer, docs), 7, 128))
    again = load_calibration(tinystories_txt, tokenizer, num_samples=7, seq_len=128, sampling="first", seed=6)
    assert again.sha256 == cal.sha256  # "first" ignores the seed


def test_sha256_is_shape_plus_int64_le_bytes():
    tokens = torch.arange(6, dtype=torch.int32).view(2, 3)
    expected = hashlib.sha256(struct.pack("<qq", 2, 3) + struct.pack("<6q", *range(6))).hexdigest()
    assert token_sha256(tokens) == expected
    assert token_sha256(tokens.view(3, 2)) != expected


# ------------------------------------------------------------------------------------------------ errors


def test_empty_files_raise(tmp_path, tokenizer):
    txt = tmp_path / "empty.txt"
    txt.write_text("\n  \n\n", encoding="utf-8")
    with pytest.raises(CalibrationError, match=r"empty\.txt is empty"):
        load_calibration(txt, tokenizer, num_samples=1, seq_len=8)
    jsonl = write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(CalibrationError, match=r"blank\.jsonl is empty: it holds no text in field 'text'"):
        load_calibration(jsonl, tokenizer, num_samples=1, seq_len=8)
    assert issubclass(CalibrationError, QuantkitError)


def test_too_short_names_file_found_and_needed(tmp_path, tokenizer):
    path = tmp_path / "short.txt"
    path.write_text("A tiny story.\n", encoding="utf-8")
    found = len(encode(tokenizer, ["A tiny story."]))
    for sampling in ("first", "random"):
        with pytest.raises(CalibrationError) as info:
            load_calibration(path, tokenizer, num_samples=2, seq_len=512, sampling=sampling)
        message = str(info.value)
        assert "short.txt" in message and f"{found} tokens found" in message and "needs 512 tokens" in message


def test_first_with_too_few_windows_says_how_many(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    total = len(encode(tokenizer, DOCS))
    expected = rf"{total} tokens: {total // 100} non-overlapping windows of 100, fewer than the 50 requested"
    with pytest.raises(CalibrationError, match=expected):
        load_calibration(path, tokenizer, num_samples=50, seq_len=100, sampling="first")


def test_random_with_fewer_tokens_than_requested_warns(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    with pytest.warns(UserWarning, match="necessarily overlap"):
        cal = load_calibration(path, tokenizer, num_samples=50, seq_len=100)
    assert cal.tokens.shape == (50, 100)


def test_bad_request_and_no_source():
    with pytest.raises(CalibrationError, match="unknown sampling 'shuffle'"):
        load_calibration("c4", None, num_samples=1, seq_len=8, sampling="shuffle")
    with pytest.raises(CalibrationError, match="no calibration data: pass --calib"):
        load_calibration(None, None, num_samples=1, seq_len=8)


# ------------------------------------------------------------------------------------------------ named sets


def test_named_sets_are_valid():
    assert named_sets() == ["c4", "pileval", "tinystories", "wikitext2"]
    for name in named_sets():
        spec = load_named_set(name)
        assert spec.name == name and spec.description and spec.local
        assert spec.hub_repo_id and spec.hub_filename and spec.text_field == "text"
    assert "test" in load_named_set("wikitext2").description.lower()  # only the test split is shipped locally


def test_unknown_named_set_lists_known_sets():
    with pytest.raises(CalibrationError, match="unknown calibration set 'pile'; known sets: c4, pileval, "
                                               "tinystories, wikitext2"):
        load_calibration("pile", None, num_samples=1, seq_len=8)


def test_c4_found_in_data_dir_matches_whole_file_protocol(shared_data, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    c4_file = shared_data / "c4" / "c4-train.00000-of-01024.first800.jsonl"
    cal = load_calibration(None, tokenizer, num_samples=4, seq_len=256, sampling="first", default_set="c4",
                           data_dir=shared_data)
    assert cal.source == f"c4:{c4_file.resolve()}"
    # only a prefix of the file is read and tokenized, yet the windows equal the whole-file protocol's
    docs = [json.loads(line)["text"] for line in c4_file.read_text(encoding="utf-8").splitlines()[:200]]
    assert torch.equal(cal.tokens, first_windows(encode(tokenizer, docs), 4, 256))
    monkeypatch.setenv("QUANTKIT_DATA_DIR", str(shared_data))  # the env var stands in for data_dir
    from_env = load_calibration("c4", tokenizer, num_samples=4, seq_len=256, sampling="first")
    assert from_env.sha256 == cal.sha256
    assert resolve_named_set("c4") == c4_file


def test_random_pool_is_the_first_four_times_the_request(shared_data, tokenizer, monkeypatch):
    """"random" draws from exactly the first RANDOM_POOL_FACTOR x num_samples x seq_len tokens of the stream, however
    far the reader's chunks ran past them: the windows do not move with its characters-per-token guess."""
    import random

    import quantkit.calib as calib

    path = shared_data / "c4/c4-train.00000-of-01024.first800.jsonl"
    docs = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()[:40]]
    pool = encode(tokenizer, docs)[: 4 * 8 * 128]
    assert len(pool) == 4 * 8 * 128  # 40 documents hold more than the pool
    rng = random.Random(0)
    expected = torch.tensor([pool[s: s + 128] for s in (rng.randrange(len(pool) - 127) for _ in range(8))])
    for guess in (1, 4, 8):
        monkeypatch.setattr(calib, "_CHARS_PER_TOKEN_GUESS", guess)
        cal = load_calibration(path, tokenizer, num_samples=8, seq_len=128, seed=0)
        assert torch.equal(cal.tokens, expected), guess


def test_offline_missing_named_set_says_what_to_pass(tmp_path, tokenizer, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    empty = tmp_path / "data"
    empty.mkdir()
    with pytest.raises(CalibrationError) as info:
        load_calibration("c4", tokenizer, num_samples=1, seq_len=8, data_dir=empty)
    message = str(info.value)
    assert "--calib" in message and "--data-dir" in message and "QUANTKIT_DATA_DIR" in message
    assert f"under data dir {empty}" in message and "HF_HUB_OFFLINE" in message
    assert "<data dir>/c4/c4-train.00000-of-01024.first800.jsonl" in message
    monkeypatch.delenv("QUANTKIT_DATA_DIR", raising=False)
    with pytest.raises(CalibrationError, match="no data dir given"):
        resolve_named_set("pileval")


def test_unreachable_hub_fails_fast_without_retries(tmp_path, tokenizer, monkeypatch):
    import huggingface_hub.constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("all_proxy", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused
    with pytest.raises(CalibrationError, match=r"(?s)127\.0\.0\.1 is unreachable .*--calib PATH"):
        load_calibration("wikitext2", tokenizer, num_samples=1, seq_len=8, data_dir=tmp_path)


# --------------------------------------------------------------------------------------------- self-generated


def test_self_generated_calibration_is_seeded(model, tokenizer):
    state = torch.random.get_rng_state()
    a = generate_calibration(model, tokenizer, num_samples=2, seq_len=32, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    b = generate_calibration(model, tokenizer, num_samples=2, seq_len=32, seed=0)
    c = generate_calibration(model, tokenizer, num_samples=2, seq_len=32, seed=1)
    assert a.tokens.shape == (2, 32) and a.tokens.dtype == torch.long
    assert (a.tokens[:, 0] == tokenizer.bos_token_id).all()
    assert not torch.isin(a.tokens[:, 1:], torch.tensor([1, 2])).any()  # EOS ids [2, 1] suppressed
    assert torch.equal(a.tokens, b.tokens) and a.sha256 == b.sha256 == token_sha256(a.tokens)
    assert not torch.equal(a.tokens, c.tokens)
    assert a.source == "self-generated" and a.seed == 0


def test_self_generated_rows_never_end_early(model, tokenizer):
    """Every row is BOS + seq_len - 1 sampled tokens even for a model that would rather stop: with the EOS logit
    raised far above the rest, generation still suppresses it until the row is full."""
    eos = tokenizer.eos_token_id
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out.index_add(
        -1, torch.tensor([eos]), torch.full((*out.shape[:-1], 1), 100.0)))
    try:
        cal = generate_calibration(model, tokenizer, num_samples=2, seq_len=16, seed=0)
    finally:
        handle.remove()
    assert cal.tokens.shape == (2, 16) and not (cal.tokens[:, 1:] == eos).any()


def test_offline_lookup_of_a_named_set_asks_the_cache_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With HF_HUB_OFFLINE set, a named set missing from the data dir is looked up in the local Hugging Face cache
    only (local_files_only), even where the Hub would answer: offline means no download."""
    import huggingface_hub

    import quantkit.calib as calib

    asked: list[bool] = []

    def download(*args: object, local_files_only: bool = False, **kwargs: object) -> str:
        asked.append(local_files_only)
        raise FileNotFoundError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(calib, "_hub_unreachable", lambda timeout=3.0: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CalibrationError, match="HF_HUB_OFFLINE is set and it is not in the local cache"):
        resolve_named_set("c4", tmp_path)
    assert asked == [True]


def test_blank_lines_between_json_rows_are_no_rows(tmp_path: Path) -> None:
    """Blank lines in a JSON-lines file (a trailing newline too many, rows separated by an empty line, a "\\r\\n"
    line) are skipped, not refused as lines that do not parse; a "" text field is still a row."""
    path = tmp_path / "gaps.jsonl"
    path.write_text('\n{"text": "a"}\n\n  \n{"text": ""}\r\n\r\n{"text": "b"}\n\n', encoding="utf-8")
    assert list(iter_documents(path)) == ["a", "", "b"]


def test_a_corrupt_compressed_or_parquet_file_is_named(tmp_path: Path) -> None:
    """A .gz whose deflate data is damaged (zlib's own error, not an OSError) and a parquet file whose footer reads
    but whose data pages are damaged (an OSError from inside pyarrow's batches) are calibration errors naming the
    file, not tracebacks."""
    text = "\n".join(f"Once upon a time number {i} there was a cat who liked to play." for i in range(3000))
    packed = bytearray(gzip.compress(text.encode(), mtime=0))
    packed[40:400] = bytes(b ^ 0x5A for b in packed[40:400])
    (tmp_path / "bad.txt.gz").write_bytes(bytes(packed))
    with pytest.raises(CalibrationError, match=r"cannot read .*bad\.txt\.gz"):
        list(iter_documents(tmp_path / "bad.txt.gz"))
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": text.splitlines()}), path, compression="snappy")
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    end = len(data) - 8 - footer  # the data pages, between the leading magic and the footer
    data[4:end] = bytes(b ^ 0x5A for b in data[4:end])
    path.write_bytes(bytes(data))
    with pytest.raises(CalibrationError, match=r"cannot read .*bad\.parquet as parquet"):
        list(iter_documents(path))


def test_a_compressed_parquet_name_is_refused_as_a_file_type(tmp_path: Path) -> None:
    """Only the text formats may be compressed: a .parquet.gz is refused by its name, listing the types, before any
    read (parquet compresses its own pages)."""
    path = tmp_path / "docs.parquet.gz"
    path.write_bytes(gzip.compress(b"not read", mtime=0))
    with pytest.raises(CalibrationError, match="unsupported calibration file type"):
        load_calibration(path, None, num_samples=1, seq_len=8)


def test_random_windows_that_fit_the_stream_exactly_do_not_warn() -> None:
    """The overlap warning is for a stream shorter than num_samples x seq_len; a stream of exactly that many tokens
    could hold the windows side by side, so it draws them without a warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        windows = sample_windows(list(range(20)), num_samples=2, seq_len=10, seed=0, sampling="random")
    assert windows.shape == (2, 10)


def test_every_start_can_be_drawn_the_last_included() -> None:
    """Random starts are drawn from all of [0, len(stream) - seq_len]: with two possible starts, 64 seeded draws take
    both, the window that ends on the stream's last token included."""
    with pytest.warns(UserWarning, match="necessarily overlap"):
        windows = sample_windows(list(range(11)), num_samples=64, seq_len=10, seed=0, sampling="random")
    assert {row[0] for row in windows.tolist()} == {0, 1}


def test_a_missing_file_in_a_directory_is_named_as_a_file(tmp_path: Path) -> None:
    """A --calib path with directories but no suffix that is not there is a missing file, not looked up (and refused)
    as a calibration set of that name."""
    with pytest.raises(CalibrationError, match=r"calibration file .*missing[/\\]docs does not exist"):
        load_calibration(tmp_path / "missing" / "docs", None, num_samples=1, seq_len=8)


def test_a_directory_named_like_a_sets_file_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A named set's candidates in the data dir are files: a directory of the first candidate's name (an unpacked
    archive, say) is passed over for the next candidate that is a file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first, second = load_named_set("tinystories").local[:2]
    (tmp_path / first).mkdir(parents=True)
    (tmp_path / second).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / second).write_text("Once upon a time.\n", encoding="utf-8")
    assert resolve_named_set("tinystories", tmp_path) == tmp_path / second


def test_a_sets_name_is_the_set_beside_a_folder_or_file_of_that_name(shared_data, tokenizer, tmp_path, monkeypatch):
    """Run from the data dir (`--calib c4 --data-dir .`), the set's own folder c4/ is in the working directory: the
    bare name is still the set, not refused as "a directory; pass a named set with --data-dir", which is what the
    user did. A file of a set's name (no suffix: no format quantkit reads) does not hide the set either."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.chdir(shared_data)
    cal = load_calibration("c4", tokenizer, num_samples=2, seq_len=64, data_dir=".")
    assert cal.source == f"c4:{(shared_data / 'c4' / 'c4-train.00000-of-01024.first800.jsonl').resolve()}"
    here = tmp_path / "here"
    (here / "c4").mkdir(parents=True)
    shutil.copy(shared_data / "c4" / "c4-train.00000-of-01024.first800.jsonl", here / "c4")
    (here / "wikitext2").write_text("Some local text. " * 200, encoding="utf-8")
    monkeypatch.chdir(here)
    assert load_calibration("c4", tokenizer, num_samples=2, seq_len=64, data_dir=here).sha256 == cal.sha256
    with pytest.raises(CalibrationError, match="under data dir"):  # the set's own not-found error
        load_calibration("wikitext2", tokenizer, num_samples=1, seq_len=8, data_dir=here)
