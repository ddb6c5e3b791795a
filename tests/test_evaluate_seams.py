"""evaluate on the shared seams: the task registry with providers from other areas (imported by name
only when asked), contributed sub-commands without an import cycle, and shared generation (core.lm)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import run_cli


def test_importing_evaluate_cli_loads_no_other_area_nor_torch():
    code = ("import sys, llmtool.evaluate.cli as c; "
            "bad = sorted(m for m in sys.modules if m.startswith('llmtool.') and m.split('.')[1] not in "
            "('core', 'evaluate', '__main__')) + [m for m in ('torch',) if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_task_list_comes_from_providers():
    from llmtool.evaluate.tasks import registry

    code, stdout, err = run_cli("--json", "evaluate", "tasks")
    assert code == 0, err
    listed = json.loads(stdout)["tasks"]
    assert set(listed) == set(registry())
    assert {"ppl", "retention", "niah_single", "ruler"} <= set(listed)
    assert listed["niah_single"]["provider"] == "llmtool.kvcache.eval_tasks"


def test_tasks_match_the_area_commands(tiny_llama_dir, tiny_text_file, tmp_path):
    out = tmp_path / "r.json"
    code, stdout, err = run_cli("--json", "evaluate", "tasks", tiny_llama_dir, "--task", "ppl,retention",
                                "--task", "niah_single", "--data", tiny_text_file, "--seqlen", "64",
                                "--base", tiny_llama_dir, "--filler", tiny_text_file, "--length", "96",
                                "--samples", "2", "-o", out)
    assert code == 0, err
    res = json.loads(stdout)["results"]
    assert json.loads(out.read_text())["results"] == res
    code, stdout, err = run_cli("--json", "evaluate", "ppl", tiny_llama_dir, "--data", tiny_text_file,
                                "--seqlen", "64")
    assert code == 0, err
    assert res["ppl"]["ppl"] == pytest.approx(json.loads(stdout)["ppl"], rel=1e-9)
    assert res["retention"]["retention"] == pytest.approx(1.0, abs=1e-9)   # base = model
    code, stdout, err = run_cli("--json", "kvcache", "evaluate", tiny_llama_dir, "--task", "niah_single",
                                "--filler", tiny_text_file, "--length", "96", "--samples", "2")
    assert code == 0, err
    assert res["niah_single"]["accuracy"] == json.loads(stdout)["accuracy"]


def test_task_errors_are_one_line(tiny_llama_dir):
    code, _, err = run_cli("evaluate", "tasks", tiny_llama_dir, "--task", "nosuch")
    assert code == 2 and "unknown task 'nosuch'" in err and "ppl" in err
    code, _, err = run_cli("evaluate", "tasks", tiny_llama_dir)
    assert code == 2 and "--task" in err


def test_provider_hook_adds_a_task(monkeypatch, tmp_path):
    """An area contributes a task by naming its module in the provider table (no import of evaluate)."""
    from llmtool.evaluate import tasks

    (tmp_path / "toy_provider.py").write_text(
        "def tasks():\n    return {'toy': (lambda m, t, o: {'seed': o.seed}, 'A toy task.')}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(tasks.PROVIDERS, "toy_provider", "toy")
    assert tasks.run(None, None, ["toy"], tasks.TaskOptions(seed=7)) == {"toy": {"seed": 7}}
    monkeypatch.setitem(tasks.PROVIDERS, "not_installed_provider", "absent")
    assert "toy" in tasks.registry()


def test_contributed_command_runs(tiny_llama_dir):
    code, stdout, _ = run_cli("evaluate", "edits", "--help")
    assert code == 0 and "edits" in stdout.lower()


def test_live_sysr_answers_are_core_lm_greedy(tiny_llama_dir, tmp_path):
    """sysr live mode decodes with core.lm.generate: its answer equals plain HF greedy decoding."""
    import torch

    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.evaluate.sysr_live import live_scorer

    model, tok = load_model(tiny_llama_dir), load_tokenizer(tiny_llama_dir)
    prompt = "It is a truth universally"
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    reference = tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip().splitlines()[0]
    assert reference
    (tmp_path / "models.yaml").write_text(f"- {{name: a, path: {tiny_llama_dir}, max_new_tokens: 6}}\n"
                                          f"- {{name: b, path: {tiny_llama_dir}, max_new_tokens: 6}}\n")
    (tmp_path / "bench.jsonl").write_text(json.dumps({"id": 1, "prompt": prompt, "reference": reference}) + "\n"
                                          + json.dumps({"id": 2, "prompt": prompt, "reference": "zzz"}) + "\n")
    _, _, score = live_scorer(tmp_path / "models.yaml", tmp_path / "bench.jsonl", "exact_match")
    assert score("a", 0) == 1.0 and score("b", 1) == 0.0


def test_bai_methods_contract():
    import numpy as np

    from llmtool.core.console import UsageError
    from llmtool.evaluate.bai import BAI_CONFIGS, BAI_METHODS, default_methods, parse_method
    from llmtool.evaluate.sysr import MatrixOracle

    assert set(BAI_CONFIGS.names()) == set(BAI_METHODS.names())
    assert "full" not in default_methods() and len(default_methods()) == len(BAI_CONFIGS.names()) - 1
    assert parse_method("ucbe@0.1").a == 0.1
    assert parse_method("ucbe-lrf@3").eta == 3.0          # was silently dropped (set an unknown `a`)
    for bad, word in (("sysr@1", "no option"), ("ucbe@-1", "--a"), ("nope", "nope"), ("ucbe@x", "not a number")):
        with pytest.raises(UsageError, match=word):
            parse_method(bad)
    scores = np.random.default_rng(0).random((4, 200)) < np.linspace(0.3, 0.6, 4)[:, None]
    cfg = parse_method("ucbe-lrf@2", ensemble=4)
    a = cfg.run(MatrixOracle(scores.astype(float), np.random.default_rng(1)), 200, np.random.default_rng(2))
    b = BAI_METHODS.get("ucbe-lrf")(MatrixOracle(scores.astype(float), np.random.default_rng(1)), 200,
                                    np.random.default_rng(2), eta=2.0, ensemble=4)
    assert a.best == b.best and a.used == b.used
