"""Benchmarks for `llmtool train grpo` (issue 15): clipping bias, spurious rewards, SetPO diversity, cost.

    .venv/bin/python benchmarks/train_grpo.py --parts bandit                      # exact, ~2-5 min
    .venv/bin/python benchmarks/train_grpo.py --parts spurious,diversity,cost \\
        --steps 30 --seeds 3 --group-size 8 --prompts 8 --max-new-tokens 48      # full CPU protocol (hours)

Writes benchmarks/results/train_grpo.json and .md (and train_grpo_bandit.png); ``--tag NAME`` writes
NAME.json/.md and NAME.spurious.runs.jsonl instead. Each part is independent; results of parts not run are
kept from the previous JSON.

The clip-binding protocol of issue 43 (8 off-policy updates per phase, mini-batches of 4 of the phase's 32
rollouts; pilots at lr 1e-5 and 3e-5 are kept in the same runs file and listed in the report)::

    .venv/bin/python benchmarks/train_grpo.py --parts spurious --tag train_grpo_clip \
        --arms random,random+ratio-no-clip,random+on-policy,random+pi-no-ratio --seeds 5 --steps 3 --group-size 8 \
        --prompts 4 --updates 8 --lr 2e-5 --max-new-tokens 48 --test-rows 100 --workers 1 --threads 1

The same arms on Qwen2.5-Coder-0.5B-Instruct (issues 40/43: the paper's random-reward gain is Qwen's), on
2x2- and 3x1-digit multiplication with "python" (code reasoning) as the marker; the last 8 of 24 blocks are
trained so that AdamW's states fit a few GB (pilot at 12 blocks, lr 2e-5: 21 % clip_frac, pass@1 to 0)::

    .venv/bin/python benchmarks/train_grpo.py --parts spurious --tag train_grpo_qwen --model qwen2.5-coder-0.5b \
        --task mul --hard-frac 0.5 --marker python --train-layers 8 --arms random,random+ratio-no-clip,ground-truth \
        --seeds 3 --steps 3 --group-size 8 --prompts 4 --updates 8 --lr 6e-6 --max-new-tokens 64 \
        --test-rows 100 --workers 1 --threads 1

- bandit: the spec's 10-armed bandit over ``--bandit-seeds`` seeds; gates on means (clip ≥ 0.74,
  ratio-no-clip ≤ 0.55, clip − ratio ≥ 0.2, on-policy in [0.55, 0.72]); the official −π·Â loss as well.
- spurious: SmolLM2-135M on generated arithmetic, same prompts/steps/seeds for ground-truth, random,
  format, incorrect, random + ratio-no-clip, random + −π·Â, random on-policy; test greedy pass@1
  before/after with Wilson intervals and the marker frequency per step.
- diversity: GRPO vs SetPO (λ = ``--div-coef``, or one arm per λ as ``setpo@0.3``), GRPO + entropy bonus,
  clip-higher and DRA-GRPO on the sum-two task (N in ``--sum-range``; larger N is the harder variant),
  from a warm start that knows the task's format (``--warmup-steps`` SFT steps; the model as given has no
  reward variance on it): pass@k (k = 1, 2, 4, ... up to n = ``--n-eval`` ≤ 64, T = 0.6, top-p 0.95),
  distinct correct answers per prompt; the warm start first. Runs go to ``TAG.diversity.runs.jsonl``.
- div-pilot: the warm start's pass@k at each of ``--pilot-warmups`` SFT step counts, to choose a start
  where pass@1 leaves GRPO reward variance and pass@k at the largest k does not saturate (issue 43).

The non-saturating SetPO protocol of issue 43 (λ sweep and the built baselines, seed-major so a cut run
leaves whole seeds)::

    .venv/bin/python benchmarks/train_grpo.py --parts div-pilot,diversity --tag train_grpo_div2 \
        --pilot-warmups 40 --sum-range 10,40 --warmup-steps 40 --steps 10 --group-size 8 --prompts 4 \
        --updates 2 --lr 2e-5 --max-new-tokens 16 --test-rows 32 --n-eval 32 --seeds 3 --threads 1 \
        --div-arms grpo,setpo@1.0,setpo@0.3,dra,entropy,setpo@0.1,clip-higher
- cost: rollout tokens/s, optimizer steps/s, generation share of step time, SetPO overhead.

Gates go through ``benchmarks/gates.py`` (met / not met / not tested + reason): the spurious part reports
``clip_frac`` beside every arm, and the clip-vs-no-clip comparison (spec acceptance 10: the marker rises
more with the clip) is ``not tested`` when the clip binds on < 1 % of tokens; a SetPO pass@k direction is
``not tested`` where pass@k saturates (within 0.5 points of 1.0 in both arms).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = ROOT / "benchmarks" / "results"
from benchmarks.gates import gate, lines as gate_lines, render, saturated  # noqa: E402

SATURATED_TOL = 0.005  # pass@k within half a point of 1.0 in both arms counts as saturated
CLIP_BINDS = 0.01  # the clip-vs-no-clip comparison is tested only when the clip binds on >= 1 % of tokens
CLIP_BINDS_MAX = 0.10  # ... and on <= 10 % (issue 43's range; beyond it the updates are far off-policy)


def seed_ci(xs) -> tuple[float, float, float]:
    """Mean and Student-t 95 % interval over a few replicates (seeds): (mean, low, high); nan bounds for n < 2."""
    import numpy as np
    from scipy import stats

    x = np.asarray(xs, dtype=float)
    m = float(x.mean())
    if len(x) < 2:
        return m, float("nan"), float("nan")
    h = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return m, m - h, m + h


def seed_contrast(runs_a: list[dict], runs_b: list[dict], value) -> dict:
    """Arm A minus arm B paired by seed (same seed: same prompts, same random rewards in the first phase):
    mean difference of ``value(run)`` with a t interval over seeds, and how many seeds have A > B."""
    b = {r["seed"]: value(r) for r in runs_b}
    d = [value(r) - b[r["seed"]] for r in runs_a if r["seed"] in b]
    if not d:
        return {"diff": None, "ci95": [None, None], "per_seed": [], "a_higher": "0/0"}
    m, lo, hi = seed_ci(d)
    return {"diff": m, "ci95": [lo, hi], "per_seed": d, "a_higher": f"{sum(x > 0 for x in d)}/{len(d)}"}


def mean_ci(xs, z=1.96):
    import numpy as np

    x = np.asarray(xs, dtype=float)
    m = float(x.mean())
    h = float(z * x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")
    return m, m - h, m + h


def wilson(k, n):
    from llmtool.core.intervals import wilson as wilson_interval

    return wilson_interval(k, n) if n else (float("nan"), float("nan"))


# ------------------------------------------------------------------------------------ bandit
def run_bandit(seeds: int) -> dict:
    from llmtool.train.grpo import toy_bandit

    arms = {"clip": ("clip", 8), "ratio-no-clip": ("ratio", 8), "on-policy": ("clip", 1), "pi-no-ratio": ("pi", 8)}
    out = {}
    curves = {}
    for name, (lt, mb) in arms.items():
        t = time.time()
        r = toy_bandit(lt, seeds=seeds, mini_batches=mb)
        m, lo, hi = mean_ci(r["prior"])
        e, _, _ = mean_ci(r["entropy"])
        import numpy as np

        out[name] = {"mean_prior": m, "ci95": [lo, hi], "median_prior": float(np.median(r["prior"])),
                     "mean_entropy": e, "seconds": time.time() - t, "start_prior": r["start_prior"]}
        curves[name] = r["prior"]
    c, n, o = out["clip"]["mean_prior"], out["ratio-no-clip"]["mean_prior"], out["on-policy"]["mean_prior"]
    out["gates"] = {"clip>=0.74": gate("clip>=0.74", c >= 0.74, round(c, 4)),
                    "ratio<=0.55": gate("ratio<=0.55", n <= 0.55, round(n, 4)),
                    "diff>=0.2": gate("diff>=0.2", c - n >= 0.2, round(c - n, 4)),
                    "on-policy in [0.55,0.72]": gate("on-policy in [0.55,0.72]", 0.55 <= o <= 0.72, round(o, 4))}
    out["seeds"] = seeds
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.boxplot([curves[k] for k in arms], labels=list(arms))
        ax.axhline(out["clip"]["start_prior"], ls="--", c="gray", label="start")
        ax.set_ylabel("final p(prior arm)")
        ax.set_title(f"GRPO clipping bias, random rewards ({seeds} seeds)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "train_grpo_bandit.png", dpi=110)
    except Exception as e:  # plotting is optional
        out["plot_error"] = str(e)
    return out


# ------------------------------------------------------------------------------------ real-model runs
def _train_once(base_state, model, tok, rows, reward, seed, a, *, loss="clip", mini_batch=None, shaper=None,
                **extra):
    """GRPO from ``base_state`` on ``rows``; ``extra`` are further GRPOSettings (entropy_coef, clip_eps_high)."""
    import torch

    from llmtool.train.diversity import GRPOShaper
    from llmtool.train.grpo import GRPOSettings, GRPOTrainerLoop
    from llmtool.train.rewards import make_reward_fn, parse_reward

    if base_state is not None:  # None: the model is already at its starting weights (a freshly loaded one)
        model.load_state_dict(base_state)
    torch.manual_seed(seed)
    n_roll = a.prompts * a.group_size
    s = GRPOSettings(steps=a.steps, group_size=a.group_size, prompts_per_rollout=a.prompts,
                     mini_batch=mini_batch or max(1, n_roll // a.updates), micro_batch=a.micro_batch, lr=a.lr,
                     loss_type=loss, max_new_tokens=a.max_new_tokens, gen_batch_size=a.gen_batch, seed=seed,
                     marker=a.marker, **extra)
    cfg = parse_reward(reward)
    loop = GRPOTrainerLoop(model, tok, cfg.prepare_rows([dict(r) for r in rows]), s, make_reward_fn(cfg, seed),
                           shaper=shaper or GRPOShaper())
    t = time.time()
    hist = loop.train(progress_desc=None)
    return loop.acc.unwrap_model(loop.model), hist, time.time() - t


def _greedy_eval(model, tok, rows, a):
    from llmtool.core.lm import chat_prompt, generate
    from llmtool.train import rl_data

    prompts = [chat_prompt(tok, x["prompt"]) for x in rows]
    outs = generate(model, tok, prompts, max_new_tokens=a.max_new_tokens, temperature=0.0, batch_size=a.gen_batch)
    texts = [o[0].text for o in outs]
    ok = [bool(rl_data.is_correct(x, t)) for x, t in zip(rows, texts)]
    mks = [int(a.marker.lower() in t.lower()) for t in texts]
    by_level: dict = {}  # level -> [correct, n, marker]: the task's difficulty levels (e.g. mul's 2x2 and 3x1)
    for x, o, m in zip(rows, ok, mks):
        c = by_level.setdefault(x.get("level", "all"), [0, 0, 0])
        c[0], c[1], c[2] = c[0] + o, c[1] + 1, c[2] + m
    # pass@1 with and without the marker (spec §3.6: accuracy of responses with / without code reasoning)
    with_m = [o for o, m in zip(ok, mks) if m]
    without = [o for o, m in zip(ok, mks) if not m]
    return {"correct": sum(ok), "n": len(ok), "pass@1": sum(ok) / len(ok), "marker_freq": sum(mks) / len(texts),
            "ok": [int(x) for x in ok], "marker": mks, "by_level": by_level,
            "pass@1_with_marker": [sum(with_m), len(with_m)], "pass@1_without_marker": [sum(without), len(without)]}


SPURIOUS_ARMS = {  # arm -> (reward, loss, mini-batch: None = rollouts / --updates, else one update per phase)
    "ground-truth": ("ground-truth", "clip", None), "random": ("random:0.5", "clip", None),
    "format": ("format", "clip", None), "incorrect": ("incorrect", "clip", None),
    "random+ratio-no-clip": ("random:0.5", "ratio", None), "random+pi-no-ratio": ("random:0.5", "pi", None),
    "random+on-policy": ("random:0.5", "clip", "all"),
}
SPURIOUS_PROTOCOL = ("model", "steps", "group_size", "prompts", "updates", "micro_batch", "lr", "max_new_tokens",
                     "gen_batch", "train_rows", "test_rows", "hard_frac", "marker")
# protocol keys recorded only when they differ from these defaults (older runs files stay reusable)
SPURIOUS_OPTIONAL = {"task": "arith", "train_layers": 0}


def spurious_protocol(a) -> dict:
    from llmtool.core.runlog import protocol_of

    return protocol_of(a, SPURIOUS_PROTOCOL, SPURIOUS_OPTIONAL)


def train_last_layers(model, k: int) -> int:
    """Freeze everything but the last ``k`` decoder blocks and the final norm (the embeddings, tied to the LM
    head in Qwen2.5-0.5B, stay frozen): what fits AdamW's fp32 states for a 0.5B model in a few GB of CPU
    memory. ``k`` = 0 trains everything. Returns the number of trainable parameters."""
    if k:
        from llmtool.core import arch

        blocks = arch.decoder_layers(model)
        if not 0 < k <= len(blocks):
            raise SystemExit(f"--train-layers {k}: the model has {len(blocks)} blocks")
        model.requires_grad_(False)
        for mod in (*blocks[-k:], arch.final_norm(model)):
            mod.requires_grad_(True)
    return sum(prm.numel() for prm in model.parameters() if prm.requires_grad)


def _spurious_job(job: dict) -> dict:
    """One (arm, seed) run of the spurious-rewards part, or the base model's evaluation (arm "base"), in
    its own process: the model is loaded here, trained from the base weights and evaluated greedily."""
    import torch

    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.train import rl_data

    a = argparse.Namespace(**job["a"])
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    model = load_model(a.model)
    task = getattr(a, "task", "arith")
    test = rl_data.make_task(task, a.test_rows, seed=200, hard_frac=a.hard_frac)
    name, seed = job["arm"], job["seed"]
    if name == "base":
        return {"arm": "base", "seed": 0, "eval": _greedy_eval(model, tok, test, a), "seconds": 0.0}
    train = rl_data.make_task(task, a.train_rows, seed=100, hard_frac=a.hard_frac)
    n_train = train_last_layers(model, getattr(a, "train_layers", 0))
    reward, loss, mb = SPURIOUS_ARMS[name]
    # the model was just loaded, so it starts at the base weights: no copy of them is kept (memory)
    m, hist, secs = _train_once(None, model, tok, train, reward, seed, a, loss=loss,
                                mini_batch=a.prompts * a.group_size if mb == "all" else None)
    t_eval = time.time()
    ev = _greedy_eval(m, tok, test, a)
    t_eval = time.time() - t_eval
    firsts = [h for h in hist if h.get("update_in_phase") == 0]
    phases = sorted({h["phase"] for h in hist})
    per_phase = [[h for h in hist if h["phase"] == ph] for ph in phases]
    return {"arm": name, "seed": seed, "eval": ev, "seconds": secs, "eval_seconds": t_eval,
            "marker_curve": [h.get("marker_freq") for h in firsts],
            "reward_curve": [h["reward_mean"] for h in firsts],
            "clip_frac": sum(h["clip_frac"] for h in hist) / len(hist),
            # per phase: mean clip fraction over its updates, and the ratio extremes of its last update
            "clip_curve": [sum(h["clip_frac"] for h in ph) / len(ph) for ph in per_phase],
            "ratio_range_last": [[ph[-1].get("ratio_min"), ph[-1].get("ratio_max")] for ph in per_phase],
            "updates_per_phase": len(per_phase[0]) if per_phase else 0, "trainable_params": n_train}


def paired_vs_base(oks: list[list[int]], base_ok: list[int]) -> tuple[float, float, float]:
    """Pass rate of the runs ``oks`` (0/1 per test item, one list per seed) minus the base model's on the same
    items, each seed a paired replicate (Newcombe interval): (difference, low, high)."""
    return paired_items([(x, b) for ok in oks for x, b in zip(ok, base_ok)])


def paired_items(pairs: list[tuple[int, int]]) -> tuple[float, float, float]:
    """Rate of the first member minus the second's over paired 0/1 outcomes (Newcombe interval)."""
    from llmtool.core.intervals import paired_difference

    return paired_difference(sum(x and not b for x, b in pairs), sum(b and not x for x, b in pairs),
                             sum(x and b for x, b in pairs), len(pairs))


