"""evade on the shared seams: generation and token NLL from core.lm (outputs equal to the direct
transformers computation), and attack options from the method contract."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import TINY_TEXT, build_tiny_llama, build_tokenizer, run_cli


@pytest.fixture(scope="module")
def lm_tok():
    tok = build_tokenizer()
    return build_tiny_llama(len(tok), seed=1, initializer_range=0.2), tok


def _reference_generate(model, tok, prompts, procs, max_new, seed, stops, temperature, top_p, ngram):
    """Direct model.generate with the same batching/seeding rules (the pre-core.lm implementation)."""
    from transformers import LogitsProcessorList

    outs = []
    for start in range(0, len(prompts), 3):
        chunk = prompts[start:start + 3]
        width = max(map(len, chunk))
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        torch.manual_seed(seed + start)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=0,
                             eos_token_id=stops, no_repeat_ngram_size=ngram, do_sample=True,
                             temperature=temperature, top_p=top_p, top_k=0,
                             logits_processor=LogitsProcessorList(procs))
        for row in out[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in stops), len(row))
            outs.append(row[:cut])
    return outs


def test_generate_ids_equals_direct_generate(lm_tok):
    from llmtool.evade.generation import DecodeConfig, generate_ids
    from llmtool.evade.watermarks import make_scheme

    model, tok = lm_tok
    prompts = [tok("It is a truth universally acknowledged" * (i % 3 + 1))["input_ids"] for i in range(4)]
    sch = make_scheme("unigram", len(tok))
    dec = DecodeConfig(max_new_tokens=8, batch_size=3, seed=5, temperature=0.7, top_p=0.9, no_repeat_ngram_size=4)
    got = generate_ids(model, tok, prompts, [sch.processor()], dec, stop_ids=[0, 17])
    ref = _reference_generate(model, tok, prompts, [sch.processor()], 8, 5, [0, 17], 0.7, 0.9, 4)
    assert got == ref and sum(map(len, got)) > 8


def test_surprisal_and_perplexity_equal_direct_log_softmax(lm_tok):
    from llmtool.evade.bira import token_surprisal
    from llmtool.evade.metrics import perplexity_of

    model, tok = lm_tok
    ids = tok(TINY_TEXT)["input_ids"][:120]
    x = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), -1)
    ref = -logp.gather(-1, x[0, 1:, None]).squeeze(-1).numpy()
    s = token_surprisal(model, ids)
    assert np.isnan(s[0]) and np.allclose(s[1:], ref, rtol=1e-5, atol=1e-6)
    text = tok.decode(ids)
    assert perplexity_of(model, tok, [text])[0] == pytest.approx(float(np.exp(ref.mean())), rel=1e-5)


def test_attack_options_follow_the_method(tiny_llama_dir, tmp_path):
    from llmtool.evade.attack_methods import ATTACK_METHODS
    from llmtool.evade.attacks import ATTACKS

    assert {c.attack for c in ATTACK_METHODS.configs()} <= set(ATTACKS.names())
    src = tmp_path / "wm.jsonl"
    src.write_text(json.dumps({"watermarked_text": "a man in a cap and a man with a cap"}) + "\n")
    for extra, word in ((["--method", "bira", "--delete-ratio", "0.5"], "--delete-ratio"),
                        (["--method", "word-delete", "--paraphraser", tiny_llama_dir], "--paraphraser"),
                        (["--method", "vanilla", "--beta0", "-2"], "--beta0"),
                        (["--method", "synonym", "--temperature", "1.0"], "--temperature")):
        code, _, err = run_cli("evade", "attack", src, "-o", tmp_path / "o.jsonl", *extra)
        assert code == 2 and word in err and "does not apply" in err, (extra, err)
    code, _, err = run_cli("evade", "attack", src, "-o", tmp_path / "o.jsonl", "--method", "emoji")
    assert code == 2 and "--scheme" in err
    code, _, err = run_cli("evade", "attack", src, "-o", tmp_path / "o.jsonl", "--method", "bira",
                           "--beta-step", "0")
    assert code == 2 and "--max-iter 1" in err
    assert not (tmp_path / "o.jsonl").exists()
    code, stdout, err = run_cli("--json", "evade", "attack", src, "-o", tmp_path / "o.jsonl", "--method",
                                "word-delete", "--delete-ratio", "0.5")
    assert code == 0, err
    assert json.loads(stdout)["config"] == {"method": "word-delete", "delete_ratio": 0.5}


def test_watermark_refuses_sampling_options_its_scheme_ignores(tiny_llama_dir, tmp_path):
    from llmtool.evade.watermarks import SCHEMES

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "It is a truth"}) + "\n")
    code, out, _ = run_cli("evade", "watermark", "--help")
    assert code == 0 and all(n in out for n in SCHEMES.names())
    for scheme in ("exp", "dip"):
        code, _, err = run_cli("evade", "watermark", tiny_llama_dir, prompts, "-o", tmp_path / "w.jsonl",
                               "--scheme", scheme, "--temperature", "0.9")
        assert code == 2 and "--temperature does not apply" in err, err
    code, stdout, err = run_cli("--json", "evade", "watermark", tiny_llama_dir, prompts, "-o", tmp_path / "w.jsonl",
                                "--scheme", "kgw", "--temperature", "0.9", "--max-new-tokens", "4")
    assert code == 0, err
    assert json.loads(stdout)["scheme_config"]["gamma"] == 0.5
