"""`llmtool kvcache generate|evaluate` on the tiny model: outputs, JSON, and one-line usage errors."""
from __future__ import annotations

import json

from conftest import run_cli, run_cli_subprocess


def test_generate_writes_results_and_reports_memory(tiny_llama_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"context": "The capital of France is Paris. " * 12, "question": "The capital"})
                       + "\n" + json.dumps({"prompt": "It is a truth universally acknowledged"}) + "\n")
    before = prompts.read_bytes()
    out = tmp_path / "out.jsonl"
    code, stdout, err = run_cli("--json", "kvcache", "generate", tiny_llama_dir, "--prompts", prompts, "--out", out,
                                "--max-new-tokens", "4", "--method", "snapkv", "--critical", "--budget", "0.5",
                                "--window-size", "4")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["method"] == "critical+snapkv@0.5" and len(res["results"]) == 2
    first = res["results"][0]
    assert first["kv_bytes"] < first["full_kv_bytes"] and first["new_tokens"] == 4
    assert len(out.read_text().splitlines()) == 2
    assert prompts.read_bytes() == before


def test_evaluate_ppl_and_task(tiny_llama_dir, tiny_text_file):
    code, stdout, err = run_cli("--json", "kvcache", "evaluate", tiny_llama_dir, "--task", "ppl", "--data",
                                tiny_text_file, "--prefix", "64", "--continuation", "64", "--samples", "1",
                                "--method", "patternkv", "--bits", "4", "--group-size", "16", "--residual-length", "32")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["ppl"] > 1 and res["kv_fraction"] < 1 and res["method"] == "patternkv-4bit"
    code, stdout, err = run_cli("--json", "kvcache", "evaluate", tiny_llama_dir, "--task", "niah_single",
                                "--filler", tiny_text_file, "--length", "96", "--samples", "1", "--method", "adakv",
                                "--budget", "0.5", "--window-size", "8")
    assert code == 0, err
    res = json.loads(stdout)
    assert 0 <= res["accuracy"] <= 100 and "acc_niah_single" in res


def test_bad_values_exit_2_with_one_line(tiny_llama_dir, tiny_text_file):
    base = ["kvcache", "evaluate", tiny_llama_dir, "--task", "ppl", "--data", tiny_text_file]
    for extra, word in ((["--method", "snapkv", "--budget", "0"], "--budget"),
                        (["--method", "snapkv", "--budget", "1.5"], "--budget"),
                        (["--method", "kivi", "--bits", "3"], "--bits"),
                        (["--method", "kivi", "--group-size", "64", "--residual-length", "96"], "--residual-length"),
                        (["--method", "h2o"], "h2o"),
                        (["--critical"], "--critical")):
        code, _, err = run_cli(*base, *extra)
        assert code == 2 and word in err, (extra, err)
    code, _, err = run_cli("kvcache", "evaluate", tiny_llama_dir, "--task", "nosuch")
    assert code == 2 and "nosuch" in err
    proc = run_cli_subprocess(*base, "--method", "snapkv", "--budget", "-0.2")
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in proc.stderr


def test_malformed_prompts_file(tiny_llama_dir, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"context": "ok"}\n{"question": 3}\n')
    code, _, err = run_cli("kvcache", "generate", tiny_llama_dir, "--prompts", p)
    assert code == 2 and "bad.jsonl" in err
