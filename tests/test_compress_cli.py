"""`llmtool compress` end to end on a tiny Llama, and every user error: exit 2, one clear line,
nothing left behind."""
import json

import pytest
from conftest import run_cli, run_cli_subprocess


def _args(model, out, *extra, calib):
    return ["compress", str(model), str(out), "--calib-data", str(calib), "--calib-samples", "4",
            "--calib-seqlen", "32", "--grad-seqlen", "32", *extra]


def test_compress_cli_writes_reloadable_checkpoint(tiny_llama_dir, tiny_text_file, tmp_path):
    import torch

    import llmtool

    out = tmp_path / "zs"
    code, stdout, err = run_cli("--json", *_args(tiny_llama_dir, out, "--method", "zs-svd", "--ratio", "0.4",
                                                 calib=tiny_text_file))
    assert code == 0, err
    report = json.loads(stdout)
    cfg = json.loads((out / "config.json").read_text())["llmtool_lowrank"]
    prov = json.loads((out / "llmtool.json").read_text())
    assert cfg["format_version"] == 1 and cfg["ranks"] == report["ranks"] == prov["ranks"]
    assert prov["method"] == "zs-svd" and prov["parameters"]["ratio"] == 0.4 and len(prov["source"]["sha256"]) == 64
    assert report["stored_params"] == report["params_after"] < report["params_before"]
    assert report["achieved_ratio"] >= 0.4
    assert (out / "tokenizer.json").is_file() and (out / "report.json").is_file()
    m = llmtool.load(out)
    assert torch.isfinite(m(input_ids=torch.tensor([[1, 2, 3]])).logits).all()
    # OUT exists now: without --overwrite it is refused and left as it was
    before = sorted(p.name for p in out.iterdir())
    code, _, err = run_cli(*_args(tiny_llama_dir, out, "--ratio", "0.4", calib=tiny_text_file))
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.parametrize("extra,needle", [
    (["--ratio", "0"], "--ratio"), (["--ratio", "1.0"], "--ratio"), (["--ratio", "-0.2"], "--ratio"),
    (["--ratio", "0.4", "--method", "magic"], "unknown method 'magic'"),
    (["--ratio", "0.4", "--correction", "bogus"], "--correction"),
    (["--ratio", "0.4", "--stages", "3"], "--stages"),
])
def test_bad_options_exit_2_and_leave_nothing(tiny_llama_dir, tiny_text_file, tmp_path, extra, needle):
    out = tmp_path / "out"
    code, _, err = run_cli(*_args(tiny_llama_dir, out, *extra, calib=tiny_text_file))
    assert code == 2 and needle in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_missing_dir_and_non_causal_lm(tiny_text_file, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(*_args(tmp_path / "nope", out, "--ratio", "0.4", calib=tiny_text_file))
    assert code == 2 and "nope" in err
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    code, _, err = run_cli(*_args(bert, out, "--ratio", "0.4", calib=tiny_text_file))
    assert code == 2 and "not a causal language model" in err and "config.json" in err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_subprocess_error_is_one_line_without_traceback(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_cli_subprocess("compress", tiny_llama_dir, out, "--ratio", "1.5", "--method", "svd")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "--ratio" in lines[0]
    assert "Traceback" not in proc.stderr and not out.exists()
