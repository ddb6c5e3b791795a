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


def student_agreement(texts: list[str], labels, *, folds: int = 5, seed: int = 0) -> dict:
    """Held-out agreement of a bag-of-n-grams student with a partition (the GEM spec's "always report" student
    agreement, measured with its Student B): scikit-learn HashingVectorizer (2^20 features, word 1–2-grams,
    alternate_sign False, L2 norm, lower-cased) + SGDClassifier (log loss, alpha 1e-6, 5 epochs), trained on the
    hard labels of the other folds and scored on each held-out fold (stratified ``folds``-fold cross-fitting:
    every document is predicted once by a student that never saw it). Returns accuracy (``agreement``), macro-F1,
    Cohen's κ (agreement above what the label shares give by chance: a collapsed partition scores high accuracy
    by predicting its giant cluster, not high κ) and ``majority`` (the largest label share = the accuracy of
    always predicting it)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.feature_extraction.text import HashingVectorizer
    from sklearn.linear_model import SGDClassifier
    from sklearn.metrics import cohen_kappa_score, f1_score
    from sklearn.model_selection import StratifiedKFold

    y = np.asarray(labels)
    if len(np.unique(y)) < 2:
        return {"agreement": None, "macro_f1": None, "kappa": None, "majority": 1.0, "folds": folds}
    vec = HashingVectorizer(n_features=2 ** 20, ngram_range=(1, 2), alternate_sign=False, norm="l2", lowercase=True)
    x = vec.transform([clean(t) for t in texts])
    pred = np.empty_like(y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", UserWarning)  # a class with fewer members than folds
        for train, test in StratifiedKFold(folds, shuffle=True, random_state=seed).split(x, y):
            clf = SGDClassifier(loss="log_loss", alpha=1e-6, max_iter=5, tol=None, random_state=seed)
            pred[test] = clf.fit(x[train], y[train]).predict(x[test])
    _, counts = np.unique(y, return_counts=True)
    return {"agreement": float(np.mean(pred == y)), "macro_f1": float(f1_score(y, pred, average="macro")),
            "kappa": float(cohen_kappa_score(y, pred)), "majority": float(counts.max() / len(y)), "folds": folds}
