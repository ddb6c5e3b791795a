"""Keystone neurons: cross-task activation probing and ablation (with matched random controls).

Paper: Ji, Chen, Cai, Wang, Zhang, Chua, "Tiny Brains, Giant Impact: Uncovering the Keystone
Neurons of LLM with Just a Few Prompts", ICML 2026 (arXiv 2605.24846).

Neuron (family f, layer l, channel c) = one output channel of a projection in a decoder block
(f ∈ q, k, v, o, gate, up, down) or, for f = ``ffn``, one FFN intermediate unit (the input
channel c of down_proj, i.e. act(gate)·up).  [spec decision; the paper's 38 912 neurons/layer
of Llama-3.1-8B = q+k+v+o+gate+up widths]

Activation on probe p:  a_p(n) = mean_t |y_t[c]|  over the prompt's tokens (``skip_first_token``
drops t = 0).  Score (reconstructed, spec §3.1): per prompt rank all candidates by a_p (rank 0 =
largest); ``worst-rank``: s(n) = max_p rank_p(n), ascending, ties by mean activation; ``mean``:
descending mean_p a_p; ``min``: descending min_p a_p.  Ranks are global over the chosen families
(``rank_scope='global'``) or within each family (``'family'``).

Ablation zeroes the channel's output with a hook on a clone (never the residual stream): for a
projection, output channel c; for ``ffn``, the down_proj input channel c — identical to zeroing
row c of the weight (or column c of down_proj).  Controls: random neurons with the same family ×
layer histogram, excluding the keystone set.
"""
from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from llmtool.core.console import UsageError, progress
from llmtool.core import arch
from llmtool.core.arch import ROLES, decoder_layers, linear

# neuron family -> block role of the module holding it (``ffn``: the down_proj input channels)
MODULES = {**{r: r for r in ROLES}, "ffn": "down"}
DEFAULT_FAMILIES = ("q", "k", "v", "o", "gate", "up", "ffn")
SCORES = ("worst-rank", "mean", "min")
DATA = Path(__file__).parent / "data"


@dataclass
class Neuron:
    family: str
    layer: int
    channel: int
    score: float = 0.0
    mean_activation: float = 0.0
    per_prompt_activation: list[float] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.family, self.layer, self.channel)


def site(model, family: str, layer: int) -> tuple[torch.nn.Linear, int, int]:
    """(module, first channel, width) of a neuron family in ``layer``: the role's own Linear (offset 0), or
    the fused ``qkv_proj`` / ``gate_up_proj`` holding it with the role's row offset (Phi-3). An MoE layer's
    MLP families are refused (its experts are tensors, not Linears)."""
    block = decoder_layers(model)[layer]
    spec = arch.arch_of_layer(block)
    role = MODULES[family]
    if role in arch.MLP_ROLES and arch.is_moe_layer(block, spec):
        arch.refuse("edit keystone", spec.family, arch.P_EXPERTS,
                    f"layer {layer}'s MLP neurons live in per-expert tensors; pass --families q,k,v,o")
    hit = spec.fused_of(role)
    if hit is None:
        m = linear(block, role, spec)
        return m, 0, (m.in_features if family == "ffn" else m.out_features)
    name, sl = arch.role_slices(arch.layer_config(block), spec)[role]
    return block.get_submodule(spec.module_path(name)), sl.start, sl.stop - sl.start


def module_of(model, family: str, layer: int) -> torch.nn.Linear:
    return site(model, family, layer)[0]


def width(model, family: str, layer: int) -> int:
    return site(model, family, layer)[2]


def parse_families(text: str) -> list[str]:
    fams = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in fams if f not in MODULES]
    if bad or not fams:
        raise UsageError(f"--families: unknown {bad or text!r}; choose from {', '.join(MODULES)}")
    return fams


@torch.no_grad()
def probe_activations(model, token_ids: list[torch.Tensor], families: list[str], skip_first_token: bool = False
                      ) -> dict[str, torch.Tensor]:
    """{family: [P, n_layers, width]} of mean |activation| per prompt (float64)."""
    n_layers = len(decoder_layers(model))
    device = next(model.parameters()).device
    out = {f: torch.zeros(len(token_ids), n_layers, width(model, f, 0), dtype=torch.float64) for f in families}
    current = {"p": 0}

    def record(f, l, y, off, w):
        y = y[0] if y.dim() == 3 else y
        y = y[1:] if skip_first_token else y
        out[f][current["p"], l] = y[..., off:off + w].abs().double().mean(0).cpu()

    handles = []
    for f in families:
        for l in range(n_layers):
            m, off, w = site(model, f, l)
            if f == "ffn":
                handles.append(m.register_forward_pre_hook(
                    lambda mod, i, f=f, l=l, off=off, w=w: record(f, l, i[0], off, w)))
            else:
                handles.append(m.register_forward_hook(
                    lambda mod, i, o, f=f, l=l, off=off, w=w: record(f, l, o, off, w)))
    try:
        for p, ids in enumerate(progress(token_ids, "probing")):
            current["p"] = p
            model(input_ids=ids[None].to(device))
    finally:
        for h in handles:
            h.remove()
    return out


