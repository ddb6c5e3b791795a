"""Record reference values from MarkLLM itself for ``tests/test_evade_markllm_compat.py``.

The test checks that llmtool's watermark schemes with ``markllm_compat: true`` reproduce MarkLLM's
green lists (KGW, Unigram), pseudo-random uniforms, token choice and p-values (EXP), and DiPmark's
permutations, reweighted distributions and detection scores. This script calls MarkLLM's own
helper classes (``*Utils`` and ``DIPLogitsProcessor``) with small stand-in config objects, so no
language model or tokenizer is needed, and writes ``tests/data/markllm_reference.json``.

Setup (never inside the project's virtual environment): MarkLLM's source checkout, because the PyPI
package ``markllm`` (0.1.5) has no DiPmark (its KGW/Unigram/EXP helpers are the same code as the
checkout's). The checkout imports its modules top-level (``utils``, ``watermark``), so its root goes
on ``sys.path``; torch, numpy, scipy and transformers must be importable. In a scratch directory::

    git clone https://github.com/THU-BPM/MarkLLM
    python3 -m venv mkl && mkl/bin/pip install torch numpy scipy transformers
    mkl/bin/python <llmtool>/benchmarks/markllm_record.py --markllm-src MarkLLM

Recorded with MarkLLM commit 112fa74 (2025) and torch 2.13 on CPU. MarkLLM's ``DIPConfig`` at that
commit no longer sets the ``hash_key`` its ``DIPUtils`` hashes (every DIP call raises
AttributeError); this script supplies the key exactly as the last revision that set it did
(commit 876ccb9: ``random.seed(key)`` then 1024 random bits as 128 big-endian bytes).

Everything runs on the CPU: MarkLLM seeds its generators on ``config.device``, and CUDA generators
give other permutations/uniforms than CPU ones, so MarkLLM run on a GPU is not reproduced.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "markllm_reference.json"
V_DEFAULT = 49152  # vocabulary of the packaged default model (SmolLM2)


# ---- inputs shared with the test (pure integer/float64 arithmetic, identical on every machine) ----

def reference_logits(vocab: int, salt: int) -> np.ndarray:
    """A deterministic float32 logit vector with a few dominant tokens (same function in the test)."""
    i = np.arange(vocab, dtype=np.int64)
    x = ((i * 2654435761 + salt * 40503) % 1000003) / 1000003.0
    logits = x * 6.0 - 3.0
    for k in range(5):
        logits[(salt * 7919 + k * 104729) % vocab] += 9.0 - 1.5 * k
    return logits.astype(np.float32)


def token_sequence(vocab: int, length: int, salt: int, repeat_every: int = 0) -> list[int]:
    """A deterministic token sequence; with ``repeat_every`` an earlier 8-token stretch recurs."""
    state = salt * 2862933555777941757 + 3037000493
    out = []
    for _ in range(length):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((state >> 33) % vocab)
    if repeat_every:
        for start in range(repeat_every, length - 8, repeat_every):
            out[start:start + 8] = out[:8]
    return out


def ids_digest(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


def f32_digest(values) -> str:
    return hashlib.sha256(np.asarray(values, dtype="<f4").tobytes()).hexdigest()


def id_list_record(ids) -> dict:
    ids = np.sort(np.asarray(ids, dtype=np.int64))
    return {"count": int(ids.size), "first50": ids[:50].tolist(), "sha256": ids_digest(ids)}


# ---- per scheme ----

def record_kgw(torch, KGWUtils) -> list[dict]:
    out = []
    for vocab, contexts in ((V_DEFAULT, ([17], [1234])), (1000, ([3], [999]))):
        cfg = SimpleNamespace(gamma=0.5, delta=2.0, hash_key=15485863, z_threshold=4.0, prefix_length=1,
                              f_scheme="time", window_scheme="left", vocab_size=vocab, device="cpu")
        utils = KGWUtils(cfg)
        greens = [id_list_record(utils.get_greenlist_ids(torch.tensor(c)).tolist()) for c in contexts]
        out.append({"config": {"vocab_size": vocab}, "contexts": [list(c) for c in contexts], "green": greens})
    return out


def record_unigram(torch, UnigramUtils) -> list[dict]:
    out = []
    for vocab, gamma, key in ((V_DEFAULT, 0.5, 15485863), (1000, 0.25, 12345)):
        cfg = SimpleNamespace(gamma=gamma, delta=2.0, hash_key=key, z_threshold=4.0, vocab_size=vocab, device="cpu")
        utils = UnigramUtils(cfg)
        seqs = [token_sequence(vocab, 60, 1), np.flatnonzero(utils.mask)[::97][:40].tolist()]
        scores = [utils.score_sequence(torch.tensor(s))[0] for s in seqs]
        out.append({"config": {"vocab_size": vocab, "gamma": gamma, "key": key},
                    "green": id_list_record(np.flatnonzero(utils.mask)),
                    "detect": [{"ids": s, "z": float(z)} for s, z in zip(seqs, scores)]})
    return out


def record_exp(torch, EXPUtils, scipy_stats) -> list[dict]:
    out = []
    for vocab, prefix, key in ((V_DEFAULT, 4, 15485863), (1000, 2, 99)):
        cfg = SimpleNamespace(prefix_length=prefix, hash_key=key, threshold=1e-4, top_k=-1, temperature=0.7,
                              vocab_size=vocab, device="cpu")
        utils = EXPUtils(cfg)

        def uniforms(context, utils=utils, vocab=vocab):
            utils.seed_rng(torch.tensor(context))
            return torch.rand(vocab, generator=utils.rng)

        contexts = [token_sequence(vocab, prefix, s) for s in (2, 3)] + [[1] * prefix]
        unif = []
        for c in contexts:
            u = uniforms(c).numpy()
            unif.append({"context": c, "first64": [float(x) for x in u[:64]], "sha256": f32_digest(u)})
        # detection exactly as MarkLLM's EXP.detect_watermark, on given ids instead of re-tokenised text
        detect = []
        seqs = [token_sequence(vocab, 40, 4)]
        chosen_seq = token_sequence(vocab, prefix, 5)  # a watermarked sequence: MarkLLM's own choices
        for t in range(30):
            probs = torch.softmax(torch.from_numpy(reference_logits(vocab, 100 + t))[None] / cfg.temperature, dim=-1)
            chosen_seq.append(int(utils.exp_sampling(probs, uniforms(chosen_seq))[0, 0]))
        seqs.append(chosen_seq)
        for s in seqs:
            arr = np.asarray(s, dtype=np.int64)
            total = 0
            for i in range(prefix, len(arr)):
                utils.seed_rng(arr[:i])
                r = torch.rand(vocab, generator=utils.rng)[arr[i]]
                total += math.log(1 / (1 - r))  # as MarkLLM: float32 tensor arithmetic, then math.log
            n = len(arr) - prefix
            detect.append({"ids": s, "total": float(total), "p": float(scipy_stats.gamma.sf(total, n, loc=0, scale=1)),
                           "n": n})
        # token choice for given logits at temperature 0.7 (MarkLLM's top-k branch fails: it gathers
        # from the 1-D uniform vector with 2-D indices, so only top_k <= 0 can be recorded)
        choices = []
        for salt in (7, 8, 9):
            ctx = token_sequence(vocab, prefix, salt)
            probs = torch.softmax(torch.from_numpy(reference_logits(vocab, salt))[None] / cfg.temperature, dim=-1)
            choices.append({"context": ctx, "logits_salt": salt,
                            "token": int(utils.exp_sampling(probs, uniforms(ctx))[0, 0])})
        out.append({"config": {"vocab_size": vocab, "prefix_length": prefix, "key": key, "temperature": 0.7},
                    "uniforms": unif, "detect": detect, "choices": choices})
    return out


def dip_hash_key(key: int) -> bytes:
    """The DIP key bytes as MarkLLM's DIPConfig derived them up to commit 876ccb9."""
    random.seed(key)
    return random.getrandbits(1024).to_bytes(128, "big")


