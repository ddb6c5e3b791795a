"""`llmtool evaluate sysr|bai-sim|judge|judge-sample|judge-self-agg|judge-synth|autograder ...`: statistics over
per-item result files, and the judge sampling that makes vote files.

Registers its commands on the `evaluate` app (see llmtool/evaluate/cli.py). Heavy imports stay inside the
command functions.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Optional

import typer

from llmtool.core.console import OPTIONS, UsageError, emit, info, progress
from llmtool.core.preflight import preflight  # torch-free: fail fast before heavy imports
from llmtool.evaluate.cli import app

Responses = typer.Option(None, "--responses", help="Per-item results: one wide/long .csv/.parquet, or one "
                         "lm-eval samples .jsonl per model (NAME=path). Repeatable.")


def _matrix(responses: list[str], metric: Optional[str]):
    from llmtool.evaluate.results_io import complete_items, load_matrix

    mat = load_matrix(responses, metric)
    mat, dropped = complete_items(mat)
    if dropped:
        info(f"dropped {dropped} item(s) without a score for every model; {len(mat.item_ids)} remain")
    return mat


def _write_json(path: Path, doc) -> None:
    from llmtool.core.checkpoint import atomic_file

    with atomic_file(Path(path)) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, default=float))


# ----------------------------------------------------------------------------------------------- sysr

def _files(responses: Optional[list[str]]) -> list[str]:
    """The paths of --responses values (``NAME=path`` or a path)."""
    out = []
    for r in responses or []:
        out.append(r if Path(r).exists() or "=" not in r else r.split("=", 1)[1])
    return out


def check_output(*args, **kwargs):
    """core.checkpoint's output check, imported when a command runs (it loads torch)."""
    from llmtool.core.checkpoint import check_output as check

    return check(*args, **kwargs)


