"""Rotations of a Llama-style residual stream, fused offline into the weights (QuaRot / SpinQuant /
ReSpinQuant), the low-rank residual-transition approximation, and the Cayley SGD optimiser.

Conventions: row vectors, ``F.linear`` computes ``y = x Wᵀ`` (W is out×in). A stream stored in basis
R is ``x̃ = x R``. A Linear reading it gets ``W ← W R``; a Linear writing into basis R gets
``W ← Rᵀ W``; the embedding table becomes ``E ← E R``.

Per decoder layer i (D hidden, d head dim, L layers):
* ``R1[i]`` basis of the stream entering layer i: ``W_q, W_k, W_v ← W R1[i]``;
* ``R2[i]`` basis attention writes in and the FFN reads: ``W_o ← R2[i]ᵀ W_o``, ``W_gate, W_up ← W R2[i]``;
* the FFN writes in ``R1[i+1]``: ``W_down ← R1[i+1]ᵀ W_down``; ``lm_head ← W_lm R1[L]``, ``E ← E R1[0]``;
* ``R3[i]`` (d×d) per head on the value path: ``W_v[h] ← R3ᵀ W_v[h]`` (rows of each KV head block),
  ``W_o[:, h] ← W_o[:, h] R3`` (columns of each query head block; query heads of a GQA group see their
  KV head's value, and all heads share R3[i]);
* residual transitions ``T_attn[i] = R1[i]ᵀ R2[i]`` and ``T_ffn[i] = R2[i]ᵀ R1[i+1]``.
* the down_proj input gets an online Hadamard ``H`` (intermediate size), fused as ``W_down ← W_down H``.

Before rotating, :func:`prepare` unties ``lm_head`` from the embedding and folds every RMSNorm gain
into the columns of the Linears that read the norm's output (gains become 1), so RMSNorm commutes with
the rotations. Gemma's ``(1 + w)`` norms fold their effective gain ``1 + w`` and are left with ``w = 0``.

Sandwich post-norms (Gemma 2/3) [derived here]: the attention and MLP outputs pass through an RMSNorm
``N(y) = g ⊙ y / rms(y)`` *before* the residual add. ``N(y R) ≠ N(y) R`` (the per-channel gain acts after
normalisation), so a rotation cannot be fused into o_proj / down_proj rows. Instead those writers keep
the original basis (only R3 on o_proj's columns and the down_proj input Hadamard are fused), the
post-norm runs in the original basis with its own gain, and its output is rotated online into the
stream's basis: ``N(y) R2[i]`` after attention, ``N(y) R1[i+1]`` after the MLP
(:class:`llmtool.quantize.modules.RotatedNorm`, a D×D product per sublayer). Every Linear *input* is still
rotated (q/k/v and gate/up read the rotated normalised stream, o_proj reads R3-rotated values, down_proj
the Hadamard-rotated activations), which is what the quantizers need; the extra cost is two D×D
products per layer. The pre-norms (input, pre-feedforward, final) are RMSNorms of the rotated stream and
commute once their gains are taken out. q/k norms (Qwen3, Gemma 3) act on head_dim after the projection and
before RoPE: no rotation crosses them.

Pre-norm gains of the sandwich-norm families are not folded into the readers [derived here]: Gemma 3's
residual stream carries a few massive channels, and its pre-norm gains ``1 + w`` are near zero exactly there
(0 to 60 within one norm), so ``N(x) = n(x) ⊙ g`` is much smaller than the unit-gain ``n(x)`` (norm √D).
Folded into ``W diag(g)``, a 4-bit weight error multiplies ``n(x)`` whole and swamps the small signal:
measured on gemma3-270m, folding alone (no rotation, RTN W4A16) takes perplexity from 118 to 5.5e9. So the
pre-norms run with unit gain and an online ``Rᵀ diag(g) R`` after them (:func:`prepare` installs
``diag(g)``, :func:`fuse` conjugates it with ``R1[i]`` / ``R2[i]``; one more D×D product per pre-norm),
and the readers hold ``W R`` unscaled. The final norm's gain is still folded into lm_head (kept in float).

Transition approximation (ReSpinQuant §3.5): Q = top-r left singular vectors of ``ΔT = T − I``,
``R̂ = polar(Qᵀ T Q)``, ``T̂ = I + Q (R̂ − I) Qᵀ`` (orthogonal whenever QᵀQ = I); stored as
``basis = Q``, ``core = R̂ − I``; a near-zero ΔT gives an all-zero core.

Cayley SGD (Li et al. 2020, as used by SpinQuant's SGDG): for a Euclidean gradient G at R,
``A = G Rᵀ − R Gᵀ`` (skew) and ``R ← (I + α/2 A)⁻¹ (I − α/2 A) R``, a descent retraction on the
orthogonal group (``dR/dα = −A R``). The step is ``α = min(lr, 1/(‖A‖₁ + ε))`` (SGDG's cap, which
is what makes lr = 1.5 safe); the solve is exact, and R is re-orthonormalised by its polar factor if
``‖RᵀR − I‖_max`` exceeds 1e-4. The spec writes the update with the opposite sign convention for the
skew matrix; the descent direction above is the one that reduces the loss (tested).
"""
from __future__ import annotations

