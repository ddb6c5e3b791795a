"""select-data mixers: proxy data, DoReMi and RegMix on planted domains, the sampled stream, the CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_cli

from llmtool.select_data import proxies as P


class IntTokenizer:
    """Texts are space-separated token ids (planted data); id 0 is EOS."""
    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[int(t) for t in s.split()] for s in texts]}


def planted(n=60, length=60, seed=0):
    """Three domains: uniform noise over 40 ids (irreducible), a period-5 pattern and a period-11 pattern
    (both learnable)."""
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for _ in range(n):
        texts.append(" ".join(str(x) for x in rng.integers(1, 41, length)))
        labels.append("noise")
    for _ in range(n):
        st = int(rng.integers(5))
        texts.append(" ".join(str(41 + (st + j) % 5) for j in range(length)))
        labels.append("pattern5")
    perm = [50, 53, 51, 57, 52, 55, 54, 59, 56, 58, 60]
    for _ in range(n):
        st = int(rng.integers(11))
        texts.append(" ".join(str(perm[(st + j) % 11]) for j in range(length)))
        labels.append("pattern11")
    return texts, labels


SMALL = P.ProxySettings(layers=1, d_model=32, heads=2, context=32, vocab=64, batch_size=12, lr=3e-3, steps=60)


def test_compact_vocab_ranks_by_frequency_and_maps_the_rest_to_oov():
    m = P.compact_vocab([[5, 5, 5, 7, 7, 9], [9, 9, 9, 11]], vocab=4, always=(0,))
    assert m == {0: 0, 9: 1, 5: 2}                    # EOS first, then 9 (4×), 5 (3×); 7 and 11 → OOV 3


def test_domain_data_split_is_disjoint_and_natural_is_token_share():
    texts = [" ".join([str(10 + i)] * (3 + i)) for i in range(20)]   # each document one distinct id
    labels = ["a"] * 12 + ["b"] * 8
    d = P.build_domain_data(texts, labels, IntTokenizer(), vocab=64, val_fraction=0.25, seed=1)
    assert d.names == ["a", "b"] and d.docs == [12, 8]
    inv = {}
    for k in range(2):
        tr = set(d.train[k].tolist()) - {d.eos}
        va = set(d.val[k].tolist()) - {d.eos}
        assert va and tr and not tr & va                  # documents are held out whole
        inv[k] = tr | va
    assert not inv[0] & inv[1]                            # a domain's stream holds only its documents
    assert np.allclose(d.natural(), d.train_tokens() / d.train_tokens().sum())
    assert d.train_tokens().sum() + sum(len(v) for v in d.val) == sum(3 + i + 1 for i in range(20))


def test_windows_tile_short_streams():
    g = torch.Generator().manual_seed(0)
    w = P.windows(torch.tensor([1, 2, 3]), 4, 8, g)
    assert w.shape == (4, 8)
    for row in w.tolist():                                # consecutive tokens of the tiled 1 2 3 cycle
        assert all(b == a % 3 + 1 for a, b in zip(row, row[1:]))


def test_doremi_downweights_the_irreducible_domain():
    texts, labels = planted()
    d = P.build_domain_data(texts, labels, IntTokenizer(), vocab=64, seed=0)
    out = P.doremi(d, SMALL, ref_weights=d.natural(), per_domain=4)
    w = dict(zip(d.names, out["weights"]))
    assert abs(sum(w.values()) - 1) < 1e-9
    assert w["noise"] < 0.1 and w["pattern5"] > 0.25 and w["pattern11"] > 0.25, w
    assert out["trace"].shape == (SMALL.steps, 3)
    assert np.isfinite(out["ref_val"]).all() and np.isfinite(out["proxy_val"]).all()


def test_doremi_update_sees_the_new_weights():
    from llmtool.select_data.mixing import doremi_weights

    seen = []
    out = doremi_weights(lambda t, a: np.array([0.0, 1.0]), 2, 3, on_update=lambda t, a: seen.append(a.copy()))
    assert np.allclose(seen, out["trace"])                # Algorithm 1: θ is updated with α_t, not α_{t−1}


def test_regmix_sweep_learns_that_noise_weight_costs_loss():
    from scipy.stats import spearmanr

    from llmtool.select_data.mixing import regmix_weights

    texts, labels = planted()
    d = P.build_domain_data(texts, labels, IntTokenizer(), vocab=64, seed=0)
    nat = d.natural()
    sweep = P.regmix_sweep(d, SMALL, proxies=10, natural=nat, steps=30)
    assert (P.epochs_needed(sweep["mixtures"], d, SMALL, 30) <= 4 + 1e-9).all()
    noise = d.names.index("noise")
    assert spearmanr(sweep["mixtures"][:, noise], sweep["target"]).statistic > 0.5
    found = regmix_weights(sweep["mixtures"], sweep["target"], nat, candidates=5000, top=50, regressor="linear")
    assert found["weights"][noise] < nat[noise]


def test_regmix_rejects_impossible_epoch_caps():
    texts, labels = planted(n=4, length=10)
    d = P.build_domain_data(texts, labels, IntTokenizer(), vocab=64, seed=0)
    from llmtool.core.console import UsageError

    with pytest.raises(UsageError, match="max-epochs"):
        P.regmix_sweep(d, SMALL, proxies=4, natural=d.natural(), steps=50, max_epochs=0.01, max_draws=5)


def test_sample_stream_follows_weights_and_exhausts_before_repeating():
    labels = ["a"] * 50 + ["b"] * 50
    lengths = [10] * 100
    order, meta = P.sample_stream(labels, ["a", "b"], np.array([0.8, 0.2]), lengths, tokens=2000, seed=0)
    share_a = sum(1 for i in order if labels[i] == "a") / len(order)
    assert abs(share_a - 0.8) < 0.06 and meta["tokens"] >= 2000
    a_docs = [i for i in order if labels[i] == "a"]
    assert len(set(a_docs[:50])) == 50                    # no repeat before the domain is exhausted
    assert meta["epochs"]["a"] == pytest.approx(len(a_docs) / 50)


def _corpus(tmp_path, n=24):
    rows = []
    words = {"x": "apples and pears are fruit", "y": "the kernel boots the system", "z": "rain falls in the night"}
    for i in range(n):
        dom = "xyz"[i % 3]
        rows.append({"id": f"d{i}", "text": f"{words[dom]} {i}", "topic": dom})
    p = tmp_path / "corpus.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p, rows


def test_cli_mix_and_sample(tmp_path, tiny_llama_dir):
    corpus, rows = _corpus(tmp_path)
    w = tmp_path / "w.json"
    code, out, err = run_cli("--json", "select-data", "mix", corpus, "-o", w, "--method", "doremi", "--field", "topic",
                             "--tokenizer", tiny_llama_dir, "--steps", "3", "--proxy-d-model", "16",
                             "--proxy-heads", "2", "--proxy-vocab", "32", "--proxy-context", "8")
    assert code == 0, err
    doc = json.loads(w.read_text())
    assert doc["method"] == "doremi" and doc["domains"] == ["x", "y", "z"]
    assert abs(sum(doc["weights"]) - 1) < 1e-9 and len(doc["ref_val"]) == 3
    code, out, err = run_cli("--json", "select-data", "sample", corpus, "--weights", w, "--tokens", "200",
                             "--field", "topic", "--tokenizer", tiny_llama_dir, "-o", tmp_path / "s.jsonl")
    assert code == 0, err
    drawn = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert drawn and all(r in rows for r in drawn)
    assert json.loads(out)["tokens"] >= 200


def test_cli_mix_refuses_bad_input(tmp_path, tiny_llama_dir):
    corpus, _ = _corpus(tmp_path)
    code, _, err = run_cli("select-data", "mix", corpus, "-o", tmp_path / "w.json", "--method", "natural",
                           "--tokenizer", tiny_llama_dir)
    assert code == 2 and "no 'domain' field" in err and not (tmp_path / "w.json").exists()
    code, _, err = run_cli("select-data", "mix", corpus, "-o", tmp_path / "w.json", "--method", "natural",
                           "--field", "topic", "--tokenizer", tiny_llama_dir, "--steps", "5")
    assert code == 2 and "--steps" in err and not (tmp_path / "w.json").exists()
    bad = tmp_path / "w2.json"
    bad.write_text(json.dumps({"domains": ["x", "y"], "weights": [0.5, 0.5]}))
    code, _, err = run_cli("select-data", "sample", corpus, "--weights", bad, "--tokens", "50", "--field", "topic",
                           "--tokenizer", tiny_llama_dir, "-o", tmp_path / "s.jsonl")
    assert code == 2 and "no weight for domain(s) z" in err and not (tmp_path / "s.jsonl").exists()