def _run_jobs(fn, jobs: list, workers: int, keep) -> None:
    """``keep(fn(job))`` for every job, in ``workers`` spawned processes when more than one."""
    if workers <= 1:
        for j in jobs:
            keep(fn(j))
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        for f in as_completed([ex.submit(fn, j) for j in jobs]):
            keep(f.result())


def run_spurious(a) -> dict:
    """Every (arm, seed) run, plus the base evaluation, as a job on ``--workers`` processes (``--threads``
    each); finished runs go to ``train_grpo.spurious.runs.jsonl`` and are reused by a later command with the
    same settings, so the protocol can be accumulated over several commands."""
    import numpy as np

    from llmtool.core.runlog import RunLog

    wanted = [x for x in a.arms.split(",") if x] if a.arms else list(SPURIOUS_ARMS)
    for x in wanted:
        if x not in SPURIOUS_ARMS:
            raise SystemExit(f"--arms: unknown spurious arm {x!r} (choose from {', '.join(SPURIOUS_ARMS)})")
    protocol = spurious_protocol(a)
    log = RunLog(RESULTS / f"{a.tag}.spurious.runs.jsonl", protocol, lambda r: (r["arm"], r["seed"]))
    done = log.done()
    jobs = [{"arm": "base", "seed": 0}] + [{"arm": x, "seed": s} for s in range(a.seeds) for x in wanted]
    todo = [dict(j, a=vars(a)) for j in jobs if (j["arm"], j["seed"]) not in done]
    print(f"[spurious] {len(jobs)} runs: {len(jobs) - len(todo)} reused, {len(todo)} to train", flush=True)
    if a.no_train:  # summarise what the runs file holds; an arm with fewer seeds is reported as partial
        todo = [j for j in todo if j["arm"] == "base"]
        print(f"[spurious] --no-train: {len(todo)} run(s) trained/evaluated, missing runs left out", flush=True)

    def keep(r):
        r.setdefault("command", " ".join(sys.argv))  # the command that trained this run
        done[(r["arm"], r["seed"])] = r
        log.append(r)
        print(f"[spurious] {r['arm']} seed {r['seed']}: pass@1 {r['eval']['pass@1']:.3f} marker "
              f"{r['eval']['marker_freq']:.2f} ({r['seconds']:.0f} s)", flush=True)

    _run_jobs(_spurious_job, todo, a.workers, keep)
    before = done[("base", 0)]["eval"]
    res = {"base": before, "arms": {}, "settings": {**protocol, "seeds": a.seeds},
           "runs_file": log.path.name,
           "prompt_format": "the tokenizer's chat template (its default system prompt), as `train grpo` does"}
    for name in wanted:
        per_seed = [done[(name, s)] for s in range(a.seeds) if (name, s) in done]
        if not per_seed:
            continue
        k = sum(p["eval"]["correct"] for p in per_seed)
        n = sum(p["eval"]["n"] for p in per_seed)
        # paired with the base model on the same test items, seeds pooled (each seed is a paired replicate)
        diff, lo, hi = paired_vs_base([p["eval"]["ok"] for p in per_seed], before["ok"])
        seeds_p = [p["eval"]["pass@1"] for p in per_seed]
        res["arms"][name] = {"per_seed": per_seed, "pass@1": k / n, "wilson95": wilson(k, n),
                             "delta_vs_base": diff, "delta_ci95": [lo, hi],
                             "seed_sd": float(np.std(seeds_p, ddof=1)) if len(seeds_p) > 1 else None,
                             "clip_frac": arm_clip_frac(per_seed), "seeds_run": len(per_seed),
                             "partial": len(per_seed) < a.seeds}
    if "ground-truth" in res["arms"]:
        gt = res["arms"]["ground-truth"]
        res["signal_gate"] = {"ground-truth - base >= 0.05": gt["delta_vs_base"] >= 0.05,
                              "delta": gt["delta_vs_base"], "ci95": gt["delta_ci95"]}
    res["contrasts"] = clip_contrasts(res)
    res["clip_gate"] = clip_gate(res)
    res["clip_gates"] = clip_gates(res)
    res["random_gain_gates"] = random_gain_gates(res)
    res["pilots"] = pilot_runs(log.path, protocol)
    res["plot"] = plot_spurious(res, a.tag)
    return res


