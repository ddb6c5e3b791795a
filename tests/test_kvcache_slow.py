"""Real-model checks of `llmtool kvcache` on SmolLM2-135M (slow; run with `pytest -m slow`)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real(smollm2_dir):
    from llmtool.core.data import load_text, tokenize
    from llmtool.core.models import load_model, load_tokenizer

    torch.set_num_threads(2)
    tok = load_tokenizer(smollm2_dir)
    return load_model(smollm2_dir), tokenize(tok, load_text("austen-test"))[:640]


def test_real_key_residual_range_shrinks(real):
    from llmtool.kvcache import patternkv as pk
    from llmtool.kvcache.pipeline import capture_prefill

    model, ids = real
    state = capture_prefill(model, ids[None, :512])
    for layer in (0, 15, 29):
        k = state.keys[layer][0]  # [H, T, d], post-RoPE
        bank = pk.kmeans(k, 32, seed=0)
        resid = k - pk.gather_patterns(bank, pk.l2_assign(k[None], bank))[0]
        # per-channel range over groups of 64 tokens (the K quantization axis)
        rng = lambda t: (t.unflatten(1, (-1, 64)).amax(2) - t.unflatten(1, (-1, 64)).amin(2)).mean()  # noqa: E731
        assert rng(resid) < rng(k)


def test_real_patternkv_beats_kivi_at_2_bits(real):
    from llmtool.kvcache.pipeline import KVSpec, decode_nll

    model, ids = real
    nll = {}
    for q in ("none", "kivi", "patternkv"):
        spec = KVSpec(quant=q, bits=2, group_size=64, residual_length=64)
        nll[q] = decode_nll(model, ids, 512, spec, chunk=None)[0]
    assert nll["none"] < nll["patternkv"] < nll["kivi"]
