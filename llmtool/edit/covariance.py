"""Key second-moment statistics ``C_l = E[k kᵀ]`` (uncentred, mean over token positions) of the
``mlp.down_proj`` inputs of chosen layers, from real text, cached per model.

Protocol: ``samples`` token positions taken as ``ceil(samples / seqlen)`` random windows of
``seqlen`` tokens of the corpus (``llmtool.core.data.calibration_batches``, packaged
``austen-train`` by default: the paper lineage uses Wikipedia, which is not available offline).
Accumulated in float64 on CPU (:class:`llmtool.core.calib.InputStatistics`), stored in float32 (the spec's choice) under
``$LLMTOOL_HOME/edit-stats/<model sha256[:16]>/`` as one safetensors file per (layer, corpus,
samples, seqlen, seed), so statistics of one model are never reused for another. A corpus given as a
file is keyed by its content hash (a different file of the same name never reuses old statistics); an
unreadable cache file is recomputed; a read-only ``$LLMTOOL_HOME`` only disables the cache.

A tokenizer that starts every text with BOS (Gemma; ``prompts.bos_prefix``) gets each window as
``[BOS] + window``, as its model always saw text (and as the edit prompts are encoded), and the BOS
position counts in the statistics; the cache file name then ends in ``-bos``.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llmtool.core.arch import linear_names
from llmtool.core.calib import input_statistics
from llmtool.core.checkpoint import atomic_file
from llmtool.core.console import info, progress
from llmtool.core.data import calibration_batches
from llmtool.edit.prompts import bos_prefix


def stats_root() -> Path:
    from llmtool.core.defaults import home

    return home() / "edit-stats"


def _corpus_tag(corpus: str) -> str:
    import hashlib

    p = Path(str(corpus))
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", p.name)
    if p.is_file():
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        tag += "-" + h.hexdigest()[:16]
    return tag


def _file(root: Path, fingerprint: str, layer: int, corpus: str, samples: int, seqlen: int, seed: int,
          bos: bool = False) -> Path:
    tag = _corpus_tag(corpus)
    suffix = "-bos" if bos else ""
    return root / fingerprint / f"layer{layer}-{tag}-n{samples}-s{seqlen}-seed{seed}{suffix}.safetensors"


@torch.no_grad()
def compute_second_moments(model, tok, layers: list[int], corpus: str = "austen-train", samples: int = 20000,
                           seqlen: int = 256, seed: int = 0, batch_size: int = 4) -> dict[int, torch.Tensor]:
    n_windows = max(1, math.ceil(samples / seqlen))
    batches = calibration_batches(tok, corpus, n=n_windows, seqlen=seqlen, seed=seed)
    bos = bos_prefix(tok)
    if bos:
        batches = torch.cat([torch.full((batches.shape[0], 1), bos[0], dtype=batches.dtype), batches], dim=1)
    device = next(model.parameters()).device
    names = {l: linear_names(model, roles=("down",))[l][0] for l in layers}
    with input_statistics(model, list(names.values()), device="cpu") as stats:
        for i in progress(range(0, n_windows, batch_size), "key statistics", total=math.ceil(n_windows / batch_size)):
            model(input_ids=batches[i:i + batch_size].to(device))
    return {l: stats.covariance(names[l]).to(torch.float32) for l in layers}


def second_moments(model, tok, layers: list[int], fingerprint: str, corpus: str = "austen-train",
                   samples: int = 20000, seqlen: int = 256, seed: int = 0, root: Path | None = None
                   ) -> dict[int, torch.Tensor]:
    """Cached ``C_l`` for every layer in ``layers`` (computed in one pass for the missing ones)."""
    root = Path(root) if root is not None else stats_root()
    bos = bool(bos_prefix(tok))
    out, missing = {}, []
    for l in layers:
        f = _file(root, fingerprint, l, corpus, samples, seqlen, seed, bos)
        try:
            out[l] = load_file(str(f))["mom2"] if f.is_file() else None
        except Exception as e:  # a truncated or foreign file: recompute rather than fail
            info(f"ignoring unreadable cached statistics {f.name}: {type(e).__name__}")
            out[l] = None
        if out[l] is None:
            del out[l]
            missing.append(l)
    if missing:
        info(f"computing key second moments for layers {missing} ({samples} positions of {corpus})")
        fresh = compute_second_moments(model, tok, missing, corpus, samples, seqlen, seed)
        for l, c in fresh.items():
            f = _file(root, fingerprint, l, corpus, samples, seqlen, seed, bos)
            try:
                f.parent.mkdir(parents=True, exist_ok=True)
                with atomic_file(f) as tmp:
                    save_file({"mom2": c.contiguous()}, str(tmp),
                              metadata={"count": str(samples), "corpus": str(corpus)})
            except OSError as e:
                info(f"statistics not cached ({f.parent}: {e.strerror or e})")
            out[l] = c
    return out
