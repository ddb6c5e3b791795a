"""From-scratch pretraining of a small Llama, and the training runner shared with ``train sft``: any
``--clip`` policy (AdaGC by default off: ``global`` is the comparable default), any optimizer (AdamW,
Lion, SGD, Muon for 2-D weights with AdamW for the rest), fault injection, per-update metrics JSONL and
spike scores, on the shared transformers-Trainer in :mod:`llmtool.core.trainer`.

Reconstructed choices (../shared/specs/adagc.md §5 scale plan; the issue's protocol): the model is a
Llama config with the default model's tokenizer (vocab 49152, so the embedding dominates the parameter
count), tied input/output embeddings, ``--layers``/``--d-model``/``--heads`` sized 2-4 / 128-256; the
corpus is packed into ``--max-length`` blocks; the last ``--val-blocks`` blocks are held out for the
validation loss. The Trainer's own clipping is off (``max_grad_norm=0``) whenever a ``--clip`` policy
is used, so the policy sees the accumulated, unclipped gradient exactly once per optimizer update.
Lion (Chen et al. 2023): u = sign(beta1 m + (1 - beta1) g), p -= lr (u + wd p), m = beta2 m + (1 - beta2) g.

Multi-process: the clipper is built here from the unwrapped model and rebound by ``ClipCallback`` to the
parameters the optimizer updates (FSDP2 replaces them inside ``Trainer.train``); its norms are global across
ranks (``llmtool.train.adagc``). DeepSpeed is refused (:func:`check_distributed`). ``--optimizer muon`` under
FSDP2 is not supported by torch's Muon on DTensor shards (2-D orthogonalisation needs the whole matrix) and
is refused there.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from llmtool.core.console import UsageError
from llmtool.core.trainer import ClipCallback, TrainArgs, pack_texts, sft
from llmtool.train.faults import Faults
from llmtool.train.spikes import spike_score

OPTIMIZERS = ("adamw", "lion", "sgd", "muon")


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p)
                m = st["exp_avg"]
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """torch's Muon on 2-D hidden weight matrices, AdamW on everything else (embeddings, norms), as one
    optimizer object so clipping hooks and the Trainer see a single ``step()``."""

    def __init__(self, named_params, lr: float, weight_decay: float, betas, eps: float):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        mats = [p for n, p in named if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
        ids = {id(p) for p in mats}
        rest = [p for _, p in named if id(p) not in ids]
        super().__init__([{"params": mats, "kind": "muon"}, {"params": rest, "kind": "adamw"}], dict(lr=lr))
        self.muon = torch.optim.Muon(mats, lr=lr, weight_decay=weight_decay) if mats else None
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay) if rest else None

    def state_dict(self) -> dict:
        """The wrapper's groups plus both inner optimizers' states (momenta, moments, step counts): the
        wrapper itself holds no per-parameter state, so without these a resumed run would restart Muon's
        momentum and AdamW's moments from zero."""
        sd = super().state_dict()
        sd["inner"] = {k: (o.state_dict() if o is not None else None)
                       for k, o in (("muon", self.muon), ("adamw", self.adamw))}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        sd = dict(state_dict)
        inner = sd.pop("inner", None)
        if inner is None:
            raise ValueError("MuonAdamW.load_state_dict: no inner optimizer states (saved by another optimizer?)")
        super().load_state_dict(sd)
        for k, o in (("muon", self.muon), ("adamw", self.adamw)):
            if o is not None:
                o.load_state_dict(inner[k])

    @torch.no_grad()
    def step(self, closure=None):
        for group, opt in zip(self.param_groups, (self.muon, self.adamw)):
            if opt is not None:
                opt.param_groups[0]["lr"] = group["lr"]
                opt.step()
        return None


def build_optimizer(name: str, model: torch.nn.Module, args: TrainArgs, beta1: float = 0.9) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=args.lr, betas=(beta1, args.adam_beta2), eps=args.adam_epsilon,
                                 weight_decay=args.weight_decay)
    if name == "lion":
        return Lion(params, lr=args.lr, betas=(beta1, 0.99), weight_decay=args.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=beta1, weight_decay=args.weight_decay)
    if name == "muon":
        return MuonAdamW(model.named_parameters(), args.lr, args.weight_decay, (beta1, args.adam_beta2),
                         args.adam_epsilon)
    raise UsageError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


