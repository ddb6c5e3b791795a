"""Multi-process training (issue 41): every Trainer-based entry point and the AdaGC clipper under 2 CPU
processes (gloo, ``torchrun --standalone --nproc_per_node 2``) against 1 process.

For each entry point the 2-process run must write exactly one output (no second OUT, no temporary dir of
a second writer left beside it, no scratch dir of rank 1 left in $TMPDIR) whose parameters equal those of the
1-process run that sees the same sequences per update (doubled --grad-accum, or a doubled batch where the
command has no --grad-accum), to ``ATOL`` = 1e-5 absolute (fp32 sums in another order; on this machine the
pretrain/sft runs agree bit for bit). The clipper test runs one MLP through AdaGC under DDP and FSDP2
(``fully_shard`` on a CPU mesh) and checks the same clip decisions, references and parameters as 1 process,
including a NaN step that is skipped on every rank with gamma finite and no parameter moved.

Each 2-process run costs 10-30 s of wall time on an idle 2-core machine (two interpreters importing torch and
transformers; the whole file about 2 minutes). All of them run in ``make test``: issue 41 asks that every entry
point's 2-process test pass in CI.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY_TEXT, save_tiny, write_route_rows

ATOL = 1e-5
WORKER = r'''"""Worker of tests/test_dist_trainers.py: AdaGC on a small MLP, one process or two (DDP / FSDP2, gloo)."""
import json
import sys

import torch
import torch.distributed as dist

from llmtool.train.adagc import AdaGCClipper

mode, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
world, rank = 1, 0
if mode != "single":
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5), torch.nn.Tanh(),
                            torch.nn.Linear(5, 3))
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(5, 8, 8, generator=g), torch.randn(5, 8, 3, generator=g)
X[2, :, 0] *= 50.0                   # a spike on step 3: AdaGC clips the first layer
X[3, 4:, :] = float("nan")           # step 4: a NaN gradient (in rank 1's half of the batch)
clipper = AdaGCClipper(model.named_parameters(), warmup=1, lambda_abs=1.0, lambda_rel=1.05, beta=0.9)
stale_raised = None
if mode == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model)
elif mode == "fsdp2":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if not clipper.bound_to(model):      # fully_shard replaced the parameters: the old binding would clip nothing
    model(X[0][:1]).sum().backward()
    try:
        clipper.clip_()
    except RuntimeError as e:
        stale_raised = str(e)
    opt.zero_grad(set_to_none=True)
    clipper.bind(model.named_parameters())


def full(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


steps = []
for t in range(5):
    n = 8 // world
    x, y = X[t][rank * n:(rank + 1) * n], Y[t][rank * n:(rank + 1) * n]
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    before = {k: full(p) for k, p in model.named_parameters()}
    st = clipper.clip_()
    opt.step()
    after = {k: full(p) for k, p in model.named_parameters()}
    steps.append({"stats": st.as_dict(), "gamma": dict(clipper.gamma), "t": clipper.step,
                  "moved": sorted(k for k in before if not torch.equal(before[k], after[k]))})
params = {k.removeprefix("module."): full(p).flatten().tolist() for k, p in model.named_parameters()}
from llmtool.core.trainer import full_state_dict  # noqa: E402  (what train pretrain|sft save with)

sd = full_state_dict(model)
sd = None if sd is None else {k: v.flatten().tolist() for k, v in sd.items()}
if rank == 0:
    with open(out, "w") as fh:
        json.dump({"steps": steps, "params": params, "stale_raised": stale_raised, "full_sd": sd}, fh)
else:
    with open(out + f".rank{rank}", "w") as fh:
        json.dump({"steps": steps, "full_sd": sd}, fh)
if mode != "single":
    dist.destroy_process_group()
'''


def _env(tmp_path: Path) -> dict:
    scratch = tmp_path / "tmpdir"
    scratch.mkdir(exist_ok=True)
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "TMPDIR": str(scratch), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def _run(tmp_path: Path, args, nproc: int = 1, module: bool = True, timeout: int = 400):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    cmd = launcher + (["-m", "llmtool"] if module else []) + [str(a) for a in args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _one_output(parent: Path, out: Path, tmp_path: Path) -> None:
    assert out.is_dir() or out.is_file()
    siblings = [p.name for p in parent.iterdir() if p.name.startswith(f".{out.name}")]
    assert siblings == [], siblings                               # no temp dir of a second writer
    assert list((tmp_path / "tmpdir").glob("llmtool-rank*")) == []  # rank 1's scratch OUT is gone


def _params(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    assert out, path
    return out


def _assert_same(a: dict, b: dict, atol: float = ATOL) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0), (k, float((a[k] - b[k]).abs().max()))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("dist") / "tiny")


# ------------------------------------------------------------------------------------------ the clipper
def test_adagc_ddp_and_fsdp2_clip_like_one_process(tmp_path):
    (tmp_path / "w.py").write_text(WORKER)
    res = {}
    for mode in ("single", "ddp", "fsdp2"):
        _run(tmp_path, ["w.py", mode, tmp_path / f"{mode}.json"], nproc=1 if mode == "single" else 2, module=False)
        res[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    ref = res["single"]["steps"]
    assert [s["stats"]["clip_stage"] for s in ref] == ["warmup", "adaptive", "adaptive", "skipped", "adaptive"]
    assert ref[2]["stats"]["n_clipped"] > 0                    # the spike step clips something
    for mode in ("ddp", "fsdp2"):
        got = res[mode]["steps"]
        other = json.loads((tmp_path / f"{mode}.json.rank1").read_text())["steps"]
        for t, (a, b, c) in enumerate(zip(ref, got, other)):
            assert b["stats"]["clipped_tensors"] == a["stats"]["clipped_tensors"] == c["stats"]["clipped_tensors"]
            for k in ("grad_norm", "grad_norm_clipped", "clip_factor_min", "clip_factor_median", "clip_factor_max"):
                if t != 3:
                    assert b["stats"][k] == pytest.approx(a["stats"][k], rel=1e-5), (mode, t, k)
                    assert c["stats"][k] == b["stats"][k], (mode, t, k)   # identical decision on both ranks
            assert b["gamma"] == pytest.approx(a["gamma"], rel=1e-5) and c["gamma"] == b["gamma"]
            assert b["t"] == a["t"] == c["t"]
        # the NaN step (4): skipped everywhere, no parameter moved, gamma finite, t not advanced
        assert got[3]["stats"]["skipped"] and other[3]["stats"]["skipped"] and got[3]["moved"] == []
        assert all(v == v and abs(v) != float("inf") for v in got[3]["gamma"].values()) and got[3]["t"] == 3
        for k, v in res["single"]["params"].items():
            assert res[mode]["params"][k] == pytest.approx(v, abs=ATOL), (mode, k)
    # the state dict the CLI saves: FSDP2 gathers the full tensors on rank 0 only; plain models need no copy
    assert res["fsdp2"]["full_sd"] == res["fsdp2"]["params"]
    assert json.loads((tmp_path / "fsdp2.json.rank1").read_text())["full_sd"] == {}
    assert res["ddp"]["full_sd"] is None and res["single"]["full_sd"] is None
    # a clipper bound before fully_shard replaced the parameters refuses instead of clipping nothing
    assert "none of the 6 bound parameters has a gradient" in res["fsdp2"]["stale_raised"]
    assert res["ddp"]["stale_raised"] is None                  # DDP keeps the parameters: nothing to rebind


# ------------------------------------------------------------------------------------------ entry points
def _pretrain_args(tiny_dir, corpus, out, accum):
    return ["--json", "train", "pretrain", out, "--data", corpus, "--tokenizer", tiny_dir, "--layers", "1",
            "--d-model", "32", "--heads", "2", "--steps", "4", "--batch-size", "2", "--grad-accum", accum,
            "--max-length", "32", "--val-blocks", "2", "--clip", "adagc", "--adagc-warmup", "2", "--save-steps", "2",
            "--lr-scheduler", "linear"]


def test_train_pretrain_two_processes_equal_one_with_doubled_accumulation(tmp_path, tiny_dir):
    corpus = tmp_path / "c.txt"
    corpus.write_text((TINY_TEXT + "\n\n") * 6)
    _run(tmp_path, _pretrain_args(tiny_dir, corpus, tmp_path / "one", 2))
    p = _run(tmp_path, _pretrain_args(tiny_dir, corpus, tmp_path / "two", 1), nproc=2)
    _one_output(tmp_path, tmp_path / "two", tmp_path)
    assert p.stdout.count('"steps"') == 1                       # one result printed (rank 0)
    _assert_same(_params(tmp_path / "one" / "model"), _params(tmp_path / "two" / "model"))
    m1, m2 = ((tmp_path / d / "metrics.jsonl").read_text().splitlines() for d in ("one", "two"))
    assert len(m2) == 4 and [json.loads(x)["clipped_tensors"] for x in m1] == [json.loads(x)["clipped_tensors"] for x in m2]
    ck = tmp_path / "two" / "checkpoints" / "checkpoint-2"
    assert (ck / "rng_state_0.pth").is_file() and (ck / "rng_state_1.pth").is_file()   # one shared checkpoint dir
    rep = json.loads((tmp_path / "two" / "report.json").read_text())
    assert rep["steps"] == 4 and rep["clipper_step"] == 4


def test_train_pretrain_two_process_resume_equals_the_uninterrupted_run(tmp_path, tiny_dir):
    """Resume under 2 processes from a checkpoint written by 2 processes (per-rank RNG files in one folder, the
    clipper state read by every rank): the same weights and metrics as the run that was never interrupted."""
    corpus = tmp_path / "c.txt"
    corpus.write_text((TINY_TEXT + "\n\n") * 6)
    _run(tmp_path, _pretrain_args(tiny_dir, corpus, tmp_path / "full", 1), nproc=2)
    ck = tmp_path / "full" / "checkpoints" / "checkpoint-2"
    _run(tmp_path, _pretrain_args(tiny_dir, corpus, tmp_path / "res", 1) + ["--resume", ck], nproc=2)
    _one_output(tmp_path, tmp_path / "res", tmp_path)
    _assert_same(_params(tmp_path / "full" / "model"), _params(tmp_path / "res" / "model"), atol=0.0)
    assert (tmp_path / "full" / "metrics.jsonl").read_text() == (tmp_path / "res" / "metrics.jsonl").read_text()


def test_train_sft_two_processes(tmp_path, tiny_dir):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}: ", "completion": " The capital of France is Paris."}) + "\n"
                            for i in range(16)))
    common = ["--json", "train", "sft", tiny_dir, None, "--data", data, "--steps", "3", "--batch-size", "2",
              "--clip", "adagc", "--adagc-warmup", "1", "--max-length", "32", "--lr", "1e-3"]

    def args(out, accum):
        a = list(common)
        a[4] = out
        return a + ["--grad-accum", accum]

    _run(tmp_path, args(tmp_path / "one", 2))
    _run(tmp_path, args(tmp_path / "two", 1), nproc=2)
    _one_output(tmp_path, tmp_path / "two", tmp_path)
    _assert_same(_params(tmp_path / "one" / "model"), _params(tmp_path / "two" / "model"))


def test_route_make_experts_and_train_two_processes(tmp_path):
    """route has no --grad-accum: the 1-process reference uses a doubled --batch-size (the same sequences per
    update; per-batch mean losses, so the test data gives every rank the same number of target tokens)."""
    base = save_tiny(tmp_path / "base", seed=0, tie_word_embeddings=False)
    data = write_route_rows(tmp_path / "route.jsonl")
    for n, bs in ((1, 4), (2, 2)):
        _run(tmp_path, ["route", "make-experts", base, tmp_path / f"experts{n}", "--data", data, "--max-steps", "2",
                        "--batch-size", bs, "--template", "raw", "--lr", "1e-3"], nproc=n)
    _one_output(tmp_path, tmp_path / "experts2", tmp_path)
    for dom in ("math", "reverse"):
        _assert_same(_params(tmp_path / "experts1" / dom), _params(tmp_path / "experts2" / dom))
    experts = f"{tmp_path / 'experts1' / 'math'},{tmp_path / 'experts1' / 'reverse'}"
    for n, bs in ((1, 4), (2, 2)):
        _run(tmp_path, ["route", "train", tmp_path / f"router{n}", "--data", data, "--experts", experts, "--base", base,
                        "--max-steps", "2", "--batch-size", bs, "--template", "raw"], nproc=n)
    _one_output(tmp_path, tmp_path / "router2", tmp_path)
    _assert_same(_params(tmp_path / "router1"), _params(tmp_path / "router2"))


def test_select_data_mix_proxies_two_processes(tmp_path, tiny_dir):
    """DoReMi's proxies: every rank draws the same global batch and trains on its slice; 1 process with
    --per-domain doubled sees the same sequences."""
    rows = []
    words = {"x": "apples and pears are fruit", "y": "the kernel boots the system", "z": "rain falls in the night"}
    for i in range(24):
        dom = "xyz"[i % 3]
        rows.append({"id": f"d{i}", "text": f"{words[dom]} {i}", "topic": dom})
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = {}
    for n, per in ((1, 4), (2, 2)):
        out = tmp_path / f"w{n}.json"
        _run(tmp_path, ["--json", "select-data", "mix", corpus, "-o", out, "--method", "doremi", "--field", "topic",
                        "--tokenizer", tiny_dir, "--steps", "3", "--proxy-d-model", "16", "--proxy-heads", "2",
                        "--proxy-vocab", "32", "--proxy-context", "8", "--per-domain", per,
                        "--proxy-batch-size", 6 // n], nproc=n)
        docs[n] = json.loads(out.read_text())
    _one_output(tmp_path, tmp_path / "w2.json", tmp_path)
    assert docs[1]["weights"] == pytest.approx(docs[2]["weights"], abs=ATOL)
    assert docs[1]["ref_val"] == pytest.approx(docs[2]["ref_val"], abs=ATOL)
    assert docs[1]["proxy_val"] == pytest.approx(docs[2]["proxy_val"], abs=ATOL)


def test_edit_keystone_finetune_two_processes(tmp_path, tiny_dir):
    ks = tmp_path / "keystone.json"
    _run(tmp_path, ["edit", "keystone", "find", tiny_dir, "--out", ks, "--top", "20"])
    for n, bs in ((1, 8), (2, 4)):
        _run(tmp_path, ["--json", "edit", "keystone", "finetune", tiny_dir, tmp_path / f"ks{n}", "--neurons", ks,
                        "--k", "5", "--max-steps", "3", "--n-train", "16", "--lr", "1e-2", "--batch-size", bs], nproc=n)
    _one_output(tmp_path, tmp_path / "ks2", tmp_path)
    _assert_same(_params(tmp_path / "ks1"), _params(tmp_path / "ks2"))
