"""NLI entailment (llmtool.evade.entailment) on tiny random BERT classifiers, offline, and `evade quality
--nli-model`."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli, run_cli_subprocess

torch.set_num_threads(1)

NLI_LABELS = {0: "ENTAILMENT", 1: "NEUTRAL", 2: "CONTRADICTION"}
SRC = ["The capital of France is Paris, a large city on the Seine.",
       "She walked to the market in the rain and bought three apples.",
       "A single man in possession of a good fortune must be in want of a wife."]
HYP = ["Paris is big.",
       "In the rain she went to the market, where she bought apples and a loaf of bread for her mother.",
       "Every rich bachelor wants to marry."]


@pytest.fixture(scope="module")
def nli_factory(tmp_path_factory):
    """save(name, id2label, bias=None) -> a directory with one fixed random tiny BERT classifier (the same
    weights every time) under the given label names, with the packaged MiniLM WordPiece tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from llmtool.evade.similarity import model_dir

    root = tmp_path_factory.mktemp("nli")
    tok = AutoTokenizer.from_pretrained(model_dir(), local_files_only=True)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=512, num_labels=3, initializer_range=0.2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    base = BertForSequenceClassification(cfg).eval()
    with torch.no_grad():  # logits centred on the test pairs: the winning class differs between pairs and
        base.classifier.weight.normal_(0.0, 0.5)  # directions (src -> hyp: E N E, hyp -> src: C N C)
        logits = torch.cat([base(**tok(a, b, return_tensors="pt", padding=True)).logits
                            for a, b in ((SRC, HYP), (HYP, SRC))])
        base.classifier.bias -= logits.mean(0)
    state = {k: v.clone() for k, v in base.state_dict().items()}

    def save(name, id2label, bias=None):
        path = root / name
        if path.exists():
            return path
        n = len(id2label)
        c = BertConfig(**{**cfg.to_dict(), "id2label": dict(id2label),
                          "label2id": {v: k for k, v in id2label.items()}, "num_labels": n})
        model = BertForSequenceClassification(c)
        sd = {k: v[:n] if k.startswith("classifier.") else v for k, v in state.items()}
        model.load_state_dict(sd)
        if bias is not None:  # a constant winner: weight 0, the given bias
            with torch.no_grad():
                model.classifier.weight.zero_()
                model.classifier.bias.copy_(torch.tensor(bias))
        model.save_pretrained(path)
        tok.save_pretrained(path)
        return path

    return save