def _fault_trainer_cls(faults: Faults, vocab_size: int, seed: int):
    from transformers import Trainer

    class FaultTrainer(Trainer):
        """Replaces the batches of the updates listed in ``faults.garbage`` with random tokens."""

        def training_step(self, model, inputs, *a, **kw):
            if faults.is_garbage(self.state.global_step + 1):
                g = torch.Generator().manual_seed(seed * 100003 + self.state.global_step)
                ids = torch.randint(0, vocab_size, inputs["input_ids"].shape, generator=g).to(inputs["input_ids"].device)
                inputs = dict(inputs, input_ids=ids, labels=ids.clone())
            return super().training_step(model, inputs, *a, **kw)

    return FaultTrainer


def _fault_hooks(faults: Faults, model: torch.nn.Module):
    from llmtool.train.adagc import canonical_name

    saved: dict[int, float] = {}

    def pre(step, _model, optimizer):
        # the parameters the optimizer updates now (FSDP2 replaced the ones of ``model`` inside Trainer.train)
        params = {canonical_name(n): p for n, p in (_model if _model is not None else model).named_parameters()}
        for f in faults.grad_spikes:
            p = params[f.tensor]
            if f.active(step) and p.grad is not None:
                p.grad.mul_(f.scale)
        factor = faults.lr_factor(step)
        if factor != 1.0 and optimizer is not None:
            for i, g in enumerate(optimizer.param_groups):
                saved[i] = g["lr"]
                g["lr"] = g["lr"] * factor

    def post(step, _model, optimizer):
        if saved and optimizer is not None:
            for i, lr in saved.items():
                optimizer.param_groups[i]["lr"] = lr
            saved.clear()

    return pre, post