@app.command("sysr")
def sysr_cmd(
    responses: Optional[list[str]] = Responses,
    metric: Optional[str] = typer.Option(None, help="lm-eval samples: metric field (default: acc, exact_match, ...)."),
    budget: Optional[int] = typer.Option(None, min=1, help="Number of (model, query) evaluations allowed."),
    budget_frac: Optional[float] = typer.Option(None, help="Budget as a fraction of K*N (instead of --budget)."),
    models: Optional[Path] = typer.Option(None, "--models", help="Live mode: models.yaml (name, path, max_new_tokens)."),
    queries: Optional[Path] = typer.Option(None, "--queries", help="Live mode: bench.jsonl with id, prompt, reference."),
    scorer: str = typer.Option("exact_match", help="Live mode scorer: exact_match or contains."),
    cache: Optional[Path] = typer.Option(None, help="Live mode cache (default: OUT with suffix .cache.parquet)."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Write sysr_run.json here."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
) -> None:
    """Identify the best model with SySRs (replay over a score matrix, or live with a lazy scorer)."""
    preflight(None, out, inputs=(*_files(responses), models, queries), overwrite=overwrite)
    import numpy as np

    from llmtool.evaluate import sysr as S

    if out is not None:
        check_output(out, overwrite)
    seed = OPTIONS.seed
    live = models is not None or queries is not None
    if live and responses:
        raise UsageError("give either --responses (replay) or --models/--queries (live), not both")
    if live:
        if models is None or queries is None:
            raise UsageError("live mode needs both --models and --queries")
        from llmtool.evaluate.sysr_live import live_scorer

        names, item_ids, score_fn = live_scorer(models, queries, scorer)
        k, n = len(names), len(item_ids)
    else:
        if not responses:
            raise UsageError("give --responses FILE (replay) or --models and --queries (live)")
        mat = _matrix(responses, metric)
        names, item_ids = mat.models, mat.item_ids
        k, n = mat.shape
    if (budget is None) == (budget_frac is None):
        raise UsageError("give exactly one of --budget or --budget-frac")
    if budget_frac is not None:
        if not 0 < budget_frac <= 1:
            raise UsageError(f"--budget-frac must be in (0, 1], got {budget_frac}")
        budget = max(k, round(budget_frac * k * n))
    if budget < k:
        raise UsageError(f"--budget {budget} is smaller than the number of models {k}")
    rng = np.random.default_rng(seed)
    if live:
        cache = cache or (out.with_suffix(".cache.parquet") if out else Path("sysr_cache.parquet"))
        oracle = S.LiveOracle(names, item_ids, score_fn, cache)
    else:
        oracle = S.MatrixOracle(mat.scores, rng, mat.samples)
    result = S.sysr(oracle, budget, rng, names)
    doc = S.run_record(result, names, item_ids, budget, seed)
    if live:
        doc["scorer_calls"] = oracle.calls
        doc["cache"] = str(cache)
    else:
        doc["matrix"] = mat.summary()
    if out is not None:
        _write_json(out, doc)
    rows = [{"phase": p["k"], "alive": len(p["alive"]), "n_k": p["n_k"], "queries": p["cumulative_queries"],
             "eliminated": p["eliminated"] or "", "tie_broken": p["tie_broken"]} for p in doc["phases"]]
    emit(doc, rows=rows, title=f"SySRs: best = {doc['best']} ({doc['evaluations_used']}/{budget} evaluations)")


@app.command("build-matrix")
def build_matrix_cmd(
    responses: Optional[list[str]] = Responses,
    metric: Optional[str] = typer.Option(None, help="lm-eval samples: metric field."),
    keep_missing: bool = typer.Option(False, help="Keep items without a score for every model (NaN cells)."),
    out: Path = typer.Option(..., "-o", "--out", help="Wide .csv or .parquet to write."),
    overwrite: bool = typer.Option(False, "--overwrite"),
) -> None:
    """Convert long tables or lm-eval samples files into one wide score matrix (item_id + one column per model)."""
    preflight(None, out, inputs=_files(responses), overwrite=overwrite)
    from llmtool.evaluate.results_io import load_matrix, write_wide

    check_output(out, overwrite)
    if out.suffix not in (".csv", ".parquet"):
        raise UsageError(f"{out}: output must end in .csv or .parquet")
    mat = load_matrix(responses or [], metric) if keep_missing else _matrix(responses or [], metric)
    write_wide(mat, out)
    emit({"out": str(out), "models": len(mat.models), "items": len(mat.item_ids)})


# ----------------------------------------------------------------------------------------------- bai-sim

@app.command("bai-sim")
def bai_sim_cmd(
    responses: Optional[list[str]] = Responses,
    metric: Optional[str] = typer.Option(None, help="lm-eval samples: metric field."),
    synthetic: Optional[str] = typer.Option(None, help="Use a generated matrix instead: 'irt'."),
    k: int = typer.Option(10, min=2, help="Synthetic: number of models."),
    n: int = typer.Option(2000, min=2, help="Synthetic: number of items."),
    gap: float = typer.Option(0.05, help="Synthetic: top-two accuracy gap."),
    spread: float = typer.Option(3.0, help="Synthetic: sd of item difficulties (similarity)."),
    gen_seed: int = typer.Option(0, help="Synthetic: generator seed."),
    methods: Optional[str] = typer.Option(None, help="Comma list of methods (default: every registered method "
                                          "but full); NAME@VALUE sets the method's main option, e.g. ucbe@0.1 "
                                          "(exploration a), ucbe-lrf@3 (eta)."),
    budget_fracs: str = typer.Option("0.01,0.02,0.05,0.1,0.15,0.2,0.3,0.4,0.6,0.8", help="Comma list of budget fractions."),
    reps: int = typer.Option(500, min=1, help="Replays per (method, budget)."),
    lrf_reps: Optional[int] = typer.Option(None, min=1, help="Replays for ucbe-lrf (slow; default: --reps, "
                                           "the same count as every other method)."),
    workers: int = typer.Option(1, min=1, help="Processes for the (method, budget) cells (same results)."),
    delta: float = typer.Option(0.05, help="Target error for the budget-needed summary."),
    out: Path = typer.Option(..., "-o", "--out", help="bai_results.csv (bai_summary.json is written beside it)."),
    overwrite: bool = typer.Option(False, "--overwrite"),
) -> None:
    """Error rate (Wilson 95% CI) vs budget of SySRs and its baselines over many replays."""
    from dataclasses import asdict

    from llmtool.evaluate import bai_sim as B
    from llmtool.evaluate.bai import default_methods, parse_method

    check_output(out, overwrite)
    if not 0 < delta < 1:
        raise UsageError(f"--delta {delta}: must be in (0, 1)")
    method_list = [m.strip() for m in methods.split(",") if m.strip()] if methods else default_methods()
    for m in method_list:
        parse_method(m)
    try:
        fracs = [float(x) for x in budget_fracs.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--budget-fracs: not a comma list of numbers: {budget_fracs!r}") from None
    if not fracs or any(not 0 < f <= 1 for f in fracs):
        raise UsageError("--budget-fracs must be numbers in (0, 1]")
    if synthetic is not None:
        if synthetic != "irt":
            raise UsageError(f"--synthetic: unknown generator {synthetic!r} (choose: irt)")
        if responses:
            raise UsageError("give either --responses or --synthetic, not both")
        mat = B.synthetic_irt(k, n, gap, spread, gen_seed)
    elif responses:
        mat = _matrix(responses, metric)
    else:
        raise UsageError("give --responses FILE or --synthetic irt")
    rows = B.simulate(mat, method_list, fracs, reps, OPTIONS.seed, benchmark=Path(mat.source).stem
                      if synthetic is None else mat.source, reps_per_method={"ucbe-lrf": lrf_reps} if lrf_reps else None, progress=progress,
                      workers=workers)
    from llmtool.core.checkpoint import atomic_file

    fields = ["method", "budget_frac", "budget", "rep_count", "error_rate", "error_ci_low", "error_ci_high",
              "mean_regret", "benchmark"]
    with atomic_file(out) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
    summary = B.summarise(rows, delta)
    summary["matrix"] = mat.summary()
    _write_json(out.with_name("bai_summary.json"), summary)
    table = [{k_: v for k_, v in asdict(r).items() if k_ in fields[:8]} for r in rows]
    emit({"results": table, "summary": summary}, rows=table, title=f"bai-sim on {mat.source}")


# ----------------------------------------------------------------------------------------------- judge

def _read_calib_json(path: Path) -> dict:
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: malformed JSON ({getattr(e, 'msg', e)})") from None
    except RecursionError:
        raise UsageError(f"{path}: malformed JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: expected a JSON object keyed by task")
    return doc


def _self_agg_ratings(path: Path) -> dict:
    """id -> aggregated rating (null kept) from a judge-self-agg output."""
    import math

    from llmtool.core.data import read_jsonl

    out = {}
    for line, r in enumerate(read_jsonl(path, required=("id", "rating")), 1):
        x = r["rating"]
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)):
            raise UsageError(f"{path}:{line}: field 'rating' must be a number or null, got {x!r}")
        out[str(r["id"])] = x
    return out


