"""Classical LLM-PV baselines use the splits as spec llm-pv §4 says: train + val as the training set
for the learners with no validation use (XGBoost, random forest, logistic regression), early stopping
on val for the MLP."""
from __future__ import annotations

import random

import pytest

from llmtool.learn_program.baselines import BASELINES, run_baseline
from llmtool.learn_program.tasks import Dataset


def _split_rule_dataset():
    """Train labels follow bit 0, val and test follow bit 1 (train says nothing about bit 1): a learner
    that fits on train + val sees the test rule in half of its data, one that fits on train never."""
    rng = random.Random(0)

    def rows(n, bit):
        out = []
        for _ in range(n):
            x = "".join(rng.choice("01") for _ in range(8))
            out.append((x, int(x[bit] == "1")))
        return out

    return Dataset(train=rows(100, 0), val=rows(300, 1), test=rows(400, 1), meta={"kind": "binary", "length": 8})


@pytest.mark.parametrize("method", ["logreg", "random-forest", "xgboost"])
def test_learners_without_val_use_fit_on_train_plus_val(method):
    ds = _split_rule_dataset()
    rep = run_baseline(BASELINES.build(method), ds, seed=0)
    assert rep["fit_on"] == "train+val" and "val_acc" not in rep
    # bit 1 decides 300 of the 400 fitted labels; fitted on train alone, test accuracy would be ~50 %
    assert rep["test_acc"] >= 0.7, rep


def test_mlp_stops_early_on_val_and_fits_on_train():
    ds = _split_rule_dataset()
    rep = run_baseline(BASELINES.build("mlp"), ds, seed=0)
    assert rep["fit_on"] == "train" and "val_acc" in rep
    assert rep["train_acc"] >= 0.9  # it did learn its training rule (bit 0)
    assert rep["test_acc"] <= 0.65  # ... and did not see val's rule