def _progress_callback(name: str):
    """Progress over the optimizer updates: console.progress's bar in a terminal; otherwise (and not --quiet
    or --json) a status line at every tenth of the run with the time left, extrapolated from the updates so far."""
    import time

    from llmtool.core.console import OPTIONS, info, progress, stderr
    from llmtool.core.trainer import _trainer_callback_base

    class Progress(_trainer_callback_base()):
        def on_train_begin(self, args, state, control, **kw):
            self.t0, self.bar = time.time(), progress(range(state.max_steps + 1), name, total=state.max_steps)
            next(self.bar)  # draws the bar (a no-op without a terminal)

        def on_step_end(self, args, state, control, **kw):
            next(self.bar, None)
            n, every = state.global_step, max(1, state.max_steps // 10)
            if not (stderr.is_terminal or OPTIONS.json) and (n % every == 0 or n == state.max_steps):
                left = (time.time() - self.t0) / max(n, 1) * (state.max_steps - n)
                info(f"{name}: update {n}/{state.max_steps}, about {left / 60:.1f} min left")

        def on_train_end(self, args, state, control, **kw):
            self.bar.close()

    return Progress()


def check_distributed() -> None:
    """Refuse DeepSpeed (any ZeRO stage) launched through accelerate for the ``--clip`` policies.

    ZeRO >= 2 shards the gradients, so no rank sees a whole tensor. ZeRO-0/1 would give whole gradients, but
    under accelerate the DeepSpeed engine takes its optimizer step *inside* ``accelerator.backward`` (accelerate's
    ``DeepSpeedEngineWrapper.backward`` calls ``engine.step()``), before the Trainer's ``on_pre_optimizer_step``
    where the policy clips: the policy would run after the update it is meant to shape. FSDP2 (which also
    shards the optimizer state, like ZeRO-1) and DDP run the policy before the step."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "?")
        why = ("shards the gradients, so no rank sees a whole tensor" if stage.isdigit() and int(stage) >= 2 else
               "steps the optimizer inside backward under accelerate, before any clipping callback can run")
        raise UsageError(f"--clip policies do not run under DeepSpeed (ZeRO stage {stage} {why}); launch with an "
                         "FSDP2 or DDP accelerate config (examples/accelerate/fsdp2.yaml, ddp.yaml)")


@torch.no_grad()
def eval_loss(model, blocks: Sequence[dict], batch_size: int = 8) -> float:
    """Mean token NLL (nats) over ``{"input_ids"}`` blocks."""
    model.eval()
    dev = next(model.parameters()).device
    tot, n = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        ids = torch.tensor([b["input_ids"] for b in blocks[i:i + batch_size]], device=dev)
        out = model(input_ids=ids, labels=ids)
        k = ids.numel() - ids.shape[0]
        tot += float(out.loss) * k
        n += k
    return tot / max(n, 1)


def train_with_clipper(model, tokenizer, examples: Sequence[dict], args: TrainArgs, clip_cfg, *,
                       optimizer: str | Callable = "adamw", faults: Faults | None = None, out_dir: Path | None = None,
                       metrics_path: Path | None = None, resume: bool | str = False, window: int = 100,
                       sigma: float = 7.0, beta1: float = 0.9, callbacks: Sequence = ()) -> dict:
    """Train ``model`` in place with the clipping policy ``clip_cfg`` (a config from ``CLIPPERS``).

    ``optimizer``: a name of :data:`OPTIMIZERS`, or a callable ``(model, args) -> torch.optim.Optimizer``
    (e.g. an optimizer from another library; recorded under its ``__name__``). ``callbacks``: extra
    ``TrainerCallback`` objects (timers, loggers) run after the clipping callback."""
    check_distributed()
    if optimizer == "muon" and os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        raise UsageError("--optimizer muon is not supported under FSDP2 (its orthogonalisation needs whole "
                         "matrices and its inner optimizers are not re-pointed at the sharded parameters); "
                         "use adamw/lion/sgd or a DDP launch")
    faults = faults or Faults()
    args.max_grad_norm = 0.0           # the policy clips, never the Trainer
    args.logging_steps = 1
    clipper = clip_cfg.build(model.named_parameters())
    pre, post = _fault_hooks(faults, model)
    cb = ClipCallback(clipper, metrics_path=metrics_path, pre_step=pre, post_step=post,
                      resume_from=resume if isinstance(resume, (str, Path)) and resume else None)
    if callable(optimizer):
        opt = optimizer(model, args)
        optimizer = getattr(optimizer, "__name__", type(opt).__name__)
    else:
        opt = build_optimizer(optimizer, model, args, beta1=beta1)
    trainer_cls = _fault_trainer_cls(faults, model.config.vocab_size, args.seed) if faults.garbage else None
    res = sft(model, tokenizer, examples, args, out_dir=out_dir, callbacks=[cb, *callbacks, _progress_callback("train")],
              trainer_cls=trainer_cls,
              resume=resume, optimizers=(opt, None))
    recs = cb.records
    losses = [r["loss"] for r in recs if r.get("loss") is not None]
    norms = [r["grad_norm"] for r in recs if r.get("grad_norm") is not None]
    fracs = [r["clip_fraction"] for r in recs if r.get("clip_stage") in ("adaptive", "local", "global", "zclip", "none")]
    steady = fracs[len(fracs) // 2:] if fracs else []
    res.pop("log_history", None)
    res.update({
        "clip": clip_cfg.as_dict(), "optimizer": optimizer, "faults": faults.as_dict(),
        "loss_spike_score": spike_score(losses, window, sigma), "grad_norm_spike_score": spike_score(norms, window, sigma),
        "spike_window": window, "spike_sigma": sigma,
        "clip_fraction_mean": (sum(fracs) / len(fracs)) if fracs else 0.0,
        "clip_fraction_steady": (sum(steady) / len(steady)) if steady else 0.0,
        "clipper_state_bytes": clipper.state_bytes(), "clipper_step": clipper.step,
        "final_train_loss": losses[-1] if losses else math.nan,
    })
    res["records"] = recs
    return res


def corpus_texts(data: str) -> list[str]:
    """Paragraphs of a packaged text name or a text file."""
    from llmtool.core import defaults

    path = Path(data)
    if path.is_file():
        text = path.read_text(errors="replace")
    else:
        try:
            text = defaults.text(data)
        except Exception as e:  # unknown packaged name
            raise UsageError(f"--data {data!r}: not a file and not a packaged text ({e})") from None
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not paras:
        raise UsageError(f"--data {data!r}: empty text")
    return paras


def pretrain_blocks(tokenizer, data: str, block: int, val_blocks: int, max_blocks: int | None = None):
    blocks = pack_texts(tokenizer, corpus_texts(data), block, None if max_blocks is None else max_blocks + val_blocks)
    if len(blocks) <= val_blocks:
        raise UsageError(f"--data gives {len(blocks)} blocks of {block} tokens; need more than --val-blocks {val_blocks}")
    return blocks[:len(blocks) - val_blocks], blocks[len(blocks) - val_blocks:]