@app.command("judge")
def judge_cmd(
    votes: Path = typer.Option(..., "--votes", help="votes.jsonl: id, sample, order, rating (null = parse failure), "
                               "task?, group?."),
    human: Optional[Path] = typer.Option(None, "--human", help="human.jsonl: id, rating (several raters allowed)."),
    calib: Optional[Path] = typer.Option(None, "--calib-labels", help="Calibration labels (human format); default: "
                                         "random --calib-frac of the --human items (stratified by task)."),
    calib_frac: float = typer.Option(0.2, help="Calibration share of the labelled items without --calib-labels."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma list of aggregators to compare "
                                          "(default: all of llmtool.evaluate.judge_btd.METHODS)."),
    nu_mode: str = typer.Option("item", help="BTD tie model: item (per-item nu) or shared."),
    frame: str = typer.Option("canonical", help="canonical (rating > 0 = A better) or presented (mirror BA votes)."),
    load_calib: Optional[Path] = typer.Option(None, "--load-calib", help="Reuse a calib.json (one entry per task) "
                                              "instead of fitting."),
    self_agg: Optional[Path] = typer.Option(None, "--self-agg", help="selfagg.jsonl of `evaluate judge-self-agg`: "
                                            "adds the self-agg row (null/missing = tie, counted as a failure)."),
    groups: Optional[Path] = typer.Option(None, "--groups", help="JSONL with id, group (pairs.jsonl works) defining "
                                          "pairwise-accuracy groups; default: the votes' group field, else the task."),
    pool_tasks: bool = typer.Option(False, "--pool-tasks", help="One judge fit and calibration over all tasks "
                                    "(default: one per task)."),
    out: Path = typer.Option(..., "-o", "--out", help="agg.jsonl (calib.json and judge_report.json beside it)."),
    overwrite: bool = typer.Option(False, "--overwrite"),
) -> None:
    """Aggregate n judge ratings per item (BTD with per-task calibration, and baselines); MAE/pairwise accuracy."""
    preflight(None, out, inputs=(votes, human, calib, load_calib, self_agg, groups), overwrite=overwrite)
    from llmtool.core.data import read_jsonl, write_jsonl
    from llmtool.evaluate import judge_btd as J

    check_output(out, overwrite)
    if not 0 < calib_frac < 1:
        raise UsageError(f"--calib-frac must be in (0, 1), got {calib_frac}")
    methods = [m.strip() for m in methods.split(",") if m.strip()] if methods else list(J.METHODS)
    counts = J.counts_from_votes(read_jsonl(votes), frame, str(votes))
    labels = J.human_consensus(read_jsonl(human), str(human)) if human else None
    calib_ids = None
    if calib:
        calib_labels = J.human_consensus(read_jsonl(calib), str(calib))
        labels = {**(labels or {}), **calib_labels}
        calib_ids = list(calib_labels)
    fit = cal = None
    if load_calib:
        doc = _read_calib_json(load_calib)
        fit, cal = {}, {}
        for key in J.task_units(counts, not pool_tasks):
            fit[key], cal[key] = J.load_calib_document(doc, str(load_calib), key)
    group_list = None
    if groups:
        gmap = {str(r["id"]): r.get("group") for r in read_jsonl(groups, required=("id",))}
        group_list = [None if gmap.get(i) is None else str(gmap[i]) for i in counts.ids]
        missing = sum(g is None for g in group_list)
        if missing:
            info(f"{groups}: {missing} item(s) without a group use their task as the group")
    ratings = _self_agg_ratings(self_agg) if self_agg else None
    run = J.run_judge(counts, labels, calib_ids, calib_frac, nu_mode, methods, groups=group_list,
                      seed=OPTIONS.seed, fit=fit, calibration=cal, per_task=not pool_tasks, self_agg=ratings)
    names = [*methods, *(["self-agg"] if ratings is not None else [])]
    records = [rec for m in names for rec in J.agg_records(counts, run.aggregates[m])]
    write_jsonl(out, records)
    _write_json(out.with_name("calib.json"), J.calib_document(run))
    tasks = sorted(set(counts.tasks))
    report = {"items": len(counts.ids), "tasks": tasks, "calib_items": int(len(run.calib_idx)),
              "test_items": int(len(run.test_idx)), "metrics": run.metrics, **J.fit_summary(run)}
    if run.task_metrics:
        report["task_metrics"] = run.task_metrics
    if ratings is not None:
        report["self_agg"] = {"file": str(self_agg), "failures": run.self_agg_failures,
                              "failure_rate": run.self_agg_failures / len(counts.ids)}
    uncal = [k for k, c in run.calibrations.items() if not c.calibrated]
    if uncal:
        report["note"] = (f"no human labels for {', '.join(uncal)}: BTD uses beta = 1, c = log nu0, gamma = 0 "
                          "(uncalibrated)")
    _write_json(out.with_name("judge_report.json"), report)
    if ratings is not None:
        info(f"self-agg: {run.self_agg_failures} of {len(counts.ids)} item(s) without a parsed rating (counted as ties)")
    emit(report, rows=(run.metrics + run.task_metrics) or None, title="judge aggregation (test split)")


