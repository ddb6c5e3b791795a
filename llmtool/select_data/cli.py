"""`llmtool select-data`: GEM domain discovery (embed → cluster → distill → label), domain weights on any
taxonomy (mix → sample), and SHIFT RLVR subset selection (features → select). Heavy imports happen inside
the commands."""

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtool.core.console import UsageError, emit, info, progress
from llmtool.core.preflight import preflight  # torch-free: fail fast before heavy imports
from llmtool.core.options import OutDirArg, Overwrite
from llmtool.core.registry import MethodConfig, method_options
from llmtool.select_data.methods import CLUSTERERS, MIXERS, SELECTORS

app = typer.Typer(help="Data selection: GEM domain discovery on the hypersphere, SHIFT RLVR subset selection.",
                  no_args_is_help=True)

Corpus = Annotated[Path, typer.Argument(help="Corpus JSONL: {\"id\", \"text\", \"source\"?} per line.",
                                        metavar="CORPUS")]
Pool = Annotated[Path, typer.Argument(help="Pool JSONL: {\"id\", \"prompt\", ...} per line (other fields untouched).",
                                      metavar="POOL")]


def _load_embeddings(path: Path, rows: list[dict]):
    from safetensors.numpy import load_file
    from safetensors import safe_open

    from llmtool.select_data.corpora import ids_hash

    if not path.is_file():
        raise UsageError(f"{path}: no such embeddings file")
    try:
        with safe_open(str(path), "np") as fh:
            meta = fh.metadata() or {}
        emb = load_file(str(path))["embeddings"]
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a usage error
        raise UsageError(f"{path}: not a select-data embeddings file ({exc.__class__.__name__})") from None
    if emb.shape[0] != len(rows) or meta.get("ids_sha256") != ids_hash(r["id"] for r in rows):
        raise UsageError(f"{path}: embeddings do not match the corpus (rows {emb.shape[0]} vs {len(rows)}, "
                         "or the id list differs)")
    return emb


@app.command("embed")
def embed(corpus: Corpus,
          out: Annotated[Path, typer.Option("-o", "--out", help="Output .safetensors file.")],
          embedder: Annotated[str, typer.Option("--embedder", help="minilm (all-MiniLM-L6-v2) or lm (mean-pooled "
                                                "hidden state of --model).")] = "minilm",
          model: Annotated[Optional[str], typer.Option("--model", help="Causal LM for --embedder lm.")] = None,
          max_length: Annotated[int, typer.Option("--max-length", min=8, help="Tokens per document.")] = 128,
          batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Throughput only.")] = 32,
          overwrite: Overwrite = False):
    """Embed every corpus line (row i = line i); the id list's hash is stored and checked on load."""
    preflight(model if embedder == "lm" else None, out, inputs=(corpus,), overwrite=overwrite)
    from llmtool.core.checkpoint import atomic_file
    from llmtool.select_data.corpora import embed_lm, embed_minilm, ids_hash, read_jsonl

    if embedder not in ("minilm", "lm"):
        raise UsageError(f"--embedder {embedder!r}: choose minilm or lm")
    if embedder == "lm" and model is None:
        raise UsageError("--embedder lm needs --model")
    rows = read_jsonl(corpus, ("text",))
    texts = [r["text"] for r in rows]
    from llmtool.core import eta_plans as plans

    shape = plans.MINILM if embedder == "minilm" else plans.Shape.of(model)
    plans.announce(plans.embed(shape, texts, max_length), shape, "select-data embed")
    with atomic_file(out, overwrite) as tmp:
        if embedder == "minilm":
            emb = embed_minilm(texts, batch_size=batch_size, max_length=max_length, progress=progress)
            name = "all-MiniLM-L6-v2"
        else:
            from llmtool.core.models import load_model, load_tokenizer

            emb = embed_lm(load_model(model), load_tokenizer(model), texts, batch_size=batch_size,
                           max_length=max_length, progress=progress)
            name = str(model)
        from safetensors.numpy import save_file

        save_file({"embeddings": emb}, str(tmp), metadata={"model": name, "normalized": str(embedder == "minilm").lower(),
                                                           "ids_sha256": ids_hash(r["id"] for r in rows)})
    emit({"rows": len(rows), "dim": int(emb.shape[1]), "embedder": name, "out": str(out)})


