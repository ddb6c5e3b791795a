"""select-data benchmark: GEM intrinsic balance and coherence vs its baselines on real text, on two embedders
(normalised MiniLM sentence embeddings and the unnormalised mean-pooled hidden states of a causal LM, where
Euclidean K-Means is exposed to the norm variation and anisotropy that the paper's collapse claim is about), and
SHIFT selection (without RL) vs its baselines on a reasoning-gym pool with the default model's rollouts, plus cost.

    .venv/bin/python benchmarks/select_data.py                     # CPU default (LM embedder ~30 min on one thread, est.)
    .venv/bin/python benchmarks/select_data.py --skip shift,mix --fortunes 500 --austen 150 --synthetic 245 \
        --seeds 0,1,2                                               # the GEM part as measured (both embedders)
    .venv/bin/python benchmarks/select_data.py --fortunes 0 --austen 2000 --synthetic 1000 \
        --seeds 0,1,2 --pool-per-gen 50 --max-new-tokens 256        # fuller protocol (GPU advised)

Writes benchmarks/results/select_data.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gates import gate, lines as gate_lines  # noqa: E402
from llmtool.core.console import info, markdown_table  # noqa: E402

GENERATORS = ("basic_arithmetic", "chain_sum", "products", "simple_equations", "number_sorting",
              "spell_backward", "syllogism")
# The SHIFT pool's generator configurations by difficulty. "default" is reasoning-gym's own (12-digit sums,
# 5-digit products: out of a 135M model's reach, 8 % of GRPO groups with reward variance). "easy" is the issue-42
# calibration: one-digit operands, two or three terms, three numbers to sort, 3-4-letter words, so that a warm
# started SmolLM2-135M gets reward variance; syllogism keeps its default (already 91 % after the warm start).
POOL_CONFIGS = {
    "default": {},
    "easy": {"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"],
                                  "allow_parentheses": False, "allow_negation": False},
             "chain_sum": {"min_terms": 2, "max_terms": 3, "max_digits": 1},
             "products": {"max_digits": 1},
             "simple_equations": {"min_terms": 2, "max_terms": 2, "max_value": 10, "operators": ["+", "-"],
                                  "operators_weights": [0.5, 0.5]},
             "number_sorting": {"min_numbers": 3, "max_numbers": 3, "max_decimals": 0, "min_value": 0,
                                "max_value": 20},
             "spell_backward": {"min_word_len": 3, "max_word_len": 4}},
}


def gem_corpus(n_fortunes: int, n_austen: int, n_synth: int, seed: int = 0) -> list[dict]:
    import reasoning_gym

    from llmtool.core.defaults import text
    from llmtool.select_data.corpora import fortunes

    rng = np.random.default_rng(seed)
    fort = fortunes()
    if n_fortunes and n_fortunes < len(fort):
        fort = [fort[i] for i in sorted(rng.choice(len(fort), n_fortunes, replace=False))]
    paras = [p for p in text("austen-train").split("\n\n") if len(p) > 200]
    paras = [paras[i] for i in sorted(rng.choice(len(paras), min(n_austen, len(paras)), replace=False))]
    rows = fort + [{"id": f"austen-{i}", "text": p[:600], "source": "austen"} for i, p in enumerate(paras)]
    per = max(1, n_synth // len(GENERATORS))
    for g in GENERATORS:
        ds = reasoning_gym.create_dataset(g, size=per, seed=seed + 1)
        rows += [{"id": f"{g}-{i}", "text": ds[i]["question"], "source": "synthetic:" + g} for i in range(per)]
    return rows


def corpus_embeddings(texts: list[str], embedder: str, lm_model: str, cache: bool = True) -> tuple[np.ndarray, float | None]:
    """Embeddings of the GEM corpus: ``minilm`` (all-MiniLM-L6-v2, mean pooled, L2-normalised) or ``lm`` (the
    causal LM's mean-pooled last hidden state, unnormalised: ``corpora.embed_lm``), max 128 tokens. Cached under
    ``$LLMTOOL_HOME/bench/`` keyed by the embedder and a hash of the texts (the LM pass is ~30 min on one CPU
    thread); returns (embeddings, seconds spent embedding, or None when they were read from the cache)."""
    import hashlib

    from llmtool.core.defaults import home
    from llmtool.select_data.corpora import embed_lm, embed_minilm

    h = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]
    tag = "minilm" if embedder == "minilm" else f"lm-{lm_model.replace('/', '_')}"
    path = home() / "bench" / f"select_data-{tag}-L128-{h}.npy"
    if cache and path.is_file():
        info(f"embeddings ({embedder}) read from {path}")
        return np.load(path), None
    t = time.time()
    if embedder == "minilm":
        emb = embed_minilm(texts, batch_size=64)
    elif embedder == "lm":
        from llmtool.core.models import load_model, load_tokenizer

        emb = embed_lm(load_model(lm_model), load_tokenizer(lm_model), texts, batch_size=16, max_length=128)
    else:
        raise ValueError(f"unknown embedder {embedder!r} (minilm | lm)")
    sec = time.time() - t
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, emb)
    return emb, sec


GEM_METHODS = ("gem", "gem-mm", "vmf", "movmf-em", "spherical-kmeans", "kmeans", "source")
SUMMARY_KEYS = ("norm_entropy", "max_share", "top2_share", "min_share", "mean_cos", "silhouette_cos",
                "student_agreement", "student_kappa", "student_macro_f1", "synthetic_top2", "nmi_source")


def embedding_geometry(emb: np.ndarray, seed: int = 0, pairs: int = 20_000) -> dict:
    """What separates the two embedders' geometry: spread of the vector norms (coefficient of variation, 5th and
    95th percentiles over the median) and anisotropy (mean cosine of random pairs; 0 for isotropic directions;
    share of the raw variance on the first principal axis)."""
    rng = np.random.default_rng(seed)
    x = emb.astype(np.float64)
    norms = np.linalg.norm(x, axis=1)
    u = x / np.maximum(norms[:, None], 1e-12)
    i, j = rng.integers(0, len(x), pairs), rng.integers(0, len(x), pairs)
    keep = i != j
    sv = np.linalg.svd(x - x.mean(0), compute_uv=False) ** 2
    med = float(np.median(norms))
    return {"dim": int(x.shape[1]), "norm_mean": round(float(norms.mean()), 4),
            "norm_cv": round(float(norms.std() / norms.mean()), 4),
            "norm_p5_over_median": round(float(np.percentile(norms, 5) / med), 4),
            "norm_p95_over_median": round(float(np.percentile(norms, 95) / med), 4),
            "mean_pair_cos": round(float(np.mean(np.sum(u[i[keep]] * u[j[keep]], axis=1))), 4),
            "pc1_variance_share": round(float(sv[0] / sv.sum()), 4)}


def bench_gem(args) -> dict:
    """Every clusterer on every embedder (``--embedders minilm,lm``), cluster seeds ``--seeds``; per run the
    balance of the hard shares and the spec's always-reported coherence metrics (mean cosine to centroid, cosine
    silhouette, student agreement)."""
    from sklearn.metrics import normalized_mutual_info_score

    from llmtool.select_data import gem
    from llmtool.select_data.distill import student_agreement
    from llmtool.select_data.gis import taxonomy
    from llmtool.select_data.methods import CLUSTERERS, run_clusterer

    rows = gem_corpus(args.fortunes, args.austen, args.synthetic)
    texts = [r["text"] for r in rows]
    info(f"GEM corpus: {len(rows)} documents")
    sources = [r["source"] for r in rows]
    synth = np.array([s.startswith("synthetic") for s in sources])
    coarse = [s if not s.startswith("synthetic") else "synthetic" for s in sources]
    results, tax_print, embed_s, geometry, students = [], {}, {}, {}, {}
    for embedder in args.embedders:
        emb, embed_s[embedder] = corpus_embeddings(texts, embedder, args.lm_model)
        geometry[embedder] = embedding_geometry(emb)
        info(f"{embedder}: {geometry[embedder]}")
        x = gem.normalize(emb.astype(np.float64))
        # "gem-mm": GEM with the literal one-step per-sample quadratic-minoriser Q-step (--q-step mm), first seed
        # only (slow): how far the MM steps get within max_iter compared with the exact Q-step (their limit).
        for seed in args.seeds:
            for name in GEM_METHODS:
                if name in ("source", "gem-mm") and seed != args.seeds[0]:
                    continue
                kw = {} if name == "source" else {"k": args.k, "cluster_seed": seed}
                if name in ("gem", "gem-mm", "vmf", "movmf-em"):
                    kw["max_iter"] = args.max_iter
                if name == "gem-mm":
                    kw["q_step"] = "mm"
                cfg = CLUSTERERS.build("gem" if name == "gem-mm" else name, **kw)
                t = time.time()
                res, _ = run_clusterer(cfg, emb, sources)  # kmeans: Euclidean on the raw (unnormalised) vectors
                sec = time.time() - t
                k = res.k
                m = gem.intrinsic(res.labels, k, x)
                sil = cosine_silhouette(x, res.labels, seed)
                counts = np.bincount(res.labels[synth], minlength=k)
                top2 = float(np.sort(counts)[-2:].sum() / max(synth.sum(), 1))
                key = (res.labels.tobytes(), seed)  # the source labels are the same under both embedders
                if key not in students:
                    students[key] = student_agreement(texts, res.labels, folds=5, seed=seed)
                st = students[key]
                shares = np.sort(np.bincount(res.labels, minlength=k))[::-1] / len(res.labels)
                results.append({"embedder": embedder, "method": name, "seed": seed, "k": k,
                                "norm_entropy": round(m["norm_entropy"], 4), "max_share": round(m["max_share"], 4),
                                "top2_share": round(float(shares[:2].sum()), 4), "min_share": round(m["min_share"], 4),
                                "mean_cos": round(m["mean_cos"], 4), "silhouette_cos": sil,
                                "student_agreement": round(st["agreement"], 4), "student_kappa": round(st["kappa"], 4),
                                "student_macro_f1": round(st["macro_f1"], 4),
                                "synthetic_top2": round(top2, 3),
                                "nmi_source": round(float(normalized_mutual_info_score(coarse, res.labels)), 3),
                                "iterations": int(res.iterations), "seconds": round(sec, 1)})
                info(str(results[-1]))
                if name == "gem" and seed == args.seeds[0]:
                    tax = taxonomy(texts, res.labels, gem.gis_scores(x, res), k, top_terms=4)
                    tax_print[embedder] = [{"domain": t["domain"], "share": round(t["share"], 3), "name": t["name"]}
                                           for t in sorted(tax, key=lambda t: -t["share"])]
    summary = gem_summary(results, GEM_METHODS)
    return {"n_docs": len(rows), "embedders": list(args.embedders), "lm_model": args.lm_model,
            "embed_seconds": {e: None if v is None else round(v, 1) for e, v in embed_s.items()},  # None: cached
            "geometry": geometry,
            "student": "scikit-learn hashed word 1-2-grams + SGD log-loss (GEM spec Student B), 5-fold cross-fitted",
            "rows": results, "summary": summary, "gates": all_gem_gates(summary, args.k), "gem_taxonomy": tax_print}


def gem_summary(results: list[dict], names) -> list[dict]:
    """Mean ± sd over seeds per (embedder, method) (sd 0 for a single seed). Rows without an ``embedder`` field
    (runs before the LM setting existed) are MiniLM runs."""
    out = []
    embedders = list(dict.fromkeys(r.get("embedder", "minilm") for r in results))
    for emb in embedders:
        for name in names:
            rs = [r for r in results if r["method"] == name and r.get("embedder", "minilm") == emb]
            if not rs:
                continue
            row = {"embedder": emb, "method": name, "seeds": len(rs)}
            for key in SUMMARY_KEYS:
                if any(r.get(key) is None for r in rs):  # rows measured before the metric was recorded
                    continue
                v = np.array([r[key] for r in rs], dtype=float)
                row[key] = round(float(v.mean()), 4)
                row[key + "_sd"] = round(float(v.std(ddof=1)), 4) if len(v) > 1 else 0.0
            out.append(row)
    return out


def cosine_silhouette(x: np.ndarray, labels: np.ndarray, seed: int, sample: int = 10_000) -> float | None:
    """Cosine silhouette on a sample of at most ``sample`` points (spec gem §5 "always report")."""
    from sklearn.metrics import silhouette_score

    if len(np.unique(labels)) < 2:
        return None
    return round(float(silhouette_score(x, labels, metric="cosine", sample_size=min(sample, len(x)),
                                        random_state=seed)), 4)


ALWAYS_REPORT = ("mean_cos", "silhouette_cos", "student_agreement", "student_kappa")  # spec gem §5
COLLAPSE_TOP2 = 6.0  # K-Means "collapsed" when its two largest clusters hold >= 6/K of the corpus (3x uniform)


def gem_gates(summary: list[dict], k: int) -> dict:
    """Gates on the seed means of one embedder's rows (met / not met / not tested records):

    - balance (GEM's λ imposes it by construction, so these cannot fail for want of a rival): entropy of hard
      shares ≥ 0.98, ≥ movMF-EM's and ≥ K-Means's; smallest share ≥ 0.5 %;
    - the paper's collapse claim (Euclidean K-Means lets a few buckets swallow the corpus; GEM does not): GEM's
      two largest clusters hold ≤ 0.5 × what K-Means's two largest hold. Not tested unless K-Means did collapse
      here: its two largest clusters hold ≥ 6/K of the corpus (3 × the uniform 2/K), which also keeps the bound
      reachable by a K-way partition;
    - the paper's student claim (GEM 75.13 vs K-Means 72.92 held-out accuracy): the student agrees with GEM's
      labels at least as well as with K-Means's, compared on Cohen's κ (raw accuracy beside it): a collapsed
      partition is "agreed with" by predicting its giant cluster, so accuracy would reward the collapse.

    Beside each, the spec's always-reported coherence metrics of the methods compared."""
    by = {r["method"]: r for r in summary}
    g, em, km = by.get("gem"), by.get("movmf-em"), by.get("kmeans")
    if not (g and em and km):
        return {}

    def beside(*rows):
        out = {}
        for r in rows:
            out[r["method"]] = {key: r[key] for key in ("norm_entropy", "max_share", "top2_share", "min_share")
                                if key in r}
            out[r["method"]].update({key: r.get(key, "not measured") for key in ALWAYS_REPORT})
        return out

    gates = {
        "entropy_ge_0.98": gate("GEM entropy >= 0.98", g["norm_entropy"] >= 0.98, beside(g)),
        "entropy_ge_movmf_em": gate("GEM entropy >= movMF-EM's", g["norm_entropy"] >= em["norm_entropy"], beside(g, em)),
        "entropy_ge_kmeans": gate("GEM entropy >= K-Means's", g["norm_entropy"] >= km["norm_entropy"], beside(g, km)),
        "min_share_ge_0.005": gate("GEM smallest share >= 0.5 %", g["min_share"] >= 0.005, beside(g)),
    }
    if "top2_share" in g and "top2_share" in km:
        need = COLLAPSE_TOP2 / k
        gates["collapse_top2_le_half_kmeans"] = gate(
            "GEM two largest clusters <= 0.5 x K-Means's where K-Means collapsed", g["top2_share"] <= 0.5 * km["top2_share"],
            {"kmeans_collapse_threshold_top2": round(need, 4), **beside(g, km)},
            precondition=km["top2_share"] >= need,
            reason=f"K-Means did not collapse here: its two largest clusters hold {km['top2_share']:.4f} of the "
                   f"corpus, under {COLLAPSE_TOP2:g}/K = {need:.4f} (3 x the uniform share of two clusters)")
    if g.get("student_kappa") is not None and km.get("student_kappa") is not None:
        gates["student_kappa_ge_kmeans"] = gate(
            "student agreement (Cohen's kappa) with GEM >= with K-Means", g["student_kappa"] >= km["student_kappa"],
            beside(g, km))
    return gates


def all_gem_gates(summary: list[dict], k: int) -> dict:
    """gem_gates per embedder, keys prefixed with the embedder (``minilm:``, ``lm:``)."""
    out = {}
    for emb in dict.fromkeys(r.get("embedder", "minilm") for r in summary):
        for key, g in gem_gates([r for r in summary if r.get("embedder", "minilm") == emb], k).items():
            out[f"{emb}:{key}"] = g
    return out


def shift_pool(per_gen: int, seed: int = 0, difficulty: str = "default") -> list[dict]:
    from llmtool.train.rl_data import rg_dataset

    rows = []
    for g in GENERATORS:
        ds = rg_dataset(g, per_gen, seed, POOL_CONFIGS[difficulty].get(g))
        rows += [{"id": f"{g}-{i}", "prompt": ds[i]["question"], "answer": str(ds[i]["answer"]), "generator": g}
                 for i in range(per_gen)]
    return rows


def bench_shift(args) -> dict:
    from scipy.stats import spearmanr

    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.select_data import features as F
    from llmtool.select_data import shift
    from llmtool.select_data.corpora import embed_minilm
    from llmtool.select_data.methods import SELECTORS, run_selector

    rows = shift_pool(args.pool_per_gen)
    model, tok = load_model(args.model), load_tokenizer(args.model)
    t = time.time()
    res = F.extract(model, tok, [r["prompt"] for r in rows], max_new_tokens=args.max_new_tokens, batch_size=8)
    feat_s = time.time() - t
    feats = res["features"]
    feats["minilm"] = embed_minilm([r["prompt"] for r in rows])
    if args.sc_samples:
        feats["sc_entropy"] = F.sc_entropy(model, tok, [r["prompt"] for r in rows], samples=args.sc_samples,
                                           max_new_tokens=args.max_new_tokens, batch_size=8)
    gens = np.array([r["generator"] for r in rows])
    u = np.linalg.norm(feats["e"] - feats["s"], axis=1)
    out_rows = []
    for b in args.budgets:
        for name in SELECTORS.names():
            if name == "sc-entropy" and "sc_entropy" not in feats:
                continue
            seeds = range(5) if name in ("random", "kmeans-centres") else [None]
            covs = []
            for sd in seeds:
                kw = {"budget": b}
                if sd is not None:
                    kw["select_seed"] = sd
                picked = run_selector(SELECTORS.build(name, **kw), feats)["picked"]
                covs.append(len(set(gens[picked])))
            out_rows.append({"budget": b, "method": name, "generators_covered": round(float(np.mean(covs)), 2),
                             "sd": round(float(np.std(covs, ddof=1)), 2) if len(covs) > 1 else 0.0,
                             "of": len(GENERATORS)})
    diag = {"spearman_u_prompt_len": round(float(spearmanr(u, feats["prompt_len"]).statistic), 3),
            "spearman_u_gen_len": round(float(spearmanr(u, feats["gen_len"]).statistic), 3),
            "truncated_rate": round(float(feats["truncated"].mean()), 3),
            "rollouts_per_s": round(len(rows) / feat_s, 3), "pool": len(rows)}
    # selection cost at the pool size and at a synthetic 100k pool (O(N·B) farthest-first)
    s = feats["s"].astype(np.float64)
    t = time.time()
    shift.shift_select(s, feats["e"], 16)
    diag["select_seconds_pool"] = round(time.time() - t, 4)
    rng = np.random.default_rng(0)
    big_s, big_e = rng.normal(size=(100_000, 64)), rng.normal(size=(100_000, 64))
    t = time.time()
    c = shift.DistanceCounter()
    shift.shift_select(big_s, big_e, 16, counter=c)
    diag["select_seconds_100k_d128_B16"] = round(time.time() - t, 2)
    diag["distance_evals_100k"] = c.count
    return {"rows": out_rows, "diagnostics": diag}


def _split_heldout(rows: list[dict], fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Hold out ``fraction`` of every source category (at least 2 documents) for the extrinsic evaluation."""
    rng = np.random.default_rng(seed)
    by: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by.setdefault(r["source"], []).append(i)
    held = set()
    for members in by.values():
        n = max(2, int(round(fraction * len(members)))) if len(members) >= 4 else 0
        held.update(int(i) for i in rng.choice(members, size=n, replace=False))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def category_losses(model, tok, rows: list[dict]) -> dict[str, float]:
    """Mean token NLL (nats) per source category of held-out documents, each scored after an EOS token."""
    from llmtool.core.lm import completion_nll

    eos = tok.decode([tok.eos_token_id])
    nll = completion_nll(model, tok, [eos] * len(rows), [r["text"] for r in rows], batch_size=16)
    ntok = [len(tok(r["text"], add_special_tokens=False)["input_ids"]) for r in rows]
    tot: dict[str, list[float]] = {}
    for r, v, n in zip(rows, nll, ntok):
        t = tot.setdefault(r["source"], [0.0, 0])
        t[0], t[1] = t[0] + v, t[1] + n
    return {k: v[0] / v[1] for k, v in sorted(tot.items())}


def mix_inputs(args) -> dict:
    """What every seed of the GEM extrinsic part shares, computed once per invocation: the corpus and its
    held-out split, the tokenizer, the MiniLM embeddings, the document lengths and the untrained model's
    held-out losses."""
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.select_data.corpora import embed_minilm

    rows = gem_corpus(args.fortunes, args.austen, args.synthetic)
    train_rows, held = _split_heldout(rows, args.heldout)
    info(f"mix: {len(train_rows)} training documents, {len(held)} held out over "
         f"{len({r['source'] for r in held})} source categories")
    tok = load_tokenizer(args.model)
    emb = embed_minilm([r["text"] for r in train_rows], batch_size=64)
    lengths = [len(ids) + 1 for ids in tok([r["text"] for r in train_rows], add_special_tokens=False)["input_ids"]]
    base = load_model(args.model)
    base_losses = category_losses(base, tok, held)
    del base
    return {"train_rows": train_rows, "held": held, "tok": tok, "emb": emb, "lengths": lengths,
            "base_losses": base_losses}


def bench_mix(args, seed: int = 0, inputs: dict | None = None) -> dict:
    """GEM extrinsic: domain weights from natural / uniform / DoReMi / RegMix on the GEM, K-Means and source
    taxonomies, then continued training of the default model on each mixture with one token budget, scored
    by held-out loss per source category (mean and worst); RegMix predictability per taxonomy.

    ``seed`` is the whole pipeline's seed: the clusterers' initialisation, the mixers' proxies and data order,
    the sampled training stream and the continued training. The corpus and the held-out documents are the same
    for every seed (seed 0 reproduces the single-seed run that preceded ``--mix-seeds``); ``inputs`` are
    :func:`mix_inputs`, shared by the seeds of one invocation."""
    import torch

    from llmtool.core.intervals import bootstrap_mean_ci
    from llmtool.core.models import load_model
    from llmtool.core.trainer import TrainArgs, pack_texts, sft
    from llmtool.select_data.methods import CLUSTERERS, MIXERS, run_clusterer, run_mixer
    from llmtool.select_data.proxies import build_domain_data, sample_stream

    inputs = inputs or mix_inputs(args)
    train_rows, held, tok, emb, lengths = (inputs[k] for k in ("train_rows", "held", "tok", "emb", "lengths"))
    taxonomies = {}
    for name in ("gem", "kmeans", "source"):
        cfg = CLUSTERERS.build(name, **({} if name == "source" else {"k": args.k, "cluster_seed": seed}))
        res, _ = run_clusterer(cfg, emb, [r["source"] for r in train_rows])
        taxonomies[name] = [str(int(x)) for x in res.labels]
    proxy_kw = {"steps": args.proxy_steps, "proxy_vocab": args.proxy_vocab, "mix_seed": seed}
    arms, weights_out, mixer_rows = [], {}, []
    for tax, labels in taxonomies.items():
        data = build_domain_data([r["text"] for r in train_rows], labels, tok, vocab=args.proxy_vocab)
        # natural weights give one document distribution whatever the taxonomy: one arm
        mixers = (["natural"] if tax == "gem" else []) + [m for m in args.mixers.split(",") if m != "natural"]
        for mixer in mixers:
            kw = dict(proxy_kw) if mixer in ("doremi", "regmix") else {}
            if mixer == "regmix":  # fewer tokens per proxy: this corpus is small and RegMix caps epochs per domain
                kw.update(proxies=args.regmix_proxies, steps=args.regmix_steps, proxy_batch_size=args.regmix_batch)
            t = time.time()
            out = run_mixer(MIXERS.build(mixer, **kw), data)
            sec = time.time() - t
            w = np.asarray(out["weights"])
            arm = "natural" if mixer == "natural" else f"{tax}+{mixer}"
            arms.append((arm, tax, labels, data.names, w))
            ent = float(-(w[w > 0] * np.log(w[w > 0])).sum() / np.log(len(w)))
            row = {"arm": arm, "taxonomy": tax, "mixer": mixer, "domains": data.k, "seconds": round(sec, 1),
                   "max_weight": round(float(w.max()), 4), "weight_entropy": round(ent, 4)}
            if "predictability" in out:
                p = out["predictability"]
                row["regmix_rho_median"] = None if p["median"] is None else round(p["median"], 3)
                row["regmix_rho_iqr"] = None if p["iqr"] is None else [round(x, 3) for x in p["iqr"]]
                row["regmix_proxy_target_range"] = [round(float(np.min(out["proxy_target"])), 4),
                                                    round(float(np.max(out["proxy_target"])), 4)]
            mixer_rows.append(row)
            weights_out[arm] = {"domains": data.names, "weights": [round(float(x), 6) for x in w]}
            info(str(row))
    block, batch = args.mix_block, args.mix_batch
    steps = max(1, args.mix_tokens // (block * batch))
    results = [{"arm": "base (no training)", **_loss_summary(inputs["base_losses"])}]
    per_cat = {"base (no training)": results[0]["per_category"]}
    for arm, tax, labels, names, w in arms:
        order, meta = sample_stream(labels, names, w, lengths, tokens=steps * block * batch + block, seed=seed)
        blocks = pack_texts(tok, [train_rows[i]["text"] for i in order], block, max_blocks=steps * batch)
        torch.manual_seed(seed)
        model = load_model(args.model)
        t = time.time()
        fit = sft(model, tok, blocks, TrainArgs(lr=args.mix_lr, max_steps=steps, batch_size=batch, max_length=block,
                                                seed=seed, warmup_ratio=0.05))
        summ = _loss_summary(category_losses(model, tok, held))
        per_cat[arm] = summ["per_category"]
        results.append({"arm": arm, **summ, "train_loss": round(float(fit["train_loss"]), 4),
                        "max_epochs": round(max(meta["epochs"].values()), 2), "seconds": round(time.time() - t, 1)})
        info(f"{arm}: mean {summ['mean']:.4f} worst {summ['worst']:.4f}")
        del model
    nat = np.array(list(per_cat["natural"].values()))
    rng = np.random.default_rng(0)
    for r in results:
        d = np.array(list(per_cat[r["arm"]].values())) - nat
        idx = np.stack([rng.integers(0, len(d), len(d)) for _ in range(2000)])
        r["mean_minus_natural"] = round(float(d.mean()), 4)
        r["mean_minus_natural_ci"] = [round(x, 4) for x in bootstrap_mean_ci(d, idx)]
    return {"seed": seed, "train_docs": len(train_rows), "heldout_docs": len(held), "categories": len(nat), "steps": steps,
            "tokens": steps * block * batch, "mixers": mixer_rows, "weights": weights_out,
            "rows": [{k: v for k, v in r.items() if k != "per_category"} for r in results], "per_category": per_cat}


def mix_runs(mix: dict) -> list[dict]:
    """The per-seed runs of a stored mix part (a result from before ``--mix-seeds`` is one run of seed 0)."""
    return mix["runs"] if "runs" in mix else [{**mix, "seed": mix.get("seed", 0)}]


def mix_seed_summary(runs: list[dict], boot: int = 2000) -> list[dict]:
    """Per arm over the seeds: mean held-out loss (mean ± sd over seeds), the difference to the natural mixture
    of the same seed (mean over seeds, and in how many seeds it is below zero), and a 95 % two-level bootstrap
    interval of that difference: each draw resamples the seeds (runs), then the source categories, so the
    interval carries the run-to-run variation as well as the categories' (with one seed it is over categories)."""
    arms = [r["arm"] for r in runs[0]["rows"]]
    cats = list(runs[0]["per_category"]["natural"])
    rng = np.random.default_rng(0)
    out = []
    for arm in arms:
        have = [r for r in runs if arm in r["per_category"]]
        means = np.array([np.mean([r["per_category"][arm][c] for c in cats]) for r in have])
        diffs = np.array([[r["per_category"][arm][c] - r["per_category"]["natural"][c] for c in cats] for r in have])
        per_seed = diffs.mean(axis=1)
        s_idx = rng.integers(0, len(have), (boot, len(have)))
        c_idx = rng.integers(0, len(cats), (boot, len(cats)))
        draws = np.array([diffs[s_idx[b]][:, c_idx[b]].mean() for b in range(boot)])
        lo, hi = np.percentile(draws, [2.5, 97.5])
        out.append({"arm": arm, "seeds": len(have), "mean_loss": round(float(means.mean()), 4),
                    "mean_loss_sd": round(float(means.std(ddof=1)) if len(have) > 1 else 0.0, 4),
                    "minus_natural": round(float(per_seed.mean()), 4),
                    "minus_natural_ci": [round(float(lo), 4), round(float(hi), 4)],
                    "per_seed_minus_natural": [round(float(x), 4) for x in per_seed],
                    "seeds_below_natural": int((per_seed < 0).sum())})
    return out


_MIX_PROTOCOL = ("model", "fortunes", "austen", "synthetic", "k", "heldout", "proxy_steps", "proxy_vocab",
                 "regmix_proxies", "regmix_steps", "regmix_batch", "mix_tokens", "mixers", "mix_block", "mix_batch",
                 "mix_lr")


def _same_mix_protocol(old: dict, new: dict) -> bool:
    """Runs of two invocations belong in one seed summary only when every argument that shapes the mix part agrees."""
    return all(old.get(k) == new.get(k) for k in _MIX_PROTOCOL)


def _loss_summary(per: dict[str, float]) -> dict:
    v = np.array(list(per.values()))
    worst = max(per, key=per.get)
    return {"mean": round(float(v.mean()), 4), "worst": round(float(v.max()), 4), "worst_category": worst,
            "per_category": {k: round(x, 4) for k, x in per.items()}}


def _pm(r: dict, key: str, nd: int = 3) -> str:
    if key not in r:
        return "–"
    sd = r.get(key + "_sd", 0.0)
    return f"{r[key]:.{nd}f}" + (f" ± {sd:.{nd}f}" if r.get("seeds", 1) > 1 else "")


def gem_markdown(g: dict, a: dict) -> list[str]:
    """The GEM part of the report: per embedder its geometry, the seed-mean table, the gates, then per-seed rows."""
    # the per-seed rows are the record: seed means are recomputed from them (older results stored fewer of them)
    summary = gem_summary(g["rows"], GEM_METHODS) if g.get("rows") else (g.get("summary") or [])
    embedders = list(dict.fromkeys(r.get("embedder", "minilm") for r in summary)) or ["minilm"]
    tax = g.get("gem_taxonomy") or {}
    if isinstance(tax, list):  # results written before the embedder setting
        tax = {"minilm": tax}
    names = {"minilm": "all-MiniLM-L6-v2 (mean pooled, L2-normalised)",
             "lm": f"{g.get('lm_model', a.get('lm_model', 'smollm2-135m'))} mean-pooled last hidden state (unnormalised)"}
    md = [f"## GEM intrinsic ({g['n_docs']} docs, K={a['k']}, seeds {a['seeds']}, max_iter {a['max_iter']})", "",
          "Every method on each embedder. `kmeans` clusters the raw vectors (Euclidean); the others the L2-normalised "
          "ones. `top2_share` = corpus share of the two largest clusters; `synthetic_top2` = share of the "
          "reasoning-gym block held by its two largest clusters; student = " + g.get(
              "student", "not measured") + " (agreement = held-out accuracy against the partition's labels, κ = "
          "Cohen's kappa, chance-corrected). Mean ± sd over seeds (`gem-mm` and `source`: seed 0 only).", ""]
    cols = (("norm_entropy", "entropy"), ("max_share", "largest"), ("top2_share", "top-2"),
            ("min_share", "smallest"), ("mean_cos", "mean cos"), ("silhouette_cos", "silhouette (cos)"),
            ("student_agreement", "student agr."), ("student_kappa", "student κ"),
            ("synthetic_top2", "synthetic top-2"), ("nmi_source", "NMI source"))
    for emb in embedders:
        geo = (g.get("geometry") or {}).get(emb)
        md += [f"### Embedder `{emb}`: {names.get(emb, emb)}", ""]
        if geo:
            md += ["Geometry: " + ", ".join(f"{k} {v}" for k, v in geo.items()), ""]
        rows = [r for r in summary if r.get("embedder", "minilm") == emb]
        md += ["| method | seeds | " + " | ".join(c[1] for c in cols) + " |",
               "|---|---|" + "---|" * len(cols)]
        for r in rows:
            md.append(f"| {r['method']} | {r['seeds']} | " + " | ".join(_pm(r, c[0]) for c in cols) + " |")
        md += ["", "Gates (seed means):", "",
               *gate_lines(gem_gates(rows, a["k"]) if rows else {}), ""]
    md += ["### Per seed", "", markdown_table(g["rows"]), ""]
    for emb, t in tax.items():
        md += [f"### GEM taxonomy (GIS names), embedder `{emb}`, seed {a['seeds'][0]}", "", markdown_table(t or []), ""]
    return md


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fortunes", type=int, default=3000, help="fortunes sampled (0 = all ≈14k)")
    ap.add_argument("--austen", type=int, default=500)
    ap.add_argument("--synthetic", type=int, default=490)
    ap.add_argument("--k", type=int, default=24)
    ap.add_argument("--max-iter", type=int, default=200, help="GEM / vMF / movMF-EM iterations (spec default 200)")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--embedders", type=lambda s: [x for x in s.split(",") if x], default=["minilm", "lm"],
                    help="GEM part: minilm (normalised sentence embeddings) and/or lm (unnormalised mean-pooled LM "
                         "hidden states of --lm-model)")
    ap.add_argument("--lm-model", default="smollm2-135m", help="GEM part: the causal LM of the lm embedder")
    ap.add_argument("--pool-per-gen", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--sc-samples", type=int, default=8, help="SHIFT: sampled answers for sc-entropy (0 = skip)")
    ap.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[7, 16])
    ap.add_argument("--heldout", type=float, default=0.1, help="mix: held-out fraction per source category")
    ap.add_argument("--proxy-steps", type=int, default=300, help="mix: updates per proxy model")
    ap.add_argument("--proxy-vocab", type=int, default=4096, help="mix: proxies' compact vocabulary")
    ap.add_argument("--regmix-proxies", type=int, default=32, help="mix: RegMix proxy models per taxonomy")
    ap.add_argument("--regmix-steps", type=int, default=50, help="mix: updates per RegMix proxy")
    ap.add_argument("--regmix-batch", type=int, default=16, help="mix: sequences per RegMix proxy update")
    ap.add_argument("--mix-tokens", type=int, default=102400, help="mix: continued-training tokens per mixture")
    ap.add_argument("--mixers", default="uniform,doremi,regmix", help="mix: mixers per taxonomy (natural always runs once)")
    ap.add_argument("--mix-block", type=int, default=128)
    ap.add_argument("--mix-batch", type=int, default=8)
    ap.add_argument("--mix-lr", type=float, default=5e-5)
    ap.add_argument("--mix-seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                    help="mix: pipeline seeds (clusterers, mixers' proxies, training stream and run); stored runs of "
                         "other seeds made with the same mix arguments are kept and summarised with these")
    ap.add_argument("--skip", default="", help="comma list: gem,shift,mix")
    ap.add_argument("--out", default="benchmarks/results/select_data")
    args = ap.parse_args()
    skip = set(args.skip.split(",")) - {""}
    out = Path(args.out)
    result = {"args": vars(args)}
    if skip and out.with_suffix(".json").is_file():  # keep the earlier run's results of skipped parts
        old = json.loads(out.with_suffix(".json").read_text())
        for part in skip & {"gem", "shift", "mix"}:
            if part in old:
                result[part] = old[part]
                result[f"args_{part}"] = old.get(f"args_{part}", old.get("args"))
    for part in {"gem", "shift", "mix"} - skip:
        result[f"args_{part}"] = vars(args)
    rebuilt = skip >= {"gem", "shift", "mix"}  # nothing run: the report is rebuilt from the stored results
    if rebuilt and out.with_suffix(".json").is_file():
        stored = json.loads(out.with_suffix(".json").read_text())
        result["args"] = stored.get("args", result["args"])
        result["last_command"] = stored.get("last_command")
    else:
        result["last_command"] = " ".join(["benchmarks/select_data.py", *sys.argv[1:]])
    md = ["# select-data benchmark", "", (f"Last command: `{result['last_command']}` " if result.get("last_command")
                                          else "") + "(each part's arguments are in the JSON as args_gem / args_shift / "
          "args_mix)" + ("; this report was rebuilt from the stored results by `benchmarks/select_data.py --skip "
                         "gem,shift,mix`" if rebuilt else ""), ""]
    if "gem" not in skip:
        result["gem"] = bench_gem(args)
    if "gem" in result:
        md += gem_markdown(result["gem"], result["args_gem"])
    if "shift" not in skip:
        result["shift"] = bench_shift(args)
    if "shift" in result:
        s = result["shift"]
        a = result["args_shift"]
        md += [f"## SHIFT without RL (pool {s['diagnostics']['pool']}, {a['model']}, "
               f"{a['max_new_tokens']} new tokens)", "", markdown_table(s["rows"]), "",
               "```", json.dumps(s["diagnostics"], indent=1), "```", ""]
    if "mix" not in skip:
        kept = []
        if out.with_suffix(".json").is_file():  # earlier seeds of the same protocol join the summary
            old = json.loads(out.with_suffix(".json").read_text())
            if "mix" in old and _same_mix_protocol(old.get("args_mix", old.get("args", {})), vars(args)):
                kept = [r for r in mix_runs(old["mix"]) if r["seed"] not in args.mix_seeds]
        inputs = mix_inputs(args)
        runs = sorted(kept + [bench_mix(args, seed, inputs) for seed in args.mix_seeds], key=lambda r: r["seed"])
        result["mix"] = {"runs": runs, "seeds": [r["seed"] for r in runs]}
    if "mix" in result:
        runs = mix_runs(result["mix"])
        summ = mix_seed_summary(runs)  # recomputed, so a report rebuilt from stored runs carries the current interval
        if "runs" in result["mix"]:
            result["mix"]["summary"] = summ
        m = runs[0]
        a = result["args_mix"]
        md += [f"## GEM extrinsic: mixers on three taxonomies, continued training of {a['model']}", "",
               f"{m['train_docs']} training documents; {m['heldout_docs']} held out over {m['categories']} source "
               f"categories. Proxies: 2 layers, d 128, {a['proxy_vocab']}-id compact vocabulary, {a['proxy_steps']} "
               f"updates (DoReMi); RegMix {a['regmix_proxies']} proxies × {a['regmix_steps']} updates × {a['regmix_batch']} "
               f"sequences. Continued training: {m['steps']} steps × "
               f"{a['mix_batch']} × {a['mix_block']} tokens ({m['tokens']} tokens), lr {a['mix_lr']}, pipeline seeds "
               f"{', '.join(str(r['seed']) for r in runs)}.", ""]
        if len(runs) > 1:
            md += ["Over seeds: mean held-out loss (mean ± sd over seeds); mean − natural of the same seed, averaged "
                   "over seeds, with a 95 % two-level bootstrap interval (seeds resampled, then categories); the "
                   "per-seed differences and the seeds in which the arm is below natural:", "",
                   markdown_table([{"arm": r["arm"], "seeds": r["seeds"],
                                    "mean loss": f"{r['mean_loss']:.4f} ± {r['mean_loss_sd']:.4f}",
                                    "mean − natural [95 % CI]": f"{r['minus_natural']:+.4f} [{r['minus_natural_ci'][0]:+.4f}, "
                                                                f"{r['minus_natural_ci'][1]:+.4f}]",
                                    "per seed": " / ".join(f"{x:+.4f}" for x in r["per_seed_minus_natural"]),
                                    "below natural": f"{r['seeds_below_natural']}/{r['seeds']}"} for r in summ]), ""]
        for r in runs:
            md += [f"### Seed {r['seed']}", "", "Mixers:", "", markdown_table(r["mixers"]), "",
                   "Held-out loss per source category (nats/token; mean and worst over categories; difference to the "
                   "natural mixture with a 95 % bootstrap interval over categories):", "", markdown_table(r["rows"]), ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=float))
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
