"""FusionRoute training on transformers' ``Trainer`` (+ accelerate): stage 1 SFT and stage 2 CDPO
(arXiv:2601.05106, §3.3–3.4). No training loop of our own: each stage is a ``Trainer`` subclass whose
``compute_loss`` adds the routing / preference terms; stage 1 runs through ``llmtool.core.trainer.sft``.

Stage 1 (``sft``): ``L = L_lm + λ L_route`` (λ = 1.0 [R]); experts frozen (no grad, eval mode), only
their gold log-prob and greedy id per position are kept; routing head learning rate = lr × ``head_lr_mult``
(10 [R]); the head starts at zero (uniform routing).

Stage 2 (``cdpo``), as corrected by the authors' write-up: trained *mixed* with the SFT/routing loss in
one run, ``L = L_lm(y+) + λ L_route(y+) + γ L_CDPO`` (γ = ``cdpo_weight`` = 1 [R]); the fused policy's
log-likelihood uses the selected expert's log-probs as a no-gradient bias. The reference is the
stage-1 fused model; its sequence log-likelihoods are computed once before training. ``freeze_head``
freezes the routing head (the paper's ablation only).

Multi-process (``torchrun``/``accelerate launch``): each rank's loss terms are means over its own tokens,
and DDP averages the ranks' gradients, which would weight a rank's tokens by 1 / (its own count). Each term
is therefore rescaled by ``world x n_rank / n_all`` (counts all-reduced, no gradient), so N processes
optimise the mean over all ranks' tokens, exactly what one process computes on the N-times larger batch
(tested with 2 processes); the routing statistics are summed over ranks before they are reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import Trainer

from llmtool.core.data import prompt_ids
from llmtool.route import losses as L
from llmtool.route.vocab import VocabView


@dataclass
class RouteLossArgs:
    lambda_route: float = 1.0
    mask: str = "informative"          # informative | informative-strict | all
    head_lr_mult: float = 10.0
    beta: float = 0.1                   # CDPO
    cdpo_weight: float = 1.0            # CDPO term weight in the mixed stage-2 loss
    sft_weight: float = 1.0             # SFT/routing term weight in stage 2 (0 = pure CDPO)
    freeze_head: bool = False           # stage-2 ablation


def _rank_share(count: torch.Tensor):
    """``world * n_rank / n_all`` for a term that is a mean over this rank's ``count`` items (1 in a single
    process): DDP's gradient average of the rescaled terms is the mean over all ranks' items."""
    from llmtool.core import dist

    if not dist.distributed():
        return 1.0
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return 1.0
    c = count.detach().float().reshape(1)
    tot = c.clone()
    tdist.all_reduce(tot)
    if float(tot) == 0.0:
        return 1.0
    return (c / tot * tdist.get_world_size()).squeeze(0)


def _reduced_stats(st: dict) -> dict:
    """The routing statistics summed over ranks (the main process reports them)."""
    from llmtool.core import dist

    if not dist.distributed():
        return st
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return st
    t = torch.tensor([st["positions"], st["informative"], *st["share"]], dtype=torch.float64)
    if tdist.get_backend() == "nccl":
        t = t.cuda()
    tdist.all_reduce(t)
    v = [int(x) for x in t.cpu().tolist()]
    return {**st, "positions": v[0], "informative": v[1], "share": v[2:]}


class _RouteTrainerBase(Trainer):
    def __init__(self, *a, route_experts: Sequence = (), vocab: VocabView | None = None,
                 route_args: RouteLossArgs | None = None, **kw):
        super().__init__(*a, **kw)
        self.route_experts = list(route_experts)
        self.vocab = vocab
        self.route_args = route_args or RouteLossArgs()
        self.route_stats = {"positions": 0, "informative": 0, "share": [0] * len(self.route_experts)}
        for m in self.route_experts:
            m.to(self.args.device)

    def create_optimizer(self, model=None):
        opt = super().create_optimizer(model)
        mult = self.route_args.head_lr_mult
        head = [p for n, p in (model or self.model).named_parameters()
                if n.split(".")[0] == "head" and p.requires_grad]
        if head and mult != 1.0:
            ids = {id(p) for p in head}
            for g in opt.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in ids]
            opt.add_param_group({"params": head, "lr": self.args.learning_rate * mult, "weight_decay": 0.0})
        return opt

    def _sft_terms(self, logits, w, input_ids, attention_mask, targets, valid, lps=None):
        """(L_lm, L_route, informative mask) for a teacher-forced batch."""
        if lps is None:
            g, a = L.expert_stats(self.route_experts, self.vocab, input_ids, attention_mask, targets)
        else:
            g = torch.stack([lp.gather(-1, targets[..., None]).squeeze(-1) for lp in lps])
            a = torch.stack([lp.argmax(-1) for lp in lps])
        m = L.informative_mask(a, valid, self.route_args.mask, targets)
        l_lm = L.lm_loss(logits[:, :-1], self.vocab, targets, valid) * _rank_share(valid.sum())
        l_route = L.routing_loss(w[:, :-1], g, m) * _rank_share(m.sum())
        self.route_stats["positions"] += int(valid.sum())
        self.route_stats["informative"] += int(m.sum())
        k = w[:, :-1].argmax(-1)[valid]
        for i in range(len(self.route_experts)):
            self.route_stats["share"][i] += int((k == i).sum())
        return l_lm, l_route, m


class RouteSFTTrainer(_RouteTrainerBase):
    """Stage 1: ``L_lm + λ L_route`` on (prompt, response) batches from ``llmtool.core.trainer``."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
        logits, w, out = model(ids, attention_mask=mask, use_cache=False)
        targets, valid = L.shift(ids, labels)
        l_lm, l_route, _ = self._sft_terms(logits, w, ids, mask, targets, valid)
        loss = l_lm + self.route_args.lambda_route * l_route
        return (loss, out) if return_outputs else loss


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _pad(seqs: list[list[int]], fill: int, width: int) -> torch.Tensor:
    out = torch.full((len(seqs), width), fill, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def pair_collate(pad_id: int):
    def collate(batch):
        seqs = [b["c_ids"] for b in batch] + [b["r_ids"] for b in batch]
        labs = [b["c_labels"] for b in batch] + [b["r_labels"] for b in batch]
        width = max(len(s) for s in seqs)
        ids, labels = _pad(seqs, pad_id, width), _pad(labs, -100, width)
        mask = _pad([[1] * len(s) for s in seqs], 0, width)
        ref = torch.tensor([b.get("ref_c", 0.0) for b in batch] + [b.get("ref_r", 0.0) for b in batch],
                           dtype=torch.float32)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask, "ref": ref}

    return collate


