"""Watermark schemes, detectors, BIRA pieces and metrics of `llmtool evade` (tiny random LMs, CPU)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import build_tiny_llama

from llmtool.evade.bira import (BiraConfig, SuppressionBias, adaptive_attack, is_degenerate, map_to_tokenizer,
                                rank_by_surprisal, token_surprisal)
from llmtool.evade.generation import DecodeConfig, generate_ids, scheme_decoding
from llmtool.evade.metrics import auroc, detection_metrics, f1_best, tpr_at_fpr
from llmtool.evade.watermarks import SCHEMES, make_scheme
from llmtool.evade.watermarks.dip import reweight

V = 1000
N_TOKENS = 200
torch.set_num_threads(1)


class _IdTokenizer:
    """Just enough of a tokenizer for generate_ids on raw ids."""
    pad_token_id = 0
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    # eos id outside the vocabulary range used by prompts; generation never stops early
    return build_tiny_llama(V, seed=1, eos_token_id=V + 5, bos_token_id=None, pad_token_id=0)


def _prompts(n, seed=0, length=8):
    g = np.random.default_rng(seed)
    return [g.integers(1, V, size=length).tolist() for _ in range(n)]


def _generate(lm, scheme, n, seed=0, prompts=None, processors=None):
    tok = _IdTokenizer()
    tok.eos_token_id = V + 5
    dec = DecodeConfig(max_new_tokens=N_TOKENS, temperature=1.0, top_p=1.0, no_repeat_ngram_size=0,
                       batch_size=n, seed=seed)
    procs = processors if processors is not None else ([scheme.processor()] if scheme else [])
    return generate_ids(lm, tok, prompts or _prompts(n, seed), procs, dec,
                        **(scheme_decoding(scheme) if scheme and processors is None else {}))


@pytest.mark.parametrize("name", ["kgw", "unigram"])
def test_green_list_detection_separates(lm, name):
    scheme = make_scheme(name, V)
    marked = _generate(lm, scheme, 20, seed=1)
    plain = _generate(lm, None, 20, seed=2)
    assert all(len(x) == N_TOKENS for x in marked)
    z_marked = [scheme.detect(x).score for x in marked]
    z_plain = [scheme.detect(x).score for x in plain]
    assert sum(z > 4 for z in z_marked) >= 19
    assert sum(abs(z) < 2 for z in z_plain) >= 17
    assert all(scheme.detect(x).is_watermarked == (scheme.detect(x).score > 4) for x in marked[:3])


def test_exp_pvalues(lm):
    from scipy.stats import kstest

    scheme = make_scheme("exp", V)
    marked = _generate(lm, scheme, 10, seed=3)
    assert all(scheme.detect(x).score < 1e-4 for x in marked)
    plain = _generate(lm, None, 50, seed=4)
    pvals = [scheme.detect(x).score for x in plain]
    assert kstest(pvals, "uniform").pvalue > 0.01
    assert scheme.detect(marked[0]).score_kind == "p"


def test_exp_sampling_is_gumbel_max():
    probs = np.random.default_rng(0).dirichlet(np.ones(20))
    counts = np.zeros(20)
    for key in range(1, 4001):  # over random keys the EXP choice is an exact sample from p
        counts[make_scheme("exp", 20, {"key": key}).choose([1, 7, 3, 2], probs)] += 1
    assert 0.5 * np.abs(counts / counts.sum() - probs).sum() < 0.05
    assert len(np.unique(counts)) > 5


def test_dip_reweighting_is_distribution_preserving():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(40) * 0.5)
    scheme = make_scheme("dip", 40)
    acc = np.zeros(40)
    for key in range(2000):
        q = reweight(probs, scheme.perm([key, 1, 2, 3, 4]), scheme.config.alpha)
        assert abs(q.sum() - 1) < 1e-6 and (q >= -1e-12).all()
        acc += q
    assert 0.5 * np.abs(acc / 2000 - probs).sum() < 0.02
    # a single reweighting is not the identity (it does move mass toward the permutation's tail)
    assert 0.5 * np.abs(reweight(probs, scheme.perm([1, 2, 3, 4, 5]), 0.45) - probs).sum() > 0.05


def test_dip_detects_its_text(lm):
    scheme = make_scheme("dip", V)
    marked = _generate(lm, scheme, 10, seed=5)
    plain = _generate(lm, None, 10, seed=6)
    z_m = [scheme.detect(x).score for x in marked]
    z_p = [scheme.detect(x).score for x in plain]
    assert np.mean(z_m) > 3 and np.mean(z_p) < 1.5
    assert sum(z > scheme.config.z_threshold for z in z_m) >= 9


def test_green_lists_identical_across_processes_and_without_cuda():
    code = ("from llmtool.evade.watermarks import make_scheme; import json; s=make_scheme('kgw', 49152); "
            "u=make_scheme('unigram', 49152); print(json.dumps([s.green_list([17]).tolist()[:50], "
            "s.green_list([40000]).tolist()[-50:], u.green_ids.tolist()[:50]]))")
    here_k = make_scheme("kgw", 49152)
    here_u = make_scheme("unigram", 49152)
    expected = [here_k.green_list([17]).tolist()[:50], here_k.green_list([40000]).tolist()[-50:],
                here_u.green_ids.tolist()[:50]]
    for env_extra in ({}, {"CUDA_VISIBLE_DEVICES": ""}):
        import os

        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, **env_extra})
        assert json.loads(out.stdout) == expected
    assert here_k.green_list([17]).size == 49152 // 2
    assert not np.array_equal(here_k.green_list([17]), here_k.green_list([18]))


def test_markllm_compat_uses_torch_randperm():
    s = make_scheme("kgw", 500, {"markllm_compat": True})
    seed = s.step_seed([5])
    g = torch.Generator().manual_seed(seed)
    assert s.green_list([5]).tolist() == sorted(torch.randperm(500, generator=g)[:250].tolist())


def test_detection_score_stable_under_decode_encode(tiny_tokenizer):
    model = build_tiny_llama(len(tiny_tokenizer), seed=2)
    ids = tiny_tokenizer("It is a truth universally acknowledged", add_special_tokens=False)["input_ids"]
    for name in ("kgw", "unigram", "exp", "dip"):
        scheme = make_scheme(name, len(tiny_tokenizer))
        dec = DecodeConfig(max_new_tokens=60, batch_size=1, seed=0, no_repeat_ngram_size=0)
        out = generate_ids(model, tiny_tokenizer, [ids], [scheme.processor()], dec, **scheme_decoding(scheme))[0]
        text = tiny_tokenizer.decode(out)
        first = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        again = tiny_tokenizer(tiny_tokenizer.decode(first), add_special_tokens=False)["input_ids"]
        assert abs(scheme.detect(first).score - scheme.detect(again).score) <= 1e-9


def test_unigram_unique_scores_each_token_once():
    s = make_scheme("unigram", 100, {"unique": True})
    green = int(s.green_ids[0])
    assert s.detect([green] * 50).n_scored == 1
    assert make_scheme("unigram", 100).detect([green] * 50).score > 6


def test_bad_scheme_and_config_errors():
    from llmtool.core.console import UsageError

    with pytest.raises(UsageError, match="unknown scheme 'nope'.*kgw"):
        make_scheme("nope", 100)
    with pytest.raises(UsageError, match="unknown field"):
        make_scheme("kgw", 100, {"gama": 0.3})
    with pytest.raises(UsageError, match="gamma must be in"):
        make_scheme("kgw", 100, {"gamma": 1.5})
    with pytest.raises(UsageError, match="must be float"):
        make_scheme("kgw", 100, {"delta": "big"})
    assert SCHEMES.names() == ["dip", "exp", "kgw", "unigram"]


# --------------------------------------------------------------------------- BIRA


def test_suppression_bias_processor_exact():
    scores = torch.randn(2, 30)
    proc = SuppressionBias([[1, 5, 7, 29], [2]], [-3.0, -0.5], 30, protected=[7])
    out = proc(torch.zeros(2, 4, dtype=torch.long), scores.clone())
    expected = scores.clone()
    expected[0, [1, 5, 29]] -= 3.0
    expected[1, 2] -= 0.5
    assert torch.equal(out, expected)


def test_rank_by_surprisal_properties():
    ids = [9, 3, 4, 3, 8, 4, 6]
    s = [np.nan, 1.0, 5.0, 2.0, 0.5, 3.0, 5.0]
    all_q0 = rank_by_surprisal(ids, s, 0)
    assert set(all_q0) == {3, 4, 8, 6} and 9 not in all_q0  # first position dropped
    assert all_q0 == [4, 6, 3, 8]  # by decreasing max surprisal (4 and 6 tie at 5.0; stable)
    assert set(rank_by_surprisal(ids, s, 100)) == {4, 6}
    assert rank_by_surprisal(ids, s, 40) == [4, 6, 3]  # tau = 2.0


def test_suppression_set_from_model_is_ordered(tiny_tokenizer):
    model = build_tiny_llama(len(tiny_tokenizer), seed=3)
    ids = tiny_tokenizer("The capital of France is Paris. The capital of Italy is Rome.",
                         add_special_tokens=False)["input_ids"]
    surprisal = token_surprisal(model, ids)
    ranked = rank_by_surprisal(ids, surprisal, 0)
    best = {}
    for t, v in zip(ids[1:], surprisal[1:]):
        best[t] = max(best.get(t, -1), v)
    values = [best[t] for t in ranked]
    assert values == sorted(values, reverse=True)
    assert set(ranked) == set(ids[1:])


class _WordTokenizer:
    """Stub tokenizer: one id per distinct string (so nothing merges)."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def decode(self, ids):
        return "".join(f" w{i}" for i in ids)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab.setdefault(text, len(self.vocab))]}


