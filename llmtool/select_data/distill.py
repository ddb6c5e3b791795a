"""Teacher → student distillation of a domain taxonomy into a fastText classifier (GEM spec §3.4 with
the corrections: the student learns GIS-selected, cluster-balanced pseudo-labels).

Training set [ours]: in every domain, the documents ranked by GIS; the top ``per_domain`` of each
(capped by the smallest domain's top share) are kept, so every domain contributes equally; 10 % of
all documents are held out first for the agreement measurement (accuracy and macro-F1 vs the teacher's
hard labels on all held-out documents, not only GIS-selected ones).
fastText settings (spec): dim 64, epoch 5, lr 0.5, wordNgrams 2, minCount 2, softmax; text lower-cased,
newlines replaced by spaces.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np


def clean(text: str) -> str:
    return " ".join(text.lower().split())


def select_training(labels: np.ndarray, gis: np.ndarray, train_idx: np.ndarray, per_domain: int) -> np.ndarray:
    keep = []
    for j in np.unique(labels[train_idx]):
        idx = train_idx[labels[train_idx] == j]
        keep.extend(idx[np.argsort(-gis[idx], kind="stable")][:per_domain].tolist())
    return np.array(sorted(keep))


def train_student(texts: list[str], labels: np.ndarray, gis: np.ndarray, *, per_domain: int = 400,
                  holdout: float = 0.1, seed: int = 0, epoch: int = 5, dim: int = 64):
    """Returns (fasttext model, metrics dict)."""
    import fasttext
    from sklearn.metrics import f1_score

    rng = np.random.default_rng(seed)
    n = len(texts)
    perm = rng.permutation(n)
    n_hold = max(1, int(round(holdout * n)))
    hold, train = np.sort(perm[:n_hold]), np.sort(perm[n_hold:])
    chosen = select_training(labels, gis, train, per_domain)
    fd, path = tempfile.mkstemp(suffix=".txt")
    try:
        with os.fdopen(fd, "w") as fh:
            for i in rng.permutation(chosen):
                fh.write(f"__label__{int(labels[i])} {clean(texts[i])}\n")
        model = fasttext.train_supervised(input=path, dim=dim, epoch=epoch, lr=0.5, wordNgrams=2, minCount=2,
                                          loss="softmax", seed=seed, thread=1, verbose=0)
    finally:
        os.unlink(path)
    pred = predict(model, [texts[i] for i in hold])[0]
    return model, {"agreement": float(np.mean(pred == labels[hold])),
                   "macro_f1": float(f1_score(labels[hold], pred, average="macro")),
                   "train_docs": int(len(chosen)), "heldout_docs": int(len(hold))}


def predict(model, texts: list[str]):
    labs, probs = model.predict([clean(t) for t in texts], k=1)
    return (np.array([int(lab[0].replace("__label__", "")) for lab in labs]),
            np.array([float(p[0]) for p in probs]))