def _judge_backend(judge: str, api_base: Optional[str], *, temperature: float, max_new_tokens: int, batch_rows: int,
                   force_final: bool, concurrency: int, desc: str):
    """(generator, spec) for --judge / --aggregator: hf:DIR|alias (or a bare one) or openai:MODEL."""
    from llmtool.evaluate import judge_sample as S

    kind, arg = S.parse_model_spec(judge)
    if kind == "openai":
        if not api_base:
            raise UsageError(f"{judge}: openai:MODEL needs --api-base URL (e.g. http://localhost:8000/v1)")
        if force_final:
            raise UsageError("--force-final needs a local (hf:) model: a chat endpoint cannot continue a reply")
        return S.openai_generator(arg, api_base, temperature=temperature, max_new_tokens=max_new_tokens,
                                  seed=OPTIONS.seed, concurrency=concurrency, desc=desc), judge
    from llmtool.core.models import load_model, load_tokenizer

    model, tok = load_model(arg), load_tokenizer(arg)
    return S.hf_generator(model, tok, temperature=temperature, max_new_tokens=max_new_tokens, batch_rows=batch_rows,
                          seed=OPTIONS.seed, force_final=force_final, desc=desc), f"hf:{arg}"


def _judge_preflight(judge: str, out: Path, inputs, overwrite: bool) -> None:
    from llmtool.evaluate.judge_sample import parse_model_spec

    kind, arg = parse_model_spec(judge)
    preflight(arg if kind == "hf" else None, out, inputs=inputs, overwrite=overwrite)


