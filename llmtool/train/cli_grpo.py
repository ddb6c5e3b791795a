"""`llmtool train grpo|eval-passk|rl-data|label-majority`: RLVR with GRPO (spurious rewards, clipping
ablations, SetPO diversity shaping) and its evaluation. Torch/transformers are imported inside the
commands so `llmtool --help` stays fast."""


import contextlib
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtool.core.options import ModelArg, OutDirArg, Overwrite
from llmtool.core.registry import MethodConfig, method_options
from llmtool.train.diversity import SHAPERS

app = typer.Typer()

DataOpt = Annotated[str, typer.Option("--data", help="Training rows: a JSONL file ({prompt, answer, ...}) or "
                                      "gen:<task>:<n>[:<seed>] with task arith, mul, sum-two or rg:<name>.")]


def _reward_help() -> str:
    from llmtool.train.rewards import REWARDS

    return "Reward NAME[:ARG]: " + "; ".join(f"{n} ({REWARDS.get(n).help})" for n in REWARDS.names())


@app.command("grpo")
@method_options(SHAPERS, default="grpo", method_flag="--advantage-shaping", param="shaping")
def grpo(
    model: ModelArg,
    out: OutDirArg,
    data: DataOpt,
    reward: Annotated[str, typer.Option("--reward", help="Reward NAME[:ARG]: ground-truth, majority-vote, "
                                        "format[:substring], random[:gamma], incorrect, one-shot[:row].")] = "ground-truth",
    steps: Annotated[int, typer.Option("--steps", help="Rollout phases.")] = 8,
    group_size: Annotated[int, typer.Option("--group-size", help="Rollouts per prompt (G >= 2).")] = 8,
    prompts_per_rollout: Annotated[int, typer.Option("--prompts-per-rollout", help="Prompts per rollout phase.")] = 8,
    mini_batch: Annotated[int, typer.Option("--mini-batch", help="Rollouts per optimizer step (phase rollouts / "
                                            "mini-batch = updates per phase; 1 update = on-policy).")] = 32,
    micro_batch: Annotated[int, typer.Option("--micro-batch", help="Rollouts per forward/backward.")] = 8,
    lr: Annotated[float, typer.Option("--lr", help="AdamW learning rate (constant).")] = 1e-6,
    loss: Annotated[str, typer.Option("--loss", help="clip (PPO/GRPO), ratio (ratio without clamp) or pi "
                                      "(official no-clip loss -pi*A).")] = "clip",
    no_clip: Annotated[bool, typer.Option("--no-clip", help="Same as --loss ratio.")] = False,
    clip_eps: Annotated[float, typer.Option("--clip-eps", help="Clip epsilon (low side).")] = 0.2,
    clip_eps_high: Annotated[Optional[float], typer.Option("--clip-eps-high", help="Upper clip epsilon "
                                                           "(default: --clip-eps; 0.28 = clip-higher).")] = None,
    loss_agg: Annotated[str, typer.Option("--loss-agg", help="seq-mean, token-mean or seq-sum-norm.")] = "seq-mean",
    kl_coef: Annotated[float, typer.Option("--kl-coef", help="KL-to-reference weight beta (0 = no reference).")] = 0.0,
    entropy_coef: Annotated[float, typer.Option("--entropy-coef", help="Token-entropy bonus weight.")] = 0.0,
    max_grad_norm: Annotated[float, typer.Option("--max-grad-norm", help="Global gradient clipping (0 = off).")] = 1.0,
    grad_clip: Annotated[str, typer.Option("--grad-clip", help="Gradient-clipping policy: global (--max-grad-norm), "
                                           "adagc, zclip, local-fixed or none, with the defaults of "
                                           "`train pretrain --clip` (--clip here is the PPO ratio clip).")] = "global",
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature.")] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Response length limit.")] = 64,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Generation batch (sequences).")] = 64,
    marker: Annotated[str, typer.Option("--marker", help="Behaviour tracker: substring counted per rollout "
                                        "(case-insensitive).")] = "=",
    system_prompt: Annotated[Optional[str], typer.Option("--system-prompt", help="System turn for every prompt.")] = None,
    save_every: Annotated[int, typer.Option("--save-every", help="Checkpoint every N phases (0 = none).")] = 0,
    checkpoint_dir: Annotated[Optional[Path], typer.Option("--checkpoint-dir", help="Where checkpoints live "
                                                           "(default: OUT.checkpoints beside OUT).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint.")] = False,
    keep_checkpoints: Annotated[bool, typer.Option("--keep-checkpoints", help="Keep the checkpoint directory "
                                                   "after a successful run.")] = False,
    rollout_endpoint: Annotated[Optional[str], typer.Option("--rollout-endpoint", help="OpenAI-compatible server "
                                                            "(e.g. vLLM) for rollouts instead of local sampling.")] = None,
    rollout_model: Annotated[Optional[str], typer.Option("--rollout-model", help="Model name on the endpoint.")] = None,
    allow_stale_rollouts: Annotated[bool, typer.Option("--allow-stale-rollouts", help="With --rollout-endpoint and "
                                                       "--steps > 1: train on rollouts of the server's fixed "
                                                       "(initial) weights on purpose; recorded per step.")] = False,
    logp_chunk: Annotated[Optional[int], typer.Option("--logp-chunk", help="Sequence positions per chunk of the "
                                                      "selective log-softmax (default: auto, ~64 MB of fp32 "
                                                      "logits; 0 = full-vocabulary reference).")] = None,
    engine: Annotated[str, typer.Option("--engine", help="home (llmtool's loop, the reference) or trl (TRL's "
                                        "GRPOTrainer: vLLM with weight sync on GPUs, model.generate on CPU).")] = "home",
    vllm: Annotated[str, typer.Option("--vllm", help="--engine trl: none (model.generate), server (a `trl "
                                      "vllm-serve` server) or colocate (vLLM inside each process).")] = "none",
    vllm_server_url: Annotated[Optional[str], typer.Option("--vllm-server-url", help="--vllm server: the server's "
                                                           "base URL (default http://localhost:8000).")] = None,
    overwrite: Overwrite = False,
    shaping: MethodConfig = None,  # type: ignore[assignment]
) -> None:
    """GRPO (RLVR) on MODEL with a verifier or spurious reward; writes the trained model, metrics.jsonl
    (one line per optimizer step) and llmtool.json to OUT."""
    from llmtool.core.preflight import preflight

    preflight(model, out, inputs=(None if data.startswith("gen:") else data,),  # fail fast, before torch
              overwrite=overwrite)
    from llmtool.train.grpo_choices import check_loss_choices

    check_loss_choices("ratio" if no_clip and loss == "clip" else loss, loss_agg)
    import shutil

    from llmtool.core.console import OPTIONS, UsageError, emit, info
    from llmtool.core.job import job
    from llmtool.train import rl_data
    from llmtool.train.grpo import GRPOSettings, GRPOTrainerLoop, check_resume_dir, latest_checkpoint
    from llmtool.train.rewards import make_reward_fn, parse_reward

    rcfg = parse_reward(reward)
    if no_clip:
        if loss not in ("clip", "ratio"):
            raise UsageError("--no-clip conflicts with --loss " + loss)
        loss = "ratio"
    settings = GRPOSettings(steps=steps, group_size=group_size, prompts_per_rollout=prompts_per_rollout,
                            mini_batch=mini_batch, micro_batch=micro_batch, lr=lr, max_grad_norm=max_grad_norm, grad_clip=grad_clip,
                            loss_type=loss, clip_eps=clip_eps, clip_eps_high=clip_eps_high, loss_agg=loss_agg,
                            kl_coef=kl_coef, entropy_coef=entropy_coef, temperature=temperature, top_p=top_p,
                            max_new_tokens=max_new_tokens, gen_batch_size=batch_size, seed=OPTIONS.seed,
                            save_every=save_every, marker=marker, system_prompt=system_prompt,
                            logp_chunk=logp_chunk)
    settings.validate()
    if rollout_endpoint and not rollout_model:
        raise UsageError("--rollout-endpoint needs --rollout-model (the model name on the server)")
    if engine not in ("home", "trl"):
        raise UsageError(f"--engine {engine!r}: choose home or trl")
    from llmtool.train.grpo_trl import VLLM_MODES, check_mappable

    if vllm not in VLLM_MODES:
        raise UsageError(f"--vllm {vllm!r}: choose one of {', '.join(VLLM_MODES)}")
    if engine == "home" and (vllm != "none" or vllm_server_url):
        raise UsageError("--vllm/--vllm-server-url apply only with --engine trl (the home loop samples locally "
                         "or from --rollout-endpoint)")
    if vllm_server_url and vllm != "server":
        raise UsageError("--vllm-server-url needs --vllm server")
    if engine == "trl":
        check_mappable(settings, shaping=shaping.name, rollout_endpoint=rollout_endpoint, save_every=save_every,
                       resume=resume)
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            raise UsageError("--engine trl: TRL is not installed (pip install trl)")
        if vllm != "none" and importlib.util.find_spec("vllm") is None:
            raise UsageError(f"--vllm {vllm}: vLLM is not installed here (GPU machines: pip install vllm; server "
                             "mode also needs `trl vllm-serve --model MODEL` running)")
    if allow_stale_rollouts and not rollout_endpoint:
        raise UsageError("--allow-stale-rollouts applies only with --rollout-endpoint")
    if rollout_endpoint and steps > 1 and not allow_stale_rollouts:
        raise UsageError(f"--rollout-endpoint with --steps {steps}: an OpenAI-compatible server cannot receive the "
                         "updated weights, so every phase after the first would sample from the initial policy "
                         "(stale rollouts, no correction); use --engine trl with vLLM (server or colocate mode "
                         "syncs the weights after every update), --steps 1, or --allow-stale-rollouts to train "
                         "on stale rollouts on purpose (recorded per step)")
    rows = rcfg.prepare_rows(rl_data.load_rows(data, need_answer=rcfg.needs_answer))
    ckpt_root = checkpoint_dir or out.with_name(out.name + ".checkpoints")
    start = latest_checkpoint(ckpt_root) if resume else None
    if resume and start is None:
        raise UsageError(f"--resume: no complete checkpoint under {ckpt_root}")
    if start is not None:
        check_resume_dir(start)  # the checks a MODEL argument gets; a pickle file is refused, never opened
    import torch
    from accelerate import PartialState

    dist = PartialState(cpu=not torch.cuda.is_available())  # torchrun / accelerate launch: one per process
    config = {"method": "grpo", "reward": rcfg.as_dict(), "shaping": shaping.as_dict(),
              **{k: v for k, v in vars(settings).items()}, "data": str(data),
              "rollout_endpoint": rollout_endpoint, "rollout_model": rollout_model, "engine": engine,
              "processes": dist.num_processes}  # data order and mini-batches depend on it: --resume checks it
    if engine == "trl":
        config["vllm"] = vllm
    if rollout_endpoint:
        config["rollout_weights"] = ("server's own, never synced: phases after the first are stale"
                                     if steps > 1 else "server's own (one phase: the initial policy)")
    if start is not None:
        try:
            saved = json.loads((start / "progress.json").read_text()).get("config", {})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            raise UsageError(f"{start}/progress.json: missing or not a JSON object") from None
        diff = [k for k in saved if k not in ("steps", "save_every") and saved.get(k) != config.get(k)]
        if diff:
            raise UsageError(f"--resume: the checkpoint {start} was made with different settings ({', '.join(diff)})")
    main = dist.is_main_process
    if rollout_endpoint and steps > 1 and main:
        info(f"warning: --allow-stale-rollouts: phases 2..{steps} sample from the server's initial weights "
             "(recorded as rollout_policy_lag in metrics.jsonl)")
    from llmtool.core import eta_plans as plans

    shape = plans.Shape.of(model)
    done = int(start.name[11:]) if start is not None else 0  # phases a resumed run skips
    plans.announce(plans.grpo(shape, max(0, steps - done), prompts_per_rollout, group_size, max_new_tokens, batch_size,
                              kl_coef > 0 or getattr(shaping, "needs_ref", False),
                              plans.prompt_tokens(rows, system_prompt), bool(rollout_endpoint)), shape, "train grpo")
    with (job("train grpo", out=out, overwrite=overwrite, config=config, model=model) if main
          else _worker_job("train grpo", out, model, config)) as j:
        import copy

        policy = j.model
        tok = j.tokenizer
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        ref = None
        if engine == "home" and (kl_coef > 0 or getattr(shaping, "needs_ref", False)):
            ref = copy.deepcopy(policy).eval()  # (TRL builds its own reference)
        policy.train()
        if engine == "trl":
            summary = _run_trl(j, policy, tok, rows, settings, rcfg, vllm, vllm_server_url, main)
        else:
            rollout_fn = _endpoint_rollouts(rollout_endpoint, rollout_model, tok) if rollout_endpoint else None
            metrics = j.dir / "metrics.jsonl"

            def on_step(rec: dict) -> None:
                info(f"grpo phase {rec['phase'] + 1}/{steps}: reward {rec.get('reward_mean', 0):.3f} "
                     f"clip {rec.get('clip_frac', 0):.3f} marker {rec.get('marker_freq', float('nan')):.2f} "
                     f"{rec.get('phase_seconds', 0):.1f} s")

            loop = GRPOTrainerLoop(policy, tok, rows, settings, make_reward_fn(rcfg, settings.seed), shaper=shaping,
                                   ref_model=ref, rollout_fn=rollout_fn, metrics_path=metrics,
                                   checkpoint_dir=ckpt_root if save_every else None, on_step=on_step)
            loop.config_record = config  # stored in checkpoints for --resume checks
            if rollout_endpoint:
                loop.stale_rollouts = True  # each record says how many phases the server's weights lag behind
            if start is not None:
                loop.load_checkpoint(start)
                if main:
                    with open(metrics, "w") as fh:
                        for r in loop.history:
                            fh.write(json.dumps(r) + "\n")
                    info(f"grpo: resumed from {start} (phase {loop.phase})")
            torch.manual_seed(settings.seed)
            hist = loop.train()
            firsts = [h for h in hist if h.get("update_in_phase") == 0]
            summary = {
                "phases": loop.phase, "optimizer_steps": loop.step, "updates_per_phase": loop.n_updates,
                "processes": loop.world,
                "reward_first": firsts[0]["reward_mean"] if firsts else None,
                "reward_last": firsts[-1]["reward_mean"] if firsts else None,
                "clip_frac_mean": sum(h["clip_frac"] for h in hist) / max(len(hist), 1),
                "marker_first": firsts[0].get("marker_freq") if firsts else None,
                "marker_last": firsts[-1].get("marker_freq") if firsts else None,
                "resumed_from": str(start) if start is not None else None,
            }
            if main:
                final = loop.acc.unwrap_model(loop.model)
                final.save_pretrained(j.dir, safe_serialization=True)
                tok.save_pretrained(j.dir)
                j.report.update(summary)
    dist.wait_for_everyone()  # OUT is complete (renamed by the main process) before any process exits
    if not main:
        return
    if not keep_checkpoints and ckpt_root.is_dir() and save_every:
        shutil.rmtree(ckpt_root, ignore_errors=True)
    emit({"out": str(out), **summary}, title="train grpo")


