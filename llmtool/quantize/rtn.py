"""RTN baseline: no rotation; round-to-nearest per-channel symmetric weights (with the shared clip
search) and the same dynamic per-token activation quantizer as the rotating methods. Shows the
outlier problem that rotations address."""
from __future__ import annotations

from dataclasses import dataclass

from llmtool.quantize.api import METHODS, QuantConfig


@dataclass
class RTNConfig(QuantConfig):
    weight_algorithm: str = "rtn"

    def __post_init__(self):
        self.method = "rtn"


def rotate(model, config: RTNConfig, calib):
    return None, {}


METHODS.add("rtn", (RTNConfig, rotate))
