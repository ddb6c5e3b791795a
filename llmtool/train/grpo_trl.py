"""`train grpo --engine trl`: the same GRPO run through TRL's ``GRPOTrainer`` (the scale path).

Why a second engine: the home loop (:mod:`llmtool.train.grpo`) samples with ``model.generate`` or a generic
OpenAI-compatible server that never receives the updated weights. TRL's ``GRPOTrainer`` generates with vLLM
in *server* mode (``trl vllm-serve`` on separate GPUs; the trainer pushes the weights over NCCL after every
optimizer step) or *colocate* mode (vLLM inside each training process, weights loaded in place), so the
rollouts always come from the current policy; on a CPU it falls back to ``model.generate``. The home loop
stays the reference: on a fixed batch both engines give the same loss and gradients (tests).

What is mapped (llmtool → TRL ``GRPOConfig``):

| llmtool | TRL |
|---|---|
| ``--group-size G`` | ``num_generations`` |
| ``--prompts-per-rollout P`` (per process) | a generation batch of ``P·G·world`` rollouts (``steps_per_generation·m·world``) |
| ``--mini-batch M``, ``--micro-batch m`` | ``per_device_train_batch_size = m``, ``gradient_accumulation_steps = M/m``, ``steps_per_generation = P·G/m`` (so a rollout phase gives ``P·G/M`` optimizer steps, as at home) |
| ``--steps`` (phases) | ``max_steps = steps × updates per phase`` |
| ``--loss clip`` | the PPO clip of every TRL loss type, ``epsilon``/``epsilon_high`` = ``--clip-eps``/``--clip-eps-high`` |
| ``--loss ratio`` | the same with ``epsilon = epsilon_high = inf`` (the clamp never binds: ``min(ρÂ, ρÂ) = ρÂ``) |
| ``--loss-agg seq-mean`` / ``token-mean`` / ``seq-sum-norm`` | ``loss_type`` ``grpo`` / ``dapo`` / ``dr_grpo`` |
| ``--kl-coef`` | ``beta`` (TRL's k3 estimator, the home loop's), ``use_bias_correction_kl=False`` (TRL 1.16 multiplies the KL term by ρ by default; the home loop does not) |
| ``--lr``, ``--max-grad-norm``, ``--temperature``, ``--top-p``, ``--max-new-tokens``, ``--seed`` | ``learning_rate`` (constant, AdamW), ``max_grad_norm``, ``temperature``, ``top_p``, ``max_completion_length``, ``seed`` |
| ``--reward`` (every family, spurious ones included) | a TRL reward function calling the same :class:`~llmtool.train.rewards.RewardConfig`; a random reward is keyed by (seed, phase, prompt position over all processes, rollout) as at home |
| ``--marker`` | a second reward function with weight 0 (logged as ``rewards/marker/mean``, no effect on the advantage) |
| log-probs | TRL's ``_get_per_token_logps_and_entropies`` is replaced by llmtool's chunked selective log-softmax (:func:`~llmtool.train.grpo.sequence_logps`, temperature-scaled): the two engines score tokens identically |

Refused with one ``error:`` line (no TRL equivalent): ``--loss pi`` (TRL's cispo is ``clip(ρ)·Â·log π``, not
``π·Â``), ``--advantage-shaping setpo|dra`` (no hook for per-group advantage shaping), ``--entropy-coef > 0``
(TRL's bonus is a per-micro-batch token mean, not aggregated like the loss), ``--grad-clip`` other than
``global``, ``--rollout-endpoint`` (use ``--vllm server``), ``--save-every``/``--resume`` (the Trainer's
checkpoints are pickles, which llmtool never loads), ``--mini-batch`` not a multiple of ``--micro-batch`` or
phase rollouts not a multiple of ``--micro-batch``. Known difference kept: TRL's advantage divides by
``std + 1e-4`` (home: ``std + 1e-9``), so the two differ by at most 1e-4 relative on a group's advantages.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from llmtool.core.console import UsageError

LOSS_AGG_TO_TRL = {"seq-mean": "grpo", "token-mean": "dapo", "seq-sum-norm": "dr_grpo"}
VLLM_MODES = ("none", "server", "colocate")


def check_mappable(settings, *, shaping: str = "grpo", rollout_endpoint: str | None = None,
                   save_every: int = 0, resume: bool = False) -> None:
    """Refuse, with a precise line, what TRL's GRPOTrainer cannot run like the home loop."""
    s = settings
    if s.loss_type == "pi":
        raise UsageError("--engine trl cannot run --loss pi: TRL has no pi*A surrogate (its cispo loss is "
                         "clip(rho)*A*log pi); use --engine home")
    if shaping != "grpo":
        raise UsageError(f"--engine trl cannot run --advantage-shaping {shaping}: TRL's GRPOTrainer has no hook for "
                         "per-group advantage shaping; use --engine home")
    if s.entropy_coef > 0:
        raise UsageError("--engine trl cannot run --entropy-coef > 0 like the home loop: TRL's entropy bonus is a "
                         "per-micro-batch token mean, not aggregated by --loss-agg; use --engine home")
    if s.grad_clip != "global":
        raise UsageError(f"--engine trl supports only --grad-clip global (--max-grad-norm), not {s.grad_clip!r}; "
                         "use --engine home")
    if rollout_endpoint:
        raise UsageError("--engine trl does not take --rollout-endpoint: use --vllm server --vllm-server-url URL "
                         "(a `trl vllm-serve` server, which receives the weights after every update) or "
                         "--vllm colocate")
    if save_every or resume:
        raise UsageError("--engine trl does not checkpoint or resume: the Trainer's checkpoints are pickles, which "
                         "llmtool never loads; use --engine home for --save-every/--resume")
    if s.mini_batch % s.micro_batch:
        raise UsageError(f"--engine trl needs --mini-batch ({s.mini_batch}) to be a multiple of --micro-batch "
                         f"({s.micro_batch}) (gradient accumulation steps)")
    n = s.prompts_per_rollout * s.group_size
    if n % s.micro_batch or n % s.mini_batch:
        raise UsageError(f"--engine trl needs the phase's rollouts ({s.prompts_per_rollout}x{s.group_size}={n}) to "
                         f"be a multiple of --mini-batch ({s.mini_batch}) and --micro-batch ({s.micro_batch})")


