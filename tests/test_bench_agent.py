"""`llmtool bench-agent`: PIPE rewrites, IR, harness, agents, UltraHorizon environments and CLI."""
from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from conftest import run_cli

from llmtool.bench_agent.agents import Turn, make_agent
from llmtool.bench_agent.envs import BUILTIN, make_env
from llmtool.bench_agent.harness import Episode, checked_spec, run_episode
from llmtool.bench_agent.metrics import interface_reliance
from llmtool.bench_agent.rewrite import DEPRECATED, MODES, RewriteSpec, Rewriter, display
from llmtool.bench_agent.toolparse import extract_action, parse_tool_calls
from llmtool.core.console import UsageError


# ----------------------------------------------------------------------------------------- PIPE / oracle
@pytest.mark.parametrize("env_name", BUILTIN)
def test_oracle_succeeds_under_every_rewrite_with_identical_rewards(env_name):
    n = 4 if env_name == "os-sandbox" else 25
    oracle = make_agent("script:oracle")
    base = None
    for mode in MODES:
        spec = checked_spec(env_name, mode)
        recs = [run_episode(make_env(env_name), oracle, mode, i, 1000 + i, make_env(env_name).default_rounds, spec=spec)
                for i in range(n)]
        assert all(r["success"] for r in recs), (mode, [r["conversation"] for r in recs if not r["success"]][:1])
        rewards = [r["reward"] for r in recs]
        base = base or rewards
        assert rewards == base
        orig, alias = sum(r["orig_calls"] for r in recs), sum(r["alias_calls"] for r in recs)
        if mode in ("none", "dual-ori-first"):
            assert alias == 0 and orig > 0
        else:
            assert orig == 0 and alias > 0
        assert sum(r["invalid_calls"] + r["deprecated_calls"] for r in recs) == 0


def test_oracle_reads_names_from_the_prompt():
    """The oracle writes the name the prompt lists: a prompt without the action list defeats it."""
    env = make_env("grid-nav")
    ep = Episode(env, "obfuscate", 0, 3, 10)
    ep.messages[0]["content"] = "no actions here"
    turn = make_agent("script:oracle").act(ep.view(), ep.ctx)
    ep.feed(turn)
    assert ep.rec["invalid_calls"] == 1 and ep.rec["reward"] == 0


def test_builtin_specs_are_valid_and_round_trip():
    for name in BUILTIN:
        env = make_env(name)
        spec = RewriteSpec.for_env(env)
        assert spec.validate(env.sample_texts(6)) == []
        for mode in ("synonym", "obfuscate"):
            m = spec.alias_map(mode)
            assert len(set(m.values())) == len(m) and not set(m.values()) & set(spec.actions)
            text = " ".join(env.sample_texts(3)) + " " + " ".join(spec.actions)
            assert display(display(text, m), {v: k for k, v in m.items()}) == text


@pytest.mark.parametrize("synonyms, problem", [
    ({"move_north": "go", "move_south": "go", "move_east": "e", "move_west": "w"}, "not injective"),
    ({"move_north": "move_south", "move_south": "s1", "move_east": "e1", "move_west": "w1"}, "original identifier"),
    ({"move_north": "move", "move_south": "s1", "move_east": "e1", "move_west": "w1"}, "overlap"),
    ({"move_north": "Goal", "move_south": "s1", "move_east": "e1", "move_west": "w1"}, "occurs in task data"),
    ({"move_north": "n1", "move_south": "s1", "move_east": "e1"}, "no alias"),
])
def test_colliding_spec_is_refused(synonyms, problem):
    env = make_env("grid-nav")
    spec = RewriteSpec.for_env(env)
    spec.synonyms = synonyms
    problems = spec.validate(env.sample_texts(6))
    assert any(problem in p for p in problems), problems
    with pytest.raises(UsageError, match="refused"):
        spec.check(env.sample_texts(6))


