"""Naming domains from the Geometric Influence Score (GIS) [reconstructed].

Prototypes of domain k are its top-GIS documents. Name terms: over the top-GIS half of the domain,
each word's document frequency G_k(t) is compared with its corpus frequency B(t); score
G_k(t) · log(G_k(t) / B(t)) over words with G_k > B, stop-words and words with corpus df < 3 removed.
"""
from __future__ import annotations

import re
from collections import Counter

import numpy as np

STOP = set("""a about above after again against all am an and any are as at be because been before being below
between both but by can could did do does doing down during each few for from further had has have having he her
here hers herself him himself his how i if in into is it its itself just me more most my myself no nor not now of
off on once only or other our ours ourselves out over own same she should so some such than that the their theirs
them themselves then there these they this those through to too under until up very was we were what when where
which while who whom why will with would you your yours yourself yourselves one also us may might must shall get
got like said says""".split())

_WORD = re.compile(r"[a-z][a-z']{2,}")


def words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in STOP}


def taxonomy(texts: list[str], labels: np.ndarray, scores: np.ndarray, k: int, top_terms: int = 6,
             top_docs: int = 3, ids: list[str] | None = None, min_df: int = 3) -> list[dict]:
    bags = [words(t) for t in texts]
    df = Counter(w for b in bags for w in b)
    n = len(texts)
    out = []
    for j in range(k):
        idx = np.where(labels == j)[0]
        if len(idx) == 0:
            out.append({"domain": j, "share": 0.0, "name": "(empty)", "top_terms": [], "prototypes": []})
            continue
        order = idx[np.argsort(-scores[idx], kind="stable")]
        head = order[:max(1, len(order) // 2)]
        g = Counter(w for i in head for w in bags[i])
        scored = []
        for w, c in g.items():
            if df[w] < min_df:
                continue
            gk, bk = c / len(head), df[w] / n
            if gk > bk:
                scored.append((gk * np.log(gk / bk), w))
        scored.sort(reverse=True)
        terms = [[w, round(float(s), 4)] for s, w in scored[:top_terms]]
        out.append({"domain": j, "share": len(idx) / n, "name": " / ".join(w for w, _ in terms[:3]) or "(no terms)",
                    "top_terms": terms,
                    "prototypes": [ids[i] if ids else int(i) for i in order[:top_docs]],
                    "prototype_texts": [texts[i][:160] for i in order[:top_docs]]})
    return out