def manual_probs(path, premises, hypotheses):
    """The classifier run by hand, one pair at a time (no padding), premise first."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()
    rows = []
    with torch.no_grad():
        for p, h in zip(premises, hypotheses):
            enc = tok(p, h, return_tensors="pt")
            rows.append(torch.softmax(model(**enc).logits[0].double(), -1))
    return torch.stack(rows)


def test_entailment_matches_a_manual_computation(nli_factory):
    from llmtool.evade.entailment import NLIScorer

    path = nli_factory("ecn", NLI_LABELS)
    want = manual_probs(path, SRC, HYP)[:, 0].tolist()
    for batch_size in (1, 2, 16):  # padded batches give the same numbers
        got = NLIScorer(path, batch_size=batch_size).entailment(SRC, HYP)
        assert got == pytest.approx(want, abs=1e-6)
    # the pair order is premise first: the swapped encoding gives other numbers
    swapped = manual_probs(path, HYP, SRC)[:, 0].tolist()
    assert max(abs(a - b) for a, b in zip(want, swapped)) > 1e-3


def test_entailment_index_follows_id2label(nli_factory):
    from llmtool.evade.entailment import NLIScorer

    first = nli_factory("ecn", NLI_LABELS)
    last = nli_factory("cne", {0: "contradiction", 1: "neutral", 2: "entailment"})
    probs = manual_probs(first, SRC, HYP)  # same weights: the same matrix for both label orders
    assert torch.allclose(probs, manual_probs(last, SRC, HYP))
    a, b = NLIScorer(first), NLIScorer(last)
    assert (a.entail_index, b.entail_index) == (0, 2)
    assert a.entailment(SRC, HYP) == pytest.approx(probs[:, 0].tolist(), abs=1e-6)
    assert b.entailment(SRC, HYP) == pytest.approx(probs[:, 2].tolist(), abs=1e-6)
    assert max(abs(x - y) for x, y in zip(probs[:, 0], probs[:, 2])) > 1e-3


def test_two_class_labels_skip_not_entailment(nli_factory):
    from llmtool.evade.entailment import NLIScorer

    path = nli_factory("rte", {0: "not_entailment", 1: "entailment"})
    scorer = NLIScorer(path)
    assert scorer.entail_index == 1
    assert scorer.entailment(SRC, HYP) == pytest.approx(manual_probs(path, SRC, HYP)[:, 1].tolist(), abs=1e-6)


def test_both_directions(nli_factory):
    from llmtool.evade.entailment import NLIScorer

    path = nli_factory("ecn", NLI_LABELS)
    scorer = NLIScorer(path)
    res = scorer.both_directions(SRC, HYP)
    assert res["src_to_hyp"] == pytest.approx(scorer.entailment(SRC, HYP), abs=1e-9)
    assert res["hyp_to_src"] == pytest.approx(scorer.entailment(HYP, SRC), abs=1e-9)
    assert max(abs(a - b) for a, b in zip(res["src_to_hyp"], res["hyp_to_src"])) > 1e-3  # direction matters
    mins = [min(a, b) for a, b in zip(res["src_to_hyp"], res["hyp_to_src"])]
    fwd, bwd = manual_probs(path, SRC, HYP), manual_probs(path, HYP, SRC)
    both = [bool(f.argmax() == 0 and b.argmax() == 0) for f, b in zip(fwd, bwd)]
    s = res["summary"]
    assert res["bidirectional"] == pytest.approx(mins) and res["entailed_both"] == both
    assert s["pairs"] == 3
    assert s["src_to_hyp_mean"] == pytest.approx(sum(res["src_to_hyp"]) / 3)
    assert s["hyp_to_src_mean"] == pytest.approx(sum(res["hyp_to_src"]) / 3)
    assert s["bidirectional_mean"] == pytest.approx(sum(mins) / 3)
    assert s["bidirectional_mean"] <= min(s["src_to_hyp_mean"], s["hyp_to_src_mean"]) + 1e-12  # mean of minima
    assert s["entailed_both_share"] == pytest.approx(sum(both) / 3)
    # this model says entailment src -> hyp for pairs 0 and 2 but never hyp -> src: none counts
    assert [int(f.argmax()) for f in fwd] == [0, 1, 0] and not any(both)
    # the share counts argmax = entailment both ways: a head that always says entailment / always neutral
    yes = NLIScorer(nli_factory("always-e", NLI_LABELS, bias=[5.0, 0.0, 0.0])).both_directions(SRC, HYP)
    no = NLIScorer(nli_factory("always-n", NLI_LABELS, bias=[0.0, 5.0, 0.0])).both_directions(SRC, HYP)
    assert yes["summary"]["entailed_both_share"] == 1.0 and no["summary"]["entailed_both_share"] == 0.0
    assert yes["summary"]["bidirectional_mean"] == pytest.approx(torch.softmax(torch.tensor([5.0, 0, 0]), 0)[0].item())


@pytest.mark.parametrize("labels, message", [
    ({0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}, "not an NLI classifier (no label contains 'entail'; "
                                                  "id2label has: LABEL_0, LABEL_1, LABEL_2)"),
    ({0: "positive", 1: "negative"}, "id2label has: positive, negative"),
    ({0: "entailment", 1: "entails", 2: "neutral"}, "several labels contain 'entail'"),
])
def test_model_without_entailment_label_is_refused(nli_factory, labels, message):
    from llmtool.core.console import UsageError
    from llmtool.evade.entailment import NLIScorer, check_nli_model

    path = nli_factory("bad-" + "-".join(labels.values()), labels)
    for load in (check_nli_model, NLIScorer):
        with pytest.raises(UsageError) as e:
            load(path)
        assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_directories_are_refused(nli_factory, tmp_path):
    import shutil

    from llmtool.core.console import UsageError
    from llmtool.evade.entailment import NLIScorer

    with pytest.raises(UsageError, match="no such NLI model directory"):
        NLIScorer(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        NLIScorer(empty)
    # a bare encoder (no trained classifier head) would get a random head from transformers: refused
    from transformers import BertConfig, BertModel

    src = nli_factory("ecn", NLI_LABELS)
    bare = tmp_path / "bare"
    BertModel(BertConfig(**{**json.loads((src / "config.json").read_text()),
                            "architectures": ["BertForSequenceClassification"]})).save_pretrained(bare)
    shutil.copy(src / "config.json", bare / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, bare / f)
    with pytest.raises(UsageError, match="weights missing for classifier"):
        NLIScorer(bare)


def test_recorded_name_is_the_directory_name(tmp_path):
    from llmtool.evade.entailment import model_name

    assert model_name(tmp_path / "roberta-large-mnli") == "roberta-large-mnli"
    assert model_name(str(tmp_path / "nli-deberta-v3-base") + "/") == "nli-deberta-v3-base"


def _quality_input(tmp_path):
    path = tmp_path / "attacked.jsonl"
    path.write_text("".join(json.dumps({"id": i, "watermarked_text": s, "attacked_text": h}) + "\n"
                            for i, (s, h) in enumerate(zip(SRC, HYP))))
    return path


def test_quality_cli_bad_nli_model_is_one_error_line(tmp_path):
    proc = run_cli_subprocess("evade", "quality", _quality_input(tmp_path), "--nli-model", tmp_path / "no-such-nli")
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error:") and "no-such-nli: no such NLI model directory" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in proc.stderr


def test_quality_cli_refuses_non_nli_model_before_loading_anything(nli_factory, tiny_llama_dir, tmp_path,
                                                                  monkeypatch):
    import llmtool.core.models
    import llmtool.evade.similarity

    def boom(*a, **k):
        raise AssertionError("a model was loaded before --nli-model was checked")

    monkeypatch.setattr(llmtool.core.models, "load_model", boom)
    monkeypatch.setattr(llmtool.evade.similarity, "SentenceEmbedder", boom)
    path = nli_factory("bad-LABEL_0-LABEL_1-LABEL_2", {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"})
    code, _, err = run_cli("evade", "quality", _quality_input(tmp_path), "--ppl-model", tiny_llama_dir,
                           "--nli-model", path)
    assert code == 2 and "not an NLI classifier" in err and "LABEL_0, LABEL_1, LABEL_2" in err


def test_quality_cli_reports_nli(nli_factory, tiny_llama_dir, tmp_path):
    from llmtool.evade.entailment import NLIScorer

    src = _quality_input(tmp_path)
    path = nli_factory("ecn", NLI_LABELS)
    code, out, err = run_cli("--json", "evade", "quality", src, "--ppl-model", tiny_llama_dir, "--nli-model", path)
    assert code == 0, err
    got = json.loads(out)
    want = NLIScorer(path).both_directions(SRC, HYP)["summary"]
    assert got["texts"] == 3
    for key in ("src_to_hyp_mean", "hyp_to_src_mean", "bidirectional_mean", "entailed_both_share"):
        assert got[f"nli_{key}"] == pytest.approx(want[key], abs=1e-6)
    code, out, err = run_cli("--json", "evade", "quality", src, "--ppl-model", tiny_llama_dir)
    assert code == 0, err
    plain = json.loads(out)
    assert set(plain) == {"texts", "similarity_mean", "ppl_src_median", "ppl_hyp_median"}
    assert {k: got[k] for k in plain} == pytest.approx(plain)
