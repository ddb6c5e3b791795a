"""QuaRot baseline (Ashkboos et al., 2024): computational invariance with random Hadamard rotations.

Implemented here: RMSNorm gains folded and lm_head untied; one global randomised Hadamard
``R1 = diag(s) H_D`` (random ±1 signs) fused into every residual-stream reader/writer (embedding,
q/k/v, o, gate/up, down, lm_head); a random Hadamard of the head dim per layer fused into the value
rows and o_proj columns (QuaRot's per-head value rotation; the cross-head online Hadamard QuaRot adds
before o_proj is not used — a reconstructed simplification shared with the ReSpinQuant path); an
online Hadamard on the down_proj input (fused as ``W_down H``); the Q/K head-dim Hadamard after RoPE
when the KV cache is quantized. No training. GPTQ weights (same quantizer/calibration as the others).
"""
from __future__ import annotations

import torch

from llmtool.core import arch
from llmtool.core.models import decoder_layers
from llmtool.quantize import rotations as R


def rotate(model, config, calib):
    """Fuse QuaRot's random Hadamards into ``model``; returns ``(RotationSet, {})``."""
    n = len(decoder_layers(model))
    hd = arch.head_dim(model)
    g = torch.Generator().manual_seed(config.seed)
    R.prepare(model)
    R.fuse_down_hadamard(model)
    rot = R.RotationSet(n, arch.hidden_size(model), hd, tied=True, dtype=torch.float64)
    with torch.no_grad():
        rot.R1[0].copy_(R.random_hadamard(arch.hidden_size(model), g))
        for i in range(n):
            rot.R3[i].copy_(R.random_hadamard(hd, g))
    R.fuse(model, rot)
    return rot, {}
