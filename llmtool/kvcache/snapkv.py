"""SnapKV scorer (Li et al., 2024) as used by the CriticalKV paper (arXiv 2502.03805, spec 3.1).

Score of entry j for KV head h:
``s_j = mean_{q in group(h)} AvgPool_k( mean_{t in window} softmax(Q_win K^T / sqrt(d))_{t, j} )``
over the last ``w`` queries (post-RoPE, true positions, causal inside the window, softmax in fp32),
then 1-D average pooling with kernel ``k`` (stride 1, zero padding ``k // 2``, pad counted as in
``torch.nn.functional.avg_pool1d``). The ``w`` window entries get ``max(s)`` so they are always kept.
Defaults: w = 32, kernel 5. Keeps the top ``b`` entries per head (uniform budget).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmtool.kvcache.eviction import PRESSES, Press, window_attention


def snapkv_scores(module, hidden_states, keys, position_embeddings, window: int, kernel_size: int) -> torch.Tensor:
    n = keys.shape[-2]
    window = min(window, n)
    attn = window_attention(module, hidden_states, keys, position_embeddings, window)  # [B, Hq, w, n]
    s = attn[..., : n - window].mean(dim=-2)  # [B, Hq, n-w]
    if kernel_size > 1 and s.shape[-1] > 0:
        b, hq, m = s.shape
        s = F.avg_pool1d(s.reshape(b * hq, 1, m), kernel_size, stride=1, padding=kernel_size // 2).reshape(b, hq, -1)
    h_kv = keys.shape[1]
    s = s.view(s.shape[0], h_kv, -1, s.shape[-1]).mean(dim=2)  # GQA: mean over the group
    top = s.amax(dim=-1, keepdim=True) if s.shape[-1] else s.new_ones(*s.shape[:2], 1)
    return torch.cat([s, top.expand(*s.shape[:2], window)], dim=-1)


@PRESSES.register("snapkv")
@dataclass
class SnapKVPress(Press):
    kernel_size: int = 5

    def score(self, module, hidden_states, keys, values, position_embeddings):
        return snapkv_scores(module, hidden_states, keys, position_embeddings, self.window_size, self.kernel_size)
