"""AdaKV (Feng et al., 2024) head-adaptive budgets on top of SnapKV scores (CriticalKV spec 3.2).

Per layer with uniform budget ``b`` per head and ``H`` KV heads: each head's own top
``floor(alpha_safe * b)`` entries are first raised to the maximum score (safeguard, alpha_safe = 0.2),
then the top ``b * H`` scores over the flattened layer are selected; the budget of head ``h`` is the
number of selected entries that belong to it (so budgets sum to ``b * H``). The observation window
ranks above every scored entry when the safeguard is taken (kvpress' SnapKV pads it with
``max + 1``), so with ``int(alpha_safe * b) <= w`` the safeguard lies inside the window, as in the
official AdaKV/CriticalAdaKV presses (before this was matched, the head's top scored entry tied with
the window and was safeguarded too, shifting a budget by one). CriticalAdaKV keeps the safeguard
through its stage 2 (:meth:`AdaKVPress.safeguard_mask`, ``critical.py``). Head-varying budgets are
realised by gathering to the longest head and masking the padding (see ``eviction.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtool.kvcache.eviction import PRESSES, topk_mask, uniform_budget
from llmtool.kvcache.snapkv import SnapKVPress


def adakv_budgets(scores: torch.Tensor, b: int, alpha_safe: float = 0.2, window: int = 0) -> torch.Tensor:
    """Per-head budgets ``[B, H]`` summing to ``b * H`` per batch row. The last ``window`` entries
    of every head are always selected (they count toward the head's budget)."""
    bsz, h, n = scores.shape
    safe = int(alpha_safe * b)
    s = scores.clone()
    if window:
        s[..., n - window:] = float("inf")
    if safe > 0:  # on the window-raised scores: the window fills the safeguard first (kvpress)
        s = s.masked_fill(topk_mask(s, safe), float("inf"))
    flat = s.reshape(bsz, h * n)
    chosen = topk_mask(flat, min(b * h, h * n)).view(bsz, h, n)
    return chosen.sum(-1)


@PRESSES.register("adakv")
@dataclass
class AdaKVPress(SnapKVPress):
    alpha_safe: float = 0.2

    def layer_budgets(self, module, scores, n):
        b = uniform_budget(n, self.budget, self.window_size)
        return adakv_budgets(scores, b, self.alpha_safe, min(self.window_size, n))

    def safeguard_mask(self, scores: torch.Tensor) -> torch.Tensor:
        """The safeguard entries as a stage-2 selector sees them: each head's top
        ``int(alpha_safe * b)`` of ``scores`` as passed to ``select`` (observation window at
        ``+inf``, so the window fills the safeguard first, as kvpress' SnapKV padding with
        ``max + 1`` does). CriticalAdaKV carries them through its stage 2 (``critical.py``)."""
        b = uniform_budget(scores.shape[-1], self.budget, self.window_size)
        return topk_mask(scores, int(self.alpha_safe * b))