def _run_trl(j, policy, tok, rows, settings, rcfg, vllm: str, vllm_server_url: str | None, main: bool) -> dict:
    """``--engine trl``: the run through TRL's GRPOTrainer (:mod:`llmtool.train.grpo_trl`); the trained model,
    metrics.jsonl (one line per optimizer step, home-loop key names where they mean the same) and the summary."""
    from llmtool.train.grpo import updates_per_phase
    from llmtool.train.grpo_trl import MetricsWriter, build_trainer

    updates = updates_per_phase(settings.prompts_per_rollout * settings.group_size, settings.mini_batch)
    writer = MetricsWriter(j.dir / "metrics.jsonl" if main else None, updates)
    trainer = build_trainer(policy, tok, rows, settings, rcfg, output_dir=str(j.dir / "trl-scratch"), vllm=vllm,
                            vllm_server_url=vllm_server_url, callbacks=[writer.callback])
    trainer.train()
    hist = writer.records
    firsts = [h for h in hist if h.get("update_in_phase") == 0]
    summary = {"engine": "trl", "vllm": vllm, "phases": settings.steps, "optimizer_steps": trainer.state.global_step,
               "updates_per_phase": updates, "processes": trainer.accelerator.num_processes,
               "reward_first": firsts[0].get("reward_mean") if firsts else None,
               "reward_last": firsts[-1].get("reward_mean") if firsts else None,
               "clip_frac_mean": (sum(h.get("clip_frac", 0.0) for h in hist) / len(hist)) if hist else None}
    if main:
        import shutil

        shutil.rmtree(j.dir / "trl-scratch", ignore_errors=True)
        trainer.accelerator.unwrap_model(trainer.model).save_pretrained(j.dir, safe_serialization=True)
        tok.save_pretrained(j.dir)
        j.report.update(summary)
    return summary


