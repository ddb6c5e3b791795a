"""Baselines for LLM-PV on the same splits (spec llm-pv §4): classical learners on the raw symbol
vector, a small transformer trained from scratch by gradient descent, and in-context learning with a
local model.

Reconstructed choices (ours):
- Features: one integer per input position (digits as their value, other characters as ``ord``),
  right-padded with -1 to the longest input; no feature engineering (the paper's setting).
- Classical learners (spec §4: "train+val used as the training set where a method has no validation
  use"): XGBoost (300 trees, depth 6, lr 0.1), random forest (500 trees) and logistic regression (lbfgs,
  C=1) have no use for validation data and fit on train + val (``fit_on`` in the report; their
  ``train_acc`` is over that set, and no ``val_acc`` is reported, as val was trained on). The MLP
  (2x256, Adam) stops early on val, as the spec says: it fits on train alone by ``partial_fit`` epochs
  (at most 500) and keeps the epoch of best val accuracy, stopping after 10 epochs without improvement
  (sklearn's ``n_iter_no_change``; sklearn's own ``early_stopping`` would hold out 10 % of train
  instead of using val).
- ``transformer``: 2 layers, d 128, 4 heads, learned positions, [CLS] pooling, AdamW (lr 1e-3), full-batch
  epochs; the epoch with the best validation accuracy is kept (validation used for model selection only).
- ``icl``: every training example in the prompt then the query; instead of sampling an answer we score
  the two possible answers ``{"label": "0"}`` / ``{"label": "1"}`` by their summed NLL under the model
  and take the likelier one (deterministic, never unparsable); ``--queries`` test inputs (paper: 100).
  When the examples do not fit the model's context (``max_position_embeddings``) with the longest query,
  the first ones that fit are kept and ``train_in_prompt`` in the report says how many (SmolLM2's 8,192
  tokens hold 76 of the 100 L = 100 binary examples, one token per digit, and 12 graph ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmtool.core.console import UsageError, progress
from llmtool.core.registry import MethodConfig, Registry, option

BASELINES = Registry("learn-program baseline")


def encode(xs: list[str], width: int | None = None):
    import numpy as np

    width = width or max(len(x) for x in xs)
    out = np.full((len(xs), width), -1, dtype=np.float32)
    for i, x in enumerate(xs):
        for j, ch in enumerate(x[:width]):
            out[i, j] = int(ch) if ch.isdigit() else ord(ch)
    return out


def _acc(pred, ys) -> float:
    import numpy as np

    return float((np.asarray(pred).astype(int) == np.asarray(ys)).mean()) if len(ys) else float("nan")


class _Sklearn(MethodConfig):
    """A scikit-learn-style learner without a validation use: fit on train + val (spec §4)."""

    def make(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def fit(self, Xtr, ytr, Xva, yva, seed: int):
        """Fit and return ``(classifier, what it was fitted on)``."""
        import numpy as np

        if len(yva):
            Xtr, ytr = np.concatenate([Xtr, Xva]), np.concatenate([ytr, yva])
        clf = self.make(seed)
        clf.fit(Xtr, ytr)
        return clf, ("train+val" if len(yva) else "train"), (Xtr, ytr)

    def fit_eval(self, ds, model=None, tokenizer=None, seed: int = 0) -> dict:
        import numpy as np

        width = max(len(x) for x, _ in ds.train + ds.val + ds.test)

        def xy(rows):
            return encode([x for x, _ in rows], width), np.array([y for _, y in rows], dtype=int)

        (Xtr, ytr), (Xva, yva) = xy(ds.train), xy(ds.val) if ds.val else (None, np.zeros(0, dtype=int))
        clf, fit_on, (Xfit, yfit) = self.fit(Xtr, ytr, Xva, yva, seed)
        res = {"fit_on": fit_on, "train_acc": _acc(clf.predict(Xfit), yfit)}
        splits = ("test",) if fit_on == "train+val" else ("val", "test")
        for split in splits:
            rows = getattr(ds, split)
            if rows:
                res[f"{split}_acc"] = _acc(clf.predict(encode([x for x, _ in rows], width)), [y for _, y in rows])
        return res


@BASELINES.config
@dataclass
class XGBoostConfig(_Sklearn):
    name: ClassVar[str] = "xgboost"
    help: ClassVar[str] = "Gradient-boosted trees on the raw symbol vector (xgboost)."
    n_estimators: int = option(300, "Number of trees.", min=1)
    max_depth: int = option(6, "Tree depth.", min=1)
    lr: float = option(0.1, "Learning rate.", min=0.0, exclusive_min=True)

    def make(self, seed):
        from xgboost import XGBClassifier

        return XGBClassifier(n_estimators=self.n_estimators, max_depth=self.max_depth, learning_rate=self.lr,
                             random_state=seed, n_jobs=1, verbosity=0)


@BASELINES.config
@dataclass
class RandomForestConfig(_Sklearn):
    name: ClassVar[str] = "random-forest"
    help: ClassVar[str] = "Random forest (scikit-learn)."
    n_estimators: int = option(500, "Number of trees.", min=1)

    def make(self, seed):
        from sklearn.ensemble import RandomForestClassifier

        return RandomForestClassifier(n_estimators=self.n_estimators, random_state=seed, n_jobs=1)


@BASELINES.config
@dataclass
class LogRegConfig(_Sklearn):
    name: ClassVar[str] = "logreg"
    help: ClassVar[str] = "Logistic regression (scikit-learn)."
    c: float = option(1.0, "Inverse regularisation strength C.", min=0.0, exclusive_min=True)

    def make(self, seed):
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(C=self.c, max_iter=2000, random_state=seed)


@BASELINES.config
@dataclass
class MLPConfig(_Sklearn):
    name: ClassVar[str] = "mlp"
    help: ClassVar[str] = "MLP 2x256, Adam, early stopping (scikit-learn)."
    hidden: int = option(256, "Units per hidden layer (two layers).", min=1)
    max_epochs: ClassVar[int] = 500
    patience: ClassVar[int] = 10

    def make(self, seed):
        from sklearn.neural_network import MLPClassifier

        return MLPClassifier(hidden_layer_sizes=(self.hidden, self.hidden), random_state=seed)

    def fit(self, Xtr, ytr, Xva, yva, seed: int):
        """Early stopping on val (spec §4): train on train by epochs, keep the best-val epoch."""
        import copy

        if not len(yva):
            clf = self.make(seed)
            clf.set_params(early_stopping=True, max_iter=self.max_epochs)
            clf.fit(Xtr, ytr)
            return clf, "train", (Xtr, ytr)
        clf, best, best_clf, stale = self.make(seed), -1.0, None, 0
        for _ in range(self.max_epochs):
            clf.partial_fit(Xtr, ytr, classes=[0, 1])
            v = _acc(clf.predict(Xva), yva)
            if v > best:
                best, best_clf, stale = v, copy.deepcopy(clf), 0
            else:
                stale += 1
                if stale >= self.patience:
                    break
        return best_clf, "train", (Xtr, ytr)


@BASELINES.config
@dataclass
class TransformerConfig(MethodConfig):
    name: ClassVar[str] = "transformer"
    help: ClassVar[str] = "Small transformer classifier trained from scratch by gradient descent."
    layers: int = option(2, "Transformer layers.", min=1)
    d_model: int = option(128, "Model width.", min=8)
    epochs: int = option(200, "Full-batch training epochs.", min=1)
    lr: float = option(1e-3, "AdamW learning rate.", min=0.0, exclusive_min=True)

    def validate(self) -> None:
        super().validate()
        if self.d_model % 4:
            raise UsageError(f"--d-model {self.d_model}: must be divisible by 4 (4 attention heads)")

    def fit_eval(self, ds, model=None, tokenizer=None, seed: int = 0) -> dict:
        import torch
        from torch import nn

        torch.manual_seed(seed)
        chars = sorted({c for x, _ in ds.train + ds.val + ds.test for c in x})
        vocab = {c: i + 2 for i, c in enumerate(chars)}  # 0 pad, 1 cls
        width = max(len(x) for x, _ in ds.train + ds.val + ds.test) + 1

        def tens(rows):
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            for i, (x, _) in enumerate(rows):
                ids[i, 0] = 1
                ids[i, 1:len(x) + 1] = torch.tensor([vocab[c] for c in x])
            return ids, torch.tensor([y for _, y in rows])

        class Net(nn.Module):
            def __init__(s):
                super().__init__()
                s.emb = nn.Embedding(len(vocab) + 2, self.d_model, padding_idx=0)
                s.pos = nn.Parameter(torch.randn(width, self.d_model) * 0.02)
                layer = nn.TransformerEncoderLayer(self.d_model, 4, 4 * self.d_model, dropout=0.1, batch_first=True)
                s.enc = nn.TransformerEncoder(layer, self.layers)
                s.head = nn.Linear(self.d_model, 2)

            def forward(s, ids):
                h = s.enc(s.emb(ids) + s.pos, src_key_padding_mask=ids == 0)
                return s.head(h[:, 0])

        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=self.lr, weight_decay=0.01)
        Xtr, ytr = tens(ds.train)
        Xva, yva = tens(ds.val)

        def acc(X, y):
            net.eval()
            with torch.no_grad():
                out = torch.cat([net(X[i:i + 1024]).argmax(-1) for i in range(0, len(X), 1024)])
            net.train()
            return float((out == y).float().mean())

        best, best_state = -1.0, None
        for _ in progress(range(self.epochs), "transformer epochs"):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(Xtr), ytr)
            loss.backward()
            opt.step()
            v = acc(Xva, yva) if len(ds.val) else 0.0
            if v > best:
                best, best_state = v, {k: t.clone() for k, t in net.state_dict().items()}
        net.load_state_dict(best_state)
        res = {"train_acc": acc(Xtr, ytr), "val_acc": acc(Xva, yva) if ds.val else float("nan")}
        if ds.test:
            res["test_acc"] = acc(*tens(ds.test))
        return res


@BASELINES.config
@dataclass
class ICLConfig(MethodConfig):
    name: ClassVar[str] = "icl"
    help: ClassVar[str] = "In-context learning with a local model (answers scored by NLL)."
    queries: int = option(100, "Test queries (paper: 100).", min=1)
    val_queries: int = option(100, "Validation queries also scored (0: none; ICL makes no use of them).", min=0)
    needs_model: ClassVar[bool] = True

    HEAD: ClassVar[str] = "Each input string has a binary label 0 or 1 given by a fixed rule. Examples:\n"
    TAIL: ClassVar[str] = '\n\nGive the label of the next input as a JSON object {"label": "0"} or {"label": "1"}.\nInput: '
    ANSWERS: ClassVar[tuple[str, str]] = ('{"label": "0"}', '{"label": "1"}')

    def prompt_head(self, tokenizer, train: list, limit: int | None) -> tuple[str, int]:
        """The shared prompt part with as many training examples (in order) as fit ``limit`` tokens
        together with the longest query and answer; returns it and the number of examples it holds."""
        from llmtool.core.lm import chat_prompt

        def head(n):
            return self.HEAD + "\n".join(f"{x} -> {y}" for x, y in train[:n]) + self.TAIL

        n = len(train)
        if limit is None:
            return head(n), n
        longest = max((x for x, _ in train), key=len, default="")
        room = limit - max(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in self.ANSWERS)

        def fits(k):
            return len(tokenizer(chat_prompt(tokenizer, head(k) + longest), add_special_tokens=False)["input_ids"]) <= room

        if fits(n):
            return head(n), n
        lo, hi = 0, n  # fits(lo) assumed; binary search for the largest count that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        if lo == 0 and not fits(0):
            raise UsageError(f"--method icl: the model's context ({limit} tokens) cannot hold the prompt and one query")
        return head(lo), lo

    def fit_eval(self, ds, model=None, tokenizer=None, seed: int = 0) -> dict:
        from llmtool.core.lm import chat_prompt

        if model is None:
            raise UsageError("--method icl needs --model MODEL (a local model directory or alias)")
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        head, n_in_prompt = self.prompt_head(tokenizer, list(ds.train), limit)
        res: dict = {"train_in_prompt": n_in_prompt, "train_size": len(ds.train)}
        for split, n in (("val", self.val_queries), ("test", self.queries)):
            rows = getattr(ds, split)[:n]
            if not rows:
                continue
            prompts = [chat_prompt(tokenizer, head + x) for x, _ in rows]
            nll0, nll1 = answer_nll(model, tokenizer, prompts, list(self.ANSWERS))
            pred = [int(b < a) for a, b in zip(nll0, nll1)]
            res[f"{split}_acc"] = _acc(pred, [y for _, y in rows])
            res[f"{split}_queries"] = len(rows)
        return res


def common_prefix_len(seqs: list[list[int]]) -> int:
    """How many leading tokens all of ``seqs`` share."""
    n = min(len(x) for x in seqs)
    for x in seqs[1:]:
        i = 0
        while i < n and x[i] == seqs[0][i]:
            i += 1
        n = i
    return n


def answer_nll(model, tokenizer, prompts: list[str], answers: list[str]) -> list[list[float]]:
    """Summed NLL of each answer after each prompt: ``out[a][i]`` for answer a and prompt i.

    Same tokenization as :func:`llmtool.core.lm.completion_nll` (prompt and answer tokenized apart,
    then concatenated), but the long shared part of the prompts (every training example) is prefilled
    once and its KV cache reused for every query; each query's own tokens and the answers' common first
    tokens are run once, then only each answer's remaining tokens, and the cache is cropped back after
    each. A query costs its own few tokens instead of the whole prompt, once instead of once per answer.
    """
    import torch

    from llmtool.core.lm import completion_nll
    from llmtool.learn_program.proposers import cache_kwarg, output_cache

    pids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    aids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers]
    if not pids:
        return [[] for _ in answers]
    # every prompt keeps >= 1 token of its own (its last predicts the answer), every answer >= 1 own token
    shared = min(common_prefix_len(pids), min(len(p) for p in pids) - 1)
    common = min(common_prefix_len(aids), min(len(a) for a in aids) - 1)
    dev = next(model.parameters()).device
    cache = None
    if shared > 0:
        with torch.no_grad():
            cache = output_cache(model(input_ids=torch.tensor([pids[0][:shared]], device=dev), use_cache=True))
    if cache is None or not getattr(cache, "is_croppable", False):
        return [completion_nll(model, tokenizer, prompts, [a] * len(prompts), batch_size=4) for a in answers]

    def run(ids):
        return model(input_ids=torch.tensor([ids], device=dev), use_cache=True,
                     **cache_kwarg(model, cache)).logits[0].float()

    out: list[list[float]] = [[] for _ in answers]
    with torch.no_grad():
        for p in pids:
            q = p[shared:] + aids[0][:common]
            # only the rows that predict answer tokens: row i predicts the answer's token i
            lp = torch.log_softmax(run(q)[len(p) - shared - 1:], dim=-1)
            base = -float(sum(lp[i, aids[0][i]] for i in range(common)))
            for j, a in enumerate(aids):
                tail = a[common:]
                nll = base - float(lp[-1, tail[0]])
                if len(tail) > 1:
                    lt = torch.log_softmax(run(tail[:-1]), dim=-1)
                    cache.crop(-(len(tail) - 1))  # negative: tokens to remove
                    nll -= float(lt.gather(1, torch.tensor(tail[1:], device=lt.device)[:, None]).sum())
                out[j].append(nll)
            cache.crop(-len(q))
    return out


def run_baseline(cfg: MethodConfig, ds, model=None, tokenizer=None, seed: int = 0) -> dict:
    return cfg.fit_eval(ds, model=model, tokenizer=tokenizer, seed=seed)