JudgeModel = typer.Option(..., "--judge", help="hf:DIR|alias (local transformers; a bare DIR|alias also works) or "
                          "openai:MODEL (with --api-base; key from $OPENAI_API_KEY).")
ApiBase = typer.Option(None, "--api-base", help="OpenAI-compatible base URL for openai: models.")
Scale = typer.Option("3way", "--scale", help="Rating scale: 3way (A/tie/B), 5pt (-2..2) or 7pt (-3..3).")
ForceFinal = typer.Option(False, "--force-final", help="Budget forcing (local models): an output that has no "
                          "'Final rating:' line when it stops gets one appended and a few more sampled tokens; "
                          "the strict parser still decides.")
BatchRows = typer.Option(32, "--batch-rows", min=1, help="Local sampling: rows (prompts x samples) per decode batch "
                         "(throughput only).")
Concurrency = typer.Option(4, "--concurrency", min=1, help="Parallel API calls (openai:).")


@app.command("judge-sample")
def judge_sample_cmd(
    judge: str = JudgeModel,
    pairs: Path = typer.Option(..., "--pairs", help="pairs.jsonl: id, prompt, response_a, response_b, task?, group?."),
    n: int = typer.Option(20, "--n", min=1, help="Samples per pair."),
    swap: str = typer.Option("half", "--swap", help="half (odd samples in BA order, mirrored), none, or all."),
    temperature: float = typer.Option(1.0, "--temperature", min=0.0, help="Sampling temperature (0 = greedy)."),
    scale: str = Scale,
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", min=1, help="Reasoning + rating tokens per sample."),
    api_base: Optional[str] = ApiBase,
    force_final: bool = ForceFinal,
    batch_rows: int = BatchRows,
    concurrency: int = Concurrency,
    out: Path = typer.Option(..., "-o", "--out", help="votes.jsonl (canonical frame: positive = A better)."),
    overwrite: bool = typer.Option(False, "--overwrite"),
) -> None:
    """Sample n judge ratings per pair (reasoning, then 'Final rating: <value>'; strict parse, null on failure)."""
    _judge_preflight(judge, out, (pairs,), overwrite)
    from llmtool.core.checkpoint import atomic_file
    from llmtool.core.data import read_jsonl, write_jsonl
    from llmtool.evaluate import judge_sample as S

    S.check_scale(scale)
    S.sample_orders(1, swap)
    rows = S.read_pairs(read_jsonl(pairs), str(pairs))
    if temperature == 0 and n > 1:
        info("--temperature 0 is greedy: the n samples of an order are identical")
    kind, arg = S.parse_model_spec(judge)
    if kind != "openai":
        from llmtool.core import eta_plans as plans

        shape = plans.Shape.of(arg)
        n_rows = len(rows) * n
        plans.announce(plans.generation("judge samples", shape, n_rows, plans.prompt_tokens(
            [{"p": " ".join(str(r.get(k, "")) for k in ("prompt", "response_a", "response_b"))} for r in rows],
            field="p") + 60, max_new_tokens, batch_rows), shape, "evaluate judge-sample")
    with atomic_file(out, overwrite) as tmp:  # before the model loads: an interrupted run leaves nothing
        gen, spec = _judge_backend(judge, api_base, temperature=temperature, max_new_tokens=max_new_tokens,
                                   batch_rows=batch_rows, force_final=force_final, concurrency=concurrency,
                                   desc="judge samples")
        votes = S.sample_votes(rows, gen, n, swap, scale)
        write_jsonl(tmp, votes)
    summary = {"out": str(out), "judge": spec, "pairs": len(rows), "n": n, "swap": swap, "scale": scale,
               "temperature": temperature, **S.vote_summary(votes)}
    emit(summary, title="judge-sample")


