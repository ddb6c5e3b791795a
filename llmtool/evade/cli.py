"""`llmtool evade ...`: watermark text (KGW, Unigram, EXP, DiPmark), detect watermarks, attack them
(BIRA and its baselines), and score detection / text quality. Heavy imports stay inside commands."""
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from llmtool.core.console import OPTIONS, UsageError, emit, info
from llmtool.core.preflight import preflight  # torch-free: fail fast before heavy imports
from llmtool.core.options import ModelArg, Overwrite
from llmtool.core.registry import MethodConfig, method_options
from llmtool.evade.attack_methods import ATTACK_METHODS


def check_output(*args, **kwargs):
    """core.checkpoint's output check, imported when a command runs (it loads torch)."""
    from llmtool.core.checkpoint import check_output as check

    return check(*args, **kwargs)

app = typer.Typer(no_args_is_help=True)

def _scheme_help() -> str:
    from llmtool.evade.watermarks import SCHEMES

    return "Watermark scheme: " + ", ".join(SCHEMES.names()) + " (options via --config)."


Scheme = Annotated[str, typer.Option("--scheme", help=_scheme_help())]
ConfigFile = Annotated[Optional[Path], typer.Option("--config", help="JSON object overriding scheme config fields.")]
OutFile = Annotated[Path, typer.Option("-o", "--out", help="Output JSONL file.")]
Field = Annotated[str, typer.Option("--field", help="JSONL field holding the text.")]
BatchSize = Annotated[int, typer.Option("--batch-size", min=1, help="Sequences per generate call.")]


def _texts(rows: list[dict], path: Path, field: str) -> list[str]:
    out = []
    for i, row in enumerate(rows, 1):
        value = row.get(field)
        if value is None:
            raise UsageError(f"{path}: record {i}: missing field {field!r}")
        if not isinstance(value, str):
            raise UsageError(f"{path}: record {i}: field {field!r} must be a string")
        if not value.strip():
            raise UsageError(f"{path}: record {i}: field {field!r} is empty")
        out.append(value)
    return out


def _ids(rows: list[dict]) -> list[str]:
    return [str(r.get("id", i)) for i, r in enumerate(rows)]


def _scheme(name: str, model: str, config: Optional[Path]):
    from llmtool.core.checkpoint import read_config
    from llmtool.core.models import resolve_model
    from llmtool.evade.watermarks import make_scheme, read_config_file

    from llmtool.evade.watermarks import SCHEMES

    SCHEMES.get(name)  # unknown scheme -> error before any loading
    cfg = read_config(resolve_model(model))
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not vocab:
        raise UsageError(f"{model}: config.json has no vocab_size")
    return make_scheme(name, int(vocab), read_config_file(config), source=str(config or "--config"))


def _decode_config(max_new_tokens, temperature, top_p, no_repeat, batch_size):
    from llmtool.evade.generation import DecodeConfig

    return DecodeConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                        no_repeat_ngram_size=no_repeat, batch_size=batch_size, seed=OPTIONS.seed)


