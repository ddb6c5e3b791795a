"""Benchmarks run with another model (issue 40's Qwen2.5-Coder rows) write their own results stem, so the
SmolLM2 results are kept; the proposer part's pass@k and val-1.0 gate; the real-judge reading follows the
measured numbers (a judge above chance is not described as at chance)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gates  # noqa: E402
from conftest import load_benchmark as _bench  # noqa: E402


def test_learn_program_results_stem_per_model():
    lp = _bench("learn_program")
    assert lp.results_stem("smollm2-135m") == lp.RESULTS / "learn_program"
    q = lp.results_stem("qwen2.5-coder-0.5b")
    assert q.name == "learn_program-qwen2-5-coder-0-5b" and q != lp.results_stem("smollm2-135m")
    assert lp.results_stem("some/dir/My.Model/").name == "learn_program-my-model"
    # the stem takes its suffix whole (with_suffix would have cut "qwen2.5" at its dot)
    assert (q.with_name(q.name + ".json")).name == "learn_program-qwen2-5-coder-0-5b.json"


def test_learn_program_writes_to_the_model_stem_and_keeps_the_default(tmp_path, monkeypatch):
    lp = _bench("learn_program")
    monkeypatch.setattr(lp, "RESULTS", tmp_path)
    monkeypatch.setattr(lp, "part_sandbox", lambda a, log, work: {"records": [], "blocked": 0, "n": 0})
    default = tmp_path / "learn_program.json"
    default.write_text(json.dumps({"model": "smollm2-135m", "sentinel": 1}))
    res = lp.main(["--parts", "sandbox", "--model", "qwen2.5-coder-0.5b"])
    assert res["model"] == "qwen2.5-coder-0.5b"
    own = tmp_path / "learn_program-qwen2-5-coder-0-5b.json"
    assert json.loads(own.read_text())["model"] == "qwen2.5-coder-0.5b"
    assert (tmp_path / "learn_program-qwen2-5-coder-0-5b.md").is_file()
    assert json.loads(default.read_text()) == {"model": "smollm2-135m", "sentinel": 1}  # untouched
    lp.main(["--parts", "sandbox"])  # the default model still writes the default stem
    assert json.loads(default.read_text())["model"] == "smollm2-135m" and "sandbox" in json.loads(default.read_text())


def test_learn_program_proposer_pass_at_k_and_gate():
    lp = _bench("learn_program")
    rows = [{"task": "a", "best_val": 0.6, "test_acc": 0.55}, {"task": "b", "best_val": None, "test_acc": None}]
    s = lp.proposer_summary(rows)
    assert s["n_val_perfect"] == 0 and s["pass_at_k"] == 0.0
    assert s["gate_val1_implies_test_ge_0.99"]["verdict"] == gates.NOT_TESTED
    ok = lp.proposer_summary(rows + [{"task": "c", "best_val": 1.0, "test_acc": 1.0}])
    assert ok["n_val_perfect"] == 1 and ok["gate_val1_implies_test_ge_0.99"]["verdict"] == gates.MET
    lo, hi = ok["pass_at_k_ci95"]
    assert 0 < lo < 1 / 3 < hi < 1
    bad = lp.proposer_summary(rows + [{"task": "c", "best_val": 1.0, "test_acc": 0.9}])
    assert bad["gate_val1_implies_test_ge_0.99"]["verdict"] == gates.NOT_MET


def _judge_inputs(acc, n=100, first=(0.8, 0.76), label_acc=(0.3, 0.3)):
    summary = {"parse_failure_rate": 0.1, "first_slot_share_AB": first[0], "first_slot_share_BA": first[1]}
    per_vote = {"single_vote_acc_AB": acc, "single_vote_acc_BA": acc, "single_vote_n_AB": n, "single_vote_n_BA": n}

    def row(la, lo):
        return {"label_acc": la, "label_acc_ci": [lo, la + 0.1], "mae": 0.8}

    by = {"always-tie": row(0.225, 0.14), "btd": row(label_acc[0], label_acc[0] - 0.1),
          "majority": row(label_acc[1], label_acc[1] - 0.05)}
    return summary, per_vote, by


def test_judge_reading_follows_the_numbers():
    ej = _bench("evaluate_judge_real")
    assert ej.stem_of("smollm2-135m") == "evaluate_judge_real"
    assert ej.stem_of("qwen2.5-coder-0.5b") == "evaluate_judge_real-qwen2-5-coder-0-5b"
    chance = ej.reading(*_judge_inputs(0.5), same_as_tie=True)
    assert "not distinguishable from chance" in chance and "position bias" in chance
    assert "needs a judge that is better than chance" in chance
    good = ej.reading(*_judge_inputs(0.8, first=(0.5, 0.52), label_acc=(0.6, 0.7)), same_as_tie=False)
    assert "above chance" in good and "not distinguishable" not in good and "position bias" not in good
    assert "btd, majority" in good and "needs a judge" not in good
    # above always-tie (0.225) but not above a random A/B pick (0.5 x 0.775 = 0.39): not above chance
    coin = ej.reading(*_judge_inputs(0.5, label_acc=(0.35, 0.42)), same_as_tie=False)
    assert "No aggregator's label-accuracy interval lies above both chance references" in coin


def test_bench_agent_writes_another_models_rows_to_its_own_stem(tmp_path, monkeypatch):
    ba = _bench("bench_agent")
    assert ba.results_stem("smollm2-135m") == "bench_agent"
    assert ba.results_stem("qwen2.5-coder-0.5b") == "bench_agent-qwen2-5-coder-0-5b"
    monkeypatch.setattr(ba, "RESULTS", tmp_path)
    rows = {"grid-nav": {m: {"sr": 1.0, "episodes": 1, "steps_per_s": 10.0, "rewards_equal_to_none": True}
                         for m in ba.MODES}}
    monkeypatch.setattr(ba, "oracle_rows", lambda *a, **k: rows)
    default = tmp_path / "bench_agent.json"
    default.write_text(json.dumps({"command": "smol", "config": {}, "gates": {}, "pipe": {"grid-nav": {"x": 1}}}))
    ba.main(["--only", "oracle", "--model", "qwen2.5-coder-0.5b", "--work", str(tmp_path / "w")])
    own = json.loads((tmp_path / "bench_agent-qwen2-5-coder-0-5b.json").read_text())
    assert own["oracle"] == rows and (tmp_path / "bench_agent-qwen2-5-coder-0-5b.md").is_file()
    assert json.loads(default.read_text())["pipe"] == {"grid-nav": {"x": 1}}  # the SmolLM2 rows untouched
    ba.main(["--only", "oracle", "--work", str(tmp_path / "w")])  # the default model still writes the default stem
    assert json.loads(default.read_text())["oracle"] == rows


def test_bench_agent_rerun_commands_name_another_model(tmp_path, monkeypatch):
    """The command recorded for a partial rerun reproduces it: with another model it carries --model."""
    ba = _bench("bench_agent")
    monkeypatch.setattr(ba, "RESULTS", tmp_path)
    monkeypatch.setattr(ba, "uh_model_part", lambda args, work: ([], {}))
    ba.main(["--only", "uh-model", "--model", "qwen2.5-coder-0.5b", "--work", str(tmp_path / "w")])
    cmds = json.loads((tmp_path / "bench_agent-qwen2-5-coder-0-5b.json").read_text())["uh_model_commands"]
    assert cmds and all("--model qwen2.5-coder-0.5b" in c for c in cmds)
    ba.main(["--only", "uh-model", "--work", str(tmp_path / "w")])
    assert all("--model" not in c for c in json.loads((tmp_path / "bench_agent.json").read_text())["uh_model_commands"])


def test_learn_program_sanity_rerun_of_one_rule_keeps_the_others_and_stores_the_program(tmp_path, monkeypatch):
    """``--sanity-rules`` reruns some rules and keeps the stored rows of the others (the suite's pass@k and gate
    are recomputed over the merged rows); a selected program's source is kept in its row and printed when it
    reached val 1.0, so a success can be read from the results."""
    from llmtool.learn_program.proposers import MockProposer

    lp = _bench("learn_program")
    monkeypatch.setattr(lp, "_proposer", lambda a: MockProposer("first-bit"))
    stem = tmp_path / "lp"
    old = [{"rule": r, "k": 64, "pass_at_k": False, "best_val": 0.5, "test_acc": 0.5, "parse_rate": 0.6,
            "compile_rate": 0.5, "train_acc": 0.5, "proposals_per_s": 0.1, "sandbox_executions_per_s": 1000,
            "outcomes": {}} for r in lp.SANITY_RULES]
    (tmp_path / "lp.json").write_text(json.dumps({"sanity": {"model": "m", "k": 64, "rows": old, "pass_at_k": 0.0},
                                                  "part_commands": {"sanity": ["first"]}}))
    res = lp.main(["--parts", "sanity", "--sanity-rules", "first_bit_1", "--k", "2", "--out", str(stem)])
    s = res["sanity"]
    assert [r["rule"] for r in s["rows"]] == list(lp.SANITY_RULES)  # merged, in the suite's order
    new = s["rows"][0]
    assert new["rule"] == "first_bit_1" and new["pass_at_k"] and new["test_acc"] == 1.0 and new["k"] == 2
    assert "x[0] == '1'" in new["selected_code"]
    assert all(r["best_val"] == 0.5 for r in s["rows"][1:])  # the kept rows
    assert s["n_val_perfect"] == 1 and s["pass_at_k"] == 0.25 and s["k"] == 2
    assert s["gate_val1_implies_test_ge_0.99"]["verdict"] == gates.MET
    assert len(res["part_commands"]["sanity"]) == 2
    md = (tmp_path / "lp.md").read_text()
    assert "Selected programs with val 1.0: first_bit_1: `def f(x): return x[0] == '1'`" in md
