"""MEMIT (Meng et al., "Mass-Editing Memory in a Transformer", ICLR 2023): the per-layer
key/value least-squares update of ``mlp.down_proj`` and the multi-layer editing loop shared by
every locate-then-edit method here (``alphaedit`` swaps only the solve; the ``anchor`` option
swaps only the targets, see ``anchors.py``).

For edited layer l with keys K (d_ff × n: down_proj inputs at the subject's last token, averaged
over the template group ["{}"] and the group of generated templates, then over the two groups)
and residuals Rs (d_model × n), in float64:

    U = solve(K Kᵀ + C_prev + λ C_l + μ I, K Rsᵀ),   ΔW_l = Uᵀ,   W_l ← W_l + ΔW_l

the closed form of  min_Δ ‖(W+Δ)K − (WK + Rs)‖² + λ‖Δ K_0‖²  with λ C_l = λ E[k kᵀ] (C_l is the
MEAN second moment, so λ = ``mom2_update_weight`` is comparable with the MEMIT/FE configs).
``C_prev`` holds Σ K Kᵀ of batches edited before (sequential editing); zero in one-batch mode.

Residuals: backward anchor: Rs = (z − h_{l_L}^{cur}) / (L − i) at loop index i; forward anchor:
Rs = z_l − h_l^{cur}. ``h^{cur}`` is always re-measured on the partially edited model; all
targets are computed before any weight of the batch changes. After each layer the remaining-
residual ratio ‖z_L − h_L^{cur}‖_F / ‖z_L − h_L^{(0)}‖_F (over the batch) is recorded.

Families with a post-feedforward norm (Gemma 2/3 sandwich norms; ``core.arch``): the down projection does not
write the residual stream directly, so each layer's residuals Rs are first mapped to down_proj-output
residuals through the norm's inverse (:func:`through_post_norm`, derived there). MoE layers are refused by
name (``edit.layerio.down_proj``): their down projection is one of several experts chosen per token.

``solver='pinv'`` uses the pseudo-inverse (minimum-norm solution; needed when λ = μ = 0 and
n < d_ff, as in the spec's exactness tests).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from llmtool.core.console import info, progress
from llmtool.core.registry import Registry
from llmtool.edit.anchors import ANCHORS, ZConfig, bare_batch, compute_z_batch, fill, forward_replay
from llmtool.core.arch import decoder_layers
from llmtool.edit.layerio import capture_at, down_proj
from llmtool.edit.prompts import pad_batch, subject_last_index
from llmtool.edit.requests import EditRequest

METHODS = Registry("edit")


@dataclass
class EditConfig:
    layers: list[int] = field(default_factory=lambda: [3, 4, 5, 6, 7])
    method: str = "memit"
    anchor: str = "backward"
    z: ZConfig = field(default_factory=ZConfig)
    mom2_update_weight: float = 15000.0
    l2: float | None = None            # μ (MEMIT, default 0) or α (AlphaEdit, default 10)
    nullspace_threshold: float = 0.02  # AlphaEdit
    batch_size: int = 0                # 0 = every request in one batch
    solver: str = "solve"              # solve | pinv
    z_batch: int = 8                   # requests optimised together in compute_z (speed only)

    def to_json(self) -> dict:
        return asdict(self)


def solve_update(A: torch.Tensor, B: torch.Tensor, solver: str) -> torch.Tensor:
    if solver == "pinv":
        return torch.linalg.pinv(A, hermitian=True) @ B
    return torch.linalg.solve(A, B)


@METHODS.register("memit")
class MemitSolve:
    """ΔW = [ (K Kᵀ + C_prev + λ C + μ I)^{-1} K Rsᵀ ]ᵀ."""

    def __init__(self, second_moment: torch.Tensor, cfg: EditConfig):
        self.C = second_moment.to(torch.float64)
        self.cfg = cfg

    def delta(self, K: torch.Tensor, Rs: torch.Tensor, C_prev: torch.Tensor) -> torch.Tensor:
        K, Rs = K.to(torch.float64), Rs.to(torch.float64)
        eye = torch.eye(K.shape[0], dtype=torch.float64)
        mu = 0.0 if self.cfg.l2 is None else self.cfg.l2
        A = K @ K.T + C_prev + self.cfg.mom2_update_weight * self.C + mu * eye
        return solve_update(A, K @ Rs.T, self.cfg.solver).T

    def describe(self) -> dict:
        return {}


@torch.no_grad()
def compute_keys(model, tok, requests: list[EditRequest], layer: int, templates: list[str],
                 chunk: int = 64) -> torch.Tensor:
    """K (d_ff × n): down_proj input at the subject's last token, averaged within the template
    groups [["{}"], generated] and then across groups."""
    device = next(model.parameters()).device
    groups = [[t for t in templates if t == "{}"], [t for t in templates if t != "{}"]]
    groups = [g for g in groups if g]
    seqs, lookups, owner = [], [], []
    for r_i, r in enumerate(requests):
        for g_i, g in enumerate(groups):
            for t in g:
                ids, idx = subject_last_index(tok, fill(t, r.prompt), r.subject)
                seqs.append(ids)
                lookups.append(idx)
                owner.append((r_i, g_i))
    keys = []
    for s in range(0, len(seqs), chunk):
        batch = pad_batch(seqs[s:s + chunk], tok.pad_token_id or 0, device)
        keys.append(capture_at(model, batch, torch.tensor(lookups[s:s + chunk], device=device), [layer], "key")[layer])
    keys = torch.cat(keys).double().cpu()
    d = keys.shape[1]
    sums = torch.zeros(len(requests), len(groups), d, dtype=torch.float64)
    counts = torch.zeros(len(requests), len(groups), 1, dtype=torch.float64)
    for row, (r_i, g_i) in enumerate(owner):
        sums[r_i, g_i] += keys[row]
        counts[r_i, g_i] += 1
    return (sums / counts).mean(1).T


@torch.no_grad()
def hidden_at(model, tok, requests: list[EditRequest], layers: list[int]) -> dict[int, torch.Tensor]:
    device = next(model.parameters()).device
    batch, pos = bare_batch(tok, requests, device)
    return {l: v.double().cpu() for l, v in capture_at(model, batch, pos, layers, "out").items()}


def compute_targets(model, tok, requests: list[EditRequest], cfg: EditConfig, templates: list[str]
                    ) -> tuple[dict[int, torch.Tensor], list[dict]]:
    """Per-layer targets {layer: [n, d_model]} for the configured anchor (backward: only the last
    layer's z; forward: z_1 and its replayed successors), and per-request optimisation logs."""
    if cfg.anchor not in ANCHORS:
        raise ValueError(f"unknown anchor {cfg.anchor!r}")
    layers = sorted(cfg.layers)
    l_star = layers[-1] if cfg.anchor == "backward" else layers[0]
    zs, logs = [], []
    size = max(1, cfg.z_batch)
    chunks = [requests[s:s + size] for s in range(0, len(requests), size)]
    for chunk in progress(chunks, f"optimising targets at layer {l_star} ({size} requests per batch)"):
        for res in compute_z_batch(model, tok, chunk, l_star, templates, cfg.z):
            zs.append(res.z)
            logs.append({"layer": l_star, "loss": res.loss, "steps": res.steps,
                         "delta_norm_ratio": float((res.z - res.h_init).norm() / res.h_init.norm())})
    z = torch.stack(zs)
    if cfg.anchor == "backward":
        return {l_star: z.double().cpu()}, logs
    return {l: v.double().cpu() for l, v in forward_replay(model, tok, requests, z, layers).items()}, logs


def post_norm_preimage(y: torch.Tensor, g: torch.Tensor, eps: float, Rs: torch.Tensor) -> torch.Tensor:
    """The down_proj-output change ``y* − y`` (rows of ``y``, ``Rs``: [n, d]) that moves a post-norm MLP
    contribution ``N(y) = g ⊙ y / sqrt(rms(y)² + ε)`` by ``Rs``, or, where no output reaches ``N(y) + Rs``,
    the change to the closest reachable contribution.

    [Derived here.] Write ``u = y* / sqrt(rms(y*)² + ε)``: ``N(y*) = g ⊙ u``, and ``u`` ranges over the
    vectors with ``rms(u) < 1``. Let ``T = N(y) + Rs``, ``r = rms(y)``, ``ρ_y = r / sqrt(r² + ε)`` (the rms of
    y's own normalised vector ``ŷ``), and ``u₀ = T / g`` on coordinates with ``g_i ≠ 0`` (0 where ``g_i = 0``:
    those coordinates contribute nothing whatever ``y*_i`` is), ``ρ = rms(u₀)``.
    * ``g`` has zero coordinates and ``ρ ≤ ρ_y``: fill them with ``α ŷ_i`` so that ``rms(u) = ρ_y`` and take
      ``y* = r u / ρ_y`` (y's own scale; exact; ``Rs = 0`` gives ``y* = y``);
    * else ``ρ < 1`` (by more than 1e-6): ``y* = c u₀ / ρ`` with ``c / sqrt(c² + ε) = ρ``, i.e.
      ``c = ρ sqrt(ε / (1 − ρ²))`` (exact);
    * else (unreachable, e.g. a gain near 0 divides a residual): the closest reachable contribution at y's
      scale, ``argmin_u ‖g ⊙ u − T‖`` subject to ``rms(u) = ρ_y``, whose Lagrange condition gives
      ``u_i = g_i T_i / (g_i² + μ)`` with the ``μ ≥ 0`` meeting the constraint (bisection: the rms falls as μ
      grows); ``y* = r u / ρ_y``, so ``N(y*) = g ⊙ u``. MEMIT's remaining-residual ratio logs what stays
      unreached.
    Gemma 3 270M's checkpoint has post-feedforward gains exactly 0 in some coordinates (``1 + w``, ``w = −1``);
    dividing by them made every Gemma edit NaN before this form."""
    y, g, Rs = y.double(), g.double(), Rs.double()
    r = y.pow(2).mean(-1, keepdim=True).sqrt()
    y_hat = y / (r.pow(2) + eps).sqrt()              # N(y) = g ⊙ y_hat
    T = g * y_hat + Rs
    live = g != 0
    u0 = torch.where(live, T / torch.where(live, g, torch.ones_like(g)), torch.zeros_like(T))
    rho = u0.pow(2).mean(-1, keepdim=True).sqrt()
    rho_y = r / (r.pow(2) + eps).sqrt()
    # case 1: fill dead coordinates with y's own values at y's scale
    dead_ms = torch.where(live, torch.zeros_like(y_hat), y_hat).pow(2).mean(-1, keepdim=True)
    alpha = ((rho_y.pow(2) - rho.pow(2)).clamp(min=0) / dead_ms.clamp(min=1e-300)).sqrt()
    u_fill = torch.where(live, u0, alpha * y_hat)
    fill = (~live).any() & (rho <= rho_y) & (dead_ms > 0)
    y_fill = r * u_fill / rho_y
    # case 2: exact at the scale c
    gap = (1 - rho.pow(2)).clamp(min=0)
    exact = gap > 1e-6
    c = rho * (eps / gap.clamp(min=1e-300)).sqrt()
    y_exact = c * u0 / rho.clamp(min=1e-300)
    # case 3: closest reachable point with rms(u) = ρ_y
    gT, g2 = g * T, g * g

    def rms_at(mu):
        return (gT / (g2 + mu).clamp(min=1e-300)).pow(2).mean(-1, keepdim=True).sqrt()

    lo, hi = torch.zeros_like(r), torch.ones_like(r)
    for _ in range(200):                               # grow hi until rms(u(hi)) ≤ ρ_y
        need = rms_at(hi) > rho_y
        if not bool(need.any()):
            break
        hi = torch.where(need, hi * 4, hi)
    for _ in range(100):
        mid = (lo + hi) / 2
        above = rms_at(mid) > rho_y
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    u_p = gT / (g2 + hi).clamp(min=1e-300)
    u_p = u_p * (rho_y / u_p.pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-300))
    y_proj = r * u_p / rho_y
    y_star = torch.where(fill, y_fill, torch.where(exact, y_exact, y_proj))
    return y_star - y


