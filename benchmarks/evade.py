"""Benchmark for `llmtool evade`: detection before and after each attack, per watermark scheme,
with Wilson 95 % intervals, TPR at fixed FPR from >= 500 human negatives, and a quality suite.

Setup (defaults): generator = paraphraser = aux LM = SmolLM2-135M-Instruct (the packaged model).
Texts: ``austen_prompts(n_neg, prompt_words=30, human_words=max_new_tokens, source="austen-test")``
gives n_neg = 505 paragraphs; their human continuations (next max_new_tokens words) are the negatives
of every scheme (detection only, cheap); ``n`` of those prompts (seeded pick) are continued by the
watermarked generator (T 0.7, top-p 0.9, no-repeat-ngram 4; EXP greedy after its processor, DiPmark
its own sampling). Schemes KGW, Unigram, EXP, DIP (DiPmark).
Attacks: none, vanilla paraphrase (beta 0), BIRA with beta0 calibrated for the rewriter (the library
path of ``llmtool evade attack --method bira`` without --beta0: bira.calibrate_beta with the beta = 0
baseline rule through beta_cache.calibrated_beta0, on ``--calib-texts`` austen-test texts; the curve is
recorded), BIRA at the paper's fixed beta0 = -4, word deletion 0.3, synonym substitution 0.5, emoji
(optional; it regenerates).
Metrics per (scheme, attack): evasion rate = 1 - detect rate at the scheme's fixed threshold, with
Wilson 95 % interval; TPR@1 % and @10 % FPR (thresholds: the (k+1)-th largest of the n_neg human
scores, k = floor(fpr n_neg)) with Wilson intervals over the n positives; AUROC.
Quality: all-MiniLM-L6-v2 cosine to the watermarked source (mean); perplexity under the unwatermarked
model (median); self-BLEU of the attack's outputs (mean over outputs of BLEU-4 of each against all the
others; lower = more diverse); with ``--nli-model DIR`` (any local Hugging Face NLI classifier, e.g.
roberta-large-mnli) NLI entailment in both directions between the watermarked source and each output
(llmtool.evade.entailment: mean over texts of min(P(src entails out), P(out entails src)), and the share of
texts the classifier labels entailment both ways); without it NLI is not measured (no NLI model ships
offline).
Similarity at matched detection (definition used): the mean similarity over the texts an attack
*evades* (not flagged at the fixed threshold), so attacks are compared on outputs with the same
detection outcome; reported with the count.

beta0 sweep (issue 43; driven by benchmarks/evade_sweep.py): an attack ``bira@B`` runs BIRA at the fixed
beta0 = B (e.g. ``bira@-2``); the pseudo-attack ``calibrate`` measures the calibrated beta0 as its own stage;
``--fresh-calibration`` measures it with the beta0 cache off (``use_cache=False``), so it is re-measured and
``~/.cache`` is neither read nor written; ``--order attack`` runs one attack over every scheme before
the next; ``--per-text`` stores the per-text similarity, score, flag, perplexity and attempts in the JSON.
Every row carries a percentile-bootstrap 95 % interval of the mean similarity (``similarity_ci``).

Stages run in priority order (``--order``) and results are written after every stage; with
``--stop-at HH:MM`` (UTC) a stage not started by then is skipped and listed in ``meta.skipped``.
``--resume`` continues such a run: ``<out>_state.json`` (replaced atomically after every stage) holds the
stages done, their records and the watermarked texts; those stages are not rerun, and since every stage seeds
its own sampling the resumed records equal an uninterrupted run's. The attacks may grow on resumption; the
protocol (model, n, negatives, length, seed, schemes, batch size, calibration settings) may not.

    python benchmarks/evade.py                      # the full default run (many CPU hours)
    python benchmarks/evade.py --n 16 --stop-at 05:43
    python benchmarks/evade.py --n 16 --resume      # the stages the stopped run did not reach
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMES = ["kgw", "unigram", "exp", "dip"]
ATTACKS = ["none", "vanilla", "bira-cal", "bira-4", "word-delete", "synonym"]
FIXED_BIRA = "bira@"          # "bira@-2": BIRA at the fixed beta0 = -2 (the beta0 sweep)
CALIBRATE = "calibrate"       # pseudo-attack: the beta0 calibration as its own stage
BOOT_DRAWS = 2000


def fixed_beta0(attack_name: str) -> float | None:
    """The fixed beta0 of a ``bira@B`` attack name (``bira@-2`` -> -2.0); None for any other attack.
    A positive beta0 (a bias *towards* the source tokens) is refused."""
    if not attack_name.startswith(FIXED_BIRA):
        return None
    try:
        beta0 = float(attack_name[len(FIXED_BIRA):])
    except ValueError:
        raise ValueError(f"{attack_name}: expected bira@<beta0>, e.g. bira@-2") from None
    if not beta0 <= 0 or beta0 != beta0:
        raise ValueError(f"{attack_name}: beta0 must be <= 0")
    return beta0


def similarity_interval(values, seed: int = 0, draws: int = BOOT_DRAWS, level: float = 0.95) -> list[float] | None:
    """Percentile-bootstrap interval of the mean of per-text similarities (``draws`` resamples of the texts,
    numpy generator seeded by ``seed``); None for fewer than two values."""
    import numpy as np

    from llmtool.core.intervals import bootstrap_mean_ci

    values = list(values)
    if len(values) < 2:
        return None
    idx = np.random.default_rng(seed).integers(0, len(values), size=(draws, len(values)))
    return list(bootstrap_mean_ci(values, idx, level))


def self_bleu(texts: list[str]) -> float:
    """Mean over texts of sacrebleu sentence BLEU-4 of each text against all the others as references."""
    import sacrebleu

    if len(texts) < 2:
        return float("nan")
    return statistics.fmean(sacrebleu.sentence_bleu(t, texts[:i] + texts[i + 1:]).score / 100.0
                            for i, t in enumerate(texts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=100, help="watermarked texts per scheme")
    ap.add_argument("--n-neg", type=int, default=505, help="human negatives per scheme")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--schemes", nargs="+", default=SCHEMES)
    ap.add_argument("--attacks", nargs="+", default=ATTACKS,
                    help=f"{ATTACKS} and optionally emoji, bira@<beta0> (fixed beta0) and calibrate")
    ap.add_argument("--bira4-schemes", nargs="+", default=None, help="schemes for bira-4 (default: all)")
    ap.add_argument("--calib-texts", type=int, default=50)
    ap.add_argument("--order", default="stage", choices=["stage", "scheme", "attack"],
                    help="stage: every scheme's generation and cheap attacks first, then paraphrase attacks "
                         "scheme by scheme; scheme: one scheme at a time; attack: generation and cheap attacks "
                         "first, then each paraphrase attack (in --attacks order) over every scheme")
    ap.add_argument("--fresh-calibration", action="store_true",
                    help="measure the calibrated beta0 with the cache off (~/.cache neither read nor written)")
    ap.add_argument("--per-text", action="store_true",
                    help="store per-text similarity, score, flag, perplexity and attempts in the JSON")
    ap.add_argument("--stop-at", default=None, help="UTC HH:MM; stages not started by then are skipped")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run recorded in <out>_state.json (written after every stage): stages done there "
                         "are not rerun, their watermarked texts and records are reused; refused when the protocol "
                         "(model, n, n-neg, max-new-tokens, seed, schemes, batch size, calibration settings) differs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "evade"))
    ap.add_argument("--nli-model", default=None, metavar="DIR",
                    help="local NLI classifier directory (e.g. roberta-large-mnli): adds NLI entailment columns")
    args = ap.parse_args(argv)
    for a in args.attacks:
        try:
            fixed_beta0(a)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    resumed = None
    if args.resume:
        try:
            resumed = load_state(args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    if args.nli_model is not None:
        from llmtool.core.console import UsageError
        from llmtool.evade.entailment import check_nli_model

        try:
            check_nli_model(args.nli_model)  # a bad directory fails before an hour of work
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    from llmtool.core.intervals import wilson
    from llmtool.core.models import load_model, load_tokenizer, set_seed
    from llmtool.core.preflight import resolve_model
    from llmtool.evade import beta_cache
    from llmtool.evade.attacks import ATTACKS as REG, AttackContext
    from llmtool.evade.bira import BiraConfig
    from llmtool.evade.generation import DecodeConfig, generate_ids, scheme_decoding
    from llmtool.evade.metrics import detection_metrics, perplexity_of
    from llmtool.evade.paraphrase import Paraphraser
    from llmtool.evade.prompts import austen_prompts
    from llmtool.evade.similarity import SentenceEmbedder
    from llmtool.evade.watermarks import make_scheme

    t_start = time.time()
    stop = None
    if args.stop_at:
        h, m = map(int, args.stop_at.split(":"))
        now = dt.datetime.now(dt.timezone.utc)
        stop = now.replace(hour=h, minute=m, second=0, microsecond=0).timestamp()
    set_seed(args.seed)
    tok, model = load_tokenizer(args.model), load_model(args.model)
    vocab = int(model.config.vocab_size)
    embedder = SentenceEmbedder()
    nli = None
    if args.nli_model is not None:
        from llmtool.evade.entailment import NLIScorer

        nli = NLIScorer(args.nli_model, batch_size=args.batch_size)
    rows = austen_prompts(args.n_neg, prompt_words=30, human_words=args.max_new_tokens, seed=args.seed,
                          source="austen-test")
    human = [r["human_text"] for r in rows]
    picked = sorted(random.Random(args.seed + 1).sample(range(len(rows)), args.n))
    prompt_texts = [rows[i]["prompt"] for i in picked]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompt_texts]
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed)
    para = Paraphraser(model, tok, DecodeConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                                seed=args.seed, no_repeat_ngram_size=0))

    def ids_of(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    state = {"records": [], "skipped": [], "stage_seconds": {}, "calibration": None, "negatives": {}, "fpr_fixed": {}}
    schemes = {name: make_scheme(name, vocab) for name in args.schemes}
    marked: dict[str, list[str]] = {}
    outputs: dict[tuple[str, str], list[str]] = {}
    # a stage is done once it has a time in stage_seconds (run_stage records it after the stage's work)
    if resumed is not None:  # every stage seeds itself, so what follows matches an uninterrupted run
        for key in _STATE_KEYS:
            state[key] = resumed[key]
        marked.update(resumed["marked"])
        state["resumed_stages"] = list(state["stage_seconds"])
        print(f"resume: {len(state['resumed_stages'])} stages done ({', '.join(state['resumed_stages'])})",
              file=sys.stderr)

    def flush():
        write_results(args, argv, state, t_start)
        write_state(args, {"protocol": protocol_of(args), "marked": marked, **{k: state[k] for k in _STATE_KEYS}})

    def run_stage(label, fn):
        if label in state["stage_seconds"]:
            return True
        if stop is not None and time.time() >= stop:
            state["skipped"].append(label)
            print(f"skip {label} (past --stop-at)", file=sys.stderr)
            return False
        t0 = time.time()
        fn()
        state["stage_seconds"][label] = round(time.time() - t0, 1)
        print(f"{label}: {time.time() - t0:.0f}s", file=sys.stderr)
        flush()
        return True

    def negatives(name):
        scheme = schemes[name]
        dets = [scheme.detect(ids_of(t)) for t in human]
        state["negatives"][name] = [d.score for d in dets]
        k = sum(d.is_watermarked for d in dets)
        state["fpr_fixed"][name] = {"n_neg": len(dets), "flagged": k, "fpr": k / len(dets),
                                    "ci": list(wilson(k, len(dets)))}

    def score(name, attack, texts, extra=None):
        scheme = schemes[name]
        dets = [scheme.detect(ids_of(t)) for t in texts]
        flags = [d.is_watermarked for d in dets]
        n = len(texts)
        m = detection_metrics([d.score for d in dets], state["negatives"][name], flags, scheme.score_kind)
        k_det = sum(flags)
        rec = {"scheme": name, "attack": attack, **m, "n_detected": k_det,
               "detect_ci": list(wilson(k_det, n)), "evasion_rate": 1 - k_det / n,
               "evasion_ci": list(wilson(n - k_det, n))}
        for f in (0.01, 0.1):
            k = round(m[f"tpr@fpr={f:g}"] * n)
            rec[f"tpr@fpr={f:g}_ci"] = list(wilson(k, n))
        sims = embedder.similarity(marked[name], texts) if attack != "none" else [1.0] * n
        ev = [s for s, fl in zip(sims, flags) if not fl]
        ppl_all = perplexity_of(model, tok, texts)
        ppl = [p for p in ppl_all if p == p]
        rec["similarity_ci"] = similarity_interval(sims, seed=args.seed)
        if args.per_text:
            rec["per_text"] = {"similarity": sims, "score": [d.score for d in dets], "flagged": flags,
                               "ppl": [p if p == p else None for p in ppl_all],
                               **({"attempts": [r["iterations"] for r in extra["_results"]],
                                   "beta_final": [r["beta_final"] for r in extra["_results"]]}
                                  if extra and "_results" in extra else {})}
        extra = {k: v for k, v in (extra or {}).items() if k != "_results"}
        rec.update({"similarity": statistics.fmean(sims), "similarity_evaded": statistics.fmean(ev) if ev else None,
                    "n_evaded": len(ev), "ppl_median": statistics.median(ppl) if ppl else None,
                    "self_bleu": self_bleu(texts), "mean_score": statistics.fmean(d.score for d in dets),
                    "mean_tokens": statistics.fmean(len(ids_of(t)) for t in texts), **(extra or {}),
                    "example": texts[0][:300]})
        if nli is not None:  # the "none" row scores each text against itself: the classifier's own ceiling
            both = nli.both_directions(marked[name], texts)["summary"]
            rec.update({"nli_src_to_hyp": both["src_to_hyp_mean"], "nli_hyp_to_src": both["hyp_to_src_mean"],
                        "nli_bidirectional": both["bidirectional_mean"],
                        "nli_entailed_both": both["entailed_both_share"]})
        state["records"] = [r for r in state["records"] if not (r["scheme"] == name and r["attack"] == attack)]
        state["records"].append(rec)
        outputs[(name, attack)] = texts
        print(f"  {name} {attack:12s} evade={rec['evasion_rate']:.2f} tpr@1%={m['tpr@fpr=0.01']:.2f} "
              f"auroc={m['auroc']:.2f} sim={rec['similarity']:.2f} ppl={rec['ppl_median']} "
              f"sbleu={rec['self_bleu']:.3f}"
              + (f" nli={rec['nli_bidirectional']:.2f}" if nli is not None else ""), file=sys.stderr)

    def ctx_for(name, bira=None):
        scheme = schemes[name]
        dec = DecodeConfig(**{**decode.__dict__, "no_repeat_ngram_size": 0})
        if hasattr(scheme.config, "temperature"):
            dec.temperature = scheme.config.temperature
        return AttackContext(paraphraser=para, bira=bira or BiraConfig(), seed=args.seed, generator=model,
                             generator_tokenizer=tok, scheme=scheme, decode=dec, prompts=prompt_texts)

    def generate(name):
        scheme = schemes[name]
        dec = DecodeConfig(**{**decode.__dict__})
        if hasattr(scheme.config, "temperature"):
            dec.temperature = scheme.config.temperature
        marked[name] = [tok.decode(o, skip_special_tokens=True) for o in
                        generate_ids(model, tok, prompt_ids, [scheme.processor()], dec, **scheme_decoding(scheme))]
        score(name, "none", marked[name])

    def attack(name, attack_name):
        if name not in marked:
            state["skipped"].append(f"{name}/{attack_name} (no watermarked texts)")
            return
        extra = {}
        fixed = fixed_beta0(attack_name)
        if fixed is not None or attack_name in ("bira-cal", "bira-4"):
            beta0 = fixed if fixed is not None else -4.0 if attack_name == "bira-4" else calibration()
            res = REG.get("bira")(marked[name], ctx_for(name, BiraConfig(beta0, 1.0, 0, 0.0)))
            extra["beta0"] = beta0
            if fixed is not None:
                extra["first_try_degenerate_rate"] = statistics.fmean(r["iterations"] > 1 for r in res)
                extra["_results"] = res
        else:
            res = REG.get(attack_name)(marked[name], ctx_for(name))
        texts = [r["attacked_text"] or " " for r in res]
        if "degenerated" in res[0]:
            extra.update({"degenerate_rate": statistics.fmean(r["degenerated"] for r in res),
                          "mean_attempts": statistics.fmean(r["iterations"] for r in res),
                          "mean_beta_final": statistics.fmean(r["beta_final"] for r in res)})
        score(name, attack_name, texts, extra)

    def calibration() -> float:
        if state["calibration"] is not None:
            return state["calibration"]["beta0"]
        t0 = time.time()
        # the library path of `evade attack --method bira` without --beta0 (same cache entry for these settings)
        model_dir = resolve_model(args.model)
        beta0, entry = beta_cache.calibrate_for_rewriter(para, model_dir, texts=args.calib_texts, temperature=0.7,
                                                         top_p=0.9, seed=args.seed,
                                                         use_cache=not args.fresh_calibration)
        state["calibration"] = {"beta0": beta0, "cached": entry["cached"], "note": entry["note"],
                                "curve": entry["curve"], "texts": args.calib_texts, "seconds": round(time.time() - t0, 1),
                                "fresh": bool(args.fresh_calibration)}
        flush()
        return beta0

    cheap = [a for a in args.attacks if a in ("word-delete", "synonym")]
    costly = [a for a in args.attacks if a not in ("none", "word-delete", "synonym", CALIBRATE)]
    bira4 = set(args.bira4_schemes or args.schemes)
    for name in args.schemes:
        run_stage(f"{name}/negatives", lambda name=name: negatives(name))
    plan = []
    if args.order == "attack":
        for name in args.schemes:
            plan += [(f"{name}/generate", name, None)] + [(f"{name}/{a}", name, a) for a in cheap]
        for a in [a for a in args.attacks if a not in ("none", "word-delete", "synonym")]:
            if a == CALIBRATE:
                plan.append((CALIBRATE, None, CALIBRATE))
                continue
            plan += [(f"{name}/{a}", name, a) for name in args.schemes if a != "bira-4" or name in bira4]
    elif args.order == "stage":
        for name in args.schemes:
            plan += [(f"{name}/generate", name, None)] + [(f"{name}/{a}", name, a) for a in cheap]
        for name in args.schemes:
            plan += [(f"{name}/{a}", name, a) for a in costly if a != "bira-4" or name in bira4]
    else:
        for name in args.schemes:
            plan += [(f"{name}/generate", name, None)] + [(f"{name}/{a}", name, a) for a in cheap + costly
                                                          if a != "bira-4" or name in bira4]
    if args.order != "attack" and CALIBRATE in args.attacks:
        plan.insert(0, (CALIBRATE, None, CALIBRATE))
    for label, name, a in plan:
        if a == CALIBRATE:
            run_stage(label, calibration)
            continue
        run_stage(label, (lambda name=name: generate(name)) if a is None else (lambda name=name, a=a: attack(name, a)))
    flush()
    return 0


_STATE_KEYS = ("records", "stage_seconds", "calibration", "negatives", "fpr_fixed")  # restored on --resume
_PROTOCOL = ("model", "n", "n_neg", "max_new_tokens", "seed", "schemes", "batch_size", "calib_texts",
             "fresh_calibration")


def protocol_of(args) -> dict:
    """What must agree between a run and its resumption (the attacks may grow; the texts may not change)."""
    return {k: getattr(args, k) for k in _PROTOCOL}


def state_path(args) -> Path:
    out = Path(args.out)
    return out.with_name(out.name + "_state.json")


def write_state(args, doc: dict) -> None:
    """The resume record, replaced atomically after every stage (a run killed mid-write keeps the last one)."""
    path = state_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def load_state(args) -> dict | None:
    """The recorded state to resume from, None when there is none yet (the run starts from the beginning);
    ValueError (one line) when it is unreadable or was made with another protocol."""
    path = state_path(args)
    if not path.is_file():
        print(f"resume: no {path.name} yet, starting from the beginning", file=sys.stderr)
        return None
    try:
        doc = json.loads(path.read_text())
        recorded = doc["protocol"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot resume from {path.name}: not a state file of this benchmark ({e})") from None
    diff = [k for k in _PROTOCOL if recorded.get(k) != getattr(args, k)]
    if diff:
        raise ValueError(f"cannot resume from {path.name}: it was made with other " + ", ".join(
            f"--{k.replace('_', '-')} ({recorded.get(k)!r}, now {getattr(args, k)!r})" for k in diff))
    return doc


def write_results(args, argv, state, t_start) -> None:
    from llmtool.core.console import markdown_table

    recs = state["records"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_neg = args.n_neg
    meta = {"model": args.model, "n": args.n, "n_neg": n_neg, "max_new_tokens": args.max_new_tokens,
            "seed": args.seed, "schemes": args.schemes, "attacks": args.attacks, "bira_eta": 1.0,
            "bira_percentile": 0.0, "negatives": "human continuations of austen-test paragraphs",
            "fpr_note": f"with {n_neg} negatives, FPR 1% and 10% thresholds are the {1 + int(0.01 * n_neg)}-th and "
                        f"{1 + int(0.1 * n_neg)}-th largest human score",
            "intervals": "Wilson 95% over the n watermarked texts",
            "similarity_at_matched_detection": "similarity_evaded = mean S-BERT similarity over the texts the "
                                               "attack evades (not flagged at the fixed threshold)",
            "nli": nli_meta(args.nli_model),
            "fpr_at_fixed_threshold": state["fpr_fixed"],
            "calibration": state["calibration"], "skipped": state["skipped"],
            "stage_seconds": state["stage_seconds"], "seconds_total": round(time.time() - t_start, 1),
            "resumed_stages": state.get("resumed_stages", []),
            "torch_threads": args.threads, "batch_size": args.batch_size}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": recs,
                                                    "negative_scores": state["negatives"]}, indent=2))

    def ci(r, key):
        lo, hi = r[key]
        return f"[{lo:.2f}, {hi:.2f}]"

    rows = []
    for r in recs:
        rows.append({"scheme": r["scheme"], "attack": r["attack"] + (f" (b0 {r['beta0']:g})" if "beta0" in r else ""),
                     "n": r["n_pos"], "evasion": round(r["evasion_rate"], 3), "evasion 95% CI": ci(r, "evasion_ci"),
                     "TPR@1%": round(r["tpr@fpr=0.01"], 3), "TPR@1% CI": ci(r, "tpr@fpr=0.01_ci"),
                     "TPR@10%": round(r["tpr@fpr=0.1"], 3), "TPR@10% CI": ci(r, "tpr@fpr=0.1_ci"),
                     "AUROC": round(r["auroc"], 3), "sim": round(r["similarity"], 3),
                     "sim (evaded)": "" if r["similarity_evaded"] is None else
                     f"{r['similarity_evaded']:.3f} (n={r['n_evaded']})",
                     "ppl": None if r["ppl_median"] is None else round(r["ppl_median"], 1),
                     "self-BLEU": round(r["self_bleu"], 3), "degen": r.get("degenerate_rate"),
                     "attempts": r.get("mean_attempts")})
        if args.nli_model is not None:
            rows[-1].update({"NLI bi": _round(r.get("nli_bidirectional")),
                             "NLI both": _round(r.get("nli_entailed_both"))})
    cols = ["scheme", "attack", "n", "evasion", "evasion 95% CI", "TPR@1%", "TPR@1% CI", "TPR@10%", "TPR@10% CI",
            "AUROC", "sim", "sim (evaded)", "ppl", "self-BLEU"]
    cols += ["NLI bi", "NLI both"] if args.nli_model is not None else []
    cols += ["degen", "attempts"]
    table = markdown_table(rows, cols) if rows else "(no results)"
    cal = state["calibration"]
    cal_txt = "not run (skipped)" if cal is None else (
        f"beta0 = {cal['beta0']:g} ({cal['note']}; {cal['texts']} texts; "
        + ", ".join(f"beta {c['beta']:g}: {c['degenerate_rate']:.0%} degenerate" for c in cal["curve"]) + ")")
    fpr_txt = "; ".join(f"{k} {v['flagged']}/{v['n_neg']} = {v['fpr']:.3f} [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}]"
                        for k, v in state["fpr_fixed"].items())
    cmd = "python benchmarks/evade.py " + " ".join(public_argv(argv if argv is not None else sys.argv[1:]))
    skipped = ", ".join(state["skipped"]) or "none"
    out.with_suffix(".md").write_text(
        f"# evade benchmark\n\nCommand: `{cmd.strip()}`\n\n"
        f"Model {args.model} (generator, paraphraser and aux LM); {args.n} watermarked texts per scheme "
        f"(austen-test prompts of 30 words, {args.max_new_tokens} new tokens); {n_neg} human negatives per scheme "
        f"(the continuations of the austen-test paragraphs), thresholds for TPR@FPR from them ({meta['fpr_note']}). "
        f"evasion = 1 - detect rate at the scheme's fixed threshold; all intervals Wilson 95 % over the n texts. "
        f"sim = mean all-MiniLM-L6-v2 cosine to the watermarked text; sim (evaded) = the same over the texts the "
        f"attack evades (similarity at matched detection outcome); ppl = median perplexity under the unwatermarked "
        f"model; self-BLEU = mean sacrebleu BLEU-4 of each output against the other outputs (lower = more "
        f"diverse). {nli_note(args.nli_model)}\n\n"
        f"False-positive rate of the fixed thresholds on the human negatives (Wilson 95 %): {fpr_txt}.\n\n"
        f"BIRA calibration (llmtool.evade.bira.calibrate_beta, beta = 0 baseline rule, via "
        f"beta_cache.calibrated_beta0): {cal_txt}.\n\n"
        f"Stages skipped (not started before --stop-at): {skipped}.\n\n"
        f"Total {meta['seconds_total'] / 60:.1f} min, {args.threads} torch threads.\n\n" + table + "\n")
    print(table)


def nli_meta(path):
    """What the JSON records about NLI: the model directory's name (never this machine's path) and the
    definition, or how to measure it."""
    if path is None:
        return ("not measured: no NLI model ships offline; pass --nli-model DIR (any local Hugging Face NLI "
                "classifier, e.g. roberta-large-mnli) to measure it")
    from llmtool.evade.entailment import model_name

    return {"model": model_name(path),
            "definition": "nli_src_to_hyp / nli_hyp_to_src = mean P(entailment) with the watermarked source / "
                          "the output as premise; nli_bidirectional = mean over texts of the minimum of the two; "
                          "nli_entailed_both = share of texts the classifier labels entailment in both directions "
                          "(llmtool.evade.entailment)"}


def nli_note(path) -> str:
    if path is None:
        return ("NLI entailment: not measured (no NLI model ships offline; `--nli-model DIR` with any local "
                "Hugging Face NLI classifier, e.g. roberta-large-mnli, measures it).")
    from llmtool.evade.entailment import model_name

    return (f"NLI bi = mean over texts of min(P(source entails output), P(output entails source)) under "
            f"{model_name(path)}; NLI both = share of texts it labels entailment in both directions (the none "
            f"row scores each text against itself).")


def public_argv(argv) -> list[str]:
    """The command line as recorded: the --nli-model directory by its name only."""
    from llmtool.evade.entailment import model_name

    out, it = [], iter(argv)
    for a in it:
        if a == "--nli-model":
            out.append(a)
            nxt = next(it, None)
            if nxt is not None:
                out.append(model_name(nxt))
        elif a.startswith("--nli-model="):
            out.append("--nli-model=" + model_name(a.split("=", 1)[1]))
        else:
            out.append(a)
    return out


def _round(x, digits: int = 3):
    return None if x is None else round(x, digits)


if __name__ == "__main__":
    sys.exit(main())
