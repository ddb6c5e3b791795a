"""Target construction for locate-then-edit: the optimised hidden state ("anchor", ``compute_z``)
and the two ways of turning it into per-layer targets.

Paper: Liu, Liu, Deng, Teh, Lee, "From Backward Spreading to Forward Replay: Revisiting Target
Construction in LLM Parameter Editing", ICML 2026 (arXiv 2605.00358).

compute_z at layer l* (shared by both anchors; MEMIT's objective). With δ ∈ R^{d_model} added
to layer l*'s output at the subject's last token of every prompt:

    L(δ) = mean_p [ -Σ_j log P(t_j | p ⊕ t_<j) / |t| ]            (rewriting prompts p)
           + kl_factor · KL(P_orig(· | "{s} is a") ‖ P_δ(· | "{s} is a"))  (at the subject token)
           + v_weight_decay · ‖δ‖ / ‖h_init‖²

minimised with Adam (lr ``v_lr``, ``v_num_grad_steps`` steps, stop when L < 0.05), δ projected
after every step onto the ball ‖δ‖ ≤ clamp_norm_factor·‖h_init‖; z = h_init + δ, where h_init
is the unedited layer output at the subject's last token of the bare prompt.

Backward anchor (MEMIT): z is optimised at the LAST edited layer l_L; the editing loop hands
layer i (0-based in R) the residual (z − h_{l_L}^{cur}) / (L − i)   [see memit.apply_edits].

Forward anchor (FE): z_1 is optimised at the FIRST edited layer l_1; the UNEDITED model is run
on the bare prompt with layer l_1's output at the subject token overwritten by z_1, and the
outputs of layers l_2..l_L at that token are recorded as their targets z_l. Each layer then
gets the undivided residual z_l − h_l^{cur}.

Reconstructed choices: rewriting prompts are token-level concatenations of the templated prompt
and the target tokens minus the last (equivalent to MEMIT's string concatenation when the
tokenizer does not merge across the boundary); the KL term uses the logits at the KL prompt's
subject token, as in the MEMIT code lineage. For speed the LM head is applied only to the
positions the loss reads (the decoder's final hidden states are the same as in a full forward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtool.edit.layerio import capture_at, edit_layer_output, scatter_at
from llmtool.edit.methods import ANCHORS  # noqa: F401  (re-exported)
from llmtool.edit.prompts import encode, pad_batch, subject_last_index
from llmtool.edit.requests import EditRequest


@dataclass
class ZConfig:
    v_lr: float = 0.1
    v_num_grad_steps: int = 25
    clamp_norm_factor: float = 0.75
    kl_factor: float = 0.0625
    v_weight_decay: float = 0.5
    early_stop_loss: float = 0.05


@dataclass
class ZResult:
    z: torch.Tensor       # [d_model] optimised hidden state
    h_init: torch.Tensor  # [d_model] unedited hidden state
    loss: float           # final loss
    steps: int


def fill(template: str, prompt: str) -> str:
    i = template.index("{}")
    return template[:i] + prompt + template[i + 2:]


def compute_z(model, tok, request: EditRequest, layer: int, templates: list[str], cfg: ZConfig) -> ZResult:
    """compute_z for one request (see :func:`compute_z_batch`)."""
    return compute_z_batch(model, tok, [request], layer, templates, cfg)[0]


def compute_z_batch(model, tok, requests: list[EditRequest], layer: int, templates: list[str], cfg: ZConfig
                    ) -> list[ZResult]:
    """compute_z for several requests in one padded batch per step. Each request keeps its own δ
    row, loss, early stop and norm ball; rows of different requests never interact in a forward
    pass, Adam is element-wise and a stopped request's δ is frozen, so every result equals the
    one-request optimisation (up to float rounding of the padded batch)."""
    device = next(model.parameters()).device
    n_req, n_rw = len(requests), len(templates)
    seqs, lookups, owner, kl_rows = [], [], [], []
    rows, cols, labels, weights, label_owner = [], [], [], [], []
    for r_i, request in enumerate(requests):
        target = encode(tok, " " + request.target_new)
        if not target:
            raise ValueError(f"target_new {request.target_new!r} tokenizes to nothing")
        for t in templates:
            ids, idx = subject_last_index(tok, fill(t, request.prompt), request.subject)
            b = len(seqs)
            seqs.append(ids + target[:-1])
            lookups.append(idx)
            owner.append(r_i)
            for j, t_id in enumerate(target):
                rows.append(b)
                cols.append(len(ids) - 1 + j)
                labels.append(t_id)
                weights.append(1.0 / (len(target) * n_rw))
                label_owner.append(r_i)
        kl_ids, kl_idx = subject_last_index(tok, "{} is a", request.subject)
        kl_rows.append((len(seqs), kl_idx))
        seqs.append(kl_ids)
        lookups.append(kl_idx)
        owner.append(r_i)
    batch = pad_batch(seqs, tok.pad_token_id or 0, device)
    pos = torch.tensor(lookups, device=device)
    owner_t = torch.tensor(owner, device=device)
    rows_t, cols_t = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
    labels_t, weights_t = torch.tensor(labels, device=device), torch.tensor(weights, device=device)
    label_owner_t = torch.tensor(label_owner, device=device)
    kl_b = torch.tensor([b for b, _ in kl_rows], device=device)
    kl_t = torch.tensor([t for _, t in kl_rows], device=device)

    head = model.get_output_embeddings()  # logits only where the loss needs them
    seen = {}
    with torch.no_grad(), edit_layer_output(model, layer, lambda h: seen.setdefault("h", h)):
        hidden = model.base_model(**batch).last_hidden_state
        kl_ref = torch.log_softmax(head(hidden[kl_b, kl_t]).float(), -1)
    # h_init: the layer output at the subject token of the first template (MEMIT's "{}")
    first = torch.arange(n_req, device=device) * (n_rw + 1)
    h_init = seen["h"][first, pos[first]].float()

    delta = torch.zeros_like(h_init, requires_grad=True)
    opt = torch.optim.Adam([delta], lr=cfg.v_lr)
    h_norm = h_init.norm(dim=-1)
    radius = cfg.clamp_norm_factor * h_norm
    done = torch.zeros(n_req, dtype=torch.bool, device=device)
    final_loss = torch.full((n_req,), float("inf"))
    final_steps = torch.zeros(n_req, dtype=torch.long)
    with edit_layer_output(model, layer, lambda h: scatter_at(h, pos, delta.to(h.dtype)[owner_t], add=True)):
        for step in range(cfg.v_num_grad_steps):
            hidden = model.base_model(**batch).last_hidden_state
            picked = torch.cat([hidden[rows_t, cols_t], hidden[kl_b, kl_t]])
            logits = head(picked).float()
            logp = torch.log_softmax(logits[:len(labels)], -1)
            tok_nll = -(logp.gather(-1, labels_t[:, None]).squeeze(-1) * weights_t)
            nll = torch.zeros(n_req, device=device, dtype=tok_nll.dtype).index_add(0, label_owner_t, tok_nll)
            kl_now = torch.log_softmax(logits[len(labels):], -1)
            kl = torch.sum(kl_ref.exp() * (kl_ref - kl_now), -1)
            loss = nll + cfg.kl_factor * kl + cfg.v_weight_decay * delta.norm(dim=-1) / h_norm ** 2
            values = loss.detach().cpu()
            active = ~done.cpu()
            final_loss[active] = values[active]
            final_steps[active] = step + 1
            done = done | (loss.detach() < cfg.early_stop_loss)
            if bool(done.all()):
                break
            frozen = delta.detach()[done].clone()
            opt.zero_grad()
            loss[~done].sum().backward()
            opt.step()
            with torch.no_grad():
                delta[done] = frozen
                n = delta.norm(dim=-1)
                scale = torch.where(n > radius, radius / n.clamp_min(1e-30), torch.ones_like(n))
                delta.mul_(scale[:, None])
    return [ZResult(z=(h_init[i] + delta[i].detach()), h_init=h_init[i], loss=float(final_loss[i]),
                    steps=int(final_steps[i])) for i in range(n_req)]


def bare_batch(tok, requests: list[EditRequest], device) -> tuple[dict, torch.Tensor]:
    seqs, lookups = [], []
    for r in requests:
        ids, idx = subject_last_index(tok, r.prompt, r.subject)
        seqs.append(ids)
        lookups.append(idx)
    return pad_batch(seqs, tok.pad_token_id or 0, device), torch.tensor(lookups, device=device)


@torch.no_grad()
def forward_replay(model, tok, requests: list[EditRequest], z_first: torch.Tensor, layers: list[int]
                   ) -> dict[int, torch.Tensor]:
    """FE targets: inject z_first ([n, d_model]) at layers[0]'s output (subject token of the bare
    prompt) in the unedited model; return {layer: [n, d_model]} read at the same token."""
    device = next(model.parameters()).device
    batch, pos = bare_batch(tok, requests, device)
    z_first = z_first.to(device, next(model.parameters()).dtype)
    with edit_layer_output(model, layers[0], lambda h: scatter_at(h, pos, z_first, add=False)):
        got = capture_at(model, batch, pos, list(layers[1:]), "out") if len(layers) > 1 else {}
    targets = {layers[0]: z_first}
    targets.update(got)
    return targets
