"""The SHIFT-with-RL pool's difficulty (issue 42's calibrated pool): reasoning-gym rows made with a generator
configuration are verified against that configuration, the benchmark's GRPO pool is the selection features' pool
item for item, and the default difficulty keeps the committed runs' protocol."""
from __future__ import annotations

import argparse
import json
import re

import pytest
from conftest import load_benchmark

pytest.importorskip("reasoning_gym")

from llmtool.train import rl_data  # noqa: E402

EASY_SUM = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"],
            "allow_parentheses": False, "allow_negation": False}


def test_config_rows_are_verified_against_their_config():
    rows = rl_data.make_reasoning_gym("basic_arithmetic", 20, seed=3, config=EASY_SUM)
    rows = [json.loads(json.dumps(r)) for r in rows]  # as read back from a JSONL file: tuples became lists
    assert all(r["rg_config"] == EASY_SUM for r in rows)
    assert all(rl_data.is_correct(r, f"work\n{r['answer']}") for r in rows)
    assert not any(rl_data.is_correct(r, f"{r['answer']}1") for r in rows)
    # two operands of "one digit" (reasoning-gym draws 0..10): |answer| <= 20
    assert all(abs(int(r["answer"])) <= 20 for r in rows)
    # the verifier needs the config: the same index of the default generator is another problem
    plain = [{k: v for k, v in r.items() if k != "rg_config"} for r in rows]
    assert sum(rl_data.is_correct(p, r["answer"]) for p, r in zip(plain, rows)) < len(rows) // 2


def test_bad_config_field_is_a_usage_error():
    from llmtool.core.console import UsageError

    with pytest.raises(UsageError, match="basic_arithmetic"):
        rl_data.make_reasoning_gym("basic_arithmetic", 2, config={"no_such_field": 1})


@pytest.mark.parametrize("difficulty", ["default", "easy"])
def test_grpo_pool_is_the_feature_pool(difficulty):
    sd = load_benchmark("select_data")
    rl = load_benchmark("select_data_rl")
    feats_pool = sd.shift_pool(4, difficulty=difficulty)
    grpo_pool = rl.pool_rows(4, difficulty)
    suffix = "\nGive only the final answer on the last line."
    assert [r["prompt"] + suffix for r in feats_pool] == [r["prompt"] for r in grpo_pool]
    assert [r["generator"] for r in feats_pool] == [r["generator"] for r in grpo_pool]


def test_easy_pool_is_easier_and_its_test_set_another_seed():
    rl = load_benchmark("select_data_rl")
    easy, default = rl.pool_rows(10, "easy"), rl.pool_rows(10, "default")
    ints = [abs(int(r["answer"])) for r in easy if r["generator"] in ("basic_arithmetic", "products")]
    assert max(ints) <= 100
    big = [abs(int(r["answer"])) for r in default if r["generator"] in ("basic_arithmetic", "products")]
    assert max(big) > 1000
    words = [r for r in easy if r["generator"] == "spell_backward"]
    assert all(3 <= len(re.sub(r"\W", "", r["answer"])) <= 4 for r in words)
    test, _ = rl.test_rows(10, 0, "easy")
    assert all(r.get("rg_config") == rl.POOL_CONFIGS["easy"].get(r["generator"]) for r in test if "rg_config" in r)
    assert all(r["rg_seed"] == 1000 for r in test) and all(r["rg_seed"] == 0 for r in easy)


def test_default_difficulty_keeps_the_committed_protocol():
    rl = load_benchmark("select_data_rl")
    base = {k: 1 for k in rl.PROTOCOL}
    default = rl.run_protocol(argparse.Namespace(**base, difficulty="default"), "abc")
    assert "difficulty" not in default and default["start_checksum"] == "abc"
    easy = rl.run_protocol(argparse.Namespace(**base, difficulty="easy"), "abc")
    assert easy["difficulty"] == "easy"
    # the committed runs file's protocol keys are exactly the default protocol's
    rec = json.loads((rl.RESULTS / "select_data_rl.runs.jsonl").read_text().splitlines()[0])
    assert set(rec["protocol"]) == set(default)


def _record(arm: str, seed: int, ok: list[int]) -> dict:
    return {"arm": arm, "seed": seed, "ids": [0], "generators": ["products"],
            "in_domain": {"pass@1": sum(ok) / len(ok), "ok": ok}, "transfer": None, "train_reward": [0.5],
            "zero_variance_groups": [0.5], "truncated": [0.0], "seconds": 1.0}