@contextlib.contextmanager
def _worker_job(command: str, out: Path, model: str, config: dict):
    """What a non-main process of a multi-process launch runs instead of :func:`llmtool.core.job.job`:
    the same model checks, seed and thread policy, but a private scratch directory that is discarded:
    only the main process writes OUT, its provenance and checkpoints."""
    import tempfile

    from llmtool.core.job import Job, apply_threads
    from llmtool.core.models import set_seed
    from llmtool.core.preflight import checked_model

    path = checked_model(model)
    set_seed(None)
    apply_threads()
    with tempfile.TemporaryDirectory(prefix="llmtool-rank-") as d:
        yield Job(command=command, dir=Path(d), out=Path(out), model_arg=model, model_path=path, config=config)


def _endpoint_rollouts(api_base: str, model_name: str, tokenizer):
    """Rollouts from an OpenAI-compatible server. Old log-probs are still computed by the training
    model (never the sampler's), so the importance ratio is well defined. A generic server cannot receive
    weights: the command refuses ``--steps > 1`` unless ``--allow-stale-rollouts`` (then every metrics
    record carries ``rollout_policy_lag``, the phases the server's weights are behind); ``--engine trl``
    with vLLM is the weight-synced path."""
    from llmtool.core.endpoint import OpenAIEndpoint
    from llmtool.core.lm import Completion

    ep = OpenAIEndpoint(api_base, model_name)
    ep.check()

    def fn(rows, texts, G, s, seed):
        out = []
        for row in rows:
            msgs = ([{"role": "system", "content": s.system_prompt}] if s.system_prompt else []) + \
                   [{"role": "user", "content": row["prompt"]}]
            replies = ep.chat(msgs, n=G, temperature=s.temperature, max_tokens=s.max_new_tokens)
            group = []
            for rep in replies:
                text = rep.get("content") or ""
                ids = tokenizer(text, add_special_tokens=False)["input_ids"][:s.max_new_tokens]
                group.append(Completion(text=text, token_ids=ids, finish="length" if len(ids) >= s.max_new_tokens
                                        else "stop"))
            out.append(group)
        return out

    return fn


