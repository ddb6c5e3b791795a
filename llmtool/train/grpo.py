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

Engines: this module is the *home loop*, a compact loop of our own on ``accelerate`` and the reference:
SetPO needs per-group advantage shaping, which TRL's ``GRPOTrainer`` has no hook for, and the three loss
variants of the clipping ablation (clip, ratio-no-clip, −π_θ·Â) are one function here. It uses
``accelerate.Accelerator`` for device placement, DDP gradient sync (``no_sync`` on all but the last
micro-batch of a mini-batch) and ``accelerate launch``/``torchrun``, and is rank-correct under several
processes (see :class:`GRPOTrainerLoop`: the union of the ranks' work is exactly one process's work on
``world`` times the batch, tested with two CPU processes). ``--engine trl`` (:mod:`llmtool.train.grpo_trl`)
runs the same settings through TRL's ``GRPOTrainer`` (vLLM server/colocate with weight sync); on a fixed
batch both give the same loss and gradients (tests).

Memory: per-token log-probs and entropies come from a chunked selective log-softmax
(:func:`sequence_logps`): the model returns its last hidden states, the LM head runs over ``chunk``
positions at a time under activation checkpointing, and only ``logit[target] − logsumexp`` and the exact
entropy are kept, so the ``[batch, seq, vocab]`` fp32 tensor (at 7B with a 150k vocabulary, the peak of an
update) never exists, in the forward or the backward.

Resume: checkpoints hold no pickle. Model weights are safetensors; the trainer state (AdamW tensors named by
their path in the state dict, counters, metrics so far, clipper state, Python/NumPy/torch RNG states) is
``trainer_state.safetensors`` + ``trainer_state.json`` (:func:`save_trainer_state`); a resume directory gets
the checks of a MODEL argument and any pickle file in it is refused unopened (:func:`check_resume_dir`).

