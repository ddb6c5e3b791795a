"""SHIFT feature pass: one greedy rollout per prompt, then one forward pass over prompt + rollout.

Per item it stores (float32): ``s`` and ``e`` (hidden states at the last prompt token and the last
generated token, averaged over decoder layers or from one layer), ``prompt_len``, ``gen_len``,
``prompt_nll`` (mean NLL of prompt tokens), ``gen_nll`` (mean NLL of generated tokens),
``mean_entropy`` (mean next-token entropy over the rollout), ``truncated``. Positions are read from
the attention mask (right padding in the forward pass), never from raw sequence length.

:func:`sc_entropy` is the self-consistency-entropy baseline's feature: R sampled rollouts per prompt, each
reduced to a final answer by :func:`final_answer`, and the entropy (nats) of the answers' empirical
distribution. The paper used R = 32; the CLI default is 8, as the issue asks. Answer extraction [ours,
label-free]: the last ``\\boxed{...}`` content, else the last number, else the last non-empty line,
whitespace-normalised; an empty rollout counts as its own answer "".
"""
from __future__ import annotations

import numpy as np

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def build_prompt(tokenizer, question: str, template: str = "math") -> str:
    from llmtool.core.lm import chat_prompt

    user = question if template == "raw" else f"{question}\n{MATH_INSTRUCTION}"
    if getattr(tokenizer, "chat_template", None):
        return chat_prompt(tokenizer, user)
    return user + "\n"


def final_answer(text: str) -> str:
    """The answer a rollout commits to (no label is read): last boxed content, last number, or last line."""
    import re

    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return " ".join(boxed[-1].split())
    nums = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    if nums:
        return nums[-1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[-1].split()) if lines else ""


def answer_entropy(answers: list[str]) -> float:
    from collections import Counter

    n = len(answers)
    return float(-sum(c / n * np.log(c / n) for c in Counter(answers).values())) if n else 0.0


def sc_entropy(model, tokenizer, prompts: list[str], *, samples: int = 8, max_new_tokens: int = 128,
               temperature: float = 1.0, batch_size: int = 8, template: str = "math", seed: int = 0,
               progress=None) -> np.ndarray:
    """Entropy of the final answers of ``samples`` sampled rollouts per prompt (float32 [N])."""
    from llmtool.core.lm import generate

    texts = [build_prompt(tokenizer, p, template) for p in prompts]
    comps = generate(model, tokenizer, texts, max_new_tokens=max_new_tokens, temperature=temperature, n=samples,
                     batch_size=max(batch_size, samples), seed=seed,
                     desc="self-consistency samples" if progress else None)
    return np.asarray([answer_entropy([final_answer(c.text) for c in cs]) for cs in comps], dtype=np.float32)


def layer_states(hidden_states, layers: str):
    """Hidden states [B, T, D] from the tuple of per-layer outputs (index 0 = embeddings)."""
    import torch

    if layers == "mean":
        return torch.stack([h.float() for h in hidden_states[1:]]).mean(0)
    if layers == "last":
        return hidden_states[-1].float()
    return hidden_states[int(layers)].float()


def extract(model, tokenizer, prompts: list[str], *, max_new_tokens: int = 128, batch_size: int = 8,
            layers: str = "mean", template: str = "math", progress=None) -> dict:
    """Greedy rollouts and hidden-state anchors for every prompt (same order)."""
    import torch

    from llmtool.core.lm import generate

    texts = [build_prompt(tokenizer, p, template) for p in prompts]
    comps = generate(model, tokenizer, texts, max_new_tokens=max_new_tokens, temperature=0.0,
                     batch_size=batch_size, desc="rollouts" if progress else None)
    dev = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    rows = {k: [] for k in ("s", "e", "prompt_len", "gen_len", "prompt_nll", "gen_nll", "mean_entropy",
                            "truncated")}
    completions = []
    starts = range(0, len(texts), batch_size)
    loop = progress(starts, "hidden states", total=len(starts)) if progress else starts
    for b in loop:
        seqs, plens, glens = [], [], []
        for t, c in zip(texts[b:b + batch_size], comps[b:b + batch_size]):
            p_ids = tokenizer(t, add_special_tokens=False)["input_ids"]
            g_ids = list(c[0].token_ids)
            if not g_ids:  # an immediate EOS: the rollout ends where it starts
                g_ids = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else pad]
            seqs.append(p_ids + g_ids)
            plens.append(len(p_ids))
            glens.append(len(g_ids))
            completions.append({"completion": c[0].text, "finish_reason": c[0].finish})
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        with torch.no_grad():
            out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True)
        h = layer_states(out.hidden_states, layers).cpu()
        logp = torch.log_softmax(out.logits.float(), dim=-1).cpu()
        for i, (pl, gl) in enumerate(zip(plens, glens)):
            last_prompt, last_gen = pl - 1, pl + gl - 1
            rows["s"].append(h[i, last_prompt].numpy())
            rows["e"].append(h[i, last_gen].numpy())
            tgt = ids[i, 1:pl + gl]
            nll = -logp[i, :pl + gl - 1].gather(-1, tgt[:, None])[:, 0]
            ent = -(logp[i, pl - 1:pl + gl - 1].exp() * logp[i, pl - 1:pl + gl - 1]).sum(-1)
            rows["prompt_len"].append(pl)
            rows["gen_len"].append(gl)
            rows["prompt_nll"].append(float(nll[:pl - 1].mean()) if pl > 1 else 0.0)
            rows["gen_nll"].append(float(nll[pl - 1:].mean()))
            rows["mean_entropy"].append(float(ent.mean()))
            rows["truncated"].append(1 if comps[b + i][0].finish == "length" else 0)
    feats = {k: np.asarray(v, dtype=np.float32) for k, v in rows.items()}
    return {"features": feats, "rollouts": completions}
