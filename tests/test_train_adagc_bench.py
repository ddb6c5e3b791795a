"""Helpers of benchmarks/train_adagc.py added for issue 43: the fault-tensor choice (lowest AdaGC clip rate),
the regime measurements (per-tensor log-sd of gradient norms, the rule's long-run clip fraction, the regime
accumulation) and the grad-fault gate that replaced 'spike score adagc <= global'."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import load_benchmark

B = load_benchmark("train_adagc")  # puts the repository root on sys.path
from benchmarks import gates  # noqa: E402


def test_tensor_clip_rates_count_adaptive_updates_before_the_fault_only():
    log = [("warmup", {"a": 1.0, "b": 1.0}, frozenset({"a", "b"})),      # update 1: warm-up, not counted
           ("adaptive", {"a": 1.0, "b": 1.0}, frozenset({"a"})),        # 2
           ("adaptive", {"a": 1.0, "b": 1.0}, frozenset({"a", "b"})),   # 3
           ("adaptive", {"a": 1.0, "b": 1.0}, frozenset()),             # 4
           ("adaptive", {"a": 1.0, "b": 1.0}, frozenset({"b"}))]        # 5: at the fault, not counted
    rates = B.tensor_clip_rates(log, until=5)
    assert rates == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    assert B.choose_fault_tensor(rates) == "b"
    assert B.tensor_clip_rates(log) == pytest.approx({"a": 0.5, "b": 0.5})
    # ties go to model order, not to the name
    assert B.choose_fault_tensor({"z": 0.0, "a": 0.0}, ["z", "a"]) == "z"
    with pytest.raises(ValueError):
        B.choose_fault_tensor({})


def test_log_sd_detrends_a_drift_and_measures_noise():
    drift = [math.exp(2.0 - 0.01 * t) for t in range(50)]
    assert B.log_sd(drift) == pytest.approx(0.0, abs=1e-9)
    assert B.log_sd(drift, detrend=False) > 0.1
    g = torch.Generator().manual_seed(0)
    noisy = (torch.randn(4000, generator=g, dtype=torch.float64) * 0.2).exp().tolist()
    assert B.log_sd(noisy) == pytest.approx(0.2, rel=0.05)
    assert math.isnan(B.log_sd([1.0, None]))


def test_stationary_clip_fraction_rises_with_noise():
    fr = [B.stationary_clip_fraction(s, n=6000, burn=3000) for s in (0.0, 0.005, 0.03, 0.1, 0.29)]
    assert fr[0] == 0.0 and fr[1] < 0.01
    assert fr == sorted(fr) and fr[-1] > 0.6          # the noise at batch 4 x 128: most updates clipped
    # a bigger relative threshold clips less at the same noise
    assert B.stationary_clip_fraction(0.1, lambda_rel=1.5, n=6000) < fr[3]


def test_regime_accum_is_the_smallest_accumulation_below_the_threshold():
    rows = [{"accum": 1, "clip_fraction": 0.9}, {"accum": 4, "clip_fraction": 0.4},
            {"accum": 16, "clip_fraction": 0.08}, {"accum": 64, "clip_fraction": 0.02}]
    assert B.regime_accum(rows, 0.10) == 16
    assert B.regime_accum(rows, 0.5) == 4
    assert B.regime_accum(rows, 0.01) is None


def test_regime_row_from_recorded_norms():
    n = 40
    g = torch.Generator().manual_seed(1)
    norms = {"a": (torch.randn(n, generator=g) * 0.3).exp().tolist(), "b": [1.0 + 0.001 * t for t in range(n)]}
    stages = ["warmup"] * 10 + ["adaptive"] * (n - 10)
    clipped = {"a": [0] * 10 + [1] * (n - 10), "b": [0] * n}
    run = {"grad_accum": 4, "stages": stages, "tensor_norms": norms, "tensor_clipped": clipped,
           "final_train_loss": 5.0, "val_loss": 5.1, "seconds": 1.0}
    row = B.regime_row(run, 4, 128, 1.04, 0.99)
    assert row["effective_batch"] == 16 and row["tokens_per_update"] == 2048 and row["adaptive_updates"] == 30
    assert row["clip_fraction"] == pytest.approx(0.5)
    assert row["clip_rate_by_tensor"] == pytest.approx({"a": 1.0, "b": 0.0})
    assert row["log_sd_by_tensor"]["b"] < 0.01 < row["log_sd_by_tensor"]["a"]
    assert row["predicted_clip_fraction"] > 0.2


def test_fault_excess_gate_separates_the_arms_and_says_when_it_cannot():
    # the old spike-score gate passed here (scores tied at 0 %); this one fails a tie
    tie = B.fault_excess_gate(0.01, 0.01, 0.05)
    assert tie["verdict"] == gates.NOT_MET
    assert B.fault_excess_gate(0.001, 0.01, 0.05)["verdict"] == gates.MET
    assert B.fault_excess_gate(0.009, 0.01, 0.05)["verdict"] == gates.NOT_MET          # within the margin
    quiet = B.fault_excess_gate(0.0, 0.0, 0.001)
    assert quiet["verdict"] == gates.NOT_TESTED and "does not perturb" in quiet["reason"]
    clipped = B.fault_excess_gate(0.0, 0.01, 0.05, target_rate=0.95)                # issue 43: v_proj at 95-100 %
    assert clipped["verdict"] == gates.NOT_TESTED and "already clips" in clipped["reason"]
    assert B.fault_excess_gate(0.0, 0.01, 0.05, target_rate=0.2)["verdict"] == gates.MET


def test_identical_post_fault_and_target_clip_rate():
    import types

    a = types.SimpleNamespace(fault_step=3, window=2)
    clean = {"loss": [5.0, 4.9, 4.8, 4.7, 4.6]}
    assert B.identical_post_fault({"loss": [5.0, 4.9, 4.8, 4.75, 4.6]}, clean, a) == 2
    new = [{"tensor_clip_rates": {"t": 0.1}}, {"tensor_clip_rates": {"t": 0.3}}]
    assert B.target_clip_rate(new, "t") == (pytest.approx(0.2), "adaptive updates before the fault")
    old = [{"loss": [0.0] * 10, "top_clipped_second_half": [["t", 5], ["u", 4]]}]
    assert B.target_clip_rate(old, "t") == (1.0, "second half of the clean run")
    assert B.target_clip_rate(old, "v") == (None, "not recorded")


def _tiny_data():
    g = torch.Generator().manual_seed(0)
    blocks = [{"input_ids": torch.randint(0, 50, (16,), generator=g).tolist()} for _ in range(60)]
    return {"train": blocks[:48], "val": blocks[48:], "vocab": 50, "eos": 0}


def test_lowest_clip_selection_picks_the_least_clipped_tensor_and_the_fault_hits_it(tmp_path):
    data = _tiny_data()
    a = B.parse_args(["--steps", "12", "--fault-step", "9", "--window", "3", "--layers", "1", "--d-model", "32",
                      "--heads", "2", "--max-length", "16", "--batch-size", "2", "--adagc-warmup", "3",
                      "--grad-tensor", "lowest-clip", "--faults", "grad", "--arms", "none,adagc"])
    choice = B.select_fault_tensor(a, data, "adamw", lambda m: None)
    rates = choice["rates"]
    assert choice["updates"] == 8 and len(rates) == 11           # 1 layer: 9 tensors + embedding + final norm
    assert rates[choice["chosen"]] == min(rates.values())
    # every rate is a multiple of 1/5: updates 4..8 are the adaptive ones before the fault
    assert all(abs(5 * r - round(5 * r)) < 1e-3 for r in rates.values())
    jargs = {k: getattr(a, k) for k in ("steps", "batch_size", "max_length", "layers", "d_model", "heads", "lr",
                                        "lion_lr", "adam_beta2", "adam_epsilon", "weight_decay", "adagc_warmup",
                                        "grad_scale", "grad_steps", "garbage_steps", "lr_factor", "lr_steps",
                                        "spike_window", "spike_sigma", "fault_step")}
    jargs["grad_tensor"] = choice["chosen"]
    job = {"args": jargs, "data": data, "threads": 1, "optimizer": "adamw", "arm": "none", "seed": 0}
    clean = B.run_one({**job, "fault": "clean"})
    hit = B.run_one({**job, "fault": "grad"})
    assert hit["grad_tensor"] == choice["chosen"] and hit["faults"]["grad_spikes"]
    assert hit["loss"][:9] == clean["loss"][:9] and hit["loss"][9:] != clean["loss"][9:]
    assert clean["grad_norm"][8] < hit["grad_norm"][8]             # the x1e3 gradient at update 9


def test_regime_runs_continue_the_base_state_with_accumulation(tmp_path):
    # a learnable pattern (arithmetic runs mod 50), so that the base's training shows in the continuation's loss
    blocks = [{"input_ids": [(3 * j + k) % 50 for j in range(16)]} for k in range(60)]
    data = {"train": blocks[:48], "val": blocks[48:], "vocab": 50, "eos": 0}
    common = {"batch_size": 2, "max_length": 16, "layers": 1, "d_model": 32, "heads": 2, "lr": 3e-3, "lion_lr": 3e-4,
              "adam_beta2": 0.999, "adam_epsilon": 1e-12, "weight_decay": 0.1, "grad_scale": 1e3, "grad_steps": 2,
              "garbage_steps": 2, "lr_factor": 30.0, "lr_steps": 2, "spike_window": 4, "spike_sigma": 3.0,
              "grad_tensor": ""}
    base = tmp_path / "base.pt"
    b = B.run_one({"args": {**common, "steps": 30, "adagc_warmup": 3, "fault_step": 31}, "data": data, "threads": 1,
                   "optimizer": "adamw", "arm": "global", "fault": "clean", "seed": 0, "save_state": str(base)})
    job = {"args": {**common, "steps": 6, "adagc_warmup": 2, "fault_step": 5, "grad_accum": 3}, "data": data,
           "threads": 1, "optimizer": "adamw", "arm": "adagc", "fault": "clean", "seed": 1, "record_norms": True}
    cont = B.run_one({**job, "init": str(base)})
    fresh = B.run_one(job)
    assert cont["grad_accum"] == 3 and cont["stages"] == ["warmup"] * 2 + ["adaptive"] * 4
    assert len(cont["tensor_norms"]["model.embed_tokens.weight"]) == 6
    assert b["loss"][-1] < b["loss"][0] - 0.5                      # the base learned the pattern
    assert cont["loss"][0] < fresh["loss"][0] - 0.5 and abs(cont["loss"][0] - b["loss"][-1]) < 0.5
    row = B.regime_row(cont, 2, 16, 1.04, 0.99)
    assert row["effective_batch"] == 6 and 0.0 <= row["clip_fraction"] <= 1.0


def test_sampling_noise_falls_with_the_accumulation():
    from llmtool.core.models import tiny_llama

    data = _tiny_data()
    model = tiny_llama(50, layers=1, d_model=32, heads=2, max_length=16, seed=0, eos_token_id=0)
    noise = B.sampling_noise(model, data["train"][:32], [1, 32], batch_size=1, draws=200)
    names = [n for n, _ in model.named_parameters()]
    assert set(noise[1]) == set(names)
    med = {k: sorted(v.values())[len(v) // 2] for k, v in noise.items()}
    assert med[1] > 1.2 * med[32] > 0          # measured 0.131 vs 0.088 on these random tokens
    assert all(p.grad is None for p in model.parameters())
