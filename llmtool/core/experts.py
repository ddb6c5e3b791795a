"""Routed experts as ordinary Linears: :class:`LinearExperts`.

transformers 5 stores an MoE block's experts (Qwen3-MoE, Mixtral) as two 3-D parameters
(``gate_up_proj [E, 2I, D]``: gate rows then up rows; ``down_proj [E, D, I]``) inside one module called as
``experts(hidden [T, D], top_k_index [T, k], top_k_weights [T, k])``. A method that works per Linear
(low-rank factors, input statistics through forward hooks) sees none of them. :func:`unfuse_experts`
replaces each such module by a :class:`LinearExperts` holding one ``nn.Linear`` per expert and matrix
(``...mlp.experts.gate_up.E`` [2I, D], ``...mlp.experts.down.E`` [D, I]) and computing the same routed sum
``Σ_k w_k · down_e(act(gate_e(x)) · up_e(x))``; each Linear then sees exactly the tokens routed to its expert.
``core.arch.block_linears`` lists them (``experts.E.gate_up`` / ``experts.E.down``) once unfused.
"""
from __future__ import annotations

import torch
from torch import nn


class LinearExperts(nn.Module):
    def __init__(self, n: int, hidden: int, inter: int, act_fn, dtype=torch.float32, device=None):
        super().__init__()
        self.num_experts, self.act_fn = n, act_fn
        self.gate_up = nn.ModuleList(nn.Linear(hidden, 2 * inter, bias=False, dtype=dtype, device=device)
                                     for _ in range(n))
        self.down = nn.ModuleList(nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device) for _ in range(n))

    def linears(self) -> dict[str, nn.Module]:
        out = {}
        for e in range(self.num_experts):
            out[f"experts.{e}.gate_up"] = self.gate_up[e]
            out[f"experts.{e}.down"] = self.down[e]
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            gate, up = self.gate_up[e](hidden_states[tok]).chunk(2, dim=-1)
            y = self.down[e](self.act_fn(gate) * up) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


@torch.no_grad()
def unfuse_experts(model) -> int:
    """Replace every MoE layer's 3-D experts by :class:`LinearExperts` (same outputs); returns how many."""
    from llmtool.core import arch

    if not arch.is_supported(model) or arch.arch_of(model).experts is None:
        return 0
    count = 0
    for layer in arch.decoder_layers(model):
        if not arch.is_moe_layer(layer):
            continue
        spec = arch.arch_of_layer(layer)
        ex = arch.experts(layer, spec)
        if isinstance(ex, LinearExperts) or not hasattr(ex, spec.experts.gate_up):
            continue
        gu, dn = getattr(ex, spec.experts.gate_up), getattr(ex, spec.experts.down)
        n, two_i, d = gu.shape
        new = LinearExperts(n, d, two_i // 2, ex.act_fn, dtype=gu.dtype, device=gu.device)
        if gu.device.type != "meta":
            for e in range(n):
                new.gate_up[e].weight.copy_(gu[e])
                new.down[e].weight.copy_(dn[e])
        arch.set_module(layer, spec.experts.path, new)
        count += 1
    return count