@app.command("judge-self-agg")
def judge_self_agg_cmd(
    judge: Optional[str] = typer.Option(None, "--judge", help="The judge that made the votes (the aggregator unless "
                                        "--aggregator): hf:DIR|alias or openai:MODEL."),
    aggregator: Optional[str] = typer.Option(None, "--aggregator", help="Another model to aggregate with."),
    pairs: Path = typer.Option(..., "--pairs", help="The pairs.jsonl the votes were made from."),
    votes: Path = typer.Option(..., "--votes", help="votes.jsonl of `evaluate judge-sample` (raw outputs)."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="Aggregator temperature (0 = greedy)."),
    scale: str = Scale,
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", min=1),
    max_raw_chars: int = typer.Option(1000, "--max-raw-chars", min=1, help="Each judge output is cut to this length."),
    api_base: Optional[str] = ApiBase,
    force_final: bool = ForceFinal,
    batch_rows: int = BatchRows,
    concurrency: int = Concurrency,
    out: Path = typer.Option(..., "-o", "--out", help="selfagg.jsonl: id, rating (canonical; null = failure), raw."),
    overwrite: bool = typer.Option(False, "--overwrite"),
) -> None:
    """Instruction-based self-aggregation: the judge reads its n outputs for a pair and gives one final rating."""
    model = aggregator or judge
    if model is None:
        raise UsageError("give --judge MODEL (or --aggregator MODEL)")
    _judge_preflight(model, out, (pairs, votes), overwrite)
    from llmtool.core.checkpoint import atomic_file
    from llmtool.core.data import read_jsonl, write_jsonl
    from llmtool.evaluate import judge_sample as S

    S.check_scale(scale)
    rows = S.read_pairs(read_jsonl(pairs), str(pairs))
    vote_rows = read_jsonl(votes, required=("id",))
    with atomic_file(out, overwrite) as tmp:
        gen, spec = _judge_backend(model, api_base, temperature=temperature, max_new_tokens=max_new_tokens,
                                   batch_rows=batch_rows, force_final=force_final, concurrency=concurrency,
                                   desc="self-aggregation")
        recs = S.self_aggregate(rows, vote_rows, gen, scale, max_raw_chars, str(votes))
        write_jsonl(tmp, recs)
    failures = sum(r["rating"] is None for r in recs)
    summary = {"out": str(out), "aggregator": spec, "items": len(recs), "failures": failures,
               "failure_rate": failures / len(recs)}
    if failures:
        info(f"self-agg: {failures} of {len(recs)} answer(s) without a parseable final rating (null; `evaluate judge "
             "--self-agg` counts them as ties)")
    emit(summary, title="judge-self-agg")


