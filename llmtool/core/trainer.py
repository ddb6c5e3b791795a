"""The one trainer every area fine-tunes with: transformers' ``Trainer`` (which runs on ``accelerate``,
so ``accelerate launch`` — and DeepSpeed/FSDP through it — scales the same call to many GPUs).

:func:`sft` trains a causal LM in place on prompt/completion pairs (loss on completion tokens only)
or on plain texts (loss on every token), optionally through a LoRA adapter (``peft``) that is merged
back at the end so the caller gets an ordinary model. Areas pass their own ``TrainerCallback`` objects
(e.g. gradient clipping policies, metric loggers) and, for custom losses, a ``Trainer`` subclass via
``trainer_cls``.

Why transformers' Trainer rather than a loop of our own: it already handles accelerate's device
placement, mixed precision, gradient accumulation, checkpoint/resume and multi-GPU launch, which is
exactly what must not be re-implemented per area.

Pretraining: :func:`pack_texts` turns a corpus into fixed-length ``{"input_ids"}`` blocks that
:func:`sft` accepts as examples. Gradient transforms (AdaGC and the other clipping policies of
``llmtool train``) plug in through :class:`ClipCallback` with the Trainer's own clipping off
(``max_grad_norm=0``); it writes one metrics JSONL record per optimizer update and saves/restores the
transform's state next to the optimizer's in every ``checkpoint-*`` directory.

Multi-process (``torchrun`` / ``accelerate launch``; issue 41): the Trainer already shards the data, reduces
the logged loss and writes model/optimizer checkpoints from the main process; what is added here is the
rest of the contract. ``sft`` writes ``metrics_path`` on the main process only; :class:`RankSeedCallback`
gives ranks > 0 their own seed for anything drawn during training (the data order stays shared);
:class:`ClipCallback` rebinds its policy to the wrapped (FSDP2) parameters, unscales fp16 gradients, clips
identically on every rank and writes metrics and clipper files from the main process only;
:func:`full_state_dict` gathers an FSDP2 model for saving on rank 0. Output directories are made
rank-correct once for every command by :mod:`llmtool.core.dist` (through ``core.job``).
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from llmtool.core.console import UsageError, info
from llmtool.core.data import iter_jsonl


@dataclass
class TrainArgs:
    lr: float = 5e-5
    epochs: float = 1.0
    max_steps: int = -1               # > 0 overrides epochs
    batch_size: int = 8
    grad_accum: int = 1
    max_length: int = 512
    warmup_ratio: float = 0.0        # fraction of steps (transformers 5: a float < 1 in warmup_steps)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0        # 0 turns the Trainer's global clipping off (e.g. for AdaGC)
    lr_scheduler: str = "linear"
    lora_r: int = 0                   # 0 = full fine-tune
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    seed: int = 0
    logging_steps: int = 10
    save_steps: int = 0               # 0 = no intermediate checkpoints
    gradient_checkpointing: bool = False
    bf16: bool = False
    optim: str = "adamw_torch"
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8

    def validate(self) -> None:
        import math

        for name in ("lr", "epochs", "warmup_ratio", "weight_decay", "max_grad_norm", "adam_beta2", "adam_epsilon"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise UsageError(f"--{name.replace('_', '-')} {v}: must be a finite number >= 0")
        if self.lr <= 0:
            raise UsageError(f"--lr {self.lr}: must be > 0")
        for name in ("batch_size", "grad_accum", "max_length"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")


class _Examples(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def encode_examples(tokenizer, examples: Sequence[dict], max_length: int, stats: dict | None = None) -> list[dict]:
    """Token ids and labels (-100 on prompt tokens) for ``{"prompt", "completion"}`` or ``{"text"}`` rows.
    The end-of-sequence token is appended to completions/texts so the model learns to stop; a tokenizer that
    starts every text with BOS (``core.data.scoring_bos``: Gemma, Llama) gets it in front of each row, unless
    the row's text already starts with it (a chat template's ``<bos>``), so SFT sees what inference feeds.

    Rows longer than ``max_length`` are cut at the end, which cuts their targets; a row left with no target
    is dropped. ``stats`` (when given) receives ``{"examples", "cut", "dropped", "longest"}`` so the caller
    can say so."""
    from llmtool.core.data import prompt_ids

    eos = tokenizer.eos_token_id
    rows = []
    cut = dropped = longest = 0
    for i, ex in enumerate(examples):
        if "input_ids" in ex:  # pre-tokenised (e.g. packed pretraining blocks): every token is a target
            ids = list(ex["input_ids"])
            labels = list(ex.get("labels", ids))
        elif "text" in ex:
            ids = prompt_ids(tokenizer, ex["text"]) + ([eos] if eos is not None else [])
            labels = list(ids)
        elif "prompt" in ex and "completion" in ex:
            p = prompt_ids(tokenizer, ex["prompt"])
            c = tokenizer(ex["completion"], add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
            ids, labels = p + c, [-100] * len(p) + c
        else:
            raise UsageError(f"training example {i}: needs 'text' or 'prompt' and 'completion'")
        longest = max(longest, len(ids))
        if len(ids) > max_length:
            ids, labels = ids[:max_length], labels[:max_length]
            cut += 1
        if any(l != -100 for l in labels[1:]):
            rows.append({"input_ids": ids, "labels": labels})
        else:
            dropped += 1
    if stats is not None:
        stats.update(examples=len(examples), cut=cut, dropped=dropped, longest=longest)
    if not rows:
        raise UsageError("no training example has a target token within --max-length")
    return rows


def _collate(pad_id: int):
    def collate(batch: list[dict]) -> dict:
        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            labels[i, :n] = torch.tensor(b["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collate


def training_arguments(args: TrainArgs, output_dir: str, **overrides: Any):
    """transformers ``TrainingArguments`` for :class:`TrainArgs` (no hub, no external loggers)."""
    from transformers import TrainingArguments

    kw = dict(
        output_dir=output_dir, learning_rate=args.lr, num_train_epochs=args.epochs, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        warmup_steps=float(args.warmup_ratio), weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        lr_scheduler_type=args.lr_scheduler, seed=args.seed, data_seed=args.seed,
        logging_steps=args.logging_steps, save_strategy="steps" if args.save_steps > 0 else "no",
        save_steps=max(args.save_steps, 1), report_to=[], disable_tqdm=True, remove_unused_columns=False,
        bf16=args.bf16, optim=args.optim,
        adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon, dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
    )
    if args.gradient_checkpointing:
        kw["gradient_checkpointing"] = True
    kw.update(overrides)
    return TrainingArguments(**kw)


def sft(model, tokenizer, examples: Sequence[dict], args: TrainArgs | None = None, out_dir: Path | None = None,
        callbacks: Sequence = (), metrics_path: Path | None = None, trainer_cls=None,
        trainable: Sequence[str] | None = None, resume: bool | str = False, **trainer_kwargs: Any) -> dict:
    """Fine-tune ``model`` in place; returns ``{"train_loss", "steps", "seconds", "log_history"}``.

    ``trainable``: names of parameters to train (all others frozen), e.g. a keystone subset.
    ``out_dir``: where the Trainer keeps checkpoints (a temporary directory when None).
    ``metrics_path``: the Trainer's log history is written there as JSONL."""
    from transformers import PrinterCallback, Trainer

    args = args or TrainArgs()
    args.validate()
    trunc: dict = {}
    rows = encode_examples(tokenizer, examples, args.max_length, stats=trunc)
    if trunc["cut"]:
        info(f"warning: {trunc['cut']} of {trunc['examples']} training examples are longer than --max-length "
             f"{args.max_length} (longest {trunc['longest']} tokens) and were cut at the end"
             + (f"; {trunc['dropped']} lost every target token and were dropped" if trunc["dropped"] else ""))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    peft_model = None
    if args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                          target_modules="all-linear", task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, lcfg)
    elif trainable is not None:
        wanted = set(trainable)
        names = {n for n, _ in model.named_parameters()}
        missing = sorted(wanted - names)
        if missing:
            raise UsageError(f"unknown parameter names to train: {', '.join(missing[:5])}")
        for n, p in model.named_parameters():
            p.requires_grad_(n in wanted)
    train_model = peft_model if peft_model is not None else model
    was_training = train_model.training
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="llmtool-train-")
        out_dir = Path(tmp.name)
    cls = trainer_cls or Trainer
    trainer = cls(model=train_model, args=training_arguments(args, str(out_dir)), train_dataset=_Examples(rows),
                  data_collator=_collate(pad), callbacks=[RankSeedCallback(), *callbacks], **trainer_kwargs)
    trainer.remove_callback(PrinterCallback)  # logs go to metrics_path / the returned history, never stdout
    start = time.time()
    try:
        result = trainer.train(resume_from_checkpoint=resume or None)
    finally:
        if tmp is not None:
            tmp.cleanup()
    seconds = time.time() - start
    if peft_model is not None:
        merged = peft_model.merge_and_unload()
        if merged is not model:  # merge_and_unload returns the base model with merged weights
            model.load_state_dict(merged.state_dict())
    if trainable is not None:
        for p in model.parameters():
            p.requires_grad_(True)
    train_model.train(was_training)
    model.eval()
    history = list(trainer.state.log_history)
    from llmtool.core import dist

    if metrics_path is not None and dist.is_main():
        with open(metrics_path, "w") as fh:
            for rec in history:
                fh.write(json.dumps(rec) + "\n")
    return {"train_loss": float(result.training_loss), "steps": int(trainer.state.global_step),
            "seconds": round(seconds, 3), "examples": len(rows), "truncation": trunc, "log_history": history,
            "args": asdict(args)}


