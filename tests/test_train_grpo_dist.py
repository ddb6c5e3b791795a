"""`train grpo` under two processes (torchrun, gloo, CPU) against one process with the equivalent gradient
accumulation: same parameters, same reduced metrics, exactly one output.

Why equality is expected (grpo.GRPOTrainerLoop's docstring): a phase's prompts are numbered over all ranks,
a generation batch is seeded by its first prompt's position (``--batch-size G`` = one prompt per batch, so a
prompt's rollouts do not depend on the launch), random rewards are keyed by the same positions, one seeded
shuffle of the global rollout numbering defines every mini-batch, and each rank's loss is normalised by the
mini-batch's global counts and scaled by the world size before DDP averages. So 2 processes with
``--prompts-per-rollout P --mini-batch M`` take the optimizer steps of 1 process with ``2P`` and ``2M``; what
differs is float summation order (micro-batch padding, the all-reduce), hence the tolerance below.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import run_cli

TOL = 2e-5          # max |Δθ| between the launches; one AdamW step moves weights by ~lr = 1e-3
COMMON = ["--data", "gen:arith:8:1", "--steps", "2", "--group-size", "4", "--micro-batch", "2",
          "--batch-size", "4", "--max-new-tokens", "5", "--lr", "1e-3", "--reward", "random:0.5",
          "--clip-eps", "0.1", "--loss-agg", "token-mean"]


def _weights(d):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def _metrics(d):
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def _env(root):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "LLMTOOL_HOME": str(root / "home")}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    return env


def _torchrun(root, model, out, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "llmtool", "--json", "train", "grpo", str(model), str(out), *COMMON, "--prompts-per-rollout", "2",
           "--mini-batch", "4", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(root), timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def two_proc_run(tiny_llama_dir, tmp_path_factory):
    """One 2-process run (~20 s on an idle 2-core machine), shared by the tests below."""
    root = tmp_path_factory.mktemp("dist")
    _torchrun(root, tiny_llama_dir, root / "two", "--save-every", "1", "--keep-checkpoints")
    return root


def test_two_processes_equal_one_process_with_doubled_accumulation(tiny_llama_dir, two_proc_run, tmp_path):
    root = two_proc_run
    out2, out1 = root / "two", tmp_path / "one"
    code, _, err = run_cli("train", "grpo", tiny_llama_dir, out1, *COMMON, "--prompts-per-rollout", "4",
                           "--mini-batch", "8")
    assert code == 0, err

    # exactly one output: OUT, its checkpoint dir (kept on request) and nothing else (no rank's temp dir)
    assert sorted(p.name for p in root.iterdir() if p.name not in ("home", "three")) == ["two", "two.checkpoints"]
    assert [p.name for p in (root / "two.checkpoints").iterdir()] == ["checkpoint-1"]
    assert (out2 / "llmtool.json").is_file() and (out2 / "config.json").is_file()
    m2, m1 = _metrics(out2), _metrics(out1)
    assert len(m2) == len(m1) == 4                      # one writer: 2 phases × 2 updates, not twice that
    prov = json.loads((out2 / "llmtool.json").read_text())
    assert prov["metrics"]["processes"] == 2

    # the reduced metrics are the 1-process run's (rewards: exactly; losses/ratios: to float rounding)
    for a, b in zip(m2, m1):
        for k in ("reward_mean", "reward_std", "zero_std_groups", "response_len", "clip_frac"):
            assert a.get(k) == b.get(k), (k, a.get(k), b.get(k))
        for k in ("loss", "ratio_max", "ratio_min", "entropy"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    assert m2[0]["processes"] == 2 and m1[0]["processes"] == 1
    assert any(r["clip_frac"] > 0 for r in m1)          # the clamp binds somewhere: clip fractions are compared

    w2, w1, w0 = _weights(out2), _weights(out1), _weights(tiny_llama_dir)
    moved = max((w1[k] - w0[k]).abs().max().item() for k in w1)
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert moved > 50 * TOL                              # the tolerance is far below what training changed
    assert diff < TOL, diff
    assert all(torch.isfinite(v).all() for v in w2.values())


def test_two_process_resume_reproduces_the_uninterrupted_run(tiny_llama_dir, two_proc_run):
    """Resume under 2 processes from the kept phase-1 checkpoint (safetensors + JSON, written by rank 0 only)
    gives the uninterrupted 2-process run's weights bit for bit."""
    root = two_proc_run
    ck = root / "two.checkpoints" / "checkpoint-1"
    assert {"trainer_state.json", "trainer_state.safetensors", "model.safetensors"} <= {p.name for p in ck.iterdir()}
    assert not any(p.suffix in (".pt", ".bin", ".pkl") for p in ck.iterdir())
    # one process cannot continue it: data order and mini-batches depend on the number of processes
    code, _, err = run_cli("train", "grpo", tiny_llama_dir, root / "one-resumed", *COMMON, "--prompts-per-rollout",
                           "2", "--mini-batch", "4", "--save-every", "1", "--checkpoint-dir",
                           root / "two.checkpoints", "--resume")
    assert code == 2 and "processes" in err and not (root / "one-resumed").exists()
    out3 = root / "three"
    _torchrun(root, tiny_llama_dir, out3, "--save-every", "1", "--keep-checkpoints", "--checkpoint-dir",
              str(root / "two.checkpoints"),
              "--resume")
    w3, w2 = _weights(out3), _weights(root / "two")
    assert all(torch.equal(w3[k], w2[k]) for k in w2)
    assert [json.loads(x)["step"] for x in (out3 / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_rank_without_rollouts_in_a_mini_batch_keeps_ddp_in_step(tiny_llama_dir, tmp_path):
    """``--mini-batch 1`` per process: each global mini-batch holds 2 rollouts, and for seed 0 four of the eight
    land on one rank, so the other runs a zero-weighted backward to match DDP's collectives. The result still
    equals one process with ``--mini-batch 2`` (micro-batches of 1: no padding, so bit for bit here)."""
    import random

    order = list(range(16))
    random.Random(0 * 1000003 + 0).shuffle(order)   # the loop's phase-0 shuffle of the 16 global rollouts
    ranks_per_step = [{(g // 4) % 2 for g in order[i:i + 2]} for i in range(0, 16, 2)]
    assert any(len(r) == 1 for r in ranks_per_step)  # the empty-share path is exercised
    common = ["--data", "gen:arith:8:1", "--steps", "1", "--group-size", "4", "--micro-batch", "1", "--batch-size", "4",
              "--max-new-tokens", "5", "--lr", "1e-3", "--reward", "random:0.5", "--clip-eps", "0.1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "llmtool",
           "train", "grpo", str(tiny_llama_dir), str(tmp_path / "two"), *common, "--prompts-per-rollout", "2",
           "--mini-batch", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path), timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, _, err = run_cli("train", "grpo", tiny_llama_dir, tmp_path / "one", *common, "--prompts-per-rollout", "4",
                           "--mini-batch", "2")
    assert code == 0, err
    w2, w1, w0 = _weights(tmp_path / "two"), _weights(tmp_path / "one"), _weights(tiny_llama_dir)
    assert len(_metrics(tmp_path / "two")) == 8
    assert max((w1[k] - w0[k]).abs().max().item() for k in w1) > 50 * TOL
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < TOL


def test_trl_engine_under_two_processes_writes_one_output(tiny_llama_dir, tmp_path):
    """``--engine trl`` under torchrun: TRL's Trainer handles the ranks, llmtool writes OUT and metrics once;
    the random rewards are keyed by the same global prompt positions as the home loop's."""
    pytest.importorskip("trl")
    out = tmp_path / "trl2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "llmtool",
           "--json", "train", "grpo", str(tiny_llama_dir), str(out), "--engine", "trl", "--data", "gen:arith:8:1",
           "--steps", "2", "--group-size", "4", "--micro-batch", "2", "--max-new-tokens", "5", "--lr", "1e-3",
           "--reward", "random:0.5", "--prompts-per-rollout", "2", "--mini-batch", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path), timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "home") == ["trl2"]
    recs = _metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]                       # one writer
    prov = json.loads((out / "llmtool.json").read_text())
    assert prov["metrics"]["processes"] == 2 and prov["parameters"]["engine"] == "trl"
    assert (out / "model.safetensors").is_file() and not (out / "trl-scratch").exists()
