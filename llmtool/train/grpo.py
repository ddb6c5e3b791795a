"""GRPO for RLVR with explicit control of the clipping bias (`llmtool train grpo`).

Papers: "Spurious Rewards: Rethinking Training Signals in RLVR" (Shao et al., ICML 2026,
arXiv 2506.10947) and GRPO as used there (DeepSeekMath, arXiv 2402.03300, eq. 3 with the KL term of
eq. 4). What this module implements:

- group-relative advantage ``Â_i = (r_i - mean(r)) / (std_unbiased(r) + 1e-9)`` per prompt group
  (:func:`group_advantages`; groups whose rewards are all equal get exactly 0, never NaN);
- the per-token surrogates (:func:`token_surrogate`): ``clip`` = ``min(ρÂ, clip(ρ, 1-ε, 1+ε_high)Â)``
  (PPO/GRPO), ``ratio`` = ``ρÂ`` (the ratio kept, the clamp removed: the spec's ``--no-clip``), and
  ``pi`` = ``π_θ(y_t)·Â`` (the official code's "no clip" switch: no ratio and no old log-probs);
- the k3 KL estimator to a frozen reference (weight β, 0 allowed, 0 in every paper run) and an
  optional token-entropy bonus (the simplest diversity baseline of the SetPO spec);
- loss aggregation ``seq-mean`` (per-sequence token mean, then mean over sequences: the official
  code), ``token-mean`` and ``seq-sum-norm`` (sum over tokens divided by ``max_new_tokens``);
- off-policy mini-batching: each rollout phase samples ``prompts_per_rollout × G`` rollouts, freezes
  π_old log-probs **with the training model** at rollout time, shuffles the rollouts (groups are
  normalised before shuffling) and consumes them in ``mini_batch``-sized optimizer steps (one pass),
  so only the first step of a phase has ρ ≡ 1 (:func:`updates_per_phase` counts them; a warning is
  logged when the configuration implies ρ ≡ 1 everywhere and clipping cannot bind);
- global gradient-norm clipping at 1.0 (on in every official run), AdamW, constant learning rate;
- :func:`toy_bandit`, the spec's exact clipping-bias mechanism on a 10-armed softmax bandit.

Choice of engine (the issue's decision): a compact loop of our own on ``accelerate`` rather than
TRL's ``GRPOTrainer``. Reasons: SetPO needs per-group advantage shaping from rollout embeddings,
and TRL 1.16 has no public hook for custom advantages; TRL defaults to the "dapo" loss and its
mini-batching knobs differ in name and meaning from the paper's rollout/mini-batch split; the three
loss variants of the clipping ablation (clip, ratio-no-clip, −π_θ·Â) are one function here. The loop
uses ``accelerate.Accelerator`` for device placement, DDP gradient sync (``no_sync`` on all but the
last micro-batch of a mini-batch) and ``accelerate launch``; each process takes its own share of the
prompts, and a group never spans processes, so group normalisation stays local. No distributed engine
of our own. TRL is kept as a cross-check in the tests (same per-token loss on a fixed batch).

Reconstructed choices: the random reward is seeded per (seed, phase, prompt, rollout) (the official
one is unseeded); rollouts that hit ``max_new_tokens`` are trained on like any other (no overlong
filtering, as in the paper); the eos token is part of the trained response when generation stopped
on it; the policy's entropy is the exact token entropy of the full softmax on response tokens.
"""
from __future__ import annotations

import json
import math
import random as _random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

LOSS_TYPES = ("clip", "ratio", "pi")
LOSS_AGGS = ("seq-mean", "token-mean", "seq-sum-norm")


