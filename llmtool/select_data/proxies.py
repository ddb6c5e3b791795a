"""Proxy language models for the data mixers (GEM spec §3.6–3.8): per-domain token streams with a held-out
split, tiny Llama proxies trained on a weighted domain stream, DoReMi's reference + proxy loop (Xie et al.,
NeurIPS 2023, Algorithm 1), RegMix's proxy sweep (Liu et al., ICLR 2025, §3), and the training stream a
final mixture draws (§3.8). The weight mathematics (EG update, Dirichlet prior, regression, search) is in
:mod:`llmtool.select_data.mixing`.

The loops run on ``accelerate`` (``Accelerator`` places the proxy and optimizer). Under ``accelerate launch``
or ``torchrun`` with N processes every process draws the same *global* batch from one shared generator
(N x ``batch_size`` sequences, DoReMi: N x ``per_domain`` per domain) and trains on its own slice; DDP
averages the gradients and DoReMi's per-domain excess losses are averaged over processes before the weight
update, so N processes compute what one process computes with an N times larger batch (tested with 2). They are plain loops rather than the shared transformers ``Trainer`` because DoReMi's
step needs the reference model's per-token losses and a loss reweighted by the weights it has just updated.

Reconstructed choices [ours, stated in the docs]:

- Compact vocabulary: documents are tokenized with the main model's tokenizer and the ``vocab − 1`` most
  frequent ids of the corpus are kept (ties by id), every other id maps to one shared OOV id. The spec allows
  a byte-level or GPT-2 tokenizer for CPU proxies; keeping the main tokenizer's segmentation makes the proxy
  losses per domain measure the same tokens the main model is trained on, and a 4096-id output layer keeps a
  ~1M-parameter proxy (2 layers, d 128) cheap on a CPU.
- Held-out split: every document goes to validation with probability ``val_fraction`` (seeded), at least one
  document per domain when the domain has two or more; validation loss per domain is the token-weighted mean
  NLL over its held-out stream cut into ``context``-token pieces.
- Training sequences are ``context + 1`` token windows at a uniform random offset of the domain's stream of
  training documents (joined with EOS; a stream shorter than a window is tiled), so a small domain is reused
  rather than dropped; ``epochs`` per domain = tokens drawn / tokens in the stream.
- Optimiser: AdamW (β 0.9/0.95, weight decay 0.01, gradient norm clipped at 1), linear warm-up over 5 % of
  the steps then cosine decay to 10 % (the DoReMi/RegMix proxies' schedule shape); learning rate 1e-3 for a
  d-128 proxy.
- DoReMi batch: ``per_domain`` sequences from every domain; excess loss λ_k = mean over domain k's tokens of
  max(ℓ_θ − ℓ_ref, 0); the proxy's loss is Σ_k α_k · mean token loss of domain k with the α just updated.
- RegMix: every proxy shares one initialisation and one data-order seed (common random numbers, so the sweep
  varies the mixture only); the target loss is the mean of the per-domain validation losses (``uniform``) or
  their token-share-weighted mean (``natural``); mixtures needing more than ``max_epochs`` passes over a
  domain are redrawn, as in the paper.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from llmtool.core.console import UsageError


@dataclass
class ProxySettings:
    layers: int = 2
    d_model: int = 128
    heads: int = 4
    context: int = 128
    vocab: int = 4096
    batch_size: int = 32
    lr: float = 1e-3
    steps: int = 300
    seed: int = 0


@dataclass
class DomainData:
    """Per-domain token streams in the compact vocabulary."""
    names: list[str]
    train: list[torch.Tensor]
    val: list[torch.Tensor]
    vocab: int
    eos: int
    docs: list[int] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.names)

    def train_tokens(self) -> np.ndarray:
        return np.array([len(t) for t in self.train], dtype=np.float64)

    def natural(self) -> np.ndarray:
        t = self.train_tokens()
        return t / t.sum()


def compact_vocab(id_lists: Sequence[Sequence[int]], vocab: int, always: Sequence[int] = ()) -> dict[int, int]:
    """Map the ``vocab − 1`` most frequent ids (ties by id; ``always`` first) to 0.. ; OOV is ``vocab − 1``."""
    counts: dict[int, int] = {}
    for ids in id_lists:
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
    ranked = list(dict.fromkeys([*always, *sorted(counts, key=lambda i: (-counts[i], i))]))
    return {tok: j for j, tok in enumerate(ranked[:vocab - 1])}


def build_domain_data(texts: Sequence[str], labels: Sequence, tokenizer, *, vocab: int = 4096,
                      val_fraction: float = 0.1, seed: int = 0) -> DomainData:
    """Tokenize ``texts`` (one domain label each), build the compact vocabulary and the per-domain streams."""
    if len(texts) != len(labels):
        raise UsageError(f"{len(texts)} texts but {len(labels)} domain labels")
    if vocab < 16:
        raise UsageError(f"--proxy-vocab {vocab}: must be >= 16")
    names = sorted({str(lab) for lab in labels}, key=lambda s: (len(s), s) if s.isdigit() else (10**9, s))
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    enc = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    mapping = compact_vocab(enc, vocab, always=(eos,))
    oov = vocab - 1
    rng = np.random.default_rng(seed)
    is_val = rng.random(len(texts)) < val_fraction
    index = {n: j for j, n in enumerate(names)}
    by_dom: list[list[int]] = [[] for _ in names]
    for i, lab in enumerate(labels):
        by_dom[index[str(lab)]].append(i)
    train, val, docs = [], [], []
    for members in by_dom:
        v = [i for i in members if is_val[i]]
        if not v and len(members) >= 2:
            v = [members[int(rng.integers(len(members)))]]
        if len(v) == len(members):  # a one-document domain trains and validates on that document
            t = members
        else:
            vs = set(v)
            t = [i for i in members if i not in vs]
        train.append(_stream(enc, t, mapping, oov, eos))
        val.append(_stream(enc, v, mapping, oov, eos))
        docs.append(len(members))
    return DomainData(names=names, train=train, val=val, vocab=vocab, eos=mapping[eos], docs=docs)


def _stream(enc, members, mapping, oov, eos) -> torch.Tensor:
    out: list[int] = []
    for i in members:
        out.extend(mapping.get(t, oov) for t in enc[i])
        out.append(mapping[eos])
    return torch.tensor(out, dtype=torch.long)


def windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` windows of ``length`` tokens at uniform random offsets (a short stream is tiled)."""
    if len(stream) < length + 1:
        stream = stream.repeat(math.ceil((length + 1) / max(len(stream), 1)))
    starts = torch.randint(0, len(stream) - length + 1, (n,), generator=gen)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def new_proxy(data: DomainData, s: ProxySettings, seed: int):
    from llmtool.core.models import tiny_llama

    return tiny_llama(data.vocab, layers=s.layers, d_model=s.d_model, heads=s.heads, max_length=s.context,
                      seed=seed, eos_token_id=data.eos)