def grpo_config_kwargs(settings, *, output_dir: str, world: int = 1, vllm: str = "none",
                       vllm_server_url: str | None = None, use_cpu: bool = True) -> dict:
    """``GRPOConfig`` keyword arguments equivalent to ``settings`` (see the module table)."""
    from llmtool.train.grpo import updates_per_phase

    s = settings
    n = s.prompts_per_rollout * s.group_size
    ratio = s.loss_type == "ratio"
    kw = dict(output_dir=output_dir, num_generations=s.group_size,
              per_device_train_batch_size=s.micro_batch, gradient_accumulation_steps=s.mini_batch // s.micro_batch,
              steps_per_generation=n // s.micro_batch, num_iterations=1,
              max_steps=s.steps * updates_per_phase(n, s.mini_batch), learning_rate=s.lr,
              lr_scheduler_type="constant", warmup_steps=0, weight_decay=s.weight_decay,
              max_grad_norm=s.max_grad_norm, loss_type=LOSS_AGG_TO_TRL[s.loss_agg],
              epsilon=math.inf if ratio else s.clip_eps,
              epsilon_high=math.inf if ratio else (s.clip_eps if s.clip_eps_high is None else s.clip_eps_high),
              beta=s.kl_coef, use_bias_correction_kl=False, temperature=s.temperature, top_p=s.top_p,
              max_completion_length=s.max_new_tokens,
              scale_rewards="group", seed=s.seed, data_seed=s.seed, report_to=[], logging_steps=1,
              save_strategy="no", use_cpu=use_cpu, disable_dropout=True, shuffle_dataset=True,
              bf16=False, fp16=False,  # no autocast: the model's own --dtype, as at home
              remove_unused_columns=False, log_completions=False)
    if vllm != "none":
        kw.update(use_vllm=True, vllm_mode=vllm)
        if vllm == "server" and vllm_server_url:
            kw["vllm_server_base_url"] = vllm_server_url
    return kw


class TRLReward:
    """A TRL reward function over an llmtool reward config: the same ``score(row, text, finish, key)`` with
    ``key = (seed, phase, prompt position over all processes, rollout)``."""

    def __init__(self, cfg, seed: int, group_size: int, updates: int, max_new_tokens: int, name: str):
        self.cfg, self.seed, self.G, self.updates, self.max_new = cfg, seed, group_size, updates, max_new_tokens
        self.__name__ = name

    def __call__(self, prompts, completions, completion_ids=None, trainer_state=None, llmtool_row=None, **_):
        import torch.distributed as dist

        phase = (trainer_state.global_step // self.updates) if trainer_state is not None else 0
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        local_prompts = len(completions) // self.G
        out = []
        for i, comp in enumerate(completions):
            row = json.loads(llmtool_row[i])
            text = comp if isinstance(comp, str) else (comp[-1].get("content") or "")
            ids = completion_ids[i] if completion_ids is not None else []
            finish = "length" if len(ids) >= self.max_new else "stop"
            q, j = rank * local_prompts + i // self.G, i % self.G
            out.append(float(self.cfg.score(row, text, finish, (self.seed, phase, q, j))))
        return out


class MarkerRate:
    """Weight-0 reward: 1 when the marker substring is in the completion (the behaviour tracker)."""

    def __init__(self, marker: str):
        self.marker = marker.lower()
        self.__name__ = "marker"

    def __call__(self, prompts, completions, **_):
        return [float(self.marker in (c if isinstance(c, str) else (c[-1].get("content") or "")).lower())
                for c in completions]


def make_trainer_class():
    """``GRPOTrainer`` whose per-token log-probs and entropies are llmtool's (chunked selective log-softmax
    at the sampling temperature), so the two engines score tokens identically."""
    import trl

    from llmtool.train.grpo import sequence_logps

    class LlmtoolGRPOTrainer(trl.GRPOTrainer):
        logp_chunk: int | None = None

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **multimodal):
            import torch

            if any(v is not None for v in multimodal.values()):
                raise ValueError("llmtool's TRL engine is text-only")
            bs = batch_size or input_ids.size(0)
            lps, ents = [], []
            for s in range(0, input_ids.size(0), bs):
                out = sequence_logps(model, input_ids[s:s + bs], attention_mask[s:s + bs], self.temperature,
                                     with_entropy=compute_entropy, chunk=self.logp_chunk)
                lps.append(out["logp"][:, -logits_to_keep:])
                if compute_entropy:
                    ents.append(out["entropy"][:, -logits_to_keep:])
            return torch.cat(lps), (torch.cat(ents) if compute_entropy else None), None

    return LlmtoolGRPOTrainer


