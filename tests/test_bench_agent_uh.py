"""UltraHorizon report protocols (issue 42): the free-text report with an LLM judge is the default and its
prompt names no rule; the closed menu is a labelled easier variant; the inferring explorer reads only its
observations; the control agent's alias randomisation."""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from conftest import run_cli

from llmtool.bench_agent.uh import MENU_TERMS, make_uh_env
from llmtool.bench_agent.uhrun import UHCtx, UHScript, make_judge, run_uh, system_prompt
from llmtool.core.console import UsageError


def _leaks(text: str) -> list[str]:
    return [t for t in MENU_TERMS if re.search(r"(?<![\w])" + re.escape(t) + r"(?![\w])", text, re.I)]


@pytest.mark.parametrize("env_name", ["grid", "seq", "bio"])
@pytest.mark.parametrize("difficulty", ["easy", "hard"])
def test_free_prompt_names_no_rule_and_menu_does(env_name, difficulty):
    free = make_uh_env(env_name, difficulty=difficulty, steps=7, seed=0)
    assert free.report == "free"                                 # the default protocol
    assert _leaks(system_prompt(free, UHCtx(free))) == []
    menu = make_uh_env(env_name, difficulty=difficulty, steps=7, seed=0, report="menu")
    assert len(_leaks(system_prompt(menu, UHCtx(menu)))) >= 9     # the detector sees the menu's IDs / keys


def test_free_report_needs_an_llm_judge(tmp_path):
    with pytest.raises(ValueError, match="LLM judge"):
        run_uh("seq", UHScript("oracle", 0), tmp_path / "x", steps=2)
    for spec in ("", "rule"):
        with pytest.raises(UsageError, match="--judge"):
            make_judge(spec, "free")
    assert make_judge("", "menu") is None and make_judge("rule", "menu") is None
    with pytest.raises(UsageError, match="--judge"):
        make_judge("gpt4", "menu")
    code, _, err = run_cli("bench-agent", "uh-run", "script:oracle", tmp_path / "u", "--env", "seq", "--steps", "2")
    assert code == 2 and "--judge" in err and "--report menu" in err
    code, _, err = run_cli("bench-agent", "uh-run", "script:oracle", tmp_path / "u", "--env", "seq", "--steps", "2",
                           "--report", "multiple-choice", "--judge", "rule")
    assert code == 2


