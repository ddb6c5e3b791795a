"""Every ``openai:`` path of llmtool against a real OpenAI-compatible server (issue 41): ``transformers serve``
(transformers' own server, the ``serve`` extra: FastAPI + uvicorn) on 127.0.0.1, a free port, the CPU and
HF_HUB_OFFLINE=1, serving a tiny random Llama saved to a temporary directory with a tokenizer and a chat
template. Paths driven through llmtool's own code:

* ``core.endpoint.OpenAIEndpoint`` itself: ``GET /models`` and greedy chat, compared token for token with
  local ``generate`` of the same model and chat template; ``n`` choices from a server that ignores ``n``;
* judge sampling (``evaluate judge-sample --judge openai:MODEL --api-base URL``);
* bench-agent's agent (``bench-agent run openai:URL#MODEL``, the PIPE harness) and UltraHorizon
  (``bench-agent uh-run``, ``uhrun.py``);
* learn-program's proposer (``learn-program run --proposer openai:MODEL``), and the weak-proposer sanity suite
  of ``benchmarks/learn_program.py`` run through it (issue 42);
* GRPO rollouts (``train grpo --rollout-endpoint URL --rollout-model MODEL --steps 1``) and the rollout
  function under it.

Each test asserts that the requests reached the server (the server's own access log is counted) and that the
answer landed where it belongs (greedy decoding through the server equals local greedy decoding of the same
prompt). The server process is started once per module in its own process group, waited for with a bound
(180 s) and always killed by the fixture's finalizer. Slow: ``make test-slow``; the one fast test checks the
client's ``n`` top-up against a loopback stub that, like ``transformers serve``, ignores ``n``.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_cli, save_tiny

ROOT = Path(__file__).resolve().parents[1]
READY_S = 180
# A plain chat template (the tiny tokenizer has none). The server hands the template OpenAI content either as a
# string or as a list of text parts, so both are rendered the same way.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@dataclass
class Served:
    model_dir: Path
    base: str          # http://127.0.0.1:PORT
    log: Path

    @property
    def api(self) -> str:
        return self.base + "/v1"

    @property
    def name(self) -> str:   # the model id the server answers to: the path it was started with
        return str(self.model_dir)

    def chat_posts(self, status: str = "200") -> int:
        """POST /v1/chat/completions requests the server has answered with ``status`` ("" = any; its uvicorn
        access log)."""
        return sum(f'"POST /v1/chat/completions HTTP/1.1" {status}' in line
                   for line in self.log.read_text(errors="replace").splitlines())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("fastapi", reason="transformers serve needs the serve extra: pip install -e '.[serve]'")
    pytest.importorskip("uvicorn", reason="transformers serve needs the serve extra: pip install -e '.[serve]'")
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("served")
    d = save_tiny(root / "tiny-chat", max_position_embeddings=8192)   # learn-program / UH prompts are long
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    port = _free_port()
    log = root / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "transformers.cli.transformers", "serve", str(d),
                                 "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
                                 "--log-level", "warning"],
                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"transformers serve not ready after {READY_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield Served(d, base, log)
    finally:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue


@pytest.fixture(scope="module")
def local(served):
    """The served model and tokenizer loaded in this process: the reference for greedy decoding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served.model_dir)
    model = AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32).eval()

    def greedy(messages: list[dict], max_new_tokens: int) -> str:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return SimpleNamespace(tok=tok, model=model, greedy=greedy)


# ------------------------------------------------------------------------------------------- the client itself

@pytest.mark.slow
def test_client_lists_the_model_and_greedy_chat_equals_local_generate(served, local):
    from llmtool.core.endpoint import OpenAIEndpoint

    ep = OpenAIEndpoint(served.api, served.name, timeout=60)
    assert ep.check() == [served.name]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The capital of France is"}]
    before = served.chat_posts()
    got = ep.chat(msgs, n=3, temperature=0.0, max_tokens=8, seed=1)
    # transformers serve ignores `n` (one choice per reply): the client asked twice more, one choice each
    assert served.chat_posts() - before == 3
    want = local.greedy(msgs, 8)
    assert want and [m["content"] for m in got] == [want] * 3
    # a sampled request with a seed: two extra requests with their own seeds, n answers in all
    assert len(ep.chat(msgs, n=2, temperature=1.0, max_tokens=4, seed=5)) == 2


# ------------------------------------------------------------------------------------------- judge sampling