def full_state_dict(model) -> dict | None:
    """What ``save_pretrained(state_dict=...)`` needs on the main process after multi-process training.

    Plain parameters (one process, DDP, ZeRO-1): ``None`` (the model's own state dict, no copy). DTensor
    parameters (FSDP2): the full state dict gathered shard by shard into CPU memory of rank 0 only
    (``torch.distributed.checkpoint``'s ``full_state_dict`` + ``cpu_offload``; other ranks get an empty
    dict), a collective that every rank must call, so that no rank ever holds a full copy on the GPU and
    ranks > 0 none at all."""
    if not any(hasattr(p, "placements") and hasattr(p, "full_tensor") for p in model.parameters()):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def pack_texts(tokenizer, texts: Sequence[str], block: int, max_blocks: int | None = None) -> list[dict]:
    """Concatenate ``texts`` (each followed by EOS) and cut into ``block``-token ``{"input_ids"}`` rows
    (the ragged tail is dropped)."""
    if block < 2:
        raise UsageError(f"--max-length {block}: must be >= 2 for pretraining blocks")
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for t in texts:
        stream.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(eos)
        if max_blocks is not None and len(stream) >= block * max_blocks:
            break
    n = len(stream) // block
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n == 0:
        raise UsageError(f"the text has {len(stream)} tokens, fewer than one block of {block}")
    return [{"input_ids": stream[i * block:(i + 1) * block]} for i in range(n)]


