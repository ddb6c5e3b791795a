"""`llmtool train pretrain|sft`: from-scratch pretraining of a small Llama and fine-tuning, each with a
``--clip`` policy (none, global, local-fixed, adagc, zclip), fault injection and per-update metrics.
Torch/transformers are imported inside the commands so `llmtool --help` stays fast.

Multi-process (``torchrun``/``accelerate launch``, DDP, FSDP2, ZeRO-1): every rank runs this command; the
Trainer shards the data (each optimizer update sees ``ranks x --batch-size x --grad-accum`` sequences),
the clipper takes identical decisions on every rank, the main process alone writes OUT (model, metrics,
report, provenance) while all ranks share its checkpoint folder. ``--resume DIR`` is checked like a MODEL
argument and its state files are inspected without unpickling (:mod:`llmtool.core.resume`)."""
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtool.core.options import ModelArg, OutDirArg, Overwrite
from llmtool.core.registry import MethodConfig, method_options
from llmtool.train.clipping import CLIPPERS

app = typer.Typer()

Steps = Annotated[int, typer.Option("--steps", min=1, help="Optimizer updates.")]
BatchSize = Annotated[int, typer.Option("--batch-size", min=1, help="Sequences per micro-batch.")]
GradAccum = Annotated[int, typer.Option("--grad-accum", min=1, help="Micro-batches per update.")]
MaxLength = Annotated[int, typer.Option("--max-length", min=2, help="Tokens per sequence/block.")]
Optim = Annotated[str, typer.Option("--optimizer", help="adamw, lion, sgd or muon (Muon on 2-D weights, AdamW on the rest).")]
Beta2 = Annotated[float, typer.Option("--adam-beta2", min=0.0, max=1.0, help="AdamW beta2 (0.999 provokes spikes).")]
AdamEps = Annotated[float, typer.Option("--adam-epsilon", min=0.0, help="AdamW epsilon (1e-12 provokes spikes).")]
Warmup = Annotated[float, typer.Option("--warmup-ratio", min=0.0, max=1.0, help="LR warm-up fraction.")]
WD = Annotated[float, typer.Option("--weight-decay", min=0.0, help="Weight decay.")]
Sched = Annotated[str, typer.Option("--lr-scheduler", help="transformers schedule: constant, linear, cosine, ...")]
GradSpike = Annotated[Optional[list[str]], typer.Option("--inject-grad-spike", help="STEP:TENSOR:SCALE[:STEPS] "
                                                        "multiply TENSOR's gradient (repeatable).")]
Garbage = Annotated[Optional[list[str]], typer.Option("--inject-garbage", help="STEP[:STEPS] random-token batches "
                                                      "(repeatable).")]
LrSpike = Annotated[Optional[list[str]], typer.Option("--inject-lr-spike", help="STEP:FACTOR[:STEPS] multiply the "
                                                      "learning rate (repeatable).")]
SaveSteps = Annotated[int, typer.Option("--save-steps", min=0, help="Checkpoint every N updates into OUT/checkpoints "
                                        "(model, optimizer, clipper state, RNG); 0 = none.")]
Resume = Annotated[Optional[Path], typer.Option("--resume", help="A checkpoint-N directory of an earlier run to "
                                                "continue from (optimizer and clipper state included).")]
Window = Annotated[int, typer.Option("--spike-window", min=1, help="Spike-score rolling window (updates).")]
Sigma = Annotated[float, typer.Option("--spike-sigma", min=0.0, help="Spike-score threshold in std devs.")]


def _args(lr, steps, batch_size, grad_accum, max_length, beta2, eps, warmup, wd, sched, save_steps, seed):
    from llmtool.core.trainer import TrainArgs

    return TrainArgs(lr=lr, max_steps=steps, batch_size=batch_size, grad_accum=grad_accum, max_length=max_length,
                     warmup_ratio=warmup, weight_decay=wd, lr_scheduler=sched, adam_beta2=beta2, adam_epsilon=eps,
                     save_steps=save_steps, seed=seed, logging_steps=1)


