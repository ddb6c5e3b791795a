"""Tests for `llmtool tasks` and `llmtool learn-program` (spec llm-pv §8)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from llmtool.learn_program import programs
from llmtool.learn_program.reference_programs import program_for, replay_lines
from llmtool.learn_program.tasks import (SOLVABLE, TASKS, automata_parity, dyck2, generate, palindrome, parity_all,
                                         prime_decimal, write_dataset)

# --------------------------------------------------------------------------------------- generators


@pytest.mark.parametrize("length", [20, 100])
def test_generators_balanced_unique_and_labelled_by_the_rule(length):
    for name, task in TASKS.items():
        n_test = 40 if name in ("prime_decimal", "prime_plus_47") and length == 100 else 200
        ds = generate(name, length, 20, 20, n_test, seed=7)
        xs = [x for split in (ds.train, ds.val, ds.test) for x, _ in split]
        assert len(set(xs)) == len(xs), name
        for split in (ds.train, ds.val, ds.test):
            assert 2 * sum(y for _, y in split) == len(split), name
            assert all(task.rule(x) == y for x, y in split), name
        if task.kind == "graph":
            assert all(len(x) == 6 * length for x in xs)
        else:
            assert all(len(x) == length for x in xs), name


def test_generation_is_byte_identical_and_seeded(tmp_path):
    for name in ("parity_all", "dyck2", "patternmatch1", "parity_rand_10"):
        a, b = tmp_path / f"{name}_a", tmp_path / f"{name}_b"
        a.mkdir()
        b.mkdir()
        write_dataset(generate(name, 30 if name != "dyck2" else 20, 40, 40, 100, seed=5), a)
        write_dataset(generate(name, 30 if name != "dyck2" else 20, 40, 40, 100, seed=5), b)
        for f in ("train.txt", "val.txt", "test.txt", "meta.json"):
            assert (a / f).read_bytes() == (b / f).read_bytes()
    assert generate("parity_all", 30, 40, 40, 100, seed=5).train != generate("parity_all", 30, 40, 40, 100, seed=6).train
    assert generate("parity_rand_3", 100, 2, 2, 2).meta["positions"] == sorted(
        generate("parity_rand_3", 100, 2, 2, 2).meta["positions"])


def test_rule_spot_checks():
    assert parity_all("1101") == 1
    assert palindrome("0110") == 1
    assert dyck2("0001") == 1 and dyck2("0010") == 0
    assert automata_parity("000") == 0
    assert prime_decimal("97") == 1 and prime_decimal("91") == 0


def test_too_small_input_space_is_a_usage_error():
    from llmtool.core.console import UsageError

    with pytest.raises(UsageError, match="too small"):
        generate("palindrome", 10, 100, 100, 200)


# --------------------------------------------------------------------------------------- parsing


def test_extract_code_from_json_fence_and_bare_def():
    body = "def f(x):\n    return x.count('1') % 2\n"
    assert programs.extract_code("Sure!\n" + json.dumps({"code": body})) == body
    double = '{"code": "def f(x):\\\\n    return 1\\\\n"}'  # newlines escaped twice
    assert programs.extract_code(double) == "def f(x):\n    return 1\n"
    assert programs.extract_code("Here:\n```python\n" + body + "```\nDone.") == body
    bare = "import math\nThe rule is parity.\ndef g(x):\n    return math.floor(1)\nThat is all."
    assert programs.extract_code(bare) == "import math\ndef g(x):\n    return math.floor(1)\n"
    assert programs.extract_code("I do not know the rule.") is None
    assert programs.function_name("def g(x):\n    return 1\ndef f(x):\n    return g(x)\n") == "f"
    assert programs.function_name("def g(x):\n    return 1\n") == "g"
    assert programs.function_name("def f(x)\n    return 1\n") is None
    assert programs.source_length("def f(x):\n    # comment\n\n    return 1  # c\n") == len("def f(x):") + len("    return 1")


def test_normalise_predictions():
    assert [programs.normalise(v) for v in (True, False, 0, 5, "1", " true ", "false")] == [1, 0, 0, 1, 1, 1, 0]
    assert programs.normalise("yes") is None and programs.normalise(0.5) is None and programs.normalise(None) is None


# --------------------------------------------------------------------------------------- selection


def _parity_data(tmp_path, length=10):
    d = tmp_path / "data"
    d.mkdir()
    ds = generate("parity_all", length, 100, 100, 200, seed=1)
    write_dataset(ds, d)
    return d, ds


def _selection_replay(tmp_path, ds):
    bad = [x for x, _ in ds.val[:30]]
    lines = [
        json.dumps({"raw_text": '{"code": "def f(x)\\n    return 1\\n"}'}),  # syntax error
        json.dumps({"code": f"def f(x):\n    return (x.count('1') % 2) ^ (x in {bad!r})\n"}),  # val 0.7
        json.dumps({"code": "def f(x):\n    # count the ones\n    ones = sum(1 for c in x if c == '1')\n"
                            "    return ones % 2\n"}),
        json.dumps({"code": "def f(x):\n    return x.count('1') % 2\n"}),
    ]
    p = tmp_path / "replay.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_selection_by_validation_with_early_stop_and_ties(tmp_path):
    data, ds = _parity_data(tmp_path)
    replay = _selection_replay(tmp_path, ds)
    code, out, err = run_cli("learn-program", tmp_path / "run1", "--data", data, "--proposer", f"replay:{replay}")
    assert code == 0, err
    summ = json.loads((tmp_path / "run1" / "summary.json").read_text())
    assert summ["selected_idx"] == 2 and summ["k_used"] == 3 and summ["early_stopped"] == [True]
    cands = [json.loads(l) for l in (tmp_path / "run1" / "candidates.jsonl").read_text().splitlines()]
    assert [c["parse_ok"] for c in cands] == [True, True, True]
    assert cands[0]["compile_ok"] is False and cands[1]["val_acc"] == pytest.approx(0.7) and cands[1]["train_acc"] == 1.0
    assert summ["test_acc"] == 1.0
    assert (tmp_path / "run1" / "selected.py").read_text().startswith("def f(x):\n    # count")

    code, _, err = run_cli("learn-program", tmp_path / "run2", "--data", data, "--proposer", f"replay:{replay}",
                           "--no-early-stop")
    assert code == 0, err
    summ = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert summ["k_used"] == 4 and summ["selected_idx"] == 3  # tie on val and train -> shorter source


def test_prompt_has_training_lines_only(tmp_path):
    data, ds = _parity_data(tmp_path)
    code, _, err = run_cli("learn-program", tmp_path / "run", "--data", data, "--proposer", "mock:parity")
    assert code == 0, err
    prompt = (tmp_path / "run" / "prompt.txt").read_text()
    assert all(f"{x} -> {y}" in prompt for x, y in ds.train)
    assert not any(x in prompt for x, _ in ds.val + ds.test)
    cand = json.loads((tmp_path / "run" / "candidates.jsonl").read_text().splitlines()[0])
    import hashlib

    assert cand["prompt_sha256"] == hashlib.sha256(prompt.encode()).hexdigest()


def test_end_to_end_length_generalisation_with_mock(tmp_path):
    code, out, err = run_cli("--json", "learn-program", tmp_path / "ok", "--task", "parity_all", "--length", "10",
                             "--train", "100", "--val", "100", "--test", "400", "--proposer", "mock:parity",
                             "--test-lengths", "10,50,100")
    assert code == 0, err
    summ = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert summ["length_generalization"] == {"10": 1.0, "50": 1.0, "100": 1.0}
    code, _, err = run_cli("learn-program", tmp_path / "weak", "--task", "parity_all", "--length", "10",
                           "--test", "400", "--proposer", "mock:first-bit", "--samples", "2", "--test-lengths", "100")
    assert code == 0, err
    summ = json.loads((tmp_path / "weak" / "summary.json").read_text())
    assert 0.4 <= summ["test_acc"] <= 0.6 and 0.4 <= summ["length_generalization"]["100"] <= 0.6


def test_replay_reference_programs_solve_tasks(tmp_path):
    for name in ("dyck2", "parity_rand_10", "patternmatch2"):
        p = tmp_path / f"{name}.jsonl"
        p.write_text("\n".join(replay_lines(name, 40)) + "\n")
        code, _, err = run_cli("learn-program", tmp_path / name, "--task", name, "--length", "40", "--test", "400",
                               "--proposer", f"replay:{p}")
        assert code == 0, err
        summ = json.loads((tmp_path / name / "summary.json").read_text())
        assert summ["selected_idx"] == 1 and summ["best_val"] == 1.0 and summ["test_acc"] == 1.0
    assert set(SOLVABLE) == {"parity_all", "parity_first_half", "patternmatch1", "patternmatch2", "parity_rand_3",
                             "parity_rand_10", "palindrome", "dyck2", "prime_decimal", "automata_parity"}
    assert all(program_for(t, 40) for t in SOLVABLE)


def test_hostile_candidate_is_just_a_wrong_candidate(tmp_path):
    data, _ = _parity_data(tmp_path)
    outside = tmp_path / "pwned.txt"
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"code": f"import os\ndef f(x):\n    os.system('touch {outside}')\n    return 1\n"}) + "\n")
    code, _, err = run_cli("learn-program", tmp_path / "run", "--data", data, "--proposer", f"replay:{p}")
    assert code == 0, err
    cand = json.loads((tmp_path / "run" / "candidates.jsonl").read_text())
    assert cand["val_acc"] == 0.0 and "blocked os.system" in cand["error"] and not outside.exists()


# --------------------------------------------------------------------------------------- bad input


def test_bad_inputs_are_one_line_errors(tmp_path):
    data, _ = _parity_data(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("train.txt", "val.txt", "test.txt"):
        (bad / f).write_text((data / f).read_text())
    (bad / "val.txt").write_text("0101 -> 1\n0110 -> 2\n")
    code, _, err = run_cli("learn-program", tmp_path / "o1", "--data", bad, "--proposer", "mock:parity")
    assert code == 2 and "val.txt:2" in err and not (tmp_path / "o1").exists()
    code, _, err = run_cli("learn-program", tmp_path / "o2", "--task", "no_such_task", "--proposer", "mock:parity")
    assert code == 2 and "unknown task" in err
    code, _, err = run_cli("tasks", "generate", tmp_path / "o3", "--task", "no_such_task")
    assert code == 2 and "unknown task" in err and not (tmp_path / "o3").exists()
    code, _, err = run_cli("learn-program", tmp_path / "o4", "--data", data, "--proposer", "openai:m",
                           "--api-base", "http://127.0.0.1:9/v1")
    assert code == 2 and "cannot reach" in err and not (tmp_path / "o4").exists()
    code, _, err = run_cli("learn-program", tmp_path / "o5", "--data", data, "--proposer", "bogus:x")
    assert code == 2
    code, _, err = run_cli("learn-program", tmp_path / "o6", "--data", data, "--proposer", "mock:none", "--samples", "2")
    assert code == 0, err
    cands = [json.loads(l) for l in (tmp_path / "o6" / "candidates.jsonl").read_text().splitlines()]
    assert [c["parse_ok"] for c in cands] == [False, False] and not (tmp_path / "o6" / "selected.py").exists()
    code, _, err = run_cli("learn-program", tmp_path / "o6", "--data", data, "--proposer", "mock:none")
    assert code == 2  # OUT exists
    bad_replay = tmp_path / "bad.jsonl"
    bad_replay.write_text('{"raw_text": "x"}\n{oops\n')
    code, _, err = run_cli("learn-program", tmp_path / "o7", "--data", data, "--proposer", f"replay:{bad_replay}")
    assert code == 2 and "bad.jsonl:2" in err


# --------------------------------------------------------------------------------------- baselines


def test_tree_baselines_near_chance_on_parity_and_registry_cli(tmp_path):
    for method in ("xgboost", "random-forest"):
        code, _, err = run_cli("learn-program", "baseline", tmp_path / method, "--task", "parity_all", "--length",
                               "100", "--test", "2000", "--method", method)
        assert code == 0, err
        rep = json.loads((tmp_path / method / "report.json").read_text())
        assert 0.45 <= rep["test_acc"] <= 0.55 and rep["train_acc"] >= 0.95, (method, rep)
    code, _, err = run_cli("learn-program", "baseline", tmp_path / "x", "--task", "parity_all", "--method",
                           "random-forest", "--lr", "0.1")
    assert code == 2 and "--lr" in err


def test_linear_and_mlp_baselines_recover_a_planted_linear_rule(tmp_path):
    import random

    rng = random.Random(0)
    d = tmp_path / "planted"
    d.mkdir()
    for split, n in (("train", 200), ("val", 100), ("test", 400)):
        rows = []
        for _ in range(n):
            x = "".join(rng.choice("01") for _ in range(12))
            rows.append(f"{x} -> {int(x[3] == '1')}")
        (d / f"{split}.txt").write_text("\n".join(rows) + "\n")
    for method in ("logreg", "mlp"):
        code, _, err = run_cli("learn-program", "baseline", tmp_path / method, "--data", d, "--method", method)
        assert code == 0, err
        assert json.loads((tmp_path / method / "report.json").read_text())["test_acc"] >= 0.97, method


@pytest.mark.slow  # CPU-heavy under load (minutes on a shared 2-core box)
def test_transformer_baseline_learns_a_first_bit_rule(tmp_path):
    import random

    rng = random.Random(1)
    d = tmp_path / "fb"
    d.mkdir()
    for split, n in (("train", 200), ("val", 100), ("test", 200)):
        xs = ["".join(rng.choice("01") for _ in range(8)) for _ in range(n)]
        (d / f"{split}.txt").write_text("".join(f"{x} -> {x[0]}\n" for x in xs))
    code, _, err = run_cli("learn-program", "baseline", tmp_path / "tf", "--data", d, "--method", "transformer",
                           "--epochs", "150", "--d-model", "32", "--layers", "1", "--lr", "0.003")
    assert code == 0, err
    assert json.loads((tmp_path / "tf" / "report.json").read_text())["test_acc"] >= 0.9


def test_icl_and_hf_proposer_with_a_tiny_model(tmp_path, tiny_llama_dir):
    data, _ = _parity_data(tmp_path)
    code, _, err = run_cli("learn-program", "baseline", tmp_path / "icl", "--data", data, "--method", "icl",
                           "--model", tiny_llama_dir, "--queries", "4")
    assert code == 0, err
    rep = json.loads((tmp_path / "icl" / "report.json").read_text())
    assert rep["test_queries"] == 4 and 0.0 <= rep["test_acc"] <= 1.0
    code, _, err = run_cli("learn-program", "baseline", tmp_path / "icl2", "--data", data, "--method", "icl")
    assert code == 2 and "--model" in err
    code, _, err = run_cli("learn-program", tmp_path / "hf", "--data", data, "--proposer", f"hf:{tiny_llama_dir}",
                           "--samples", "3", "--batch-size", "2", "--max-new-tokens", "6")
    assert code == 0, err
    summ = json.loads((tmp_path / "hf" / "summary.json").read_text())
    assert summ["k_used"] == 3 and summ["tokens"] > 0


def test_summary_breaks_down_why_proposals_fail(tmp_path):
    """Each proposal gets one outcome; the summary counts them (a weak proposer's val 0 is explained)."""
    data, ds = _parity_data(tmp_path)
    lines = [
        json.dumps({"raw_text": "I would use a JSON parser."}),                        # no function
        json.dumps({"raw_text": '{"code": "def f(x)\\n    return 1\\n"}'}),           # syntax error
        json.dumps({"code": "def f(x):\n    return x[:3]\n"}),                        # non-binary output
        json.dumps({"code": "def f(x):\n    return int(x) // 0\n"}),                  # exception
        json.dumps({"code": "def f(x):\n    while True:\n        pass\n"}),          # timeout
        json.dumps({"code": "def f(x):\n    return x.count('1') % 2\n"}),             # correct
    ]
    replay = tmp_path / "outcomes.jsonl"
    replay.write_text("\n".join(lines) + "\n")
    code, _, err = run_cli("learn-program", tmp_path / "run", "--data", data, "--proposer", f"replay:{replay}",
                           "--timeout-s", "0.5")
    assert code == 0, err
    summ = json.loads((tmp_path / "run" / "summary.json").read_text())
    cands = [json.loads(l) for l in (tmp_path / "run" / "candidates.jsonl").read_text().splitlines()]
    assert [c["outcome"] for c in cands] == ["no_function", "syntax_error", "non_binary_output", "exception",
                                             "timeout", "binary_on_all"]
    assert summ["outcomes"] == {"binary_on_all": 1, "no_function": 1, "syntax_error": 1, "timeout": 1,
                                "exception": 1, "non_binary_output": 1}
    assert cands[2]["val_acc"] == 0.0 and cands[5]["val_acc"] == 1.0


def test_icl_answer_nll_equals_full_forward_and_prompt_fits_the_context(tiny_llama_dir):
    """The cached ICL scorer (shared prefix once, common answer tokens once) gives the same summed NLLs as a
    full forward of every prompt + answer; examples that overflow the context are dropped, counted."""
    from llmtool.core.lm import completion_nll
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.learn_program.baselines import ICLConfig, answer_nll

    model, tok = load_model(tiny_llama_dir), load_tokenizer(tiny_llama_dir)
    ds = generate("parity_all", 10, 40, 10, 10, seed=3)
    cfg = ICLConfig(queries=4, val_queries=0)
    head, n = cfg.prompt_head(tok, list(ds.train), None)
    assert n == 40
    prompts = [head + x for x, _ in ds.test[:4]]
    got = answer_nll(model, tok, prompts, list(cfg.ANSWERS))
    for j, a in enumerate(cfg.ANSWERS):
        ref = completion_nll(model, tok, prompts, [a] * len(prompts), batch_size=4)
        assert got[j] == pytest.approx(ref, rel=1e-4, abs=1e-3)
    full = len(tok(head + ds.train[0][0], add_special_tokens=False)["input_ids"])
    head2, n2 = cfg.prompt_head(tok, list(ds.train), full // 2)
    assert 0 < n2 < 40
    assert len(tok(head2 + max((x for x, _ in ds.train), key=len), add_special_tokens=False)["input_ids"]) <= full // 2
    _, n3 = cfg.prompt_head(tok, list(ds.train), full // 2 + 200)
    assert n3 > n2
    rep = cfg.fit_eval(ds, model=model, tokenizer=tok)
    assert rep["test_queries"] == 4 and "val_acc" not in rep and rep["train_in_prompt"] <= 40


def test_benchmark_partial_reruns_keep_other_rows_and_reductions_follow_the_stored_results():
    """``--tasks`` / the icl part refresh only what they ran; the reductions are read from the stored results,
    so a partial rerun cannot relabel results it did not produce."""
    from conftest import load_benchmark

    bench = load_benchmark("learn_program")
    prev = [{"task": "parity_all", "method": "xgboost", "seed": 0, "test_acc": 0.5},
            {"task": "prime_decimal", "method": "xgboost", "seed": 0, "test_acc": 0.6},
            {"task": "prime_decimal", "method": "transformer", "seed": 0, "test_acc": 0.55}]
    new = [{"task": "prime_decimal", "method": "xgboost", "seed": s, "test_acc": 0.7} for s in range(2)]
    rows = bench.merge_rows(prev, new)
    assert [r["test_acc"] for r in rows if r["method"] == "xgboost"] == [0.5, 0.7, 0.7]
    assert any(r["method"] == "transformer" for r in rows)
    more = [{"task": "prime_decimal", "method": "transformer", "seed": s, "test_acc": 0.5} for s in (0, 1)]
    by_seed = bench.merge_rows(rows, more, keys=("task", "method", "seed"))  # seeds 0-1 replaced, xgboost kept
    assert sorted((r["method"], r["seed"], r["test_acc"]) for r in by_seed if r["task"] == "prime_decimal") == [
        ("transformer", 0, 0.5), ("transformer", 1, 0.5), ("xgboost", 0, 0.7), ("xgboost", 1, 0.7)]
    res = {"proposer": {"k": 64, "max_new_tokens": 192}, "sanity": {"k": 8},
           "classical": {"prime_test": 10_000, "rows": rows},
           "icl": {"rows": [{"task": t, "train_in_prompt": 100} for t in bench.PROPOSER_TASKS]}}
    red = " ".join(bench.reductions(res))
    assert "sanity: k = 8" in red and "proposer: k" not in red and "test inputs" not in red
    assert "transformer on 1 task(s) (seeds: prime_decimal 1)" in red and "4 of the 13" in red and "token context" not in red
    res["classical"]["prime_test"] = 2_000
    res["icl"]["rows"][0]["train_in_prompt"] = 76
    red = " ".join(bench.reductions(res))
    assert "2,000 test inputs" in red and "8,192-token context" in red
    with pytest.raises(SystemExit):
        bench._task_list("parity_all,nope", ["parity_all"])