@pytest.mark.slow
def test_judge_sample_through_the_server(served, local, tmp_path):
    from llmtool.evaluate import judge_sample as S

    pairs = [{"id": f"p{i}", "prompt": f"Continue: It is a truth {i}", "response_a": "universally acknowledged",
              "response_b": "acknowledged universally"} for i in range(2)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    before = served.chat_posts()
    code, out, err = run_cli("--json", "evaluate", "judge-sample", "--judge", f"openai:{served.name}", "--api-base",
                             served.api, "--pairs", tmp_path / "pairs.jsonl", "--n", "2", "--temperature", "0",
                             "--max-new-tokens", "6", "--concurrency", "2", "-o", tmp_path / "votes.jsonl")
    assert code == 0, err
    votes = [json.loads(line) for line in (tmp_path / "votes.jsonl").read_text().splitlines()]
    assert len(votes) == 4 and json.loads(out)["votes"] == 4
    assert served.chat_posts() - before == 4             # one request per vote (n ignored by the server)
    for v in votes:
        pair = pairs[int(v["id"][1:])]
        first, second = S.presented(pair, v["order"])
        msgs = [{"role": "system", "content": S.SYSTEM},
                {"role": "user", "content": S.judge_prompt(pair["prompt"], first, second, "3way")}]
        assert v["raw"] == local.greedy(msgs, 6)          # the server's answer, in this vote's slot
        assert v["rating"] == S.to_canonical(S.parse_rating(v["raw"]), v["order"])
    # self-aggregation with the same judge through the server: one greedy request per pair
    before = served.chat_posts()
    code, _, err = run_cli("evaluate", "judge-self-agg", "--judge", f"openai:{served.name}", "--api-base", served.api,
                           "--pairs", tmp_path / "pairs.jsonl", "--votes", tmp_path / "votes.jsonl",
                           "--max-new-tokens", "5", "-o", tmp_path / "selfagg.jsonl")
    assert code == 0, err
    recs = [json.loads(line) for line in (tmp_path / "selfagg.jsonl").read_text().splitlines()]
    assert [r["id"] for r in recs] == ["p0", "p1"] and served.chat_posts() - before == 2
    per = S.group_votes(votes)
    for r, pair in zip(recs, S.read_pairs(pairs)):
        msgs = [{"role": "system", "content": S.SYSTEM},
                {"role": "user", "content": S.self_agg_prompt(pair, per[pair["id"]], "3way", 1000)}]
        assert r["raw"] == local.greedy(msgs, 5) and r["n_outputs"] == 2
        assert r["rating"] == S.parse_rating(r["raw"])


# ------------------------------------------------------------------------------------------- bench-agent

@pytest.mark.slow
def test_bench_agent_episode_through_the_server(served, local, tmp_path):
    before = served.chat_posts()
    code, out, err = run_cli("--json", "bench-agent", "run", f"openai:{served.api}#{served.name}", tmp_path / "o",
                             "--env", "grid-nav", "--episodes", "1", "--max-rounds", "2", "--max-new-tokens", "8")
    assert code == 0, err
    recs = [json.loads(line) for line in (tmp_path / "o" / "episodes.jsonl").read_text().splitlines()]
    assert len(recs) == 1
    conv = recs[0]["conversation"]
    turns = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    assert 1 <= len(turns) <= 2 and served.chat_posts() - before == len(turns)
    for i in turns:   # the agent is greedy by default (temperature 0): each turn is the model's greedy answer
        assert conv[i]["content"] == local.greedy(conv[:i], 8)


@pytest.mark.slow
def test_bench_agent_tools_protocol_through_the_server(served, tmp_path):
    """--protocol tools sends the action schemas as OpenAI tools: the server accepts them (its chat template
    gets them) and the reply's text or tool calls become the agent's turns."""
    before, before_any = served.chat_posts(), served.chat_posts("")
    code, _, err = run_cli("bench-agent", "run", f"openai:{served.api}#{served.name}", tmp_path / "t",
                           "--env", "grid-nav", "--episodes", "1", "--max-rounds", "2", "--max-new-tokens", "8", "--protocol", "tools")
    assert code == 0, err
    recs = [json.loads(line) for line in (tmp_path / "t" / "episodes.jsonl").read_text().splitlines()]
    turns = [m for m in recs[0]["conversation"] if m["role"] == "assistant"]
    # every request answered 200: no refusal of the tools (which would fall back to the text protocol)
    assert 1 <= len(turns) <= 2 and served.chat_posts() - before == served.chat_posts("") - before_any == len(turns)


@pytest.mark.slow
def test_bench_agent_ultrahorizon_run_through_the_server(served, tmp_path):
    before = served.chat_posts()
    code, out, err = run_cli("--json", "bench-agent", "uh-run", f"openai:{served.api}#{served.name}", tmp_path / "u",
                             "--env", "seq", "--steps", "1", "--runs", "1", "--context", "crnr", "--window", "3",
                             "--max-new-tokens", "4", "--report", "menu")
    assert code == 0, err
    s = json.loads(out)
    assert s["runs"] == 1 and s["score"]["mean"] == 0                 # a random tiny model never commits
    traj = [json.loads(line) for line in (tmp_path / "u" / "run-000" / "trajectory.jsonl").read_text().splitlines()]
    said = [t for t in traj if t.get("role") == "assistant"]
    assert said and served.chat_posts() - before >= len(said)


@pytest.mark.slow
def test_bench_agent_ultrahorizon_llm_judge_through_the_server(served, local, tmp_path):
    """uh-run --judge openai:URL#MODEL: the oracle agent commits a report, the server's model judges it (greedy,
    up to 3 tries); a tiny random judge never answers JSON, so the score is null and its last answer is kept."""
    from llmtool.bench_agent.uh import JUDGE_PROMPT

    before = served.chat_posts()
    code, out, err = run_cli("--json", "bench-agent", "uh-run", "script:oracle", tmp_path / "u", "--env", "seq",
                             "--steps", "40", "--runs", "1", "--judge", f"openai:{served.api}#{served.name}")
    assert code == 0, err
    ev = json.loads((tmp_path / "u" / "run-000" / "eval_output.json").read_text())
    assert ev["committed"] and ev["judge"] == f"openai:{served.name}"
    assert ev["judge_result"]["final_score"] is None and served.chat_posts() - before == 3
    truth = json.loads((tmp_path / "u" / "run-000" / "env_truth.json").read_text())
    msg = JUDGE_PROMPT.format(truth=json.dumps(truth), rubric="20 points per rule", report=ev["judge_input"])
    assert ev["judge_result"]["raw_output"] == local.greedy([{"role": "user", "content": msg}], 2048)[:4000]


# ------------------------------------------------------------------------------------------- learn-program

@pytest.mark.slow
def test_learn_program_proposer_through_the_server(served, local, tmp_path):
    before = served.chat_posts()
    code, out, err = run_cli("--json", "learn-program", "run", tmp_path / "lp", "--proposer", f"openai:{served.name}",
                             "--api-base", served.api, "--task", "parity_all", "--length", "8", "--train", "16",
                             "--val", "16", "--test", "32", "--samples", "3", "--no-early-stop", "--temperature", "0",
                             "--max-new-tokens", "12", "--concurrency", "2")
    assert code == 0, err
    cands = [json.loads(line) for line in (tmp_path / "lp" / "candidates.jsonl").read_text().splitlines()]
    assert len(cands) == 3 and served.chat_posts() - before == 3       # the proposer got 3 programs back
    prompt = (tmp_path / "lp" / "prompt.txt").read_text()
    want = local.greedy([{"role": "user", "content": prompt}], 12)
    assert [c["raw_text"] for c in cands] == [want] * 3
    assert json.loads(out)["proposer"] == f"openai:{served.name}"


@pytest.mark.slow
def test_learn_program_sanity_suite_through_the_server(served, tmp_path):
    """Issue 42: the weak-proposer sanity suite (four one-line rules as user data, benchmarks/learn_program.py)
    run through the OpenAI proposer against the local server: every rule gets its k proposals and a result;
    the gate "val 1.0 => test >= 0.99" is evaluated on what came back."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.learn_program import SANITY_RULES, sanity_dataset, sanity_gate
    from llmtool.learn_program.tasks import write_dataset

    rows, before = [], served.chat_posts()
    for rule in SANITY_RULES:
        d = tmp_path / "data" / rule
        d.mkdir(parents=True)
        write_dataset(sanity_dataset(rule, 0), d)
        code, out, err = run_cli("--json", "learn-program", "run", tmp_path / "runs" / rule, "--data", d,
                                 "--proposer", f"openai:{served.name}", "--api-base", served.api, "--samples", "2",
                                 "--no-early-stop", "--temperature", "1.0", "--max-new-tokens", "16")
        assert code == 0, err
        s = json.loads(out)
        assert s["k_used"] == 2 and s["length"] == 20
        cands = [json.loads(line) for line in (tmp_path / "runs" / rule / "candidates.jsonl").read_text().splitlines()]
        assert len(cands) == 2 and all(isinstance(c["raw_text"], str) and c["raw_text"] for c in cands)
        rows.append({"rule": rule, "pass_at_k": (s.get("best_val") or 0) >= 1.0, "test_acc": s.get("test_acc"),
                     "best_val": s.get("best_val")})
    assert served.chat_posts() - before == 2 * len(SANITY_RULES)
    gate = sanity_gate(rows)   # a tiny random proposer reaches val 1.0 on no rule: the gate is not tested
    if any(r["pass_at_k"] for r in rows):
        assert gate["met"] is (all((r["test_acc"] or 0) >= 0.99 for r in rows if r["pass_at_k"]))
    else:
        assert gate["met"] is None and gate["verdict"] != "met"


# ------------------------------------------------------------------------------------------- GRPO rollouts

@pytest.mark.slow
def test_grpo_rollout_function_groups_are_the_servers_answers(served, local):
    from llmtool.train.cli_grpo import _endpoint_rollouts

    fn = _endpoint_rollouts(served.api, served.name, local.tok)
    s = SimpleNamespace(system_prompt="Answer.", temperature=0.0, max_new_tokens=6)
    rows = [{"prompt": "2+2="}, {"prompt": "3+4="}]
    before = served.chat_posts()
    groups = fn(rows, None, 3, s, 0)
    assert served.chat_posts() - before == 6            # G = 3 per prompt although the server ignores n
    assert [len(g) for g in groups] == [3, 3]
    for row, g in zip(rows, groups):
        want = local.greedy([{"role": "system", "content": "Answer."}, {"role": "user", "content": row["prompt"]}], 6)
        assert [c.text for c in g] == [want] * 3
        assert g[0].token_ids == local.tok(want, add_special_tokens=False)["input_ids"][:6]


@pytest.mark.slow
def test_train_grpo_one_step_with_rollouts_from_the_server(served, tmp_path):
    import torch
    from safetensors.torch import load_file

    before = served.chat_posts()
    code, out, err = run_cli("--json", "train", "grpo", served.model_dir, tmp_path / "g", "--data", "gen:arith:8:1",
                             "--steps", "1", "--group-size", "3", "--prompts-per-rollout", "2", "--mini-batch", "6",
                             "--micro-batch", "6", "--max-new-tokens", "6", "--lr", "1e-2", "--reward", "random:0.5",
                             "--rollout-endpoint", served.api, "--rollout-model", served.name)
    assert code == 0, err
    s = json.loads(out)
    assert s["phases"] == 1 and s["optimizer_steps"] == 1
    assert served.chat_posts() - before == 6            # 2 prompts x G = 3, each answered by the server
    rec = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert len(rec) == 1
    a = load_file(str(served.model_dir / "model.safetensors"))
    b = load_file(str(tmp_path / "g" / "model.safetensors"))
    assert any(not torch.equal(a[k], b[k]) for k in a)   # the policy was trained on the server's rollouts


# ------------------------------------------------------------------------------------------- fast: n top-up

def test_chat_tops_up_n_from_a_server_that_ignores_it():
    """A server that answers one choice whatever ``n`` (transformers serve, llama.cpp): ``chat`` asks again, one
    choice at a time with seeds seed + 100003*j, and returns exactly n; a vLLM-like server answering n in one
    reply gets one request."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from llmtool.core.console import UsageError
    from llmtool.core.endpoint import OpenAIEndpoint

    seen: list[dict] = []
    mode = {"n": False, "empty": False}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            k = 0 if mode["empty"] else (body["n"] if mode["n"] else 1)
            choices = [{"index": i, "message": {"role": "assistant", "content": f"s{body.get('seed')}-{i}"}}
                       for i in range(k)]
            data = json.dumps({"choices": choices}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        ep = OpenAIEndpoint(f"http://127.0.0.1:{srv.server_address[1]}/v1", "m", retries=0)
        got = ep.chat([{"role": "user", "content": "hi"}], n=3, temperature=1.0, seed=7)
        assert [m["content"] for m in got] == ["s7-0", "s100010-0", "s200013-0"]
        assert [b["n"] for b in seen] == [3, 1, 1] and [b["seed"] for b in seen] == [7, 100010, 200013]
        seen.clear()
        assert len(ep.chat([{"role": "user", "content": "hi"}], n=4)) == 4 and all("seed" not in b for b in seen)
        mode["n"] = True
        seen.clear()
        assert [m["content"] for m in ep.chat([{"role": "user", "content": "hi"}], n=3, seed=1)] == \
            ["s1-0", "s1-1", "s1-2"] and len(seen) == 1
        mode["empty"] = True
        with pytest.raises(UsageError, match="no choices"):
            ep.chat([{"role": "user", "content": "hi"}], n=2)
    finally:
        srv.shutdown()
        srv.server_close()