def _run(j, model, tok, rows, args, clip, optimizer, grad_spike, garbage, lr_spike, resume, window, sigma):
    from llmtool.core.console import UsageError
    from llmtool.train.faults import Faults
    from llmtool.train.pretrain import OPTIMIZERS, train_with_clipper

    if optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    if resume is not None:
        from llmtool.core.resume import check_resume_dir

        check_resume_dir(resume)  # again for library callers; cheap
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    faults = Faults.parse(grad_spike, garbage, lr_spike, names=names)
    from llmtool.core import dist
    from llmtool.core.trainer import full_state_dict

    ckpt = j.dir / "checkpoints"
    if dist.is_main():
        ckpt.mkdir()
    # every rank's Trainer writes into the main process's checkpoint dir (per-rank RNG files included)
    ckpt = dist.main_path(ckpt)
    res = train_with_clipper(model, tok, rows, args, clip, optimizer=optimizer, faults=faults, out_dir=ckpt,
                             metrics_path=j.dir / "metrics.jsonl", resume=str(resume) if resume else False,
                             window=window, sigma=sigma)
    state = full_state_dict(model)  # a collective under FSDP2: every rank takes part
    dist.barrier()                  # no rank is still writing into the main process's temporary OUT
    res.pop("records")
    if dist.is_main():
        if not any(ckpt.iterdir()):
            ckpt.rmdir()
        model.save_pretrained(j.dir / "model", state_dict=state, safe_serialization=True)
        tok.save_pretrained(j.dir / "model")
    return res