@torch.no_grad()
def through_post_norm(model, tok, requests: list[EditRequest], layer: int, Rs: torch.Tensor) -> torch.Tensor:
    """The down_proj-output residuals that move layer ``layer``'s output by ``Rs`` ([n, d_model]).

    Without a post-feedforward norm (Llama, Qwen, Phi-3) the down projection writes the residual
    stream directly and this is ``Rs``. With one (Gemma 2/3 sandwich norms, ``N(y) = g ⊙ y / rms_ε(y)``
    with g = 1 + w) the MLP's contribution is ``N(y)``, and the target ``N(y) + Rs`` is mapped back to a
    down_proj output by :func:`post_norm_preimage` (exact where reachable, else the closest reachable
    contribution; tests/test_families.py, tests/test_edit_gemma.py)."""
    from llmtool.core import arch

    block = decoder_layers(model)[layer]
    norm = arch.mlp_out_norm(block)
    if norm is None:
        return Rs
    device = next(model.parameters()).device
    batch, pos = bare_batch(tok, requests, device)
    y = capture_at(model, batch, pos, [layer], "value")[layer].double().cpu()
    g = arch.norm_gain(norm, arch.arch_of_layer(block)).detach().double().cpu()
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
    return post_norm_preimage(y, g, eps, Rs).to(Rs.dtype)