import torch
from torch import nn

from llmtool.core import arch
from llmtool.core.arch import head_dim  # noqa: F401  (re-exported: used by the methods and tests)
from llmtool.core.models import decoder_layers
from llmtool.kernels.hadamard import hadamard_matrix


def check_supported(model, method: str = "quarot", train_steps: int = 0) -> None:
    """RMSNorm blocks without routed experts (families of :mod:`llmtool.core.arch`;
    refusals by layout property in :func:`llmtool.quantize.runner.check_family`)."""
    from llmtool.quantize.runner import check_family

    check_family(model, method, train_steps)


def random_orthogonal(n: int, generator=None, dtype=torch.float64) -> torch.Tensor:
    a = torch.randn(n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


def random_hadamard(n: int, generator=None, dtype=torch.float64) -> torch.Tensor:
    """``diag(s) H`` with random signs s (QuaRot's randomised Hadamard)."""
    s = torch.randint(0, 2, (n,), generator=generator).to(torch.float64) * 2 - 1
    return (s[:, None] * hadamard_matrix(n)).to(dtype)


def polar(m: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(m)
    return u @ vh


@torch.no_grad()
def prepare(model) -> None:
    """Untie lm_head, fold RMSNorm gains into the following Linears (in place); sandwich-norm families keep
    their pre-norm gains online instead (``diag(g)`` after a unit-gain norm, see the module docstring)."""
    check_supported(model)
    emb, lm_head = arch.embed(model), arch.lm_head(model)
    if lm_head.weight.data_ptr() == emb.weight.data_ptr():
        lm_head.weight = nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None
    spec = arch.arch_of(model)
    online = online_pre_norm_gains(model)
    if online:   # sandwich-norm families: the pre-norm gains stay online (module docstring)
        from llmtool.quantize.modules import install_pre_norm_matrices

        for layer in decoder_layers(model):
            gains = []
            for norm in (arch.input_norm(layer), arch.post_attention_norm(layer)):
                gains.append(torch.diag(arch.norm_gain(norm, spec).detach().float()))
                arch.set_unit_gain(norm, spec)
            install_pre_norm_matrices(layer, *gains)
    for layer in decoder_layers(model) if not online else ():
        for norm, roles in ((arch.input_norm(layer), ("q", "k", "v")),
                            (arch.post_attention_norm(layer), ("gate", "up"))):
            g = arch.norm_gain(norm, spec).detach().clone()   # (1 + w) for Gemma-style norms
            # a role of a fused qkv_proj / gate_up_proj is a row view: each row scaled once; an MoE MLP's
            # readers are every expert's gate_up [E, 2I, D] and the router [E, D] (scaled along the last dim)
            readers = _moe_readers(layer) if roles[0] == "gate" and arch.is_moe_layer(layer) else \
                [arch.role_weight(layer, role) for role in roles]
            for w in readers:
                w.mul_(g.to(w.dtype))
            arch.set_unit_gain(norm, spec)
    norm = arch.final_norm(model)
    g = arch.norm_gain(norm, spec).detach().clone()
    lm_head.weight.mul_(g.to(lm_head.weight.dtype)[None, :])
    arch.set_unit_gain(norm, spec)


def _moe_readers(layer) -> list[torch.Tensor]:
    """The tensors that read an MoE layer's MLP input: every expert's gate_up [E, 2I, D] and the router."""
    spec = arch.arch_of_layer(layer)
    return [getattr(arch.experts(layer), spec.experts.gate_up).data, arch.router(layer).weight.data]


def _moe_down(layer) -> torch.Tensor:
    spec = arch.arch_of_layer(layer)
    return getattr(arch.experts(layer), spec.experts.down).data   # [E, D, I]


@torch.no_grad()
def fuse_down_hadamard(model) -> None:
    """``W_down ← W_down H`` so that an online ``x H`` before down_proj keeps the product unchanged (every
    expert's down projection in an MoE layer)."""
    for layer in decoder_layers(model):
        w = _moe_down(layer) if arch.is_moe_layer(layer) else arch.role_weight(layer, "down")
        h = hadamard_matrix(w.shape[-1], dtype=torch.float64, device=w.device)
        w.copy_((w.double() @ h).to(w.dtype))


class RotationSet(nn.Module):
    """R1 [L+1, D, D], R2 [L, D, D], R3 [L, d, d]. ``tied``: one global R for every R1/R2 (SpinQuant)."""

    def __init__(self, num_layers: int, hidden: int, head: int, tied: bool = False, dtype=torch.float32):
        super().__init__()
        self.num_layers, self.tied = num_layers, tied
        eye = torch.eye(hidden, dtype=dtype)
        self.R1 = nn.Parameter(eye.repeat(1 if tied else num_layers + 1, 1, 1))
        self.R2 = None if tied else nn.Parameter(eye.repeat(num_layers, 1, 1))
        self.R3 = nn.Parameter(torch.eye(head, dtype=dtype).repeat(num_layers, 1, 1))

    def r1(self, i: int) -> torch.Tensor:
        return self.R1[0] if self.tied else self.R1[i]

    def r2(self, i: int) -> torch.Tensor:
        return self.R1[0] if self.tied else self.R2[i]

    def r3(self, i: int) -> torch.Tensor:
        return self.R3[i]

    def matrices(self) -> list[nn.Parameter]:
        return [p for p in (self.R1, self.R2, self.R3) if p is not None]

    @classmethod
    def hadamard_init(cls, num_layers, hidden, head, tied=False, generator=None, dtype=torch.float32):
        """ReSpinQuant init: every R1/R2 the same deterministic H_D (so every T = I); R3 random Hadamards."""
        rot = cls(num_layers, hidden, head, tied, dtype)
        with torch.no_grad():
            rot.R1.copy_(hadamard_matrix(hidden, dtype).expand_as(rot.R1))
            if rot.R2 is not None:
                rot.R2.copy_(hadamard_matrix(hidden, dtype).expand_as(rot.R2))
            for i in range(num_layers):
                rot.R3[i].copy_(random_hadamard(head, generator, dtype))
        return rot


def _blockdiag_rows(w: torch.Tensor, r: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head block of ``w`` [heads*d, in] ← rᵀ w_h."""
    d = r.shape[0]
    return torch.einsum("ed,hdk->hek", r.T, w.reshape(heads, d, -1)).reshape(heads * d, -1)


def _blockdiag_cols(w: torch.Tensor, r: torch.Tensor, heads: int) -> torch.Tensor:
    """Columns of each head block of ``w`` [out, heads*d] ← w_h r."""
    d = r.shape[0]
    return torch.einsum("khd,de->khe", w.reshape(w.shape[0], heads, d), r).reshape(w.shape[0], heads * d)


def post_norms(model_or_config) -> bool:
    """Whether the family normalises the attention / MLP outputs (sandwich norms): its writers then stay in
    the original basis and the rotation is applied online after the post-norm."""
    spec = arch.arch_of(model_or_config)
    return bool(spec.attn_out_norm or spec.mlp_out_norm)


def online_pre_norm_gains(model_or_config) -> bool:
    """Whether :func:`prepare` keeps the pre-norm gains online instead of folding them into the readers (the
    sandwich-norm families, whose pre-norm gains are near zero on the stream's massive channels)."""
    return post_norms(model_or_config)


def layer_weights(orig: dict[str, torch.Tensor], rot: RotationSet, i: int, cfg) -> dict[str, torch.Tensor]:
    """Effective (rotated) weights of block i from its frozen prepared weights, keyed by role
    (``q k v o gate up down``; differentiable). With sandwich post-norms (:func:`post_norms`) o_proj and
    down_proj keep their output basis (the rotation follows the post-norm online)."""
    dt = orig["q"].dtype
    r1, r2, r1n, r3 = (rot.r1(i).to(dt), rot.r2(i).to(dt), rot.r1(i + 1).to(dt), rot.r3(i).to(dt))
    online = post_norms(cfg)
    out = {
        "q": orig["q"] @ r1,
        "k": orig["k"] @ r1,
        "v": _blockdiag_rows(orig["v"] @ r1, r3, arch.n_kv_heads(cfg)),
        "o": _blockdiag_cols(orig["o"] if online else r2.T @ orig["o"], r3, arch.n_heads(cfg)),
    }
    # MLP readers (3-D expert tensors and the router of an MoE layer broadcast the same way) and writer
    for role in ("gate", "up", "gate_up", "router"):
        if role in orig:
            out[role] = orig[role] @ r2
    if "down" in orig:
        out["down"] = orig["down"] if online else r1n.T @ orig["down"]
    return out


def layer_biases(orig: dict[str, torch.Tensor | None], rot: RotationSet, i: int, cfg) -> dict[str, torch.Tensor]:
    """Effective biases of block i (roles whose Linear has one; differentiable). A bias lives on a Linear's
    output, so only the output-side rotations move it: ``v`` per head by R3, ``o`` by R2[i] and ``down`` by
    R1[i+1] (not with sandwich post-norms, whose writers keep their basis); q/k/gate/up biases are unchanged."""
    out = {}
    online = post_norms(cfg)
    for role, b in orig.items():
        if b is None:
            continue
        col = b[:, None]
        if role == "v":
            col = _blockdiag_rows(col, rot.r3(i).to(b.dtype), arch.n_kv_heads(cfg))
        elif role == "o" and not online:
            col = rot.r2(i).to(b.dtype).T @ col
        elif role == "down" and not online:
            col = rot.r1(i + 1).to(b.dtype).T @ col
        out[role] = col[:, 0]
    return out


def transitions(rot: RotationSet, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T_attn, T_ffn) of layer i."""
    return rot.r1(i).T @ rot.r2(i), rot.r2(i).T @ rot.r1(i + 1)


def approximate_transition(t: torch.Tensor, rank: int, tol: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """(basis Q [D, r], core M [r, r]) with ``I + Q M Qᵀ`` the orthogonal rank-r approximation of ``t``."""
    d = t.shape[0]
    rank = max(0, min(rank, d))
    eye = torch.eye(d, dtype=t.dtype, device=t.device)
    delta = t - eye
    if rank == 0:
        return torch.zeros(d, 0, dtype=t.dtype, device=t.device), torch.zeros(0, 0, dtype=t.dtype, device=t.device)
    if not torch.isfinite(delta).all():
        raise ValueError("transition matrix has non-finite entries")
    if delta.abs().max() <= tol:
        q = eye[:, :rank].clone()
        return q, torch.zeros(rank, rank, dtype=t.dtype, device=t.device)
    u, _, _ = torch.linalg.svd(delta)
    q = u[:, :rank]
    core = polar(q.T @ t @ q) - torch.eye(rank, dtype=t.dtype, device=t.device)
    return q, core


@torch.no_grad()
def fuse(model, rot: RotationSet) -> None:
    """Write the rotated weights into ``model`` (computed in float64, cast back)."""
    cfg = model.config
    layers = decoder_layers(model)
    device = arch.embed(model).weight.device  # rotations may be built on the CPU: fuse on the model's device
    rot64 = RotationSet(rot.num_layers, rot.r1(0).shape[0], rot.r3(0).shape[0], rot.tied, torch.float64).to(device)
    for a, b in zip(rot64.matrices(), rot.matrices()):
        a.data.copy_(b.detach().double().to(device))
    for i, layer in enumerate(layers):
        if arch.is_moe_layer(layer):   # gate_up [E, 2I, D] ← · R2, down [E, D, I] ← R1ᵀ ·, router ← · R2
            tensors = {r: arch.role_weight(layer, r) for r in arch.ATTENTION_ROLES}
            tensors.update(zip(("gate_up", "router"), _moe_readers(layer)), down=_moe_down(layer))
        else:
            tensors = {r: arch.role_weight(layer, r) for r in arch.ROLES}
        orig = {r: t.detach().double() for r, t in tensors.items()}
        for r, w in layer_weights(orig, rot64, i, cfg).items():
            p = tensors[r]   # a row view of qkv_proj / gate_up_proj where the family fuses
            p.copy_(w.to(p.dtype))
        moe = arch.is_moe_layer(layer)   # experts carry no bias
        biases = {r: arch.role_bias(layer, r) for r in (arch.ATTENTION_ROLES if moe else arch.ROLES)}
        for r, b in layer_biases({r: None if b is None else b.detach().double() for r, b in biases.items()},
                                 rot64, i, cfg).items():
            biases[r].copy_(b.to(biases[r].dtype))
    if post_norms(model):
        from llmtool.quantize.modules import install_post_norm_rotations

        from llmtool.quantize.modules import install_pre_norm_matrices, pre_norm_matrices

        for i, layer in enumerate(layers):
            install_post_norm_rotations(layer, rot64.r2(i), rot64.r1(i + 1))
            pre = pre_norm_matrices(layer)
            if pre is not None:   # the pre-norm gains diag(g) (from prepare) move into the stream's bases
                m_in, m_ff = (m.rotation.double() for m in pre)
                r1, r2 = rot64.r1(i), rot64.r2(i)
                install_pre_norm_matrices(layer, r1.T @ m_in @ r1, r2.T @ m_ff @ r2)
    # embedding / lm_head rows in chunks: a float64 copy of a 262k-row table (Gemma 3) would add 2.7 GB
    for w, r in ((arch.embed(model).weight, rot64.r1(0)), (arch.lm_head(model).weight, rot64.r1(len(layers)))):
        for s in range(0, w.shape[0], 16384):
            w[s:s + 16384] = (w[s:s + 16384].double() @ r).to(w.dtype)


class CayleySGD:
    """Cayley SGD on the orthogonal group for batched square parameters [..., n, n]."""

    def __init__(self, params: list[torch.Tensor], lr: float = 1.5, eps: float = 1e-8):
        self.params, self.lr, self.eps = list(params), lr, eps

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        for p in self.params:
            if p.grad is None:
                continue
            r, g = p.data, p.grad.to(p.dtype)
            if not torch.isfinite(g).all():
                # an overflowing gradient (seen at 3-bit activations) would turn the whole solve into NaN:
                # drop the non-finite entries for this step
                g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
            a = g @ r.transpose(-1, -2) - r @ g.transpose(-1, -2)
            finite = torch.isfinite(a).flatten(-2).all(-1)
            if not bool(finite.all()):  # huge gradients overflow G Rᵀ: skip those matrices this step
                a = torch.where(finite[..., None, None], a, torch.zeros_like(a))
            norm1 = a.abs().sum(dim=-2).amax(dim=-1)  # matrix 1-norm per matrix
            alpha = torch.clamp(1.0 / (norm1 + self.eps), max=lr)[..., None, None]
            eye = torch.eye(r.shape[-1], dtype=r.dtype, device=r.device)
            new = torch.linalg.solve(eye + 0.5 * alpha * a, (eye - 0.5 * alpha * a) @ r)
            err = (new.transpose(-1, -2) @ new - eye).abs().amax()
            if not bool(err <= 1e-4):       # also when err is NaN
                ok = torch.isfinite(new).flatten(-2).all(-1)
                new = torch.where(ok[..., None, None], new, r)   # a non-finite update keeps the rotation
                new = polar(new.double()).to(r.dtype)
            p.data.copy_(new)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