def test_map_to_tokenizer_truncates_at_300(tiny_tokenizer):
    src, dst = _WordTokenizer(), _WordTokenizer()
    mapped = map_to_tokenizer(list(range(1000)), src, dst, limit=300)
    assert len(mapped) == 300 and len(set(mapped)) == 300
    # surprisal order kept: the first source token's variants come first (" w0" then "w0")
    assert [k for k, v in sorted(dst.vocab.items(), key=lambda kv: kv[1])][:2] == [" w0", "w0"]
    assert len(map_to_tokenizer(list(range(1000)), src, _WordTokenizer(), limit=None)) == 2000
    # real byte-level tokenizer: the leading-space variant of a word is carried over
    piece = tiny_tokenizer("Paris", add_special_tokens=False)["input_ids"]
    spaced = tiny_tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    assert set(spaced) <= set(map_to_tokenizer(piece, tiny_tokenizer, tiny_tokenizer, limit=None))


def test_adaptive_schedule_with_stub():
    calls = []

    def stub(indices, betas):
        calls.append(list(betas))
        return [[1, 1, 1, 1] * 10 if b < -3 else list(range(40)) for b in betas]

    out = adaptive_attack(stub, 1, [40], BiraConfig(beta0=-6, eta=1.0))
    assert out[0].beta_final == -3 and out[0].iterations == 4 and not out[0].degenerated
    assert calls == [[-6.0], [-5.0], [-4.0], [-3.0]]
    assert BiraConfig(beta0=-6, eta=1.0).iterations() == 7


