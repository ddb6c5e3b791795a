"""StreamingLLM (Xiao et al., 2024) as a sanity lower bound for eviction (CriticalKV spec, section 4):
keep the first ``sinks`` entries (attention sinks, default 4) and the most recent ``b - sinks``.
Score = +1 for sinks, position / n for the rest, so top-b by score is exactly that set."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtool.kvcache.eviction import PRESSES, Press


@PRESSES.register("streamingllm")
@dataclass
class StreamingLLMPress(Press):
    sinks: int = 4

    def score(self, module, hidden_states, keys, values, position_embeddings):
        b, h, n, _ = keys.shape
        s = torch.arange(n, dtype=torch.float32, device=keys.device) / n
        s[: self.sinks] = 2.0
        return s.expand(b, h, n).clone()