def _report(rl, res: dict, seeds: int, n_in_domain: int) -> str:
    """The benchmark's markdown report of a summary. The settings only fill the report's header line, which no
    assertion reads, so each is a minimal valid value."""
    settings = {"pool_per_gen": 1, "budget": 1, "steps": 1, "prompts": 1, "group_size": 1, "lr": 1, "updates": 1,
                "max_new_tokens": 1, "model": "m", "warmup_steps": 0}
    return rl.markdown({**res, "settings": settings, "command": "c", "seeds": seeds, "start_checksum": "x",
                        "n_in_domain": n_in_domain, "n_transfer": 0})


@pytest.mark.parametrize("seeds,gain,expected", [(1, 40, "not tested"), (3, 40, "met"), (3, 2, "not met")])
def test_full_pool_gate_needs_three_seeds(seeds, gain, expected):
    """One seed's gain is not the gate's evidence: below three training seeds the verdict is "not tested", even
    for a 40-point gain; over three seeds it is met or not met by the paired gain."""
    rl = load_benchmark("select_data_rl")
    n = 100
    gens = [rl.GENERATORS[i % len(rl.GENERATORS)] for i in range(n)]
    base = [1] * 30 + [0] * 70
    trained = [1] * (30 + gain) + [0] * (70 - gain)
    done = {("base", 0): _record("base", 0, base)}
    done.update({("full", s): _record("full", s, trained) for s in range(seeds)})
    res = rl.summarise(done, ["full"], seeds, gens, draws=50)
    g = res["gate"]["full - base >= 0.05 in-domain"]
    assert g["verdict"] == expected
    assert abs(res["gate"]["delta"] - gain / n) < 1e-9
    text = _report(rl, res, seeds, n)
    shown = text.split("**Gate**")[1].splitlines()[0].split("in-domain: ")[1].lower()
    assert shown.startswith((expected + " (measured", expected + ":"))


def test_summary_holds_arms_with_fewer_seeds():
    """--report-only summarises finished runs: an arm is reported over the seeds it has (and says how many), an arm
    without runs is left out, and the full-pool gate counts the full arm's own seeds."""
    rl = load_benchmark("select_data_rl")
    n = 70
    gens = [rl.GENERATORS[i % len(rl.GENERATORS)] for i in range(n)]
    done = {("base", 0): _record("base", 0, [1] * 20 + [0] * 50)}
    done.update({("full", s): _record("full", s, [1] * 40 + [0] * 30) for s in range(3)})
    done[("random", 0)] = _record("random", 0, [1] * 25 + [0] * 45)
    done[("shift", 0)] = _record("shift", 0, [1] * 35 + [0] * 35)
    res = rl.summarise(done, ["full", "shift", "random", "kcenter"], 3, gens, draws=50)
    assert list(res["arms"]) == ["full", "shift", "random"]
    assert [res["arms"][x]["seeds"] for x in res["arms"]] == [3, 1, 1]
    assert res["gate"]["full - base >= 0.05 in-domain"]["verdict"] == "met"
    assert abs(res["arms"]["shift"]["minus_random"] - 10 / n) < 1e-9


def test_label_prior_generators_are_those_a_constant_answer_passes():
    """A generator whose test answers are one value at >= 90 % is named with that answer and share; one at 80 % is
    not."""
    rl = load_benchmark("select_data_rl")
    rows = ([{"generator": "syllogism", "answer": "Yes"}] * 9 + [{"generator": "syllogism", "answer": "No"}]
            + [{"generator": "products", "answer": str(i % 5)} for i in range(10)]
            + [{"generator": "chain_sum", "answer": " 4"}] * 8 + [{"generator": "chain_sum", "answer": "5"}] * 2)
    assert rl.label_prior_generators(rows) == {"syllogism": ("Yes", 0.9)}


def test_sensitivity_rows_leave_out_the_label_prior_generator():
    """An arm whose only change from the start is a label flip on the label-prior generator (10 items lost) is
    -10/70 in-domain and exactly 0 without that generator; its difference to random over the other items is the
    per-item mean over those items alone, and the report prints the table."""
    rl = load_benchmark("select_data_rl")
    gens = ["syllogism"] * 10 + [g for g in rl.GENERATORS if g != "syllogism" for _ in range(10)]
    base = [1] * 10 + [1] * 20 + [0] * 40
    flipped = [0] * 10 + [1] * 20 + [0] * 40
    rnd = [1] * 10 + [1] * 26 + [0] * 34
    done = {("base", 0): _record("base", 0, base), ("shift", 0): _record("shift", 0, flipped),
            ("random", 0): _record("random", 0, rnd)}
    res = rl.summarise(done, ["shift", "random"], 1, gens, draws=50, prior_gens={"syllogism": ("Yes", 1.0)})
    assert abs(res["arms"]["shift"]["delta_vs_base"] + 10 / 70) < 1e-9
    w = res["arms"]["shift"]["without_label_prior"]
    assert w["n_items"] == 60 and w["delta_vs_base"] == 0.0
    assert abs(w["minus_random"] + 6 / 60) < 1e-9 and abs(res["arms"]["shift"]["minus_random"] + 16 / 70) < 1e-9
    assert abs(res["arms"]["random"]["without_label_prior"]["delta_vs_base"] - 6 / 60) < 1e-9
    assert abs(res["base"]["in_domain_without_label_prior"] - 20 / 60) < 1e-9
    text = _report(rl, res, 1, 70)
    assert "over the 60 test items" in text and "syllogism (100 % of its test answers 'Yes')" in text
    assert "| shift | 0.333 | +0.000" in text