def test_colliding_spec_file_is_refused_by_the_cli(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"synonyms": {"move_north": "go", "move_south": "go", "move_east": "e9",
                                            "move_west": "w9"}}))
    code, _, err = run_cli("bench-agent", "rewrite-spec", "--env", "grid-nav", "--spec", bad)
    assert code == 2 and "not injective" in err
    code, _, err = run_cli("bench-agent", "run", "script:oracle", tmp_path / "o", "--env", "grid-nav",
                           "--rewrite", "synonym", "--rewrite-spec", bad, "--episodes", "2")
    assert code == 2 and "refused" in err and not (tmp_path / "o").exists()
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"synonyms": {"move_north": "hop_n", "move_south": "hop_s", "move_east": "hop_e",
                                             "move_west": "hop_w"}}))
    code, out, _ = run_cli("bench-agent", "run", "script:oracle", tmp_path / "g", "--env", "grid-nav",
                           "--rewrite", "synonym", "--rewrite-spec", good, "--episodes", "3", "--json")
    assert code == 0 and json.loads(out)["sr"] == 1.0
    assert "hop_n" in (tmp_path / "g" / "episodes.jsonl").read_text() or "hop_" in (tmp_path / "g" / "episodes.jsonl").read_text()


def test_golden_display_rewrites():
    m = {"look": "peek", "look around": "survey", "<search>": "<lookup>"}
    obs = {"a": ["look around the room", {"b": "You look. <search>x</search>"}], "n": 3,
           "c": "outlook looking look_at"}
    got = display(obs, m)
    assert got == {"a": ["survey the room", {"b": "You peek. <lookup>x</search>"}], "n": 3,
                   "c": "outlook looking look_at"}


def test_strict_mode_refuses_original_without_touching_state():
    env = make_env("grid-nav")
    ep = Episode(env, "synonym", 0, 5, 10)
    before = env.pos
    ep.feed(Turn("Action: move_north"))
    assert ep.rec["deprecated_calls"] == 1 and env.pos == before
    assert DEPRECATED in ep.messages[-1]["content"] and "go_up" in ep.messages[-1]["content"]
    ep.feed(Turn("Action: go_up"))
    assert ep.rec["alias_calls"] == 1
    ep2 = Episode(make_env("grid-nav"), "synonym", 0, 5, 10, strict=False)
    ep2.feed(Turn("Action: move_north"))
    assert ep2.rec["orig_calls"] == 1 and ep2.rec["deprecated_calls"] == 0


def test_dual_orders_list_names_counterbalanced():
    spec = RewriteSpec.for_env(make_env("text-coin"))
    os_, so = Rewriter(spec, "dual-ori-first"), Rewriter(spec, "dual-syn-first")
    assert os_.names("walk") == ["walk", "stroll"] and so.names("walk") == ["stroll", "walk"]
    assert os_.text("Valid actions: walk") == "Valid actions: walk"
    assert so.text("Valid actions: walk") == "Valid actions: stroll"
    for rw in (os_, so):
        assert rw.translate("walk north").kind == "orig" and rw.translate("stroll north").kind == "alias"
        assert rw.translate("STROLL north").ident == "walk"
    with pytest.raises(UsageError):
        Rewriter(spec, "dual-sideways")


# ---------------------------------------------------------------------------------------------- IR
def _eps(pairs):
    return [{"orig_calls": a, "alias_calls": b} for a, b in pairs]


def test_ir_equals_hand_computation():
    os_, so = _eps([(3, 1), (0, 2), (0, 0)]), _eps([(1, 1), (2, 0)])
    l_os = (math.log(4 / 2) + math.log(1 / 3) + 0.0) / 3
    l_so = (math.log(2 / 2) + math.log(3 / 1)) / 2
    got = interface_reliance(os_, so, draws=500)
    assert got["ir"] == pytest.approx(math.exp((l_os + l_so) / 2), rel=1e-12)
    assert got["md_ori_first"] == pytest.approx(math.exp(l_os)) and got["md_syn_first"] == pytest.approx(math.exp(l_so))
    assert got["ir_lo"] <= got["ir"] <= got["ir_hi"]
    assert got["share_only_original"] == pytest.approx(1 / 4)


@pytest.mark.parametrize("n", [1, 4])
def test_ir_policies(n):
    first = interface_reliance(_eps([(n, 0)] * 5), _eps([(0, n)] * 5))
    assert first["md_ori_first"] == pytest.approx(n + 1) and first["md_syn_first"] == pytest.approx(1 / (n + 1))
    assert first["ir"] == pytest.approx(1.0)
    assert interface_reliance(_eps([(n, 0)] * 5), _eps([(n, 0)] * 5))["ir"] == pytest.approx(n + 1)
    assert interface_reliance(_eps([(0, n)] * 5), _eps([(0, n)] * 5))["ir"] == pytest.approx(1 / (n + 1))
    ci = interface_reliance(_eps([(n, 0)] * 5), _eps([(n, 0)] * 5))
    assert ci["ir_lo"] == pytest.approx(n + 1) and ci["ir_hi"] == pytest.approx(n + 1)


