"""LLM-PV: propose k programs, verify each in the sandbox, select by validation accuracy
(Singhal et al., "LLM Priors for ERM over Programs", arXiv 2510.14331; spec llm-pv §3).

The estimator is ERM over the finite class of proposed programs: ĥ = argmax_j val_acc(h_j) with the
paper's guarantee err(ĥ) <= ε + 2·sqrt(log(4k/δ) / (2·m_val)) (their Theorem statement, §1 of the spec).
No feedback from validation into the sampler; optional early stop once a proposal reaches val 1.0.
Test accuracy is computed only for the selected program (``eval_test_all`` adds every candidate's,
as the analysis field ``oracle_test_best``: the official runner's best-by-test figure).

Files (into ``out_dir``): ``prompt.txt`` (once; its SHA-256 is in every candidate line),
``candidates.jsonl``, ``selected.py``, ``summary.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from llmtool.core.console import UsageError, info
from llmtool.core.sandbox import SandboxLimits, active_layers
from llmtool.learn_program import programs
from llmtool.learn_program.proposers import Proposer
from llmtool.learn_program.tasks import TASKS, Dataset, generate


@dataclass
class LLMPVConfig:
    samples: int = 16
    trials: int = 1
    early_stop: bool = True
    timeout_s: float = 10.0
    mem_mb: int = 1024
    max_output_kb: int = 1024
    sandbox_cmd: list[str] | None = None
    test_lengths: tuple[int, ...] = ()
    test_size: int = 10_000
    eval_test_all: bool = False
    seed: int = 0
    test_timeout_factor: float = 10.0
    extra: dict = field(default_factory=dict)

    def limits(self, factor: float = 1.0) -> SandboxLimits:
        return SandboxLimits(cpu_seconds=self.timeout_s * factor, wall_seconds=self.timeout_s * factor + 2,
                             memory_mb=self.mem_mb, output_bytes=self.max_output_kb * 1024)


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def run_llmpv(ds: Dataset, proposer: Proposer, cfg: LLMPVConfig, out_dir: Path | None = None) -> dict:
    if cfg.samples < 1 or cfg.trials < 1:
        raise UsageError("--samples and --trials must be >= 1")
    out_dir = Path(out_dir) if out_dir is not None else None
    kind = ds.meta.get("kind", "binary")
    prompt = programs.build_prompt(ds.train, kind, ds.meta.get("length"), seed=cfg.seed)
    prompt_sha = hashlib.sha256(prompt.encode()).hexdigest()
    cand_fh = None
    if out_dir is not None:
        (out_dir / "prompt.txt").write_text(prompt, encoding="utf-8")
        cand_fh = open(out_dir / "candidates.jsonl", "w", encoding="utf-8")
    rows = ds.train + ds.val
    n_train = len(ds.train)
    limits = cfg.limits()
    test_limits = cfg.limits(cfg.test_timeout_factor)
    all_cands: list[dict] = []
    trials = []
    t_start = time.monotonic()
    propose_s = sandbox_s = 0.0
    executions = 0
    try:
        for trial in range(cfg.trials):
            cands: list[dict] = []
            early = False
            stream = proposer.stream(prompt, cfg.samples, cfg.seed + 100_000 * trial, trial)
            t_prop = time.monotonic()
            for idx, prop in enumerate(stream):
                propose_s += time.monotonic() - t_prop
                code = programs.extract_code(prop.text)
                fname = programs.function_name(code) if code else None
                c = {"idx": idx, "trial": trial, "raw_text": prop.text, "code": code, "parse_ok": code is not None,
                     "compile_ok": fname is not None, "function": fname, "error": None, "train_acc": None,
                     "val_acc": None, "runtime_ms": 0.0, "timed_out": False, "tokens": prop.tokens,
                     "length": programs.source_length(code) if code else None, "prompt_sha256": prompt_sha}
                if code is None:
                    c["error"] = "no function definition found in the answer"
                elif fname is None:
                    c["error"] = "the code does not parse (SyntaxError)"
                else:
                    ev = programs.evaluate(code, fname, rows, limits, cfg.sandbox_cmd)
                    sandbox_s += ev.seconds
                    executions += len(rows)
                    tr = ev.predictions[:n_train]
                    va = ev.predictions[n_train:]
                    c["train_acc"] = sum(p == y for p, (_, y) in zip(tr, ds.train)) / max(1, len(ds.train))
                    c["val_acc"] = sum(p == y for p, (_, y) in zip(va, ds.val)) / max(1, len(ds.val))
                    c["runtime_ms"] = round(ev.seconds * 1000, 2)
                    c["timed_out"] = ev.timed_out
                    c["error"] = ev.first_error
                    c["n_errors"] = ev.errors
                c["outcome"] = programs.outcome(c)
                cands.append(c)
                if cand_fh:
                    cand_fh.write(json.dumps(c) + "\n")
                    cand_fh.flush()
                if cfg.early_stop and c["val_acc"] == 1.0:
                    early = True
                    break
                t_prop = time.monotonic()
            sel = programs.select(cands)
            test_acc = None
            if sel is not None and ds.test:
                ev = programs.evaluate(sel["code"], sel["function"], ds.test, test_limits, cfg.sandbox_cmd)
                sandbox_s += ev.seconds
                executions += len(ds.test)
                test_acc = ev.acc
                sel["test_acc"] = test_acc
            trials.append({"trial": trial, "k_used": len(cands), "early_stopped": early,
                           "selected_idx": sel["idx"] if sel else None,
                           "best_val": sel["val_acc"] if sel else None,
                           "train_acc": sel["train_acc"] if sel else None, "test_acc": test_acc,
                           "any_val_perfect": any(c["val_acc"] == 1.0 for c in cands)})
            all_cands.extend(cands)
            info(f"trial {trial}: {len(cands)} proposals, best val {trials[-1]['best_val']}, test {test_acc}")
    finally:
        if cand_fh:
            cand_fh.close()

    overall = programs.select(all_cands)
    oracle = None
    if cfg.eval_test_all and ds.test:
        accs = []
        for c in all_cands:
            if c["compile_ok"]:
                if "test_acc" not in c:
                    c["test_acc"] = programs.evaluate(c["code"], c["function"], ds.test, test_limits,
                                                      cfg.sandbox_cmd).acc
                accs.append(c["test_acc"])
        oracle = max(accs) if accs else None
        if out_dir is not None:  # rewrite with the analysis field
            with open(out_dir / "candidates.jsonl", "w", encoding="utf-8") as fh:
                for c in all_cands:
                    fh.write(json.dumps(c) + "\n")

    length_gen = {}
    if cfg.test_lengths:
        task = ds.meta.get("task")
        if task not in TASKS:
            raise UsageError("--test-lengths needs a built-in task (--task, or --data made by `llmtool tasks generate`)")
        seen = {x for x, _ in rows}
        for L in cfg.test_lengths:
            if overall is None:
                length_gen[str(L)] = None
                continue
            if L == ds.meta.get("length") and ds.test:
                test_rows = ds.test
            else:
                test_rows = generate(task, L, 0, 0, cfg.test_size, seed=cfg.seed + L, exclude=seen).test
            ev = programs.evaluate(overall["code"], overall["function"], test_rows, test_limits, cfg.sandbox_cmd)
            executions += len(test_rows)
            sandbox_s += ev.seconds
            length_gen[str(L)] = ev.acc

    if out_dir is not None and overall is not None:
        (out_dir / "selected.py").write_text(overall["code"], encoding="utf-8")
    n = len(all_cands)
    test_accs = [t["test_acc"] for t in trials if t["test_acc"] is not None]
    summary = {
        "task": ds.meta.get("task"), "length": ds.meta.get("length"),
        "sizes": {"train": len(ds.train), "val": len(ds.val), "test": len(ds.test)},
        "proposer": proposer.spec, "k_requested": cfg.samples, "k_used": n, "trials": cfg.trials,
        "early_stop": cfg.early_stop, "early_stopped": [t["early_stopped"] for t in trials],
        "selected_trial": overall["trial"] if overall else None, "selected_idx": overall["idx"] if overall else None,
        "best_val": overall["val_acc"] if overall else None,
        "train_acc": overall["train_acc"] if overall else None,
        "test_acc": overall.get("test_acc") if overall else None,
        "test_acc_mean": statistics.fmean(test_accs) if test_accs else None,
        "test_acc_sd": _sd(test_accs) if test_accs else None,
        "per_trial": trials,
        "pass_rate_val_perfect": sum(t["any_val_perfect"] for t in trials) / len(trials),
        "parse_rate": sum(c["parse_ok"] for c in all_cands) / n if n else 0.0,
        "compile_rate": sum(c["compile_ok"] for c in all_cands) / n if n else 0.0,
        "outcomes": {k: sum(c["outcome"] == k for c in all_cands) for k in programs.OUTCOMES},
        "length_generalization": length_gen,
        "oracle_test_best": oracle,
        "timeout_s": cfg.timeout_s, "mem_mb": cfg.mem_mb,
        "sandbox_cmd": cfg.sandbox_cmd,
        "sandbox_layers": active_layers(cfg.sandbox_cmd),   # what a candidate's process really got
        "proposals_per_s": n / propose_s if propose_s > 0 else None,
        "sandbox_executions_per_s": executions / sandbox_s if sandbox_s > 0 else None,
        "tokens": sum(c["tokens"] or 0 for c in all_cands),
        "seconds": round(time.monotonic() - t_start, 3),
        "prompt_sha256": prompt_sha,
        "bound_delta_0.05": 2 * math.sqrt(math.log(4 * max(1, n) / 0.05) / (2 * len(ds.val))) if ds.val else None,
    }
    if out_dir is not None:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def load_or_generate(data: str | None, task: str | None, length: int, n_train: int, n_val: int, n_test: int,
                     seed: int) -> Dataset:
    from llmtool.learn_program.tasks import read_dataset

    if (data is None) == (task is None):
        raise UsageError("give exactly one of --data DIR or --task NAME")
    if data is not None:
        return read_dataset(Path(data))
    return generate(task, length, n_train, n_val, n_test, seed=seed)


__all__ = ["LLMPVConfig", "run_llmpv", "load_or_generate", "asdict", "replace"]
