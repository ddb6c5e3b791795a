"""PyramidKV (Cai et al., 2024) budgets on top of SnapKV scores (CriticalKV spec 3.2).

Per-layer budgets decrease linearly from the bottom layer to the top with the same total as the
uniform budget ``b`` (window ``w`` included): with ``B' = b - w``, ``min = B'/beta``,
``max = 2 B' - min``, layer ``l`` of ``L`` keeps ``w + max - l (max - min)/(L - 1)`` entries per head
(beta = 20, the PyramidKV default). Reconstructed choices: budgets are floored to integers and
clamped to ``[w, n]``; with one layer the budget is ``b``. Inside a layer all heads share the budget
(gathered physically).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtool.kvcache.eviction import PRESSES, uniform_budget
from llmtool.kvcache.snapkv import SnapKVPress


def pyramid_budget(layer: int, num_layers: int, b: int, window: int, n: int, beta: float = 20.0) -> int:
    spare = max(b - window, 0)
    if num_layers <= 1 or spare == 0:
        return b
    lo = spare / beta
    hi = 2 * spare - lo
    per_layer = window + hi - layer * (hi - lo) / (num_layers - 1)
    return int(min(n, max(window, int(per_layer))))


@PRESSES.register("pyramidkv")
@dataclass
class PyramidKVPress(SnapKVPress):
    beta: float = 20.0

    def layer_budgets(self, module, scores, n):
        b = uniform_budget(n, self.budget, self.window_size)
        nl = num_layers_of_module(module)
        bl = pyramid_budget(module.layer_idx, nl, b, min(self.window_size, n), n, self.beta)
        return torch.full(scores.shape[:2], bl, dtype=torch.long, device=scores.device)


def num_layers_of_module(module) -> int:
    return module.config.get_text_config(decoder=True).num_hidden_layers if hasattr(module, "config") else 1

