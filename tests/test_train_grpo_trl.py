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
