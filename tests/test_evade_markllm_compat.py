"""``markllm_compat`` reproduces MarkLLM exactly: values recorded from MarkLLM's own code by
benchmarks/markllm_record.py (tests/data/markllm_reference.json). Each scheme also checks that its
default mode differs, so a compat flag that did nothing would fail here. MarkLLM is not needed."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from llmtool.evade.watermarks import make_scheme

REF = json.loads((Path(__file__).parent / "data" / "markllm_reference.json").read_text(encoding="utf-8"))
COMPAT = {"markllm_compat": True}


def reference_logits(vocab: int, salt: int) -> np.ndarray:
    """Same function as in benchmarks/markllm_record.py (checked against the recorded digests)."""
    i = np.arange(vocab, dtype=np.int64)
    x = ((i * 2654435761 + salt * 40503) % 1000003) / 1000003.0
    logits = x * 6.0 - 3.0
    for k in range(5):
        logits[(salt * 7919 + k * 104729) % vocab] += 9.0 - 1.5 * k
    return logits.astype(np.float32)




def id_record(ids) -> dict:
    ids = np.sort(np.asarray(ids, dtype=np.int64))
    return {"count": int(ids.size), "first50": ids[:50].tolist(),
            "sha256": hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()}


def test_reference_inputs_are_reproduced():
    assert REF["kgw"] and REF["unigram"] and REF["exp"] and REF["dip"]
    for check in REF["logits_check"]:
        got = hashlib.sha256(reference_logits(check["vocab_size"], check["salt"]).astype("<f4").tobytes()).hexdigest()
        assert got == check["sha256"]


@pytest.mark.parametrize("case", REF["kgw"], ids=lambda c: f"V{c['config']['vocab_size']}")
def test_kgw_green_lists(case):
    V = case["config"]["vocab_size"]
    compat, default = make_scheme("kgw", V, COMPAT), make_scheme("kgw", V)
    for ctx, want in zip(case["contexts"], case["green"]):
        assert id_record(compat.green_list(ctx)) == want
        assert id_record(default.green_list(ctx))["sha256"] != want["sha256"]


@pytest.mark.parametrize("case", REF["unigram"], ids=lambda c: f"V{c['config']['vocab_size']}")
def test_unigram_green_list_and_scores(case):
    c = case["config"]
    cfg = {"gamma": c["gamma"], "key": c["key"]}
    compat = make_scheme("unigram", c["vocab_size"], {**cfg, **COMPAT})
    assert id_record(compat.green_ids) == case["green"]
    assert id_record(np.flatnonzero(compat.mask)) == case["green"]
    for d in case["detect"]:
        assert compat.detect(d["ids"]).score == pytest.approx(d["z"], abs=1e-12)
    default = make_scheme("unigram", c["vocab_size"], cfg)
    assert id_record(default.green_ids)["sha256"] != case["green"]["sha256"]


@pytest.mark.parametrize("case", REF["exp"], ids=lambda c: f"V{c['config']['vocab_size']}")
def test_exp_uniforms_choices_and_pvalues(case):
    c = case["config"]
    cfg = {"prefix_length": c["prefix_length"], "key": c["key"], "temperature": c["temperature"]}
    compat = make_scheme("exp", c["vocab_size"], {**cfg, **COMPAT})
    default = make_scheme("exp", c["vocab_size"], cfg)
    for u in case["uniforms"]:
        r = compat.uniforms(u["context"])
        assert r.dtype == np.float32
        assert r[:64].tolist() == u["first64"]
        assert hashlib.sha256(r.astype("<f4").tobytes()).hexdigest() == u["sha256"]
        assert default.uniforms(u["context"])[:64].tolist() != u["first64"]
    proc = compat.processor()
    for ch in case["choices"]:
        scores = torch.from_numpy(reference_logits(c["vocab_size"], ch["logits_salt"]))[None]
        out = proc(torch.tensor([ch["context"]]), scores.clone())
        assert int(torch.argmax(out[0])) == ch["token"]
        assert torch.isinf(out).sum() == c["vocab_size"] - 1
    for d in case["detect"]:
        det = compat.detect(d["ids"])
        assert det.n_scored == d["n"]
        assert det.score == pytest.approx(d["p"], rel=1e-9, abs=1e-300)
        assert math.isclose(-math.log(det.score) if det.score > 0 else 0, -math.log(d["p"]), rel_tol=1e-9)
    wm = case["detect"][-1]  # MarkLLM's own watermarked sequence: our default mode does not see it
    assert default.detect(wm["ids"]).score > 1e3 * wm["p"]


@pytest.mark.parametrize("case", REF["dip"], ids=lambda c: f"V{c['config']['vocab_size']}")
def test_dip_permutations_reweighting_and_scores(case):
    c = case["config"]
    V = c["vocab_size"]
    cfg = {"gamma": c["gamma"], "alpha": c["alpha"], "key": c["key"], "prefix_length": c["prefix_length"]}
    compat = make_scheme("dip", V, {**cfg, **COMPAT})
    default = make_scheme("dip", V, cfg)
    for p in case["perms"]:
        assert compat.perm_seed(p["context"]) == p["seed"]
        perm = compat.perm(p["context"])
        assert perm[:50].tolist() == p["first50"]
        assert hashlib.sha256(perm.astype("<i8").tobytes()).hexdigest() == p["sha256"]
        assert default.perm(p["context"])[:50].tolist() != p["first50"]

    # one generation, row growing by one token per step; repeated contexts keep the model's distribution
    proc = make_scheme("dip", V, {**cfg, **COMPAT, "temperature": 1.0}).processor()
    hot = make_scheme("dip", V, {**cfg, **COMPAT, "temperature": 0.7}).processor()
    plain = default.processor()
    differs = False
    for step in case["reweight"]:
        scores = torch.from_numpy(reference_logits(V, step["logits_salt"]))[None]
        ids = torch.tensor([step["row"]])
        q = torch.softmax(proc(ids, scores.clone()).double(), dim=-1)[0].numpy()
        assert int((q == 0).sum()) == step["zeros"]
        sel = q if "index" not in step else q[np.asarray(step["index"])]
        np.testing.assert_allclose(sel, step["q"], rtol=0, atol=1e-6)
        if step is case["reweight"][0]:  # the temperature acts after the reweighting: log q / T
            t = hot(ids, scores.clone())[0].double().numpy()
            finite = q > 0
            np.testing.assert_allclose(t[finite], np.log(q[finite]) / 0.7, rtol=1e-5, atol=1e-5)
        qd = torch.softmax(plain(ids, scores.clone()).double(), dim=-1)[0].numpy()
        sel_d = qd if "index" not in step else qd[np.asarray(step["index"])]
        differs |= not np.allclose(sel_d, step["q"], atol=1e-6)
    assert differs

    for d in case["detect"]:
        for label, skip in (("masked", None), ("unmasked", False)):
            want = d[label]
            det = make_scheme("dip", V, {**cfg, **COMPAT, "skip_repeated_detection": skip}).detect(d["ids"])
            assert det.n_scored == want["n"]
            assert det.score == pytest.approx(want["z"], abs=1e-6)
            assert det.score == want["z"]  # float32 arithmetic as MarkLLM: bit for bit
            green = det.score * math.sqrt(want["n"]) + (1 - c["gamma"]) * want["n"]
            assert round(green) == want["green"]
    wm = case["detect"][-1]
    assert default.detect(wm["ids"]).score != pytest.approx(wm["unmasked"]["z"], abs=1e-3)


def test_dip_skip_repeated_defaults_and_validation():
    from llmtool.core.console import UsageError

    on = make_scheme("dip", 100, COMPAT).config
    off = make_scheme("dip", 100).config
    assert on.skips("detection") and on.skips("generation")
    assert not off.skips("detection") and not off.skips("generation")
    assert make_scheme("dip", 100, {"skip_repeated_detection": True}).config.skips("detection")
    with pytest.raises(UsageError, match="skip_repeated_detection"):
        make_scheme("dip", 100, {"skip_repeated_detection": 1})
    with pytest.raises(UsageError, match="unknown field"):
        make_scheme("dip", 100, {"ignore_history": True})
    # default mode: a repeated context is skipped only when asked
    ids = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6]
    assert make_scheme("dip", 100).detect(ids).n_scored == len(ids) - 5
    assert make_scheme("dip", 100, {"skip_repeated_detection": True}).detect(ids).n_scored == 6