def token_losses(model, x: torch.Tensor) -> torch.Tensor:
    """Per-token next-token NLL [B, T − 1] of windows ``x`` [B, T]."""
    logits = model(input_ids=x[:, :-1]).logits.float()
    return F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")


def _optimizer(model, s: ProxySettings, steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, steps // 20)

    def lr_at(t: int) -> float:
        if t < warm:
            return (t + 1) / warm
        p = (t - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def _update(acc, model, opt, sched, loss) -> None:
    """One proxy update: backward through accelerate, global grad-norm clip 1, optimizer and schedule step."""
    acc.backward(loss)
    acc.clip_grad_norm_(model.parameters(), 1.0)  # torch's clip_grad_norm_ here; the sharded variant under FSDP
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _accelerator():
    from accelerate import Accelerator

    # cpu=True on a machine without CUDA: without it accelerate treats a CPU launch of N processes as N
    # independent single-process runs (DistributedType.NO), which would train N unsynchronised proxies
    return Accelerator(cpu=not torch.cuda.is_available())


def epochs_needed(weights: np.ndarray, data: DomainData, s: ProxySettings, steps: int) -> np.ndarray:
    drawn = np.asarray(weights, dtype=np.float64) * steps * s.batch_size * (s.context + 1)
    return drawn / np.maximum(data.train_tokens(), 1.0)


def train_on_mixture(data: DomainData, weights: np.ndarray, s: ProxySettings, *, steps: int | None = None,
                     seed: int | None = None, progress: Callable | None = None, desc: str = "proxy"):
    """Train a fresh proxy for ``steps`` updates on sequences whose domain is drawn from ``weights``."""
    steps = s.steps if steps is None else steps
    seed = s.seed if seed is None else seed
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (data.k,) or not np.all(np.isfinite(w)) or w.min() < 0 or w.sum() <= 0:
        raise UsageError(f"mixture weights must be {data.k} non-negative finite numbers")
    acc = _accelerator()
    model = new_proxy(data, s, seed)
    opt, sched = _optimizer(model, s, steps)
    model, opt = acc.prepare(model, opt)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)  # shared by all ranks: one global batch
    world, rank = acc.num_processes, acc.process_index
    probs = torch.tensor(w / w.sum())
    model.train()
    loop = progress(range(steps), desc, total=steps) if progress else range(steps)
    for _ in loop:
        doms = torch.multinomial(probs, s.batch_size * world, replacement=True, generator=gen)
        counts = torch.bincount(doms, minlength=data.k).tolist()
        x = torch.cat([windows(data.train[d], c, s.context + 1, gen) for d, c in enumerate(counts) if c])
        x = x[rank * s.batch_size:(rank + 1) * s.batch_size]     # this rank's slice of the global batch
        _update(acc, model, opt, sched, token_losses(model, x.to(acc.device)).mean())
    return acc.unwrap_model(model)


@torch.no_grad()
def domain_val_losses(model, data: DomainData, context: int, batch_size: int = 32) -> np.ndarray:
    """Token-weighted mean NLL of each domain's held-out stream (cut into ``context + 1``-token pieces)."""
    model.eval()
    dev = next(model.parameters()).device
    out = np.full(data.k, np.nan)
    for k, stream in enumerate(data.val):
        if len(stream) < 2:
            continue
        pieces = [stream[i:i + context + 1] for i in range(0, len(stream) - 1, context)]
        full = [p for p in pieces if len(p) == context + 1]
        tail = [p for p in pieces if 1 < len(p) < context + 1]
        tot, n = 0.0, 0
        for i in range(0, len(full), batch_size):
            lt = token_losses(model, torch.stack(full[i:i + batch_size]).to(dev))
            tot, n = tot + float(lt.sum()), n + lt.numel()
        for p in tail:
            lt = token_losses(model, p[None].to(dev))
            tot, n = tot + float(lt.sum()), n + lt.numel()
        out[k] = tot / n
    model.train()
    return out


def doremi(data: DomainData, s: ProxySettings, *, ref_weights: np.ndarray, steps: int | None = None,
           per_domain: int = 1, eta: float = 1.0, smooth: float = 1e-3, progress: Callable | None = None) -> dict:
    """DoReMi: a reference proxy on ``ref_weights``, then a proxy trained with Group DRO whose domain weights
    follow the exponentiated-gradient update; returns the step-averaged weights ᾱ and the trace."""
    from llmtool.select_data.mixing import doremi_weights

    steps = s.steps if steps is None else steps
    ref = train_on_mixture(data, ref_weights, s, steps=steps, seed=s.seed, progress=progress, desc="DoReMi reference")
    ref.eval()
    acc = _accelerator()
    proxy = new_proxy(data, s, s.seed + 1)
    opt, sched = _optimizer(proxy, s, steps)
    proxy, opt = acc.prepare(proxy, opt)
    ref = ref.to(acc.device)
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + 29)  # shared by all ranks: one global batch
    world, rank = acc.num_processes, acc.process_index
    state: dict = {}

    def excess(t: int, alpha: np.ndarray) -> np.ndarray:
        x = torch.stack([windows(data.train[d], per_domain * world, s.context + 1, gen) for d in range(data.k)])
        x = x[:, rank * per_domain:(rank + 1) * per_domain].reshape(-1, s.context + 1).to(acc.device)
        with torch.no_grad():
            l_ref = token_losses(ref, x)
        l_theta = token_losses(proxy, x)
        dom_theta = l_theta.view(data.k, -1).mean(1)                       # mean token loss per domain
        ex = (l_theta.detach() - l_ref).clamp_min(0).view(data.k, -1).mean(1)
        ex = acc.reduce(ex, "mean")
        state["dom_theta"] = dom_theta
        return ex.cpu().double().numpy()

    def update(t: int, alpha: np.ndarray) -> None:
        weights = torch.tensor(alpha, dtype=state["dom_theta"].dtype, device=acc.device)
        _update(acc, proxy, opt, sched, (weights * state["dom_theta"]).sum())

    proxy.train()
    out = doremi_weights(excess, data.k, steps, eta=eta, smooth=smooth, on_update=update,
                         progress=(lambda it: progress(it, "DoReMi proxy", total=steps)) if progress else None)
    out["ref_val"] = domain_val_losses(ref, data, s.context)
    out["proxy_val"] = domain_val_losses(acc.unwrap_model(proxy), data, s.context)
    return out


