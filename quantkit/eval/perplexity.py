"""WikiText-2 perplexity with the GPTQ/AWQ/QServe protocol.

`"\n\n".join(test rows)` is tokenized once (with the tokenizer's BOS), cut into non-overlapping windows of
`seq_len` tokens (the tail shorter than a window is dropped), and ppl = exp(sum_i L * mean_nll_i / (n * L)),
exactly as those papers' evaluation scripts compute it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.files import json_objects, resolve_data_dir

WIKITEXT_FILE = "wikitext-2-raw-v1/test.jsonl"


class DataNotFoundError(QuantkitError):
    """An evaluation data file is missing."""


class DataFormatError(QuantkitError):
    """An evaluation data file is not what its task reads."""


def wikitext_file(data_dir: str | Path | None) -> Path:
    """The local file of the WikiText-2 raw test rows, or an error that says what to pass."""
    root = resolve_data_dir(data_dir)
    if root is None:
        raise DataNotFoundError(
            f"WikiText-2 needs its local test rows: pass --data-dir DIR (or set QUANTKIT_DATA_DIR) where "
            f"DIR/{WIKITEXT_FILE} holds the HF `wikitext-2-raw-v1` test split as JSON lines"
        )
    path = root / WIKITEXT_FILE
    if not path.is_file():
        raise DataNotFoundError(f"WikiText-2 test rows not found: {path} is missing (task wikitext)")
    return path


def wikitext_rows(data_dir: str | Path | None) -> list[str]:
    """The WikiText-2 raw test rows (HF layout: one JSON object with a "text" string per line), or an error naming
    the file and line that is not such a row."""
    path = wikitext_file(data_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataFormatError(f"cannot read {path} as UTF-8 text ({exc})") from None
    fix = "the file must hold the HF `wikitext-2-raw-v1` test split as JSON lines"
    rows = []
    for number, row in json_objects(text.splitlines(), path, ("text",), DataFormatError, fix):
        if not isinstance(row["text"], str):
            raise DataFormatError(f"{path}, line {number}: field 'text' is {type(row['text']).__name__}, not text")
        rows.append(row["text"])
    if not any(row.strip() for row in rows):  # blank rows alone would tokenize to almost nothing
        raise DataFormatError(f"{path} holds no text (task wikitext); {fix}")
    return rows


@dataclass
class PerplexityResult:
    perplexity: float
    windows: int
    seq_len: int
    tokens: int  # the windows' tokens, windows x seq_len
    scored_tokens: int  # the tokens predicted, windows x (seq_len - 1): a window's first has no context
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@torch.no_grad()
def perplexity(
    model: torch.nn.Module, token_ids: torch.Tensor, seq_len: int, limit: int | None = None, batch_size: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity over the first `limit` (default all) non-overlapping `seq_len` windows of `token_ids` [T];
    `progress(done, total)` is called after every batch of windows."""
    t0 = time.time()
    n = token_ids.numel() // seq_len
    if limit is not None:
        n = min(n, limit)
    if n == 0:
        raise QuantkitError(f"text has {token_ids.numel()} tokens, fewer than one window of {seq_len}")
    windows = token_ids[: n * seq_len].view(n, seq_len)
    device = next(model.parameters()).device
    if progress is not None:
        progress(0, n)  # the clock starts with the first window, not after it
    nll_sum = 0.0
    for start in range(0, n, batch_size):
        batch = windows[start:start + batch_size].to(device)
        logits = model(batch).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
        ).view(batch.shape[0], -1)
        nll_sum += float((loss.mean(dim=1) * seq_len).sum())
        if progress is not None:
            progress(start + batch.shape[0], n)
    return PerplexityResult(math.exp(nll_sum / (n * seq_len)), n, seq_len, n * seq_len, n * (seq_len - 1),
                            time.time() - t0)


def wikitext_perplexity(
    model: torch.nn.Module, tokenizer: Any, rows: list[str], seq_len: int = 2048, limit: int | None = None,
    batch_size: int = 1, progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """The papers' WikiText-2 perplexity of `model` on the test `rows` (`wikitext_rows`; `progress(done, total)`
    after every batch of windows)."""
    text = "\n\n".join(rows)
    # One sequence far past the model's context, cut into windows below: verbose=False keeps the tokenizer from
    # warning of "indexing errors" that the windowing never makes.
    ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids[0]
    return perplexity(model, ids, seq_len, limit, batch_size, progress)