@app.command("watermark")
def watermark(
    model: ModelArg,
    prompts: Annotated[Path, typer.Argument(help="JSONL with a 'prompt' field (and optional 'id').")],
    output: OutFile,
    scheme: Scheme = "kgw",
    config: ConfigFile = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="New tokens per text.")] = 150,
    temperature: Annotated[Optional[float], typer.Option(min=1e-3, help="Sampling temperature (default 0.7; "
                                                         "kgw/unigram: exp and dip sample as their config says).")] = None,
    top_p: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Nucleus mass (default 0.9; "
                                                   "kgw/unigram).")] = None,
    no_repeat_ngram: Annotated[int, typer.Option(min=0, help="no_repeat_ngram_size (0 = off).")] = 4,
    batch_size: BatchSize = 16,
    unwatermarked: Annotated[bool, typer.Option("--unwatermarked", help="Generate without the watermark "
                                                "(negatives from the same model).")] = False,
    overwrite: Overwrite = False,
) -> None:
    """Generate watermarked continuations of PROMPTS with MODEL (the prompt is not part of the text)."""
    preflight(model, output, inputs=(prompts, config), overwrite=overwrite)
    from llmtool.core.data import read_jsonl, write_jsonl
    from llmtool.core.models import load_model, load_tokenizer, set_seed
    from llmtool.evade.generation import generate_ids, scheme_decoding

    check_output(output, overwrite, (prompts,))
    wm = _scheme(scheme, model, config)
    rows = read_jsonl(prompts, required=("prompt",))
    texts = _texts(rows, prompts, "prompt")
    from llmtool.core import eta_plans as plans

    shape = plans.Shape.of(model)
    plans.announce(plans.generation("generation", shape, len(texts), plans.prompt_tokens(
        [{"prompt": t} for t in texts]) - 20, max_new_tokens, batch_size), shape, "evade watermark")
    tok, m = load_tokenizer(model), load_model(model)
    set_seed()
    own_sampling = wm.score_kind == "p" or getattr(wm, "owns_sampling", False)
    if own_sampling:
        given = [f for f, v in (("--temperature", temperature), ("--top-p", top_p)) if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} does not apply to scheme {scheme!r} (it samples as its config "
                             "says; set its temperature with --config)")
    dec = _decode_config(max_new_tokens, 0.7 if temperature is None else temperature,
                         0.9 if top_p is None else top_p, no_repeat_ngram, batch_size)
    if own_sampling:
        dec.temperature = wm.config.temperature
    pids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    info(f"generating {len(pids)} texts with {'no watermark' if unwatermarked else scheme}")
    outs = generate_ids(m, tok, pids, [] if unwatermarked else [wm.processor()], dec,
                        description=f"generating (batches of {dec.batch_size})",
                        **({} if unwatermarked else scheme_decoding(wm)))
    field = "text" if unwatermarked else "watermarked_text"
    out_rows = [{"id": i, "prompt": p, field: tok.decode(o, skip_special_tokens=True), "scheme":
                 None if unwatermarked else scheme, "gen_model": str(model), "config_sha": wm.config_sha(),
                 "n_tokens": len(o)} for i, p, o in zip(_ids(rows), texts, outs)]
    write_jsonl(output, out_rows)
    emit({"output": str(output), "texts": len(out_rows), "scheme": scheme, "watermarked": not unwatermarked,
          "scheme_config": wm.config_dict(), "config_sha": wm.config_sha(),
          "mean_tokens": sum(len(o) for o in outs) / len(outs)})


@app.command("detect")
def detect(
    texts: Annotated[Path, typer.Argument(help="JSONL of texts to score.")],
    model: Annotated[str, typer.Option("--model", help="Generator (its tokenizer and vocab_size).")] = "smollm2-135m",
    scheme: Scheme = "kgw",
    config: ConfigFile = None,
    field: Field = "watermarked_text",
    output: Annotated[Optional[Path], typer.Option("-o", "--out", help="Per-text detections (JSONL).")] = None,
    overwrite: Overwrite = False,
) -> None:
    """Score TEXTS with the scheme's detector (z-score, or p-value for EXP)."""
    preflight(model, output, inputs=(texts, config), overwrite=overwrite)
    from llmtool.core.data import read_jsonl, write_jsonl
    from llmtool.core.models import load_tokenizer

    if output is not None:
        check_output(output, overwrite, (texts,))
    wm = _scheme(scheme, model, config)
    rows = read_jsonl(texts)
    values = _texts(rows, texts, field)
    tok = load_tokenizer(model)
    results = []
    for rid, text in zip(_ids(rows), values):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if ids and max(ids) >= wm.vocab_size:
            raise UsageError(f"{texts}: tokenizer of {model} yields ids beyond vocab_size {wm.vocab_size}")
        d = wm.detect(ids)
        results.append({"id": rid, **d.as_dict(), "scheme": scheme})
    if output is not None:
        write_jsonl(output, results)
    rate = sum(r["is_watermarked"] for r in results) / len(results)
    summary = {"texts": len(results), "scheme": scheme, "detect_rate": rate, "score_kind": wm.score_kind,
               "mean_score": sum(r["score"] for r in results) / len(results)}
    emit({**summary, "detections": results} if output is None else summary,
         rows=[{k: r[k] for k in ("id", "score", "is_watermarked", "n_scored")} for r in results]
         if output is None else None)


