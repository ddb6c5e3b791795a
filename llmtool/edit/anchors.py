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
from llmtool.edit.prompts import encode, pad_batch, subject_last_index
from llmtool.edit.requests import EditRequest

ANCHORS = ("backward", "forward")


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
    device = next(model.parameters()).device
    target = encode(tok, " " + request.target_new)
    if not target:
        raise ValueError(f"target_new {request.target_new!r} tokenizes to nothing")
    seqs, lookups, starts = [], [], []
    for t in templates:
        ids, idx = subject_last_index(tok, fill(t, request.prompt), request.subject)
        seqs.append(ids + target[:-1])
        lookups.append(idx)
        starts.append(len(ids) - 1)
    kl_ids, kl_idx = subject_last_index(tok, "{} is a", request.subject)
    seqs.append(kl_ids)
    lookups.append(kl_idx)
    batch = pad_batch(seqs, tok.pad_token_id or 0, device)
    pos = torch.tensor(lookups, device=device)
    n_rw = len(templates)
    rows, cols, labels, weights = [], [], [], []
    for b in range(n_rw):
        for j, t_id in enumerate(target):
            rows.append(b)
            cols.append(starts[b] + j)
            labels.append(t_id)
            weights.append(1.0 / (len(target) * n_rw))
    rows_t, cols_t = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
    labels_t, weights_t = torch.tensor(labels, device=device), torch.tensor(weights, device=device)

    with torch.no_grad():
        h0 = capture_at(model, batch, pos, [layer], "out")[layer]
        h_init = h0[0].float()
        logits = model(**batch).logits
        kl_ref = torch.log_softmax(logits[n_rw, kl_idx].float(), -1)

    head = model.get_output_embeddings()  # logits only where the loss needs them
    delta = torch.zeros_like(h_init, requires_grad=True)
    opt = torch.optim.Adam([delta], lr=cfg.v_lr)
    radius = cfg.clamp_norm_factor * h_init.norm()
    loss_value, steps = float("inf"), 0
    with edit_layer_output(model, layer, lambda h: scatter_at(h, pos, delta.to(h.dtype).expand(len(seqs), -1), add=True)):
        for step in range(cfg.v_num_grad_steps):
            hidden = model.base_model(**batch).last_hidden_state
            picked = torch.cat([hidden[rows_t, cols_t], hidden[n_rw, kl_idx][None]])
            logits = head(picked).float()
            logp = torch.log_softmax(logits[:-1], -1)
            nll = -(logp.gather(-1, labels_t[:, None]).squeeze(-1) * weights_t).sum()
            kl_now = torch.log_softmax(logits[-1], -1)
            kl = torch.sum(kl_ref.exp() * (kl_ref - kl_now))
            loss = nll + cfg.kl_factor * kl + cfg.v_weight_decay * delta.norm() / h_init.norm() ** 2
            loss_value, steps = float(loss.detach()), step
            if loss_value < cfg.early_stop_loss:
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                n = delta.norm()
                if n > radius:
                    delta.mul_(radius / n)
    return ZResult(z=(h_init + delta.detach()), h_init=h_init, loss=loss_value, steps=steps + 1)


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
