"""GRPO / spurious rewards / SetPO: unit tests of the mechanisms and the CLI on a tiny random Llama."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from conftest import run_cli
from llmtool.core.console import UsageError

from llmtool.train import diversity, passk, rl_data
from llmtool.train.grpo import (GRPOSettings, GRPOTrainerLoop, group_advantages, token_surrogate, toy_bandit,
                                updates_per_phase)
from llmtool.train.rewards import REWARDS, make_reward_fn, majority_labels, marker_rate, parse_reward


# ------------------------------------------------------------------------------------ advantages / loss
def test_constant_groups_give_exact_zero_and_normalised_groups():
    r = torch.tensor([0.3] * 5 + [1.0, 0.0, 1.0, 1.0, 0.0] + [0.1 + 0.2] * 5)
    a = group_advantages(r, 5).view(3, 5)
    assert torch.equal(a[0], torch.zeros(5)) and torch.equal(a[2], torch.zeros(5))
    assert not torch.isnan(a).any()
    assert abs(a[1].sum().item()) < 1e-6 and abs(a[1].std().item() - 1) < 1e-6


def test_on_policy_clip_equals_unclipped_gradient():
    torch.manual_seed(0)
    logits = torch.randn(6, 9, 11, requires_grad=True)
    tok = torch.randint(0, 11, (6, 9))
    adv = torch.randn(6)
    grads = []
    for lt in ("clip", "ratio"):
        logp = torch.log_softmax(logits, -1).gather(-1, tok[..., None]).squeeze(-1)
        obj, st = token_surrogate(logp, logp.detach(), adv, lt)
        g, = torch.autograd.grad(obj.mean(), logits)
        grads.append(g)
        assert st["clip_low"].sum() == 0 and st["clip_high"].sum() == 0
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


@pytest.mark.parametrize("adv,old_shift,zero", [(1.0, -0.5, True), (1.0, 0.0, False), (-1.0, 0.5, True),
                                                  (-1.0, 0.0, False), (1.0, 0.5, False), (-1.0, -0.5, False)])
def test_case_table(adv, old_shift, zero):
    """Â>0 & ρ>1+ε → 0 gradient; Â<0 & ρ<1−ε → 0; otherwise the gradient is Â∇ρ (= ÂρVlogπ)."""
    lp = torch.tensor([-1.0], requires_grad=True)
    old = lp.detach() + old_shift   # ρ = exp(-old_shift): shift −0.5 → ρ≈1.65, +0.5 → ρ≈0.61
    obj, _ = token_surrogate(lp, old, torch.tensor([adv]), "clip", 0.2)
    g, = torch.autograd.grad(obj.sum(), lp)
    expect = 0.0 if zero else adv * math.exp(-old_shift)
    assert g.item() == pytest.approx(expect, abs=1e-7)


def test_upper_edge_unreachable_for_likely_tokens():
    """π_old ≥ 1/(1+ε) ⇒ ρ = π/π_old ≤ 1/π_old ≤ 1+ε for every θ: the upper clamp never activates."""
    g = torch.Generator().manual_seed(0)
    eps = 0.2
    for _ in range(200):
        old_logits = torch.randn(8, generator=g) * 3
        old_logits[0] += 6
        old_p = torch.softmax(old_logits, -1)[0]
        if old_p < 1 / (1 + eps):
            continue
        new = torch.softmax(torch.randn(8, generator=g) * 10, -1)[0]
        _, st = token_surrogate(new.log()[None], old_p.log()[None], torch.tensor([1.0]), "clip", eps)
        assert not st["clip_high"].any()


def test_pi_loss_gradient_is_prob_times_adv_score():
    lp = torch.tensor([-0.7], requires_grad=True)
    obj, _ = token_surrogate(lp, torch.tensor([-3.0]), torch.tensor([2.0]), "pi")
    g, = torch.autograd.grad(obj.sum(), lp)
    assert g.item() == pytest.approx(2.0 * math.exp(-0.7), rel=1e-6)   # independent of π_old


def test_update_counting():
    assert updates_per_phase(64 * 16, 128) == 8
    assert updates_per_phase(64 * 16, 1024) == 1
    assert updates_per_phase(8 * 16, 128) == 1


def test_toy_bandit_clipping_bias_small():
    """The mechanism on few seeds: clipping keeps/grows the prior arm, ratio-no-clip drifts away."""
    seeds = range(12)
    clip = toy_bandit("clip", seeds=seeds, iterations=80)
    noclip = toy_bandit("ratio", seeds=seeds, iterations=80)
    mc = sum(clip["prior"]) / 12
    mn = sum(noclip["prior"]) / 12
    assert mc > clip["start_prior"] and mc - mn > 0.15


# ------------------------------------------------------------------------------------ rewards
def test_random_reward_rate_and_seed():
    cfg = parse_reward("random:0.3")
    draws = [cfg.score({}, "", "stop", (0, 0, i, 0)) for i in range(10_000)]
    rate = sum(draws) / len(draws)
    assert abs(rate - 0.3) < 3 * math.sqrt(0.3 * 0.7 / 10_000)
    assert draws == [cfg.score({}, "x", "stop", (0, 0, i, 0)) for i in range(10_000)]   # ignores the text
    other = [cfg.score({}, "", "stop", (1, 0, i, 0)) for i in range(200)]
    assert other != draws[:200]


def test_verifier_format_incorrect_and_parse_errors():
    from llmtool.core.console import UsageError

    row = {"prompt": "What is 7 + 5?", "answer": "12"}
    gt = parse_reward("ground-truth")
    assert gt.score(row, "7 + 5 = 12.", "stop", ()) == 1.0
    assert gt.score(row, "The answer is 12, not 13", "stop", ()) == 0.0   # last integer counts
    assert gt.score(row, "1,012? no: 12", "stop", ()) == 1.0
    inc = parse_reward("incorrect")
    rows = inc.prepare_rows([dict(row)])
    assert inc.score(rows[0], "= 13", "stop", ()) == 1.0 and inc.score(rows[0], "= 12", "stop", ()) == 0.0
    fmt = parse_reward("format")
    assert fmt.score(row, "no number", "stop", ()) == 0.0 and fmt.score(row, "99", "stop", ()) == 1.0
    assert parse_reward("format:python").score(row, "use Python", "stop", ()) == 1.0
    one = parse_reward("one-shot:1")
    assert one.prepare_rows([{"a": 1}, {"b": 2}]) == [{"b": 2}]
    for bad in ("nope", "random:2", "random:x", "ground-truth:3"):
        with pytest.raises(UsageError):
            parse_reward(bad)
    assert set(REWARDS.names()) >= {"ground-truth", "majority-vote", "format", "random", "incorrect", "one-shot"}


def test_majority_labels_and_marker():
    rows = [{"prompt": "p", "answer": "4"}]
    lab = majority_labels(rows, [["= 4", "is 5", "5", "x"]])
    assert lab[0]["mv_label"] == "5" and lab[0]["mv_correct"] is False
    assert marker_rate(["a = b", "A=B", "none"], "=") == pytest.approx(2 / 3)


def test_sum_two_task_verifier():
    row = rl_data.make_sum_two(1, seed=3)[0]
    N = row["n"]
    assert rl_data.is_correct(row, f"{N} = 1 + {N - 1}")
    assert not rl_data.is_correct(row, f"0 + {N}")
    assert rl_data.extract_answer(row, f"{N - 2} + 2") == rl_data.extract_answer(row, f"2 + {N - 2}")


# ------------------------------------------------------------------------------------ SetPO
def test_logdet_closed_form_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for G in range(2, 13):
        X = torch.randn(G, 5, generator=g, dtype=torch.float64)
        K = diversity.rbf_kernel(X)
        c = diversity.logdet_contributions(K, 0.7)
        full = diversity.logdet_diversity(K, 0.7)
        for i in range(G):
            keep = [j for j in range(G) if j != i]
            assert c[i].item() == pytest.approx(full - diversity.logdet_diversity(K[keep][:, keep], 0.7), abs=1e-10)


def test_rarity_monotone_and_diminishing_returns():
    base = torch.zeros(6, 3, dtype=torch.float64)
    base[:5, 0] = torch.linspace(0, 0.01, 5)
    contribs = []
    for d in (0.05, 0.2, 0.5, 1.0, 2.0):
        X = base.clone()
        X[5, 1] = d
        K = diversity.cosine_kernel(X + torch.tensor([1.0, 0, 0], dtype=torch.float64))
        contribs.append(diversity.logdet_contributions(K)[5].item())
        Kp = torch.exp(-torch.cdist(X, X).pow(2))
        contribs_pw = diversity.pairwise_contributions(Kp)
        assert contribs_pw[5] >= contribs_pw[:5].max() - 1e-12
    assert all(b > a for a, b in zip(contribs, contribs[1:])) and contribs[-1] <= math.log(2) + 1e-12
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        X = torch.randn(8, 4, generator=g, dtype=torch.float64)
        K = diversity.cosine_kernel(X)
        S = [0, 1, 2, 3]
        T = [0, 1, 2, 3, 4, 5, 6]
        cs = diversity.logdet_contributions(K[S][:, S])[0]
        ct = diversity.logdet_contributions(K[T][:, T])[0]
        assert cs >= ct - 1e-12


def test_setpo_scope_normalisation_and_neutral_cases():
    sh = SHAPER = diversity.SetPOShaper(div_coef=0.5)
    phi = torch.randn(6, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    r = torch.tensor([1.0, 1, 0, 1, 0, 1])
    b, info = sh.bonus(phi, r, [False] * 6)
    assert torch.all(b[r == 0] == 0) and info["eligible"] == 4
    assert abs(b[r == 1].mean().item()) < 1e-9 and abs(b[r == 1].std(unbiased=False).item() - 1) < 1e-4
    same = torch.ones(6, 4, dtype=torch.float64)
    assert torch.equal(sh.bonus(same, r, [False] * 6)[0], torch.zeros(6, dtype=torch.float64))
    one = torch.tensor([1.0, 0, 0, 0, 0, 0])
    assert torch.equal(sh.bonus(phi, one, [False] * 6)[0], torch.zeros(6, dtype=torch.float64))
    # truncated rollouts are never eligible
    assert sh.bonus(phi, r, [True, True, False, True, False, False])[1]["eligible"] == 1
    del SHAPER


def test_all_correct_group_rewards_the_rarest():
    class R:
        def __init__(self, t):
            self.text, self.finish = t, "stop"
    texts = ["5 + 5", "5 + 5", "5 + 5", "3 + 7 is my answer, a different way"]
    rs = [R(t) for t in texts]
    rewards = torch.ones(4)
    adv = group_advantages(rewards, 4)
    shaped = diversity.SetPOShaper(div_coef=0.2)(rs, rewards, adv, 4, {})
    assert torch.equal(adv, torch.zeros(4)) and shaped[3] > 0 and shaped[3] == shaped.max()
    assert torch.equal(diversity.SetPOShaper(div_coef=0.0)(rs, rewards, adv, 4, {}), adv)


# ------------------------------------------------------------------------------------ pass@k
def test_pass_at_k_matches_enumeration():
    for n, c in [(6, 0), (6, 2), (6, 6), (7, 3)]:
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            exact = sum(any(i < c for i in s) for s in subsets) / len(subsets)
            assert passk.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    assert passk.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    rows = [{"prompt": "p", "answer": "2"}]
    s = passk.score_samples(rows, [["2", "2", "3", "x"]], ks=(1, 2, 4))["summary"]
    assert s["pass@4"] == 1.0 and s["distinct_correct"] == 1 and s["pass@1"] == 0.5


# ------------------------------------------------------------------------------------ the loop on a tiny model
def _loop(tiny_dir, shaper=None, reward="ground-truth", steps=2, **kw):
    from llmtool.core.models import load_model, load_tokenizer

    torch.manual_seed(0)
    m, tok = load_model(tiny_dir), load_tokenizer(tiny_dir)
    s = GRPOSettings(steps=steps, group_size=4, prompts_per_rollout=2, mini_batch=4, micro_batch=4, lr=1e-3,
                     max_new_tokens=6, **kw)
    rows = rl_data.make_arith(8, seed=1)
    cfg = parse_reward(reward)
    loop = GRPOTrainerLoop(m, tok, rows, s, make_reward_fn(cfg, 0), shaper=shaper)
    return loop


def _weights(loop):
    return {k: v.detach().clone() for k, v in loop.acc.unwrap_model(loop.model).state_dict().items()}


def test_setpo_lambda_zero_is_grpo_bit_for_bit_and_counts_updates(tiny_llama_dir):
    a = _loop(tiny_llama_dir, diversity.GRPOShaper(), reward="random:0.5", steps=1)
    hist = a.train(progress_desc=None)
    assert a.step == 2 and len(hist) == 2   # 8 rollouts / mini-batch 4 = 2 updates per phase
    assert hist[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # first update of a phase is on-policy
    b = _loop(tiny_llama_dir, diversity.SetPOShaper(div_coef=0.0, div_scope="all"), reward="random:0.5", steps=1)
    b.train(progress_desc=None)
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    c = _loop(tiny_llama_dir, diversity.SetPOShaper(div_coef=1.0, div_scope="all", div_keep_truncated=True),
              reward="random:0.5", steps=1)
    c.train(progress_desc=None)
    wc = _weights(c)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_constant_reward_leaves_weights_unchanged(tiny_llama_dir):
    loop = _loop(tiny_llama_dir, reward="random:0", steps=1)
    before = _weights(loop)
    hist = loop.train(progress_desc=None)
    after = _weights(loop)
    assert hist[0]["zero_std_groups"] == 1.0
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_grad_clip_policies_plug_into_the_loop(tiny_llama_dir, tmp_path):
    """--grad-clip none equals --max-grad-norm 0 bit for bit; adagc records its clip fraction and its state
    survives a checkpoint round trip."""
    a = _loop(tiny_llama_dir, reward="random:0.5", steps=1, grad_clip="none")
    a.train(progress_desc=None)
    b = _loop(tiny_llama_dir, reward="random:0.5", steps=1, max_grad_norm=0.0)
    b.train(progress_desc=None)
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    c = _loop(tiny_llama_dir, reward="random:0.5", steps=1, grad_clip="adagc")
    hist = c.train(progress_desc=None)
    assert all(0.0 <= r["grad_clip_fraction"] <= 1.0 for r in hist)
    state = c.clipper.state_dict()
    ckpt = c.save_checkpoint(tmp_path / "ck")
    d = _loop(tiny_llama_dir, reward="random:0.5", steps=1, grad_clip="adagc")
    d.load_checkpoint(ckpt)
    assert d.clipper.state_dict() == state and d.step == c.step
    with pytest.raises(UsageError, match="--grad-clip"):
        GRPOSettings(grad_clip="nope").validate()


# ------------------------------------------------------------------------------------ chunked log-probs
class _AllocTracker:
    """Every tensor produced inside the block (forward and backward): the largest element count and the
    peak of live bytes of the storages created there (pre-existing weights excluded)."""

    def __enter__(self):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.largest, self.peak, self.live = 0, 0, {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        tracker.largest = max(tracker.largest, t.numel())
                        tracker.live.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))
                tracker.live = {k: v for k, v in tracker.live.items() if not v[0].expired()}
                tracker.peak = max(tracker.peak, sum(v[1] for v in tracker.live.values()))
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *a):
        return self.mode.__exit__(*a)


def test_chunked_logps_equal_full_and_never_build_the_full_logits():
    from conftest import build_tiny_llama

    from llmtool.train.grpo import sequence_logps

    V, B, T = 4096, 2, 96
    m = build_tiny_llama(V, hidden_size=32, intermediate_size=64).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (B, T), generator=g)
    att = torch.ones_like(ids)
    att[1, 70:] = 0
    res = {}
    for chunk in (0, 8, None, 1000):
        m.zero_grad()
        with _AllocTracker() as tr:
            o = sequence_logps(m, ids, att, 0.7, with_entropy=True, chunk=chunk)
            (o["logp"].sum() - 0.3 * o["entropy"].sum()).backward()
        res[chunk] = (o["logp"].detach(), o["entropy"].detach(), tr,
                      {n: p.grad.clone() for n, p in m.named_parameters()})
    lp0, ent0, tr0, g0 = res[0]
    full = B * (T - 1) * V
    assert tr0.largest >= full                                # the reference does build [B, T-1, V]
    for chunk in (8, None, 1000):
        lp, ent, tr, gr = res[chunk]
        assert torch.allclose(lp, lp0, rtol=1e-5, atol=2e-5) and torch.allclose(ent, ent0, rtol=1e-5, atol=2e-5)
        for n in g0:
            assert torch.allclose(gr[n], g0[n], rtol=1e-4, atol=1e-5), n
    lp, ent, tr8, _ = res[8]
    assert tr8.largest < full / 4                             # no [B, T-1, V] tensor exists on the chunked path
    assert tr8.peak < tr0.peak / 3, (tr8.peak, tr0.peak)      # measured: ~3.4 MB against ~17 MB
    assert res[1000][2].largest >= full                       # one chunk spanning the sequence is the full size


def test_chunked_logps_fall_back_when_the_head_is_not_the_models():
    """A model whose logits are not ``lm_head(hidden_states[-1])`` (here: a scaled head) is detected by the
    last-position check and computed on the full path, so the result is still right."""
    from conftest import build_tiny_llama

    from llmtool.train.grpo import sequence_logps

    m = build_tiny_llama(64)
    real = m.forward

    def scaled(*a, **k):
        out = real(*a, **k)
        out.logits = out.logits * 2.0
        return out

    m.forward = scaled
    ids = torch.randint(1, 64, (2, 9))
    att = torch.ones_like(ids)
    with torch.no_grad():
        a = sequence_logps(m, ids, att, chunk=3)["logp"]
        b = sequence_logps(m, ids, att, chunk=0)["logp"]
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ resume without pickle
def test_trainer_state_round_trip_is_safetensors_and_json(tiny_llama_dir, tmp_path):
    a = _loop(tiny_llama_dir, reward="random:0.5", steps=1)
    a.train(progress_desc=None)
    ck = a.save_checkpoint(tmp_path / "ck")
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("trainer_state")) == \
        ["trainer_state.json", "trainer_state.safetensors"]
    b = _loop(tiny_llama_dir, reward="random:0.5", steps=2)
    b.load_checkpoint(ck)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and b.phase == a.phase and b.step == a.step
    for k in sa["state"]:
        for name, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][name]), (k, name)
    assert b.history == a.history
    import llmtool.train.grpo as G

    src = open(G.__file__).read()
    assert "torch.load" not in src and "pickle.load" not in src and "weights_only" not in src


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # creates the marker file if anything ever unpickles it
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("with_state", [False, True])
def test_cli_resume_refuses_a_planted_pickle_without_loading_it(tiny_llama_dir, tmp_path, with_state):
    import pickle
    import shutil

    out = tmp_path / "run"
    ck = tmp_path / "run.checkpoints" / "checkpoint-1"
    if with_state:   # a genuine checkpoint of this llmtool with a pickle planted beside its state
        loop = _loop(tiny_llama_dir, reward="random:0.5", steps=1)
        loop.train(progress_desc=None)
        loop.save_checkpoint(ck.parent)
    else:            # the old format: weights + trainer_state.pt
        ck.mkdir(parents=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy(tiny_llama_dir / f, ck / f)
    marker = tmp_path / "PWNED"
    (ck / "trainer_state.pt").write_bytes(pickle.dumps(_Payload(marker)))
    code, _, err = run_cli(*_grpo_args(tiny_llama_dir, out, "--reward", "random:0.5", "--save-every", "1",
                                       "--resume"))
    assert code == 2 and "pickle" in err and "trainer_state.pt" in err
    assert not marker.exists() and not out.exists()


def test_cli_resume_refuses_a_corrupt_state(tiny_llama_dir, tmp_path):
    loop = _loop(tiny_llama_dir, reward="random:0.5", steps=1)
    loop.train(progress_desc=None)
    ck = loop.save_checkpoint(tmp_path / "run.checkpoints")
    st = ck / "trainer_state.safetensors"
    st.write_bytes(st.read_bytes()[:-10])
    code, _, err = run_cli(*_grpo_args(tiny_llama_dir, tmp_path / "run", "--reward", "random:0.5",
                                       "--save-every", "1", "--resume"))
    assert code == 2 and "trainer_state.safetensors" in err
    from safetensors.torch import load_file, save_file

    loop.save_checkpoint(tmp_path / "run.checkpoints")        # rewrite it whole, then poison one Adam moment
    tensors = load_file(str(st))
    name = next(k for k, v in tensors.items() if v.is_floating_point() and v.numel() > 1)
    tensors[name][0] = float("nan")
    save_file(tensors, str(st), metadata={"format": "llmtool-grpo-trainer-state/1"})
    code, _, err = run_cli(*_grpo_args(tiny_llama_dir, tmp_path / "run", "--reward", "random:0.5",
                                       "--save-every", "1", "--resume"))
    assert code == 2 and "NaN" in err and name in err
    (ck / "trainer_state.safetensors").unlink()
    code, _, err = run_cli(*_grpo_args(tiny_llama_dir, tmp_path / "run", "--reward", "random:0.5",
                                       "--save-every", "1", "--resume"))
    assert code == 2 and "incomplete checkpoint" in err


def test_cli_rollout_endpoint_refuses_a_stale_multi_phase_run(tiny_llama_dir, tmp_path):
    ep = ("--rollout-endpoint", "http://127.0.0.1:9/v1", "--rollout-model", "m")
    code, _, err = run_cli(*_grpo_args(tiny_llama_dir, tmp_path / "o", *ep))   # --steps 2
    assert code == 2 and "initial policy" in err and "--engine trl" in err and not (tmp_path / "o").exists()
    code, _, err = run_cli(*_grpo_args(tiny_llama_dir, tmp_path / "o", "--allow-stale-rollouts"))
    assert code == 2 and "only with --rollout-endpoint" in err


# ------------------------------------------------------------------------------------ CLI
def _grpo_args(model, out, *extra):
    return ["train", "grpo", model, out, "--data", "gen:arith:8:1", "--steps", "2", "--group-size", "4",
            "--prompts-per-rollout", "2", "--mini-batch", "4", "--micro-batch", "4", "--max-new-tokens", "5",
            "--lr", "1e-3", *extra]


def test_cli_grpo_writes_model_metrics_and_resumes(tiny_llama_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    code, stdout, err = run_cli("--json", *_grpo_args(tiny_llama_dir, out, "--reward", "random:0.5",
                                                      "--advantage-shaping", "setpo", "--div-coef", "0.1"))
    assert code == 0, err
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and {"clip_frac", "kl", "entropy", "marker_freq"} <= set(recs[0])
    prov = json.loads((out / "llmtool.json").read_text())
    assert "setpo" in json.dumps(prov)
    assert (out / "config.json").is_file()
    full = {k: v for k, v in _st(out).items()}

    # interrupted run: crash in phase 2 after a checkpoint at phase 1, then resume → same weights
    out2 = tmp_path / "run2"
    import llmtool.train.grpo as G

    real = G.GRPOTrainerLoop.run_phase

    def boom(self):
        if self.phase == 1:
            raise RuntimeError("simulated crash")
        return real(self)

    monkeypatch.setattr(G.GRPOTrainerLoop, "run_phase", boom)
    try:
        code, _, _ = run_cli("--json", *_grpo_args(tiny_llama_dir, out2, "--reward", "random:0.5",
                                                   "--advantage-shaping", "setpo", "--div-coef", "0.1",
                                                   "--save-every", "1"))
    except RuntimeError:
        code = -1
    assert code != 0
    monkeypatch.setattr(G.GRPOTrainerLoop, "run_phase", real)
    assert not out2.exists() and (tmp_path / "run2.checkpoints" / "checkpoint-1").is_dir()
    code, _, err = run_cli("--json", *_grpo_args(tiny_llama_dir, out2, "--reward", "random:0.5",
                                                 "--advantage-shaping", "setpo", "--div-coef", "0.1",
                                                 "--save-every", "1", "--resume"))
    assert code == 0, err
    resumed = _st(out2)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert len((out2 / "metrics.jsonl").read_text().splitlines()) == 4
    assert not (tmp_path / "run2.checkpoints").exists()


def _st(d):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


@pytest.mark.parametrize("extra,needle", [
    (("--reward", "nope"), "unknown reward"),
    (("--group-size", "1"), "G >= 2"),
    (("--div-coef", "0.1"), "does not apply"),
    (("--resume",), "no complete checkpoint"),
])
def test_cli_bad_input(tiny_llama_dir, tmp_path, extra, needle):
    args = _grpo_args(tiny_llama_dir, tmp_path / "o", *extra)
    code, _, err = run_cli(*args)
    assert code == 2 and needle in err and not (tmp_path / "o").exists()


def test_cli_bad_data_and_not_causal(tiny_llama_dir, tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"prompt": "What is 1+1?", "answer": "2"}\n{"prompt": "no answer"}\n')
    args = _grpo_args(tiny_llama_dir, tmp_path / "o")
    args[args.index("--data") + 1] = str(bad)
    code, _, err = run_cli(*args)
    assert code == 2 and "d.jsonl:2" in err and "answer" in err
    # a random reward needs no answer
    args += ["--reward", "random", "--steps", "1"]
    code, _, err = run_cli(*args)
    assert code == 0, err
    enc = tmp_path / "enc"
    enc.mkdir()
    (enc / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    code, _, err = run_cli(*_grpo_args(str(enc), tmp_path / "o2"))
    assert code == 2 and "causal" in err


def test_cli_eval_passk_and_rl_data(tiny_llama_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    code, _, err = run_cli("train", "rl-data", "--task", "sum-two", "--n", "3", "-o", data)
    assert code == 0, err and len(data.read_text().splitlines()) == 3
    res = tmp_path / "p.json"
    code, _, err = run_cli("train", "eval-passk", tiny_llama_dir, "--data", data, "--n", "4", "--k", "1,2,4",
                           "--max-new-tokens", "4", "-o", res)
    assert code == 0, err
    summ = json.loads(res.read_text())["summary"]
    assert {"pass@1", "pass@4", "greedy_pass@1", "distinct_correct", "answer_entropy"} <= set(summ)
    code, _, err = run_cli("train", "eval-passk", tiny_llama_dir, "--data", data, "--n", "2", "--k", "4")
    assert code == 2 and "n >= max k" in err


# ------------------------------------------------------------------------------------ benchmark: clip ablation
def _spurious_runs(clip_frac, mk_clip, mk_no_clip):
    def arm(marks):
        return {"per_seed": [{"seed": i, "clip_frac": clip_frac,
                              "eval": {"marker_freq": m, "pass@1": 0.5, "ok": [1, 0, i % 2], "marker": [1, int(m > 0.5), 0]}}
                             for i, m in enumerate(marks)]}

    return {"base": {"marker_freq": 0.5}, "arms": {"random": arm(mk_clip), "random+ratio-no-clip": arm(mk_no_clip)}}


@pytest.mark.parametrize("clip_frac,mc,want", [
    (0.005, [0.6, 0.7, 0.8], ("not tested", "not tested")),   # the clip does not bind: same algorithm
    (0.25, [0.6, 0.7, 0.8], ("not tested", "not tested")),    # binds on > 10 %: outside the range
    (0.03, [0.7, 0.75, 0.8], ("met", "met")),                 # every seed well above: interval above 0
    (0.03, [0.6, 0.7, 0.8], ("met", "not met")),              # every seed higher, but 3 seeds: t interval spans 0
    (0.03, [0.9, 0.3, 0.8], ("met", "not met")),              # mean higher, interval spans 0
    (0.03, [0.4, 0.5, 0.45], ("not met", "not met")),
])
def test_clip_gates_need_binding_clip_and_separate_direction_from_interval(clip_frac, mc, want):
    from conftest import load_benchmark

    grpo = load_benchmark("train_grpo")
    gs = grpo.clip_gates(_spurious_runs(clip_frac, mc, [0.5, 0.5, 0.5]))
    assert tuple(g["verdict"] for g in gs) == want
    if want[0] != "not tested":
        m = gs[0]["measured"]
        assert m["diff"] == pytest.approx(sum(mc) / 3 - 0.5) and m["seeds_clip_higher"] == f"{sum(x > 0.5 for x in mc)}/3"


def test_clip_contrasts_pair_by_seed_and_by_item():
    from conftest import load_benchmark

    grpo = load_benchmark("train_grpo")
    s = _spurious_runs(0.03, [0.6, 0.7, 0.8], [0.5, 0.5, 0.5])
    s["arms"]["random+ratio-no-clip"]["per_seed"].reverse()  # pairing is by seed, not by position
    c = grpo.clip_contrasts(s)["random - random+ratio-no-clip"]
    assert c["marker_by_seed"]["per_seed"] == pytest.approx([0.1, 0.2, 0.3])
    assert c["pass@1_by_seed"]["diff"] == 0.0 and c["pass@1_items"]["diff"] == 0.0
    assert c["marker_items"]["pairs"] == 9 and c["marker_items"]["diff"] == pytest.approx(3 / 9)
    lo, hi = c["marker_by_seed"]["ci95"]
    assert lo == pytest.approx(0.2 - 4.303 * 0.1 / 3 ** 0.5, abs=1e-3) and hi == pytest.approx(0.4 - lo)


# ------------------------------------------------------------------------------------ diversity benchmark (issue 43)
def _div_bench():
    from conftest import load_benchmark

    return load_benchmark("train_grpo")


def test_diversity_arms_sweep_lambda_and_keep_old_names():
    b = _div_bench()
    assert b.div_arm("setpo", 0.1) == ("setpo", {"div_coef": 0.1}, {})
    assert b.div_arm("setpo@0.3", 0.1) == ("setpo", {"div_coef": 0.3}, {})
    assert b.div_arm("setpo@1", 0.1)[1] == {"div_coef": 1.0}
    assert b.div_arm("grpo", 0.5) == ("grpo", {}, {})
    assert b.div_arm("clip-higher", 0.1) == ("grpo", {}, {"clip_eps_high": 0.28})
    assert b.div_arm("entropy", 0.1)[2] == {"entropy_coef": 1e-3}
    assert b.div_arm("dra", 0.1)[0] == "dra"
    for bad in ("setpo@", "setpo@x", "setpo@-1", "grpo@0.3", "nope"):
        with pytest.raises(ValueError):
            b.div_arm(bad, 0.1)
    assert b.setpo_arms(["grpo", "setpo", "setpo@0.3", "entropy"]) == ["setpo", "setpo@0.3"]


def test_diversity_ks_range_and_protocol_of_the_committed_runs():
    import argparse

    b = _div_bench()
    assert b.div_ks(16) == [1, 2, 4, 8, 16] and b.div_ks(64) == [1, 2, 4, 8, 16, 32, 64] and b.div_ks(40)[-1] == 32
    a = argparse.Namespace(**{k: 1 for k in b.DIV_PROTOCOL}, sum_range="6,20")
    assert "sum_range" not in b.div_protocol(a, "x")  # the first protocol's records keep matching
    a.sum_range = "20,99"
    assert b.div_protocol(a, "x")["sum_range"] == [20, 99]
    rows = b.sum_two_rows(a, 50, seed=1)
    assert all(20 <= r["n"] <= 99 for r in rows) and rows == rl_data.make_sum_two(50, seed=1, lo=20, hi=99)
    a.sum_range = "6,20"
    assert b.sum_two_rows(a, 20, seed=4) == rl_data.make_sum_two(20, seed=4)
    for bad in ("5", "9,3", "a,b"):
        a.sum_range = bad
        with pytest.raises(SystemExit):
            b.sum_range(a)


def _div_res(per_problem_by_arm):
    """A diversity result: arm -> {seed: [(correct, distinct) per problem]} at n = 8."""
    arms = {}
    for name, seeds in per_problem_by_arm.items():
        per = [{"seed": s, "per_problem": pp} for s, pp in seeds.items()]
        arms[name] = {"per_seed": per}
    base = {"per_problem": [(4, 2)] * 3}
    return {"base": base, "arms": arms}


def test_diversity_contrasts_pair_only_common_seeds():
    b = _div_bench()
    res = _div_res({"grpo": {0: [(8, 1), (8, 1), (0, 0)], 1: [(0, 0), (0, 0), (0, 0)]},
                    "setpo@0.3": {0: [(8, 3), (8, 3), (8, 2)]}})
    c = b.diversity_contrasts(res, [1, 8], 8, draws=200)
    # seed 0 only: setpo solves the third problem that grpo never does
    assert c["setpo@0.3-grpo"]["pass@8"]["diff"] == pytest.approx(1 / 3)
    assert c["setpo@0.3-grpo"]["distinct_correct"]["diff"] == pytest.approx((2 + 2 + 2) / 3)
    assert c["grpo-base"]["pass@1"]["diff"] == pytest.approx((0.5 + 0.5 + 0) / 3 - 0.5)


def test_setpo_lambda_arms_get_gates_and_largest_k_direction_can_fail():
    b = _div_bench()

    def entry(p1, p8, p64):
        return {"pass@1": p1, "pass@8": p8, "pass@64": p64}

    d = {"arms": {"grpo": entry(0.5, 0.8, 0.9), "setpo@0.3": entry(0.5, 0.8, 0.85), "setpo@1.0": entry(0.5, 0.8, 1.0)},
         "paired": {"setpo@0.3-grpo": {"pass@1": {"diff": 0.0}, "pass@8": {"diff": 0.0}, "pass@64": {"diff": -0.05},
                                       "distinct_correct": {"diff": 0.2, "lo": 0.1, "hi": 0.3}},
                    "setpo@1.0-grpo": {"pass@1": {"diff": 0.0}, "pass@8": {"diff": 0.0}, "pass@64": {"diff": 0.1},
                                       "distinct_correct": {"diff": -0.2}}}}
    v = {g["gate"]: g for g in b.setpo_directions(d)}
    assert v["SetPO λ=0.3 pass@64 - GRPO >= 0"]["verdict"] == "not met"
    assert v["SetPO λ=1.0 pass@64 - GRPO >= 0"]["verdict"] == "met"
    assert v["SetPO λ=0.3 distinct correct - GRPO >= 0"]["measured"]["ci95"] == [0.1, 0.3]
    assert v["SetPO λ=1.0 distinct correct - GRPO >= 0"]["verdict"] == "not met"
    assert v["SetPO λ=0.3 pass@8 - GRPO >= -2 points"]["verdict"] == "met"


def test_setpo_gates_not_tested_when_the_bonus_never_fired():
    b = _div_bench()
    run = {"seed": 0, "per_problem": [[3, 1], [0, 0]], "train_reward": [0.0, 0.1]}
    arm = {"pass@1": 0.5, "pass@32": 0.9, "per_seed": [dict(run)]}
    d = {"arms": {"grpo": dict(arm), "setpo@1.0": dict(arm)},
         "paired": {"setpo@1.0-grpo": {"pass@1": {"diff": 0.0}, "pass@32": {"diff": 0.0},
                                       "distinct_correct": {"diff": 0.0}}}}
    v = {g["gate"]: g["verdict"] for g in b.setpo_directions(d)}
    assert set(v.values()) == {"not tested"} and "SetPO λ=1.0 pass@32 - GRPO >= 0" in v
    d["arms"]["setpo@1.0"] = {**arm, "per_seed": [{**run, "per_problem": [[3, 2], [0, 0]]}]}
    v = {g["gate"]: g["verdict"] for g in b.setpo_directions(d)}
    assert v["SetPO λ=1.0 pass@32 - GRPO >= 0"] == "met"
