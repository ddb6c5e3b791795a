"""Keystone-only supervised fine-tuning with an exact row mask (delta parametrisation), plus the
full-SFT and random-neuron-SFT baselines (spec keystone-neurons §3.4, §4).

Trainable parameters of neuron (f, l, c): row c of W_f (and bias c); for ``ffn``: row c of
gate_proj and up_proj and column c of down_proj.  [spec decision]  Base weights stay frozen;
each touched module gets one fp32 delta holding only its selected rows, applied in the forward
pass as  y = W x + scatter_rows(Δ) x  (a forward hook adding Δx into the selected output
channels; for down_proj columns, Δ x[..., cols]).  Rows outside the selection therefore never
change, whatever the optimiser (AdamW weight decay acts on Δ only), and optimiser state is tiny.

Objective: causal-LM cross-entropy on response tokens only.  Defaults [spec decision]: AdamW
(0.9, 0.999), weight decay 0, cosine schedule with 3 % linear warm-up, grad clip 1.0.
Merging adds Δ to the selected rows in fp32 and casts back to the checkpoint dtype.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from llmtool.edit.keystone import Neuron, group_channels, mean_ppl, module_of


@dataclass
class SFTConfig:
    lr: float = 1e-4
    epochs: int = 3
    weight_decay: float = 0.0
    warmup_frac: float = 0.03
    grad_clip: float = 1.0
    batch_size: int = 8
    max_steps: int = 0   # 0 = epochs × batches
    seed: int = 0


class RowDeltas:
    """fp32 deltas on selected rows (and down_proj columns for ``ffn``), installed as hooks."""

    def __init__(self, model, neurons: list[Neuron]):
        self.entries = []  # (module, kind, index, weight delta, bias delta or None)
        for (f, l), chans in group_channels(neurons).items():
            idx = torch.tensor(sorted(set(chans)))
            if f == "ffn":
                for fam in ("gate", "up"):
                    self._add(module_of(model, fam, l), "rows", idx)
                self._add(module_of(model, "down", l), "cols", idx)
            else:
                self._add(module_of(model, f, l), "rows", idx)
        self.handles = []

    def _add(self, m: torch.nn.Linear, kind: str, idx: torch.Tensor) -> None:
        for e in self.entries:
            if e[0] is m and e[1] == kind:  # merge with an existing selection of the same module
                merged = torch.unique(torch.cat([e[2], idx]))
                self.entries.remove(e)
                idx = merged
                break
        shape = (len(idx), m.in_features) if kind == "rows" else (m.out_features, len(idx))
        dw = torch.zeros(shape, dtype=torch.float32, device=m.weight.device, requires_grad=True)
        db = None
        if kind == "rows" and m.bias is not None:
            db = torch.zeros(len(idx), dtype=torch.float32, device=m.weight.device, requires_grad=True)
        self.entries.append((m, kind, idx.to(m.weight.device), dw, db))

    def parameters(self) -> list[torch.Tensor]:
        return [p for e in self.entries for p in (e[3], e[4]) if p is not None]

    def trainable_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def install(self) -> "RowDeltas":
        for m, kind, idx, dw, db in self.entries:
            if kind == "rows":
                def hook(mod, inputs, out, idx=idx, dw=dw, db=db):
                    add = inputs[0].float() @ dw.T
                    if db is not None:
                        add = add + db
                    return out.index_add(-1, idx, add.to(out.dtype))
            else:
                def hook(mod, inputs, out, idx=idx, dw=dw):
                    return out + (inputs[0][..., idx].float() @ dw.T).to(out.dtype)
            self.handles.append(m.register_forward_hook(hook))
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @torch.no_grad()
    def merge(self) -> None:
        """Add the deltas into the weights (fp32 arithmetic) and remove the hooks."""
        self.remove()
        for m, kind, idx, dw, db in self.entries:
            W = m.weight
            if kind == "rows":
                W[idx] = (W[idx].float() + dw).to(W.dtype)
                if db is not None:
                    m.bias[idx] = (m.bias[idx].float() + db).to(m.bias.dtype)
            else:
                W[:, idx] = (W[:, idx].float() + dw).to(W.dtype)

    def state(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        out = {}
        for m, kind, idx, dw, db in self.entries:
            base = names[id(m)]
            out[f"{base}.weight.{kind}_index"] = idx.cpu()
            out[f"{base}.weight.delta"] = dw.detach().cpu().contiguous()
            if db is not None:
                out[f"{base}.bias.delta"] = db.detach().cpu().contiguous()
        return out


def arithmetic_task(n: int, seed: int) -> list[dict]:
    """Synthetic target task: two-number addition, answer after 'A:'."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"Q: What is {a} plus {b}?\nA:", "response": f" {a + b}"})
    return rows


def encode_examples(tok, rows: list[dict], max_len: int = 256) -> list[tuple[list[int], int]]:
    out = []
    for r in rows:
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        y = tok(r["response"], add_special_tokens=False)["input_ids"]
        if tok.eos_token_id is not None:
            y = y + [tok.eos_token_id]
        out.append(((p + y)[:max_len], len(p)))
    return out


def batch_loss(model, examples: list[tuple[list[int], int]], pad_id: int) -> torch.Tensor:
    device = next(model.parameters()).device
    n = max(len(ids) for ids, _ in examples)
    x = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(examples):
        x[i, :len(ids)] = torch.tensor(ids)
        labels[i, n_prompt:len(ids)] = torch.tensor(ids[n_prompt:])
        mask[i, :len(ids)] = 1
    logits = model(input_ids=x.to(device), attention_mask=mask.to(device)).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1).to(device), ignore_index=-100)


@torch.no_grad()
def eval_loss(model, examples, pad_id: int, batch_size: int = 16) -> float:
    total, n = 0.0, 0
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        total += batch_loss(model, chunk, pad_id).item() * len(chunk)
        n += len(chunk)
    return total / max(1, n)


def train(model, examples, params: list[torch.Tensor], cfg: SFTConfig, pad_id: int, log=None) -> list[dict]:
    """AdamW + cosine/warm-up + clipping over ``params``; returns per-step records."""
    g = random.Random(cfg.seed)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
    total = cfg.max_steps or cfg.epochs * steps_per_epoch
    warm = max(1, int(cfg.warmup_frac * total))
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
    records, step = [], 0
    order: list[int] = []
    model.train(False)
    while step < total:
        if not order:
            order = list(range(len(examples)))
            g.shuffle(order)
        idx, order = order[:cfg.batch_size], order[cfg.batch_size:]
        loss = batch_loss(model, [examples[i] for i in idx], pad_id)
        opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        rec = {"step": step, "loss": float(loss.detach()), "lr": float(sched.get_last_lr()[0]), "grad_norm": float(gn)}
        records.append(rec)
        if log:
            log(rec)
        step += 1
    return records


def trainable_parameters(model, mode: str, neurons: list[Neuron] | None) -> tuple[list[torch.Tensor], RowDeltas | None]:
    """What ``mode`` trains: every (deduplicated, tied weights once) parameter for ``full``, else
    the row deltas of ``neurons``, installed as hooks."""
    for p in model.parameters():
        p.requires_grad_(mode == "full")
    if mode == "full":
        return list({id(p): p for p in model.parameters()}.values()), None
    deltas = RowDeltas(model, neurons).install()
    return deltas.parameters(), deltas


def task_metrics(model, held_examples, retention_ids: list[torch.Tensor], pad_id: int) -> dict:
    """Held-out target-task loss and retention perplexity (on the capability texts)."""
    return {"target_loss": eval_loss(model, held_examples, pad_id), "retention_ppl": mean_ppl(model, retention_ids)}