@app.command("judge-synth")
def judge_synth_cmd(
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Folder for votes.jsonl, human.jsonl, truth.jsonl."),
    items: int = typer.Option(500, min=10),
    n_votes: int = typer.Option(20, "--n", min=1, help="Votes per item."),
    tau: float = typer.Option(1.5, min=0.0, max=20.0, help="sd of the item strengths theta_i."),
    omega: float = typer.Option(0.5, min=0.0, max=10.0, help="sd of log nu_i (0 = shared nu)."),
    nu_h: float = typer.Option(2.0, min=0.0, max=1e6, help="Human tie parameter."),
    swap: bool = typer.Option(True, help="Write half of the votes in BA order (presented frame)."),
    overwrite: bool = typer.Option(False, "--overwrite"),
) -> None:
    """Synthetic judge votes and human labels with planted Davidson parameters (for tests and demos)."""
    import numpy as np

    from llmtool.core.checkpoint import atomic_output
    from llmtool.evaluate import judge_btd as J

    seed = OPTIONS.seed
    counts, theta, log_nu = J.synthetic_counts(items, tau, 0.0, omega, n_votes, seed, shared=omega == 0)
    h = J.synthetic_human(theta, nu_h, seed + 1)
    rng = np.random.default_rng(seed + 2)
    with atomic_output(out_dir, overwrite) as tmp:
        with open(tmp / "votes.jsonl", "w") as fh:
            for i, iid in enumerate(counts.ids):
                ratings = [1] * int(counts.a[i]) + [0] * int(counts.t[i]) + [-1] * int(counts.b[i])
                rng.shuffle(ratings)
                for s, r in enumerate(ratings):
                    order = "BA" if swap and s % 2 else "AB"
                    fh.write(json.dumps({"id": iid, "sample": s, "order": order,
                                         "rating": -r if order == "BA" else r}) + "\n")
        with open(tmp / "human.jsonl", "w") as fh:
            for iid, x in zip(counts.ids, h):
                fh.write(json.dumps({"id": iid, "rating": int(x)}) + "\n")
        with open(tmp / "truth.jsonl", "w") as fh:
            for iid, t, ln in zip(counts.ids, theta, log_nu):
                fh.write(json.dumps({"id": iid, "theta": float(t), "log_nu": float(ln)}) + "\n")
    emit({"out": str(out_dir), "items": items, "n": n_votes, "frame": "presented" if swap else "canonical"})


# ----------------------------------------------------------------------------------------------- autograder

autograder_app = typer.Typer(no_args_is_help=True, help="Bayesian GLMs of autograder bias (NumPyro NUTS).")
app.add_typer(autograder_app, name="autograder")


def _csv_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