class _Judge(BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *a):
        pass

    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"data": [{"id": "judge"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Judge.seen.append(body["messages"][-1]["content"])
        self._send({"choices": [{"message": {"content": '{"final_score": 80, "score_breakdown": []}'}}]})


def test_cli_free_report_scored_by_the_llm_judge(tmp_path):
    srv = HTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"openai:http://127.0.0.1:{srv.server_address[1]}/v1#judge"
        code, out, err = run_cli("bench-agent", "uh-run", "script:oracle", tmp_path / "u", "--env", "seq",
                                 "--steps", "3", "--runs", "2", "--judge", url, "--json")
        assert code == 0, err
        assert json.loads(out)["score"]["mean"] == 80
        ev = json.loads((tmp_path / "u" / "run-000" / "eval_output.json").read_text())
        assert ev["report"] == "free" and ev["judge"].startswith("openai:")
        commit = (tmp_path / "u" / "run-000" / "commit.txt").read_text()
        assert "rule_1:" in commit and "{" not in commit                  # prose, not a JSON of rule IDs
        assert commit in _Judge.seen[-1] and "interleave main and vice" in _Judge.seen[-1]   # truth text to the judge
        sys_prompt = json.loads((tmp_path / "u" / "run-000" / "trajectory.jsonl").read_text().splitlines()[0])["content"]
        assert _leaks(sys_prompt) == []
    finally:
        srv.shutdown()


def test_menu_variant_is_labelled(tmp_path):
    ev = run_uh("grid", UHScript("oracle", 0), tmp_path / "m", steps=3, seed=0, report="menu")
    assert ev["protocol"] == "easier variant (closed menu)" and ev["judge"] == "rule"
    assert ev["judge_result"]["final_score"] == 100


# ------------------------------------------------------------------------------ inferring explorer
class _Blind:
    """An environment proxy for the agent's side: every attribute access raises (the hidden truth, the
    gating state, even the name), so an agent that reads the environment fails."""

    def __getattr__(self, name):
        raise AssertionError(f"the inferring explorer read env.{name}")


@pytest.fixture
def blind_ctx(monkeypatch):
    import llmtool.bench_agent.uhrun as uhrun

    class BlindCtx(uhrun.UHCtx):
        def __init__(self, env):
            self._real = env
            self.env = _Blind()

        def tool_schemas(self):
            return self._real.schemas() + uhrun.AUX_SCHEMAS

    monkeypatch.setattr(uhrun, "UHCtx", BlindCtx)


@pytest.mark.parametrize("env_name,steps,least", [("grid", 30, 100), ("seq", 10, 100), ("bio", 10, 80)])
def test_infer_explorer_reads_only_observations(blind_ctx, env_name, steps, least, tmp_path):
    ev = run_uh(env_name, UHScript("infer", 1), tmp_path / "i", steps=steps, seed=1, report="menu", window=40)
    assert ev["committed"] and ev["env_actions"] == steps
    assert ev["judge_result"]["final_score"] >= least, ev["judge_result"]
    with pytest.raises(AssertionError, match="read env"):         # the truth-reading oracle cannot run blind
        run_uh(env_name, UHScript("oracle", 1), tmp_path / "o", steps=steps, seed=1, report="menu")


def test_infer_explorer_recovers_an_assignment_no_difficulty_uses(blind_ctx, monkeypatch, tmp_path):
    """The grid letters get effects no built-in difficulty assigns: only inference from the moves finds them."""
    import llmtool.bench_agent.uh as uh

    odd = {"A": "coordinate", "B": "parity", "C": "minus_score", "D": "energy_threshold", "E": "plus_energy"}
    assert odd not in uh.GRID_EFFECTS.values()
    monkeypatch.setitem(uh.GRID_EFFECTS, "hard", odd)
    ev = run_uh("grid", UHScript("infer", 0), tmp_path / "g", steps=40, seed=0, report="menu", policy="crnr", window=12)
    assert ev["stats"]["refreshes"] >= 1                   # it survives context refreshes
    assert json.loads(ev["judge_input"]) == odd
    seq = run_uh("seq", UHScript("infer", 0), tmp_path / "s", steps=12, seed=0, difficulty="easy", report="menu")
    assert json.loads(seq["judge_input"]) == {f"rule_{i + 1}": r for i, r in enumerate(uh.SEQ_RULES["easy"])}


def test_infer_explorer_short_horizon_is_imperfect(tmp_path):
    """At R = 3 the grid letters cannot all be pinned down: the explorer is no oracle."""
    scores = [run_uh("grid", UHScript("infer", s), tmp_path / f"g{s}", steps=3, seed=s, report="menu")
              ["judge_result"]["final_score"] for s in range(4)]
    assert min(scores) < 100


def test_infer_explorer_free_report_is_prose(tmp_path):
    srv = HTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        judge = make_judge(f"openai:http://127.0.0.1:{srv.server_address[1]}/v1#judge", "free")
        ev = run_uh("bio", UHScript("infer", 0), tmp_path / "b", steps=6, seed=0, judge=judge)
        assert ev["report"] == "free" and ev["judge_result"]["final_score"] == 80
        assert ev["judge_input"].startswith("Genetic basis: ploidy 3") and "{" not in ev["judge_input"]
    finally:
        srv.shutdown()


# ------------------------------------------------------------------------------------ control agent
@pytest.mark.parametrize("env_name", ["grid-nav", "sqlite-qa", "text-coin", "os-files"])
def test_control_training_episodes_never_show_the_original_names(env_name):
    import random

    from llmtool.bench_agent.control import control_episodes, random_alias_spec
    from llmtool.bench_agent.envs import make_env

    env = make_env(env_name)
    rng = random.Random(0)
    specs = [random_alias_spec(env, rng, env.sample_texts(8)) for _ in range(3)]
    assert all(not s.validate() for s in specs)
    assert len({tuple(s.synonyms.values()) for s in specs}) == 3           # fresh aliases per draw
    eps = control_episodes(env_name, 4, seed=0)
    assert len({tuple(e["aliases"].values()) for e in eps}) == 4
    for e in eps:
        assert e["success"] and e["orig_calls"] == 0 and e["alias_calls"] > 0
        text = "\n".join(m["content"] for m in e["conversation"])
        for orig in env.IDENTIFIERS:
            assert not re.search(r"(?<!\w)" + re.escape(orig) + r"(?!\w)", text), orig
        assert any(al in text for al in e["aliases"].values())


def _bench_agent_module():
    from conftest import load_benchmark

    return load_benchmark("bench_agent")


def test_control_ir_gate_can_fail_and_says_not_tested_when_not_run():
    ba = _bench_agent_module()
    from benchmarks import gates
    assert ba.control_ir_gate({})["verdict"] == gates.NOT_TESTED
    assert "not run" in ba.control_ir_gate({})["reason"]
    silent = {m: {"orig_calls": 0, "alias_calls": 0} for m in ("dual-ori-first", "dual-syn-first")}
    ir = {"ir": 1.0, "ir_lo": 1.0, "ir_hi": 1.0}
    assert ba.control_ir_gate({"control_ir": ir, "control_eval": silent})["verdict"] == gates.NOT_TESTED
    acting = dict(silent, **{"dual-syn-first": {"orig_calls": 4, "alias_calls": 5}})
    assert ba.control_ir_gate({"control_ir": ir, "control_eval": acting})["verdict"] == gates.MET
    assert ba.control_ir_gate({"control_ir": dict(ir, ir=2.7), "control_eval": acting})["verdict"] == gates.NOT_MET


def test_uh_gates_judge_the_menu_rows_and_the_inferring_explorer():
    ba = _bench_agent_module()
    from benchmarks import gates

    def cell(m):
        return {"score": {"mean": m}, "report": "menu"}

    raw = {"oracle-grid-10-crnr": cell(100), "infer-grid-10-crnr": cell(70), "random-grid-10-crnr": cell(5),
           "model-grid-3-crnr": cell(0)}
    res = {"ultrahorizon": {"raw": raw}, "gates": {}}
    ba.uh_gates(res)
    g = res["gates"]
    assert g["uh_oracle_scores_100"] and g["uh_random_scores_le_40"]
    assert g["uh_infer_above_random_every_cell"]["verdict"] == gates.MET
    raw["infer-grid-10-crnr"] = cell(5)
    ba.uh_gates(res)
    assert res["gates"]["uh_infer_above_random_every_cell"]["verdict"] == gates.NOT_MET


def test_in_process_hf_judge(tiny_llama_dir, tmp_path):
    """--judge hf:MODEL: the same judge prompt in-process; a tiny random model never answers JSON, so the score
    is null after three tries and its last answer is kept; a judge whose window is too small gives a null score."""
    from conftest import save_tiny

    from llmtool.bench_agent.uh import llm_judge
    from llmtool.bench_agent.uhrun import HFJudge, judge_name

    env = make_uh_env("seq", steps=1, seed=0)
    report = env.describe(env.oracle_report())
    small = make_judge(f"hf:{tiny_llama_dir}", "free")               # 512-token window
    res = llm_judge(env, report, small)
    assert res["final_score"] is None and "does not fit" in res["raw_output"]
    model = save_tiny(tmp_path / "tiny-long", max_position_embeddings=8192)
    judge = make_judge(f"hf:{model}", "free")
    assert isinstance(judge, HFJudge) and judge_name(judge) == f"hf:{model}"
    judge.cap = 6
    res = llm_judge(env, report, judge)
    assert res["final_score"] is None and "does not fit" not in res["raw_output"]


def test_free_judge_gate_needs_the_oracle_report_near_100_and_above_random():
    ba = _bench_agent_module()

    def cell(mean):
        return {"score": {"mean": mean}, "report": "free"}

    good = {"oracle-grid-10-crnr-free": cell(100.0), "random-grid-10-crnr-free": cell(10.0)}
    assert ba.free_judge_gate(good)["verdict"] == "met"
    bad = {"oracle-grid-10-crnr-free": cell(10.0), "random-grid-10-crnr-free": cell(10.0)}  # a judge misreading the rubric
    assert ba.free_judge_gate(bad)["verdict"] == "not met"
    assert ba.free_judge_gate({})["verdict"] == "not tested"
    unparsed = {"oracle-grid-10-crnr-free": cell(10.0), "random-grid-10-crnr-free": cell(None)}  # judge gave no score
    assert ba.free_judge_gate(unparsed)["verdict"] == "not met"