def test_degeneration_detector(tiny_tokenizer):
    the = tiny_tokenizer(" the" * 100, add_special_tokens=False)["input_ids"]
    normal = tiny_tokenizer("It is a truth universally acknowledged, that a single man in possession of a good "
                            "fortune, must be in want of a wife.", add_special_tokens=False)["input_ids"]
    assert is_degenerate(the)
    assert not is_degenerate(normal)
    assert is_degenerate(normal[:5], source_length=100)  # shorter than 30% of the source


def test_bira_mechanical_evasion(lm):
    """Re-sampling KGW text with the unwatermarked LM under the BIRA bias on S removes the mark."""
    scheme = make_scheme("kgw", V)
    marked = _generate(lm, scheme, 40, seed=7)
    z_before = [scheme.detect(x).score for x in marked]
    sets = [rank_by_surprisal(x, token_surprisal(lm, x), 0) for x in marked]
    attacked = _generate(lm, None, 40, seed=8, prompts=[x[-32:] for x in marked],
                         processors=[SuppressionBias(sets, [-4.0] * 40, V)])
    z_after = [scheme.detect(x).score for x in attacked]
    assert sum(z > 4 for z in z_before) == 40
    assert sum(z < 4 for z in z_after) >= 38
    # the bias did act: the rewrite reuses far fewer of the source's tokens than unbiased resampling
    reused = np.mean([len(set(a) & set(s)) / len(set(a)) for a, s in zip(attacked, sets)])
    assert reused < 0.1


