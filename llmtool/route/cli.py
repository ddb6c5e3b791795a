"""`llmtool route ...`: FusionRoute token-level collaboration of domain experts, its training stages,
its task data, and the paper's baseline families. Heavy imports stay inside the commands."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtool.core.console import OPTIONS, UsageError, emit, info
from llmtool.core.options import ModelArg, OutDirArg, Overwrite
from llmtool.core.registry import MethodConfig, method_options
from llmtool.route.baselines import BASELINES

app = typer.Typer(no_args_is_help=True, help="Token-level collaboration of expert models: FusionRoute and baselines.")

Experts = Annotated[str, typer.Option("--experts", help="Comma-separated expert model dirs (same tokenizer), in routing order.")]
Data = Annotated[Path, typer.Option("--data", help="JSONL task data: prompt, response (SFT) / answer, domain (scoring).")]
Template = Annotated[str, typer.Option("--template", help="Prompt rendering: chat (the tokenizer's chat template) or raw.")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", min=1, help="New tokens per answer.")]
BatchSize = Annotated[int, typer.Option("--batch-size", min=1, help="Sequences per batch (throughput only).")]
OutFile = Annotated[Path, typer.Option("--out", "-o", help="Output file.")]
Lr = Annotated[float, typer.Option("--lr", min=0.0, help="Learning rate.")]
Epochs = Annotated[float, typer.Option("--epochs", min=0.0, help="Training epochs.")]
MaxSteps = Annotated[int, typer.Option("--max-steps", help="Training steps (> 0 overrides --epochs).")]
MaxLength = Annotated[int, typer.Option("--max-length", min=8, help="Max tokens per training sequence.")]


def _template(t: str) -> str:
    if t not in ("chat", "raw"):
        raise UsageError(f"--template {t!r}: choose chat or raw")
    return t


def _paths(text: str, flag: str = "--experts") -> list[str]:
    items = [x.strip() for x in (text or "").split(",") if x.strip()]
    if not items:
        raise UsageError(f"{flag}: give at least one model directory")
    return items


def _preflight(model=None, out=None, inputs=(), overwrite: bool = False, experts: Optional[str] = None) -> None:
    """core.preflight before torch is imported: inputs exist, every model (and expert) is a sane causal-LM
    checkpoint or a default alias, OUT is writable."""
    from llmtool.core.preflight import checked_model, preflight

    preflight(model, out, inputs=inputs, overwrite=overwrite)
    for p in _paths(experts) if experts else ():
        checked_model(p)


def _train_args(lr, epochs, max_steps, batch_size, grad_accum=1, max_length=256, lora_r=0):
    from llmtool.core.trainer import TrainArgs

    if lr <= 0:
        raise UsageError(f"--lr {lr}: must be > 0")
    a = TrainArgs(lr=lr, epochs=epochs, max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum,
                  max_length=max_length, lora_r=lora_r, seed=OPTIONS.seed, logging_steps=5, lora_alpha=2 * max(lora_r, 1))
    a.validate()
    return a


def _threads():
    from llmtool.core.job import apply_threads

    apply_threads()


# ----------------------------------------------------------------------------------------------- data
@app.command("data")
def data_cmd(
    out: OutDirArg,
    domains: Annotated[str, typer.Option("--domains", help="Comma-separated trainable domains (math, code, reverse).")] = "math,code",
    train: Annotated[int, typer.Option("--train", min=1, help="Training rows per domain (protocol: 2000).")] = 2000,
    test: Annotated[int, typer.Option("--test", min=1, help="Test rows per domain (protocol: 200).")] = 200,
    transfer: Annotated[str, typer.Option("--transfer", help="Comma-separated report-only sets (gsm, humaneval), or ''.")] = "",
    overwrite: Overwrite = False,
) -> None:
    """Write deterministic task data (reasoning-gym generators): OUT/train.jsonl, OUT/test.jsonl,
    OUT/<domain>.train.jsonl and OUT/transfer.jsonl."""
    from llmtool.route.tasks import domain, make_split

    names = _paths(domains, "--domains")
    for n in names:
        if not domain(n).trainable:
            raise UsageError(f"--domains {n}: a transfer-only set; pass it with --transfer")
    extra = [x for x in transfer.split(",") if x.strip()]
    for n in extra:
        domain(n.strip())
    from llmtool.core.data import write_jsonl  # torch: only after the values are checked
    from llmtool.core.job import job
    with job("route data", out=out, overwrite=overwrite, seed=OPTIONS.seed) as j:
        all_train, all_test = [], []
        for i, n in enumerate(names):
            tr = make_split(n, train, OPTIONS.seed * 10**7 + i * 10**6, "train")
            te = make_split(n, test, OPTIONS.seed * 10**7 + i * 10**6 + 500_000, "test",
                            exclude={r["prompt"] for r in tr})
            write_jsonl(j.dir / f"{n}.train.jsonl", tr)
            all_train += tr
            all_test += te
        write_jsonl(j.dir / "train.jsonl", all_train)
        write_jsonl(j.dir / "test.jsonl", all_test)
        tx = []
        for n in extra:
            tx += make_split(n.strip(), test, OPTIONS.seed * 10**7 + 9 * 10**6, "transfer")
        if tx:
            write_jsonl(j.dir / "transfer.jsonl", tx)
        j.report.update({"domains": names, "train_rows": len(all_train), "test_rows": len(all_test),
                         "transfer_rows": len(tx)})
    emit({"out": str(out), **j.report})


# ----------------------------------------------------------------------------------------------- experts
@app.command("make-experts")
def make_experts(
    model: ModelArg,
    out: OutDirArg,
    data: Data,
    domains: Annotated[str, typer.Option("--domains", help="Comma-separated domains to train (default: all in --data).")] = "",
    lr: Lr = 1e-4,
    epochs: Epochs = 1.0,
    max_steps: MaxSteps = -1,
    batch_size: BatchSize = 8,
    max_length: MaxLength = 256,
    lora_r: Annotated[int, typer.Option("--lora-r", min=0, help="LoRA rank (0 = full fine-tune).")] = 0,
    template: Template = "chat",
    overwrite: Overwrite = False,
) -> None:
    """Fine-tune MODEL into one expert per domain of --data (OUT/<domain>/, ordinary HF checkpoints),
    through the shared transformers Trainer (accelerate launch scales it)."""
    from llmtool.core.preflight import preflight

    preflight(model, out, inputs=(data,), overwrite=overwrite)  # fail fast, before torch is imported
    from llmtool.core.job import job
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.core.trainer import sft
    from llmtool.route.pipeline import read_rows, sft_examples

    template = _template(template)
    rows = read_rows(data, required=("prompt", "response", "domain"))
    names = _paths(domains, "--domains") if domains else sorted({r["domain"] for r in rows})
    for n in names:
        if not any(r["domain"] == n for r in rows):
            raise UsageError(f"--domains {n}: no record of that domain in {data}")
    targs = _train_args(lr, epochs, max_steps, batch_size, max_length=max_length, lora_r=lora_r)
    from llmtool.core import eta_plans as plans

    shape = plans.Shape.of(model)
    plans.announce(plans.route_make_experts(shape, rows, names, epochs, max_steps, batch_size, max_length), shape,
                   "route make-experts")
    with job("route make-experts", out=out, overwrite=overwrite, model=model, inputs=(data,)) as j:
        tok = load_tokenizer(j.model_path)
        summary = {}
        for n in names:
            m = load_model(j.model_path)  # before the message: a bad checkpoint is the only line printed
            info(f"training expert {n!r}")
            ex = sft_examples(tok, [r for r in rows if r["domain"] == n], template, str(data))
            res = sft(m, tok, ex, targs)
            m.save_pretrained(j.dir / n, safe_serialization=True)
            tok.save_pretrained(j.dir / n)
            summary[n] = {k: res[k] for k in ("train_loss", "steps", "seconds", "examples")}
            del m
        j.report.update({"experts": summary, "train_args": targs.__dict__})
    emit({"out": str(out), "experts": ", ".join(names)},
         rows=[{"domain": k, **v} for k, v in summary.items()], title="experts")


# ----------------------------------------------------------------------------------------------- train
@app.command("train")
def train_cmd(
    out: OutDirArg,
    data: Data,
    stage: Annotated[str, typer.Option("--stage", help="sft (routing + LM) or cdpo (mixed SFT/routing + CDPO).")] = "sft",
    experts: Annotated[Optional[str], typer.Option("--experts", help="Comma-separated expert dirs (stage sft).")] = None,
    base: Annotated[Optional[str], typer.Option("--base", help="Router base model (stage sft; default smollm2-135m).")] = None,
    init: Annotated[Optional[Path], typer.Option("--init", help="Stage-1 router dir (stage cdpo).")] = None,
    lambda_route: Annotated[float, typer.Option("--lambda-route", min=0.0, help="Weight of the routing loss.")] = 1.0,
    mask: Annotated[str, typer.Option("--mask", help="Routing-loss positions: informative, informative-strict, all.")] = "informative",
    head_lr_mult: Annotated[float, typer.Option("--head-lr-mult", min=0.0, help="Routing-head LR multiplier.")] = 10.0,
    beta: Annotated[float, typer.Option("--beta", min=0.0, help="CDPO beta.")] = 0.1,
    cdpo_weight: Annotated[float, typer.Option("--cdpo-weight", min=0.0, help="CDPO term weight (stage cdpo).")] = 1.0,
    sft_weight: Annotated[float, typer.Option("--sft-weight", min=0.0, help="SFT/routing term weight in stage cdpo (0 = pure CDPO).")] = 1.0,
    freeze_head: Annotated[bool, typer.Option("--freeze-head", help="Stage cdpo ablation: freeze the routing head.")] = False,
    lr: Lr = 5e-5,
    epochs: Epochs = 1.0,
    max_steps: MaxSteps = -1,
    batch_size: BatchSize = 8,
    max_length: MaxLength = 256,
    template: Template = "chat",
    overwrite: Overwrite = False,
) -> None:
    """Train a FusionRoute router: --stage sft from --base over --experts, or --stage cdpo from --init."""
    # every option value is checked here, before any heavy import or model load
    if stage not in ("sft", "cdpo"):
        raise UsageError(f"--stage {stage!r}: choose sft or cdpo")
    if mask not in ("informative", "informative-strict", "all"):
        raise UsageError(f"--mask {mask!r}: choose informative, informative-strict or all")
    if stage == "sft" and init is not None:
        raise UsageError("--init applies to --stage cdpo only")
    if stage == "sft" and not experts:
        raise UsageError("--stage sft needs --experts")
    if stage == "cdpo" and init is None:
        raise UsageError("--stage cdpo needs --init (a stage-1 router dir)")
    if stage == "cdpo" and (experts or base):
        raise UsageError("--stage cdpo takes its experts and base from --init; drop --experts/--base")
    _preflight((base or "smollm2-135m") if stage == "sft" else None, out, (data, init), overwrite, experts)
    from llmtool.core.job import job
    from llmtool.core.models import load_model, load_tokenizer, resolve_model
    from llmtool.route.pipeline import read_rows, render, sft_examples
    from llmtool.route.router import ExpertRef, FusionRouter, RouterMeta, load_experts, load_router, save_router
    from llmtool.route.training import RouteLossArgs, train_cdpo, train_sft
    from llmtool.route.vocab import VocabView, vocab_hash

    template = _template(template)
    if mask not in ("informative", "informative-strict", "all"):
        raise UsageError(f"--mask {mask!r}: choose informative, informative-strict or all")
    rargs = RouteLossArgs(lambda_route=lambda_route, mask=mask, head_lr_mult=head_lr_mult, beta=beta,
                          cdpo_weight=cdpo_weight, sft_weight=sft_weight, freeze_head=freeze_head)
    targs = _train_args(lr, epochs, max_steps, batch_size, max_length=max_length)
    if stage == "sft":
        if init is not None:
            raise UsageError("--init applies to --stage cdpo only")
        if not experts:
            raise UsageError("--stage sft needs --experts")
        rows = read_rows(data, required=("prompt", "response"))
        base_arg = base or "smollm2-135m"
        paths = [str(resolve_model(p)) for p in _paths(experts)]
        from llmtool.core import eta_plans as plans

        shape = plans.Shape.of(base_arg)
        plans.announce(plans.route_train(shape, [plans.Shape.of(p) for p in paths], rows, epochs, max_steps,
                                         batch_size, max_length), shape, "route train")
        with job("route train", out=out, overwrite=overwrite, model=base_arg, inputs=(data,)) as j:
            tok = load_tokenizer(j.model_path)
            ref = vocab_hash(tok)
            models = load_experts(paths, ref, against=f"the router base {base_arg}")
            router = FusionRouter(load_model(j.model_path), len(models))
            vocab = VocabView.of([router.lm, *models], tok)
            res = train_sft(router, models, tok, vocab, sft_examples(tok, rows, template, str(data)), targs, rargs)
            meta = RouterMeta([ExpertRef(Path(p).name, p, ref) for p in paths], vocab.size, vocab.n_tokens,
                              str(j.model_path), "sft", {"template": template, **rargs.__dict__, **targs.__dict__})
            save_router(j.dir, router, tok, meta)
            j.report.update(res)
    elif stage == "cdpo":
        if init is None:
            raise UsageError("--stage cdpo needs --init (a stage-1 router dir)")
        if experts or base:
            raise UsageError("--stage cdpo takes its experts and base from --init; drop --experts/--base")
        rows = read_rows(data, required=("prompt", "chosen", "rejected"))
        from llmtool.core import eta_plans as plans
        from llmtool.route.router import read_meta

        shape = plans.Shape.of(init)  # the stage-1 dir holds the router's LM (config.json)
        pair_rows = [{"prompt": r["prompt"], "response": r[k]} for r in rows for k in ("chosen", "rejected")]
        plans.announce(plans.route_train(shape, [plans.Shape.of(e.path) for e in read_meta(init).experts], pair_rows,
                                         epochs, max_steps, 2 * batch_size, max_length), shape, "route train")
        with job("route train", out=out, overwrite=overwrite, inputs=(data, init)) as j:
            router, tok, models, meta = load_router(init)
            vocab = VocabView(meta.vocab_size_used, meta.n_tokens)
            tmpl = meta.params.get("template", template)
            pairs = [{"prompt": render(tok, r["prompt"], tmpl), "chosen": r["chosen"], "rejected": r["rejected"]}
                     for r in rows]
            res = train_cdpo(router, models, tok, vocab, pairs, targs, rargs)
            meta.stage = "cdpo"
            meta.params = {**meta.params, "cdpo": {**rargs.__dict__, **targs.__dict__}}
            save_router(j.dir, router, tok, meta)
            j.report.update(res)
    else:
        raise UsageError(f"--stage {stage!r}: choose sft or cdpo")
    emit({"out": str(out), "stage": stage, **{k: v for k, v in j.report.items() if not isinstance(v, (list, dict))}})


# ----------------------------------------------------------------------------------------------- generation
def _system(router: Optional[Path], model: Optional[str], mode: str, eager: bool, experts: Optional[str] = None):
    """(tokenizer, make_chooser, models, expert names, mode string) for --router RUN or --model DIR."""
    from llmtool.core.models import load_model, load_tokenizer, resolve_model
    from llmtool.route.decoding import FusionChooser, parse_mode
    from llmtool.route.router import load_router
    from llmtool.route.vocab import VocabView

    if (router is None) == (model is None):
        raise UsageError("give exactly one of --router RUN or --model DIR")
    if model is not None:
        if mode not in ("fusion", "expert:0"):
            raise UsageError("--mode applies to --router only (a --model is decoded plainly)")
        path = resolve_model(model)
        tok = load_tokenizer(path)
        m = load_model(path)
        vocab = VocabView.of([m], tok)
        return tok, (lambda: FusionChooser(None, [m], vocab, mode="expert", k=0)), [m], [], "model"
    r, tok, models, meta = load_router(router, _paths(experts) if experts else None)
    kind, k = parse_mode(mode, len(models))
    vocab = VocabView(meta.vocab_size_used, meta.n_tokens)
    names = [e.name for e in meta.experts]
    return (tok, (lambda: FusionChooser(r, models, vocab, mode=kind, k=k, eager=eager)), [r.lm, *models], names,
            mode)


RouterOpt = Annotated[Optional[Path], typer.Option("--router", help="A `route train` output dir.")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help="Decode a plain model instead (expert, merge, base).")]
Mode = Annotated[str, typer.Option("--mode", help="fusion, route-only, router-only, expert:K or force:K.")]
Eager = Annotated[bool, typer.Option("--eager-experts", help="Run every expert at every step (debug; same tokens).")]
InFile = Annotated[Path, typer.Option("--in", help="JSONL prompts (field 'prompt', optional 'id').")]
ExpertsOverride = Annotated[Optional[str], typer.Option("--experts", help="Override the recorded expert dirs (same order).")]


@app.command("generate")
def generate_cmd(
    prompts: InFile,
    out: OutFile,
    router: RouterOpt = None,
    model: ModelOpt = None,
    mode: Mode = "fusion",
    eager_experts: Eager = False,
    experts: ExpertsOverride = None,
    max_new_tokens: MaxNew = 64,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0 = greedy; else sample softmax(f/T).")] = 0.0,
    batch_size: BatchSize = 8,
    template: Template = "chat",
    overwrite: Overwrite = False,
) -> None:
    """Generate with a FusionRoute router (any mode) or a plain model; writes JSONL with route_trace."""
    _preflight(model, out, (prompts, router), overwrite, experts)
    from llmtool.core.checkpoint import atomic_file, check_output
    from llmtool.route.pipeline import read_rows, run_generation

    template = _template(template)
    check_output(out, overwrite)
    rows = read_rows(prompts)
    _threads()
    tok, make, models, names, label = _system(router, model, mode, eager_experts, experts)
    recs, summary = run_generation(rows, tok, make, models, mode=label, expert_names=names,
                                   max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
                                   seed=OPTIONS.seed, template=template)
    import json

    with atomic_file(out, overwrite) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for r in recs:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    emit({"out": str(out), "rows": len(recs), "mode": label, **summary})


@app.command("eval")
def eval_cmd(
    data: Data,
    out: OutFile,
    router: RouterOpt = None,
    model: ModelOpt = None,
    generations: Annotated[Optional[Path], typer.Option("--generations", help="Score an existing generations JSONL "
                                                        "(e.g. from `route baseline`) instead of generating.")] = None,
    mode: Mode = "fusion",
    experts: ExpertsOverride = None,
    max_new_tokens: MaxNew = 32,
    batch_size: BatchSize = 8,
    template: Template = "chat",
    overwrite: Overwrite = False,
) -> None:
    """Accuracy per domain (verifier-scored, Wilson 95 % interval), expert share per domain, tokens/s."""
    _preflight(model, out, (data, router, generations), overwrite, experts)
    import json

    from llmtool.core.checkpoint import atomic_file, check_output
    from llmtool.route.pipeline import read_rows, run_generation, score_records

    template = _template(template)
    check_output(out, overwrite)
    rows = read_rows(data, required=("prompt", "answer", "domain"))
    _threads()
    summary, names = {}, []
    if generations is not None:
        if router is not None or model is not None:
            raise UsageError("--generations scores a file; drop --router/--model")
        recs = read_rows(generations, required=("output",))
        by_id = {str(r["id"]): r for r in recs}
        missing = [str(r["id"]) for r in rows if str(r["id"]) not in by_id]
        if missing:
            raise UsageError(f"{generations}: no generation for id {missing[0]!r} of {data}")
        recs = [by_id[str(r["id"])] for r in rows]
        label = recs[0].get("mode", "file") if recs else "file"
    else:
        tok, make, models, names, label = _system(router, model, mode, False, experts)
        recs, summary = run_generation(rows, tok, make, models, mode=label, expert_names=names,
                                       max_new_tokens=max_new_tokens, batch_size=batch_size, template=template)
    scores = score_records(rows, recs, names)
    result = {"mode": label, **scores, **summary}
    with atomic_file(out, overwrite) as tmp:
        Path(tmp).write_text(json.dumps(result, indent=2))
    emit({"out": str(out), "mode": label, "mean_accuracy": scores["mean_accuracy"], **summary},
         rows=[{"domain": d, **{k: v for k, v in s.items() if k != "expert_share"}} for d, s in scores["domains"].items()],
         title="accuracy")


# ----------------------------------------------------------------------------------------------- preferences
@app.command("make-prefs")
def make_prefs(
    router: Annotated[Path, typer.Option("--router", help="Stage-1 router dir.")],
    data: Data,
    out: OutFile,
    samples: Annotated[int, typer.Option("--samples", min=2, help="Sampled responses per prompt (K).")] = 4,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="Sampling temperature.")] = 0.7,
    limit: Annotated[int, typer.Option("--limit", min=0, help="Use the first N prompts (0 = all).")] = 0,
    max_new_tokens: MaxNew = 32,
    batch_size: BatchSize = 8,
    overwrite: Overwrite = False,
) -> None:
    """Preference pairs for stage cdpo: K fused samples per prompt labelled by the domain verifier; chosen =
    a correct sample (else the gold response), rejected = a wrong one; prompts with no wrong sample are skipped."""
    _preflight(None, out, (router, data), overwrite)
    import json

    from llmtool.core.checkpoint import atomic_file, check_output
    from llmtool.route.pipeline import read_rows, run_generation
    from llmtool.route.tasks import correct

    if temperature <= 0:
        raise UsageError("--temperature must be > 0 to sample distinct responses")
    check_output(out, overwrite)
    rows = read_rows(data, required=("prompt", "answer", "domain", "response"))
    rows = rows[:limit] if limit else rows
    _threads()
    tok, make, models, names, _ = _system(router, None, "fusion", False)
    tmpl = "chat"
    from llmtool.route.router import read_meta

    tmpl = read_meta(router).params.get("template", tmpl)
    rep = [r for r in rows for _ in range(samples)]
    recs, _ = run_generation(rep, tok, make, models, mode="fusion", expert_names=names, max_new_tokens=max_new_tokens,
                             batch_size=batch_size, temperature=temperature, seed=OPTIONS.seed, template=tmpl,
                             desc="sample")
    pairs = []
    for i, r in enumerate(rows):
        outs = [x["output"] for x in recs[i * samples:(i + 1) * samples]]
        good = [o for o in outs if correct(r, o)]
        bad = [o for o in outs if not correct(r, o)]
        if not bad:
            continue
        pairs.append({"id": r["id"], "prompt": r["prompt"], "chosen": good[0] if good else r["response"],
                      "rejected": bad[0], "domain": r["domain"], "chosen_source": "sample" if good else "gold"})
    if not pairs:
        raise UsageError("no prompt produced a wrong sample; nothing to prefer (raise --temperature or --samples)")
    with atomic_file(out, overwrite) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for p in pairs:
            fh.write(json.dumps(p, ensure_ascii=False) + "\n")
    emit({"out": str(out), "prompts": len(rows), "pairs": len(pairs)})


# ----------------------------------------------------------------------------------------------- baselines
@app.command("baseline")
@method_options(BASELINES, default="seq-select")
def baseline_cmd(
    out: OutDirArg,
    config: MethodConfig,
    experts: Experts,
    base: Annotated[str, typer.Option("--base", help="Base model the experts were fine-tuned from (merges, "
                                      "sft-union, judge and reference of seq/token-select).")] = "smollm2-135m",
    data: Annotated[Optional[Path], typer.Option("--data", help="Training JSONL (sft-union).")] = None,
    prompts: Annotated[Optional[Path], typer.Option("--in", help="Prompts JSONL (seq-select, token-select); "
                                                    "rows with domain+answer are also scored.")] = None,
    max_new_tokens: MaxNew = 32,
    batch_size: BatchSize = 8,
    template: Template = "chat",
    overwrite: Overwrite = False,
) -> None:
    """Run one baseline family: generation baselines write OUT/generations.jsonl; merges and sft-union
    write OUT as an ordinary HF checkpoint."""
    candidates = Path(config.candidates) if getattr(config, "candidates", "") else None
    _preflight(base, out, (data, prompts, candidates), overwrite, experts)
    from llmtool.core.data import write_jsonl
    from llmtool.core.job import job
    from llmtool.core.models import load_model, load_tokenizer, resolve_model
    from llmtool.route.router import load_experts
    from llmtool.route.vocab import VocabView, vocab_hash

    template = _template(template)
    kind = type(config).kind
    paths = [str(resolve_model(p)) for p in _paths(experts)]
    if kind == "generate" and prompts is None:
        raise UsageError(f"--method {config.name} needs --in PROMPTS")
    if config.name == "sft-union" and data is None:
        raise UsageError("--method sft-union needs --data (the union of the experts' training data)")
    inputs = tuple(p for p in (data, prompts, candidates) if p is not None)
    with job("route baseline", out=out, overwrite=overwrite, config=config, model=base, inputs=inputs) as j:
        tok = load_tokenizer(j.model_path)
        ref = vocab_hash(tok)
        names = [Path(p).name for p in paths]
        if kind == "generate":
            from llmtool.route.pipeline import read_rows, run_generation, score_records

            rows = read_rows(prompts)
            models = load_experts(paths, ref, against=f"the base {base}")
            if config.name == "seq-select":
                from llmtool.route.baselines import seq_select
                from llmtool.route.decoding import FusionChooser

                vocab = VocabView.of(models, tok)
                outs, recs_all, secs = [], [], 0.0
                if config.candidates:
                    # every expert's answer from an earlier seq-select run on the same prompts (no generation)
                    prev = {str(r["id"]): r for r in read_rows(candidates, required=("output",))}
                    for r in rows:
                        c = prev.get(str(r["id"]), {}).get("candidates")
                        if not isinstance(c, list) or len(c) != len(models):
                            raise UsageError(f"--candidates {config.candidates}: no {len(models)} candidates for id "
                                             f"{r['id']!r}")
                    for i in range(len(models)):
                        outs.append([prev[str(r["id"])]["candidates"][i] for r in rows])
                        recs_all.append([{"id": r["id"], "output": o, "n_tokens": len(tok(o, add_special_tokens=False)
                                                                                     ["input_ids"]),
                                          "finish": "candidates", "seconds": 0.0,
                                          **({"domain": r["domain"]} if "domain" in r else {})}
                                         for r, o in zip(rows, outs[i])])
                else:
                    for i, m in enumerate(models):
                        recs, summ = run_generation(rows, tok, lambda m=m: FusionChooser(None, [m], vocab, "expert", 0),
                                                    [m], mode=f"expert:{i}", max_new_tokens=max_new_tokens,
                                                    batch_size=batch_size, template=template, desc=f"expert {i}")
                        outs.append([r["output"] for r in recs])
                        recs_all.append(recs)
                        secs += summ["seconds"]
                judge = load_model(j.model_path) if config.scorer in ("judge", "vote", "verifier") else None
                picks = seq_select(outs, rows, config.scorer, names, judge, tok, template)
                recs = []
                for jx, (r, k) in enumerate(zip(rows, picks)):
                    rec = dict(recs_all[k][jx])
                    rec.update(mode="seq-select", route_trace=[k] * rec["n_tokens"], expert_share={names[k]: 1.0},
                               chosen_expert=k, candidates=[o[jx] for o in outs])
                    recs.append(rec)
                summary = {"seconds": round(secs, 3)}
            else:
                from llmtool.route.decoding import TokenSelectChooser

                refm = load_model(j.model_path) if config.value == "implicit" else None
                vocab = VocabView.of(models + ([refm] if refm is not None else []), tok)
                recs, summary = run_generation(
                    rows, tok, lambda: TokenSelectChooser(models, vocab, refm, config.value), models,
                    mode="token-select", expert_names=names, max_new_tokens=max_new_tokens, batch_size=batch_size,
                    template=template)
            write_jsonl(j.dir / "generations.jsonl", recs)
            j.report.update(summary)
            if all("answer" in r and "domain" in r for r in rows):
                j.report.update(score_records(rows, recs, names))
        elif config.name in ("merge-ta", "merge-dare"):
            from llmtool.route.merging import dare, task_arithmetic
            from llmtool.route.vocab import check_same_tokenizer

            for p in paths:
                check_same_tokenizer(ref, load_tokenizer(p), p, f"the base {base}")
            base_model = load_model(j.model_path)
            base_sd = {k: v.detach().cpu() for k, v in base_model.state_dict().items()}
            sds = [{k: v.detach().cpu() for k, v in load_model(p).state_dict().items()} for p in paths]
            if config.name == "merge-ta":
                merged = task_arithmetic(base_sd, sds, config.lam, names)
            else:
                merged = dare(base_sd, sds, config.drop, config.lam, OPTIONS.seed, names)
            base_model.load_state_dict(merged)
            base_model.save_pretrained(j.dir, safe_serialization=True)
            tok.save_pretrained(j.dir)
            j.report.update({"experts": names})
        else:  # sft-union
            from llmtool.core.trainer import sft
            from llmtool.route.pipeline import read_rows, sft_examples

            rows = read_rows(data, required=("prompt", "response"))
            m = load_model(j.model_path)
            targs = _train_args(config.lr, config.epochs, config.max_steps, batch_size, lora_r=config.lora_r)
            res = sft(m, tok, sft_examples(tok, rows, template, str(data)), targs)
            m.save_pretrained(j.dir, safe_serialization=True)
            tok.save_pretrained(j.dir)
            j.report.update({k: res[k] for k in ("train_loss", "steps", "seconds", "examples")})
    emit({"out": str(out), "method": config.name,
          **{k: v for k, v in j.report.items() if not isinstance(v, (list, dict))}})
