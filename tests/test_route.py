"""FusionRoute (llmtool route): decoding equivalences, losses, training stages, baselines, CLI.
Tiny random Llamas only; every test runs in seconds."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import build_tiny_llama, build_tokenizer, run_cli, save_tiny, write_route_rows


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _models(tok, n=2, untied=True):
    from llmtool.route.router import FusionRouter

    V = len(tok)
    router = FusionRouter(build_tiny_llama(V, seed=0, tie_word_embeddings=False), n)
    experts = [build_tiny_llama(V, seed=10 + i, tie_word_embeddings=not untied) for i in range(n)]
    for e in experts:
        e.requires_grad_(False)
    return router, experts


def _prompts(tok):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in
            ("The capital of", "It is a truth universally", "man", "single man in possession of a good")]


def _decode(router, experts, tok, prompts, n=24, **kw):
    from llmtool.route.decoding import FusionChooser, decode_loop
    from llmtool.route.vocab import VocabView

    vocab = VocabView.of([router.lm, *experts], tok)
    record = kw.pop("record_scores", False)
    return decode_loop(prompts, FusionChooser(router, experts, vocab, **kw), eos_ids=[], pad_id=0,
                       max_new_tokens=n, record_scores=record)


def _hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


# ------------------------------------------------------------------------------------- decoding
def test_force_k_with_uniform_router_equals_expert_greedy(tok):
    router, experts = _models(tok)
    with torch.no_grad():
        router.lm.lm_head.weight.zero_()  # router log-softmax is uniform: a constant shift
    p = _prompts(tok)[0]
    for k in (1,):
        got = _decode(router, experts, tok, [p], n=64, mode="force", k=k)[0]
        assert got.token_ids == _hf_greedy(experts[k], p, 64)
        assert set(got.trace) == {k}


def test_route_only_with_hardwired_head_equals_expert_mode(tok):
    router, experts = _models(tok)
    with torch.no_grad():
        router.head.bias.copy_(torch.tensor([0.0, 5.0]))
    p = _prompts(tok)[:2]
    a = _decode(router, experts, tok, p, mode="route-only")
    b = _decode(router, experts, tok, p, mode="expert", k=1)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert a[0].token_ids == _hf_greedy(experts[1], p[0], 24)


def test_lazy_equals_eager_and_routes_switch(tok):
    router, experts = _models(tok)
    torch.manual_seed(3)
    with torch.no_grad():
        torch.nn.init.normal_(router.head.weight, std=2.0)
    p = _prompts(tok)
    lazy = _decode(router, experts, tok, p, record_scores=True)
    eager = _decode(router, experts, tok, p, record_scores=True, eager=True)
    switches = 0
    for a, b in zip(lazy, eager):
        assert a.token_ids == b.token_ids and a.trace == b.trace
        for s1, s2 in zip(a.scores, b.scores):
            fin = torch.isfinite(s1)
            assert torch.equal(fin, torch.isfinite(s2))
            assert torch.allclose(s1[fin], s2[fin], atol=1e-5)
        switches += sum(x != y for x, y in zip(a.trace, a.trace[1:]))
    assert switches > 0, "random head should switch experts at least once"
    assert {k for r in lazy for k in r.trace} == {0, 1}


def test_batch_equals_single_runs(tok):
    router, experts = _models(tok)
    torch.manual_seed(4)
    with torch.no_grad():
        torch.nn.init.normal_(router.head.weight, std=2.0)
    p = _prompts(tok)
    batch = _decode(router, experts, tok, p)
    for i, q in enumerate(p):
        single = _decode(router, experts, tok, [q])[0]
        assert single.token_ids == batch[i].token_ids and single.trace == batch[i].trace


def test_padded_vocab_ids_never_chosen(tok):
    from llmtool.route.router import FusionRouter

    V = len(tok)
    router = FusionRouter(build_tiny_llama(V + 8, seed=0, tie_word_embeddings=False), 1)
    expert = build_tiny_llama(V + 8, seed=1, tie_word_embeddings=False)
    with torch.no_grad():  # make padded rows the most likely ids
        router.lm.lm_head.weight[V:] = 50.0
        expert.lm_head.weight[V:] = 50.0
    out = _decode(router, [expert], tok, _prompts(tok)[:1], n=8)[0]
    assert max(out.token_ids) < V


# ------------------------------------------------------------------------------------- losses
def test_informative_mask_and_empty_mask():
    from llmtool.route.losses import informative_mask, routing_loss

    a = torch.tensor([[[1, 2, 3, 4]], [[1, 5, 3, 6]]])        # [n=2, B=1, T=4]
    valid = torch.tensor([[True, True, True, False]])
    assert informative_mask(a, valid).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    tgt = torch.tensor([[1, 7, 3, 6]])
    assert informative_mask(a, valid, "informative-strict", tgt).tolist() == [[0.0, 0.0, 0.0, 0.0]]
    w = torch.randn(1, 4, 2, requires_grad=True)
    loss = routing_loss(w, torch.randn(2, 1, 4), torch.zeros(1, 4))
    assert float(loss.detach()) == 0.0 and not torch.isnan(loss.detach())
    loss.backward()
    assert torch.isfinite(w.grad).all()


def test_routing_loss_brute_force():
    from llmtool.route.losses import routing_loss

    torch.manual_seed(0)
    w = torch.randn(1, 3, 2)
    g = torch.log_softmax(torch.randn(2, 1, 3, 5), -1)[..., 0]
    m = torch.tensor([[1.0, 0.0, 1.0]])
    ref = 0.0
    for t in (0, 2):
        alpha = torch.softmax(w[0, t], -1)
        ref += -math.log(sum(float(alpha[i]) * math.exp(float(g[i, 0, t])) for i in range(2)))
    assert abs(float(routing_loss(w, g, m)) - ref / 2) < 1e-5


def test_cdpo_equal_policy_is_log2():
    from llmtool.route.losses import cdpo_loss

    x = torch.tensor([-3.0, -7.5])
    assert abs(float(cdpo_loss(x, x - 1, x, x - 1)) - math.log(2)) < 1e-6


# ------------------------------------------------------------------------------------- training
def _checksum(m):
    return sum(float(p.double().sum()) for p in m.parameters())


def test_one_sft_step_moves_router_not_experts(tok):
    from llmtool.core.trainer import TrainArgs
    from llmtool.route.training import RouteLossArgs, train_sft
    from llmtool.route.vocab import VocabView

    router, experts = _models(tok)
    vocab = VocabView.of([router.lm, *experts], tok)
    before_e = [_checksum(e) for e in experts]
    before_body = router.lm.model.layers[0].mlp.down_proj.weight.clone()
    ex = [{"prompt": "The capital of", "completion": " France is Paris."}] * 4
    res = train_sft(router, experts, tok, vocab, ex, TrainArgs(lr=1e-3, max_steps=1, batch_size=4), RouteLossArgs())
    assert res["steps"] == 1 and res["informative_fraction"] > 0
    assert [_checksum(e) for e in experts] == before_e
    assert router.head.weight.abs().sum() > 0
    assert not torch.equal(before_body, router.lm.model.layers[0].mlp.down_proj.weight)


def test_cdpo_initial_loss_log2_and_margin_grows(tok):
    from llmtool.core.trainer import TrainArgs
    from llmtool.route.training import (RouteLossArgs, encode_pairs, fused_sequence_logprobs, pair_collate,
                                        train_cdpo)
    from llmtool.route.vocab import VocabView

    router, experts = _models(tok)
    with torch.no_grad():
        router.head.bias.copy_(torch.tensor([1.0, 0.0]))
    vocab = VocabView.of([router.lm, *experts], tok)
    pairs = [{"prompt": "The capital of", "chosen": " France is Paris.", "rejected": " Italy is Rome."}] * 4
    batch = pair_collate(0)(encode_pairs(tok, pairs[:1], 64))

    def margin():
        lp = fused_sequence_logprobs(router, experts, vocab, batch)
        return float(lp[0] - lp[1])

    m0 = margin()
    res = train_cdpo(router, experts, tok, vocab, pairs, TrainArgs(lr=1e-3, max_steps=3, batch_size=4),
                     RouteLossArgs(sft_weight=0.0))
    assert abs(res["cdpo_loss_first"] - math.log(2)) < 1e-5
    assert margin() > m0


def test_routing_recovers_planted_domain_experts(tok):
    """Two domains (marker word) whose gold responses are each expert's own greedy continuation: after
    SFT the router must pick the domain's expert on >= 90 % of informative positions and route-only
    accuracy must beat every single expert."""
    from llmtool.core.trainer import TrainArgs
    from llmtool.route.decoding import FusionChooser, decode_loop
    from llmtool.route.losses import expert_stats, informative_mask, shift
    from llmtool.route.training import RouteLossArgs
    from llmtool.route.vocab import VocabView

    router, experts = _models(tok)
    with torch.no_grad():  # random experts are near-uniform; sharpen them so "who wrote this" is identifiable
        for e in experts:
            e.lm_head.weight.mul_(20.0)
    vocab = VocabView.of([router.lm, *experts], tok)
    words = ["capital", "truth", "fortune", "wife", "Paris", "Rome", "man", "daughters"]
    rows = []
    for d, marker in enumerate(("France", "Italy")):
        for w in words:
            p = tok(f"{marker} {w}", add_special_tokens=False)["input_ids"]
            rows.append((d, p, _hf_greedy(experts[d], p, 6)))
    # token-level rows (random experts emit byte fragments that do not survive a decode/encode round trip),
    # trained by the same Trainer subclass the CLI uses
    import tempfile

    from llmtool.core.trainer import _collate, _Examples, training_arguments
    from llmtool.route.training import RouteSFTTrainer

    data = _Examples([{"input_ids": p + c, "labels": [-100] * len(p) + c} for _, p, c in rows])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = RouteSFTTrainer(model=router, args=training_arguments(
            TrainArgs(lr=3e-3, max_steps=40, batch_size=8, seed=0), tmp), train_dataset=data,
            data_collator=_collate(0), route_experts=experts, vocab=vocab, route_args=RouteLossArgs())
        trainer.train()
    router.eval()
    hit = tot = 0
    for d, p, c in rows:
        ids = torch.tensor([p + c])
        labels = torch.tensor([[-100] * len(p) + c])
        tgt, valid = shift(ids, labels)
        g, a = expert_stats(experts, vocab, ids, torch.ones_like(ids), tgt)
        m = informative_mask(a, valid).bool()
        with torch.no_grad():
            _, w, _ = router(ids)
        k = w[:, :-1].argmax(-1)
        hit += int((k[m] == d).sum())
        tot += int(m.sum())
    assert tot > 0 and hit / tot >= 0.9
    prompts = [p for _, p, _ in rows]
    gold = [c for _, _, c in rows]

    def acc(**kw):
        res = decode_loop(prompts, FusionChooser(router, experts, vocab, **kw), eos_ids=[], pad_id=0,
                          max_new_tokens=6)
        return sum(r.token_ids == g for r, g in zip(res, gold)) / len(gold)

    route_only = acc(mode="route-only")
    singles = [acc(mode="expert", k=k) for k in range(2)]
    assert route_only >= max(singles) and route_only >= 0.9


# ------------------------------------------------------------------------------------- baselines
def test_merges():
    from llmtool.route.merging import dare, task_arithmetic

    torch.manual_seed(0)
    base = {"w": torch.randn(4, 4), "i": torch.tensor([1, 2])}
    e1 = {"w": base["w"] + torch.randn(4, 4), "i": torch.tensor([1, 2])}
    e2 = {"w": base["w"] + torch.randn(4, 4), "i": torch.tensor([1, 2])}
    assert torch.equal(task_arithmetic(base, [e1, e2], 0.0)["w"], base["w"])
    assert torch.allclose(task_arithmetic(base, [e1], 1.0)["w"], e1["w"], atol=1e-6)
    assert torch.allclose(dare(base, [e1, e2], p=0.0, lam=0.5)["w"], task_arithmetic(base, [e1, e2], 0.5)["w"])
    d = dare(base, [e1], p=0.5, lam=1.0, seed=1)["w"] - base["w"]
    delta = e1["w"] - base["w"]
    kept = d != 0
    assert 0 < int(kept.sum()) < 16 and torch.allclose(d[kept], 2 * delta[kept], atol=1e-5)
    from llmtool.core.console import UsageError

    with pytest.raises(UsageError, match="shape"):
        task_arithmetic(base, [{"w": torch.randn(5, 4), "i": base["i"]}], 1.0)


def test_seq_select_oracle_and_vote():
    from llmtool.route.baselines import seq_select

    rows = [{"domain": "math", "answer": "6", "prompt": "1+5"}, {"domain": "reverse", "answer": "noen", "prompt": "x"}]
    outs = [["6", "nope"], ["7", "noen"]]
    assert seq_select(outs, rows, "oracle", ["math", "reverse"]) == [0, 1]
    with pytest.raises(Exception):
        seq_select(outs, rows, "oracle", ["a", "b"])


def test_token_select_prefers_confident_expert(tok):
    from llmtool.route.decoding import TokenSelectChooser, decode_loop
    from llmtool.route.vocab import VocabView

    _, experts = _models(tok)
    vocab = VocabView.of(experts, tok)
    p = _prompts(tok)[:1]
    res = decode_loop(p, TokenSelectChooser(experts, vocab, value="confidence"), eos_ids=[], pad_id=0, max_new_tokens=5)
    # reference: recompute each step by brute force
    seq = list(p[0])
    for t, tokid in enumerate(res[0].token_ids):
        best = None
        for j, e in enumerate(experts):
            with torch.no_grad():
                lp = torch.log_softmax(e(torch.tensor([seq])).logits[0, -1].float(), -1)
            a = int(lp.argmax())
            if best is None or float(lp[a]) > best[0]:
                best = (float(lp[a]), a, j)
        assert tokid == best[1] and res[0].trace[t] == best[2]
        seq.append(tokid)


# ------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("route")
    base = save_tiny(root / "base", seed=0, tie_word_embeddings=False)
    data = write_route_rows(root / "train.jsonl")
    code, out, err = run_cli("route", "make-experts", str(base), str(root / "experts"), "--data", str(data),
                             "--max-steps", "2", "--batch-size", "4", "--template", "raw")
    assert code == 0, err + out
    return root, base, data


def test_cli_train_generate_eval_roundtrip(cli_setup, tmp_path, monkeypatch):
    root, base, data = cli_setup
    experts = f"{root}/experts/math,{root}/experts/reverse"
    run = tmp_path / "fr"
    code, out, err = run_cli("route", "train", str(run), "--data", str(data), "--experts", experts, "--base", str(base),
                             "--max-steps", "2", "--batch-size", "4", "--template", "raw")
    assert code == 0, err + out
    assert (run / "routing_head.safetensors").is_file() and (run / "fusionroute.json").is_file()
    gen1, gen2 = tmp_path / "g1.jsonl", tmp_path / "g2.jsonl"
    for g in (gen1, gen2):
        code, out, err = run_cli("route", "generate", "--router", str(run), "--in", str(data), "-o", str(g),
                                 "--max-new-tokens", "6", "--template", "raw")
        assert code == 0, err + out
    a = [json.loads(x) for x in gen1.read_text().splitlines()]
    assert a == [json.loads(x) for x in gen2.read_text().splitlines()] or \
        [r["output"] for r in a] == [json.loads(x)["output"] for x in gen2.read_text().splitlines()]
    assert all(len(r["route_trace"]) == r["n_tokens"] for r in a)
    ev = tmp_path / "ev.json"
    code, out, err = run_cli("route", "eval", "--router", str(run), "--data", str(data), "-o", str(ev),
                             "--max-new-tokens", "4", "--template", "raw", "--mode", "route-only")
    assert code == 0, err + out
    res = json.loads(ev.read_text())
    assert set(res["domains"]) == {"math", "reverse"}
    # cdpo stage from the sft run
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": "France capital", "chosen": " is Paris.", "rejected": " is Rome."}) + "\n"
                             for _ in range(4)))
    from llmtool.core import eta
    monkeypatch.setattr(eta, "MIN_PRINT_S", 0.0)
    code, out, err = run_cli("route", "train", str(tmp_path / "fr2"), "--stage", "cdpo", "--init", str(run),
                             "--data", str(prefs), "--max-steps", "1", "--batch-size", "2")
    assert code == 0, err + out
    assert json.loads((tmp_path / "fr2" / "fusionroute.json").read_text())["stage"] == "cdpo"
    assert "estimate:" in err and "router 4 rows" in err, err   # stage 2 announces its estimate too (1 x 2 pairs x 2)


def test_cli_baselines(cli_setup, tmp_path):
    root, base, data = cli_setup
    experts = f"{root}/experts/math,{root}/experts/reverse"
    code, out, err = run_cli("route", "baseline", str(tmp_path / "ta"), "--method", "merge-ta", "--experts", experts,
                             "--base", str(base), "--lam", "0")
    assert code == 0, err + out
    from safetensors.torch import load_file

    merged = load_file(str(next((tmp_path / "ta").glob("*.safetensors"))))
    orig = load_file(str(next(base.glob("*.safetensors"))))
    assert all(torch.equal(merged[k], orig[k]) for k in orig)
    for method in ("seq-select", "token-select"):
        code, out, err = run_cli("route", "baseline", str(tmp_path / method), "--method", method, "--experts", experts,
                                 "--base", str(base), "--in", str(data), "--max-new-tokens", "4", "--template", "raw")
        assert code == 0, err + out
        assert (tmp_path / method / "generations.jsonl").is_file()
    code, out, err = run_cli("route", "baseline", str(tmp_path / "x"), "--method", "merge-ta", "--experts", experts,
                             "--scorer", "vote")
    assert code == 2 and "--scorer" in err and not (tmp_path / "x").exists()


def test_cli_bad_inputs(cli_setup, tmp_path):
    root, base, data = cli_setup
    experts = f"{root}/experts/math,{root}/experts/reverse"
    other = tmp_path / "other"
    other.mkdir()
    from transformers import LlamaConfig, LlamaForCausalLM

    t2 = build_tokenizer(vocab_size=300)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(t2), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    t2.save_pretrained(other)
    out = tmp_path / "o"
    code, _, err = run_cli("route", "train", str(out), "--data", str(data), "--experts", f"{root}/experts/math,{other}",
                           "--base", str(base), "--max-steps", "1")
    assert code == 2 and "tokenizer.json" in err and str(other) in err and not out.exists()
    notlm = tmp_path / "notlm"
    notlm.mkdir()
    (notlm / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    code, _, err = run_cli("route", "train", str(out), "--data", str(data), "--experts", f"{root}/experts/math,{notlm}",
                           "--base", str(base), "--max-steps", "1")
    assert code == 2 and "causal" in err and not out.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n{not json\n")
    code, _, err = run_cli("route", "train", str(out), "--data", str(bad), "--experts", experts, "--base", str(base))
    assert code == 2 and "bad.jsonl:2" in err and not out.exists()
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"prompt": "a"}) + "\n")
    code, _, err = run_cli("route", "train", str(out), "--data", str(missing), "--experts", experts, "--base", str(base))
    assert code == 2 and "'response'" in err and ":1" in err
    run = tmp_path / "fr"
    assert run_cli("route", "train", str(run), "--data", str(data), "--experts", experts, "--base", str(base),
                   "--max-steps", "1", "--template", "raw")[0] == 0
    g = tmp_path / "g.jsonl"
    code, _, err = run_cli("route", "generate", "--router", str(run), "--in", str(data), "-o", str(g), "--mode", "expert:2")
    assert code == 2 and "out of range" in err and not g.exists()
    # loading with an expert whose tokenizer differs from the recorded hash is refused
    code, _, err = run_cli("route", "generate", "--router", str(run), "--in", str(data), "-o", str(g),
                           "--experts", f"{root}/experts/math,{other}")
    assert code == 2 and "tokenizer.json" in err and not g.exists()


def test_seq_select_verifier_prefers_well_formed_answers_ties_by_judge(tok, monkeypatch):
    """The verifier scorer: the domain's format reward first (math: a bare integer; code/joint: a function that
    parses), the judge's mean log-likelihood only among equally well-formed answers."""
    import llmtool.core.lm as lm
    from llmtool.route.baselines import seq_select

    # a fake judge that always prefers expert 1's answer (higher mean log-likelihood)
    calls = []

    def fake_nll(judge, tokenizer, prompts, outs):
        calls.append(len(outs))
        return [1.0 if len(calls) == 2 else 5.0 for _ in outs]

    monkeypatch.setattr(lm, "completion_nll", fake_nll)
    good_code, bad_code = "def f(x):\n    return x + 1", "def f(x):\n    return ("
    rows = [{"domain": "math", "prompt": "1 + 5 ="}, {"domain": "code", "prompt": "write f"},
            {"domain": "joint", "prompt": "write f with C"}, {"domain": "code", "prompt": "write g"},
            {"domain": "math", "prompt": "2 + 2 ="}]
    outs = [["6", "17", bad_code, "17", "4"],                 # expert 0
            [good_code, good_code, good_code, bad_code, "5"]]  # expert 1
    judge_picks = seq_select(outs, rows, "judge", judge=object(), tokenizer=tok, template="raw")
    assert judge_picks == [1, 1, 1, 1, 1]
    calls.clear()
    picks = seq_select(outs, rows, "verifier", judge=object(), tokenizer=tok, template="raw")
    # math: only expert 0 wrote a bare integer; code/joint: only expert 1 parses; row 4: neither parses and
    # row 5: both are integers -> the judge (expert 1)
    assert picks == [0, 1, 1, 1, 1]