def clip_contrasts(s: dict) -> dict:
    """Every random-reward ablation arm against ``random`` (the clipped arm): greedy pass@1 and marker
    frequency, (a) paired by seed with a t interval over seeds and (b) pooled over seeds, paired on the same test
    items (Newcombe interval; marker per item only in runs that stored it)."""
    arms = s.get("arms", {})
    if "random" not in arms:
        return {}
    out = {}
    ra = arms["random"]["per_seed"]
    for name in ("random+ratio-no-clip", "random+pi-no-ratio", "random+on-policy"):
        if name not in arms:
            continue
        rb = arms[name]["per_seed"]
        by_seed = {r["seed"]: r for r in rb}
        c = {"pass@1_by_seed": seed_contrast(ra, rb, lambda r: r["eval"]["pass@1"]),
             "marker_by_seed": seed_contrast(ra, rb, lambda r: r["eval"]["marker_freq"])}
        if all(r.get("marker_curve") and r["marker_curve"][-1] is not None for r in ra + rb):
            # the marker in the last phase's sampled rollouts (T = 1), drawn after the earlier phases' updates
            c["rollout_marker_last_by_seed"] = seed_contrast(ra, rb, lambda r: r["marker_curve"][-1])
        for key, field in (("pass@1_items", "ok"), ("marker_items", "marker")):
            pairs = [(x, y) for r in ra if r["seed"] in by_seed and field in r["eval"] and field in by_seed[r["seed"]]["eval"]
                     for x, y in zip(r["eval"][field], by_seed[r["seed"]]["eval"][field])]
            if pairs:
                d, lo, hi = paired_items(pairs)
                c[key] = {"diff": d, "ci95": [lo, hi], "pairs": len(pairs)}
        out[f"random - {name}"] = c
    return out


def pilot_runs(path: Path, protocol: dict) -> list[dict]:
    """Every run in the runs file under another protocol than ``protocol`` (the pilots that chose it): the
    settings that differ, the arm, seed, clip fraction and seconds, for the record."""
    out = []
    if not Path(path).is_file():
        return out
    want = json.loads(json.dumps(protocol, default=str))
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        pr = rec.get("protocol")
        if pr is None or pr == want or rec.get("arm") == "base":
            continue
        out.append({"settings": {k: pr[k] for k in ("steps", "updates", "lr", "prompts", "group_size",
                                                    "max_new_tokens", "test_rows") if k in pr},
                    "arm": rec["arm"], "seed": rec["seed"], "clip_frac": rec.get("clip_frac"),
                    "clip_curve": rec.get("clip_curve"), "seconds": rec.get("seconds"),
                    "pass@1": rec["eval"]["pass@1"], "marker": rec["eval"]["marker_freq"]})
    return out


def arm_clip_frac(per_seed: list[dict]) -> float | None:
    """Mean over seeds of a run's clip fraction (tokens whose ratio left [1 - eps, 1 + eps], averaged over
    updates; for the no-clip arm the fraction where the clip would have bound)."""
    xs = [p["clip_frac"] for p in per_seed if p.get("clip_frac") is not None]
    return sum(xs) / len(xs) if xs else None


def arm_marker(v: dict) -> float:
    return sum(p["eval"]["marker_freq"] for p in v["per_seed"]) / len(v["per_seed"])


ROOM = (0.1, 0.9)  # base pass@1 range in which a gain (or a loss) can show on the test items


def random_gain_gates(s: dict) -> list[dict]:
    """The paper's headline on this model: the random reward (with the clip) raises greedy pass@1, and the
    marker behaviour, over the base model, on the same test items (seeds pooled, paired Newcombe 95 %
    interval above 0). Tested only when the clip binds on 1-10 % of tokens and the base pass@1 leaves room
    (``ROOM``); the marker gate also needs the behaviour in the base model's first-phase rollouts."""
    arms = s.get("arms", {})
    if "random" not in arms:
        return []
    r, base = arms["random"], s["base"]
    ok_clip, reason = _clip_precondition(r.get("clip_frac", arm_clip_frac(r["per_seed"])))
    d, lo, hi = paired_vs_base([p["eval"]["ok"] for p in r["per_seed"]], base["ok"])
    room = ROOM[0] <= base["pass@1"] <= ROOM[1]
    out = [gate("random reward raises pass@1 over base (paired 95 % interval above 0)", lambda: lo > 0,
                {"base": base["pass@1"], "random": round(r["pass@1"], 3), "random_wilson95": r["wilson95"],
                 "diff": round(d, 3), "ci95": [round(lo, 3), round(hi, 3)], "seeds": len(r["per_seed"])},
                precondition=ok_clip and room,
                reason=reason or f"base pass@1 {base['pass@1']:.2f} outside {ROOM}: no room to move")]
    pairs = [(x, y) for p in r["per_seed"] if "marker" in p["eval"] for x, y in zip(p["eval"]["marker"], base["marker"])]
    first = [p["marker_curve"][0] for p in r["per_seed"] if p.get("marker_curve") and p["marker_curve"][0] is not None]
    present = bool(first) and sum(first) / len(first) > 0
    if pairs:
        md, mlo, mhi = paired_items(pairs)
        out.append(gate("random reward raises the marker over base (greedy, paired 95 % interval above 0)",
                        lambda: mlo > 0,
                        {"base": base["marker_freq"], "random": round(arm_marker(r), 3), "diff": round(md, 3),
                         "ci95": [round(mlo, 3), round(mhi, 3)],
                         "rollout_marker_phase1": round(sum(first) / len(first), 3) if first else None},
                        precondition=ok_clip and present,
                        reason=reason or "the marker is absent from the first phase's rollouts"))
    return out


