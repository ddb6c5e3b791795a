"""Keystone-only supervised fine-tuning with an exact row mask (delta parametrisation), plus the
full-SFT and random-neuron-SFT baselines (spec keystone-neurons §3.4, §4), on the shared trainer
(:func:`llmtool.core.trainer.sft`: transformers' Trainer + accelerate).

Trainable parameters of neuron (f, l, c): row c of W_f (and bias c); for ``ffn``: row c of
gate_proj and up_proj and column c of down_proj.  [spec decision]  Base weights stay frozen;
each touched module gets one fp32 delta parameter holding only its selected rows (registered on the
module, so the trainer sees it as a named parameter and trains nothing else), applied in the forward
pass as  y = W x + scatter_rows(Δ) x  (a forward hook adding Δx into the selected output channels;
for down_proj columns, Δ x[..., cols]).  Rows outside the selection therefore never change, whatever
the optimiser (AdamW weight decay acts on Δ only), and optimiser state is tiny.

Objective: causal-LM cross-entropy on response tokens only (EOS appended).  Defaults [spec decision]:
AdamW (0.9, 0.999), weight decay 0, cosine schedule with 3 % linear warm-up, grad clip 1.0.
Merging adds Δ to the selected rows in fp32, casts back to the checkpoint dtype and removes the
delta parameters and hooks.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from llmtool.edit.keystone import Neuron, group_channels, mean_ppl, module_of, site  # noqa: F401


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
    max_length: int = 256
    trainable: str = "keystone"   # keystone | random | full (provenance)
    k: int = 0                    # neurons trained (provenance)

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return {"method": self.trainable, **asdict(self)}

    def train_args(self):
        """The shared trainer's arguments for this run."""
        from llmtool.core.trainer import TrainArgs

        return TrainArgs(lr=self.lr, epochs=float(self.epochs), max_steps=self.max_steps or -1,
                         batch_size=self.batch_size, max_length=self.max_length, warmup_ratio=self.warmup_frac,
                         weight_decay=self.weight_decay, max_grad_norm=self.grad_clip, lr_scheduler="cosine",
                         seed=self.seed, logging_steps=1)


class RowDeltas:
    """fp32 deltas on selected rows (and down_proj columns for ``ffn``), registered as parameters
    ``keystone_rows_delta`` / ``keystone_cols_delta`` (+ ``keystone_bias_delta``) of the touched modules
    and applied by forward hooks."""

    def __init__(self, model, neurons: list[Neuron]):
        wanted: dict[tuple[int, str], tuple[torch.nn.Linear, set]] = {}
        for (f, l), chans in group_channels(neurons).items():
            if f == "ffn":
                parts = [(site(model, "gate", l), "rows"), (site(model, "up", l), "rows"),
                         (site(model, "down", l), "cols")]
            else:
                parts = [(site(model, f, l), "rows")]
            for (m, off, _), kind in parts:   # off: the role's first row in a fused qkv_proj / gate_up_proj
                wanted.setdefault((id(m), kind), (m, set()))[1].update(c + (off if kind == "rows" else 0)
                                                                       for c in chans)
        names = {id(m): n for n, m in model.named_modules()}
        self.entries = []  # (module, kind, index, weight delta, bias delta or None)
        self.names: list[str] = []
        for (_, kind), (m, chans) in wanted.items():
            idx = torch.tensor(sorted(chans), device=m.weight.device)
            shape = (len(idx), m.in_features) if kind == "rows" else (m.out_features, len(idx))
            dw = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=m.weight.device))
            m.register_parameter(f"keystone_{kind}_delta", dw)
            self.names.append(f"{names[id(m)]}.keystone_{kind}_delta")
            db = None
            if kind == "rows" and m.bias is not None:
                db = torch.nn.Parameter(torch.zeros(len(idx), dtype=torch.float32, device=m.weight.device))
                m.register_parameter("keystone_bias_delta", db)
                self.names.append(f"{names[id(m)]}.keystone_bias_delta")
            self.entries.append((m, kind, idx, dw, db))
        self.handles = []

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
        """Remove the hooks and the delta parameters (the model is as before, unless merged)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for m, kind, _, _, db in self.entries:
            m._parameters.pop(f"keystone_{kind}_delta", None)
            if db is not None:
                m._parameters.pop("keystone_bias_delta", None)

    @torch.no_grad()
    def merge(self) -> None:
        """Add the deltas into the weights (fp32 arithmetic) and remove hooks and delta parameters."""
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


def sft_examples(rows: list[dict]) -> list[dict]:
    """``{prompt, response}`` rows as the shared trainer's ``{prompt, completion}`` examples."""
    return [{"prompt": r["prompt"], "completion": r["response"]} for r in rows]


def encode_examples(tok, rows: list[dict], max_len: int = 256) -> list[dict]:
    """Token ids and labels (-100 on the prompt) of ``{prompt, response}`` rows, EOS appended, exactly
    as the trainer sees them (:func:`llmtool.core.trainer.encode_examples`)."""
    from llmtool.core.trainer import encode_examples as encode

    return encode(tok, sft_examples(rows), max_len)


@torch.no_grad()
def eval_loss(model, examples: list[dict], pad_id: int, batch_size: int = 16) -> float:
    """Mean response-token cross-entropy per batch of ``batch_size`` examples, averaged over examples."""
    from llmtool.core.lm import token_nll

    total, n = 0.0, 0
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        width = max(len(e["input_ids"]) for e in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for i, e in enumerate(chunk):
            ids[i, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
            labels[i, :len(e["labels"])] = torch.tensor(e["labels"])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(e["input_ids"]) for e in chunk])[:, None]).long()
        nll = token_nll(model, ids, mask)
        scored = labels[:, 1:] != -100
        total += float(nll[scored.to(nll.device)].mean()) * len(chunk)
        n += len(chunk)
    return total / max(1, n)


def finetune(model, tok, rows: list[dict], cfg: SFTConfig, mode: str, neurons: list[Neuron] | None = None) -> dict:
    """Train ``model`` in place with the shared trainer on ``{prompt, response}`` rows: every parameter
    (``full``) or only the row deltas of ``neurons`` (``keystone``/``random``), merged at the end.
    Returns ``{"records", "trainable_parameters", "delta_state", "train"}``."""
    from llmtool.core.trainer import sft

    deltas, trainable = None, None
    if mode == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    else:
        deltas = RowDeltas(model, neurons or []).install()
        trainable = deltas.names
        count = deltas.trainable_count()
    try:
        res = sft(model, tok, sft_examples(rows), cfg.train_args(), trainable=trainable)
    except BaseException:
        if deltas is not None:
            deltas.remove()
        raise
    names = {id(m): n for n, m in model.named_modules()}
    delta_state = deltas.state(names) if deltas is not None else {}
    if deltas is not None:
        deltas.merge()
    for p in model.parameters():
        p.requires_grad_(False)
    records = [{"step": int(r["step"]), "loss": float(r["loss"]), "lr": float(r.get("learning_rate", 0.0)),
                "grad_norm": float(r.get("grad_norm", 0.0))} for r in res["log_history"] if "loss" in r]
    return {"records": records, "trainable_parameters": count, "delta_state": delta_state, "train": res}


def task_metrics(model, held_examples, retention_ids: list[torch.Tensor], pad_id: int) -> dict:
    """Held-out target-task loss and retention perplexity (on the capability texts)."""
    return {"target_loss": eval_loss(model, held_examples, pad_id), "retention_ppl": mean_ppl(model, retention_ids)}