def rank_neurons(acts: dict[str, torch.Tensor], score: str = "worst-rank", rank_scope: str = "global",
                 top: int | None = None) -> list[Neuron]:
    if score not in SCORES:
        raise UsageError(f"unknown --score {score!r}; choose one of: {', '.join(SCORES)}")
    if rank_scope not in ("global", "family"):
        raise UsageError(f"unknown --rank-scope {rank_scope!r}; choose global or family")
    ids, blocks = [], []
    for f, a in acts.items():
        P, L, W = a.shape
        blocks.append(a.reshape(P, L * W))
        ids.extend((f, l, c) for l in range(L) for c in range(W))
    A = torch.cat(blocks, 1)  # [P, N]
    mean = A.mean(0)

    def ranks(block: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(block, dim=1, descending=True, stable=True)
        r = torch.empty_like(order)
        r.scatter_(1, order, torch.arange(block.shape[1]).expand_as(order).contiguous())
        return r

    if score == "worst-rank":
        if rank_scope == "global":
            R = ranks(A)
        else:
            R = torch.cat([ranks(b) for b in blocks], 1)
        s = R.max(0).values.double()
        order = sorted(range(len(ids)), key=lambda i: (s[i].item(), -mean[i].item()))
    else:
        s = mean if score == "mean" else A.min(0).values
        order = torch.argsort(s, descending=True, stable=True).tolist()
    order = order[:top] if top else order
    return [Neuron(*ids[i], score=float(s[i]), mean_activation=float(mean[i]),
                   per_prompt_activation=[float(x) for x in A[:, i]]) for i in order]


def group_channels(neurons: list[Neuron]) -> dict[tuple[str, int], list[int]]:
    groups: dict[tuple[str, int], list[int]] = {}
    for n in neurons:
        groups.setdefault((n.family, n.layer), []).append(n.channel)
    return groups


@contextmanager
def ablated(model, neurons: list[Neuron]) -> Iterator[None]:
    """Zero the neurons' channels with hooks (on clones) for the duration of the block."""
    handles = []
    for (f, l), chans in group_channels(neurons).items():
        m, off, _ = site(model, f, l)
        idx = torch.tensor(sorted(set(chans)), device=m.weight.device) + off
        if f == "ffn":
            def pre(mod, inputs, idx=idx):
                x = inputs[0].clone()
                x[..., idx] = 0
                return (x, *inputs[1:])
            handles.append(m.register_forward_pre_hook(pre))
        else:
            def post(mod, inputs, output, idx=idx):
                y = output.clone()
                y[..., idx] = 0
                return y
            handles.append(m.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def matched_random(model, neurons: list[Neuron], seed: int) -> list[Neuron]:
    """Random neurons with the same family × layer histogram as ``neurons``, none of them."""
    g = torch.Generator().manual_seed(seed)
    taken = {n.key for n in neurons}
    out = []
    for (f, l), count in Counter((n.family, n.layer) for n in neurons).items():
        pool = [c for c in torch.randperm(width(model, f, l), generator=g).tolist() if (f, l, c) not in taken]
        out.extend(Neuron(f, l, c) for c in pool[:count])
    return out


def load_texts(path: Path) -> list[dict]:
    from llmtool.core.data import read_jsonl

    return read_jsonl(path, required=("text",))


def default_probes() -> list[dict]:
    return load_texts(DATA / "keystone_probes.jsonl")


def default_eval_texts() -> list[dict]:
    return load_texts(DATA / "keystone_eval.jsonl")


def save_keystone(path: Path, neurons: list[Neuron], meta: dict) -> None:
    from llmtool.core.checkpoint import atomic_file

    with atomic_file(Path(path)) as tmp:
        Path(tmp).write_text(json.dumps({**meta, "neurons": [asdict(n) for n in neurons]}, indent=1))


def load_keystone(path: Path, k: int | None = None) -> list[Neuron]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such keystone file (make one with `llmtool edit keystone find`)")
    try:
        rows = json.loads(path.read_text())["neurons"]
        neurons = [Neuron(r["family"], int(r["layer"]), int(r["channel"]), float(r.get("score", 0)),
                          float(r.get("mean_activation", 0))) for r in rows]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path}: not a keystone file ({type(e).__name__}: {e})") from None
    for n in neurons:
        if n.family not in MODULES:
            raise UsageError(f"{path}: unknown family {n.family!r}")
    if k is not None and k > len(neurons):
        raise UsageError(f"--k {k}: {path} holds only {len(neurons)} neurons")
    return neurons[:k] if k is not None else neurons


@torch.no_grad()
def mean_ppl(model, token_ids: list[torch.Tensor]) -> float:
    """exp of the token-weighted mean NLL over the texts (each text one sequence)."""
    import math

    from llmtool.core.lm import token_nll

    total, count = 0.0, 0
    for ids in token_ids:
        total += float(token_nll(model, ids[None]).double().sum())
        count += ids.numel() - 1
    return math.exp(total / max(1, count))