@app.command("eval-passk")
def eval_passk(
    model: ModelArg,
    data: DataOpt,
    n: Annotated[int, typer.Option("--n", help="Samples per problem (>= max k).")] = 16,
    k: Annotated[str, typer.Option("--k", help="Comma-separated k values.")] = "1,2,4,8,16",
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature.")] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Response length limit.")] = 64,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Generation batch (sequences).")] = 64,
    marker: Annotated[str, typer.Option("--marker", help="Behaviour marker to count.")] = "=",
    limit: Annotated[int, typer.Option("--limit", help="Use the first N rows (0 = all).")] = 0,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Write the result JSON here.")] = None,
    overwrite: Overwrite = False,
) -> None:
    """Unbiased pass@k, greedy pass@1, distinct correct answers and answer entropy of MODEL on --data."""
    from llmtool.core.preflight import preflight

    preflight(model, out, inputs=(None if data.startswith("gen:") else data,),  # fail fast, before torch
              overwrite=overwrite)
    from llmtool.core.checkpoint import atomic_file
    from llmtool.core.console import OPTIONS, UsageError, emit
    from llmtool.core.job import apply_threads
    from llmtool.core.models import check_causal_lm, load_model, load_tokenizer, resolve_model, set_seed
    from llmtool.train import passk, rl_data

    try:
        ks = tuple(int(x) for x in k.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--k {k!r}: expected comma-separated integers") from None
    if not ks or min(ks) < 1:
        raise UsageError(f"--k {k!r}: values must be >= 1")
    if n < max(ks):
        raise UsageError(f"--n {n}: the unbiased pass@k estimator needs n >= max k ({max(ks)})")
    if temperature <= 0:
        raise UsageError("--temperature must be > 0 for sampled pass@k (greedy pass@1 is reported as well)")
    if out is not None and out.exists() and not overwrite:
        raise UsageError(f"{out}: already exists (pass --overwrite to replace it)")
    rows = rl_data.load_rows(data)
    if limit:
        rows = rows[:limit]
    path = resolve_model(model)
    check_causal_lm(path)
    set_seed()
    apply_threads()
    m, tok = load_model(path), load_tokenizer(path)
    res = passk.evaluate(m, tok, rows, n=n, ks=ks, temperature=temperature, top_p=top_p,
                         max_new_tokens=max_new_tokens, batch_size=batch_size, seed=OPTIONS.seed, marker=marker,
                         desc="pass@k")
    if out is not None:
        with atomic_file(out, overwrite=True) as tmp:
            Path(tmp).write_text(json.dumps(res, indent=2))
    emit(res["summary"], title="pass@k")


@app.command("rl-data")
def rl_data_cmd(
    task: Annotated[str, typer.Option("--task", help="arith, mul, sum-two or rg:<reasoning-gym name>.")] = "arith",
    n: Annotated[int, typer.Option("--n", help="Number of rows.", min=1)] = 200,
    hard_frac: Annotated[float, typer.Option("--hard-frac", help="arith: share of 2-digit additions; mul: of 2x2-digit products.",
                                             min=0.0, max=1.0)] = 0.4,
    out: Annotated[Path, typer.Option("-o", "--out", help="Output JSONL file.")] = ...,  # type: ignore[assignment]
    overwrite: Overwrite = False,
) -> None:
    """Write deterministic RLVR rows (seeded by the global --seed) as JSONL."""
    from llmtool.core.checkpoint import atomic_file
    from llmtool.core.console import OPTIONS, UsageError, emit
    from llmtool.train import rl_data

    if out.exists() and not overwrite:
        raise UsageError(f"{out}: already exists (pass --overwrite to replace it)")
    rows = rl_data.make_task(task, n, OPTIONS.seed, hard_frac)  # hard_frac is read by arith and mul only
    with atomic_file(out, overwrite=True) as tmp:
        rl_data.write_rows(rows, Path(tmp))
    emit({"out": str(out), "rows": len(rows), "task": task})


@app.command("label-majority")
def label_majority(
    model: ModelArg,
    data: DataOpt,
    samples: Annotated[int, typer.Option("--samples", help="Samples per prompt.", min=1)] = 16,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature.")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Response length limit.")] = 64,
    keep: Annotated[str, typer.Option("--keep", help="all, or incorrect (rows whose majority label is wrong; "
                                      "the label becomes wrong_label for --reward incorrect).")] = "all",
    out: Annotated[Path, typer.Option("-o", "--out", help="Output JSONL file.")] = ...,  # type: ignore[assignment]
    overwrite: Overwrite = False,
) -> None:
    """Add the untrained model's majority answer (mv_label) to each row (for majority-vote/incorrect rewards)."""
    from llmtool.core.console import UsageError
    from llmtool.core.preflight import preflight

    if keep not in ("all", "incorrect"):  # before the model loads
        raise UsageError(f"--keep {keep!r}: choose all or incorrect")
    preflight(model, out, inputs=(None if data.startswith("gen:") else data,),  # fail fast, before torch
              overwrite=overwrite)
    from llmtool.core.checkpoint import atomic_file
    from llmtool.core.console import OPTIONS, emit
    from llmtool.core.lm import chat_prompt, generate
    from llmtool.core.models import check_causal_lm, load_model, load_tokenizer, resolve_model, set_seed
    from llmtool.train import rl_data
    from llmtool.train.rewards import majority_labels

    if out.exists() and not overwrite:
        raise UsageError(f"{out}: already exists (pass --overwrite to replace it)")
    rows = rl_data.load_rows(data)
    path = resolve_model(model)
    check_causal_lm(path)
    set_seed()
    m, tok = load_model(path), load_tokenizer(path)
    comps = generate(m, tok, [chat_prompt(tok, r["prompt"]) for r in rows], n=samples, temperature=temperature,
                     max_new_tokens=max_new_tokens, seed=OPTIONS.seed, desc="label-majority")
    labelled = majority_labels(rows, [[c.text for c in g] for g in comps])
    if keep == "incorrect":
        labelled = [dict(r, wrong_label=r["mv_label"]) for r in labelled if r["mv_label"] is not None and not r["mv_correct"]]
    with atomic_file(out, overwrite=True) as tmp:
        rl_data.write_rows(labelled, Path(tmp))
    emit({"out": str(out), "rows": len(labelled),
          "majority_correct": sum(bool(r.get("mv_correct")) for r in labelled) / max(len(labelled), 1)})