@app.command("cluster")
@method_options(CLUSTERERS, default="gem")
def cluster(corpus: Corpus, out: OutDirArg, config: MethodConfig,
            embeddings: Annotated[Path, typer.Option("--embeddings", help="From `select-data embed`.")],
            top_docs: Annotated[int, typer.Option("--top-docs", min=1, help="Prototypes per domain.")] = 3,
            top_terms: Annotated[int, typer.Option("--top-terms", min=1, help="Name terms per domain.")] = 6,
            beta: Annotated[float, typer.Option("--beta", min=0.0, help="GIS weight of local density.")] = 1.0,
            overwrite: Overwrite = False):
    """Cut the corpus into domains (GEM or a baseline); writes assignments, model, taxonomy, summary."""
    preflight(None, out, inputs=(corpus, embeddings), overwrite=overwrite)
    import numpy as np

    from llmtool.core.job import job
    from llmtool.select_data import gem, gis
    from llmtool.select_data.corpora import read_jsonl
    from llmtool.select_data.methods import run_clusterer

    rows = read_jsonl(corpus, ("text",))
    emb = _load_embeddings(embeddings, rows)
    with job("select-data cluster", out=out, overwrite=overwrite, config=config, inputs=(corpus, embeddings)) as j:
        res, names = run_clusterer(config, emb, [r.get("source") for r in rows], progress=progress)
        x = gem.normalize(emb.astype(np.float64))
        k = res.k
        scores = gem.gis_scores(x, res, beta=beta)
        taxonomy = gis.taxonomy([r["text"] for r in rows], res.labels, scores, k, top_terms=top_terms,
                                top_docs=top_docs, ids=[r["id"] for r in rows])
        if names:
            for t in taxonomy:
                t["source"] = names[t["domain"]]
        with open(j.dir / "assignments.jsonl", "w") as fh:
            for i, r in enumerate(rows):
                rec = {"id": r["id"], "domain": int(res.labels[i]), "gis": float(scores[i])}
                if res.q is not None:
                    rec["p_max"] = float(res.q[i].max())
                fh.write(json.dumps(rec) + "\n")
        from safetensors.numpy import save_file

        tensors = {"mu": res.mu.astype(np.float32)}
        if res.kappa is not None:
            tensors["kappa"] = res.kappa.astype(np.float32)
            tensors["prior"] = res.prior.astype(np.float32)
        save_file(tensors, str(j.dir / "model.safetensors"))
        (j.dir / "taxonomy.json").write_text(json.dumps(taxonomy, indent=2))
        summary = gem.intrinsic(res.labels, k, x)
        summary.update({"method": config.name, "n": len(rows), "iterations": res.iterations,
                        "objective_trace": [float(v) for v in res.trace], "reseeds": res.events})
        (j.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        j.report.update({k2: v for k2, v in summary.items() if k2 not in ("objective_trace", "reseeds")})
    emit(j.report, rows=[{"domain": t["domain"], "share": round(t["share"], 4), "name": t["name"]} for t in taxonomy],
         title=f"{config.name}: {k} domains")


@app.command("features")
def features_cmd(pool: Pool, out: OutDirArg,
                 model: Annotated[str, typer.Option("--model", help="Policy model (dir or default alias).")] = "smollm2-135m",
                 max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Rollout length cap.")] = 128,
                 layers: Annotated[str, typer.Option("--layers", help="mean (over decoder layers), last, or an index.")] = "mean",
                 template: Annotated[str, typer.Option("--prompt-template", help="math or raw.")] = "math",
                 minilm: Annotated[bool, typer.Option("--minilm", help="Also store MiniLM prompt embeddings.")] = False,
                 sc_samples: Annotated[int, typer.Option("--sc-samples", min=0, help="Also store the self-consistency "
                                                         "entropy of this many sampled answers (T 1; 0 = off).")] = 0,
                 batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Throughput only.")] = 8,
                 overwrite: Overwrite = False):
    """One greedy rollout per prompt and the hidden-state anchors SHIFT and its baselines read."""
    preflight(model, out, inputs=(pool,), overwrite=overwrite)  # fail fast, before torch is imported
    import numpy as np

    from llmtool.core.job import job
    from llmtool.select_data import features as F
    from llmtool.select_data.corpora import embed_minilm, ids_hash, read_jsonl

    if layers not in ("mean", "last") and not layers.lstrip("-").isdigit():
        raise UsageError(f"--layers {layers!r}: mean, last or a layer index")
    if template not in ("math", "raw"):
        raise UsageError(f"--prompt-template {template!r}: math or raw")
    rows = read_jsonl(pool, ("prompt",))
    with job("select-data features", out=out, overwrite=overwrite, model=model, inputs=(pool,)) as j:
        res = F.extract(j.model, j.tokenizer, [r["prompt"] for r in rows], max_new_tokens=max_new_tokens,
                        batch_size=batch_size, layers=layers, template=template, progress=progress)
        feats = res["features"]
        if minilm:
            feats["minilm"] = embed_minilm([r["prompt"] for r in rows], progress=progress)
        if sc_samples:
            feats["sc_entropy"] = F.sc_entropy(j.model, j.tokenizer, [r["prompt"] for r in rows], samples=sc_samples,
                                               max_new_tokens=max_new_tokens, batch_size=batch_size,
                                               template=template, progress=progress)
        from safetensors.numpy import save_file

        save_file(feats, str(j.dir / "features.safetensors"),
                  metadata={"model": str(model), "layers": layers, "template": template,
                            "ids_sha256": ids_hash(r["id"] for r in rows)})
        with open(j.dir / "rollouts.jsonl", "w") as fh:
            for r, c in zip(rows, res["rollouts"]):
                fh.write(json.dumps({"id": r["id"], **c}) + "\n")
        u = np.linalg.norm(feats["e"] - feats["s"], axis=1)
        j.report.update({"n": len(rows), "truncated_rate": float(feats["truncated"].mean()),
                         "rirs_norm_mean": float(u.mean()), "mean_gen_len": float(feats["gen_len"].mean())})
    emit(j.report)


def load_features(path: Path, rows: list[dict]) -> dict:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    from llmtool.select_data.corpora import ids_hash

    f = path / "features.safetensors" if path.is_dir() else path
    if not f.is_file():
        raise UsageError(f"{path}: no features.safetensors (make it with `select-data features`)")
    with safe_open(str(f), "np") as fh:
        meta = fh.metadata() or {}
    feats = load_file(str(f))
    if len(feats["s"]) != len(rows) or meta.get("ids_sha256") != ids_hash(r["id"] for r in rows):
        raise UsageError(f"{f}: features do not match the pool (rows or ids differ)")
    return feats


@app.command("select")
@method_options(SELECTORS, default="shift")
def select(pool: Pool, config: MethodConfig,
           features: Annotated[Path, typer.Option("--features", help="Directory from `select-data features`.")],
           out: Annotated[Path, typer.Option("-o", "--out", help="Output subset JSONL.")],
           overwrite: Overwrite = False):
    """Pick a budget of pool prompts (label-free: only features are read, never answers)."""
    preflight(None, out, inputs=(pool, features), overwrite=overwrite)
    import numpy as np
    from scipy.stats import spearmanr

    from llmtool.core.checkpoint import atomic_file
    from llmtool.select_data.corpora import read_jsonl
    from llmtool.select_data.methods import run_selector

    rows = read_jsonl(pool, ("prompt",))
    feats = load_features(features, rows)
    res = run_selector(config, feats)
    picked = [int(i) for i in res["picked"]]
    u = np.linalg.norm(feats["e"].astype(np.float64) - feats["s"].astype(np.float64), axis=1)
    def rank_corr(a, b):
        if np.ptp(a) == 0 or np.ptp(b) == 0:
            return None  # undefined for a constant input
        return float(spearmanr(a, b).statistic)

    meta = {"config": config.as_dict(), "n": len(rows), "selected": len(picked),
            "spearman_u_gen_len": rank_corr(u, feats["gen_len"]),
            "spearman_u_prompt_len": rank_corr(u, feats["prompt_len"]),
            "truncated_in_subset": float(np.mean(feats["truncated"][picked]))}
    if "coverage_radius" in res:
        meta["coverage_radius"] = res["coverage_radius"]
    with atomic_file(out, overwrite) as tmp:
        with open(tmp, "w") as fh:
            for r, i in enumerate(picked):
                rec = dict(rows[i])
                rec["select"] = {"rank": r, "rirs_norm": float(u[i])}
                if "min_dist" in res:
                    rec["select"]["min_dist"] = float(res["min_dist"][r])
                fh.write(json.dumps(rec) + "\n")
    meta_path = Path(str(out) + ".meta.json")
    meta_path.write_text(json.dumps(meta, indent=2))
    info(f"wrote {out} and {meta_path}")
    emit(meta, rows=[{"rank": r, "id": rows[i]["id"], "rirs_norm": round(float(u[i]), 3)} for r, i in enumerate(picked)])


@app.command("distill")
def distill_cmd(domains: Annotated[Path, typer.Argument(help="OUT directory of `select-data cluster`.",
                                                        metavar="DOMAINS")],
                corpus: Corpus,
                out: Annotated[Path, typer.Option("-o", "--out", help="Output fastText student (.bin).")],
                per_domain: Annotated[int, typer.Option("--per-domain", min=1, help="Top-GIS documents per domain.")] = 400,
                epoch: Annotated[int, typer.Option("--epoch", min=1, help="fastText epochs.")] = 5,
                overwrite: Overwrite = False):
    """Train the fastText student on GIS-selected, domain-balanced pseudo-labels; report agreement."""
    preflight(None, out, inputs=(domains, corpus), overwrite=overwrite)
    import numpy as np

    from llmtool.core.checkpoint import atomic_file
    from llmtool.select_data.corpora import read_jsonl
    from llmtool.select_data.distill import train_student

    rows = read_jsonl(corpus, ("text",))
    assign = read_jsonl(domains / "assignments.jsonl", ()) if (domains / "assignments.jsonl").is_file() else None
    if assign is None:
        raise UsageError(f"{domains}: no assignments.jsonl (make it with `select-data cluster`)")
    if [a["id"] for a in assign] != [r["id"] for r in rows]:
        raise UsageError(f"{domains}/assignments.jsonl: ids do not match {corpus}")
    labels = np.array([int(a["domain"]) for a in assign])
    gis = np.array([float(a["gis"]) for a in assign])
    model, metrics = train_student([r["text"] for r in rows], labels, gis, per_domain=per_domain, epoch=epoch)
    if metrics["agreement"] < 0.8:
        info(f"warning: student agrees with the teacher on only {metrics['agreement']:.3f} of held-out documents")
    with atomic_file(out, overwrite) as tmp:
        model.save_model(str(tmp))
    emit(metrics)


@app.command("label")
def label_cmd(corpus: Corpus,
              student: Annotated[Path, typer.Option("--student", help="fastText student from `select-data distill`.")],
              out: Annotated[Path, typer.Option("-o", "--out", help="Output JSONL (input lines + domain, domain_p).")],
              overwrite: Overwrite = False):
    """Stream a corpus through the student, adding `domain` and `domain_p` to every line."""
    from llmtool.core.checkpoint import atomic_file
    from llmtool.select_data.distill import predict

    if not student.is_file():
        raise UsageError(f"{student}: no such student file")
    if not corpus.is_file():
        raise UsageError(f"{corpus}: no such file")
    import fasttext

    model = fasttext.load_model(str(student))
    n = 0
    from llmtool.core.data import iter_jsonl

    with atomic_file(out, overwrite) as tmp, open(tmp, "w") as dst:
        for i, row in iter_jsonl(corpus):  # streams: a corpus of any size
            if not isinstance(row.get("text"), str):
                raise UsageError(f"{corpus}:{i}: missing string field 'text'")
            lab, p = predict(model, [row["text"]])
            row["domain"], row["domain_p"] = int(lab[0]), float(p[0])
            dst.write(json.dumps(row) + "\n")
            n += 1
    emit({"labelled": n, "out": str(out)})


DomainsOpt = Annotated[Optional[Path], typer.Option("--domains", help="A `select-data cluster` OUT directory whose "
                                                    "assignments.jsonl gives each line's domain (ids must match).")]
FieldOpt = Annotated[str, typer.Option("--field", help="Without --domains: the corpus field holding the domain "
                                       "(`domain` from `select-data label`; `source` for the human taxonomy).")]
TokenizerOpt = Annotated[str, typer.Option("--tokenizer", help="Tokenizer (model dir or alias) counting tokens.")]


def _corpus_domains(corpus: Path, domains: Optional[Path], field: str) -> tuple[list[dict], list[str]]:
    """Corpus rows and one domain label (a string) per row, from a cluster's assignments or a field."""
    from llmtool.select_data.corpora import read_jsonl

    rows = read_jsonl(corpus, ("text",))
    if domains is not None:
        path = domains / "assignments.jsonl" if domains.is_dir() else domains
        if not path.is_file():
            raise UsageError(f"{domains}: no assignments.jsonl (make it with `select-data cluster`)")
        assign = read_jsonl(path, ())
        if [str(a.get("id")) for a in assign] != [str(r["id"]) for r in rows]:
            raise UsageError(f"{path}: ids do not match {corpus}")
        return rows, [str(a["domain"]) for a in assign]
    labels = []
    for i, r in enumerate(rows, 1):
        if field not in r or r[field] is None:
            raise UsageError(f"{corpus}:{i}: no {field!r} field (give --domains DIR or --field NAME)")
        labels.append(str(r[field]))
    return rows, labels


@app.command("mix")
@method_options(MIXERS, default="doremi")
def mix(corpus: Corpus, config: MethodConfig,
        out: Annotated[Path, typer.Option("-o", "--out", help="Output weights JSON.")],
        domains: DomainsOpt = None, field: FieldOpt = "domain", tokenizer: TokenizerOpt = "smollm2-135m",
        overwrite: Overwrite = False):
    """Domain weights for a labelled corpus: natural, uniform, DoReMi or RegMix (proxy models trained here)."""
    preflight(tokenizer, out, inputs=(corpus, domains), overwrite=overwrite)
    import numpy as np

    from llmtool.core.checkpoint import atomic_file
    from llmtool.core.models import load_tokenizer
    from llmtool.select_data.methods import run_mixer
    from llmtool.select_data.proxies import build_domain_data

    rows, labels = _corpus_domains(corpus, domains, field)
    if len(set(labels)) < 2:
        raise UsageError(f"{corpus}: one domain only; mixing needs two or more")
    vocab = getattr(config, "proxy_vocab", 4096)
    data = build_domain_data([r["text"] for r in rows], labels, load_tokenizer(tokenizer), vocab=vocab,
                             val_fraction=getattr(config, "val_fraction", 0.1), seed=getattr(config, "mix_seed", 0))
    from llmtool.core import eta_plans as plans

    plans.announce(plans.mix_proxies(config, data.k), None, "select-data mix")
    res = run_mixer(config, data, progress=progress)

    def plain(v):  # JSON without NaN: a domain without held-out text has no validation loss (null)
        if isinstance(v, np.ndarray):
            v = v.tolist()
        if isinstance(v, float):
            return v if np.isfinite(v) else None
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    doc = {"method": config.name, "config": config.as_dict(), "domains": data.names,
           "weights": [float(w) for w in res["weights"]], "natural": data.natural().tolist(), "documents": data.docs,
           "train_tokens": data.train_tokens().astype(int).tolist(), "tokenizer": str(tokenizer),
           "source": {"corpus": str(corpus), "domains": str(domains) if domains else None,
                      "field": None if domains else field},
           **{k: plain(v) for k, v in res.items() if k != "weights"}}
    from llmtool.core import dist

    if dist.is_main():  # one output under a multi-process launch
        with atomic_file(out, overwrite) as tmp:
            tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    order = np.argsort(-np.asarray(res["weights"]))
    emit({"method": config.name, "domains": data.k, "out": str(out),
          **({"predictability": res["predictability"]} if "predictability" in res else {})},
         rows=[{"domain": data.names[i], "weight": round(float(res["weights"][i]), 4),
                "natural": round(float(data.natural()[i]), 4)} for i in order],
         title=f"{config.name} weights over {data.k} domains")


@app.command("sample")
def sample(corpus: Corpus,
           weights: Annotated[str, typer.Option("--weights", help="Weights JSON from `select-data mix`, or natural or "
                                                "uniform.")],
           tokens: Annotated[int, typer.Option("--tokens", min=1, help="Tokens in the drawn stream.")],
           out: Annotated[Path, typer.Option("-o", "--out", help="Output JSONL: corpus lines in training order.")],
           domains: DomainsOpt = None, field: FieldOpt = "domain", tokenizer: TokenizerOpt = "smollm2-135m",
           seed: Annotated[int, typer.Option("--sample-seed", help="Seed of the draw.")] = 0,
           overwrite: Overwrite = False):
    """Draw a training stream with domain weights: documents within a domain without replacement, a domain
    repeated only once exhausted; reports epochs per domain."""
    named = weights in ("natural", "uniform")
    preflight(tokenizer, out, inputs=(corpus, domains, None if named else Path(weights)), overwrite=overwrite)
    import numpy as np

    from llmtool.core.checkpoint import atomic_file
    from llmtool.core.models import load_tokenizer
    from llmtool.select_data.proxies import sample_stream

    rows, labels = _corpus_domains(corpus, domains, field)
    tok = load_tokenizer(tokenizer)
    lengths = [len(ids) + 1 for ids in tok([r["text"] for r in rows], add_special_tokens=False)["input_ids"]]
    names = sorted(set(labels))
    if named:
        sizes = np.array([sum(n for n, lab in zip(lengths, labels) if lab == d) for d in names], dtype=np.float64)
        w = sizes / sizes.sum() if weights == "natural" else np.full(len(names), 1.0 / len(names))
    else:
        try:
            doc = json.loads(Path(weights).read_text())
            names, w = [str(d) for d in doc["domains"]], np.asarray(doc["weights"], dtype=np.float64)
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{weights}: not a weights JSON from `select-data mix`") from None
        missing = sorted(set(labels) - set(names))
        if missing:
            raise UsageError(f"{weights}: no weight for domain(s) {', '.join(missing[:5])} of {corpus}")
    order, meta = sample_stream(labels, names, w, lengths, tokens, seed=seed)
    with atomic_file(out, overwrite) as tmp:
        with open(tmp, "w") as fh:
            for i in order:
                fh.write(json.dumps(rows[i]) + "\n")
    emit({"out": str(out), "weights": weights, **meta},
         rows=[{"domain": d, "epochs": round(e, 3)} for d, e in meta["epochs"].items()],
         title="epochs per domain")