@autograder_app.command("fit")
def autograder_fit_cmd(
    data: Path = typer.Option(..., "--data", help="Long CSV/parquet, one row per grade."),
    outcome: str = typer.Option("score", help="Outcome column."),
    kind: str = typer.Option("ordinal", help="ordinal | pairwise | binomial."),
    levels: Optional[str] = typer.Option(None, help="Ordinal scale MIN:MAX (default: data range)."),
    effects: str = typer.Option("", help="Comma list of categorical main effects, e.g. grader,LLM."),
    interactions: str = typer.Option("", help="Comma list FACTOR:FACTOR, e.g. grader:LLM (self-preference)."),
    slopes: str = typer.Option("", help="Comma list COLUMN or COLUMN:FACTOR (slope per level, partially pooled)."),
    standardise: str = typer.Option("", help="Columns to standardise (mean 0, sd 1)."),
    random: str = typer.Option("", help="Random intercepts, e.g. item."),
    hierarchical: Optional[str] = typer.Option(None, help="GRADER:TYPE grader-type hierarchy."),
    group_map: str = typer.Option("", help="Grader -> type when TYPE is not a column: 'Human=human,*=model'."),
    pair_param: str = typer.Option("pair", help="Pairwise: pair (effects given) or bt (LLM_1/LLM_2 strengths)."),
    coding: str = typer.Option("effect", help="effect (sum-to-zero) or dummy."),
    trials: Optional[str] = typer.Option(None, help="Binomial: column with the number of attempts."),
    chains: int = typer.Option(4, min=1), samples: int = typer.Option(2000, min=1),
    warmup: int = typer.Option(1000, min=1), target_accept: float = typer.Option(0.95),
    max_tree_depth: int = typer.Option(10, min=1),
    agreement_units: str = typer.Option("", help="Also compute Krippendorff alpha with these unit columns, e.g. item,LLM."),
    counterfactual: str = typer.Option("", help="Bias terms to zero for counterfactual alpha, e.g. grader_effects."),
    tag: str = typer.Option(""),
    out: Path = typer.Option(..., "-o", "--out", help="Output directory."),
    overwrite: bool = typer.Option(False, "--overwrite"),
) -> None:
    """Fit a Bayesian GLM of grades; write draws, summary (R-hat, ESS), diagnostics, LOO/WAIC."""
    lv = None
    if levels:
        try:
            lo, hi = (int(x) for x in levels.split(":"))
        except ValueError:
            raise UsageError(f"--levels: expected MIN:MAX integers, got {levels!r}") from None
        if lo >= hi:
            raise UsageError(f"--levels {levels}: MIN must be below MAX (an ordinal scale has two or more grades)")
        lv = (lo, hi)
    if not 0.0 < target_accept < 1.0:
        raise UsageError(f"--target-accept {target_accept}: must lie in (0, 1)")
    preflight(None, out, inputs=(data,), overwrite=overwrite)
    from llmtool.core.checkpoint import atomic_output, write_provenance
    from llmtool.core.data import read_table
    from llmtool.evaluate import autograder_glm as G

    check_output(out, overwrite, inputs=(data,))
    cfg = G.GlmConfig(outcome=outcome, kind=kind, levels=lv, effects=_csv_list(effects),
                      interactions=_csv_list(interactions), slopes=_csv_list(slopes),
                      standardise=_csv_list(standardise), random=_csv_list(random), hierarchical=hierarchical,
                      group_map=G.parse_group_map(group_map), pair_param=pair_param, coding=coding, trials=trials,
                      chains=chains, samples=samples, warmup=warmup, target_accept=target_accept,
                      max_tree_depth=max_tree_depth, seed=OPTIONS.seed, tag=tag)
    G.validate_config(cfg)
    rows = read_table(data)
    G.build_design(rows, cfg, str(data))  # empty, non-numeric or non-finite grades: refused before sampling
    info(f"NUTS: {chains} chains x ({warmup} warm-up + {samples} draws) on {len(rows)} rows")
    fitted = G.fit(rows, cfg, str(data))
    ic = G.information_criteria(fitted)
    agreement = None
    if agreement_units:
        agreement = G.agreement(fitted, rows, _csv_list(agreement_units), counterfactual=_csv_list(counterfactual),
                                seed=cfg.seed)
    with atomic_output(out, overwrite) as tmp:
        G.write_fit(fitted, tmp, dict(ic))
        if agreement is not None:
            (tmp / "agreement.json").write_text(json.dumps(agreement, indent=2))
        write_provenance(tmp, "evaluate autograder fit", kind, {k: str(v) for k, v in vars(cfg).items()},
                         metrics={"diagnostics": fitted.diagnostics, "loo": ic["loo"], "waic": ic["waic"]})
    bias = [r for r in G.bias_table(fitted) if r["parameter"] not in ("cutpoints", "cut_first")]
    emit({"out": str(out), "diagnostics": fitted.diagnostics, "loo": ic["loo"], "waic": ic["waic"],
          "effects": bias, "agreement": agreement},
         rows=[{k: v for k, v in r.items() if k != "sd"} for r in bias],
         title=f"posterior (94% HDI); max r_hat {fitted.diagnostics['max_r_hat']:.3f}, min ESS "
               f"{fitted.diagnostics['min_ess']:.0f}, divergences {fitted.diagnostics['divergences']}")


@autograder_app.command("compare")
def autograder_compare_cmd(
    fits: list[Path] = typer.Argument(..., help="Two or more fit directories."),
    criterion: str = typer.Option("loo", help="loo or waic."),
) -> None:
    """Compare fitted models by PSIS-LOO or WAIC (elpd difference and its SE)."""
    preflight(None, None, inputs=fits)
    import warnings

    import arviz as az

    from llmtool.evaluate import autograder_glm as G

    if len(fits) < 2:
        raise UsageError("compare needs at least two fit directories")
    if criterion not in ("loo", "waic"):
        raise UsageError(f"--criterion must be loo or waic, got {criterion!r}")
    idatas = {str(p): G.load_fit_dir(p) for p in fits}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = az.compare(idatas, ic=criterion)
    rows = [{"model": name, "rank": int(r["rank"]), "elpd": float(r[f"elpd_{criterion}"]), "se": float(r["se"]),
             "elpd_diff": float(r["elpd_diff"]), "dse": float(r["dse"])} for name, r in table.iterrows()]
    emit({"criterion": criterion, "models": rows}, rows=rows, title=f"model comparison ({criterion})")
