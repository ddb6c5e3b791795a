"""Tests of `llmtool edit` (MEMIT / AlphaEdit, backward vs forward anchor) and `evaluate edits`."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_TEXT, build_tokenizer, run_cli, run_cli_subprocess, save_tiny

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("edit") / "tiny4", seed=3, num_hidden_layers=4)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _model64(path):
    from llmtool.core.models import load_model

    m = load_model(path, dtype=torch.float64)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _req(**kw):
    from llmtool.edit.requests import EditRequest

    base = dict(prompt="The capital of {} is", subject="France", target_new="Rome", target_true="Paris")
    base.update(kw)
    return EditRequest(**base)


# ---------------------------------------------------------------- requests
def test_request_formats(tmp_path):
    from llmtool.edit.requests import read_requests

    p = tmp_path / "r.jsonl"
    rows = [
        {"requested_rewrite": {"prompt": "The capital of {} is", "subject": "France",
                               "target_new": {"str": "Rome"}, "target_true": {"str": "Paris"}},
         "paraphrase_prompts": ["France's capital is"], "neighborhood_prompts": ["The Louvre is in"]},
        {"prompt": "{} plays the", "subject": "Ann", "target_new": "piano"},
        {"src": "What is the capital of Peru?", "subject": "Peru", "alt": "Quito", "answers": ["Lima"],
         "rephrase": "Which city is Peru's capital?", "loc": "nq question: who wrote hamlet", "loc_ans": "Shakespeare"},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    a, b, c = read_requests(p)
    assert (a.prompt, a.subject, a.target_new, a.target_true) == ("The capital of {} is", "France", "Rome", "Paris")
    assert a.neighborhood == [("The Louvre is in", "Paris")] and a.paraphrase_prompts == ["France's capital is"]
    assert b.target_true is None and b.filled() == "Ann plays the"
    assert c.prompt == "What is the capital of {}?" and c.target_new == "Quito" and c.target_true == "Lima"
    assert c.neighborhood == [("nq question: who wrote hamlet", "Shakespeare")]


@pytest.mark.parametrize("line,needle", [
    ('{"prompt": "x {}", "subject": "a"', ":1: malformed JSON"),
    ('{"prompt": "no slot", "subject": "a", "target_new": "b"}', ":1: field 'prompt' must contain"),
    ('{"requested_rewrite": {"prompt": "{} is", "subject": "a"}}', ":1: missing field 'requested_rewrite.target_new'"),
    ('[1, 2]', ":1: each line must be a JSON object"),
    ('{"prompt": "{} is", "subject": "", "target_new": "b"}', ":1: field 'subject' must be a non-empty string"),
])
def test_bad_request_files_give_clear_errors(tmp_path, tiny_llama_dir, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(line + "\n")
    code, _, err = run_cli("edit", "--method", "memit", str(tiny_llama_dir), str(p), str(tmp_path / "out"))
    assert code == 2 and needle in err and "bad.jsonl" in err
    assert not (tmp_path / "out").exists()


def test_bad_input_subprocess_one_line(tmp_path, tiny_llama_dir):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "{} is", "subject": "a", "target_new": "b"}\n{oops\n')
    r = run_cli_subprocess("edit", "--method", "memit", "--anchor", "forward", tiny_llama_dir, p, tmp_path / "o")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "bad.jsonl:2: malformed JSON" in r.stderr
    code, _, err = run_cli("edit", "--method", "rome", str(tiny_llama_dir), str(p), str(tmp_path / "o"))
    assert code == 2 and "unknown method 'rome'" in err


# ---------------------------------------------------------------- lookup index
@pytest.mark.parametrize("prompt,subject", [
    ("The capital of {} is", "France"),
    ("{} is in Paris", "The Eiffel Tower"),
    ("{} was a wife", "Jane Bennet"),
    ("However little {} may be", "Xylophonequartz"),
])
def test_lookup_index_is_subject_last_token(tok, prompt, subject):
    from llmtool.edit.prompts import subject_last_index

    ids, idx = subject_last_index(tok, prompt, subject)
    head = tok.decode(ids[:idx + 1])
    tail = tok.decode(ids[idx + 1:])
    assert head.endswith(subject) and not tok.decode(ids[:idx]).endswith(subject)
    assert head + tail == prompt.replace("{}", subject)


# ---------------------------------------------------------------- closed forms
def test_memit_closed_form_normal_equations_and_exact_fit():
    from llmtool.edit.memit import EditConfig, MemitSolve

    g = torch.Generator().manual_seed(0)
    d_ff, d, n = 24, 10, 5
    K, Rs = torch.randn(d_ff, n, generator=g, dtype=torch.float64), torch.randn(d, n, generator=g, dtype=torch.float64)
    X = torch.randn(d_ff, 100, generator=g, dtype=torch.float64)
    C = X @ X.T / 100
    s = MemitSolve(C, EditConfig(mom2_update_weight=3.0))
    dW = s.delta(K, Rs, torch.zeros(d_ff, d_ff, dtype=torch.float64))
    lhs, rhs = (K @ K.T + 3.0 * C) @ dW.T, K @ Rs.T
    assert (lhs - rhs).norm() / rhs.norm() < 1e-8
    exact = MemitSolve(C, EditConfig(mom2_update_weight=0.0, solver="pinv"))
    dW0 = exact.delta(K, Rs, torch.zeros(d_ff, d_ff, dtype=torch.float64))
    assert torch.allclose(dW0 @ K, Rs, atol=1e-9)


def test_alphaedit_projection_preserves_keys():
    from llmtool.edit.alphaedit import AlphaEditSolve, nullspace_projection
    from llmtool.edit.memit import EditConfig

    g = torch.Generator().manual_seed(1)
    d_ff, d = 32, 8
    basis = torch.randn(d_ff, 20, generator=g, dtype=torch.float64)  # preserved keys span 20 dims
    K0 = basis @ torch.randn(20, 400, generator=g, dtype=torch.float64)
    C = K0 @ K0.T / 400
    P = nullspace_projection(C, 1e-6)
    assert torch.allclose(P, P.T, atol=1e-12) and torch.allclose(P @ P, P, atol=1e-10)
    K, Rs = torch.randn(d_ff, 3, generator=g, dtype=torch.float64), torch.randn(d, 3, generator=g, dtype=torch.float64)
    W = torch.randn(d, d_ff, generator=g, dtype=torch.float64)
    dW = AlphaEditSolve(C, EditConfig(nullspace_threshold=1e-6, l2=1e-3)).delta(K, Rs, torch.zeros(d_ff, d_ff,
                                                                                                  dtype=torch.float64))
    assert (dW @ K0).norm() / (W @ K0).norm() < 1e-3
    assert (torch.sign((dW @ K) * Rs) > 0).float().mean() > 0.9  # edited keys still move toward Rs


# ---------------------------------------------------------------- anchors
def test_forward_replay_matches_manual_recomputation(tiny4, tok):
    from llmtool.core.models import decoder_layers
    from llmtool.edit.anchors import bare_batch, forward_replay

    m = _model64(tiny4)
    reqs = [_req(), _req(subject="Italy is a good", target_new="Paris")]
    layers = [1, 2, 3]
    batch, pos = bare_batch(tok, reqs, "cpu")
    out = m(**batch, output_hidden_states=True)
    h1 = out.hidden_states[layers[0] + 1].clone()  # output of decoder layer 1
    z1 = h1[torch.arange(2), pos] + torch.randn(2, 64, dtype=torch.float64) * 0.5
    targets = forward_replay(m, tok, reqs, z1, layers)
    # manual: overwrite, then push the stream through decoder layers 2..3 one at a time
    h = h1.clone()
    h[torch.arange(2), pos] = z1
    ids = batch["input_ids"]
    cache_pos = torch.arange(ids.shape[1])
    pos_ids = cache_pos[None].expand(2, -1)
    # right padding + causal attention: a plain causal mask is exact at every real token
    mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    pe = m.model.rotary_emb(h, pos_ids)
    for l in layers[1:]:
        o = decoder_layers(m)[l](h, attention_mask=mask, position_ids=pos_ids, position_embeddings=pe,
                                 cache_position=cache_pos)
        h = o[0] if isinstance(o, tuple) else o
        assert (targets[l] - h[torch.arange(2), pos]).abs().max() < 1e-10


def test_identity_anchor_gives_zero_update(tiny4, tok):
    from llmtool.edit.anchors import bare_batch, forward_replay
    from llmtool.edit.layerio import capture_at, down_proj
    from llmtool.edit.memit import METHODS, EditConfig, edit_batch

    m = _model64(tiny4)
    reqs = [_req(), _req(subject="Italy", target_new="Paris")]
    layers = [1, 2, 3]
    batch, pos = bare_batch(tok, reqs, "cpu")
    clean = capture_at(m, batch, pos, layers, "out")
    targets = forward_replay(m, tok, reqs, clean[1], layers)
    for l in layers:
        assert torch.equal(targets[l], clean[l].float()) or (targets[l] - clean[l]).abs().max() < 1e-12
    before = {l: down_proj(m, l).weight.clone() for l in layers}
    cfg = EditConfig(layers=layers, anchor="forward")
    C = {l: torch.eye(128, dtype=torch.float64) for l in layers}
    solvers = {l: METHODS.get("memit")(C[l], cfg) for l in layers}
    prev = {l: torch.zeros(128, 128, dtype=torch.float64) for l in layers}
    rep = edit_batch(m, tok, reqs, cfg, ["{}"], solvers, prev, targets={l: t.double() for l, t in targets.items()})
    for l in layers:
        assert torch.equal(down_proj(m, l).weight, before[l])
    assert all(r["delta_fro"] == 0.0 and r["residual_fro"] == 0.0 for r in rep["layers"])


# ---------------------------------------------------------------- end to end (CLI)
def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


FAST = ["--mom2-samples", "512", "--v-steps", "30", "--v-lr", "0.5", "--clamp-norm", "4", "--mom2-weight", "1",
        "--v-weight-decay", "0", "--kl-factor", "0"]


def test_empty_request_set_leaves_model_unchanged(tmp_path, tiny4, tiny_text_file):
    from safetensors.torch import load_file

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run_cli("edit", "--method", "memit", "--anchor", "forward", "--layers", "1,2", str(tiny4),
                           str(empty), str(tmp_path / "out"), "--stats-corpus", str(tiny_text_file), *FAST)
    assert code == 0, err
    a, b = load_file(str(tiny4 / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method,anchor", [("memit", "forward")])
def test_single_edit_reaches_efficacy_one(tmp_path, tiny4, tiny_text_file, tok, method, anchor):
    from safetensors.torch import load_file

    from llmtool.core.models import load_model
    from llmtool.edit.evaluate_edits import pair_scores

    req = {"prompt": "The capital of {} is", "subject": "France", "target_new": "Rome", "target_true": "Paris",
           "neighborhood": [{"prompt": "The Eiffel Tower is in", "target": "Paris"}]}
    edits = _write(tmp_path / "one.jsonl", [req])
    out = tmp_path / "edited"
    code, _, err = run_cli("edit", "--method", method, "--anchor", anchor, "--layers", "1,2", str(tiny4), str(edits),
                           str(out), "--stats-corpus", str(tiny_text_file), "--nullspace-threshold", "1e-4", *FAST)
    assert code == 0, err
    m = load_model(out)
    (nll, _), (nll_true, _) = pair_scores(m, tok, [("The capital of France is", "Rome"),
                                                  ("The capital of France is", "Paris")])
    base = load_model(tiny4)
    (nll0, _), = pair_scores(base, tok, [("The capital of France is", "Rome")])
    assert nll < nll_true and nll < nll0  # efficacy success 1 (a random tiny model has a narrow logit range)
    a, b = load_file(str(tiny4 / "model.safetensors")), load_file(str(out / "model.safetensors"))
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed <= {"model.layers.1.mlp.down_proj.weight", "model.layers.2.mlp.down_proj.weight"} and changed
    assert all(a[k].dtype == b[k].dtype for k in a)
    manifest = json.loads((out / "edit_manifest.json").read_text())
    assert manifest["method"] == method and len(manifest["batches"][0]["layers"]) == 2
    code, stdout, err = run_cli("--json", "evaluate", "edits", str(out), str(edits), "--base", str(tiny4),
                                "--fluency-prompts", "1", "--fluency-tokens", "8")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["efficacy_success"] == 100.0 and res["requests"] == 1
    assert res["specificity_kl"] >= 0 and 0 <= res["top1_overlap"] <= 100  # neighbourhood metrics need --base
