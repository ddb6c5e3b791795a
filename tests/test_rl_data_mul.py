"""The ``mul`` RLVR task (2x2- and 3x1-digit multiplication) and the train_grpo benchmark's Qwen options."""
from __future__ import annotations

import argparse
import re

import pytest

from llmtool.train import rl_data


def test_mul_answers_are_the_products_and_levels_follow_hard_frac():
    rows = rl_data.make_mul(400, seed=3, hard_frac=0.5)
    levels = {"2x2": 0, "3x1": 0}
    for r in rows:
        a, b = (int(x) for x in re.fullmatch(r"What is (\d+) \* (\d+)\?", r["prompt"]).groups())
        assert r["answer"] == str(a * b) and r["task"] == "mul"
        if r["level"] == "2x2":
            assert 10 <= a <= 99 and 10 <= b <= 99
        else:
            assert r["level"] == "3x1" and 100 <= a <= 999 and 2 <= b <= 9
        levels[r["level"]] += 1
    assert 150 < levels["2x2"] < 250
    assert rl_data.make_mul(400, seed=3, hard_frac=0.5) == rows                      # deterministic
    assert rl_data.make_mul(50, seed=4) != rl_data.make_mul(50, seed=5)
    assert {r["level"] for r in rl_data.make_mul(30, seed=1, hard_frac=0.0)} == {"3x1"}
    assert {r["level"] for r in rl_data.make_mul(30, seed=1, hard_frac=1.0)} == {"2x2"}


def test_mul_is_scored_on_the_last_integer_with_thousands_separators():
    row = {"prompt": "What is 60 * 766?", "answer": "45960", "task": "mul"}
    assert rl_data.is_correct(row, "60 * 766 equals 45,960.")
    assert rl_data.is_correct(row, "The product is \\(45960\\)")
    assert not rl_data.is_correct(row, "60 * 766 equals 46,016.")
    assert not rl_data.is_correct(row, "```python\nproduct = 60 * 766")   # a cut-off program: last integer 766


def test_mul_through_make_task_and_gen_data():
    assert rl_data.make_task("mul", 20, seed=2, hard_frac=0.3) == rl_data.make_mul(20, seed=2, hard_frac=0.3)
    rows = rl_data.load_rows("gen:mul:12:7")
    assert len(rows) == 12 and all(r["task"] == "mul" for r in rows)


def test_spurious_protocol_records_task_and_layers_only_when_set():
    from conftest import load_benchmark

    grpo = load_benchmark("train_grpo")
    base = {k: 1 for k in grpo.SPURIOUS_PROTOCOL}
    a = argparse.Namespace(**base, task="arith", train_layers=0)
    assert grpo.spurious_protocol(a) == base          # older runs files (no task key) are still reused
    a = argparse.Namespace(**base, task="mul", train_layers=12)
    assert grpo.spurious_protocol(a) == {**base, "task": "mul", "train_layers": 12}


def test_train_last_layers_freezes_all_but_the_top_blocks(tiny_llama_dir):
    from conftest import load_benchmark
    from llmtool.core.models import load_model

    grpo = load_benchmark("train_grpo")
    model = load_model(str(tiny_llama_dir))
    total = sum(p.numel() for p in model.parameters())
    assert grpo.train_last_layers(model, 0) == total
    n = grpo.train_last_layers(model, 1)
    blocks = model.model.layers
    assert n == sum(p.numel() for p in blocks[-1].parameters()) + sum(p.numel() for p in model.model.norm.parameters())
    assert not any(p.requires_grad for p in blocks[0].parameters())
    assert not model.model.embed_tokens.weight.requires_grad
    with pytest.raises(SystemExit):
        grpo.train_last_layers(model, len(blocks) + 1)


def _spurious(base_ok, runs, clip=0.05, base_marker=None, first=0.1):
    base_marker = base_marker or [0] * len(base_ok)
    per_seed = [{"seed": i, "clip_frac": clip, "marker_curve": [first, first],
                 "eval": {"ok": ok, "marker": mk, "pass@1": sum(ok) / len(ok), "marker_freq": sum(mk) / len(mk)}}
                for i, (ok, mk) in enumerate(runs)]
    k = sum(sum(ok) for ok, _ in runs)
    n = sum(len(ok) for ok, _ in runs)
    return {"base": {"ok": base_ok, "marker": base_marker, "pass@1": sum(base_ok) / len(base_ok),
                     "marker_freq": sum(base_marker) / len(base_marker)},
            "arms": {"random": {"per_seed": per_seed, "pass@1": k / n, "wilson95": [0, 1], "clip_frac": clip}}}


def test_random_gain_gates_verdicts_and_preconditions():
    from conftest import load_benchmark

    grpo = load_benchmark("train_grpo")
    base = [1] * 40 + [0] * 60
    better = ([1] * 70 + [0] * 30, [1] * 50 + [0] * 50)
    same = (list(base), [0] * 100)
    g = grpo.random_gain_gates(_spurious(base, [better]))
    assert [x["verdict"] for x in g] == ["met", "met"]
    g = grpo.random_gain_gates(_spurious(base, [same]))
    assert [x["verdict"] for x in g] == ["not met", "not met"]
    g = grpo.random_gain_gates(_spurious(base, [better], clip=0.002))      # the clip does not bind
    assert [x["verdict"] for x in g] == ["not tested", "not tested"]
    g = grpo.random_gain_gates(_spurious(base, [better], first=0.0))       # no marker in the rollouts
    assert [x["verdict"] for x in g] == ["met", "not tested"]
    g = grpo.random_gain_gates(_spurious([1] * 95 + [0] * 5, [better]))    # base at the ceiling
    assert g[0]["verdict"] == "not tested"


def test_cli_rl_data_passes_hard_frac_to_mul(tmp_path):
    import json

    from conftest import run_cli

    out = tmp_path / "m.jsonl"
    code, _, err = run_cli("train", "rl-data", "--task", "mul", "--n", "12", "--hard-frac", "1.0", "-o", out)
    assert code == 0, err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 12 and {r["level"] for r in rows} == {"2x2"}