def test_shift_minus_each_arm_is_the_paired_item_difference():
    """SHIFT − arm is SHIFT's seed-averaged per-item score minus the arm's, for every arm but SHIFT (random, a
    coreset, the full pool), over all items and over the items left after the label-prior generator, and the
    report prints the column in both tables."""
    rl = load_benchmark("select_data_rl")
    gens = ["syllogism"] * 10 + [g for g in rl.GENERATORS if g != "syllogism" for _ in range(10)]
    base = [1] * 10 + [1] * 20 + [0] * 40
    shift = [0] * 10 + [1] * 24 + [0] * 36          # flips syllogism, +4 elsewhere
    kcenter_s0 = [1] * 10 + [1] * 30 + [0] * 30     # +10 elsewhere
    kcenter_s1 = [1] * 10 + [1] * 20 + [0] * 40     # unchanged
    rnd = [1] * 10 + [1] * 22 + [0] * 38
    done = {("base", 0): _record("base", 0, base), ("shift", 0): _record("shift", 0, shift),
            ("shift", 1): _record("shift", 1, shift), ("random", 0): _record("random", 0, rnd),
            ("random", 1): _record("random", 1, rnd), ("kcenter", 0): _record("kcenter", 0, kcenter_s0),
            ("kcenter", 1): _record("kcenter", 1, kcenter_s1)}
    res = rl.summarise(done, ["shift", "random", "kcenter"], 2, gens, draws=50,
                       prior_gens={"syllogism": ("Yes", 1.0)})
    kc = res["arms"]["kcenter"]
    # shift: 24 of 70; kcenter: mean of 40 and 30 of 70 = 35
    assert abs(kc["shift_minus"] - (24 - 35) / 70) < 1e-9
    assert abs(kc["without_label_prior"]["shift_minus"] - (24 - 25) / 60) < 1e-9
    assert abs(res["arms"]["random"]["shift_minus"] - (24 - 32) / 70) < 1e-9
    assert "shift_minus" not in res["arms"]["shift"]
    lo, hi = kc["shift_minus_ci95"]
    assert lo <= kc["shift_minus"] <= hi
    text = _report(rl, res, 2, 70)
    assert text.count("SHIFT − arm [95 % CI]") == 2
    assert f"| {kc['shift_minus']:+.3f} [" in text


def test_another_budget_takes_the_start_and_full_pool_runs_of_the_same_protocol(tmp_path):
    """--reference-from lends a new budget the starting policy's evaluation and the full-pool runs trained under the
    same settings apart from the budget and feature length; never a selector's run (its picks depend on the budget),
    and nothing under another training setting."""
    from llmtool.core.runlog import RunLog

    rl = load_benchmark("select_data_rl")
    path = tmp_path / "b16.runs.jsonl"
    p16 = {"budget": 16, "feature_tokens": 48, "lr": 1e-5, "start_checksum": "abc"}
    log = RunLog(path, p16, rl.run_key)
    for arm, seed in [("base", 0), ("full", 0), ("full", 1), ("shift", 0)]:
        log.append(_record(arm, seed, [1, 0]))
    lent = rl.reference_runs(path, {**p16, "budget": 7, "feature_tokens": 32})
    assert sorted(lent) == [("base", 0), ("full", 0), ("full", 1)]
    assert lent[("full", 1)] == _record("full", 1, [1, 0])
    assert rl.reference_runs(path, {**p16, "budget": 7, "lr": 5e-5}) == {}
    assert rl.reference_runs(path, {**p16, "budget": 7, "start_checksum": "def"}) == {}


def test_reference_from_a_missing_runs_file_is_a_usage_error():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "select_data_rl.py"), "--reference-from",
                          "no_such_tag", "--report-only"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 2
    assert "--reference-from: no runs file no_such_tag.runs.jsonl" in out.stderr.strip().splitlines()[-1]
