"""Cross-check of our GRPO loss against TRL's GRPOTrainer (loss_type "grpo") on a fixed batch."""
from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_llama, build_tokenizer

from llmtool.train.grpo import aggregate, group_advantages, sequence_logps, token_surrogate


def test_loss_matches_trl_grpo_on_fixed_batch(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tok = build_tokenizer()
    model = build_tiny_llama(len(tok))
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=5, loss_type="grpo", beta=0.0, report_to=[], use_cpu=True,
                          epsilon=0.2, logging_steps=1)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                              args=args, train_dataset=Dataset.from_list([{"prompt": "a b"}] * 8),
                              processing_class=tok)
    torch.manual_seed(0)
    B, P, C = 4, 3, 5
    prompt_ids = torch.randint(1, len(tok), (B, P))
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    completion_ids = torch.randint(1, len(tok), (B, C))
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 3:] = 0
    completion_mask[2, 4:] = 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 4)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    att = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        cur = sequence_logps(model, ids, att)["logp"][:, P - 1:]
    old = cur + torch.randn(B, C) * 0.5          # ratios on both sides of the clip band
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1

    # both sides use the same forward (TRL's own forward differs from ours by ~1e-4 in log-prob through a
    # different attention path), so what is compared is the advantage → loss → gradient math
    def same_forward(model_, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
        out = sequence_logps(model_, input_ids, attention_mask, with_entropy=compute_entropy)
        ent = out["entropy"][:, -logits_to_keep:] if compute_entropy else None
        return out["logp"][:, -logits_to_keep:], ent, None

    trainer._get_per_token_logps_and_entropies = same_forward
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=adv, old_per_token_logps=old)
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_grad = torch.autograd.grad(trl_loss, model.model.embed_tokens.weight)[0]

    lp = sequence_logps(model, ids, att)["logp"][:, P - 1:]
    obj, st = token_surrogate(lp, old, adv, "clip", 0.2)
    mask = completion_mask.bool()
    ours = aggregate(-obj, mask, "seq-mean", B, int(mask.sum()), C)
    our_grad = torch.autograd.grad(ours, model.model.embed_tokens.weight)[0]
    assert (st["clip_low"] | st["clip_high"])[mask].any()   # the clamp is active somewhere in this batch
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-8)
    assert torch.allclose(our_grad, trl_grad, rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------------------------ --engine trl
@pytest.mark.parametrize("loss,agg,kl,eps_high", [("clip", "seq-mean", 0.0, None), ("clip", "token-mean", 0.1, 0.28), ("clip", "token-mean", 0.0, 0.28), ("clip", "token-mean", 0.0, None), ("clip", "seq-mean", 0.1, None),
                                                  ("ratio", "seq-sum-norm", 0.0, None), ("clip", "seq-sum-norm", 0.05, None)])
def test_engines_agree_on_a_fixed_batch(tmp_path, loss, agg, kl, eps_high):
    """The TRL engine as llmtool builds it (settings → GRPOConfig, llmtool's log-probs inside TRL) and the home
    loop's micro-batch loss give the same loss and gradients on one fixed batch of rollouts."""
    pytest.importorskip("trl")
    from llmtool.train import grpo_trl, rl_data
    from llmtool.train.grpo import GRPOSettings, Rollout, _pad_batch, rollout_loss
    from llmtool.train.rewards import parse_reward

    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    build_tiny_llama(len(tok)).save_pretrained(tmp_path / "m")   # TRL loads its KL reference from the path
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m").train()
    B, P, C = 4, 3, 5
    s = GRPOSettings(steps=1, group_size=4, prompts_per_rollout=1, mini_batch=4, micro_batch=4, lr=1e-3,
                     max_new_tokens=C, loss_type=loss, loss_agg=agg, kl_coef=kl, clip_eps=0.2, clip_eps_high=eps_high)
    trainer = grpo_trl.build_trainer(model, tok, rl_data.make_arith(4, seed=1), s, parse_reward("random:0.5"),
                                     output_dir=str(tmp_path / "trl"))
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(1, len(tok), (B, P), generator=g)
    completion_ids = torch.randint(1, len(tok), (B, C), generator=g)
    lengths = [5, 3, 4, 5]
    completion_mask = torch.zeros(B, C, dtype=torch.long)
    for i, n in enumerate(lengths):
        completion_mask[i, :n] = 1
        completion_ids[i, n:] = tok.pad_token_id
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 4)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    att = torch.cat([torch.ones(B, P, dtype=torch.long), completion_mask], 1)
    with torch.no_grad():
        cur = sequence_logps(model, ids, att)["logp"][:, P - 1:]
    old = cur + torch.randn(B, C, generator=g) * 0.5           # ratios on both sides of the clip band
    ref = cur + torch.randn(B, C, generator=g) * 0.3
    rollouts = []
    for i, n in enumerate(lengths):
        r = Rollout(0, {}, prompt_ids[i].tolist(), completion_ids[i, :n].tolist(), "", "length", advantage=float(adv[i]))
        r.extra["old_logp"], r.extra["ref_logp"] = old[i, :n], ref[i, :n]
        rollouts.append(r)
    hids, hatt, resp = _pad_batch(rollouts, tok.pad_token_id)
    assert torch.equal(hids, ids) and torch.equal(hatt, att)
    home, _, st, _ = rollout_loss(model, rollouts, hids, hatt, resp, s, B, sum(lengths), use_ref=kl > 0)
    home_grad = torch.autograd.grad(home, list(model.parameters()))

    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones(B, P, dtype=torch.long), completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=adv, old_per_token_logps=old,
                  num_items_in_batch=completion_mask.sum())
    if kl > 0:
        inputs["ref_per_token_logps"] = ref
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_grad = torch.autograd.grad(trl_loss, list(model.parameters()))
    if loss == "clip":
        assert (st["clip_low"] | st["clip_high"])[resp].any()  # the clamp binds somewhere in this batch
    assert home.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-7)
    for a, b in zip(home_grad, trl_grad):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_cli_engine_trl_trains_writes_one_output_and_refuses_what_it_cannot_map(tiny_llama_dir, tmp_path):
    pytest.importorskip("trl")
    import json

    from conftest import run_cli

    base = ["train", "grpo", tiny_llama_dir, None, "--data", "gen:arith:8:1", "--steps", "2", "--group-size", "4",
            "--prompts-per-rollout", "2", "--mini-batch", "4", "--micro-batch", "2", "--max-new-tokens", "5",
            "--lr", "1e-3", "--reward", "random:0.5", "--engine", "trl"]

    def args(out, *extra):
        a = list(base)
        a[3] = out
        return [*a, *extra]

    out = tmp_path / "trl-run"
    code, stdout, err = run_cli("--json", *args(out))
    assert code == 0, err
    assert json.loads(stdout)["engine"] == "trl"                 # stdout is only the JSON summary
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and [r["phase"] for r in recs] == [0, 0, 1, 1]
    assert "reward_mean" in recs[0] and "clip_frac" in recs[1]
    prov = json.loads((out / "llmtool.json").read_text())
    assert prov["parameters"]["engine"] == "trl" and prov["metrics"]["engine"] == "trl"
    assert not (out / "trl-scratch").exists() and (out / "model.safetensors").is_file()
    from safetensors.torch import load_file

    w0, w1 = load_file(str(tiny_llama_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)      # it trained
    for extra, needle in [(("--loss", "pi"), "--loss pi"), (("--advantage-shaping", "setpo"), "advantage shaping"),
                          (("--entropy-coef", "0.1"), "entropy"), (("--save-every", "1"), "pickle"),
                          (("--grad-clip", "adagc"), "--grad-clip"), (("--micro-batch", "3"), "multiple"),
                          (("--vllm", "server"), "vLLM is not installed"),
                          (("--rollout-endpoint", "http://x/v1", "--rollout-model", "m"), "--vllm server")]:
        o = tmp_path / "refused"
        code, _, err = run_cli(*args(o, *extra))
        assert code == 2 and needle in err, (extra, err)
        assert not o.exists()
    code, _, err = run_cli(*args(tmp_path / "r2")[:-2], "--vllm", "colocate")
    assert code == 2 and "only with --engine trl" in err


def test_settings_map_onto_grpo_config(tmp_path):
    trl = pytest.importorskip("trl")
    import math

    from llmtool.train import grpo_trl
    from llmtool.train.grpo import GRPOSettings

    s = GRPOSettings(steps=3, group_size=8, prompts_per_rollout=4, mini_batch=16, micro_batch=4, loss_type="ratio",
                     loss_agg="token-mean", kl_coef=0.02, clip_eps_high=0.28)
    kw = grpo_trl.grpo_config_kwargs(s, output_dir=str(tmp_path))
    cfg = trl.GRPOConfig(**kw)
    assert cfg.generation_batch_size == 32 and cfg.num_generations == 8          # P·G rollouts per phase
    assert cfg.gradient_accumulation_steps * cfg.per_device_train_batch_size == 16  # one optimizer step = M
    assert cfg.max_steps == 3 * 2 and cfg.loss_type == "dapo" and cfg.beta == 0.02
    assert math.isinf(cfg.epsilon) and math.isinf(cfg.epsilon_high)              # ratio: the clamp never binds
    assert not cfg.use_bias_correction_kl and not cfg.bf16 and cfg.disable_dropout and kw["save_strategy"] == "no"
    s.loss_type = "clip"
    kw = grpo_trl.grpo_config_kwargs(s, output_dir=str(tmp_path), vllm="server", vllm_server_url="http://h:8000")
    assert (kw["epsilon"], kw["epsilon_high"]) == (0.2, 0.28) and kw["use_vllm"] and kw["vllm_mode"] == "server"
    assert kw["vllm_server_base_url"] == "http://h:8000"