# ------------------------------------------------------------------------------------ advantages
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group ``(r - mean) / (std_unbiased + 1e-9)``; rewards are laid out group by group.

    A group whose rewards are all equal gets exactly 0 (no NaN), however the floats round."""
    if group_size < 2:
        raise ValueError("group size must be >= 2")
    r = rewards.detach().to(torch.float64).reshape(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=True, keepdim=True)
    const = (r == r[:, :1]).all(dim=1, keepdim=True)
    adv = torch.where(const, torch.zeros_like(r), (r - mean) / (std + 1e-9))
    return adv.reshape(-1).to(torch.float32)


# ------------------------------------------------------------------------------------ surrogate
def token_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, loss_type: str = "clip",
                    eps_low: float = 0.2, eps_high: float | None = None) -> tuple[torch.Tensor, dict]:
    """The per-token objective to MAXIMISE, ``[B, T]``, and per-token indicator tensors for logging.

    ``adv`` is ``[B]`` (one advantage per rollout, broadcast over its tokens) or ``[B, T]``."""
    eps_high = eps_low if eps_high is None else eps_high
    a = adv[:, None] if adv.dim() == 1 else adv
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    if loss_type == "pi":
        obj = torch.exp(logp) * a
    elif loss_type == "ratio":
        obj = ratio * a
    elif loss_type == "clip":
        obj = torch.minimum(ratio * a, torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * a)
    else:
        raise ValueError(f"unknown loss type {loss_type!r}")
    r = ratio.detach()
    stats = {"ratio": r,
             "clip_low": (r < 1.0 - eps_low) & (a < 0),     # clamp active: Â < 0 and ρ below the band
             "clip_high": (r > 1.0 + eps_high) & (a > 0)}   # clamp active: Â > 0 and ρ above the band
    return obj, stats


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative KL(π_θ‖π_ref) estimator ``e^{ref-logp} - (ref-logp) - 1``."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str, n_seqs: int, n_tokens: int,
              max_new_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the mini-batch mean (``n_seqs``/``n_tokens``: mini-batch totals)."""
    m = mask.to(per_token.dtype)
    if agg == "seq-mean":
        per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp_min(1.0)
        return per_seq.sum() / n_seqs
    if agg == "token-mean":
        return (per_token * m).sum() / max(n_tokens, 1)
    if agg == "seq-sum-norm":
        return ((per_token * m).sum(-1) / max_new_tokens).sum() / n_seqs
    raise ValueError(f"unknown loss aggregation {agg!r}")


def updates_per_phase(n_rollouts: int, mini_batch: int) -> int:
    """Optimizer steps in one rollout phase (one pass over the shuffled rollouts)."""
    return max(1, math.ceil(n_rollouts / mini_batch))


# ------------------------------------------------------------------------------------ toy bandit
def toy_bandit(loss_type: str = "clip", *, seeds: int | Sequence[int] = 200, arms: int = 10, prior_logit: float = 3.0,
               iterations: int = 200, groups: int = 4, group_size: int = 16, mini_batches: int = 8,
               lr: float = 1.0, eps: float = 0.2, gamma: float = 0.5) -> dict:
    """The spec's clipping-bias bandit: softmax policy over ``arms`` with logits ``(prior_logit, 0, ...)``,
    per iteration ``groups × group_size`` samples with Bernoulli(γ) rewards independent of the arm,
    group-normalised advantages, rollouts shuffled into ``mini_batches`` plain-SGD steps with the chosen
    surrogate (``mini_batches = 1`` is on-policy: ρ ≡ 1). All seeds run at once, each with its own
    generator. Returns the final prior-arm probability and policy entropy per seed."""
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    S, n = len(seed_list), groups * group_size
    # one generator per seed, drawn in blocks per iteration, so a seed's run does not depend on the others
    gens = [torch.Generator().manual_seed(int(s)) for s in seed_list]
    logits = torch.zeros(S, arms, dtype=torch.float64)
    logits[:, 0] = prior_logit
    start_p = torch.softmax(logits[0], -1)[0].item()
    mb = n // mini_batches
    for _ in range(iterations):
        with torch.no_grad():
            u = torch.stack([torch.rand(3, n, generator=g, dtype=torch.float64) for g in gens])  # [S, 3, n]
            cdf = torch.softmax(logits, -1).cumsum(-1)
            acts = (u[:, 0, :, None] > cdf[:, None, :]).sum(-1).clamp_max(arms - 1)      # inverse-CDF sampling
            rew = (u[:, 1] < gamma).to(torch.float64)
            adv = group_advantages(rew.reshape(-1), group_size).reshape(S, n).to(torch.float64)
            old_logp = torch.log_softmax(logits, -1).gather(1, acts)
            perm = u[:, 2].argsort(dim=1)
        for b in range(mini_batches):
            idx = perm[:, b * mb:(b + 1) * mb]
            theta = logits.clone().requires_grad_(True)
            logp = torch.log_softmax(theta, -1).gather(1, acts.gather(1, idx))
            obj, _ = token_surrogate(logp, old_logp.gather(1, idx), adv.gather(1, idx), loss_type, eps)
            loss = -obj.mean(dim=1).sum()  # per-seed mean over the mini-batch; seeds are independent
            loss.backward()
            with torch.no_grad():
                logits = logits - lr * theta.grad
    p = torch.softmax(logits, -1)
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    return {"loss": loss_type, "mini_batches": mini_batches, "start_prior": start_p,
            "prior": p[:, 0].tolist(), "entropy": ent.tolist(), "seeds": seed_list}