def test_cli_seq_select_verifier_reuses_candidates(cli_setup, tmp_path):
    """`--scorer verifier --candidates FILE` picks among an earlier run's answers (no generation): with the judge's
    own candidates it keeps each row's well-formed answer when only one is well-formed, and refuses a file that
    lacks a row's candidates."""
    root, base, data = cli_setup
    experts = f"{root}/experts/math,{root}/experts/reverse"
    code, out, err = run_cli("route", "baseline", str(tmp_path / "judge"), "--method", "seq-select", "--experts", experts,
                             "--base", str(base), "--in", str(data), "--max-new-tokens", "4", "--template", "raw")
    assert code == 0, err + out
    gens = [json.loads(x) for x in (tmp_path / "judge" / "generations.jsonl").read_text().splitlines()]
    assert all(len(r["candidates"]) == 2 for r in gens)
    # plant a well-formed answer for one expert per row: math rows get "7" from expert 1, reverse rows "olleh" from 0
    for r in gens:
        r["candidates"] = ["x y z", "7"] if r["domain"] == "math" else ["olleh", "1 2"]
    cand = tmp_path / "cand.jsonl"
    cand.write_text("".join(json.dumps(r) + "\n" for r in gens))
    code, out, err = run_cli("route", "baseline", str(tmp_path / "ver"), "--method", "seq-select", "--scorer", "verifier",
                             "--candidates", str(cand), "--experts", experts, "--base", str(base), "--in", str(data),
                             "--template", "raw")
    assert code == 0, err + out
    got = [json.loads(x) for x in (tmp_path / "ver" / "generations.jsonl").read_text().splitlines()]
    assert [r["chosen_expert"] for r in got] == [1 if r["domain"] == "math" else 0 for r in got]
    assert [r["output"] for r in got] == ["7" if r["domain"] == "math" else "olleh" for r in got]
    cand.write_text("".join(json.dumps({**r, "candidates": r["candidates"][:1]}) + "\n" for r in gens))
    code, _, err = run_cli("route", "baseline", str(tmp_path / "bad"), "--method", "seq-select", "--scorer", "verifier",
                           "--candidates", str(cand), "--experts", experts, "--base", str(base), "--in", str(data),
                           "--template", "raw")
    assert code == 2 and "candidates" in err and not (tmp_path / "bad").exists()
    code, _, err = run_cli("route", "baseline", str(tmp_path / "gone"), "--method", "seq-select", "--scorer", "verifier",
                           "--candidates", str(tmp_path / "missing.jsonl"), "--experts", experts, "--base", str(base),
                           "--in", str(data), "--template", "raw")
    assert code == 2 and "missing.jsonl: no such file" in err and not (tmp_path / "gone").exists()