CLIP_STATE_NAME = "clipper_state.json"
CLIP_RECORDS_NAME = "clip_records.jsonl"   # per-update records up to the checkpoint


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class RankSeedCallback(_trainer_callback_base()):
    """Per-rank seeds under a multi-process launch: the Trainer seeds every rank with the same ``seed``
    (the data sampler relies on it to shard one permutation), so draws that must differ between ranks
    (dropout masks, sampling) would repeat on every rank. At the start of training (after the data loader
    and its own seeded generator exist) ranks > 0 reseed torch, python and numpy with
    :func:`llmtool.core.dist.rank_seed`; rank 0 keeps the plain seed, so a 1-process run is unchanged."""

    def on_train_begin(self, args, state, control, **kw):
        from llmtool.core import dist

        if dist.distributed() and not dist.is_main() and state.global_step == 0:
            import random

            import numpy as np

            s = dist.rank_seed(args.seed)
            random.seed(s)
            np.random.seed(s % 2**32)
            torch.manual_seed(s)


class ClipCallback(_trainer_callback_base()):
    """Runs ``clipper.clip_()`` once per optimizer update (after gradient accumulation, before
    ``optimizer.step()``), writes per-update metrics and keeps the clipper's state in checkpoints.

    ``clipper``: any object with ``clip_() -> stats`` (``stats.as_dict()``), ``state_dict()`` and
    ``load_state_dict()``. ``pre_step(step, model, optimizer)`` / ``post_step(step, model, optimizer)``:
    optional hooks around the clip and the optimizer step (fault injection). ``metrics_path``: JSONL, one
    record per logged update (use ``logging_steps=1`` for every update) with the Trainer's loss and lr and
    the clip statistics of that update."""

    def __init__(self, clipper, metrics_path: Path | None = None, pre_step=None, post_step=None,
                 resume_from: Path | str | None = None):
        from llmtool.core import dist

        self.clipper = clipper
        # every rank clips (identical decisions); the main process alone writes metrics and checkpoint files
        self.metrics_path = Path(metrics_path) if metrics_path is not None and dist.is_main() else None
        self.resume_from = Path(resume_from) if resume_from else None
        self.pre_step, self.post_step = pre_step, post_step
        self.last: dict = {}
        self.records: list[dict] = []
        self._fh = None

    def _bind(self, model) -> None:
        """(Re)bind the clipper to the parameters the optimizer updates now: FSDP2's ``fully_shard`` (run by
        accelerate inside ``Trainer.train``) replaces them with DTensors after the clipper was built."""
        if model is None or not hasattr(self.clipper, "bind"):
            return
        if not self.clipper.bound_to(model):
            self.clipper.bind(model.named_parameters())

    def _unscale(self, optimizer) -> None:
        """fp16 with a GradScaler (accelerate's ``AcceleratedOptimizer.scaler``): the clipper must see true
        gradients. Unscale now unless the Trainer already did this step (its grad-norm logging calls
        ``accelerator.clip_grad_norm_``, which unscales); the scaler then skips the step on inf/NaN
        itself, and the clipper skips it too (non-finite norms)."""
        scaler = getattr(optimizer, "scaler", None)
        inner = getattr(optimizer, "optimizer", None)
        if scaler is None or inner is None or not scaler.is_enabled():
            return
        from torch.amp.grad_scaler import OptState

        st = scaler._per_optimizer_states[id(inner)]
        if st["stage"] is OptState.READY:
            scaler.unscale_(inner)

    def on_train_begin(self, args, state, control, model=None, **kw):
        self._bind(model)
        restored = False
        if state.global_step > 0:  # resumed: the Trainer restored its state before this event
            ckpt = self.resume_from or Path(args.output_dir) / f"checkpoint-{state.global_step}"
            path = ckpt / CLIP_STATE_NAME
            if not path.is_file():
                raise UsageError(f"cannot resume: {ckpt.name} has no {CLIP_STATE_NAME} (clipper state)")
            self.clipper.load_state_dict(json.loads(path.read_text()))
            # the records of the updates before the checkpoint, so that spike scores and clip fractions of a
            # resumed run cover the whole run (checkpoints written before this file existed have none)
            rec_path = ckpt / CLIP_RECORDS_NAME
            if rec_path.is_file():
                self.records = [r for _, r in iter_jsonl(rec_path) if r.get("step", 0) <= state.global_step]
                restored = True
        if self.metrics_path is not None:
            self._fh = open(self.metrics_path, "a" if state.global_step > 0 and not restored else "w")
            for rec in self.records:
                self._fh.write(json.dumps(rec) + "\n")

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        step = state.global_step + 1
        self._bind(model)
        self._unscale(optimizer)
        if self.pre_step is not None:
            self.pre_step(step, model, optimizer)
        stats = self.clipper.clip_()
        self.last = stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        if self.post_step is not None:
            self.post_step(state.global_step + 1, model, optimizer)

    def on_log(self, args, state, control, logs=None, **kw):
        logs = dict(logs or {})
        if "loss" not in logs:  # end-of-training summary, not a step record
            return
        rec = {"step": state.global_step, "loss": logs.get("loss"), "lr": logs.get("learning_rate")}
        rec.update({k: v for k, v in self.last.items() if k != "step"})
        self.records.append(rec)
        if self._fh is not None:
            self._fh.write(json.dumps(rec) + "\n")
            self._fh.flush()

    def on_save(self, args, state, control, **kw):
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if ckpt.is_dir() and state.is_world_process_zero:
            (ckpt / CLIP_STATE_NAME).write_text(json.dumps(self.clipper.state_dict()))
            (ckpt / CLIP_RECORDS_NAME).write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def on_train_end(self, args, state, control, **kw):
        if self._fh is not None:
            self._fh.close()
            self._fh = None
