"""Hostile inputs against every command that loads a model or reads data (issue: no traceback, no silent
garbage, fast failure).

Each case asserts: the exit code, exactly one `error:` line that names the offending file or field, no
traceback, no output or temp dir left behind, and inputs byte-identical afterwards (sha256).

New commands join by adding a row to :data:`MODEL_COMMANDS` (how to call them with a MODEL and an OUT)
or :data:`DATA_CASES`; the case count per command is written by `make reliability-report` into
docs/reliability.md.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import run_cli, save_tiny

# ------------------------------------------------------------------------------------ bad checkpoints


def _sha_tree(path: Path) -> dict[str, str]:
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _corrupt_header(d: Path) -> None:
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\xff" * 12
    f.write_bytes(bytes(data))


def _huge_header(d: Path) -> None:
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    f.write_bytes(bytes(data))


def _truncated(d: Path) -> None:
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _pickle_only(d: Path) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")


def _missing_tensor(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    sd.pop("model.layers.1.mlp.down_proj.weight")
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def _nan_weight(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.q_proj.weight"][0, 0] = math.nan
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def _not_causal(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["BertModel"]
    (d / "config.json").write_text(json.dumps(cfg))


def _bad_config_json(d: Path) -> None:
    (d / "config.json").write_text("{not json")


def _remote_code(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel"}
    cfg["architectures"] = ["EvilModelForCausalLM"]
    cfg["model_type"] = "evil"
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "evil.py").write_text("raise SystemExit('remote code ran')\n")


def _set_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _config_list(d: Path) -> None:
    (d / "config.json").write_text(json.dumps([json.loads((d / "config.json").read_text())]))


def _config_not_utf8(d: Path) -> None:
    (d / "config.json").write_bytes((d / "config.json").read_bytes()[:-1] + b', "x": "\xff\xfe"}')


def _config_deep(d: Path) -> None:  # beyond the JSON parser's recursion limit
    (d / "config.json").write_text("[" * 200_000 + "]" * 200_000)


def _weights_dir(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


def _weights_symlink_loop(d: Path) -> None:
    import os

    (d / "model.safetensors").unlink()
    os.symlink("model.safetensors", d / "model.safetensors")


def _weights_fifo(d: Path) -> None:  # opening it would block forever
    import os

    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")


def _int32_weight(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    sd[key] = (sd[key] * 1000).to(torch.int32)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def _index_outside(d: Path) -> None:
    """A shard index naming a weight file outside the checkpoint (a copy of the real one lies there)."""
    outside = d.parent / f"{d.name}-outside.safetensors"
    shutil.copyfile(d / "model.safetensors", outside)
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), framework="pt") as h:
        names = list(h.keys())
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f"../{outside.name}" for n in names}}))


BAD_MODELS = {
    "config-is-a-list": (_config_list, "must be a JSON object"),
    "config-not-utf8": (_config_not_utf8, "not UTF-8"),
    "config-too-deep": (_config_deep, "nested too deeply"),
    "weights-are-a-dir": (_weights_dir, "not a regular file"),
    "weights-symlink-loop": (_weights_symlink_loop, "symbolic links"),
    "weights-fifo": (_weights_fifo, "not a regular file (a FIFO)"),
    "zero-heads": (lambda d: _set_config(d, num_attention_heads=0), "num_attention_heads"),
    "nested-auto-map": (lambda d: _set_config(d, text_config={"auto_map": {"AutoModelForCausalLM": "evil.M"}}),
                        "text_config.auto_map"),
    "int32-weights": (_int32_weight, "stored as I32"),
    "index-outside-dir": (_index_outside, "outside the checkpoint"),
    "tokenizer-fifo": (lambda d: ((d / "tokenizer.json").unlink(), __import__("os").mkfifo(d / "tokenizer.json")),
                       "tokenizer.json: not a regular file (a FIFO)"),
    "corrupt-header": (_corrupt_header, "corrupt safetensors"),
    "huge-header": (_huge_header, "corrupt safetensors"),
    "truncated": (_truncated, "safetensors"),
    "pickle-only": (_pickle_only, "pickle"),
    "missing-tensor": (_missing_tensor, "down_proj"),
    "nan-weight": (_nan_weight, "NaN"),
    "not-causal-lm": (_not_causal, "not a causal language model"),
    "bad-config": (_bad_config_json, "invalid JSON"),
    "remote-code": (_remote_code, "config.json"),
}


@pytest.fixture(scope="module")
def clean_tiny(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("clean") / "tiny")


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, clean_tiny) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    out = {}
    for name, (make, _) in BAD_MODELS.items():
        d = root / name
        shutil.copytree(clean_tiny, d)
        make(d)
        out[name] = d
    return out


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
def test_load_model_refuses_bad_checkpoints(case, bad_models):
    from llmtool.core.console import UsageError
    from llmtool.core.models import load_model

    before = _sha_tree(bad_models[case])
    with pytest.raises(UsageError) as e:
        load_model(bad_models[case])
    assert BAD_MODELS[case][1] in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert _sha_tree(bad_models[case]) == before


def test_clean_checkpoint_still_loads(clean_tiny):
    from llmtool.core.models import load_model

    assert load_model(clean_tiny).config.num_hidden_layers == 2


# ------------------------------------------------------------------------------------ the command walk
# command -> argv with {model}, {out}, {data}, {text}; every case here runs before any heavy compute.
MODEL_COMMANDS: dict[str, list[str]] = {
    "compress": ["compress", "{model}", "{out}", "--ratio", "0.2", "--calib-data", "{text}", "--calib-samples", "2",
                 "--calib-seqlen", "16"],
    "quantize": ["quantize", "{model}", "{out}", "--method", "rtn", "--calib-data", "{text}", "--no-eval"],
    "evaluate ppl": ["evaluate", "ppl", "{model}", "--data", "{text}", "--seqlen", "16"],
    "models export": ["models", "export", "{model}", "{out}"],
    "kvcache evaluate": ["kvcache", "evaluate", "{model}", "--task", "ppl", "--data", "{text}"],
    "train sft": ["train", "sft", "{model}", "{out}", "--data", "{sft}", "--steps", "1"],
    "train grpo": ["train", "grpo", "{model}", "{out}", "--data", "{rl}", "--reward", "ground-truth"],
    "route make-experts": ["route", "make-experts", "{model}", "{out}", "--data", "{route}", "--max-steps", "1"],
    "select-data features": ["select-data", "features", "{pool}", "{out}", "--model", "{model}"],
    "learn-program run": ["learn-program", "run", "{out}", "--proposer", "hf:{model}", "--task", "parity_all",
                          "--length", "8", "--train", "4", "--val", "4", "--test", "4", "--samples", "1",
                          "--max-new-tokens", "4"],
    "learn-program baseline icl": ["learn-program", "baseline", "{out}", "--method", "icl", "--model", "{model}",
                                   "--task", "parity_all", "--length", "8", "--train", "4", "--val", "4",
                                   "--test", "4"],
    "bench-agent run": ["bench-agent", "run", "hf:{model}", "{out}", "--env", "grid-nav", "--episodes", "1",
                        "--max-rounds", "1", "--max-new-tokens", "4"],
    "bench-agent uh-run": ["bench-agent", "uh-run", "hf:{model}", "{out}", "--env", "seq", "--steps", "2",
                           "--runs", "1", "--report", "menu"],
    "evaluate judge-sample": ["evaluate", "judge-sample", "--judge", "hf:{model}", "--pairs", "{pairs}", "--n", "2",
                              "--max-new-tokens", "2", "-o", "{out}"],
    "evaluate judge-self-agg": ["evaluate", "judge-self-agg", "--judge", "hf:{model}", "--pairs", "{pairs}",
                                "--votes", "{votes}", "--max-new-tokens", "2", "-o", "{out}"],
}


@pytest.fixture(scope="module")
def area_data(tmp_path_factory) -> dict[str, Path]:
    """Well-formed data for the commands above, so that only the model is bad."""
    root = tmp_path_factory.mktemp("area-data")
    rows = {
        "sft": [{"prompt": "2+2=", "completion": "4"}] * 4,
        "rl": [{"prompt": "2+2=", "answer": "4"}] * 4,
        "route": [{"id": f"m{i}", "domain": "math", "prompt": "2+2=", "response": "4", "answer": "4"} for i in range(4)],
        "pool": [{"id": f"p{i}", "prompt": "What is 2+2?"} for i in range(4)],
        "pairs": [{"id": "j0", "prompt": "2+2=", "response_a": "4", "response_b": "5"}],
        "votes": [{"id": "j0", "sample": 0, "order": "AB", "raw": "Final rating: A", "rating": 1}],
    }
    out = {}
    for name, rs in rows.items():
        out[name] = root / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in rs))
    return out


def _one_error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def _run(argv_t: list[str], **subs) -> tuple[int, str, str]:
    argv = [a.format(**subs) for a in argv_t]
    try:
        return run_cli(*argv)
    except Exception as e:  # an exception escaping the CLI is a traceback for the user
        pytest.fail(f"{argv}: traceback {type(e).__name__}: {e}")


CASES = [(cmd, bad) for cmd in MODEL_COMMANDS for bad in sorted(BAD_MODELS)]


@pytest.mark.parametrize("cmd,bad", CASES, ids=[f"{c}-{b}" for c, b in CASES])
def test_commands_refuse_bad_models_with_one_line(cmd, bad, bad_models, tmp_path, tiny_text_file, area_data):
    model = bad_models[bad]
    before = _sha_tree(model)
    out = tmp_path / "out"
    code, _, err = _run(MODEL_COMMANDS[cmd], model=model, out=out, text=tiny_text_file, **area_data)
    assert code == 2, (cmd, bad, code, err)
    _one_error_line(err)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    assert _sha_tree(model) == before


DATA_CASES = {
    "non-utf8-jsonl": ("calib.jsonl", b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', "not UTF-8"),
    "malformed-jsonl": ("calib.jsonl", b'{"text": "ok"}\n{"text": \n', ":2: malformed JSON"),
    "missing-field": ("calib.jsonl", b'{"txt": "ok"}\n', "missing field 'text'"),
    "corrupt-parquet": ("calib.parquet", b"PAR1 this is not parquet", "parquet"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_calibration_data_is_one_line(case, clean_tiny, tmp_path):
    name, payload, needle = DATA_CASES[case]
    data = tmp_path / name
    data.write_bytes(payload)
    out = tmp_path / "out"
    code, _, err = _run(MODEL_COMMANDS["compress"], model=clean_tiny, out=out, text=data)
    assert code == 2, err
    line = _one_error_line(err)
    assert needle in line and name in line, line
    assert not out.exists() and data.read_bytes() == payload


def test_output_whose_parent_is_a_file_fails_before_work(clean_tiny, tmp_path, tiny_text_file):
    f = tmp_path / "afile"
    f.write_text("x")
    code, _, err = _run(MODEL_COMMANDS["quantize"], model=clean_tiny, out=f / "out", text=tiny_text_file)
    assert code == 2 and "not a directory" in _one_error_line(err)


def test_bad_global_values_are_one_line():
    for argv, needle in ((["--seed", str(2**70), "models", "list"], "--seed"),
                         (["--dtype", "bogus", "models", "list"], "--dtype"),
                         (["--threads", "0", "models", "list"], "--threads")):
        code, _, err = run_cli(*argv)
        assert code == 2 and needle in _one_error_line(err), (argv, err)


def test_sigint_mid_run_exits_130_with_one_line_and_leaves_nothing(clean_tiny, tmp_path, tiny_text_file):
    """Ctrl-C while a writing command works: `error: interrupted`, exit 130, no OUT, no temp dir."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    big = tmp_path / "big.txt"
    big.write_text(tiny_text_file.read_text() * 400)  # long enough that the run is still working when signalled
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen([sys.executable, "-m", "llmtool", "--quiet", "compress", str(clean_tiny), str(out), "--ratio", "0.2",
                          "--calib-data", str(big), "--calib-samples", "2000", "--calib-seqlen", "64"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    started = time.time()
    while time.time() < deadline and p.poll() is None and not (
            list(tmp_path.glob(".out.tmp-*")) and time.time() - started > 1) and time.time() - started < 12:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    if p.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert p.returncode == 130, err
    assert _one_error_line(err) == "error: interrupted"
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


WRITERS = [cmd for cmd, argv in MODEL_COMMANDS.items() if "{out}" in argv]


@pytest.mark.parametrize("cmd", WRITERS)
def test_interrupt_while_working_leaves_nothing(cmd, clean_tiny, tmp_path, tiny_text_file, area_data, monkeypatch,
                                                capsys):
    """Every writing command interrupted mid-run (Ctrl-C arriving while the model loads, after OUT's temp dir
    exists): exit 130, one `error: interrupted` line, no OUT, no temp dir, inputs unchanged. bench-agent's
    runs are resumable by design: they load the agent first and keep only a `.OUT.partial` work dir, which
    the next run resumes (or `--restart` discards)."""
    resumable = cmd.startswith("bench-agent")
    import sys

    import llmtool.core.models as models
    from llmtool.cli import main

    def interrupted(*a, **k):
        assert resumable or list(tmp_path.glob(".out.tmp-*")), "interrupt before the temp dir exists tests nothing"
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load_model", interrupted)
    before = _sha_tree(clean_tiny)
    argv = [a.format(model=clean_tiny, out=tmp_path / "out", text=tiny_text_file, **area_data)
            for a in MODEL_COMMANDS[cmd]]
    monkeypatch.setattr(sys, "argv", ["llmtool", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 130, err
    assert _one_error_line(err) == "error: interrupted"
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.glob(".out*")] in ([], [".out.partial"] if resumable else [])
    assert _sha_tree(clean_tiny) == before


def test_unwritable_llmtool_home_fails_before_materializing(tmp_path):
    """$LLMTOOL_HOME that cannot be created: one line, exit 2, before the packaged model is converted."""
    from conftest import run_cli_subprocess

    f = tmp_path / "afile"
    f.write_text("x")
    p = run_cli_subprocess("models", "pull", "smollm2-135m", env={"LLMTOOL_HOME": str(f / "home")}, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "not a directory" in _one_error_line(p.stderr)


# ------------------------------------------------------------------------ meaningless exit 0, second round
ARG_CASES = {
    # name: (argv template, needle in the one error line)
    "ppl-empty-text": (["evaluate", "ppl", "{model}", "--data", "{empty}"], "perplexity needs at least 2"),
    "bai-sim-gap-nan": (["evaluate", "bai-sim", "--synthetic", "irt", "--k", "4", "--n", "50", "--gap", "nan",
                         "--reps", "2", "-o", "{out}.csv"], "--gap"),
    "bai-sim-gap-too-big": (["evaluate", "bai-sim", "--synthetic", "irt", "--k", "4", "--n", "50", "--gap", "0.5",
                             "--reps", "2", "-o", "{out}.csv"], "outside (0, 1)"),
    "keystone-k-negative": (["edit", "keystone", "ablate", "{model}", "--neurons", "{empty}", "--k", "-5"], "--k -5"),
    "metrics-string-score": (["evade", "metrics", "{strscore}", "{okscore}"], "'score' must be a finite number"),
    "metrics-nan-score": (["evade", "metrics", "{okscore}", "{nanscore}"], "'score' must be a finite number"),
    "quality-nli-model-is-a-causal-lm": (["evade", "quality", "{okscore}", "--nli-model", "{model}"],
                                         "not an NLI classifier"),
}


@pytest.fixture()
def arg_files(tmp_path) -> dict[str, Path]:
    files = {"empty": tmp_path / "empty.txt", "strscore": tmp_path / "str.jsonl", "okscore": tmp_path / "ok.jsonl",
             "nanscore": tmp_path / "nan.jsonl"}
    files["empty"].write_text("")
    files["strscore"].write_text(json.dumps({"score": "abc", "is_watermarked": True, "score_kind": "z"}) + "\n")
    files["okscore"].write_text(json.dumps({"score": 1.5, "is_watermarked": False, "score_kind": "z"}) + "\n")
    files["nanscore"].write_text('{"score": NaN, "is_watermarked": false, "score_kind": "z"}\n')
    return files


@pytest.mark.parametrize("case", sorted(ARG_CASES))
def test_meaningless_inputs_are_refused(case, clean_tiny, tmp_path, arg_files):
    argv, needle = ARG_CASES[case]
    out = tmp_path / "result"
    before = {k: v.read_bytes() for k, v in arg_files.items()}
    code, _, err = _run(argv, model=clean_tiny, out=out, **arg_files)
    assert code == 2, (case, code, err)
    assert needle in _one_error_line(err), err
    assert not list(tmp_path.glob("result*"))
    assert {k: v.read_bytes() for k, v in arg_files.items()} == before


def test_outputs_of_one_tool_refused_by_the_other(clean_tiny, tmp_path, tiny_text_file):
    """A low-rank output given to quantize (was an internal AttributeError) and a quantized output given
    to compress are one-line errors; the output files have ordinary permissions (safetensors writes 0600)."""
    import os
    import stat

    lowrank = tmp_path / "lowrank"
    code, _, err = run_cli("compress", "--method", "svd", str(clean_tiny), str(lowrank), "--ratio", "0.2")
    assert code == 0, err
    mask = os.umask(0)
    os.umask(mask)
    for f in lowrank.glob("*.safetensors"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask
    code, _, err = run_cli("quantize", "--method", "rtn", str(lowrank), str(tmp_path / "q"), "--no-eval")
    assert code == 2 and "low-rank" in _one_error_line(err)
    quant = tmp_path / "quant"
    code, _, err = run_cli("quantize", "--method", "rtn", str(clean_tiny), str(quant), "--no-eval")
    assert code == 0, err
    code, _, err = run_cli("compress", "--method", "svd", str(quant), str(tmp_path / "c"), "--ratio", "0.2")
    assert code == 2 and "quantized" in _one_error_line(err)
    assert not (tmp_path / "q").exists() and not (tmp_path / "c").exists()


def test_edit_statistics_cache_is_keyed_by_content_and_survives_corruption(clean_tiny, tmp_path):
    """Stale caches: a different corpus file of the same name must not reuse old statistics; a corrupt
    cache file is recomputed, not a traceback."""
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.edit.covariance import second_moments

    model, tok = load_model(clean_tiny), load_tokenizer(clean_tiny)
    root = tmp_path / "stats"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat and looked at the dog. " * 60)
    a = second_moments(model, tok, [0], "fp", corpus=str(corpus), samples=64, seqlen=16, root=root)[0]
    corpus.write_text("zebra quantum xylophone! 12345 ?? " * 80)  # same name, other content
    b = second_moments(model, tok, [0], "fp", corpus=str(corpus), samples=64, seqlen=16, root=root)[0]
    assert not torch.allclose(a, b)
    cached = sorted(root.rglob("*.safetensors"))
    assert len(cached) == 2
    for f in cached:
        f.write_bytes(b"garbage")
    c = second_moments(model, tok, [0], "fp", corpus=str(corpus), samples=64, seqlen=16, root=root)[0]
    assert torch.allclose(b, c)


# ------------------------------------------------------------------------ fast failure, before heavy imports
# Every leaf command of the tree, called with its input(s) missing ({m}: a path that does not exist, or an
# unknown name; {o}: a fresh output path). Each must exit 2 with one `error:` line naming the missing input,
# before torch or transformers is imported. A command that reads no input is listed in NO_INPUT instead;
# `test_every_command_is_in_the_fast_fail_walk` keeps the two in step with the command tree.
FAST_FAIL: dict[str, list[str]] = {
    "models pull": ["{m}"],
    "models export": ["{m}", "{o}"],
    "compress": ["{m}", "{o}", "--ratio", "0.2"],
    "quantize": ["{m}", "{o}"],
    "kvcache generate": ["{m}", "--prompts", "{m}.jsonl"],
    "kvcache evaluate": ["{m}", "--task", "ppl"],
    "edit apply": ["{m}", "counterfact-smollm2", "{o}"],
    "edit keystone find": ["{m}"],
    "edit keystone ablate": ["{m}", "--neurons", "{m}.json"],
    "edit keystone finetune": ["{m}", "{o}", "--neurons", "{m}.json"],
    "evaluate ppl": ["{m}"],
    "evaluate edits": ["{m}", "{m}.jsonl"],
    "evaluate tasks": ["{m}", "--task", "ppl"],
    "evaluate sysr": ["--responses", "{m}.csv"],
    "evaluate build-matrix": ["--responses", "{m}.jsonl", "-o", "{o}.csv"],
    "evaluate judge": ["--votes", "{m}.jsonl", "-o", "{o}"],
    "evaluate judge-sample": ["--judge", "{m}", "--pairs", "{m}.jsonl", "-o", "{o}.jsonl"],
    "evaluate judge-self-agg": ["--judge", "{m}", "--pairs", "{m}.jsonl", "--votes", "{m}2.jsonl", "-o", "{o}.jsonl"],
    "evaluate autograder fit": ["--data", "{m}.csv", "-o", "{o}"],
    "evaluate autograder compare": ["{m}", "{m}2"],
    "evade watermark": ["{m}", "{m}.jsonl", "-o", "{o}.jsonl"],
    "evade detect": ["{m}.jsonl"],
    "evade attack": ["{m}.jsonl", "-o", "{o}.jsonl"],
    "evade metrics": ["{m}.jsonl", "{m}2.jsonl"],
    "evade quality": ["{m}.jsonl"],
    "evade calibrate-beta": ["{m}.jsonl"],
    "select-data embed": ["{m}.jsonl", "-o", "{o}"],
    "select-data cluster": ["{m}.jsonl", "{o}", "--embeddings", "{m}.npy"],
    "select-data features": ["{m}.jsonl", "{o}"],
    "select-data select": ["{m}.jsonl", "--features", "{m}.npz", "-o", "{o}"],
    "select-data distill": ["{m}.json", "{m}.jsonl", "-o", "{o}"],
    "select-data label": ["{m}.jsonl", "--student", "{m}", "-o", "{o}"],
    "select-data mix": ["{m}.jsonl", "-o", "{o}.json"],
    "select-data sample": ["{m}.jsonl", "--weights", "natural", "--tokens", "10", "-o", "{o}.jsonl"],
    "route make-experts": ["{m}", "{o}", "--data", "{m}.jsonl"],
    "route train": ["{o}", "--data", "{m}.jsonl", "--experts", "{m}"],
    "route generate": ["--in", "{m}.jsonl", "--out", "{o}.jsonl", "--router", "{m}"],
    "route eval": ["--data", "{m}.jsonl", "--out", "{o}", "--router", "{m}"],
    "route make-prefs": ["--router", "{m}", "--data", "{m}.jsonl", "--out", "{o}.jsonl"],
    "route baseline": ["{o}", "--method", "seq-select", "--experts", "{m}", "--in", "{m}.jsonl"],
    "train pretrain": ["{o}", "--data", "{m}.txt"],
    "train sft": ["{m}", "{o}", "--data", "{m}.jsonl"],
    "train grpo": ["{m}", "{o}", "--data", "{m}.jsonl"],
    "train eval-passk": ["{m}", "--data", "{m}.jsonl"],
    "train label-majority": ["{m}", "--data", "{m}.jsonl", "-o", "{o}.jsonl"],
    "bench-agent rewrite-spec": ["--env", "{m}"],
    "bench-agent run": ["{m}", "{o}"],
    "bench-agent report": ["{m}"],
    "bench-agent uh-run": ["{m}", "{o}"],
    "bench-agent uh-score": ["{m}"],
    "bench-agent uh-entropy": ["{m}"],
    "tasks generate": ["{o}", "--task", "{m}"],
    "learn-program run": ["{o}", "--data", "{m}", "--proposer", "mock:parity"],
    "learn-program baseline": ["{o}", "--method", "xgboost", "--data", "{m}"],
}
# Commands that read no input file or name: they list, simulate or generate (their bad *values* are in
# ARG_CASES or the area's tests).
NO_INPUT = {"models list", "evaluate bai-sim", "evaluate judge-synth", "evade prompts", "route data", "train rl-data",
            "bench-agent envs", "bench-agent uh-play", "tasks list", "doctor",
            "example-data"}


def command_tree() -> list[str]:
    """Every leaf command of `llmtool`, as 'area sub sub'."""
    import importlib

    import typer

    from llmtool.cli import AREAS

    out = []

    def walk(cmd, path):
        ctx = cmd.context_class(cmd)
        names = cmd.list_commands(ctx) if hasattr(cmd, "list_commands") else []
        if names:  # a group: its own and its lazily contributed sub-commands
            for name in names:
                walk(cmd.get_command(ctx, name), [*path, name])
        else:  # a command (compress and quantize are groups whose callback is the command)
            out.append(" ".join(path))

    for area, (module, _) in AREAS.items():
        walk(typer.main.get_command(importlib.import_module(module).app), [area])
    return out


def test_every_command_is_in_the_fast_fail_walk():
    tree = set(command_tree())
    assert not NO_INPUT & set(FAST_FAIL)
    assert tree == set(FAST_FAIL) | NO_INPUT, {"not in the walk": sorted(tree - set(FAST_FAIL) - NO_INPUT),
                                               "not a command": sorted(set(FAST_FAIL) | NO_INPUT - tree)}


def test_missing_inputs_fail_before_torch_is_imported(tmp_path):
    """Every command refuses a missing input with one line naming it, before torch or transformers is imported
    (the subprocess makes importing either an error, so a command that imports them first fails the case)."""
    import subprocess
    import sys

    cases = {}
    for i, (cmd, argv) in enumerate(FAST_FAIL.items()):
        cases[cmd] = [*cmd.split(), *(a.format(m=tmp_path / "nope", o=tmp_path / f"out{i}") for a in argv)]
    code = ("import io, json, sys, contextlib\n"
            "sys.modules['torch'] = None\nsys.modules['transformers'] = None\n"
            "from llmtool.cli import main\n"
            f"cases = {cases!r}\nres = {{}}\n"
            "for cmd, argv in cases.items():\n"
            "    sys.argv = ['llmtool', *argv]\n    err = io.StringIO()\n    rc = 0\n"
            "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n            main()\n        except SystemExit as e:\n            rc = e.code\n"
            "    res[cmd] = [rc, err.getvalue()]\n"
            "print(json.dumps(res))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    bad = {}
    for cmd, (rc, err) in res.items():
        lines = [l for l in err.splitlines() if l.strip()]
        if rc != 2 or len(lines) != 1 or not lines[0].startswith("error:") or "nope" not in lines[0]:
            bad[cmd] = (rc, err.strip()[:200])
    assert not bad, '\n'.join(f'{k}: {v}' for k, v in bad.items())
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".out*"))


# ------------------------------------------------------------------------ docs/reliability.md (kept in sync)
DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
BEGIN, END = "<!-- begin: generated by tests/test_reliability.py -->", "<!-- end: generated -->"


def reliability_table() -> str:
    """Cases per command of this file's walk; every case expects exit 2 with one `error:` line, no
    traceback, no output or temp dir left, inputs byte-identical."""
    per: dict[str, dict[str, int]] = {}

    def add(cmd: str, kind: str, n: int = 1) -> None:
        per.setdefault(cmd, {}).setdefault(kind, 0)
        per[cmd][kind] += n

    for cmd in MODEL_COMMANDS:
        add(cmd, "hostile checkpoint", len(BAD_MODELS))
    add("compress", "bad calibration data", len(DATA_CASES))
    add("quantize", "output parent is a file")
    for argv, _ in ARG_CASES.values():
        add(" ".join(a for a in argv[:2] if not a.startswith("{")), "meaningless value")
    for cmd in FAST_FAIL:
        add(cmd, "missing input, before torch")
    for cmd in WRITERS:
        add(cmd, "interrupted mid-run")
    kinds = sorted({k for d in per.values() for k in d})
    lines = ["| command | " + " | ".join(kinds) + " | total |", "|---" * (len(kinds) + 2) + "|"]
    for cmd in sorted(per):
        row = [str(per[cmd].get(k, "")) for k in kinds]
        lines.append(f"| `{cmd}` | " + " | ".join(row) + f" | {sum(per[cmd].values())} |")
    total = sum(sum(d.values()) for d in per.values())
    lines.append("| **all** | " + " | ".join(str(sum(d.get(k, 0) for d in per.values())) for k in kinds)
                 + f" | {total} |")
    hostile = ", ".join(f"`{b}`" for b in sorted(BAD_MODELS))
    return "\n".join([BEGIN, "", *lines, "", f"Hostile checkpoints: {hostile}.", "", END])


def test_reliability_doc_lists_the_current_cases():
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == reliability_table(), "regenerate with: python tests/test_reliability.py"


if __name__ == "__main__":  # rewrite the generated block of docs/reliability.md
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    DOC.write_text(text[:start] + reliability_table() + text[end:])
    print(f"wrote {DOC}")