def _all_expert_lps(experts, vocab, ids, mask):
    return [L.expert_log_probs(m, vocab, ids, mask) for m in experts]


def _select(lps, k):
    e = torch.zeros_like(lps[0])
    for i, lp in enumerate(lps):
        e = torch.where((k == i)[..., None], lp, e)
    return e


@torch.no_grad()
def fused_sequence_logprobs(router, experts, vocab, batch) -> torch.Tensor:
    """log π_F(y|x) of every sequence of a collated pair batch (used for the frozen reference)."""
    dev = next(router.parameters()).device
    ids, mask, labels = (batch[k].to(dev) for k in ("input_ids", "attention_mask", "labels"))
    was = router.training
    router.eval()
    logits, w, _ = router(ids, attention_mask=mask, use_cache=False)
    router.train(was)
    targets, valid = L.shift(ids, labels)
    k = w[:, :-1].argmax(-1)
    e = _select(_all_expert_lps(experts, vocab, ids, mask), k)
    return L.fused_logprob(logits[:, :-1], e, vocab, targets, valid).float().cpu()


class CDPOTrainer(_RouteTrainerBase):
    """Stage 2: mixed SFT/routing + CDPO on preference pairs (chosen rows first, then rejected)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids, mask, labels, ref = (inputs[k] for k in ("input_ids", "attention_mask", "labels", "ref"))
        B = ids.shape[0] // 2
        logits, w, out = model(ids, attention_mask=mask, use_cache=False)
        targets, valid = L.shift(ids, labels)
        lps = _all_expert_lps(self.route_experts, self.vocab, ids, mask)
        k = w[:, :-1].detach().argmax(-1)
        fused = L.fused_logprob(logits[:, :-1], _select(lps, k), self.vocab, targets, valid)
        l_cdpo = L.cdpo_loss(fused[:B], fused[B:], ref[:B].to(fused), ref[B:].to(fused), self.route_args.beta)
        ra = self.route_args
        loss = ra.cdpo_weight * l_cdpo
        if ra.sft_weight > 0:
            l_lm, l_route, _ = self._sft_terms(logits[:B], w[:B], ids[:B], mask[:B], targets[:B], valid[:B],
                                               lps=[lp[:B] for lp in lps])
            loss = loss + ra.sft_weight * (l_lm + ra.lambda_route * l_route)
        self.route_stats.setdefault("cdpo_losses", []).append(float(l_cdpo.detach()))
        return (loss, out) if return_outputs else loss


def encode_pairs(tokenizer, pairs: Sequence[dict], max_length: int) -> list[dict]:
    """``{"prompt", "chosen", "rejected"}`` (prompt already rendered) -> token ids and labels."""
    eos = tokenizer.eos_token_id
    rows = []
    for p in pairs:
        pi = prompt_ids(tokenizer, p["prompt"])
        row = {}
        for side in ("chosen", "rejected"):
            ci = tokenizer(p[side], add_special_tokens=False)["input_ids"] + [eos]
            ids = (pi + ci)[:max_length]
            lab = ([-100] * len(pi) + ci)[:max_length]
            row[side[0] + "_ids"], row[side[0] + "_labels"] = ids, lab
        if any(x != -100 for x in row["c_labels"][1:]) and any(x != -100 for x in row["r_labels"][1:]):
            rows.append(row)
    return rows


def train_cdpo(router, experts, tokenizer, vocab, pairs: Sequence[dict], targs, rargs: RouteLossArgs,
               callbacks=()) -> dict:
    """Stage 2 in place on ``router``; returns the training summary (initial CDPO loss included)."""
    import tempfile
    import time

    from transformers import PrinterCallback

    from llmtool.core.console import UsageError
    from llmtool.core.trainer import RankSeedCallback, training_arguments

    targs.validate()
    rows = encode_pairs(tokenizer, pairs, targs.max_length)
    if not rows:
        raise UsageError("no preference pair has response tokens within --max-length")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collate = pair_collate(pad)
    refs = []
    for s in range(0, len(rows), targs.batch_size):
        chunk = rows[s:s + targs.batch_size]
        lp = fused_sequence_logprobs(router, experts, vocab, collate(chunk))
        refs.extend(zip(lp[:len(chunk)].tolist(), lp[len(chunk):].tolist()))
    for r, (c, j) in zip(rows, refs):
        r["ref_c"], r["ref_r"] = c, j
    if rargs.freeze_head:
        router.head.requires_grad_(False)
    with tempfile.TemporaryDirectory(prefix="llmtool-cdpo-") as tmp:
        trainer = CDPOTrainer(model=router, args=training_arguments(targs, tmp), train_dataset=_Pairs(rows),
                              data_collator=collate, callbacks=[RankSeedCallback(), *callbacks], route_experts=experts,
                              vocab=vocab, route_args=rargs)
        trainer.remove_callback(PrinterCallback)
        t0 = time.time()
        res = trainer.train()
    router.head.requires_grad_(True)
    router.eval()
    st = _reduced_stats(trainer.route_stats)
    cl = st.get("cdpo_losses") or []
    from llmtool.core import dist

    ends = dist.reduce_mean({"first": cl[0], "last": cl[-1]}) if cl else {"first": None, "last": None}
    return {"train_loss": float(res.training_loss), "steps": int(trainer.state.global_step),
            "seconds": round(time.time() - t0, 3), "pairs": len(rows),
            "cdpo_loss_first": ends["first"], "cdpo_loss_last": ends["last"],
            "informative_fraction": st["informative"] / max(1, st["positions"])}


def train_sft(router, experts, tokenizer, vocab, examples: Sequence[dict], targs, rargs: RouteLossArgs,
              callbacks=()) -> dict:
    """Stage 1 in place on ``router`` through ``llmtool.core.trainer.sft``."""
    from llmtool.core.trainer import sft

    holder = {}

    class _Keep(RouteSFTTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            holder["t"] = self

    res = sft(router, tokenizer, examples, targs, callbacks=callbacks, trainer_cls=_Keep,
              route_experts=experts, vocab=vocab, route_args=rargs)
    st = _reduced_stats(holder["t"].route_stats)
    tot = max(1, sum(st["share"]))
    return {"train_loss": res["train_loss"], "steps": res["steps"], "seconds": res["seconds"],
            "examples": res["examples"], "informative_fraction": st["informative"] / max(1, st["positions"]),
            "train_expert_share": [s / tot for s in st["share"]]}
