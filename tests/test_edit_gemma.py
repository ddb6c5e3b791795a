"""Gemma-specific editing: (1) prompts on a tokenizer that starts every text with BOS (Gemma, Llama 2/3):
every prompt the edit methods and metrics run starts with that BOS, targets never do, and tokenizers without one
(SmolLM2) encode as before; (2) the post-feedforward-norm pre-image with gains exactly 0 (Gemma 3 270M's
checkpoint has them) and with unreachable targets."""
from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_llama, build_tokenizer


def _bos_tokenizer():
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    plain = build_tokenizer()
    tk = plain.backend_tokenizer
    bos_id = tk.token_to_id("<|endoftext|>")
    tk.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                      special_tokens=[("<|endoftext|>", bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")


@pytest.fixture(scope="module")
def bos_tok():
    tok = _bos_tokenizer()
    assert tok("a")["input_ids"][0] == tok.bos_token_id   # the fixture really adds BOS
    return tok


@pytest.mark.parametrize("prompt,subject", [("The capital of {} is", "France"), ("{} is in Paris", "The Eiffel Tower")])
def test_lookup_sequences_start_with_bos_and_index_the_subject(bos_tok, prompt, subject):
    from llmtool.edit.prompts import subject_last_index

    ids, idx = subject_last_index(bos_tok, prompt, subject)
    assert ids[0] == bos_tok.bos_token_id and ids[1] != bos_tok.bos_token_id
    assert bos_tok.decode(ids[1:idx + 1]).endswith(subject)
    assert not bos_tok.decode(ids[1:idx]).endswith(subject)
    assert bos_tok.decode(ids[1:]) == prompt.replace("{}", subject)


def test_plain_tokenizer_gets_no_bos():
    from llmtool.edit.prompts import bos_prefix, encode, encode_prompt, subject_last_index

    tok = build_tokenizer()
    assert bos_prefix(tok) == []
    assert encode_prompt(tok, "The capital of France is") == encode(tok, "The capital of France is")
    ids, _ = subject_last_index(tok, "The capital of {} is", "France")
    assert ids == encode(tok, "The capital of France is")


def test_metrics_score_after_bos_and_targets_have_none(bos_tok):
    from llmtool.edit.metrics import next_token_logprobs, pair_scores
    from llmtool.edit.prompts import encode

    model = build_tiny_llama(len(bos_tok), seed=3)
    prompt, target = "The capital of France is", "Paris"
    p = [bos_tok.bos_token_id] + encode(bos_tok, prompt)
    t = encode(bos_tok, " " + target)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([p + t])).logits[0].float(), -1)
    want = -logp[torch.arange(len(p) - 1, len(p) - 1 + len(t)), torch.tensor(t)].mean().item()
    (nll, _), = pair_scores(model, bos_tok, [(prompt, target)])
    assert abs(nll - want) < 1e-5
    assert torch.allclose(next_token_logprobs(model, bos_tok, [prompt])[0], logp[len(p) - 1], atol=1e-5)


def test_key_statistics_windows_start_with_bos_and_cache_apart(bos_tok, tiny_text_file, tmp_path):
    from llmtool.edit.covariance import compute_second_moments, second_moments

    model = build_tiny_llama(len(bos_tok), seed=1)
    seen = []
    h = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, i: seen.append(i[0].shape))
    got = compute_second_moments(model, bos_tok, [0], corpus=str(tiny_text_file), samples=64, seqlen=16)
    h.remove()
    assert seen and all(s[1] == 17 for s in seen)   # [BOS] + 16-token window
    assert torch.isfinite(got[0]).all()
    second_moments(model, bos_tok, [0], "fp", corpus=str(tiny_text_file), samples=64, seqlen=16, root=tmp_path)
    assert [f.name.endswith("-bos.safetensors") for f in (tmp_path / "fp").iterdir()] == [True]


def _norm(y, g, eps):
    return g * y / (y.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def _gains(d=64, seed=0, zeros=(3, 17, 40)):
    gen = torch.Generator().manual_seed(seed)
    g = (torch.rand(d, generator=gen, dtype=torch.float64) * 2 + 0.2)
    g[list(zeros)] = 0.0
    return g, gen


@pytest.mark.parametrize("zeros", [(3, 17, 40), ()])
def test_post_norm_preimage_exact_with_zero_gains(zeros):
    from llmtool.edit.memit import post_norm_preimage

    eps = 1e-6
    g, gen = _gains(zeros=zeros)
    y = torch.randn(4, 64, generator=gen, dtype=torch.float64) * 30
    y2 = y + 0.3 * torch.randn(4, 64, generator=gen, dtype=torch.float64) * 30
    Rs = _norm(y2, g, eps) - _norm(y, g, eps)              # reachable by construction (0 on dead coordinates)
    Rs[0] = 0.0                                            # no change asked: no change made
    d = post_norm_preimage(y, g, eps, Rs)
    assert torch.isfinite(d).all()
    assert d[0].abs().max() < 1e-9 * y.abs().max()
    assert torch.allclose(_norm(y + d, g, eps), _norm(y, g, eps) + Rs, atol=1e-7, rtol=0)


def test_post_norm_preimage_unreachable_is_the_closest_reachable_point():
    from llmtool.edit.memit import post_norm_preimage

    eps = 1e-6
    g, gen = _gains()
    g[5] = 1e-3                                            # a near-zero gain amplifies its residual
    y = torch.randn(3, 64, generator=gen, dtype=torch.float64) * 30
    base = _norm(y, g, eps)
    Rs = torch.randn(3, 64, generator=gen, dtype=torch.float64) * base.abs().mean()   # far outside the set
    d = post_norm_preimage(y, g, eps, Rs)
    assert torch.isfinite(d).all()
    got = _norm(y + d, g, eps)
    T = base + Rs
    err = (got - T).norm(dim=-1)
    # no reachable contribution at y's scale is closer: compare with random feasible points and with the
    # direction-only rescaling y* = r (T/g)/rms(T/g) on live coordinates
    r = y.pow(2).mean(-1, keepdim=True).sqrt()
    live = g != 0
    t = torch.where(live, T / torch.where(live, g, torch.ones_like(g)), torch.zeros_like(T))
    rescaled = _norm(r * t / t.pow(2).mean(-1, keepdim=True).sqrt(), g, eps)
    assert (err < (rescaled - T).norm(dim=-1)).all()
    for _ in range(50):
        cand = y + torch.randn(y.shape, generator=gen, dtype=torch.float64) * 5
        assert (err <= (_norm(cand, g, eps) - T).norm(dim=-1) + 1e-9).all()


def test_gemma3_270m_preset():
    from llmtool.edit.presets import preset_for

    p = preset_for({"model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18})
    assert p.name == "gemma3-270m" and p.layers == (1, 2, 3, 4, 5) and p.mom2_update_weight == 1500.0


def test_keystone_cli_texts_start_with_bos_only_where_the_tokenizer_adds_one(bos_tok):
    """`llmtool edit keystone find|ablate` scored Gemma's texts without the BOS it was trained with, so the CLI did
    not match the benchmark's keystone rows."""
    from llmtool.core.data import tokenize
    from llmtool.edit.keystone_cli import _tokens

    rows = [{"text": "It is a truth universally acknowledged"}]
    (ids,) = _tokens(bos_tok, rows)
    assert ids[0].item() == bos_tok.bos_token_id and ids[1:].tolist() == tokenize(bos_tok, rows[0]["text"]).tolist()
    plain = build_tokenizer()
    (ids,) = _tokens(plain, rows)
    assert ids.tolist() == tokenize(plain, rows[0]["text"]).tolist()
