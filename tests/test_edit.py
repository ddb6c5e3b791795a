"""Tests of `llmtool edit` (MEMIT / AlphaEdit, backward vs forward anchor) and `evaluate edits`."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import build_tokenizer, run_cli, run_cli_subprocess, save_tiny

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


FAST = ["--mom2-samples", "512", "--v-steps", "30", "--v-lr", "0.5", "--clamp-norm", "4",
        "--v-weight-decay", "0", "--kl-factor", "0"]
MEMIT_FAST = [*FAST, "--mom2-weight", "1"]


def test_empty_request_set_leaves_model_unchanged(tmp_path, tiny4, tiny_text_file):
    from safetensors.torch import load_file

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run_cli("edit", "--method", "memit", "--anchor", "forward", "--layers", "1,2", str(tiny4),
                           str(empty), str(tmp_path / "out"), "--calib-data", str(tiny_text_file), *MEMIT_FAST)
    assert code == 0, err
    a, b = load_file(str(tiny4 / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method,anchor", [("memit", "forward")])
def test_single_edit_reaches_efficacy_one(tmp_path, tiny4, tiny_text_file, tok, method, anchor):
    from safetensors.torch import load_file

    from llmtool.core.models import load_model
    from llmtool.edit.metrics import pair_scores

    req = {"prompt": "The capital of {} is", "subject": "France", "target_new": "Rome", "target_true": "Paris",
           "neighborhood": [{"prompt": "The Eiffel Tower is in", "target": "Paris"}]}
    edits = _write(tmp_path / "one.jsonl", [req])
    out = tmp_path / "edited"
    code, _, err = run_cli("edit", "--method", method, "--anchor", anchor, "--layers", "1,2", str(tiny4), str(edits),
                           str(out), "--calib-data", str(tiny_text_file),
                           *(["--nullspace-threshold", "1e-4"] if method == "alphaedit" else []),
                           *(MEMIT_FAST if method == "memit" else FAST))
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
    assert manifest["preset"] == "generic" and manifest["config"]["mom2_update_weight"] == 1.0  # flag beats preset
    code, stdout, err = run_cli("--json", "evaluate", "edits", str(out), str(edits), "--base", str(tiny4),
                                "--fluency-prompts", "1", "--fluency-tokens", "8")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["efficacy_success"] == 100.0 and res["requests"] == 1
    assert res["specificity_kl"] >= 0 and 0 <= res["top1_overlap"] <= 100  # neighbourhood metrics need --base


# ---------------------------------------------------------------- spreading bookkeeping (spec test 4)
def test_backward_spreading_bookkeeping_on_synthetic_stack(tiny4, tok):
    """Blocks after the first edited layer add nothing except through the edited down_proj:
    attention outputs of the edited layers are zeroed and the later down_projs start at zero.
    With one request, lambda = 0 and the minimum-norm solver, MEMIT's divided residuals each move
    h_L by a third of the gap; both anchors end with h_L = z_L; under FE every later residual is 0."""
    from llmtool.core.models import decoder_layers
    from llmtool.edit.anchors import forward_replay
    from llmtool.edit.layerio import down_proj
    from llmtool.edit.memit import METHODS, EditConfig, edit_batch, hidden_at

    layers = [1, 2, 3]
    req = [_req()]
    results = {}
    for anchor in ("backward", "forward"):
        m = _model64(tiny4)
        with torch.no_grad():
            for l in layers:
                decoder_layers(m)[l].self_attn.o_proj.weight.zero_()
            for l in layers[1:]:
                down_proj(m, l).weight.zero_()
        h = hidden_at(m, tok, req, layers)
        assert torch.allclose(h[1], h[3], atol=1e-12)  # the stack really is transparent after layer 1
        delta = torch.randn(1, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        if anchor == "backward":
            targets = {3: h[3] + delta}
        else:
            targets = {l: t.double() for l, t in forward_replay(m, tok, req, h[1] + delta, layers).items()}
            assert all(torch.allclose(targets[l], h[1] + delta, atol=1e-12) for l in layers)
        cfg = EditConfig(layers=layers, anchor=anchor, mom2_update_weight=0.0, solver="pinv")
        C = {l: torch.eye(128, dtype=torch.float64) for l in layers}
        solvers = {l: METHODS.get("memit")(C[l], cfg) for l in layers}
        prev = {l: torch.zeros(128, 128, dtype=torch.float64) for l in layers}
        rep = edit_batch(m, tok, req, cfg, ["{}"], solvers, prev, targets=targets)
        final = hidden_at(m, tok, req, [3])[3]
        assert (final - (h[3] + delta)).abs().max() < 1e-8
        results[anchor] = rep["layers"]
    gap = float(delta.norm())
    bw = results["backward"]
    assert [round(r["remaining_residual_ratio"], 8) for r in bw] == [round(2 / 3, 8), round(1 / 3, 8), 0.0]
    assert all(abs(r["residual_fro"] - gap / 3) < 1e-8 for r in bw)  # thirds that sum to the full gap
    fw = results["forward"]
    assert abs(fw[0]["residual_fro"] - gap) < 1e-8
    assert all(r["residual_fro"] < 1e-8 for r in fw[1:]) and all(r["remaining_residual_ratio"] < 1e-8 for r in fw)


# ---------------------------------------------------------------- convergence (spec test 7)
def test_forward_anchor_residual_ratio_falls_and_ends_below_memit(tiny4, tok):
    from llmtool.edit.anchors import ZConfig
    from llmtool.edit.memit import METHODS, EditConfig, compute_targets, edit_batch

    torch.manual_seed(0)
    subjects = ["France", "Italy", "Spain", "Peru", "Chile", "Japan", "Egypt", "Kenya"]
    news = ["Rome", "Oslo", "Lima", "Cairo", "Paris", "Quito", "Tokyo", "Seoul"]
    reqs = [_req(subject=s, target_new=t) for s, t in zip(subjects, news)]
    layers = [0, 1, 2]  # layer 3's attention carries the subject-token edit to the target positions
    templates = ["{}", "The day. {}", "Because of it. {}"]
    zcfg = ZConfig(v_lr=0.5, v_num_grad_steps=20, clamp_norm_factor=4.0, kl_factor=0.0, v_weight_decay=0.0)
    g = torch.Generator().manual_seed(2)
    X = torch.randn(128, 2000, generator=g, dtype=torch.float64)
    ratios = {}
    for anchor in ("backward", "forward"):
        m = _model64(tiny4)
        cfg = EditConfig(layers=layers, anchor=anchor, z=zcfg, mom2_update_weight=0.01)
        solvers = {l: METHODS.get("memit")(X @ X.T / 2000, cfg) for l in layers}
        prev = {l: torch.zeros(128, 128, dtype=torch.float64) for l in layers}
        targets, _ = compute_targets(m, tok, reqs, cfg, templates)
        rep = edit_batch(m, tok, reqs, cfg, templates, solvers, prev, targets=targets)
        ratios[anchor] = [r["remaining_residual_ratio"] for r in rep["layers"]]
    fw, bw = ratios["forward"], ratios["backward"]
    assert all(b <= a + 1e-9 for a, b in zip(fw, fw[1:])), fw
    assert fw[-1] < bw[-1], (fw, bw)


# ---------------------------------------------------------------- batched target optimisation
def test_batched_compute_z_equals_one_request_at_a_time(tiny4, tok):
    """Several requests optimised in one padded batch give each request's own result, including
    one that stops early while the others keep going."""
    from llmtool.edit.anchors import ZConfig, compute_z, compute_z_batch

    m = _model64(tiny4)
    reqs = [_req(), _req(subject="Italy is a good", target_new="Paris"), _req(subject="Peru", target_new="Lima x")]
    templates = ["{}", "The day. {}"]
    base = ZConfig(v_lr=0.2, v_num_grad_steps=12, clamp_norm_factor=4.0, kl_factor=0.1, v_weight_decay=1e-3)
    first = ZConfig(**{**base.__dict__, "v_num_grad_steps": 1})
    # an early-stop threshold halfway down the best request's loss curve: it stops mid-way while
    # the others (whose losses stay higher) run every step
    curves = [(compute_z(m, tok, r, 1, templates, first).loss, compute_z(m, tok, r, 1, templates, base).loss)
              for r in reqs]
    l0, lf = min(curves, key=lambda c: c[1])
    stop = ZConfig(**{**base.__dict__, "early_stop_loss": (l0 + lf) / 2})
    for cfg in (base, stop):
        one = [compute_z(m, tok, r, 1, templates, cfg) for r in reqs]
        many = compute_z_batch(m, tok, reqs, 1, templates, cfg)
        for a, b in zip(one, many):
            assert a.steps == b.steps and abs(a.loss - b.loss) < 1e-6
            assert (a.h_init - b.h_init).abs().max() < 1e-6 and (a.z - b.z).abs().max() < 1e-6
    assert len({r.steps for r in [compute_z(m, tok, r, 1, templates, stop) for r in reqs]}) > 1


# ---------------------------------------------------------------- presets
def test_presets_pick_layers_and_lambda_from_config(tiny4):
    from llmtool.core.checkpoint import read_config
    from llmtool.edit.presets import preset_for

    smol = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30}
    assert preset_for(smol).name == "smollm2-135m" and preset_for(smol).mom2_update_weight == 1500.0
    assert preset_for(smol).layers == (3, 4, 5, 6, 7)
    g = preset_for(read_config(tiny4))  # 4 layers, no measured preset
    assert g.name == "generic" and g.mom2_update_weight == 15000.0
    assert g.layers and max(g.layers) < 3  # never the last layer: its subject-token output reaches no later token
    deep = preset_for({"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 40})
    assert deep.layers == (4, 5, 6, 7, 8)
