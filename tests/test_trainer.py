"""The shared trainer with clipping policies: ClipCallback == Trainer clipping, exact resume with the
clipper state, packing, and the `train pretrain|sft` CLI (outputs, metrics JSONL, bad input)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_TEXT, build_tiny_llama, build_tokenizer, run_cli
from llmtool.core.trainer import ClipCallback, TrainArgs, pack_texts, sft
from llmtool.train.clipping import CLIPPERS
from llmtool.train.pretrain import train_with_clipper


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _blocks(tok, n=16, T=32):
    return pack_texts(tok, [TINY_TEXT] * 4, T, max_blocks=n)


def test_pack_texts(tok):
    blocks = pack_texts(tok, ["a b c", "d e f"], 2)
    ids = tok("a b c", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] + \
        tok("d e f", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert [x for b in blocks for x in b["input_ids"]] == ids[:len(blocks) * 2]


def test_clip_callback_global_equals_trainer_clipping(tok):
    rows = _blocks(tok)
    base = TrainArgs(lr=1e-2, max_steps=4, batch_size=4, max_length=32, lr_scheduler="constant", logging_steps=1)
    m1 = build_tiny_llama(len(tok), seed=1).train()
    sft(m1, tok, rows, TrainArgs(**{**base.__dict__, "max_grad_norm": 0.5}))
    m2 = build_tiny_llama(len(tok), seed=1).train()
    clipper = CLIPPERS.build("global", max_grad_norm=0.5).build(m2.named_parameters())
    cb = ClipCallback(clipper)
    sft(m2, tok, rows, TrainArgs(**{**base.__dict__, "max_grad_norm": 0.0}), callbacks=[cb])
    assert clipper.step == 4 and len(cb.records) == 4 and cb.records[0]["clip_fraction"] == 1.0
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_resume_restores_clipper_state_exactly(tok, tmp_path):
    rows = _blocks(tok)
    cfg = CLIPPERS.build("adagc", adagc_warmup=2)

    def args(**kw):
        return TrainArgs(lr=3e-3, max_steps=6, batch_size=4, max_length=32, lr_scheduler="constant", **kw)

    full = build_tiny_llama(len(tok), seed=2).train()
    r_full = train_with_clipper(full, tok, rows, args(), cfg, out_dir=tmp_path / "a")
    part = build_tiny_llama(len(tok), seed=2).train()
    train_with_clipper(part, tok, rows, args(save_steps=3), cfg, out_dir=tmp_path / "b")
    ck = tmp_path / "b" / "checkpoint-3"
    assert (ck / "clipper_state.json").is_file()
    saved = json.loads((ck / "clipper_state.json").read_text())
    assert saved["step"] == 3 and set(saved["gamma"]) == {n for n, _ in full.named_parameters()} - {"lm_head.weight"}
    from transformers import LlamaForCausalLM

    resumed = LlamaForCausalLM.from_pretrained(ck).train()
    r_res = train_with_clipper(resumed, tok, rows, args(), cfg, out_dir=tmp_path / "b", resume=str(ck))
    assert r_res["clipper_step"] == 6
    # the records before the checkpoint come back from it, so the summary covers the whole run
    assert [r["step"] for r in r_res["records"]] == [1, 2, 3, 4, 5, 6]
    assert r_res["records"][:3] == r_full["records"][:3]
    assert r_res["clip_fraction_mean"] == pytest.approx(r_full["clip_fraction_mean"], rel=1e-6)
    for a, b in zip(r_full["records"][3:], r_res["records"][3:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["clip_factor_min"] == pytest.approx(b["clip_factor_min"], rel=1e-5)
    for (n, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), n


def test_faults_reach_clipper_and_lr(tok):
    rows = _blocks(tok)
    m = build_tiny_llama(len(tok), seed=3).train()
    from llmtool.train.faults import Faults

    faults = Faults.parse(["3:model.layers.0.self_attn.q_proj.weight:1000:2"], ["5"], ["6:30"],
                          names=[n for n, _ in m.named_parameters()])
    args = TrainArgs(lr=1e-2, max_steps=6, batch_size=4, max_length=32, lr_scheduler="constant")
    res = train_with_clipper(m, tok, rows, args, CLIPPERS.build("none"), faults=faults)
    recs = res["records"]
    gn = [r["grad_norm"] for r in recs]
    assert gn[2] > 3 * gn[1] and gn[5] < 3 * gn[1]
    assert recs[4]["loss"] > recs[3]["loss"] + 0.1   # garbage batch: random tokens, loss ~ ln(V)
    assert [r["lr"] for r in recs] == pytest.approx([1e-2] * 6)  # logged lr is the scheduled one, restored


def test_cli_pretrain_adagc(tiny_llama_dir, tmp_path):
    tdir = tiny_llama_dir
    corpus = tmp_path / "c.txt"
    corpus.write_text((TINY_TEXT + "\n\n") * 6)
    out = tmp_path / "run"
    code, stdout, err = run_cli("--json", "train", "pretrain", out, "--data", corpus, "--tokenizer", tdir,
                                "--layers", "1", "--d-model", "32", "--heads", "2", "--steps", "6", "--batch-size", "2",
                                "--max-length", "32", "--val-blocks", "2", "--clip", "adagc", "--adagc-warmup", "2",
                                "--adagc-preset", "preprint", "--inject-grad-spike", "4:model.embed_tokens.weight:1e3",
                                "--save-steps", "3", "--spike-window", "2")
    assert code == 0, err
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert recs[0]["clip_stage"] == "warmup" and recs[3]["clip_stage"] == "adaptive"
    assert "model.embed_tokens.weight" in recs[3]["clipped_tensors"]
    rep = json.loads((out / "report.json").read_text())
    assert rep["clip"]["adagc_preset"] == "preprint" and rep["steps"] == 6 and rep["val_loss"] > 0
    assert (out / "model" / "model.safetensors").is_file()
    assert (out / "checkpoints" / "checkpoint-3" / "clipper_state.json").is_file()


def test_cli_pretrain_resume_from_another_run_equals_the_uninterrupted_run(tiny_llama_dir, tmp_path):
    """`--resume OTHER_RUN/checkpoints/checkpoint-N` into a new output directory: the clipper state is read from
    that checkpoint (not from the new run's empty checkpoint folder) and the metrics and summary cover every
    update, equal to the run that was never interrupted."""
    corpus = tmp_path / "c.txt"
    corpus.write_text((TINY_TEXT + "\n\n") * 6)
    common = ("--data", corpus, "--tokenizer", tiny_llama_dir, "--layers", "1", "--d-model", "32", "--heads", "2",
              "--steps", "6", "--batch-size", "2", "--max-length", "32", "--val-blocks", "2", "--clip", "adagc",
              "--adagc-warmup", "2", "--spike-window", "2")
    code, _, err = run_cli("--json", "train", "pretrain", tmp_path / "a", *common, "--save-steps", "3")
    assert code == 0, err
    code, _, err = run_cli("--json", "train", "pretrain", tmp_path / "b", *common, "--resume",
                           tmp_path / "a" / "checkpoints" / "checkpoint-3")
    assert code == 0, err
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == (tmp_path / "b" / "metrics.jsonl").read_text()
    ra, rb = (json.loads((tmp_path / d / "report.json").read_text()) for d in "ab")
    for k in ("steps", "final_train_loss", "val_loss", "loss_spike_score", "grad_norm_spike_score",
              "clip_fraction_mean", "clip_fraction_steady", "clipper_step"):
        assert ra[k] == rb[k], k
    from safetensors.torch import load_file

    wa, wb = (load_file(tmp_path / d / "model" / "model.safetensors") for d in "ab")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_cli_pretrain_resume_with_corrupt_records_is_one_line(tiny_llama_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text((TINY_TEXT + "\n\n") * 6)
    common = ("--data", corpus, "--tokenizer", tiny_llama_dir, "--layers", "1", "--d-model", "32", "--heads", "2",
              "--steps", "4", "--batch-size", "2", "--max-length", "32", "--val-blocks", "2", "--clip", "adagc")
    code, _, err = run_cli("train", "pretrain", tmp_path / "a", *common, "--save-steps", "2")
    assert code == 0, err
    ck = tmp_path / "a" / "checkpoints" / "checkpoint-2"
    (ck / "clip_records.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')
    code, _, err = run_cli("train", "pretrain", tmp_path / "b", *common, "--resume", ck)
    assert code == 2 and "clip_records.jsonl:2: malformed JSON" in err and not (tmp_path / "b").exists()


@pytest.mark.parametrize("extra,needle", [
    (["--inject-grad-spike", "4:model.embed_tokens.weigh:10"], "close names: model.embed_tokens.weight"),
    (["--inject-grad-spike", "four:x:10"], "STEP"),
    (["--clip", "adagc", "--adagc-lambda-rel", "-1"], "--adagc-lambda-rel"),
    (["--clip", "global", "--adagc-beta", "0.9"], "does not apply"),
    (["--optimizer", "adam"], "--optimizer"),
])
def test_cli_bad_input(tiny_llama_dir, tmp_path, extra, needle):
    tdir = tiny_llama_dir
    corpus = tmp_path / "c.txt"
    corpus.write_text((TINY_TEXT + "\n\n") * 6)
    out = tmp_path / "run"
    code, _, err = run_cli("train", "pretrain", out, "--data", corpus, "--tokenizer", tdir, "--layers", "1",
                           "--d-model", "32", "--heads", "2", "--steps", "2", "--batch-size", "2", "--max-length", "32",
                           "--val-blocks", "2", *extra)
    assert code == 2 and needle in err and not out.exists()


def test_cli_sft_and_bad_jsonl(tiny_llama_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Q{i}: ", "completion": "The capital of France is Paris."})
                              for i in range(8)))
    out = tmp_path / "sft"
    code, _, err = run_cli("train", "sft", tiny_llama_dir, out, "--data", data, "--steps", "3", "--clip", "adagc",
                           "--adagc-warmup", "1", "--max-length", "32")
    assert code == 0, err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    code, _, err = run_cli("train", "sft", tiny_llama_dir, tmp_path / "o2", "--data", bad, "--steps", "1")
    assert code == 2 and "bad.jsonl:2" in err


# ------------------------------------------------------------------------------ resume without unpickling
class _Payload:
    """Unpickling this creates the marker file (what a planted checkpoint would do with os.system)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _checkpoint(tiny_llama_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text((TINY_TEXT + "\n\n") * 6)
    common = ["--data", corpus, "--tokenizer", tiny_llama_dir, "--layers", "1", "--d-model", "32", "--heads", "2",
              "--steps", "3", "--batch-size", "2", "--max-length", "32", "--val-blocks", "2", "--clip", "adagc"]
    code, _, err = run_cli("train", "pretrain", tmp_path / "a", *common, "--save-steps", "2")
    assert code == 0, err
    return tmp_path / "a" / "checkpoints" / "checkpoint-2", common


def test_resume_refuses_planted_pickles_and_never_runs_them(tiny_llama_dir, tmp_path):
    """Issue 39 (critical 2): `train pretrain|sft --resume DIR` checks DIR like a MODEL argument and reads the
    Trainer's torch-saved state files without unpickling; a planted payload is refused (exit 2) and never runs."""
    import pickle
    import shutil

    ck, common = _checkpoint(tiny_llama_dir, tmp_path)
    marker = tmp_path / "payload-ran"
    cases = {
        "optimizer.pt": lambda p: torch.save({"state": {0: _Payload(str(marker))}, "param_groups": []}, p),
        "rng_state.pth": lambda p: torch.save({"python": _Payload(str(marker))}, p),
        "scheduler.pt": lambda p: p.write_bytes(pickle.dumps(_Payload(str(marker)))),   # legacy raw pickle
        "extra.bin": lambda p: torch.save(_Payload(str(marker)), p),                    # any pickle file
    }
    for i, (name, plant) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(ck, bad)
        plant(bad / name)
        assert not marker.exists()
        out = tmp_path / f"o{i}"
        code, _, err = run_cli("train", "pretrain", out, *common, "--resume", bad)
        assert code == 2 and name in err and not out.exists(), (name, err)
        assert not marker.exists(), name
    # the same through `train sft --resume`, and as a real process (exit status 2, one error line)
    from conftest import run_cli_subprocess

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": TINY_TEXT}) + "\n")
    p = run_cli_subprocess("train", "sft", tiny_llama_dir, tmp_path / "s", "--data", data, "--steps", "1",
                           "--resume", tmp_path / "bad0")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "optimizer.pt" in p.stderr, p.stderr
    assert not marker.exists() and not (tmp_path / "s").exists()


def test_resume_runs_the_model_checks(tiny_llama_dir, tmp_path):
    """Pickle-only weights, remote code and a broken safetensors header in a resume dir are refused like in a
    MODEL argument (before this, `--resume` loaded with from_pretrained and no checks)."""
    import shutil

    ck, common = _checkpoint(tiny_llama_dir, tmp_path)
    pk = tmp_path / "pickle-only"
    shutil.copytree(ck, pk)
    (pk / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, pk / "pytorch_model.bin")
    rc = tmp_path / "remote"
    shutil.copytree(ck, rc)
    cfg = json.loads((rc / "config.json").read_text())
    (rc / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    hd = tmp_path / "header"
    shutil.copytree(ck, hd)
    (hd / "model.safetensors").write_bytes(b"\xff" * 16)
    st = tmp_path / "state"
    shutil.copytree(ck, st)
    (st / "trainer_state.json").write_text("[1, 2]")
    for d, needle in ((pk, "safetensors"), (rc, "remote code"), (hd, "model.safetensors"), (st, "trainer state")):
        code, _, err = run_cli("train", "pretrain", tmp_path / "o", *common, "--resume", d)
        assert code == 2 and needle in err and not (tmp_path / "o").exists(), (d.name, err)
    # a clean checkpoint still resumes
    code, _, err = run_cli("train", "pretrain", tmp_path / "o", *common, "--resume", ck)
    assert code == 0, err


def test_transformers_trainer_loads_state_with_weights_only():
    """The second line of defence: every torch.load in transformers' Trainer passes weights_only=True (a
    transformers upgrade that drops it must fail here)."""
    import inspect

    import transformers.trainer as T

    src = inspect.getsource(T)
    calls = []
    i = src.find("torch.load(")
    while i >= 0:
        depth, j = 0, i + len("torch.load")
        while True:
            depth += {"(": 1, ")": -1}.get(src[j], 0)
            j += 1
            if depth == 0:
                break
        calls.append(src[i:j])
        i = src.find("torch.load(", j)
    assert len(calls) >= 5
    assert all("weights_only=True" in c for c in calls), [c for c in calls if "weights_only=True" not in c]


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_state_file_scan_resolves_globals_of_every_pickle_protocol(tmp_path, protocol):
    """Protocol 2 names globals inline (GLOBAL); 4 and 5 push module and name as strings, often through the memo
    (STACK_GLOBAL after BINGET): the scan must resolve both, pass plain tensor state and name the payload."""
    from llmtool.core.console import UsageError
    from llmtool.core.resume import check_pickle_file, pickle_globals

    ok = tmp_path / "ok.pt"
    torch.save({"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.1}]},
               ok, pickle_protocol=protocol)
    check_pickle_file(ok)
    bad = tmp_path / "bad.pt"
    marker = tmp_path / "ran"
    torch.save([torch.zeros(1), _Payload(str(marker)), _Payload(str(marker))], bad, pickle_protocol=protocol)
    with pytest.raises(UsageError, match="builtins.open|__builtin__.open|io.open"):
        check_pickle_file(bad)
    assert not marker.exists()
    import pickle

    memo = pickle.dumps([_Payload("x"), _Payload("y")], protocol=protocol)  # 2nd global comes from the memo
    assert pickle_globals(memo, "m") & {"builtins.open", "__builtin__.open", "io.open"}