# --------------------------------------------------------------------------- metrics


def test_metrics_hand_computed():
    pos = [5.0, 4.0, 3.0, 0.5]
    neg = [0.0, 1.0, 2.0, 3.5, -1.0, 0.2, 0.1, 0.3, 0.4, 0.6]
    tpr, thr = tpr_at_fpr(pos, neg, 0.1)  # k = 1 -> threshold = 2nd largest negative = 2.0
    assert thr == 2.0 and tpr == 0.75
    tpr, thr = tpr_at_fpr(pos, neg, 0.01)  # k = 0 -> max negative
    assert thr == 3.5 and tpr == 0.5
    # AUROC: pairs pos > neg: 5:10, 4:10, 3:9, 0.5:6 -> 35 of 40
    assert auroc(pos, neg) == pytest.approx(35 / 40)
    f1, t = f1_best(pos, neg)
    assert f1 == pytest.approx(2 * 3 / (2 * 3 + 1 + 1)) and t == 3.0  # tp 3, fp 1 (3.5), fn 1
    # EXP direction: p-values, low = watermarked, give the same numbers when mirrored
    m = detection_metrics([10 ** -s for s in pos], [10 ** -s for s in neg], [True, True, False, False], "p")
    assert m["tpr@fpr=0.1"] == 0.75 and m["auroc"] == pytest.approx(35 / 40) and m["asr"] == 0.5
    assert m["threshold@fpr=0.1"] == pytest.approx(10 ** -2.0)


def test_similarity_model_ranks_paraphrase_above_unrelated():
    from llmtool.evade.similarity import SentenceEmbedder

    emb = SentenceEmbedder()
    sims = emb.similarity(["The cat sat on the mat.", "The cat sat on the mat."],
                          ["A cat was sitting on the rug.", "Interest rates rose sharply in March."])
    assert sims[0] > 0.6 and sims[1] < 0.2
    assert emb.similarity(["same words"], ["same words"])[0] == pytest.approx(1.0, abs=1e-5)


def test_edits():
    from llmtool.evade.edits import delete_words, strip_emoji

    text = " ".join(f"w{i}" for i in range(200))
    kept = delete_words(text, 0.3, seed=1).split()
    assert 110 < len(kept) < 170 and kept == [w for w in text.split() if w in set(kept)]
    assert delete_words(text, 0.3, seed=1) == delete_words(text, 0.3, seed=1)
    assert strip_emoji("Hello \U0001F600 world \U0001F600, fine \u2764\ufe0f") == "Hello world, fine"