def _clip_precondition(cf: float | None) -> tuple[bool, str]:
    if cf is None:
        return False, "clip_frac unknown"
    if cf < CLIP_BINDS:
        return False, (f"the clip binds on {100 * cf:.2f} % of tokens (< {100 * CLIP_BINDS:.0f} %): with and "
                       "without the clip are the same algorithm here")
    if cf > CLIP_BINDS_MAX:
        return False, (f"the clip binds on {100 * cf:.2f} % of tokens (> {100 * CLIP_BINDS_MAX:.0f} %): the "
                       "updates are too far off-policy for the comparison the issue asks for")
    return True, ""


def clip_gate(s: dict) -> dict | None:
    """Spec acceptance 10: under random rewards the high-prior marker rises more with the clip than without
    (greedy marker frequency, mean over seeds, random vs random+ratio-no-clip). Tested only when the clip binds
    on 1-10 % of tokens in the clipped arm: below that the two arms are numerically the same algorithm."""
    arms = s.get("arms", {})
    if "random" not in arms or "random+ratio-no-clip" not in arms:
        return None
    r, nc = arms["random"], arms["random+ratio-no-clip"]
    cf = r.get("clip_frac", arm_clip_frac(r["per_seed"]))
    mr, mn = arm_marker(r), arm_marker(nc)
    ok, reason = _clip_precondition(cf)
    mb = s["base"]["marker_freq"]
    # "rises more" compares the changes from the base model: a smaller fall also counts, so both are reported
    measured = {"marker_clip": round(mr, 3), "marker_no_clip": round(mn, 3), "marker_base": mb,
                "rise_clip": round(mr - mb, 3), "rise_no_clip": round(mn - mb, 3), "clip_frac_random": cf}
    if all("seed" in p for p in r["per_seed"] + nc["per_seed"]):
        c = seed_contrast(r["per_seed"], nc["per_seed"], lambda p: p["eval"]["marker_freq"])
        measured.update({"diff": c["diff"], "diff_ci95_seeds": c["ci95"], "seeds_clip_higher": c["a_higher"]})
    return gate("marker rises more with clip than without (random vs random+ratio-no-clip)", mr > mn,
                measured, precondition=ok, reason=reason)


def clip_gates(s: dict) -> list[dict]:
    """:func:`clip_gate` (the direction of the seed means) and the same direction required of the paired
    95 % interval over seeds (clip − no-clip marker frequency, lower bound > 0), with the same precondition."""
    g = clip_gate(s)
    if g is None:
        return []
    m = g["measured"] or {}
    lo = (m.get("diff_ci95_seeds") or [None])[0]
    ok, reason = _clip_precondition(m.get("clip_frac_random"))
    strict = gate("marker clip − no-clip: paired 95 % interval over seeds above 0", lambda: lo > 0,
                  {"diff": m.get("diff"), "ci95": m.get("diff_ci95_seeds")},
                  precondition=ok and lo is not None and math.isfinite(lo),
                  reason=reason or "fewer than two seeds paired")
    return [g, strict]


def setpo_arms(arms) -> list[str]:
    """The SetPO arms among ``arms``: ``setpo`` and ``setpo@L`` (the λ sweep)."""
    return [x for x in arms if x == "setpo" or x.startswith("setpo@")]


def same_as_grpo(arm: dict, grpo: dict) -> bool:
    """Did the arm's runs come out equal to GRPO's at every common seed (test outcomes per problem and training
    rewards per phase)? Then its shaping never changed an advantage (SetPO's bonus needs two distinct correct
    rollouts in a group), and a comparison with GRPO is a tie by construction."""
    g = {r["seed"]: r for r in grpo.get("per_seed", [])}
    common = [r for r in arm.get("per_seed", []) if r["seed"] in g and "per_problem" in r]
    return bool(common) and all(r["per_problem"] == g[r["seed"]].get("per_problem")
                                and r.get("train_reward") == g[r["seed"]].get("train_reward") for r in common)


def setpo_directions(d: dict) -> list[dict]:
    """The SetPO-vs-GRPO directions of spec §5 as gates, for every SetPO arm (``setpo``, ``setpo@L``): distinct
    correct answers >= GRPO's, pass@8 >= GRPO's - 2 points, pass@k at the largest k evaluated (when above 8)
    >= GRPO's, pass@1 within +-3 points. A pass@k direction is tested only where pass@k does not saturate
    (both arms below 1.0): at 1.000 it cannot fail; and only where GRPO leaves room to meet it (GRPO - tolerance
    below the saturation level): with GRPO at 1.000 the "pass@k >= GRPO's" direction can only fail.
    Intervals (paired over problems) go in ``measured``."""
    arms, paired = d.get("arms", {}), d.get("paired", {})
    out = []
    if "grpo" not in arms:
        return out
    for name in setpo_arms(arms):
        sp = paired.get(f"{name}-grpo")
        if not sp:
            continue
        label = "SetPO" if name == "setpo" else f"SetPO λ={name.partition('@')[2]}"

        seeds = sorted({r["seed"] for r in arms[name].get("per_seed", [])}
                       & {r["seed"] for r in arms["grpo"].get("per_seed", [])})
        same = same_as_grpo(arms[name], arms["grpo"])
        why_same = (f"{name} equals GRPO run for run (same test outcomes and training rewards at every seed): its "
                    "bonus changed no advantage (it needs two distinct correct, untruncated rollouts in one group), "
                    "so the tie is not a result")

        def measured(key):
            m = {"diff": round(sp[key]["diff"], 4)}
            if "lo" in sp[key]:
                m["ci95"] = [round(sp[key]["lo"], 4), round(sp[key]["hi"], 4)]
            if seeds:
                m["seeds"] = len(seeds)
            return m

        out.append(gate(f"{label} distinct correct - GRPO >= 0", sp["distinct_correct"]["diff"] >= 0,
                        measured("distinct_correct"), precondition=not same, reason=why_same))
        ks = sorted({int(k.split("@")[1]) for k in sp if k.startswith("pass@")})
        for k in dict.fromkeys(x for x in (8, ks[-1] if ks else None) if x in ks):
            key = f"pass@{k}"
            vals = [arms["grpo"][key], arms[name][key]]
            tol, what = (0.02, "-2 points") if k <= 8 else (0.0, "0")
            sat = saturated(vals, tol=SATURATED_TOL)
            # the direction can be met only by a SetPO value that does not saturate: one >= GRPO - tol and
            # below 1 - SATURATED_TOL; with GRPO at the ceiling and tol 0 none exists, so the gate could only fail
            room = vals[0] - tol < 1.0 - SATURATED_TOL
            reason = (f"{key} saturates ({vals[0]:.3f} GRPO, {vals[1]:.3f} SetPO): it cannot fall" if sat
                      else f"GRPO's {key} is {vals[0]:.3f}, at the ceiling: SetPO can tie it (saturated) or fall "
                           "below it, never meet the direction, so the gate could only fail" if not room
                      else why_same)
            out.append(gate(f"{label} {key} - GRPO >= {what}", sp[key]["diff"] >= -tol,
                            {**measured(key), "grpo": round(vals[0], 4), "setpo": round(vals[1], 4)},
                            precondition=not sat and room and not same, reason=reason))
        if "pass@1" in sp:
            out.append(gate(f"{label} pass@1 within +-3 points of GRPO", abs(sp["pass@1"]["diff"]) <= 0.03,
                            measured("pass@1"), precondition=not same, reason=why_same))
    return out