def target_loss(val: np.ndarray, natural: np.ndarray, target: str) -> float:
    ok = np.isfinite(val)
    if target == "uniform":
        return float(val[ok].mean())
    if target == "natural":
        return float((val[ok] * natural[ok]).sum() / natural[ok].sum())
    raise UsageError(f"--target {target!r}: uniform or natural")


def regmix_sweep(data: DomainData, s: ProxySettings, *, proxies: int, natural: np.ndarray, steps: int | None = None,
                 max_epochs: float = 4.0, target: str = "uniform", progress: Callable | None = None,
                 max_draws: int = 1000) -> dict:
    """Train one proxy per mixture drawn from RegMix's prior; returns mixtures [M, K], per-domain validation
    losses [M, K] and the target loss [M]."""
    from llmtool.select_data.mixing import dirichlet_mixtures

    steps = s.steps if steps is None else steps
    rng = np.random.default_rng(s.seed)
    mixtures, draws = [], 0
    while len(mixtures) < proxies:
        w = dirichlet_mixtures(natural, 1, rng)[0]
        draws += 1
        if epochs_needed(w, data, s, steps).max() <= max_epochs:
            mixtures.append(w)
        elif draws >= max_draws * proxies:
            raise UsageError(f"RegMix: no mixture within --max-epochs {max_epochs} after {draws} draws; raise "
                             "--max-epochs or lower --steps/--batch-size")
    mixtures = np.array(mixtures)
    vals = []
    loop = progress(range(proxies), "RegMix proxies", total=proxies) if progress else range(proxies)
    for i in loop:
        model = train_on_mixture(data, mixtures[i], s, steps=steps, seed=s.seed)
        vals.append(domain_val_losses(model, data, s.context))
    vals = np.array(vals)
    y = np.array([target_loss(v, natural, target) for v in vals])
    return {"mixtures": mixtures, "val": vals, "target": y, "draws": draws}