@app.command("attack")
@method_options(ATTACK_METHODS, default="bira")
def attack(
    inputs: Annotated[Path, typer.Argument(help="JSONL of watermarked texts.")],
    output: OutFile,
    config: MethodConfig,
    field: Field = "watermarked_text",
    overwrite: Overwrite = False,
) -> None:
    """Rewrite watermarked texts to evade detection (writes attacked_text and attack fields)."""
    preflight(None, output, inputs=(inputs,), overwrite=overwrite)
    from llmtool.core.data import read_jsonl, write_jsonl
    from llmtool.core.models import load_model, load_tokenizer, set_seed
    from llmtool.evade.attacks import ATTACKS, AttackContext
    from llmtool.evade.bira import BiraConfig
    from llmtool.evade.paraphrase import PROMPT_VERSION, Paraphraser

    method = config.name
    fn = ATTACKS.get(config.attack)
    check_output(output, overwrite, (inputs,))
    rows = read_jsonl(inputs)
    ctx = AttackContext(seed=OPTIONS.seed)
    ctx.delete_ratio = getattr(config, "delete_ratio", ctx.delete_ratio)
    ctx.synonym_ratio = getattr(config, "synonym_ratio", ctx.synonym_ratio)
    set_seed()
    if method == "emoji":
        cfg_file = Path(config.scheme_config) if config.scheme_config else None
        ctx.scheme = _scheme(config.scheme, config.generator, cfg_file)
        ctx.prompts = _texts(rows, inputs, "prompt")
        ctx.generator, ctx.generator_tokenizer = load_model(config.generator), load_tokenizer(config.generator)
        ctx.decode = _decode_config(config.max_new_tokens, config.temperature, config.top_p, 0, config.batch_size)
        texts = ctx.prompts
    else:
        texts = _texts(rows, inputs, field)
        if hasattr(config, "paraphraser"):
            dec = _decode_config(150, getattr(config, "temperature", 0.7), getattr(config, "top_p", 0.9), 0,
                                 getattr(config, "batch_size", 16))
            ctx.paraphraser = Paraphraser(load_model(config.paraphraser), load_tokenizer(config.paraphraser), dec)
            if getattr(config, "aux_model", None):
                ctx.aux_model, ctx.aux_tokenizer = load_model(config.aux_model), load_tokenizer(config.aux_model)
    calibration = None
    if method == "bira":
        beta0 = config.beta0
        if beta0 is None:
            beta0, calibration = _calibrated_beta0(config, ctx)
        ctx.bira = BiraConfig(beta0, config.beta_step, config.max_iter, config.percentile)
    if ctx.paraphraser is not None:  # one rewrite of up to 150 tokens per text (BIRA retries degenerate ones)
        from llmtool.core import eta_plans as plans

        shape = plans.Shape.of(config.paraphraser)
        plans.announce(plans.generation("rewrite", shape, len(texts), plans.prompt_tokens(
            [{"prompt": t} for t in texts]) + 40, 150, getattr(config, "batch_size", 16),
            f"rewrite {len(texts)} texts x up to 150 tokens" + (", more for retries" if method == "bira" else "")),
            shape, "evade attack")
    info(f"attacking {len(texts)} texts with {method}")
    results = fn(texts, ctx)
    out_rows = [{**row, **res, "attack": method, "prompt_version": PROMPT_VERSION if method in
                 ("bira", "vanilla", "paraphrase") else None} for row, res in zip(rows, results)]
    write_jsonl(output, out_rows)
    summary = {"output": str(output), "method": method, "texts": len(out_rows), "config": config.as_dict()}
    if calibration is not None:
        summary["beta0"] = {k: calibration[k] for k in ("beta0", "cached", "note", "texts", "grid")}
    if results and "degenerated" in results[0]:
        summary["degenerate_rate"] = sum(r["degenerated"] for r in results) / len(results)
        summary["mean_attempts"] = sum(r["iterations"] for r in results) / len(results)
    emit(summary)