def build_trainer(model, tokenizer, rows: Sequence[dict], settings, reward_cfg, *, output_dir: str,
                  vllm: str = "none", vllm_server_url: str | None = None, callbacks: Sequence = ()):
    """A ready ``GRPOTrainer`` equivalent to the home loop's settings (after :func:`check_mappable`)."""
    import torch
    import trl
    from accelerate import PartialState
    from datasets import Dataset

    from llmtool.core.lm import chat_prompt
    from llmtool.train.grpo import updates_per_phase

    s = settings
    world = PartialState().num_processes
    kw = grpo_config_kwargs(s, output_dir=output_dir, world=world, vllm=vllm, vllm_server_url=vllm_server_url,
                            use_cpu=not torch.cuda.is_available())
    funcs, weights = [TRLReward(reward_cfg, s.seed, s.group_size, updates_per_phase(
        s.prompts_per_rollout * s.group_size, s.mini_batch), s.max_new_tokens, f"reward_{reward_cfg.name}")], [1.0]
    if s.marker:
        funcs.append(MarkerRate(s.marker))
        weights.append(0.0)
    kw["reward_weights"] = weights
    args = trl.GRPOConfig(**kw)
    data = Dataset.from_list([{"prompt": chat_prompt(tokenizer, r["prompt"], system=s.system_prompt),
                               "llmtool_row": json.dumps(r, default=str)} for r in rows])
    cls = make_trainer_class()
    trainer = cls(model=model, reward_funcs=funcs, args=args, train_dataset=data, processing_class=tokenizer,
                  callbacks=list(callbacks))
    trainer.logp_chunk = s.logp_chunk
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for cb in (PrinterCallback, ProgressCallback):  # they print raw log dicts on stdout (--json must stay clean)
        trainer.remove_callback(cb)
    return trainer


class MetricsWriter:
    """A ``TrainerCallback`` that appends each optimizer step's TRL log to ``metrics.jsonl`` (main process),
    renamed to the home loop's keys where they mean the same."""

    RENAME = {"reward": "reward_mean", "clip_ratio/region_mean": "clip_frac", "clip_ratio/low_mean": "clip_frac_low",
              "clip_ratio/high_mean": "clip_frac_high", "entropy": "entropy", "kl": "kl", "loss": "loss",
              "grad_norm": "grad_norm", "completions/mean_length": "response_len",
              "rewards/marker/mean": "marker_freq", "frac_reward_zero_std": "zero_std_groups"}

    def __init__(self, path: Path | None, updates: int):
        from transformers import TrainerCallback

        self.path, self.updates, self.records = path, updates, []
        writer = self

        class CB(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                if not logs or "train_runtime" in logs:
                    return
                rec = {"step": state.global_step, "phase": (state.global_step - 1) // writer.updates,
                       "update_in_phase": (state.global_step - 1) % writer.updates, "engine": "trl"}
                for k, v in logs.items():
                    rec[writer.RENAME.get(k, k)] = v
                writer.records.append(rec)
                if state.is_world_process_zero and rec["update_in_phase"] == 0 and "reward_mean" in rec:
                    from llmtool.core.console import info

                    info(f"grpo (trl) phase {rec['phase'] + 1}: reward {rec['reward_mean']:.3f} "
                         f"clip {rec.get('clip_frac', 0.0):.3f}")
                if writer.path is not None and state.is_world_process_zero:
                    with open(writer.path, "a") as fh:
                        fh.write(json.dumps(rec, default=float) + "\n")

        self.callback = CB()
