"""RTN baseline: no rotation; round-to-nearest per-channel symmetric weights (with the shared clip
search) and the same dynamic per-token activation quantizer as the rotating methods. Shows the
outlier problem that rotations address."""
from __future__ import annotations

from llmtool.quantize.configs import RTNConfig  # noqa: F401  (the method is its config: no rotation)