# ------------------------------------------------------------------------------------------ parsing
def test_parser_tolerance():
    names = {"move_north", "run_sql"}
    assert extract_action("Thought: go.\nAction: move_north\nmore") == ("move_north", "text")
    assert extract_action('<tool_call>{"name": "run_sql", "arguments": {"query": "SELECT 1"}}</tool_call>',
                          names) == ("run_sql SELECT 1", "tool_calls")
    assert extract_action('Sure! {"name": "move_north", "parameters": {}}', names) == ("move_north", "tool_calls")
    assert extract_action('I will call run_sql(query="SELECT 2")', names) == ("run_sql SELECT 2", "tool_calls")
    assert extract_action("<tool_call>{not json</tool_call>", names) == (None, "malformed")
    assert extract_action("", names) == (None, "none")
    assert extract_action("`action: move_north`") == ("move_north", "text")
    calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls == [{"name": "a", "arguments": {"x": 1}}]
    assert parse_tool_calls('{"name": "a", "arguments": "{bad"}')[0]["error"].startswith("arguments")


def test_unparseable_reply_is_an_invalid_call_not_a_crash():
    ep = Episode(make_env("sqlite-qa"), "none", 0, 1, 3)
    for text in ("", "<tool_call>{oops", "I do not know."):
        ep.feed(Turn(text))
    rec = ep.record()
    assert rec["invalid_calls"] == 3 and rec["unparsed_calls"] == 2 and rec["rounds"] == 3 and not rec["success"]


