"""benchmarks/grpo_signal.py: the share of GRPO groups with reward variance, on counts and on a tiny model."""
import argparse

from conftest import load_benchmark

grpo_signal = load_benchmark("grpo_signal")


def test_group_signal_counts_only_groups_with_mixed_rewards():
    per = [{"n": 8, "correct": 0}, {"n": 8, "correct": 8}, {"n": 8, "correct": 3}, {"n": 8, "correct": 1}]
    s = grpo_signal.group_signal(per)
    assert (s["with_variance"], s["all_wrong"], s["all_right"], s["prompts"]) == (2, 1, 1, 4)
    assert s["share_with_variance"] == 0.5


def test_measure_on_a_tiny_model_accounts_for_every_prompt(tiny_llama_dir):
    a = argparse.Namespace(rows=4, seed=400, max_new_tokens=4, temperature=1.0, group_size=2, batch_size=8)
    r = grpo_signal.measure(str(tiny_llama_dir), "sum-two", a)
    assert r["prompts"] == 4 and r["with_variance"] + r["all_wrong"] + r["all_right"] == 4
    assert 0.0 <= r["mean_reward_ci"][0] <= r["mean_reward"] <= r["mean_reward_ci"][1] <= 1.0
    assert len(r["samples"]) == 3 and r["max_new_tokens"] == 4


def test_bad_sizes_are_refused_before_any_model_loads():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "grpo_signal.py"
    for bad in (["--group-size", "1"], ["--rows", "0"], ["--temperature", "0"]):
        p = subprocess.run([sys.executable, str(script), "--models", "no-such-model", *bad], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2 and "need --rows" in p.stderr