@app.command("pretrain")
@method_options(CLIPPERS, default="global", method_flag="--clip", param="clip")
def pretrain(
    out: OutDirArg,
    clip: MethodConfig,
    data: Annotated[str, typer.Option("--data", help="Corpus: packaged text name (austen-train, ...) or a .txt file.")] = "austen-train",
    tokenizer: Annotated[str, typer.Option("--tokenizer", help="Tokenizer source (model dir or alias).")] = "smollm2-135m",
    layers: Annotated[int, typer.Option("--layers", min=1, help="Transformer layers.")] = 2,
    d_model: Annotated[int, typer.Option("--d-model", min=8, help="Hidden size.")] = 128,
    heads: Annotated[int, typer.Option("--heads", min=1, help="Attention heads.")] = 4,
    steps: Steps = 1000,
    batch_size: BatchSize = 16,
    grad_accum: GradAccum = 1,
    max_length: MaxLength = 128,
    lr: Annotated[float, typer.Option("--lr", min=0.0, help="Peak learning rate.")] = 3e-3,
    optimizer: Optim = "adamw",
    adam_beta2: Beta2 = 0.95,
    adam_epsilon: AdamEps = 1e-8,
    warmup_ratio: Warmup = 0.0,
    weight_decay: WD = 0.1,
    lr_scheduler: Sched = "constant",
    val_blocks: Annotated[int, typer.Option("--val-blocks", min=1, help="Held-out blocks for validation loss.")] = 32,
    max_blocks: Annotated[Optional[int], typer.Option("--max-blocks", min=1, help="Use at most N training blocks.")] = None,
    inject_grad_spike: GradSpike = None,
    inject_garbage: Garbage = None,
    inject_lr_spike: LrSpike = None,
    save_steps: SaveSteps = 0,
    resume: Resume = None,
    spike_window: Window = 100,
    spike_sigma: Sigma = 7.0,
    overwrite: Overwrite = False,
):
    """Pretrain a small Llama from scratch (default model's tokenizer) with a clipping policy. The global
    --seed sets the initialisation, data order and faults."""
    from llmtool.core.preflight import looks_like_path, preflight, resolve_model
    from llmtool.core.resume import check_resume_dir

    preflight(None, out, inputs=(data if looks_like_path(data) else None, resume), overwrite=overwrite)
    resolve_model(tokenizer)  # fail fast, before torch is imported
    if resume is not None:  # the same checks as a MODEL argument, and no pickle is ever run
        check_resume_dir(resume)
    from llmtool.core.console import OPTIONS, emit
    from llmtool.core.job import job
    from llmtool.core.models import load_tokenizer, tiny_llama
    from llmtool.train.pretrain import eval_loss, pretrain_blocks

    seed = OPTIONS.seed
    args = _args(lr, steps, batch_size, grad_accum, max_length, adam_beta2, adam_epsilon, warmup_ratio,
                 weight_decay, lr_scheduler, save_steps, seed)
    args.validate()
    from llmtool.core import eta_plans as plans

    shape = plans.Shape.from_config({"hidden_size": d_model, "num_hidden_layers": layers, "num_attention_heads": heads,
                                     "vocab_size": plans.tokenizer_vocab(tokenizer)})
    plans.announce(plans.pretrain(shape, steps, batch_size, grad_accum, max_length, val_blocks), None, "train pretrain")
    with job("train pretrain", out, overwrite=overwrite, config=clip, seed=seed) as j:
        tok = load_tokenizer(tokenizer)
        train, val = pretrain_blocks(tok, data, max_length, val_blocks, max_blocks)
        model = tiny_llama(len(tok), layers=layers, d_model=d_model, heads=heads, max_length=max_length, seed=seed,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        if resume is not None:
            from llmtool.core.models import load_model

            model = load_model(resume).train()  # safetensors only, every tensor present, finite
        res = _run(j, model, tok, train, args, clip, optimizer, inject_grad_spike, inject_garbage, inject_lr_spike,
                   resume, spike_window, spike_sigma)
        res["val_loss"] = eval_loss(model, val)
        res.update({"train_blocks": len(train), "val_blocks": len(val), "layers": layers, "d_model": d_model,
                    "parameters": sum(p.numel() for p in model.parameters())})
        j.report.update(res)
    emit({k: res[k] for k in ("steps", "final_train_loss", "val_loss", "loss_spike_score", "grad_norm_spike_score",
                              "clip_fraction_steady", "seconds")}, title=f"train pretrain --clip {clip.name}")


@app.command("sft")
@method_options(CLIPPERS, default="global", method_flag="--clip", param="clip")
def sft(
    model: ModelArg,
    out: OutDirArg,
    clip: MethodConfig,
    data: Annotated[Path, typer.Option("--data", help="JSONL rows {prompt, completion} or {text}.")],
    steps: Steps = 100,
    batch_size: BatchSize = 4,
    grad_accum: GradAccum = 1,
    max_length: MaxLength = 512,
    lr: Annotated[float, typer.Option("--lr", min=0.0, help="Learning rate.")] = 2e-5,
    optimizer: Optim = "adamw",
    adam_beta2: Beta2 = 0.999,
    adam_epsilon: AdamEps = 1e-8,
    warmup_ratio: Warmup = 0.0,
    weight_decay: WD = 0.0,
    lr_scheduler: Sched = "linear",
    inject_grad_spike: GradSpike = None,
    inject_garbage: Garbage = None,
    inject_lr_spike: LrSpike = None,
    save_steps: SaveSteps = 0,
    resume: Resume = None,
    spike_window: Window = 100,
    spike_sigma: Sigma = 7.0,
    overwrite: Overwrite = False,
):
    """Fine-tune MODEL (full fine-tune) with a clipping policy (data order seeded by the global --seed)."""
    from llmtool.core.preflight import preflight
    from llmtool.core.resume import check_resume_dir

    preflight(model, out, inputs=(data, resume), overwrite=overwrite)  # fail fast, before torch is imported
    if resume is not None:
        check_resume_dir(resume)
    from llmtool.core.console import OPTIONS, emit
    from llmtool.core.job import job
    from llmtool.train.sft import load_sft_rows

    seed = OPTIONS.seed
    args = _args(lr, steps, batch_size, grad_accum, max_length, adam_beta2, adam_epsilon, warmup_ratio,
                 weight_decay, lr_scheduler, save_steps, seed)
    args.validate()
    rows = load_sft_rows(data)
    from llmtool.core import eta_plans as plans

    shape = plans.Shape.of(model)
    plans.announce(plans.sft(shape, steps, batch_size, grad_accum, max_length, plans.sft_row_tokens(rows)), shape,
                   "train sft")
    with job("train sft", out, overwrite=overwrite, config=clip, model=model, inputs=(data,), seed=seed) as j:
        m = j.model
        if resume is not None:
            from llmtool.core.models import load_model

            m = load_model(resume)
        m.train()
        res = _run(j, m, j.tokenizer, rows, args, clip, optimizer, inject_grad_spike, inject_garbage, inject_lr_spike,
                   resume, spike_window, spike_sigma)
        j.report.update(res)
    emit({k: res[k] for k in ("steps", "train_loss", "final_train_loss", "loss_spike_score", "clip_fraction_steady",
                              "seconds")}, title=f"train sft --clip {clip.name}")