Reconstructed choices: the random reward is seeded per (seed, phase, prompt position over all
processes, rollout) (the official one is unseeded); rollouts that hit ``max_new_tokens`` are trained on like any other (no overlong
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

from llmtool.core.data import prompt_ids
from llmtool.train.grpo_choices import LOSS_AGGS, LOSS_TYPES, check_loss_choices  # noqa: E402,F401


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
    logp_chunk: int | None = None     # positions per log-prob chunk (None: auto, 0: full-vocabulary reference)

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
        if self.logp_chunk is not None and self.logp_chunk < 0:
            raise UsageError(f"--logp-chunk {self.logp_chunk}: must be >= 0 (0 = full-vocabulary reference)")
        if self.temperature == 0:
            raise UsageError("--temperature 0: RL rollouts must be sampled (temperature > 0)")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p {self.top_p}: must be in (0, 1]")
        check_loss_choices(self.loss_type, self.loss_agg)


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
    global_index: int = -1            # the prompt's position in the phase over all ranks (-1: = prompt_index)

    def __post_init__(self):
        if self.global_index < 0:
            self.global_index = self.prompt_index


# ------------------------------------------------------------------------------------ log-probs
LOGP_CHUNK_ELEMENTS = 1 << 24   # fp32 logits entries per chunk in the automatic chunk size (64 MB)


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


def _head_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None,
                 temperature: float) -> torch.Tensor:
    logits = torch.nn.functional.linear(h, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits / temperature


def _chunk_logp_entropy(h: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        softcap: float | None, temperature: float, with_entropy: bool):
    """Selective log-softmax of one chunk of positions: ``logit[target] - logsumexp(logits)`` and the exact
    entropy ``logsumexp - Σ p·logit``; only this chunk's ``[B, c, V]`` logits ever exist."""
    logits = _head_logits(h, weight, bias, softcap, temperature)
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    p = torch.exp(logits - lse[..., None])
    return logp, lse - (p * logits).sum(-1)


def _output_head(model):
    """``(weight, bias, softcap)`` of the LM head of ``model`` (unwrapped), or None when it is not a plain
    linear layer or its weight is sharded (then :func:`sequence_logps` takes the full path)."""
    base = getattr(model, "module", model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return None
    w = head.weight
    if getattr(w, "ds_id", None) is not None or hasattr(w, "full_tensor") or hasattr(w, "_local_tensor"):
        return None  # sharded (DeepSpeed ZeRO-3 / FSDP2 DTensor): only the module's own forward sees it whole
    cfg = getattr(base, "config", None)
    softcap = getattr(cfg, "final_logit_softcapping", None) if cfg is not None else None
    cfg_text = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    softcap = softcap or getattr(cfg_text, "final_logit_softcapping", None)
    return head.weight, head.bias, softcap


def auto_chunk(batch: int, vocab: int, seq: int) -> int:
    """Positions per chunk so that one chunk's fp32 logits hold about ``LOGP_CHUNK_ELEMENTS`` entries."""
    return max(1, min(seq, LOGP_CHUNK_ELEMENTS // max(1, batch * vocab)))


def sequence_logps(model, ids: torch.Tensor, att: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, with_hidden: bool = False, chunk: int | None = None) -> dict:
    """Log-probabilities of each target token ``[B, T-1]`` under ``model`` (logits divided by the
    sampling temperature, so they are the sampler's log-probs), optionally the token entropy and the
    last hidden states.

    ``chunk`` positions at a time (None: :func:`auto_chunk`; 0: the full-vocabulary reference path).
    The chunked path asks the model for its last hidden states only (``logits_to_keep=1``) and applies
    the LM head per chunk inside activation checkpointing, so neither the forward nor the backward ever
    holds the ``[B, T, V]`` fp32 logits: peak memory grows with ``B·chunk·V``. It checks once per call
    that the head it applies reproduces the model's own last-position logits (families with a logit
    transform it does not know fall back to the full path)."""
    if chunk == 0:
        return _full_logps(model, ids, att, temperature, with_entropy, with_hidden)
    head = _output_head(model)
    if head is None:
        return _full_logps(model, ids, att, temperature, with_entropy, with_hidden)
    weight, bias, softcap = head
    try:
        out = model(input_ids=ids, attention_mask=att, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    except TypeError:  # a model class without ``logits_to_keep``
        return _full_logps(model, ids, att, temperature, with_entropy, with_hidden)
    hidden = out.hidden_states[-1]
    with torch.no_grad():  # the head we apply must be the model's own (norm, softcap, scale)
        mine = _head_logits(hidden[:, -1:], weight, bias, softcap, 1.0)
        theirs = out.logits[:, -1:].float()
        if mine.shape != theirs.shape or not torch.allclose(
                mine, theirs, rtol=1e-3, atol=1e-3 * (1.0 + float(theirs.abs().max()))):
            return _full_logps(model, ids, att, temperature, with_entropy, with_hidden)
    h, targets = hidden[:, :-1], ids[:, 1:]
    B, T = targets.shape
    c = chunk or auto_chunk(B, weight.shape[0], T)
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    lps, ents = [], []
    for s in range(0, T, c):
        args = (h[:, s:s + c], targets[:, s:s + c], weight, bias, softcap, temperature, with_entropy)
        if grad:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(_chunk_logp_entropy, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logp_entropy(*args)
        lps.append(lp)
        ents.append(ent)
    res = {"logp": torch.cat(lps, 1) if lps else hidden.new_zeros(B, 0, dtype=torch.float32)}
    if with_entropy:
        res["entropy"] = torch.cat(ents, 1) if ents else res["logp"].clone()
    if with_hidden:
        res["hidden"] = hidden
    return res


def _full_logps(model, ids, att, temperature, with_entropy, with_hidden) -> dict:
    """The reference: the full ``[B, T, V]`` fp32 log-softmax."""
    out = model(input_ids=ids, attention_mask=att, use_cache=False, output_hidden_states=with_hidden)
    logits = out.logits[:, :-1].float() / temperature
    logsm = torch.log_softmax(logits, -1)
    res = {"logp": logsm.gather(-1, ids[:, 1:, None]).squeeze(-1)}
    if with_entropy:
        res["entropy"] = -(logsm.exp() * logsm).sum(-1)
    if with_hidden:
        res["hidden"] = out.hidden_states[-1]
    return res


def rollout_loss(model, chunk: Sequence[Rollout], ids: torch.Tensor, att: torch.Tensor, resp: torch.Tensor,
                 s: GRPOSettings, n_seqs: int, n_tokens: int, use_ref: bool = False):
    """The home loop's loss of one micro-batch (its share of the mini-batch mean; ``n_seqs``/``n_tokens`` are
    the mini-batch totals): surrogate + β·KL − entropy bonus, aggregated by ``s.loss_agg``. Returns
    ``(loss, sequence_logps output, surrogate stats, per-token KL or None)``."""
    out = sequence_logps(model, ids, att, s.temperature, with_entropy=True, chunk=s.logp_chunk)
    logp = out["logp"]
    old = torch.zeros_like(logp)
    adv = torch.zeros(logp.shape, dtype=logp.dtype, device=logp.device)
    for i, r in enumerate(chunk):
        old[i][resp[i]] = r.extra["old_logp"].to(old.device)
        adv[i][resp[i]] = r.advantage
    obj, st = token_surrogate(logp, old, adv, s.loss_type, s.clip_eps, s.clip_eps_high)
    per_tok = -obj
    kl = None
    if use_ref:
        ref = torch.zeros_like(logp)
        for i, r in enumerate(chunk):
            ref[i][resp[i]] = r.extra["ref_logp"].to(ref.device)
        kl = kl_k3(logp, ref)
        per_tok = per_tok + s.kl_coef * kl
    if s.entropy_coef > 0:
        per_tok = per_tok - s.entropy_coef * out["entropy"]
    return aggregate(per_tok, resp, s.loss_agg, n_seqs, n_tokens, s.max_new_tokens), out, st, kl


# ------------------------------------------------------------------------------------ the loop
class GRPOTrainerLoop:
    """One GRPO run: rollouts → rewards → (shaped) advantages → mini-batched clipped updates.

    ``reward_fn(rollouts, phase)`` sets ``r.reward`` on each rollout of the phase (it sees whole groups,
    so majority-vote style rewards are possible); ``shaper(rollouts, rewards, advantages, group_size,
    ctx) -> advantages`` reshapes the group advantages (GRPO: identity). ``rollout_fn`` (optional)
    replaces local sampling (e.g. an OpenAI-compatible server).

    Under several processes (``torchrun``/``accelerate launch``; DDP) the loop is rank-correct:

    - prompts: a phase takes ``prompts_per_rollout × world`` prompts; the one at phase position ``q``
      belongs to rank ``q mod world`` (a group never spans processes, so group normalisation and SetPO
      stay local); ``prompts_per_rollout`` and ``mini_batch`` are per process;
    - randomness: a generation batch is seeded by (seed, phase, phase position of its first prompt) and a
      random reward by (seed, phase, phase position, rollout), so ranks draw different noise, and with
      one prompt per generation batch (``gen_batch_size <= G``) a prompt's rollouts do not depend on the
      number of processes;
    - updates: the phase's rollouts are numbered globally (``position × G + j``) and shuffled by one
      seeded permutation shared by all ranks; optimizer step ``u`` takes the global slice
      ``[u·M·world, (u+1)·M·world)`` and each rank trains on its members of it. The loss is normalised by
      the global sequence/token counts of the mini-batch (token counts all-reduced) and multiplied by
      ``world`` (DDP averages gradients), so ``world`` processes take exactly the step of one process with
      ``world`` times the prompts and mini-batch (= gradient accumulation), up to float summation order;
      a rank with no member in a mini-batch runs a zero-weighted backward so DDP's collectives match;
    - outputs: only the main process writes metrics and checkpoints and reports progress; metrics are
      reduced over ranks (rewards/advantages gathered, clip fractions and entropies summed over all
      tokens, ratio min/max reduced)."""

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
        self.world = self.acc.num_processes
        self.rank = self.acc.process_index
        self.is_main = self.acc.is_main_process
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
        self.stale_rollouts = False  # rollouts from a server whose weights are never synced (recorded per step)

    # ------------------------------------------------------------------ collectives (no-ops on one process)
    def _all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        if self.world == 1:
            return [float(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.acc.device)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
        return t.cpu().tolist()

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenation over ranks in rank order (every rank holds the same number of rollouts)."""
        if self.world == 1:
            return t
        return self.acc.gather(t.to(self.acc.device)).cpu()

    # ------------------------------------------------------------------ data order (deterministic)
    def phase_positions(self, phase: int) -> list[int]:
        """This rank's positions in the phase's global prompt list (``rank, rank + world, ...``)."""
        return list(range(self.rank, self.s.prompts_per_rollout * self.world, self.world))

    def phase_rows(self, phase: int) -> list[int]:
        """Row indices of ``phase``: a seeded permutation per data epoch, consumed in order; each
        accelerate process takes every ``num_processes``-th prompt."""
        k = self.s.prompts_per_rollout * self.world
        n = len(self.rows)
        start = phase * k
        out = []
        for j in range(start, start + k):
            epoch, pos = divmod(j, n)
            perm = list(range(n))
            _random.Random(self.s.seed * 7919 + epoch).shuffle(perm)
            out.append(perm[pos])
        return out[self.rank::self.world]

    def sampling_seed(self, phase: int, position: int) -> int:
        """Seed of the generation batch whose first prompt is at phase position ``position``."""
        from llmtool.train.rewards import hash_key

        return hash_key(("sample", self.s.seed, phase, position)) % (2 ** 62)

    def prompt_text(self, row: dict) -> str:
        from llmtool.core.lm import chat_prompt

        return chat_prompt(self.tokenizer, row["prompt"], system=self.s.system_prompt)

    # ------------------------------------------------------------------ rollouts
    def rollouts(self, phase: int) -> list[Rollout]:
        from llmtool.core.lm import generate

        idx = self.phase_rows(phase)
        positions = self.phase_positions(phase)
        rows = [self.rows[i] for i in idx]
        texts = [self.prompt_text(r) for r in rows]
        G = self.s.group_size
        if self.rollout_fn is not None:
            comps = self.rollout_fn(rows, texts, G, self.s, self.sampling_seed(phase, positions[0]))
        else:
            model = self.acc.unwrap_model(self.model)
            was_training = model.training
            model.eval()
            per = max(1, self.s.gen_batch_size // G)
            comps = []
            for b in range(0, len(texts), per):
                comps += generate(model, self.tokenizer, texts[b:b + per], max_new_tokens=self.s.max_new_tokens,
                                  temperature=self.s.temperature, top_p=self.s.top_p, n=G,
                                  batch_size=self.s.gen_batch_size, seed=self.sampling_seed(phase, positions[b]))
            model.train(was_training)
        out = []
        for pi, (row, text, group) in enumerate(zip(rows, texts, comps)):
            p_ids = prompt_ids(self.tokenizer, text)   # as generate encoded it (BOS first on Gemma)
            for c in group:
                ids = list(c.token_ids)
                if c.finish == "stop" and self.eos_id is not None:
                    ids = ids + [self.eos_id]
                if not ids:  # an empty response still needs one trained token
                    ids = [self.eos_id if self.eos_id is not None else self.pad_id]
                out.append(Rollout(pi, row, p_ids, ids, c.text, c.finish, global_index=positions[pi]))
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
            lp = sequence_logps(model, ids, att, self.s.temperature, chunk=self.s.logp_chunk)["logp"].cpu()
            ref = None
            if self.ref_model is not None and self.s.kl_coef > 0:
                ref = sequence_logps(self.ref_model, ids, att, self.s.temperature, chunk=self.s.logp_chunk)["logp"].cpu()
            for i, r in enumerate(chunk):
                sel = resp[i]
                r.extra["old_logp"] = lp[i][sel]
                if ref is not None:
                    r.extra["ref_logp"] = ref[i][sel]

    # ------------------------------------------------------------------ one phase
    def _phase_stats(self, rollouts: list[Rollout], rewards: torch.Tensor, adv: torch.Tensor,
                     shape_stats: dict) -> dict:
        """Phase statistics over every rank's rollouts."""
        s = self.s
        local = torch.stack([rewards, adv.to(torch.float32),
                             torch.tensor([float(len(r.completion_ids)) for r in rollouts]),
                             torch.tensor([float(r.finish == "length") for r in rollouts]),
                             torch.tensor([float(bool(s.marker) and s.marker.lower() in r.text.lower())
                                           for r in rollouts])], 1)
        allr = self._gather(local)
        rew, a = allr[:, 0], allr[:, 1]
        g = rew.view(-1, s.group_size)
        st = {
            "reward_mean": rew.mean().item(),
            "reward_std": rew.std().item() if len(rew) > 1 else 0.0,
            "zero_std_groups": (g == g[:, :1]).all(1).float().mean().item(),
            "adv_mean": a.mean().item(), "adv_abs_mean": a.abs().mean().item(),
            "response_len": allr[:, 2].mean().item(), "truncated": allr[:, 3].mean().item(),
            "rollout_tokens": int(allr[:, 2].sum().item()), "processes": self.world,
        }
        if s.marker:
            st["marker_freq"] = allr[:, 4].mean().item()
        # a shaper's statistics: the mean over the ranks that have a number for it (a shaper sets the same keys
        # on every call, so every rank reduces the same vector; None where a rank had nothing to measure)
        keys = sorted(shape_stats)
        flat = []
        for k in keys:
            v = shape_stats[k]
            num = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            flat += [float(v) if num else 0.0, 1.0 if num else 0.0]
        red = self._all_reduce(flat)
        for i, k in enumerate(keys):
            total, count = red[2 * i], red[2 * i + 1]
            st[k] = total / count if count else shape_stats[k]
        return st

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
        phase_stats = {"phase": phase, **self._phase_stats(rollouts, rewards, adv, shape_stats),
                       "gen_seconds": t_gen, "shape_seconds": t_shape, "old_logp_seconds": t_old,
                       "updates_per_phase": self.n_updates}
        if self.stale_rollouts:  # the server still has the initial weights: say how far behind they are
            phase_stats["rollout_policy_lag"] = {"phases": phase, "optimizer_steps": self.step}
        # one global numbering and one shuffle shared by all ranks (see the class docstring)
        G = s.group_size
        by_gid, seen = {}, {}
        for r in rollouts:
            j = seen.get(r.global_index, 0)
            seen[r.global_index] = j + 1
            by_gid[r.global_index * G + j] = r
        order = list(range(s.prompts_per_rollout * self.world * G))
        _random.Random(s.seed * 1000003 + phase).shuffle(order)
        span = s.mini_batch * self.world
        records = []
        t_train = time.perf_counter()
        for u in range(self.n_updates):
            gids = order[u * span:(u + 1) * span]
            if not gids:
                break
            batch = [by_gid[g] for g in gids if g in by_gid]
            st = self._update(batch, len(gids), filler=rollouts[0])
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

    def _update(self, batch: list[Rollout], n_seqs: int | None = None, filler: Rollout | None = None) -> dict:
        """One optimizer step on this rank's share ``batch`` of a mini-batch of ``n_seqs`` rollouts (all
        ranks together); ``filler`` is run with weight 0 when this rank has no member in it."""
        s = self.s
        model = self.model
        model.train()
        n_seqs = len(batch) if n_seqs is None else n_seqs
        n_tokens = int(self._all_reduce([sum(len(r.completion_ids) for r in batch)])[0])
        sums = {"clip_low": 0.0, "clip_high": 0.0, "ratio_sum": 0.0, "kl": 0.0, "entropy": 0.0, "loss": 0.0}
        rmin, rmax, ntok = float("inf"), float("-inf"), 0
        micro = [batch[i:i + s.micro_batch] for i in range(0, len(batch), s.micro_batch)]
        dummy = not micro
        if dummy:
            if filler is None:
                raise ValueError("an empty mini-batch share needs a filler rollout")
            micro = [[filler]]
        for mi, chunk in enumerate(micro):
            ids, att, resp = _pad_batch(chunk, self.pad_id)
            ids, att, resp = ids.to(self.acc.device), att.to(self.acc.device), resp.to(self.acc.device)
            sync = mi == len(micro) - 1
            ctx = self.acc.no_sync(model) if (not sync and self.world > 1) else _null()
            with ctx:
                loss, out, st, kl = rollout_loss(model, chunk, ids, att, resp, s, n_seqs, n_tokens,
                                                 use_ref=s.kl_coef > 0 and self.ref_model is not None)
                # DDP averages gradients over ranks: scale back to the sum of the ranks' shares
                self.acc.backward(loss * (0.0 if dummy else float(self.world)))
            if dummy:
                continue
            m = resp
            sums["loss"] += loss.item()
            if kl is not None:
                sums["kl"] += (kl.detach() * m).sum().item()
            sums["clip_low"] += (st["clip_low"] & m).sum().item()
            sums["clip_high"] += (st["clip_high"] & m).sum().item()
            r_sel = st["ratio"][m]
            if r_sel.numel():
                sums["ratio_sum"] += r_sel.sum().item()
                rmin, rmax = min(rmin, r_sel.min().item()), max(rmax, r_sel.max().item())
            sums["entropy"] += (out["entropy"].detach() * m).sum().item()
            ntok += m.sum().item()
        keys = list(sums)
        tot = self._all_reduce([sums[k] for k in keys] + [ntok])
        sums, ntok = dict(zip(keys, tot[:-1])), tot[-1]
        rmin = self._all_reduce([rmin], "min")[0]
        rmax = self._all_reduce([rmax], "max")[0]
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
        """``root/checkpoint-<phase>/``: weights (safetensors), the trainer state without any pickle
        (:func:`save_trainer_state`: optimizer tensors in ``trainer_state.safetensors``, counters, metrics,
        clipper state and RNG states in ``trainer_state.json``) and ``progress.json``; written atomically
        by the main process only, so an interrupted save never shadows the previous one."""
        from llmtool.core.checkpoint import atomic_output

        target = root / f"checkpoint-{self.phase}"
        if self.is_main:
            root.mkdir(parents=True, exist_ok=True)
            with atomic_output(target, overwrite=True) as tmp:
                self.acc.unwrap_model(self.model).save_pretrained(tmp, safe_serialization=True)
                save_trainer_state(tmp, {"optimizer": self.optimizer.state_dict(), "phase": self.phase,
                                         "step": self.step, "history": self.history,
                                         "clipper": self.clipper.state_dict() if self.clipper is not None else None,
                                         "rng": rng_state()})
                (tmp / "progress.json").write_text(json.dumps({"phase": self.phase, "step": self.step,
                                                               "config": getattr(self, "config_record", None) or {}},
                                                              default=str))
        self.acc.wait_for_everyone()
        return target

    def load_checkpoint(self, path: Path) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint` after :func:`check_resume_dir`'s checks
        (no pickle is ever read: model and optimizer tensors come from safetensors, the rest from JSON)."""
        from safetensors.torch import load_file

        from llmtool.core.checkpoint import weight_files
        from llmtool.core.models import check_finite

        check_resume_dir(path)
        model = self.acc.unwrap_model(self.model)
        state = {}
        for f in weight_files(path):
            state.update(load_file(str(f)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        bad = [k for k in missing if "lm_head" not in k] + list(unexpected)
        if bad:
            from llmtool.core.console import UsageError

            raise UsageError(f"{path}: checkpoint does not match the model ({bad[:3]} ...)")
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
        check_finite(model, path)
        ts = load_trainer_state(path)
        self.optimizer.load_state_dict(ts["optimizer"])
        if self.clipper is not None and ts.get("clipper") is not None:
            self.clipper.load_state_dict(ts["clipper"])
        if ts.get("rng"):
            set_rng_state(ts["rng"])
        self.phase, self.step, self.history = int(ts["phase"]), int(ts["step"]), list(ts["history"])

    # ------------------------------------------------------------------ run
    def train(self, progress_desc: str | None = "grpo") -> list[dict]:
        from llmtool.core.console import info, progress

        s = self.s
        if self.on_policy_only and self.phase == 0 and self.is_main:
            info(f"grpo: {s.prompts_per_rollout}×{s.group_size} rollouts with mini-batch {s.mini_batch} give one "
                 "update per phase: rho == 1 and clipping cannot bind (the on-policy ablation)")
        remaining = range(self.phase, s.steps)
        show = progress_desc and self.is_main
        it = progress(remaining, progress_desc, total=len(remaining)) if show else remaining
        for _ in it:
            recs = self.run_phase()
            self.history.extend(recs)
            if self.metrics_path is not None and self.is_main:
                with open(self.metrics_path, "a") as fh:
                    for r in recs:
                        fh.write(json.dumps(r) + "\n")
            if self.on_step and self.is_main:
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


# ------------------------------------------------------------------------------------ resume state (no pickle)
STATE_FORMAT = "llmtool-grpo-trainer-state/1"
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.safetensors"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


def _encode(obj, key: str, tensors: dict):
    """JSON-able form of a nested state: tensors go to ``tensors[key]`` (referenced by name), dict keys
    keep their type (optimizer states are keyed by int), tuples stay tuples."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            raise TypeError(f"{key}: only str/int dict keys can be saved")
        return {"__dict__": [[k, _encode(v, f"{key}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{key}: cannot save a {type(obj).__name__} without pickle")


def _decode(obj, tensors: dict):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: _decode(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def save_trainer_state(path: Path, state: dict) -> None:
    """Write ``state`` (nested dicts/lists/tuples of tensors and scalars) as ``trainer_state.safetensors``
    (every tensor, named by its path in the state) + ``trainer_state.json`` (the structure)."""
    from safetensors.torch import save_file

    tensors: dict = {}
    body = _encode(state, "state", tensors)
    save_file(tensors, str(Path(path) / STATE_TENSORS), metadata={"format": STATE_FORMAT})
    (Path(path) / STATE_JSON).write_text(json.dumps({"format": STATE_FORMAT, "state": body}))


def load_trainer_state(path: Path) -> dict:
    """Read :func:`save_trainer_state`'s files (safetensors + JSON; never pickle)."""
    from safetensors.torch import load_file

    from llmtool.core.console import UsageError

    f = Path(path) / STATE_JSON
    try:
        doc = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UsageError(f"{f}: not a readable trainer state ({type(e).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
        raise UsageError(f"{f}: not a trainer state of this llmtool (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    tensors = load_file(str(Path(path) / STATE_TENSORS))
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UsageError(f"{Path(path) / STATE_TENSORS}: tensor {name!r} has NaN/inf values (a corrupt or "
                             "diverged trainer state)")
    try:
        state = _decode(doc["state"], tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{f}: malformed trainer state ({e})") from None
    if not isinstance(state, dict) or not {"optimizer", "phase", "step", "history"} <= set(state):
        raise UsageError(f"{f}: malformed trainer state (missing optimizer/phase/step/history)")
    return state


def rng_state() -> dict:
    """Python, numpy and torch (CPU and CUDA) generator states as tensors and plain lists."""
    import random

    st: dict = {"torch": torch.get_rng_state()}
    v, internal, gauss = random.getstate()
    st["python"] = [v, list(internal), gauss]
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        st["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if torch.cuda.is_available():
        st["cuda"] = list(torch.cuda.get_rng_state_all())
    return st


def set_rng_state(st: dict) -> None:
    import random

    if "torch" in st:
        torch.set_rng_state(st["torch"].to(torch.uint8))
    if "python" in st:
        v, internal, gauss = st["python"]
        random.setstate((v, tuple(int(x) for x in internal), gauss))
    if "numpy" in st:
        import numpy as np

        name, keys, pos, has_gauss, cached = st["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), int(pos), int(has_gauss), float(cached)))
    if "cuda" in st and torch.cuda.is_available() and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([t.to(torch.uint8) for t in st["cuda"]])


def check_resume_dir(path: Path) -> None:
    """The checks a MODEL argument gets (causal LM config, no remote code, safetensors headers that fit
    their files, pickle-only weights refused), plus: no pickle file anywhere in the checkpoint (an older
    llmtool's ``trainer_state.pt`` or a planted one is refused, never opened), and a trainer state in
    safetensors + JSON whose tensor header is sane. Raises :class:`UsageError` (exit 2)."""
    from llmtool.core.checkpoint import check_safetensors
    from llmtool.core.console import UsageError
    from llmtool.core.preflight import checked_model

    path = Path(path)
    pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise UsageError(f"{path}: checkpoint holds a pickle file ({pickles[0]}); llmtool never unpickles (a pickle "
                         "can run code): resume only from checkpoints of this llmtool (trainer_state.json + "
                         ".safetensors), or remove the directory")
    checked_model(path)
    for name in (STATE_JSON, STATE_TENSORS):
        if not (path / name).is_file():
            raise UsageError(f"{path}: incomplete checkpoint (no {name})")
    check_safetensors(path / STATE_TENSORS)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint with the highest phase under ``root`` (temp dirs of killed saves ignored). A directory
    that holds a trainer state in either format counts, so that a pickle one is refused by
    :func:`check_resume_dir` rather than silently skipped."""
    if not root.is_dir():
        return None
    best = None
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("checkpoint-") and p.name[11:].isdigit() \
                and ((p / STATE_JSON).is_file() or (p / "trainer_state.pt").is_file()):
            if best is None or int(p.name[11:]) > int(best.name[11:]):
                best = p
    return best