def regmix_predictability(w: np.ndarray, y: np.ndarray, splits: int = 10, test_fraction: float = 0.2,
                          seed: int = 0, regressor: str = "quadratic") -> dict:
    """Spearman ρ between predicted and measured target loss on held-out proxies over random splits."""
    from scipy.stats import spearmanr

    from llmtool.select_data.mixing import regmix_fit

    rng = np.random.default_rng(seed)
    m = len(y)
    n_test = max(3, int(round(test_fraction * m)))
    if m - n_test < 3:
        return {"splits": 0, "rho": [], "median": None, "iqr": None}
    rhos = []
    for _ in range(splits):
        perm = rng.permutation(m)
        te, tr = perm[:n_test], perm[n_test:]
        pred = regmix_fit(w[tr], y[tr], regressor=regressor)(w[te])
        rho = spearmanr(pred, y[te]).statistic
        rhos.append(float(rho) if np.isfinite(rho) else float("nan"))
    r = np.array(rhos)
    ok = r[np.isfinite(r)]
    return {"splits": splits, "rho": rhos, "median": float(np.median(ok)) if len(ok) else None,
            "iqr": [float(np.percentile(ok, 25)), float(np.percentile(ok, 75))] if len(ok) else None}


def sample_stream(labels: Sequence, names: Sequence[str], weights: np.ndarray, lengths: Sequence[int], tokens: int,
                  seed: int = 0) -> tuple[list[int], dict]:
    """Document indices of a training stream of ≈ ``tokens`` tokens drawn with domain ``weights``: each pick
    draws a domain from the weights, then that domain's next document from a seeded permutation (a domain
    repeats only after it is exhausted, and is reshuffled then). Returns the order and per-domain epochs."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) != len(names) or not np.all(np.isfinite(w)) or w.min() < 0 or w.sum() <= 0:
        raise UsageError(f"weights must be {len(names)} non-negative finite numbers with a positive sum")
    w = w / w.sum()
    rng = np.random.default_rng(seed)
    index = {str(n): j for j, n in enumerate(names)}
    members: list[list[int]] = [[] for _ in names]
    for i, lab in enumerate(labels):
        j = index.get(str(lab))
        if j is None:
            raise UsageError(f"document {i}: domain {lab!r} has no weight")
        members[j].append(i)
    empty = [names[j] for j in range(len(names)) if w[j] > 0 and not members[j]]
    if empty:
        raise UsageError(f"domains with weight but no documents: {', '.join(map(str, empty[:5]))}")
    orders = [list(rng.permutation(m)) if m else [] for m in members]
    pos = [0] * len(names)
    passes = [0] * len(names)
    used = np.zeros(len(names))
    picked, total = [], 0
    while total < tokens:
        j = int(rng.choice(len(names), p=w))
        if pos[j] == len(orders[j]):
            orders[j] = list(rng.permutation(members[j]))
            pos[j], passes[j] = 0, passes[j] + 1
        i = int(orders[j][pos[j]])
        pos[j] += 1
        picked.append(i)
        used[j] += lengths[i]
        total += lengths[i]
    sizes = np.array([sum(lengths[i] for i in m) for m in members], dtype=np.float64)
    epochs = {str(names[j]): float(used[j] / sizes[j]) if sizes[j] else 0.0 for j in range(len(names))}
    return picked, {"tokens": int(total), "documents": len(picked), "epochs": epochs}
