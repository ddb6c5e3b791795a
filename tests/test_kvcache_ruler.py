"""benchmarks/kvcache_ruler.py: the shared-prefill path decodes what `kvcache.pipeline.generate` decodes
(both protocols, every eviction setting, Llama and a Gemma 3 hybrid layout), and the word needles."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import kvcache_ruler as R  # noqa: E402
from conftest import build_tiny_llama, build_tokenizer  # noqa: E402
from llmtool.kvcache.pipeline import KVSpec, generate  # noqa: E402

SPECS = [KVSpec(), KVSpec(evict="snapkv", budget=0.2), KVSpec(evict="snapkv", budget=0.5, critical=True),
         KVSpec(evict="adakv", budget=0.2), KVSpec(evict="adakv", budget=0.5, critical=True),
         KVSpec(evict="pyramidkv", budget=0.1, critical=True)]


def _tiny_gemma3():
    """Sliding, full, sliding: the last layer's rotary embeddings are the local ones, so a prefill that kept
    only one layer's would score the full layer with the wrong positions."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return Gemma3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    if request.param == "llama":
        return build_tiny_llama(320, seed=0, max_position_embeddings=1024)
    return _tiny_gemma3()


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(5)
    return torch.randint(1, 320, (1, 180), generator=g), torch.randint(1, 320, (1, 7), generator=g)


def _same_cache(a, b):
    for la, lb in zip(a.layers, b.layers):
        assert la.keys.shape == lb.keys.shape
        torch.testing.assert_close(la.keys, lb.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(la.values, lb.values, rtol=1e-4, atol=1e-5)
        assert (la.bias is None) == (lb.bias is None)


@pytest.mark.parametrize("protocol", R.PROTOCOLS)
def test_shared_prefill_matches_generate(model, prompt, protocol):
    ctx, q = prompt
    pre = R.shared_prefill(model, torch.cat([ctx, q], dim=-1))
    compressed = 0
    for spec in SPECS:
        want, stats, _ = generate(model, ctx, q, spec, 12, compress_question=protocol == "aware")
        got, cache = R.run_setting(model, pre, ctx.shape[-1], q, spec, protocol, 12)
        assert got == want, (spec.label(), protocol)
        _same_cache(cache, stats.extra["cache"])
        compressed += any(layer.compressed for layer in cache.layers)
    assert compressed == len(SPECS) - 1          # every eviction setting really evicted something


def test_one_rope_for_every_layer_would_fail():
    """The per-layer rotary embeddings matter: scoring Gemma's full layer with the last (sliding) layer's
    embeddings, as a single captured one would, changes what is kept."""
    model = _tiny_gemma3()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 320, (1, 180), generator=g)
    pre = R.shared_prefill(model, ids)
    assert not torch.equal(pre.rope[0][0], pre.rope[1][0])
    spec = KVSpec(evict="snapkv", budget=0.2)
    _, right = R.run_setting(model, pre, ids.shape[-1], None, spec, "aware", 1)
    pre.rope = [pre.rope[-1]] * len(pre.rope)
    _, wrong = R.run_setting(model, pre, ids.shape[-1], None, spec, "aware", 1)
    assert not torch.equal(right.layers[1].keys, wrong.layers[1].keys)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small haystack file (the packaged corpus takes minutes to tokenize with the tiny tokenizer)."""
    path = tmp_path_factory.mktemp("haystack") / "haystack.txt"
    path.write_text(" ".join(f"Sentence number {i} of the haystack is here." for i in range(400)))
    return str(path)


def test_word_needles(tok, corpus):
    single = R.make_samples("niah_single", "words", tok, 256, 6, 1, corpus)
    again = R.make_samples("niah_single", "words", tok, 256, 6, 1, corpus)
    assert [s.answers for s in single] == [s.answers for s in again]
    assert len({s.answers[0] for s in single}) > 1
    for s in single:
        adj, noun = s.answers[0].split()
        assert adj in R._ADJS and noun in R._NOUNS
        assert s.context.count("special magic words") == 1 and s.question.endswith(' are "')
        key = s.question.split("for ")[1].split("?")[0]
        assert f'for {key} are "{s.answers[0]}".' in s.context
    for s in R.make_samples("niah_multikey", "words", tok, 256, 4, 1, corpus):
        assert s.context.count("special magic words") == 4
        values = [c.split(' are "')[1].split('"')[0] for c in s.context.split("special magic words for ")[1:]]
        words = [w for v in values for w in v.split()]
        assert len(set(words)) == len(words) == 8 and s.answers[0] in values
    for s in R.make_samples("niah_multikey", "digits3", tok, 256, 4, 1, corpus):
        values = [c.split(" is: ")[1].split(".")[0] for c in s.context.split("special magic number for ")[1:]]
        assert len(set(values)) == 4 and all(len(v) == 3 for v in values) and s.answers[0] in values
    with pytest.raises(SystemExit):
        R.make_samples("variable_tracking", "words", tok, 256, 1, 0, corpus)


def test_digits7_is_the_earlier_task(tok, corpus):
    from llmtool.kvcache import tasks as T

    a = R.make_samples("niah_single", "digits7", tok, 256, 3, 0, corpus)
    b = T.make_samples("niah_single", tok, 256, 3, 0, corpus)
    assert [s.as_dict() for s in a] == [s.as_dict() for s in b]


def test_partial_hit():
    assert R.partial_hit(" 864.", "8646861", "digits7") and not R.partial_hit(" 8656861", "8646861", "digits7")
    assert R.partial_hit(" Quiet pebble.", "quiet kettle", "words")
    assert not R.partial_hit(" kettle", "quiet kettle", "words")
    assert R.partial_hit(" 4", "481", "digits3") and not R.partial_hit("581", "481", "digits3")


def test_paired_rows_and_gate():
    hits = {("aware", "snapkv@0.2", "niah_single"): [True, False, False, True],
            ("aware", "critical+snapkv@0.2", "niah_single"): [True, True, True, False]}
    rows = R.paired_rows(hits, ["snapkv@0.2", "critical+snapkv@0.2"], ["niah_single"], ["aware"], 4)
    assert len(rows) == 1 and rows[0]["critical_only"] == 2 and rows[0]["base_only"] == 1
    assert rows[0]["diff"] == pytest.approx(0.25) and rows[0]["low"] < 0.25 < rows[0]["high"]
    (g,) = R.gates_for(rows)
    assert g["verdict"] == "met"
    hits[("aware", "critical+snapkv@0.2", "niah_single")] = [True, False, False, False]
    (g,) = R.gates_for(R.paired_rows(hits, ["snapkv@0.2", "critical+snapkv@0.2"], ["niah_single"], ["aware"], 4))
    assert g["verdict"] == "not met"
    hits[("aware", "critical+snapkv@0.2", "niah_single")] = list(hits[("aware", "snapkv@0.2", "niah_single")])
    (g,) = R.gates_for(R.paired_rows(hits, ["snapkv@0.2", "critical+snapkv@0.2"], ["niah_single"], ["aware"], 4))
    assert g["verdict"] == "not tested"