def edit_batch(model, tok, requests: list[EditRequest], cfg: EditConfig, templates: list[str],
               solvers: dict, C_prev: dict[int, torch.Tensor], targets: dict[int, torch.Tensor] | None = None
               ) -> dict:
    """Edit one batch in place; returns per-layer ΔW norms and remaining-residual ratios."""
    layers = sorted(cfg.layers)
    last = layers[-1]
    if targets is None:
        targets, z_logs = compute_targets(model, tok, requests, cfg, templates)
    else:
        z_logs = []
    z_last = targets[last]
    h_last0 = hidden_at(model, tok, requests, [last])[last]
    gap0 = (z_last - h_last0).norm().item()
    per_layer = []
    for i, l in enumerate(layers):
        K = compute_keys(model, tok, requests, l, templates)
        if cfg.anchor == "backward":
            cur = hidden_at(model, tok, requests, [last])[last]
            Rs = (z_last - cur) / (len(layers) - i)
        else:
            cur = hidden_at(model, tok, requests, [l])[l]
            Rs = targets[l] - cur
        Rs = through_post_norm(model, tok, requests, l, Rs)
        dW = solvers[l].delta(K, Rs.T, C_prev[l])
        W = down_proj(model, l).weight
        with torch.no_grad():
            W.add_(dW.to(W.dtype).to(W.device))
        C_prev[l] = C_prev[l] + K @ K.T
        h_last = hidden_at(model, tok, requests, [last])[last]
        ratio = (z_last - h_last).norm().item() / gap0 if gap0 > 0 else 0.0
        per_layer.append({"layer": l, "delta_fro": float(dW.norm()), "residual_fro": float(Rs.norm()),
                          "remaining_residual_ratio": ratio})
        info(f"layer {l}: ||dW||_F={float(dW.norm()):.4g}  remaining residual ratio={ratio:.3f}")
    return {"layers": per_layer, "z": z_logs, "targets": targets}


def apply_edits(model, tok, requests: list[EditRequest], cfg: EditConfig, templates: list[str],
                second_moments: dict[int, torch.Tensor]) -> dict:
    """Edit ``model`` in place with ``requests`` (batches in sequence, C_prev accumulating)."""
    solver_cls = METHODS.get(cfg.method)
    layers = sorted(cfg.layers)
    solvers = {l: solver_cls(second_moments[l], cfg) for l in layers}
    d_ff = down_proj(model, layers[0]).weight.shape[1]
    C_prev = {l: torch.zeros(d_ff, d_ff, dtype=torch.float64) for l in layers}
    for p in model.parameters():
        p.requires_grad_(False)
    size = cfg.batch_size or max(1, len(requests))
    batches = []
    for s in range(0, len(requests), size):
        batches.append(edit_batch(model, tok, requests[s:s + size], cfg, templates, solvers, C_prev))
    return {"batches": batches, "solver": {l: s.describe() for l, s in solvers.items()}}