def test_calibrate_beta_returns_first_degenerate_beta():
    from llmtool.evade.bira import calibrate_beta

    def stub(beta):  # the second text degenerates once beta <= -5
        return [list(range(50)), [7] * 50 if beta <= -5 else list(range(50))]

    beta0, curve = calibrate_beta(stub, [50, 50], [-1, -2, -3, -4, -5, -6])
    # no degeneration at beta = 0: the baseline rule is the paper's rule (first beta with one degenerate)
    assert beta0 == -5 and [c["beta"] for c in curve] == [0, -1, -2, -3, -4, -5]
    assert curve[-1]["degenerate_rate"] == 0.5 and curve[0]["degenerate_rate"] == 0
    assert calibrate_beta(stub, [50, 50], [-1, -2, -3, -4, -5, -6], baseline=False)[0] == -5
    assert calibrate_beta(lambda b: [list(range(50))], [50], [-1, -2])[0] is None


def test_calibrate_beta_against_the_unbiased_degeneration_rate():
    """A rewriter that degenerates 20 % of the time without any bias and breaks down from beta = -6: the
    paper's rule fires at the first beta (vacuous), the baseline rule finds the onset."""
    import zlib

    from llmtool.evade.bira import calibrate_beta

    n = 50

    def stub(beta):
        out = []
        for i in range(n):
            noise = zlib.crc32(f"{i}:{beta}".encode()) % 100 < 20       # 20 % at every beta, beta = 0 included
            broken = beta <= -6 and i % 5 != 0                           # 80 % from -6 on
            out.append([3] * 60 if noise or broken else list(range(60)))
        return out

    grid = [-1.0 * b for b in range(1, 13)]
    assert calibrate_beta(stub, [60] * n, grid, baseline=False)[0] == -1
    beta0, curve = calibrate_beta(stub, [60] * n, grid)
    assert beta0 == -6
    assert 0.1 <= curve[0]["degenerate_rate"] <= 0.3 and not any(c["significant"] for c in curve[1:-1])


def test_beta0_cache_per_rewriter(tmp_path, monkeypatch):
    import json

    from llmtool.evade import beta_cache

    monkeypatch.setenv("LLMTOOL_HOME", str(tmp_path / "home"))
    model = tmp_path / "rewriter"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\0\0")
    calls = []

    def measure(value):
        def run():
            calls.append(value)
            return value, [{"beta": 0.0, "degenerate_rate": 0.0}]
        return run

    settings = {"texts": 50, "grid": [-1.0, -2.0], "temperature": 0.7}
    assert beta_cache.calibrated_beta0(model, settings, measure(-2.0), -4.0)[0] == -2.0
    beta0, entry = beta_cache.calibrated_beta0(model, settings, measure(-9.0), -4.0)
    assert beta0 == -2.0 and entry["cached"] and calls == [-2.0]
    # other decoding settings, or another rewriter in the same directory, are measured again
    assert beta_cache.calibrated_beta0(model, {**settings, "temperature": 1.0}, measure(-1.0), -4.0)[0] == -1.0
    (model / "config.json").write_text('{"model_type": "llama", "vocab_size": 7}')
    assert beta_cache.calibrated_beta0(model, settings, measure(-1.0), -4.0)[0] == -1.0
    # no beta degenerates: the grid's end; degenerate more often than not at beta = 0: the fallback
    (model / "config.json").write_text('{"model_type": "mistral"}')
    assert beta_cache.calibrated_beta0(model, settings, lambda: (None, [{"beta": 0.0, "degenerate_rate": 0.1}]),
                                       -4.0)[0] == -2.0
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    assert beta_cache.calibrated_beta0(model, settings, lambda: (None, [{"beta": 0.0, "degenerate_rate": 0.9}]),
                                       -4.0)[0] == -4.0
    beta_cache.cache_path().write_text("{damaged")      # a damaged cache is ignored and rewritten
    assert beta_cache.calibrated_beta0(model, settings, measure(-3.0), -4.0)[0] == -3.0
    assert json.loads(beta_cache.cache_path().read_text())