# ------------------------------------------------------------------------------------ config
@dataclass
class GRPOSettings:
    """Every knob of the loop (the CLI maps its options onto this; provenance is ``asdict``)."""
    steps: int = 8                    # rollout phases
    group_size: int = 8               # G
    prompts_per_rollout: int = 8
    mini_batch: int = 32              # rollouts per optimizer step
    micro_batch: int = 8              # rollouts per forward/backward
    lr: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0        # global clipping (0 = off)
    grad_clip: str = "global"         # gradient-clipping policy of `--clip` in train pretrain/sft (defaults)
    loss_type: str = "clip"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    loss_agg: str = "seq-mean"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    gen_batch_size: int = 64
    seed: int = 0
    save_every: int = 0               # phases between checkpoints (0 = only at the end)
    marker: str = ""                  # behaviour tracker substring ("" = off)
    system_prompt: str | None = None

    def validate(self) -> None:
        from llmtool.core.console import UsageError

        if self.group_size < 2:
            raise UsageError(f"--group-size {self.group_size}: GRPO needs G >= 2 rollouts per prompt")
        for k in ("steps", "prompts_per_rollout", "mini_batch", "micro_batch", "max_new_tokens", "gen_batch_size"):
            if getattr(self, k) < 1:
                raise UsageError(f"--{k.replace('_', '-')} {getattr(self, k)}: must be >= 1")
        for k in ("lr", "weight_decay", "max_grad_norm", "clip_eps", "kl_coef", "entropy_coef", "temperature"):
            v = getattr(self, k)
            if not math.isfinite(v) or v < 0:
                raise UsageError(f"--{k.replace('_', '-')} {v}: must be a finite number >= 0")
        from llmtool.train.clipping import CLIPPERS

        if self.grad_clip not in CLIPPERS.names():
            raise UsageError(f"--grad-clip {self.grad_clip!r}: choose one of {', '.join(CLIPPERS.names())}")
        if self.clip_eps_high is not None and (not math.isfinite(self.clip_eps_high) or self.clip_eps_high < 0):
            raise UsageError(f"--clip-eps-high {self.clip_eps_high}: must be a finite number >= 0")
        if self.lr == 0:
            raise UsageError("--lr 0: must be > 0")
        if self.temperature == 0:
            raise UsageError("--temperature 0: RL rollouts must be sampled (temperature > 0)")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.loss_type not in LOSS_TYPES:
            raise UsageError(f"--loss {self.loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
        if self.loss_agg not in LOSS_AGGS:
            raise UsageError(f"--loss-agg {self.loss_agg!r}: choose one of {', '.join(LOSS_AGGS)}")


@dataclass
class Rollout:
    prompt_index: int                 # index into the phase's prompt list
    row: dict                         # the data row
    prompt_ids: list[int]
    completion_ids: list[int]         # trained response tokens (eos appended when generation stopped on it)
    text: str
    finish: str
    reward: float = 0.0
    advantage: float = 0.0
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------ log-probs
def _pad_batch(rollouts: Sequence[Rollout], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and the response mask aligned with targets ``[:, 1:]``."""
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    ids = torch.full((len(rollouts), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rollouts), width), dtype=torch.long)
    resp = torch.zeros((len(rollouts), width - 1), dtype=torch.bool)
    for i, r in enumerate(rollouts):
        seq = r.prompt_ids + r.completion_ids
        ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        att[i, :len(seq)] = 1
        resp[i, len(r.prompt_ids) - 1:len(seq) - 1] = True
    return ids, att, resp


def sequence_logps(model, ids: torch.Tensor, att: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, with_hidden: bool = False) -> dict:
    """Log-probabilities of each target token ``[B, T-1]`` under ``model`` (logits divided by the
    sampling temperature, so they are the sampler's log-probs), optionally the token entropy and the
    last hidden states."""
    out = model(input_ids=ids, attention_mask=att, use_cache=False, output_hidden_states=with_hidden)
    logits = out.logits[:, :-1].float() / temperature
    logsm = torch.log_softmax(logits, -1)
    res = {"logp": logsm.gather(-1, ids[:, 1:, None]).squeeze(-1)}
    if with_entropy:
        res["entropy"] = -(logsm.exp() * logsm).sum(-1)
    if with_hidden:
        res["hidden"] = out.hidden_states[-1]
    return res


# ------------------------------------------------------------------------------------ the loop
class GRPOTrainerLoop:
    """One GRPO run: rollouts → rewards → (shaped) advantages → mini-batched clipped updates.

    ``reward_fn(rollouts, phase)`` sets ``r.reward`` on each rollout of the phase (it sees whole groups,
    so majority-vote style rewards are possible); ``shaper(rollouts, rewards, advantages, group_size,
    ctx) -> advantages`` reshapes the group advantages (GRPO: identity). ``rollout_fn`` (optional)
    replaces local sampling (e.g. an OpenAI-compatible server)."""

    def __init__(self, model, tokenizer, rows: Sequence[dict], settings: GRPOSettings,
                 reward_fn: Callable, shaper: Callable | None = None, ref_model=None,
                 rollout_fn: Callable | None = None, metrics_path: Path | None = None,
                 checkpoint_dir: Path | None = None, on_step: Callable[[dict], None] | None = None,
                 accelerator=None):
        from accelerate import Accelerator

        settings.validate()
        self.s = settings
        self.tokenizer = tokenizer
        self.rows = list(rows)
        self.reward_fn = reward_fn
        self.shaper = shaper
        self.rollout_fn = rollout_fn
        self.metrics_path = metrics_path
        self.checkpoint_dir = checkpoint_dir
        self.on_step = on_step
        self.acc = accelerator or Accelerator(cpu=not torch.cuda.is_available())
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
        self.model, self.optimizer = self.acc.prepare(self.model, self.optimizer)
        self.clipper = None  # "global" keeps accelerate's clip_grad_norm_ (works under every launcher)
        if settings.grad_clip != "global":
            from llmtool.train.clipping import CLIPPERS, refuse_deepspeed_zero

            refuse_deepspeed_zero(self.acc)
            self.clipper = CLIPPERS.build(settings.grad_clip).build(
                self.acc.unwrap_model(self.model).named_parameters())
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.to(self.acc.device).eval()
            for p in ref_model.parameters():
                p.requires_grad_(False)
        self.phase = 0
        self.step = 0
        self.history: list[dict] = []
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.eos_id = tokenizer.eos_token_id
        n_roll = settings.prompts_per_rollout * settings.group_size
        self.n_updates = updates_per_phase(n_roll, settings.mini_batch)
        self.on_policy_only = self.n_updates == 1
        self.prompts_cache: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ data order (deterministic)
    def phase_rows(self, phase: int) -> list[int]:
        """Row indices of ``phase``: a seeded permutation per data epoch, consumed in order; each
        accelerate process takes every ``num_processes``-th prompt."""
        k = self.s.prompts_per_rollout * self.acc.num_processes
        n = len(self.rows)
        start = phase * k
        out = []
        for j in range(start, start + k):
            epoch, pos = divmod(j, n)
            perm = list(range(n))
            _random.Random(self.s.seed * 7919 + epoch).shuffle(perm)
            out.append(perm[pos])
        return out[self.acc.process_index::self.acc.num_processes]

    def prompt_text(self, row: dict) -> str:
        from llmtool.core.lm import chat_prompt

        return chat_prompt(self.tokenizer, row["prompt"], system=self.s.system_prompt)

    # ------------------------------------------------------------------ rollouts
    def rollouts(self, phase: int) -> list[Rollout]:
        from llmtool.core.lm import generate

        idx = self.phase_rows(phase)
        rows = [self.rows[i] for i in idx]
        texts = [self.prompt_text(r) for r in rows]
        G = self.s.group_size
        seed = self.s.seed * 100003 + phase
        if self.rollout_fn is not None:
            comps = self.rollout_fn(rows, texts, G, self.s, seed)
        else:
            model = self.acc.unwrap_model(self.model)
            was_training = model.training
            model.eval()
            comps = generate(model, self.tokenizer, texts, max_new_tokens=self.s.max_new_tokens,
                             temperature=self.s.temperature, top_p=self.s.top_p, n=G,
                             batch_size=self.s.gen_batch_size, seed=seed)
            model.train(was_training)
        out = []
        for pi, (row, text, group) in enumerate(zip(rows, texts, comps)):
            p_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            for c in group:
                ids = list(c.token_ids)
                if c.finish == "stop" and self.eos_id is not None:
                    ids = ids + [self.eos_id]
                if not ids:  # an empty response still needs one trained token
                    ids = [self.eos_id if self.eos_id is not None else self.pad_id]
                out.append(Rollout(pi, row, p_ids, ids, c.text, c.finish))
        return out

    @torch.no_grad()
    def _old_logps(self, rollouts: list[Rollout]) -> None:
        """π_old (and π_ref) log-probs with the training model, frozen at rollout time."""
        model = self.acc.unwrap_model(self.model)
        mb = self.s.micro_batch
        for s in range(0, len(rollouts), mb):
            chunk = rollouts[s:s + mb]
            ids, att, resp = _pad_batch(chunk, self.pad_id)
            ids, att = ids.to(self.acc.device), att.to(self.acc.device)
            lp = sequence_logps(model, ids, att, self.s.temperature)["logp"].cpu()
            ref = None
            if self.ref_model is not None and self.s.kl_coef > 0:
                ref = sequence_logps(self.ref_model, ids, att, self.s.temperature)["logp"].cpu()
            for i, r in enumerate(chunk):
                sel = resp[i]
                r.extra["old_logp"] = lp[i][sel]
                if ref is not None:
                    r.extra["ref_logp"] = ref[i][sel]

    # ------------------------------------------------------------------ one phase
    def run_phase(self) -> list[dict]:
        s, phase = self.s, self.phase
        t0 = time.perf_counter()
        rollouts = self.rollouts(phase)
        t_gen = time.perf_counter() - t0
        self.reward_fn(rollouts, phase)
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        adv = group_advantages(rewards, s.group_size)
        t1 = time.perf_counter()
        shape_stats: dict = {}
        if self.shaper is not None:
            ctx = {"model": self.acc.unwrap_model(self.model), "ref_model": self.ref_model, "tokenizer": self.tokenizer,
                   "pad_id": self.pad_id, "stats": shape_stats, "device": self.acc.device}
            adv = self.shaper(rollouts, rewards, adv, s.group_size, ctx)
        t_shape = time.perf_counter() - t1
        for r, a in zip(rollouts, adv.tolist()):
            r.advantage = a
        self._old_logps(rollouts)
        t_old = time.perf_counter() - t1 - t_shape
        g = rewards.view(-1, s.group_size)
        phase_stats = {
            "phase": phase, "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "zero_std_groups": (g == g[:, :1]).all(1).float().mean().item(),
            "adv_mean": adv.mean().item(), "adv_abs_mean": adv.abs().mean().item(),
            "response_len": sum(len(r.completion_ids) for r in rollouts) / len(rollouts),
            "truncated": sum(r.finish == "length" for r in rollouts) / len(rollouts),
            "gen_seconds": t_gen, "shape_seconds": t_shape, "old_logp_seconds": t_old,
            "rollout_tokens": sum(len(r.completion_ids) for r in rollouts),
            "updates_per_phase": self.n_updates,
        }
        if s.marker:
            phase_stats["marker_freq"] = sum(s.marker.lower() in r.text.lower() for r in rollouts) / len(rollouts)
        for k, v in shape_stats.items():
            phase_stats[k] = v
        order = list(range(len(rollouts)))
        _random.Random(s.seed * 1000003 + phase).shuffle(order)
        records = []
        t_train = time.perf_counter()
        for u in range(self.n_updates):
            batch = [rollouts[i] for i in order[u * s.mini_batch:(u + 1) * s.mini_batch]]
            if not batch:
                break
            st = self._update(batch)
            st.update(phase_stats if u == 0 else {"phase": phase})
            st["update_in_phase"] = u
            records.append(st)
        t_upd = time.perf_counter() - t_train
        for rec in records:
            rec["train_seconds_phase"] = t_upd
            rec["phase_seconds"] = time.perf_counter() - t0
        if self.on_policy_only and phase == 0:
            records[0]["warning"] = "one optimizer step per rollout phase: rho == 1, clipping can never bind"
        self.phase += 1
        return records

    def _update(self, batch: list[Rollout]) -> dict:
        s = self.s
        model = self.model
        model.train()
        n_seqs = len(batch)
        n_tokens = sum(len(r.completion_ids) for r in batch)
        sums = {"clip_low": 0.0, "clip_high": 0.0, "ratio_sum": 0.0, "kl": 0.0, "entropy": 0.0, "loss": 0.0}
        rmin, rmax, ntok = float("inf"), float("-inf"), 0
        micro = [batch[i:i + s.micro_batch] for i in range(0, n_seqs, s.micro_batch)]
        for mi, chunk in enumerate(micro):
            ids, att, resp = _pad_batch(chunk, self.pad_id)
            ids, att, resp = ids.to(self.acc.device), att.to(self.acc.device), resp.to(self.acc.device)
            sync = mi == len(micro) - 1
            ctx = self.acc.no_sync(model) if (not sync and self.acc.num_processes > 1) else _null()
            with ctx:
                out = sequence_logps(model, ids, att, s.temperature, with_entropy=True)
                logp = out["logp"]
                old = torch.zeros_like(logp)
                adv = torch.zeros(logp.shape, dtype=logp.dtype, device=logp.device)
                ref = None
                for i, r in enumerate(chunk):
                    old[i][resp[i]] = r.extra["old_logp"].to(old.device)
                    adv[i][resp[i]] = r.advantage
                if s.kl_coef > 0 and self.ref_model is not None:
                    ref = torch.zeros_like(logp)
                    for i, r in enumerate(chunk):
                        ref[i][resp[i]] = r.extra["ref_logp"].to(ref.device)
                obj, st = token_surrogate(logp, old, adv, s.loss_type, s.clip_eps, s.clip_eps_high)
                per_tok = -obj
                if ref is not None:
                    kl = kl_k3(logp, ref)
                    per_tok = per_tok + s.kl_coef * kl
                    sums["kl"] += (kl.detach() * resp).sum().item()
                if s.entropy_coef > 0:
                    per_tok = per_tok - s.entropy_coef * out["entropy"]
                loss = aggregate(per_tok, resp, s.loss_agg, n_seqs, n_tokens, s.max_new_tokens)
                self.acc.backward(loss)
            m = resp
            sums["loss"] += loss.item()
            sums["clip_low"] += (st["clip_low"] & m).sum().item()
            sums["clip_high"] += (st["clip_high"] & m).sum().item()
            r_sel = st["ratio"][m]
            if r_sel.numel():
                sums["ratio_sum"] += r_sel.sum().item()
                rmin, rmax = min(rmin, r_sel.min().item()), max(rmax, r_sel.max().item())
            sums["entropy"] += (out["entropy"].detach() * m).sum().item()
            ntok += m.sum().item()
        grad_norm, clip_fraction = None, None
        if self.clipper is not None:
            stats = self.clipper.clip_().as_dict()
            grad_norm, clip_fraction = stats.get("grad_norm"), stats.get("clip_fraction")
        elif s.max_grad_norm > 0:
            grad_norm = float(self.acc.clip_grad_norm_(self.model.parameters(), s.max_grad_norm))
        else:
            grad_norm = float(torch.norm(torch.stack([p.grad.detach().norm() for p in self.model.parameters()
                                                       if p.grad is not None])))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        ntok = max(ntok, 1)
        return {"step": self.step, "loss": sums["loss"], "clip_frac_low": sums["clip_low"] / ntok,
                "clip_frac_high": sums["clip_high"] / ntok,
                "clip_frac": (sums["clip_low"] + sums["clip_high"]) / ntok,
                "ratio_mean": sums["ratio_sum"] / ntok, "ratio_min": rmin, "ratio_max": rmax,
                "kl": sums["kl"] / ntok, "entropy": sums["entropy"] / ntok, "grad_norm": grad_norm,
                **({"grad_clip_fraction": clip_fraction} if self.clipper is not None else {})}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, root: Path) -> Path:
        """``root/checkpoint-<phase>/``: weights (safetensors), optimizer state, counters and the
        metrics so far; written atomically, so an interrupted save never shadows the previous one."""
        from llmtool.core.checkpoint import atomic_output

        target = root / f"checkpoint-{self.phase}"
        root.mkdir(parents=True, exist_ok=True)
        with atomic_output(target, overwrite=True) as tmp:
            self.acc.unwrap_model(self.model).save_pretrained(tmp, safe_serialization=True)
            torch.save({"optimizer": self.optimizer.state_dict(), "phase": self.phase, "step": self.step,
                        "history": self.history,
                        "clipper": self.clipper.state_dict() if self.clipper is not None else None},
                       tmp / "trainer_state.pt")
            (tmp / "progress.json").write_text(json.dumps({"phase": self.phase, "step": self.step,
                                                           "config": getattr(self, "config_record", None) or {}},
                                                          default=str))
        return target

    def load_checkpoint(self, path: Path) -> None:
        from safetensors.torch import load_file

        model = self.acc.unwrap_model(self.model)
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(f)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        bad = [k for k in missing if "lm_head" not in k] + list(unexpected)
        if bad:
            raise ValueError(f"{path}: checkpoint does not match the model ({bad[:3]} ...)")
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
        ts = torch.load(path / "trainer_state.pt", weights_only=False)
        self.optimizer.load_state_dict(ts["optimizer"])
        if self.clipper is not None and ts.get("clipper") is not None:
            self.clipper.load_state_dict(ts["clipper"])
        self.phase, self.step, self.history = ts["phase"], ts["step"], ts["history"]

    # ------------------------------------------------------------------ run
    def train(self, progress_desc: str | None = "grpo") -> list[dict]:
        from llmtool.core.console import info, progress

        s = self.s
        if self.on_policy_only and self.phase == 0:
            info(f"grpo: {s.prompts_per_rollout}×{s.group_size} rollouts with mini-batch {s.mini_batch} give one "
                 "update per phase: rho == 1 and clipping cannot bind (the on-policy ablation)")
        remaining = range(self.phase, s.steps)
        it = progress(remaining, progress_desc, total=len(remaining)) if progress_desc else remaining
        for _ in it:
            recs = self.run_phase()
            self.history.extend(recs)
            if self.metrics_path is not None:
                with open(self.metrics_path, "a") as fh:
                    for r in recs:
                        fh.write(json.dumps(r) + "\n")
            if self.on_step:
                self.on_step(recs[0])
            if self.checkpoint_dir is not None and s.save_every and self.phase % s.save_every == 0 \
                    and self.phase < s.steps:
                self.save_checkpoint(self.checkpoint_dir)
        return self.history


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest phase under ``root`` (temp dirs of killed saves ignored)."""
    if not root.is_dir():
        return None
    best = None
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("checkpoint-") and p.name[11:].isdigit() \
                and (p / "trainer_state.pt").is_file():
            if best is None or int(p.name[11:]) > int(best.name[11:]):
                best = p
    return best