@app.command("metrics")
def metrics(
    positives: Annotated[Path, typer.Argument(help="Detections of (attacked) watermarked texts (detect -o).")],
    negatives: Annotated[Path, typer.Argument(help="Detections of human / unwatermarked texts.")],
    fpr: Annotated[Optional[List[float]], typer.Option("--fpr", help="FPR levels for TPR (repeatable).")] = None,
) -> None:
    """ASR, TPR at fixed FPR (thresholds from NEGATIVES), best F1 and AUROC."""
    preflight(None, None, inputs=(positives, negatives))
    from llmtool.core.data import read_jsonl
    from llmtool.evade.metrics import detection_metrics

    need = ("score", "is_watermarked", "score_kind")
    pos, neg = read_jsonl(positives, required=need), read_jsonl(negatives, required=need)
    for path, rows in ((positives, pos), (negatives, neg)):
        if not rows:
            raise UsageError(f"{path}: no detections")
        for i, r in enumerate(rows, 1):
            v = r["score"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
                raise UsageError(f"{path}:{i}: field 'score' must be a finite number, got {v!r}")
            if not isinstance(r["is_watermarked"], bool):
                raise UsageError(f"{path}:{i}: field 'is_watermarked' must be true or false, got {r['is_watermarked']!r}")
    kinds = {r["score_kind"] for r in pos + neg}
    if len(kinds) != 1 or not kinds <= {"z", "p"}:
        raise UsageError(f"{positives}, {negatives}: score_kind must be one of z/p and the same in both files")
    levels = tuple(fpr or (0.01, 0.1))
    if any(not 0 < f < 1 for f in levels):
        raise UsageError("--fpr values must be in (0, 1)")
    out = detection_metrics([r["score"] for r in pos], [r["score"] for r in neg],
                            [r["is_watermarked"] for r in pos], kinds.pop(), levels)
    emit(out)


@app.command("quality")
def quality(
    attacked: Annotated[Path, typer.Argument(help="JSONL with the source and the rewritten text.")],
    src_field: Annotated[str, typer.Option("--src-field")] = "watermarked_text",
    hyp_field: Annotated[str, typer.Option("--hyp-field")] = "attacked_text",
    ppl_model: Annotated[str, typer.Option("--ppl-model", help="Oracle LM for perplexity.")] = "smollm2-135m",
    nli_model: Annotated[Optional[Path], typer.Option("--nli-model", help="Local NLI classifier directory (e.g. "
                                                      "roberta-large-mnli): adds entailment in both directions.")] = None,
) -> None:
    """Semantic similarity (all-MiniLM-L6-v2 cosine) of rewrite to source, and perplexity of both; with
    --nli-model also NLI entailment source -> rewrite and rewrite -> source (llmtool/evade/entailment.py)."""
    from llmtool.evade.entailment import check_nli_model  # torch-free

    if nli_model is not None:
        check_nli_model(nli_model)  # a bad directory fails before any model loads
    preflight(ppl_model, None, inputs=(attacked,))
    import statistics

    from llmtool.core.data import read_jsonl
    from llmtool.core.models import load_model, load_tokenizer, parse_device
    from llmtool.evade.metrics import perplexity_of
    from llmtool.evade.similarity import SentenceEmbedder

    rows = read_jsonl(attacked)
    src, hyp = _texts(rows, attacked, src_field), _texts(rows, attacked, hyp_field)
    sims = SentenceEmbedder().similarity(src, hyp)
    nli = None
    if nli_model is not None:
        from llmtool.evade.entailment import NLIScorer

        nli = NLIScorer(nli_model, device=str(parse_device(None))).both_directions(src, hyp)["summary"]
    m, tok = load_model(ppl_model), load_tokenizer(ppl_model)
    p_src, p_hyp = perplexity_of(m, tok, src), perplexity_of(m, tok, hyp)
    out = {"texts": len(rows), "similarity_mean": statistics.fmean(sims), "ppl_src_median": statistics.median(p_src),
           "ppl_hyp_median": statistics.median(p_hyp)}
    if nli is not None:
        out.update({"nli_src_to_hyp_mean": nli["src_to_hyp_mean"], "nli_hyp_to_src_mean": nli["hyp_to_src_mean"],
                    "nli_bidirectional_mean": nli["bidirectional_mean"],
                    "nli_entailed_both_share": nli["entailed_both_share"]})
    emit(out)


@app.command("prompts")
def prompts(
    output: OutFile,
    n: Annotated[int, typer.Option("--n", min=1, help="Number of prompts.")] = 30,
    prompt_words: Annotated[int, typer.Option(min=1, help="Words per prompt.")] = 30,
    human_words: Annotated[int, typer.Option(min=1, help="Words of human continuation (negatives).")] = 120,
    source: Annotated[str, typer.Option("--data", help="Packaged corpus or text file.")] = "austen-test",
    overwrite: Overwrite = False,
) -> None:
    """Write the Austen-derived prompt set: {"id", "prompt", "human_text"} per line."""
    from llmtool.core.data import write_jsonl
    from llmtool.evade.prompts import austen_prompts

    check_output(output, overwrite)
    rows = austen_prompts(n, prompt_words, human_words, OPTIONS.seed, source)
    write_jsonl(output, rows)
    emit({"output": str(output), "prompts": len(rows), "source": source})


def _calibrated_beta0(config, ctx) -> tuple[float, dict]:
    """beta0 measured for this rewriter on held-out Austen (cached per rewriter; see evade.beta_cache)."""
    from llmtool.core.preflight import resolve_model
    from llmtool.evade import beta_cache

    beta0, entry = beta_cache.calibrate_for_rewriter(
        ctx.paraphraser, resolve_model(config.paraphraser), texts=config.calib_texts, temperature=config.temperature,
        top_p=config.top_p, seed=OPTIONS.seed, percentile=config.percentile, aux_name=config.aux_model,
        aux_model=ctx.aux_model, aux_tokenizer=ctx.aux_tokenizer,
        announce=lambda: info(f"calibrating beta0 for {config.paraphraser} on {config.calib_texts} "
                              f"{beta_cache.CALIB_SOURCE} texts (once per rewriter; --beta0 skips this)"))
    info(f"beta0 = {beta0:g} for this rewriter ({'cached' if entry['cached'] else entry['note']})")
    return beta0, entry


@app.command("calibrate-beta")
def calibrate_beta_cmd(
    data: Annotated[Path, typer.Argument(help="JSONL of (unwatermarked) calibration texts.")],
    paraphraser: Annotated[str, typer.Option("--paraphraser", help="Rewriter LM.")] = "smollm2-135m",
    field: Field = "text",
    n: Annotated[int, typer.Option("--n", min=1, help="Texts used (the paper uses 50).")] = 50,
    start: Annotated[float, typer.Option("--from", max=0.0, help="First beta tried.")] = -1.0,
    stop: Annotated[float, typer.Option("--to", max=0.0, help="Last beta tried.")] = -12.0,
    step: Annotated[float, typer.Option("--step", min=0.01, help="Spacing of the beta grid.")] = 1.0,
    batch_size: BatchSize = 16,
    baseline: Annotated[bool, typer.Option("--baseline/--no-baseline", help="Measure degeneration at beta = 0 "
                                           "first and count a beta only when its rate is significantly above it "
                                           "(--no-baseline: the paper's rule, one degenerate output).")] = True,
) -> None:
    """Find BIRA's beta0 for a rewriter: the first beta (from --from down to --to) at which the N
    paraphrases degenerate significantly more often than at beta = 0 (with --no-baseline: at which at
    least one degenerates)."""
    preflight(paraphraser, None, inputs=(data,))
    from llmtool.core.data import read_jsonl
    from llmtool.core.models import load_model, load_tokenizer, set_seed
    from llmtool.evade.bira import calibrate_beta, suppression_set
    from llmtool.evade.paraphrase import Paraphraser

    if stop > start:
        raise UsageError(f"--to {stop} must not be above --from {start}")
    rows = read_jsonl(data)[:n]
    texts = _texts(rows, data, field)
    set_seed()
    para = Paraphraser(load_model(paraphraser), load_tokenizer(paraphraser),
                       _decode_config(150, 0.7, 0.9, 0, batch_size))
    sets = [suppression_set(para.model, para.tokenizer, t) for t in texts]
    lengths = [para.source_length(t) for t in texts]
    grid, b = [], start
    while b >= stop - 1e-9:
        grid.append(round(b, 6))
        b -= step
    beta0, curve = calibrate_beta(lambda beta: para.rewrite_ids(texts, sets, [beta] * len(texts), seed=OPTIONS.seed),
                                  lengths, grid, baseline=baseline)
    emit({"paraphraser": paraphraser, "texts": len(texts), "beta0": beta0, "curve": curve}, rows=curve,
         title=f"beta0 = {beta0}")
