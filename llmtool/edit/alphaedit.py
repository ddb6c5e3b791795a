"""AlphaEdit (Fang et al., "AlphaEdit: Null-Space Constrained Knowledge Editing for Language
Models", ICLR 2025): the MEMIT update projected onto the null space of the preserved keys.

P_l = Û Ûᵀ with Û the left singular vectors of the mean key second moment C_l whose singular
values are below ``nullspace_threshold`` (0.02 by default). Per layer, in float64:

    U = solve(P (K Kᵀ + C_prev) + α I, P K Rsᵀ),   ΔW = Uᵀ

(no λC term; α = ``l2``, 10 by default for AlphaEdit). Every column of U lies in range(P), so
ΔW k_0 ≈ 0 for keys k_0 that span C_l's large directions. Targets (backward or forward anchor)
and the editing loop are the shared ones in ``memit.py``.
"""
from __future__ import annotations

import torch

from llmtool.edit.memit import METHODS, EditConfig, solve_update


def nullspace_projection(second_moment: torch.Tensor, threshold: float) -> torch.Tensor:
    C = second_moment.to(torch.float64)
    U, S, _ = torch.linalg.svd(C)
    small = U[:, S < threshold]
    return small @ small.T


@METHODS.register("alphaedit")
class AlphaEditSolve:
    def __init__(self, second_moment: torch.Tensor, cfg: EditConfig):
        self.P = nullspace_projection(second_moment, cfg.nullspace_threshold)
        self.cfg = cfg

    def delta(self, K: torch.Tensor, Rs: torch.Tensor, C_prev: torch.Tensor) -> torch.Tensor:
        K, Rs = K.to(torch.float64), Rs.to(torch.float64)
        eye = torch.eye(K.shape[0], dtype=torch.float64)
        alpha = 10.0 if self.cfg.l2 is None else self.cfg.l2
        A = self.P @ (K @ K.T + C_prev) + alpha * eye
        return solve_update(A, self.P @ K @ Rs.T, self.cfg.solver).T

    def describe(self) -> dict:
        return {"nullspace_dim": int(round(float(torch.trace(self.P))))}