def record_dip(torch, DIPUtils, DIPLogitsProcessor) -> list[dict]:
    out = []
    configs = ((V_DEFAULT, 0.5, 0.45, 42, 5), (64, 0.3, 0.3, 7, 3), (10, 0.30000001, 0.45, 3, 2))
    for vocab, gamma, alpha, key, prefix in configs:
        base = {"gamma": gamma, "alpha": alpha, "prefix_length": prefix, "z_threshold": 1.513,
                "hash_key": dip_hash_key(key), "vocab_size": vocab, "device": "cpu"}

        def make(ignore_gen=False, ignore_det=False, base=base):
            cfg = SimpleNamespace(**base, ignore_history_generation=ignore_gen, ignore_history_detection=ignore_det)
            utils = DIPUtils(cfg)
            return utils, DIPLogitsProcessor(cfg, utils)

        utils, proc = make()
        small = vocab <= 64
        # permutations
        perms = []
        for salt in (1, 2):
            ctx = token_sequence(vocab, prefix, salt)
            code = utils._extract_context_code(torch.tensor(ctx))
            seed = utils._get_rng_seed(code)
            perm = utils.from_random(torch.Generator().manual_seed(seed), vocab).numpy()
            perms.append({"context": ctx, "seed": seed, "first50": perm[:50].tolist(), "sha256": ids_digest(perm)})
        utils.cc_history.clear()
        # reweighting along one generation (the row grows by a token per step); the sequence repeats
        # with period prefix + 1, so the step at k = prefix + 1 sees the first step's context again
        steps = []
        seq = token_sequence(vocab, prefix + 1, 11) * 2
        rows = [seq[:prefix + k] for k in range(prefix + 3)]
        for k, row in enumerate(rows):
            logits = torch.from_numpy(reference_logits(vocab, 20 + k))[None]
            q = torch.softmax(proc(torch.tensor([row]), logits.clone()).double(), dim=-1)[0].numpy()
            rec = {"row": row, "logits_salt": 20 + k, "zeros": int((q == 0).sum())}
            if small:
                rec["q"] = q.tolist()
            else:
                top = np.argsort(-q, kind="stable")[:32]
                probe = np.arange(0, vocab, vocab // 32)[:32]
                idx = np.concatenate([top, probe])
                rec["index"] = idx.tolist()
                rec["q"] = q[idx].tolist()
            steps.append(rec)
        utils.cc_history.clear()
        # detection: MarkLLM's score_sequence, with and without history masking
        detect = []
        wm = token_sequence(vocab, prefix, 12)
        length = 24 if vocab == V_DEFAULT else 50  # every scored token costs a 49152-permutation in the test
        for _ in range(length - prefix):  # a watermarked sequence: always the last token of the permutation
            code = utils._extract_context_code(torch.tensor(wm))
            perm = utils.from_random(torch.Generator().manual_seed(utils._get_rng_seed(code)), vocab)
            wm.append(int(perm[-1]))
        utils.cc_history.clear()
        seqs = [token_sequence(vocab, length, 13), token_sequence(vocab, length + 6, 14, repeat_every=10), wm]
        for s in seqs:
            rec = {"ids": s}
            for label, ignore in (("masked", False), ("unmasked", True)):
                u, _ = make(ignore_det=ignore)
                u.state_indicator = 1  # as DIP.detect_watermark, which clears the history after each text
                z, _ = u.score_sequence(torch.tensor(s))
                u.cc_history.clear()
                scores = u._get_dip_score(torch.tensor(s), vocab)
                ignored = int((scores == -1).sum())
                rec[label] = {"z": float(z), "green": int((scores >= gamma).sum()), "n": len(s) - ignored}
            detect.append(rec)
        out.append({"config": {"vocab_size": vocab, "gamma": gamma, "alpha": alpha, "key": key, "prefix_length": prefix},
                    "perms": perms, "reweight": steps, "detect": detect})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markllm-src", required=True, help="Root of a MarkLLM source checkout.")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(args.markllm_src).resolve()))
    import scipy.stats
    import torch
    from watermark.dip.dip import DIPLogitsProcessor, DIPUtils
    from watermark.exp.exp import EXPUtils
    from watermark.kgw.kgw import KGWUtils
    from watermark.unigram.unigram import UnigramUtils

    torch.set_num_threads(1)
    ref = {
        "source": "MarkLLM (github THU-BPM/MarkLLM @112fa74), recorded by benchmarks/markllm_record.py",
        "torch": torch.__version__.split("+")[0], "numpy": np.__version__, "python": platform.python_version(),
        "logits_check": [{"vocab_size": v, "salt": 7, "sha256": f32_digest(reference_logits(v, 7))} for v in (1000, V_DEFAULT)],
        "kgw": record_kgw(torch, KGWUtils),
        "unigram": record_unigram(torch, UnigramUtils),
        "exp": record_exp(torch, EXPUtils, scipy.stats),
        "dip": record_dip(torch, DIPUtils, DIPLogitsProcessor),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(ref, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