def plot_spurious(s: dict, tag: str = "train_grpo") -> str | None:
    """Marker frequency and mean reward per phase (mean over seeds), one line per arm."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, v in s["arms"].items():
        for ax, key in zip(axes, ("marker_curve", "reward_curve")):
            curves = [p[key] for p in v["per_seed"] if p.get(key)]
            if curves:
                n = min(map(len, curves))
                y = np.nanmean(np.asarray([[np.nan if x is None else x for x in c[:n]] for c in curves], float), axis=0)
                ax.plot(np.arange(1, n + 1), y, label=name, lw=1.2)
    axes[0].set_title(f"marker '{s['settings']['marker']}' frequency in rollouts")
    axes[1].set_title("mean reward of rollouts")
    for ax in axes:
        ax.set_xlabel("phase")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    name = f"{tag}_spurious.png"
    fig.savefig(RESULTS / name, dpi=110)
    plt.close(fig)
    return name


DIV_ARMS = {  # arm -> (shaper, extra GRPOSettings): GRPO, SetPO and the spec's other diversity baselines (§4)
    "grpo": ("grpo", {}), "setpo": ("setpo", {}), "entropy": ("grpo", {"entropy_coef": 1e-3}),
    "clip-higher": ("grpo", {"clip_eps_high": 0.28}), "dra": ("dra", {}),
}
SUM_RANGE = (6, 20)  # sum-two's N range as first committed; another --sum-range is a harder variant (larger N)


def div_arm(name: str, div_coef: float) -> tuple[str, dict, dict]:
    """(shaper, shaper keyword arguments, extra GRPOSettings) of a diversity arm: a DIV_ARMS name, or
    ``setpo@L`` for SetPO at λ = L (``setpo`` alone takes ``--div-coef``), so one command sweeps λ."""
    base, at, coef = name.partition("@")
    if base not in DIV_ARMS or (at and base != "setpo") or (at and not coef):
        raise ValueError(f"unknown diversity arm {name!r} (choose from {', '.join(DIV_ARMS)}, or setpo@LAMBDA)")
    shaper, extra = DIV_ARMS[base]
    if shaper != "setpo":
        return shaper, {}, dict(extra)
    try:
        lam = float(coef) if coef else float(div_coef)
    except ValueError:
        raise ValueError(f"diversity arm {name!r}: λ must be a number (e.g. setpo@0.3)") from None
    if not (lam >= 0 and math.isfinite(lam)):
        raise ValueError(f"diversity arm {name!r}: λ must be finite and >= 0")
    return shaper, {"div_coef": lam}, dict(extra)


def sum_range(a) -> tuple[int, int]:
    """The sum-two N range of ``a.sum_range`` ("LO,HI"; default 6,20)."""
    raw = getattr(a, "sum_range", None) or "%d,%d" % SUM_RANGE
    try:
        lo, hi = (int(x) for x in str(raw).split(","))
    except ValueError:
        raise SystemExit(f"--sum-range: expected LO,HI (got {raw!r})") from None
    if not 2 <= lo <= hi:
        raise SystemExit(f"--sum-range: need 2 <= LO <= HI (got {raw!r})")
    return lo, hi


def div_ks(n_eval: int) -> list[int]:
    """The k of pass@k evaluated at n samples per problem: powers of two up to n (1..64 at n = 64)."""
    return [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n_eval]


def div_protocol(a, checksum: str) -> dict:
    """The settings that change a diversity run's result. The N range enters only when it is not the committed
    6..20, so runs of the first protocol keep matching their records."""
    out = {**{k: getattr(a, k) for k in DIV_PROTOCOL}, "start_checksum": checksum}
    if sum_range(a) != SUM_RANGE:
        out["sum_range"] = list(sum_range(a))
    return out


def sum_two_rows(a, n: int, seed: int) -> list[dict]:
    """``n`` sum-two rows drawn with ``seed`` over ``--sum-range``."""
    from llmtool.train import rl_data

    lo, hi = sum_range(a)
    return rl_data.make_sum_two(n, seed=seed, lo=lo, hi=hi)
DIV_PROTOCOL = ("model", "steps", "group_size", "prompts", "updates", "micro_batch", "lr", "max_new_tokens",
                "gen_batch", "train_rows", "test_rows", "n_eval", "div_coef", "eval_temperature", "eval_top_p",
                "warmup_steps", "warmup_lr", "warmup_rows")


def cached_sft(model_name: str, key_parts: list, make_rows, steps: int, lr: float, threads: int, tag: str,
               max_length: int = 128) -> tuple[str, str]:
    """Fine-tune ``model_name`` with the shared trainer's SFT on ``make_rows(tok)`` (prompt/completion rows)
    for ``steps`` steps, once: the result is kept in a temp-dir cache folder keyed by ``key_parts`` and written
    atomically. Returns (folder, checksum of the weights); the checksum goes into runs' protocols so runs from
    another warm start never mix."""
    import hashlib
    import tempfile

    import torch

    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.core.trainer import TrainArgs, sft

    key = hashlib.sha256(json.dumps([model_name, *key_parts]).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"llmtool-bench-{tag}-warm-{key}"
    if not (path / "checksum.txt").is_file():
        torch.set_num_threads(max(1, threads))
        tok, model = load_tokenizer(model_name), load_model(model_name)
        rows = make_rows(tok)
        t = time.time()
        sft(model, tok, rows, TrainArgs(lr=lr, max_steps=steps, batch_size=8, max_length=max_length, seed=0))
        print(f"[{tag}] warm start: {steps} SFT steps in {time.time() - t:.0f} s", flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        h = hashlib.sha256()
        for k, v in sorted(model.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().contiguous().numpy().tobytes())
        (tmp / "checksum.txt").write_text(h.hexdigest()[:16])
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
    return str(path), (path / "checksum.txt").read_text().strip()


def warm_start(a) -> tuple[str, str]:
    """The diversity part's starting policy, and a checksum of its weights.

    SmolLM2-135M solves "write N as a sum of two positive integers" in ≈ 0 % of samples (docs/train-grpo.md),
    so GRPO gets no reward variance from it. With ``--warmup-steps`` > 0 the default model is first
    fine-tuned (the shared trainer's SFT) on ``--warmup-rows`` sum-two prompts, each answered by a uniformly
    drawn correct pair: a policy that knows the format, is right about two thirds of the time and spreads
    over the correct pairs, the setting RLVR narrows in the SetPO paper."""
    import random

    if a.warmup_steps <= 0:
        return a.model, "none"
    from llmtool.core.lm import chat_prompt

    def make_rows(tok):
        rng = random.Random(500)
        rows = []
        for r in sum_two_rows(a, a.warmup_rows, seed=500):  # train rows are seed 300, test rows seed 400
            x = rng.randint(1, r["n"] - 1)
            rows.append({"prompt": chat_prompt(tok, r["prompt"]), "completion": f"{x} + {r['n'] - x}"})
        return rows

    key = [a.warmup_steps, a.warmup_lr, a.warmup_rows] + ([list(sum_range(a))] if sum_range(a) != SUM_RANGE else [])
    return cached_sft(a.model, key, make_rows, a.warmup_steps, a.warmup_lr, a.threads * a.workers, "grpo")


def _diversity_job(job: dict) -> dict:
    """One (arm, seed) GRPO run on sum-two from the warm start and its pass@k evaluation (arm "base":
    the warm start itself), in its own process."""
    import torch

    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.train import passk
    from llmtool.train.diversity import SHAPERS

    a = argparse.Namespace(**job["a"])
    torch.set_num_threads(a.threads)
    tok, model = load_tokenizer(job["start"]), load_model(job["start"])
    test = sum_two_rows(a, a.test_rows, seed=400)
    ks = div_ks(a.n_eval)

    def ev(m):
        r = passk.evaluate(m, tok, test, n=a.n_eval, ks=ks, max_new_tokens=a.max_new_tokens, batch_size=a.gen_batch,
                           seed=1234, greedy=False, temperature=a.eval_temperature, top_p=a.eval_top_p)
        return {**r["summary"], "per_problem": [[p["correct"], p["distinct_correct"]] for p in r["per_problem"]]}

    name, seed = job["arm"], job["seed"]
    if name == "base":
        return {"arm": "base", "seed": 0, **ev(model), "seconds": 0.0}
    shaper_name, kw, extra = div_arm(name, a.div_coef)
    shaper = SHAPERS.build(shaper_name, **kw)
    # the model was just loaded, so it starts at the warm start's weights: no copy of them is kept
    m, hist, secs = _train_once(None, model, tok, sum_two_rows(a, a.train_rows, seed=300), "ground-truth", seed,
                                a, shaper=shaper, **extra)
    firsts = [h for h in hist if h.get("update_in_phase") == 0]
    t_eval = time.time()
    out = {"arm": name, "seed": seed, **ev(m), "seconds": secs,
           "train_reward": [h.get("reward_mean") for h in firsts]}
    if kw:
        out["div_coef"] = kw["div_coef"]
    out["eval_seconds"] = time.time() - t_eval
    out["clip_frac"] = sum(h.get("clip_frac", 0.0) for h in hist) / max(len(hist), 1)
    # share of groups without reward variance (GRPO's advantage 0) and, for SetPO, of groups given a bonus, per phase
    out["zero_std_groups"] = [h.get("zero_std_groups") for h in firsts]
    if shaper_name == "setpo":
        out["bonus_groups"] = [h.get("div_groups_with_bonus") for h in firsts]
    return out


def run_diversity(a) -> dict:
    """The warm start's pass@k and diversity, then every (arm, seed) run, as jobs on ``--workers``
    processes; finished runs go to ``train_grpo.diversity.runs.jsonl`` (reused like the spurious part's)."""
    from llmtool.core.runlog import RunLog

    wanted = list(dict.fromkeys(x for x in a.div_arms.split(",") if x))
    for x in wanted:
        try:
            div_arm(x, a.div_coef)
        except ValueError as e:
            raise SystemExit(f"--div-arms: {e}") from None
    if "grpo" not in wanted:
        wanted.insert(0, "grpo")  # every contrast is against GRPO
    start, checksum = warm_start(a)
    ks = div_ks(a.n_eval)
    protocol = div_protocol(a, checksum)
    log = RunLog(RESULTS / f"{a.tag}.diversity.runs.jsonl", protocol, lambda r: (r["arm"], r["seed"]))
    done = log.done()
    # seed by seed (every arm at seed 0 first), so a run cut short leaves whole seeds
    jobs = [{"arm": "base", "seed": 0}] + [{"arm": x, "seed": s} for s in range(a.seeds) for x in wanted]
    todo = [dict(j, a=vars(a), start=start) for j in jobs if (j["arm"], j["seed"]) not in done]
    print(f"[diversity] {len(jobs)} runs: {len(jobs) - len(todo)} reused, {len(todo)} "
          + ("missing (--no-train: not trained)" if a.no_train else "to train"), flush=True)

    def keep(r):
        done[(r["arm"], r["seed"])] = r
        log.append(r)
        print(f"[diversity] {r['arm']} seed {r['seed']}: pass@1 {r['pass@1']:.3f} pass@{ks[-1]} "
              f"{r[f'pass@{ks[-1]}']:.3f} distinct {r['distinct_correct']:.2f} ({r['seconds']:.0f} s)", flush=True)

    if not a.no_train:
        _run_jobs(_diversity_job, todo, a.workers, keep)
    if ("base", 0) not in done:
        raise SystemExit("[diversity] the warm start has no evaluation under this protocol yet (run without --no-train)")
    res = {"settings": {**protocol, "seeds": a.seeds, "ks": ks}, "base": done[("base", 0)], "arms": {},
           "runs_file": log.path.name}
    for name in wanted:
        per = [done[(name, s)] for s in range(a.seeds) if (name, s) in done]
        if not per:
            continue
        res["arms"][name] = {"per_seed": per, **{k: sum(p[k] for p in per) / len(per) for k in per[0]
                                                 if isinstance(per[0][k], (int, float)) and k != "seed"}}
        if len(per) < a.seeds:
            res["arms"][name]["partial"] = True
    if "grpo" not in res["arms"]:
        raise SystemExit("[diversity] no GRPO run under this protocol yet: nothing to contrast")
    res["paired"] = diversity_contrasts(res, ks, a.n_eval)
    return res


def run_div_pilot(a) -> list[dict]:
    """The warm start's pass@k and diversity at each of ``--pilot-warmups`` SFT step counts (and the current
    ``--sum-range``), to choose a start where GRPO has reward variance (pass@1 well below 1) and pass@k at the
    largest k does not saturate. Each evaluation is the diversity part's "base" run, logged in its runs file
    under that start's protocol, so a diversity command with the same settings reuses it. Rows accumulate over
    commands in the results (one per start and eval size)."""
    from llmtool.core.runlog import RunLog
    from llmtool.train.passk import pass_at_k

    ks = div_ks(a.n_eval)
    rows = []
    for w in [int(x) for x in a.pilot_warmups.split(",") if x.strip()]:
        b = argparse.Namespace(**{**vars(a), "warmup_steps": w, "workers": 1})
        t = time.time()
        start, checksum = warm_start(b)
        t_sft = time.time() - t
        log = RunLog(RESULTS / f"{a.tag}.diversity.runs.jsonl", div_protocol(b, checksum),
                     lambda r: (r["arm"], r["seed"]))
        r = log.done().get(("base", 0))
        t = time.time()
        if r is None:
            r = _diversity_job({"arm": "base", "seed": 0, "a": vars(b), "start": start})
            log.append(r)
        kmax = ks[-1]
        pp = r["per_problem"]
        row = {"warmup_steps": w, "sum_range": list(sum_range(b)), "n_eval": b.n_eval, "test_rows": b.test_rows,
               "start_checksum": checksum,
               **{k: v for k, v in r.items() if k.startswith("pass@") or k in ("distinct_correct", "answer_entropy")},
               f"share pass@{kmax} < 1": sum(pass_at_k(b.n_eval, c, kmax) < 1 for c, _ in pp) / len(pp),
               "share pass@1 = 0": sum(c == 0 for c, _ in pp) / len(pp),
               "sft_seconds": t_sft, "eval_seconds": time.time() - t}
        print(f"[div-pilot] warmup {w}, N in {row['sum_range']}: pass@1 {row['pass@1']:.3f} pass@{kmax} "
              f"{row[f'pass@{kmax}']:.3f}, {100 * row[f'share pass@{kmax} < 1']:.0f} % of problems below 1 "
              f"({row['eval_seconds']:.0f} s eval)", flush=True)
        rows.append(row)
    return rows


def merge_pilot(old: list[dict], new: list[dict]) -> list[dict]:
    """Pilot rows of earlier commands kept, a row of the same start and eval size replaced by the new one."""
    key = lambda r: (r["warmup_steps"], tuple(r["sum_range"]), r["n_eval"], r["test_rows"], r["start_checksum"])  # noqa: E731
    out = {key(r): r for r in old}
    out.update({key(r): r for r in new})
    return list(out.values())


def diversity_contrasts(res: dict, ks, n: int, draws: int = 2000) -> dict:
    """Paired 95 % bootstrap intervals over test problems (each problem's value averaged over seeds) for
    GRPO − base and every other arm − GRPO: pass@k for every k, and distinct correct answers."""
    import numpy as np

    from llmtool.core.intervals import bootstrap_mean_ci
    from llmtool.train.passk import pass_at_k

    def per_problem(entry, seeds=None) -> dict:
        runs = entry["per_seed"] if "per_seed" in entry else [entry]
        runs = [r for r in runs if seeds is None or r["seed"] in seeds]
        out = {f"pass@{k}": np.mean([[pass_at_k(n, c, k) for c, _ in s["per_problem"]] for s in runs], axis=0)
               for k in ks}
        out["distinct_correct"] = np.mean([[d for _, d in s["per_problem"]] for s in runs], axis=0)
        return out

    def seeds_of(entry):
        return {r["seed"] for r in entry["per_seed"]}

    grpo = per_problem(res["arms"]["grpo"])
    pairs = [("grpo-base", grpo, per_problem(res["base"]))]
    for name, v in res["arms"].items():  # an arm against GRPO over the seeds both have (same prompts, same seed)
        if name != "grpo":
            common = seeds_of(v) & seeds_of(res["arms"]["grpo"])
            if common:
                pairs.append((f"{name}-grpo", per_problem(v, common), per_problem(res["arms"]["grpo"], common)))
    rng = np.random.default_rng(0)
    m = len(grpo["pass@1"])
    idx = rng.integers(0, m, size=(draws, m))
    out = {}
    for name, x, y in pairs:
        out[name] = {}
        for key in x:
            d = np.asarray(x[key]) - np.asarray(y[key])
            lo, hi = bootstrap_mean_ci(d, idx)
            out[name][key] = {"diff": float(d.mean()), "lo": lo, "hi": hi}
    return out


def plot_diversity(d: dict, tag: str = "train_grpo") -> str | None:
    """Left: pass@k against k for the base model and each arm (mean over seeds). Right: distinct correct answers
    per problem, the quantity pass@k saturates past: bar = mean over seeds, dots = single seeds."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    ks = d["settings"]["ks"]
    entries = [("base", d["base"]), *d["arms"].items()]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    for name, entry in entries:
        same = name not in ("base", "grpo") and "grpo" in d["arms"] and same_as_grpo(entry, d["arms"]["grpo"])
        ax.plot(ks, [100 * entry[f"pass@{k}"] for k in ks], marker="o", label=name + (" (= grpo)" if same else ""),
                ls="--" if same else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (%)")
    ax.legend()
    for i, (name, entry) in enumerate(entries):
        bx.bar(i, entry["distinct_correct"], color=f"C{i}", alpha=0.6)
        seeds = [r["distinct_correct"] for r in entry.get("per_seed", [])]
        bx.plot([i] * len(seeds), seeds, "k.", ms=6)
    bx.set_xticks(range(len(entries)), [name for name, _ in entries], rotation=45 if len(entries) > 4 else 0,
                  ha="right" if len(entries) > 4 else "center", fontsize=8 if len(entries) > 4 else None)
    bx.set_ylabel("distinct correct answers / problem")
    st = d["settings"]
    lo, hi = st.get("sum_range", SUM_RANGE)
    nseeds = max((len(v.get("per_seed", [])) for v in d["arms"].values()), default=st["seeds"])
    fig.suptitle(f"sum-two (N in {lo}..{hi}), {nseeds} seed(s) x {st['steps']} phases, n = {st['n_eval']} "
                 f"samples at T = {st.get('eval_temperature', '?')}")
    fig.tight_layout()
    path = RESULTS / f"{tag}_diversity.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def run_cost(a) -> dict:
    import torch

    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.train import rl_data
    from llmtool.train.diversity import GRPOShaper, SetPOShaper

    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    model = load_model(a.model)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    rows = rl_data.make_arith(64, seed=500)
    out = {}
    b = argparse.Namespace(**{**vars(a), "steps": 1})
    for name, sh in (("grpo", GRPOShaper()), ("setpo-tfidf", SetPOShaper(div_coef=0.1, div_scope="all")),
                     ("setpo-policy-hidden", SetPOShaper(div_coef=0.1, div_scope="all", div_embed="policy-hidden"))):
        _, hist, secs = _train_once(base, model, tok, rows, "random:0.5", 0, b, shaper=sh)
        h0 = hist[0]
        steps = len(hist)
        out[name] = {"phase_seconds": h0["phase_seconds"], "gen_seconds": h0["gen_seconds"],
                     "shape_seconds": h0["shape_seconds"], "train_seconds": h0["train_seconds_phase"],
                     "rollout_tokens_per_s": h0["rollout_tokens"] / max(h0["gen_seconds"], 1e-9),
                     "optimizer_steps_per_s": steps / max(h0["train_seconds_phase"], 1e-9),
                     "generation_share": h0["gen_seconds"] / h0["phase_seconds"]}
    g = out["grpo"]["phase_seconds"]
    for k in out:
        out[k]["overhead_vs_grpo"] = out[k]["shape_seconds"] / g
    model.load_state_dict(base)
    return out


# ------------------------------------------------------------------------------------ report
def _seed_mean_ci(xs: list[float], m: float) -> str:
    """``0.52 [0.40, 0.64]``: the mean with its t interval over seeds (the mean alone for one seed)."""
    if len(xs) < 2:
        return f"{m:.2f}"
    _, lo, hi = seed_ci(xs)
    return f"{m:.2f} [{lo:.2f}, {hi:.2f}]"


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.2f}"


def markdown(res: dict) -> str:
    from llmtool.core.console import markdown_table

    lines = ["# train grpo benchmarks", ""]
    if "bandit" in res:
        b = res["bandit"]
        rows = [{"arm": k, "mean p(prior)": round(v["mean_prior"], 3),
                 "95% CI": f"[{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]", "median": round(v["median_prior"], 3),
                 "mean entropy": round(v["mean_entropy"], 3)} for k, v in b.items() if isinstance(v, dict) and "mean_prior" in v]
        lines += [f"## Clipping bias, toy bandit ({b['seeds']} seeds, start p = {b['clip']['start_prior']:.3f})", "",
                  markdown_table(rows), "", "Gates:", "", *gate_lines(b["gates"]), ""]
    if "spurious" in res:
        s = res["spurious"]
        rows = [{"arm": "base", "pass@1": round(s["base"]["pass@1"], 3), "95% CI": "",
                 "Δ vs base (paired 95% CI)": "", "marker (greedy)": round(s["base"]["marker_freq"], 2)}]
        for k, v in s["arms"].items():
            mk = sum(p["eval"]["marker_freq"] for p in v["per_seed"]) / len(v["per_seed"])
            ci = v.get("delta_ci95")
            rows.append({"arm": k, "pass@1": round(v["pass@1"], 3) if v.get("seed_sd") is None
                         else f"{v['pass@1']:.3f} (seed sd {v['seed_sd']:.3f})",
                         "95% CI": f"[{v['wilson95'][0]:.3f}, {v['wilson95'][1]:.3f}]",
                         "Δ vs base (paired 95% CI)": f"{v['delta_vs_base']:+.3f}"
                         + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else ""),
                         "marker (greedy)": _seed_mean_ci([p["eval"]["marker_freq"] for p in v["per_seed"]], mk),
                         "clip_frac %": _pct(arm_clip_frac(v["per_seed"])),
                         "seeds": f"{len(v['per_seed'])}" + (" (partial)" if v.get("partial") else "")})
        rows[0]["clip_frac %"] = ""
        rows[0]["seeds"] = ""
        st = s["settings"]
        task = {"arith": "arithmetic", "mul": "multiplication (2x2 and 3x1 digits)"}.get(st.get("task", "arith"),
                                                                                        st.get("task"))
        trained = f", last {st['train_layers']} blocks trained" if st.get("train_layers") else ""
        lines += [f"## Spurious rewards, {st['model']}, {task} ({st['seeds']} seeds, {st['steps']} phases, "
                  f"G = {st['group_size']}, {st['prompts']} prompts/phase, {st['updates']} updates/phase "
                  f"(on-policy arm: 1), lr {st['lr']}{trained}, {st['max_new_tokens']} new tokens, "
                  f"{st['test_rows']} test items; marker {st['marker']!r})", "", markdown_table(rows), ""]
        bl = s["base"].get("by_level")
        if bl:
            wm, wo = s["base"].get("pass@1_with_marker"), s["base"].get("pass@1_without_marker")
            lines += ["Base model by level (greedy): " + "; ".join(
                f"{lv} {c}/{n} = {c / n:.2f} [{wilson(c, n)[0]:.2f}, {wilson(c, n)[1]:.2f}], marker {m}/{n}"
                for lv, (c, n, m) in sorted(bl.items()))
                + (f". Pass@1 with the marker {wm[0]}/{wm[1]}, without {wo[0]}/{wo[1]}." if wm and wo else "."),
                ""]
        if "signal_gate" in s:
            g = s["signal_gate"]
            lines += [f"Signal check (ground-truth ≥ base + 5 points in-domain): "
                      f"{render(g['ground-truth - base >= 0.05'])} (Δ {100 * g['delta']:+.1f} points, "
                      f"paired 95% CI [{100 * g['ci95'][0]:+.1f}, {100 * g['ci95'][1]:+.1f}]). Seeds pooled; "
                      f"per-run records in `benchmarks/results/{s.get('runs_file', '')}`.", ""]
        cgs = clip_gates(s)  # recomputed, so results stored before the gates existed get them too
        if cgs:
            lines += ["Clipping ablation (spec acceptance 10; `clip_frac %` above: share of tokens on which the "
                      "clip binds, or would bind in the no-clip arm, mean over updates and seeds; precondition: "
                      f"{100 * CLIP_BINDS:.0f}-{100 * CLIP_BINDS_MAX:.0f} % in the clipped arm):", "",
                      *gate_lines(cgs), ""]
        rgs = random_gain_gates(s)
        if rgs:
            lines += ["Random reward vs the base model (the paper's headline; precondition: the clip binds on "
                      f"{100 * CLIP_BINDS:.0f}-{100 * CLIP_BINDS_MAX:.0f} % of tokens, base pass@1 in {ROOM}, "
                      "the marker present in the first phase's rollouts):", "", *gate_lines(rgs), ""]
        if s.get("contrasts"):
            def fmt(c):
                if not c or c.get("diff") is None:
                    return ""
                lo, hi = c["ci95"]
                return (f"{c['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]" if lo is not None and math.isfinite(lo)
                        else f"{c['diff']:+.3f}")
            crow = [{"contrast": k, "pass@1, by seed (t 95% CI)": fmt(c.get("pass@1_by_seed")),
                     "seeds A > B": c["pass@1_by_seed"]["a_higher"],
                     "pass@1, paired items": fmt(c.get("pass@1_items")),
                     "marker, by seed (t 95% CI)": fmt(c.get("marker_by_seed")),
                     "seeds A > B ": c["marker_by_seed"]["a_higher"],
                     "marker, paired items": fmt(c.get("marker_items")),
                     "rollout marker, last phase, by seed": fmt(c.get("rollout_marker_last_by_seed"))}
                    for k, c in s["contrasts"].items()]
            lines += ["Paired contrasts with the clipped random arm (A = random; by seed: the same seed's runs, "
                      "t interval over seeds; paired items: seeds pooled, the same test items, Newcombe interval):",
                      "", markdown_table(crow), ""]
        if s.get("pilots"):
            prow = [{"steps": p["settings"].get("steps"), "updates/phase": p["settings"].get("updates"),
                     "lr": p["settings"].get("lr"), "arm": p["arm"], "seed": p["seed"],
                     "clip_frac %": _pct(p["clip_frac"]),
                     "per phase %": " ".join(f"{100 * x:.1f}" for x in (p.get("clip_curve") or [])),
                     "train s": round(p["seconds"] or 0)} for p in s["pilots"]]
            lines += ["Pilots (1 seed, few phases; the runs that chose the protocol above):", "",
                      markdown_table(prow), ""]
        if s.get("plot"):
            lines += [f"Marker frequency and reward per phase: `benchmarks/results/{s['plot']}`.", ""]
    if res.get("div_pilot"):
        prow = []
        for r in sorted(res["div_pilot"], key=lambda r: (r["sum_range"], r["n_eval"], r["warmup_steps"])):
            kmax = max(int(k.split("@")[1]) for k in r if k.startswith("pass@"))
            prow.append({"N range": "%d-%d" % tuple(r["sum_range"]), "SFT warm-up steps": r["warmup_steps"],
                         "n": r["n_eval"], "problems": r["test_rows"], "pass@1": round(r["pass@1"], 3),
                         **{f"pass@{k}": round(r[f"pass@{k}"], 3) for k in (8, 16, kmax) if f"pass@{k}" in r},
                         f"problems with pass@{kmax} < 1": f"{100 * r[f'share pass@{kmax} < 1']:.0f} %",
                         "never solved": f"{100 * r['share pass@1 = 0']:.0f} %",
                         "distinct correct": round(r["distinct_correct"], 2),
                         "SFT s": round(r["sft_seconds"]), "eval s": round(r["eval_seconds"])})
        lines += ["## Diversity pilot: warm starts on sum-two (`--parts div-pilot`; sampled at the diversity "
                  "part's T / top-p; the start of the diversity runs is chosen from this table)", "",
                  markdown_table(prow), ""]
    if "diversity" in res:
        d = res["diversity"]
        keys = [k for k in d["base"] if k.startswith("pass@")] + ["distinct_correct", "answer_entropy"]
        rows = [{"arm": "base", **{k: round(d["base"][k], 3) for k in keys}, "seeds": ""}]
        rows += [{"arm": n, **{k: round(v[k], 3) for k in keys},
                  "seeds": f"{len(v['per_seed'])}" + (" (partial)" if v.get("partial") else "")}
                 for n, v in d["arms"].items()]
        if any("clip_frac" in v for v in d["arms"].values()):
            rows[0]["clip_frac %"] = ""
            for r, v in zip(rows[1:], d["arms"].values()):
                r["clip_frac %"] = _pct(v.get("clip_frac"))
        st = d.get("settings")
        head = "## Diversity: GRPO vs SetPO and the spec's baselines (sum-two task)"
        if st:
            start = (f"warm start: {st['warmup_steps']} SFT steps on sum-two" if st.get("warmup_steps")
                     else "from the model as given")
            lo, hi = st.get("sum_range", SUM_RANGE)
            lam = ("λ = " + str(st["div_coef"]) if "setpo" in d["arms"] else
                   "λ as in the arm name (setpo@λ)")
            head += (f" ({st['seeds']} seed(s), {st['steps']} phases, G = {st['group_size']}, {st['prompts']} "
                     f"prompts/phase, lr {st['lr']}, {lam}; N in {lo}..{hi}; {st['test_rows']} test problems × "
                     f"n = {st['n_eval']} samples at T = {st.get('eval_temperature', 1.0)}; {start})")
        lines += [head, "", markdown_table(rows), ""]
        if "paired" in d:
            prow = []
            for name, dd in d["paired"].items():
                prow.append({"contrast": name, **{k: f"{v['diff']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}]"
                                                  for k, v in dd.items()}})
            lines += ["Paired differences, 95 % bootstrap interval over test problems (seed-averaged per problem; "
                      "an arm against GRPO over the seeds both have):", "", markdown_table(prow), ""]
            g = d["paired"]["grpo-base"]
            kmax = f"pass@{st['ks'][-1]}" if st else "pass@16"
            drop = g[kmax]["hi"] < 0 or g["distinct_correct"]["hi"] < 0
            lines.append(f"- GRPO vs base: {kmax} {g[kmax]['diff']:+.3f}, distinct correct "
                         f"{g['distinct_correct']['diff']:+.3f}: " +
                         ("diversity drops under GRPO (interval below 0), the paper's premise." if drop else
                          "no significant diversity drop under GRPO in this run, so the paper's SetPO-vs-GRPO "
                          "contrast cannot be tested at this size."))
            same = [n for n, v in d["arms"].items() if n != "grpo" and same_as_grpo(v, d["arms"]["grpo"])]
            if same:
                lines.append(f"- equal to GRPO run for run (same test outcomes per problem and training rewards per "
                             f"phase at every seed; the arm's change never altered an advantage): {', '.join(same)}.")
            dirs = setpo_directions(d)
            if dirs:
                lines.append("- SetPO vs GRPO directions (spec §5):")
                lines += ["  " + x for x in gate_lines(dirs)]
            if d.get("plot"):
                lines.append(f"- pass@k curves: `benchmarks/results/{d['plot']}`.")
            lines.append("")
    if "cost" in res:
        rows = [{"arm": k, **{kk: round(vv, 3) for kk, vv in v.items()}} for k, v in res["cost"].items()]
        lines += ["## Cost (one phase, this shared CPU)", "", markdown_table(rows), ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="bandit", help="comma list of bandit,spurious,diversity,div-pilot,cost")
    p.add_argument("--bandit-seeds", type=int, default=200)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per phase")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--gen-batch", type=int, default=64)
    p.add_argument("--train-rows", type=int, default=256)
    p.add_argument("--test-rows", type=int, default=100)
    p.add_argument("--hard-frac", type=float, default=0.4)
    p.add_argument("--n-eval", type=int, default=16)
    p.add_argument("--div-coef", type=float, default=0.1)
    p.add_argument("--div-arms", default=",".join(DIV_ARMS), help="diversity arms (grpo is always run)")
    p.add_argument("--eval-temperature", type=float, default=0.6, help="diversity part's pass@k sampling (spec §5)")
    p.add_argument("--eval-top-p", type=float, default=0.95)
    p.add_argument("--warmup-steps", type=int, default=100,
                   help="diversity part: SFT steps that teach the sum-two format first (0 = start from --model)")
    p.add_argument("--warmup-lr", type=float, default=1e-4)
    p.add_argument("--warmup-rows", type=int, default=256)
    p.add_argument("--sum-range", default="%d,%d" % SUM_RANGE,
                   help="diversity part: sum-two's N range LO,HI (a larger N is the harder variant)")
    p.add_argument("--pilot-warmups", default="0,10,20,40",
                   help="div-pilot part: warm starts (SFT steps) whose pass@k is measured at --n-eval")
    p.add_argument("--marker", default="=")
    p.add_argument("--no-train", action="store_true",
                   help="spurious/diversity parts: train nothing, summarise the runs already in the runs file "
                        "(arms with fewer than --seeds runs are marked partial)")
    p.add_argument("--tag", default="train_grpo",
                   help="results name: RESULTS/TAG.json, TAG.md, TAG.spurious.runs.jsonl, TAG_spurious.png "
                        "(e.g. train_grpo_clip for the clip-binding protocol of issue 43)")
    p.add_argument("--arms", default="", help="spurious arms to run (default all)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--task", default="arith", choices=["arith", "mul"],
                   help="spurious part: the generated task (mul: 2x2- and 3x1-digit multiplication, for Qwen)")
    p.add_argument("--train-layers", type=int, default=0,
                   help="spurious part: train only the last K decoder blocks and the final norm (0 = all; memory)")
    p.add_argument("--workers", type=int, default=1,
                   help="spurious/diversity parts: (arm, seed) runs in parallel processes (e.g. --workers 2 --threads 1)")
    a = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{a.tag}.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    for part in parts:
        t = time.time()
        if part == "bandit":
            res["bandit"] = run_bandit(a.bandit_seeds)
        elif part == "spurious":
            res["spurious"] = run_spurious(a)
        elif part == "diversity":
            res["diversity"] = run_diversity(a)
            res["diversity"]["plot"] = plot_diversity(res["diversity"], a.tag)
        elif part == "div-pilot":
            res["div_pilot"] = merge_pilot(res.get("div_pilot", []), run_div_pilot(a))
        elif part == "cost":
            res["cost"] = run_cost(a)
        else:
            raise SystemExit(f"unknown part {part!r}")
        res.setdefault("commands", {})[part] = " ".join(sys.argv)
        res.setdefault("seconds", {})[part] = time.time() - t
        path.write_text(json.dumps(res, indent=2, default=str))
        (RESULTS / f"{a.tag}.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
