"""Calibration/eval text and record loaders (named packaged corpora, .txt, .jsonl, .parquet, .csv)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from llmtool.core.console import UsageError

DEFAULT_CALIB = "austen-train"
DEFAULT_EVAL = "austen-test"


def load_text(source: str | Path) -> str:
    """Text of a packaged corpus name (``austen-train``, ``austen-test``) or a file:
    .txt (whole file), .jsonl (field ``text`` of each line), .parquet/.csv (column ``text``)."""
    from llmtool.core import defaults

    if str(source) in defaults.TEXTS:
        return defaults.text(str(source))
    path = Path(source)
    if not path.is_file():
        raise UsageError(f"{source}: no such data file or dataset (datasets: {', '.join(defaults.TEXTS)})")
    if path.suffix == ".jsonl":
        return "\n\n".join(str(r["text"]) for r in read_jsonl(path, required=("text",)))
    if path.suffix in (".parquet", ".csv"):
        return "\n\n".join(str(r["text"]) for r in read_table(path, required=("text",)))
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text") from None


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` for every non-blank line of a JSONL file; a malformed line is a
    one-line error naming ``file:line``."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    with open(path, "rb") as fh:
        for i, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(f"{path}:{i}: not UTF-8 text (byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{i}: malformed JSON ({e.msg})") from None
            except RecursionError:
                raise UsageError(f"{path}:{i}: malformed JSON (nested too deeply)") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path}:{i}: each line must be a JSON object")
            yield i, row


def read_jsonl(path: str | Path, required: Sequence[str] = (), allow_empty: bool = False) -> list[dict]:
    """Read a JSONL file; a malformed line or a missing field is a one-line error naming the line."""
    rows = []
    for i, row in iter_jsonl(path):
        for f in required:
            if f not in row:
                raise UsageError(f"{path}:{i}: missing field {f!r}")
        rows.append(row)
    if not rows and not allow_empty:
        raise UsageError(f"{path}: no records")
    return rows


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    from llmtool.core.checkpoint import atomic_file

    with atomic_file(Path(path)) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_table(path: str | Path, required: Sequence[str] = ()) -> list[dict]:
    """Rows of a .csv or .parquet file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pyarrow.ArrowException, OSError) as e:
            raise UsageError(f"{path}: not a readable parquet file ({str(e).splitlines()[0][:120]})") from None
    else:
        import csv

        try:
            with open(path, newline="", encoding="utf-8") as fh:
                rows = list(csv.DictReader(fh))
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except csv.Error as e:
            raise UsageError(f"{path}: malformed CSV ({e})") from None
    for f in required:
        if rows and f not in rows[0]:
            raise UsageError(f"{path}: missing column {f!r}")
    return rows


TOKENIZE_CHUNK_CHARS = 200_000


def scoring_bos(tokenizer) -> int | None:
    """The BOS id a perplexity window must start with: the tokenizer's ``bos_token_id`` when encoding a text
    with special tokens puts it first (Gemma, Llama 2/3), else None (SmolLM2 and Qwen2.5 add none)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True, return_attention_mask=False)["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A prompt's ids as the model was trained to see text: ``text`` without special tokens, led by the
    tokenizer's BOS where it starts every text with one (:func:`scoring_bos`: Gemma, Llama) and the text does
    not already begin with it (chat templates such as Gemma's write ``<bos>`` themselves). Tokenizers that add
    no BOS (SmolLM2, Qwen2.5) get exactly ``tokenizer(text, add_special_tokens=False)``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = scoring_bos(tokenizer)
    return [bos, *ids] if bos is not None and (not ids or ids[0] != bos) else list(ids)


def tokenize_prompt(tokenizer, text: str) -> torch.Tensor:
    """:func:`tokenize` (long texts in pieces) led by the BOS :func:`prompt_ids` would put first: the context
    of a KV-cache run or any long prompt, fed as the model saw text in training."""
    ids = tokenize(tokenizer, text)
    bos = scoring_bos(tokenizer)
    if bos is None or (ids.numel() and int(ids[0]) == bos):
        return ids
    return torch.cat([torch.tensor([bos], dtype=ids.dtype), ids])


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def _split_points(text: str, every: int) -> list[int]:
    """Positions about every ``every`` characters of a line break that a letter follows (the piece after
    the split starts with that line break: byte-level BPE's regex keeps a lone line break before a word
    apart, but merges a run of line breaks at a piece's start)."""
    points, pos = [], every
    while pos < len(text):
        nl = text.find("\n", pos)
        while nl != -1 and nl + 1 < len(text) and not text[nl + 1].isalpha():
            nl = text.find("\n", nl + 1)
        if nl == -1 or nl + 1 >= len(text):
            break
        points.append(nl)
        pos = nl + 1 + every
    return points


def tokenize(tokenizer, text: str, chunk_chars: int = TOKENIZE_CHUNK_CHARS) -> torch.Tensor:
    """Token ids of ``text`` as one 1-D tensor (no special tokens added).

    Encoding austen-train (3.1M characters, 721k tokens) in one call raised the process's peak memory
    by ~400 MB (measured; encoding it in pieces adds ~30 MB). Long texts are therefore encoded in pieces of
    about ``chunk_chars`` characters, split before a line break that a letter follows, and the ids are
    concatenated. A split is used only if encoding 256 characters on either side of it together gives
    the same ids as encoding both sides apart (a pre-tokenizer boundary, as for byte-level BPE); if any
    split fails that check the text is encoded whole, so the ids always equal the one-piece encoding
    for tokenizers whose pre-tokenization is local (tests/test_core.py)."""
    points = _split_points(text, chunk_chars) if len(text) > chunk_chars else []
    for p in points:
        left, right = text[max(0, p - 256):p], text[p:p + 256]
        if _encode(tokenizer, left + right) != _encode(tokenizer, left) + _encode(tokenizer, right):
            points = []
            break
    bounds = [0, *points, len(text)]
    ids: list[int] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        ids.extend(_encode(tokenizer, text[a:b]))
    return torch.tensor(ids, dtype=torch.long)


def calibration_batches(tokenizer, source: str | Path = DEFAULT_CALIB, n: int = 32, seqlen: int = 512,
                        seed: int = 0, bos: bool = False) -> torch.Tensor:
    """``n`` random windows of ``seqlen`` tokens of the concatenated tokenized text, as [n, seqlen]
    (the SVD-LLM / GPTQ calibration protocol).

    ``bos=True``: a model whose tokenizer starts every text with BOS (:func:`scoring_bos`: Gemma, Llama 2/3)
    gets windows of BOS + ``seqlen - 1`` text tokens, as its perplexity windows are scored (issue 40: Gemma 3
    calibrated on windows without BOS turns the first text token into the attention sink, whose massive
    activations then dominate the calibration statistics). For a tokenizer without a scoring BOS (SmolLM2,
    Qwen2.5) the windows are the same either way, draw for draw."""
    ids = tokenize(tokenizer, load_text(source))
    if ids.numel() <= seqlen:
        raise UsageError(f"{source}: only {ids.numel()} tokens, need more than --seqlen {seqlen}")
    first = scoring_bos(tokenizer) if bos else None
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen, (n,), generator=g)
    if first is None:
        return torch.stack([ids[s:s + seqlen] for s in starts.tolist()])
    head = torch.tensor([first], dtype=ids.dtype)
    return torch.stack([torch.cat([head, ids[s:s + seqlen - 1]]) for s in starts.tolist()])