# ------------------------------------------------------------------------------------------ sandbox
def test_sandboxed_os_task_cannot_touch_the_host(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("secret")
    env = make_env("os-sandbox")
    env.reset(0)
    attempts = [f"open({str(tmp_path / 'pwned.txt')!r}, 'w').write('x')",
                f"print(open({str(victim)!r}).read())",
                f"import os;os.remove({str(victim)!r})",
                "import subprocess;subprocess.run(['touch', 'x'])",
                "import socket"]
    for code in attempts:
        obs = env.step("run_python", code).observation
        assert "Exit code 0" not in obs and "secret" not in obs, (code, obs)
    assert not (tmp_path / "pwned.txt").exists() and victim.read_text() == "secret"
    obs = env.step("run_python", "import os;print(sorted(os.listdir('data')))").observation
    assert obs.startswith("Exit code 0") and "Stdout: [" in obs


# ----------------------------------------------------------------------------------------- CLI e2e
def test_cli_run_report_end_to_end(tmp_path):
    for mode in ("none", "obfuscate", "dual-ori-first", "dual-syn-first"):
        code, out, err = run_cli("bench-agent", "run", "script:oracle", tmp_path / mode, "--env", "text-coin",
                                 "--rewrite", mode, "--episodes", "6", "--concurrency", "2", "--json")
        assert code == 0, err
        s = json.loads(out)
        assert s["sr"] == 1.0 and s["episodes"] == 6
    lines = (tmp_path / "dual-syn-first" / "episodes.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    assert rec["usage"]["prompt"] > 0 and rec["wall_s"] >= 0 and rec["conversation"][0]["role"] == "system"
    assert (tmp_path / "none" / "llmtool.json").is_file()
    code, out, err = run_cli("bench-agent", "report", tmp_path, "-o", tmp_path / "rep.json", "--json")
    assert code == 0, err
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert rep["interface_reliance"][0]["ir"] == pytest.approx(1.0)
    assert {r["rewrite"] for r in rep["runs"]} == {"none", "obfuscate", "dual-ori-first", "dual-syn-first"}
    # OUT exists -> one-line usage error
    code, _, err = run_cli("bench-agent", "run", "script:oracle", tmp_path / "none", "--env", "text-coin")
    assert code == 2 and "already exists" in err


def test_cli_bad_input(tmp_path):
    code, _, err = run_cli("bench-agent", "run", "script:oracle", tmp_path / "x", "--env", "no-such-env")
    assert code == 2 and "unknown environment" in err
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"item_id": 1}\n{"item_id": 2, \n')
    code, _, err = run_cli("bench-agent", "run", "script:oracle", tmp_path / "x", "--data", bad)
    assert code == 2 and "tasks.jsonl:2" in err
    code, _, err = run_cli("bench-agent", "run", "openai:http://127.0.0.1:9/v1#m", tmp_path / "x")
    assert code == 2 and "cannot reach" in err
    code, _, err = run_cli("bench-agent", "run", "script:nope", tmp_path / "x")
    assert code == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / ".x.partial").exists()


def test_cli_run_resumes_without_redoing_episodes(tmp_path, monkeypatch):
    import llmtool.bench_agent.harness as h

    real, calls = h.run_episode, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("interrupted")
        return real(*a, **k)

    monkeypatch.setattr(h, "run_episode", flaky)
    code, _, _ = run_cli("bench-agent", "run", "script:oracle", tmp_path / "r", "--env", "grid-nav", "--episodes", "8")
    assert code == 1          # an internal fault mid-run
    assert not (tmp_path / "r").exists()
    part = tmp_path / ".r.partial" / "episodes.jsonl"
    assert len(part.read_text().splitlines()) == 3
    code, _, err = run_cli("bench-agent", "run", "script:oracle", tmp_path / "r", "--env", "grid-nav",
                           "--episodes", "9")
    assert code == 2 and "different settings" in err
    calls["n"] = -100
    code, out, err = run_cli("bench-agent", "run", "script:oracle", tmp_path / "r", "--env", "grid-nav",
                             "--episodes", "8", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["resumed"] == 3 and s["episodes"] == 8 and calls["n"] == -100 + 5
    assert not (tmp_path / ".r.partial").exists()


# ------------------------------------------------------------------------------------------ agents
def test_hf_agent_kv_reuse_matches_fresh_decoding(tiny_llama_dir):
    from llmtool.bench_agent.agents import HFAgent

    a, b = HFAgent(str(tiny_llama_dir), max_new_tokens=6), HFAgent(str(tiny_llama_dir), max_new_tokens=6)
    msgs = [{"role": "system", "content": "You walk."}, {"role": "user", "content": "Position 1."}]
    t1 = a.act(msgs)
    msgs2 = msgs + [{"role": "assistant", "content": t1.content}, {"role": "user", "content": "Position 2."}]
    t2 = a.act(msgs2)
    assert a.reused_tokens > 0
    assert b.act(msgs2).content == t2.content
    assert t2.usage["prompt"] > t1.usage["prompt"] and t2.entropy is not None


def test_hf_agent_greedy_equals_transformers_generate(tiny_llama_dir):
    """The agent's own decoding loop (KV cache, last-position logits only) gives transformers' greedy tokens."""
    import torch

    from llmtool.bench_agent.agents import HFAgent

    agent = HFAgent(str(tiny_llama_dir), max_new_tokens=7, stop=("\x00",))
    msgs = [{"role": "system", "content": "You walk."}, {"role": "user", "content": "Position 1."}]
    turn = agent.act(msgs)
    ids = torch.tensor([agent.render(msgs)])
    with torch.no_grad():
        ref = agent.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False,
                                   eos_token_id=agent.tok.eos_token_id, pad_token_id=agent.tok.eos_token_id)
    ref_ids = [t for t in ref[0, ids.shape[1]:].tolist() if t != agent.tok.eos_token_id]
    assert turn.content == agent.tok.decode(ref_ids, skip_special_tokens=True).strip()


def test_cli_hf_agent_tiny_model(tiny_llama_dir, tmp_path):
    code, out, err = run_cli("bench-agent", "run", f"hf:{tiny_llama_dir}", tmp_path / "h", "--env", "grid-nav",
                             "--episodes", "2", "--max-rounds", "2", "--max-new-tokens", "4", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["episodes"] == 2 and s["completion_tokens"] > 0
    recs = [json.loads(x) for x in (tmp_path / "h" / "episodes.jsonl").read_text().splitlines()]
    assert all(r["rounds"] == 2 for r in recs)
    assert all(r["invalid_calls"] + r["orig_calls"] == 2 for r in recs)
    assert s["model"] == f"hf:{tiny_llama_dir}"
    code, out, err = run_cli("bench-agent", "run", f"hf:{tiny_llama_dir}", tmp_path / "b", "--env", "grid-nav",
                             "--episodes", "3", "--max-rounds", "2", "--max-new-tokens", "4", "--concurrency", "3",
                             "--json")
    assert code == 0, err
    assert json.loads(out)["episodes"] == 3
    recs = [json.loads(x) for x in (tmp_path / "b" / "episodes.jsonl").read_text().splitlines()]
    assert sorted(r["item_id"] for r in recs) == [0, 1, 2] and all(r["rounds"] == 2 for r in recs)


class _Stub(BaseHTTPRequestHandler):
    log = []
    fail_503 = 1

    def log_message(self, *a):
        pass

    def do_GET(self):
        self._send(200, {"data": [{"id": "m"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Stub.log.append(body)
        if _Stub.fail_503 > 0:
            _Stub.fail_503 -= 1
            return self._send(503, {"error": "busy"})
        if "tools" in body and body["messages"][-1]["content"].startswith("refuse"):
            return self._send(400, {"error": "tool_choice auto requires --enable-auto-tool-choice"})
        if "tools" in body:
            msg = {"content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "go_up", "arguments": json.dumps({"argument": ""})}}]}
        else:
            msg = {"content": "Action: move_north"}
        self._send(200, {"choices": [{"message": msg}], "usage": {"prompt_tokens": 11, "completion_tokens": 3}})

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_openai_agent_against_loopback_stub():
    srv = HTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1#m"
        agent = make_agent(f"openai:{url}", protocol="tools", backoff=0.01)
        agent.check()
        ep = Episode(make_env("grid-nav"), "synonym", 0, 2, 5)
        turn = agent.act(ep.view(), ep.ctx)                      # first POST: 503, retried
        assert _Stub.fail_503 == 0 and len(_Stub.log) == 2
        assert _Stub.log[-1]["tool_choice"] == "auto" and _Stub.log[-1]["tools"]
        assert turn.tool_calls[0]["name"] == "go_up" and turn.tool_calls[0]["arguments"] == {"argument": ""}
        assert turn.usage == {"prompt": 11, "completion": 3}
        ep.feed(turn)
        assert ep.rec["alias_calls"] == 1
        turn = agent.act([{"role": "user", "content": "refuse tools"}], ep.ctx)   # HTTP 400 -> text protocol
        assert agent.protocol == "text" and "tools" not in _Stub.log[-1] and turn.content == "Action: move_north"
    finally:
        srv.shutdown()


# ------------------------------------------------------------------------------------- UltraHorizon
from llmtool.bench_agent.uh import (AlienGenetics, MysteryGrid, SequenceExploration, gamete,  # noqa: E402
                                    make_uh_env, phenotype, schema_of, zygote)
from llmtool.bench_agent.uhrun import REFRESH, UHScript, apply_policy, run_uh, score_runs  # noqa: E402


def _grid_at(x, y, letter, energy=20, steps=0):
    g = MysteryGrid(difficulty="hard", steps=5, seed=0)
    g.pos, g.energy, g.steps = (x, y), energy, steps
    before = g.score
    g.apply_effect(letter)
    return g.score - before, g


def test_grid_effects_hard():
    assert _grid_at(7, 2, "E")[0] == 5
    assert _grid_at(0, 0, "B")[0] == 6 and _grid_at(5, 1, "B")[0] == 3 and _grid_at(5, 5, "B")[0] == 0
    assert [_grid_at(5, 5, "A", steps=s)[0] for s in (1, 2, 3, 6)] == [-1, -1, 2, 2]
    g = MysteryGrid(difficulty="hard", steps=5, seed=0)
    got = []
    for _ in range(3):
        s0 = g.score
        g.apply_effect("C")
        got.append(g.score - s0)
    assert got == [1, 0, 1]
    d, g = _grid_at(5, 5, "D", energy=9)
    assert d == -2 and g.energy == 19


def test_grid_move_applies_effect_after_paying_energy():
    g = MysteryGrid(difficulty="hard", steps=50, seed=3)
    g.pos, g.energy = (4, 4), 1
    g.board[4][5] = "D"
    out = g.move("right")
    assert out["energy"] == 10 and out["game_over"] and g.board[4][5] == "X"   # energy hit 0: round over


def test_gating_and_free_mode():
    s = SequenceExploration(steps=2, seed=0)
    assert s.call("commit_final_result", {"content": "{}"}).startswith("Refused")
    for _ in range(2):
        assert "rule_1" in s.call("input_sequences", {"main": "ABCDE", "vice": "BBCCA"})
    assert s.call("input_sequences", {"main": "ABCDE", "vice": "BBCCA"}).startswith("Refused")
    assert s.call("commit_final_result", {"content": "{}"}) == "Final result committed."
    assert s.call("commit_final_result", {"content": "{}"}).startswith("Refused")
    f = SequenceExploration(steps=5, seed=0, free=True)
    assert f.call("commit_final_result", {"content": "{}"}) == "Final result committed."


def _ref_hard(main, vice, n, prev):
    """An independent implementation of the hard sequence rules."""
    A = [ord(c) - 65 for c in main]
    V = [ord(c) - 65 for c in vice]
    first, second = (A, V) if n % 2 else (V, A)
    s = []
    for i in range(5):
        s += [first[i], second[i]]
    r1 = s
    r2 = [(v + n) % 26 for v in reversed(r1)] + [(v + n) % 26 for v in r1]
    a = n % 10 if n % 10 else 10
    r3 = r2 + [r2[a - 1]] * a if len(r2) >= a else r2
    if prev is None:
        r4 = list(r3)
    else:
        P = [ord(c) - 65 for c in prev]
        r4 = [(r3[i] + P[i]) % 26 for i in range(5)] + r3[5:]
    if n in (2, 3, 5, 7, 11, 13):
        best = None
        for v in r4:
            if best is None or r4.count(v) > r4.count(best):
                best = v
        r5 = [(v + 1) % 26 if v == best else v for v in r4]
    else:
        r5 = list(r4)
    return ["".join(chr(65 + v) for v in r) for r in (r1, r2, r3, r4, r5)]


def test_seq_golden_against_independent_implementation():
    s = SequenceExploration(steps=10, seed=0)
    inputs = [("ABCDE", "EDCBA"), ("AABBC", "CCDDE"), ("BADCE", "ABABA"), ("EEEEA", "ABCDD"), ("CDCDC", "AEAEA"),
              ("BBBBA", "DDDDC"), ("ACEAC", "BDBDB")]
    prev = None
    for n, (m, v) in enumerate(inputs, 1):
        out = json.loads(s.call("input_sequences", {"main": m, "vice": v}))
        if n in (1, 2, 3, 7):
            assert [out[f"rule_{i}"] for i in range(1, 6)] == _ref_hard(m, v, n, prev), n
        prev = m
    used = s.used
    for bad in ({"main": "ABCD", "vice": "ABCDE"}, {"main": "ABCDF", "vice": "ABCDE"}, {"main": "AAAAA", "vice": "ABCDE"}):
        assert s.call("input_sequences", bad).startswith("Refused")
    assert s.used == used


def test_bio_phenotypes_viability_and_hidden_genotypes():
    import random

    rng = random.Random(0)
    base = {"color": ("C1",) * 3, "shell": ("H1",) * 3}
    p = phenotype({"size": ("S1", "S1", "S2"), **base}, rng)
    assert abs(p["size"] - 450) <= 5 and p["size_class"] == "extra_large"
    p = phenotype({"size": ("S3",) * 3, **base}, rng)
    assert abs(p["size"] - 30) <= 1 and p["size_class"] == "tiny"
    p = phenotype({"size": ("S3",) * 3, "color": ("C2", "C3", "C3"), "shell": ("H1", "H3", "H3")}, rng)
    assert p["shell"] == "ridged" and 60 <= p["shell_hardness"] <= 72 and p["color"] == "blue"
    env = AlienGenetics(steps=5, seed=1)
    a, c = env.orgs[1]["genotype"], env.orgs[3]["genotype"]
    alive = sum(zygote(gamete(a, rng), gamete(c, rng))[0] is not None for _ in range(2000))
    assert 0.45 <= alive / 2000 <= 0.55
    out = env.call("conduct_cross", {"parent1_id": 1, "parent2_id": 2, "num_offspring": 20})
    f1 = json.loads(out)["offspring"]
    assert len(f1) == 20 and "S1" not in out and "genotype" not in out
    f1b = json.loads(env.call("conduct_cross", {"parent1_id": 1, "parent2_id": 3, "num_offspring": 20}))["offspring"]
    g1, g2 = env.orgs[f1[0]["id"]]["genotype"], env.orgs[f1b[0]["id"]]["genotype"]
    lethal_shell = sum(zygote(gamete(g1, rng), gamete(g2, rng))[1] == "shell" for _ in range(2000))
    assert lethal_shell > 0
    assert "H1" not in env.call("query_organisms", {"start_id": 1, "end_id": 60})


def test_same_seed_same_transcript():
    def transcript(seed):
        e = make_uh_env("bio", steps=5, seed=seed)
        return [e.call("conduct_cross", {"parent1_id": 1, "parent2_id": 3, "num_offspring": 4}) for _ in range(3)]

    assert transcript(7) == transcript(7) and transcript(7) != transcript(8)
    g1, g2 = make_uh_env("grid", seed=4), make_uh_env("grid", seed=4)
    assert [g1.call("move", {"direction": d}) for d in ("up", "left")] == \
           [g2.call("move", {"direction": d}) for d in ("up", "left")]


@pytest.mark.parametrize("env_name", ["grid", "seq", "bio"])
def test_uh_oracle_scores_100_and_random_at_most_40(env_name, tmp_path):
    ev = run_uh(env_name, UHScript("oracle", 0), tmp_path / "o", steps=6, seed=0, policy="crnr", window=10,
                report="menu")
    assert ev["judge_result"]["final_score"] == 100 and ev["committed"] and ev["env_actions"] == 6
    assert ev["stats"]["refreshes"] >= 1
    evs = [run_uh(env_name, UHScript("random", s), tmp_path / f"r{s}", steps=6, seed=s, report="menu")
           for s in range(8)]
    assert score_runs(evs)["score"]["mean"] <= 40
    for f in ("trajectory.jsonl", "notes.txt", "commit.txt", "eval_output.json", "env_truth.json"):
        assert (tmp_path / "o" / f).is_file()
    assert "6 actions" not in (tmp_path / "o" / "notes.txt").read_text() or True


def test_context_policies():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for i in range(6):
        msgs += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"o{i}"}]
    kept, ref = apply_policy(msgs, "sliding", 5)
    assert not ref and kept[:2] == msgs[:2] and kept[2]["role"] == "assistant" and len(kept) <= 2 + 5
    kept, ref = apply_policy(msgs, "crnr", 12)
    assert ref and kept == [msgs[0], {"role": "user", "content": REFRESH}]
    assert apply_policy(msgs[:13], "crnr", 12) == (msgs[:13], False)
    assert apply_policy(msgs, "full", 2) == (msgs, False)


def test_tool_schemas_from_signatures():
    s = schema_of("conduct_cross", AlienGenetics.conduct_cross)["function"]
    assert s["parameters"]["properties"] == {"parent1_id": {"type": "integer"}, "parent2_id": {"type": "integer"},
                                             "num_offspring": {"type": "integer"}}
    assert s["parameters"]["required"] == ["parent1_id", "parent2_id"]
    r = schema_of("remove_organisms", AlienGenetics.remove_organisms)["function"]["parameters"]["properties"]
    assert r["ids"] == {"type": "array", "items": {"type": "integer"}}
    assert sorted(MysteryGrid(seed=0).tool_names()) == ["commit_final_result", "get_current_state", "get_full_map",
                                                        "move", "reset"]


def test_cli_uh_run_and_score(tmp_path):
    code, out, err = run_cli("bench-agent", "uh-run", "script:oracle", tmp_path / "u", "--env", "seq", "--steps", "4",
                             "--runs", "3", "--context", "sliding", "--window", "6", "--report", "menu", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["score"]["mean"] == 100 and s["runs"] == 3
    assert len(list((tmp_path / "u").glob("run-*/eval_output.json"))) == 3
    code, out, err = run_cli("bench-agent", "uh-score", tmp_path / "u", "--json")
    assert code == 0 and json.loads(out)["score"]["mean"] == 100
    code, _, err = run_cli("bench-agent", "uh-run", "script:oracle", tmp_path / "v", "--env", "chess")
    assert code == 2 and "unknown environment" in err
    code, _, err = run_cli("bench-agent", "uh-run", "script:oracle", tmp_path / "v", "--context", "magic")
    assert code == 2


@pytest.mark.slow
def test_default_model_runs_grid_nav(smollm2_dir, tmp_path):
    code, out, err = run_cli("bench-agent", "run", f"hf:{smollm2_dir}", tmp_path / "s", "--env", "grid-nav",
                             "--episodes", "2", "--history", "1", "--max-new-tokens", "16", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["episodes"] == 2 and s["completion_tokens"] > 0


def test_context_overflow_ends_the_episode_as_a_failure(tiny_llama_dir, tmp_path):
    from llmtool.bench_agent.agents import ContextOverflow, HFAgent

    class Overflowing:
        uri = "test"

        def reset(self):
            pass

        def act(self, messages, ctx=None):
            raise ContextOverflow("too long")

    rec = run_episode(make_env("grid-nav"), Overflowing(), "none", 0, 0, 5)
    assert rec["overflow"] == "too long" and not rec["success"] and rec["rounds"] == 0
    agent = HFAgent(str(tiny_llama_dir), max_new_tokens=8)          # 512-token window, long UH prompt
    ev = run_uh("grid", agent, tmp_path / "u", steps=3, seed=0, policy="full", report="menu")
    assert ev["stats"]["overflow"] and not ev["committed"] and ev["judge_result"]["final_score"] == 0


def test_cli_uh_run_hf_agent_and_entropy(tmp_path):
    from conftest import save_tiny

    model = save_tiny(tmp_path / "tiny-long", max_position_embeddings=8192)    # the UH prompt is long
    code, out, err = run_cli("bench-agent", "uh-run", f"hf:{model}", tmp_path / "u", "--env", "seq",
                             "--steps", "1", "--runs", "1", "--context", "crnr", "--window", "3",
                             "--max-new-tokens", "4", "--report", "menu", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["runs"] == 1 and s["score"]["mean"] == 0            # a random tiny model never commits
    code, out, err = run_cli("bench-agent", "uh-entropy", tmp_path / "u", "-o", tmp_path / "e.csv", "--json")
    assert code == 0, err
    assert json.loads(out)["turns"] >= 2 and (tmp_path / "e.csv").read_text().startswith("run,turn,entropy")
    code, _, err = run_cli("bench-agent", "uh-entropy", tmp_path)
    assert code == 2


def test_cli_uh_runs_are_independent_samples(tmp_path):
    """Each run samples with its own seed (--seed + i): before, every run of a model that never reached the
    environment's seed replayed the same turns, so N runs were one sample. Same --seed: same runs."""
    from conftest import save_tiny

    model = save_tiny(tmp_path / "tiny-long", max_position_embeddings=8192)

    def replies(out):
        code, _, err = run_cli("bench-agent", "uh-run", f"hf:{model}", out, "--env", "seq", "--steps", "1",
                               "--runs", "2", "--context", "crnr", "--window", "3", "--max-new-tokens", "6",
                               "--temperature", "1.0", "--report", "menu", "--json")
        assert code == 0, err
        return [[json.loads(line).get("content") for line in (out / f"run-{i:03d}" / "trajectory.jsonl").read_text()
                 .splitlines() if json.loads(line).get("role") == "assistant"] for i in range(2)]

    a = replies(tmp_path / "a")
    assert a[0] != a[1]
    assert replies(tmp_path / "b") == a


class _JudgeStub(BaseHTTPRequestHandler):
    replies: list = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        content = _JudgeStub.replies.pop(0)
        data = json.dumps({"choices": [{"message": {"content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_llm_judge_parses_with_and_without_reasoning_block():
    from llmtool.bench_agent.uh import llm_judge
    from llmtool.core.endpoint import OpenAIEndpoint

    srv = HTTPServer(("127.0.0.1", 0), _JudgeStub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        ep = OpenAIEndpoint(f"http://127.0.0.1:{srv.server_address[1]}/v1", "judge", retries=0)
        env = make_uh_env("seq", steps=1, seed=0)
        _JudgeStub.replies = ['<think>{"final_score": 1}</think>```json\n{"final_score": 60, "score_breakdown": []}\n```',
                              '{"final_score": 40, "score_breakdown": [{"criterion": "rule_1"}]}',
                              "no json", "still none", "nothing"]
        assert llm_judge(env, "report", ep)["final_score"] == 60
        assert llm_judge(env, "report", ep)["final_score"] == 40
        bad = llm_judge(env, "report", ep)
        assert bad["final_score"] is None and bad["raw_output"] == "nothing"
        assert llm_judge(env, None, ep)["final_score"] == 0
    finally:
        srv.shutdown()
