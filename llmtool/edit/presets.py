"""Per-model editing presets: which layers to edit and MEMIT's λ, chosen from the checkpoint's
``config.json`` when the user does not give ``--layers`` / ``--mom2-weight`` (the role of the
per-model hparams files of the MEMIT, AlphaEdit and FE code bases).

λ weighs the mean key second moment against the edited keys' K Kᵀ, and the value that balances
them depends on the model: the papers' λ = 15000 (GPT-J, Llama-3-8B) leaves SmolLM2-135M almost
unedited (0 % efficacy at 10 edits, ``benchmarks/results/edit-lambda15000.md``) while λ = 1500
reaches 90–100 % (``benchmarks/results/edit.md``). Architectures without a measured preset get
the papers' λ and early-middle layers scaled to the depth, and the manifest says so.

Gemma 3 270M (18 layers): layers 1–5, chosen by the MEMIT papers' rule (edit the early-middle MLPs whose
output at the subject's last token carries the fact, found by causal tracing). ``benchmarks/edit_trace.py``
on 30 facts of ``counterfact-gemma3`` (subject embeddings noised, one 3-layer window of MLP outputs restored
at a time; ``benchmarks/results/edit-trace-gemma3.md``) recovers P(true object) only through windows that
contain layer 3 (windows centred on 2, 3, 4: +0.014, +0.026, +0.033; centred on 5 or later: ≤ +0.0014), so
the five layers centred on layer 3 (1–5; 6–33 % of the depth, the papers' early-middle band) are edited.
λ = 1500 is SmolLM2's measured value carried over, not swept on Gemma: a 1-edit pilot at λ = 1500 gave
the forward anchor 100 % efficacy; ``benchmarks/results/edit-gemma3.md`` has the 10-edit rows.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EditPreset:
    name: str
    layers: tuple[int, ...]
    mom2_update_weight: float
    source: str


# (model_type, hidden_size, num_hidden_layers) -> preset
PRESETS = {
    ("llama", 576, 30): EditPreset("smollm2-135m", (3, 4, 5, 6, 7), 1500.0,
                                   "measured on SmolLM2-135M (benchmarks/edit.py)"),
    ("gemma3_text", 640, 18): EditPreset("gemma3-270m", (1, 2, 3, 4, 5), 1500.0,
                                         "layers by causal tracing (benchmarks/edit_trace.py); SmolLM2's λ"),
    ("llama", 4096, 32): EditPreset("llama3-8b", (4, 5, 6, 7, 8), 15000.0, "FE / AlphaEdit paper configs"),
    ("gptj", 4096, 28): EditPreset("gpt-j-6b", (3, 4, 5, 6, 7, 8), 15000.0, "MEMIT paper config"),
    ("gpt2", 1600, 48): EditPreset("gpt2-xl", (13, 14, 15, 16, 17), 20000.0, "MEMIT paper config"),
}


def preset_for(config: dict) -> EditPreset:
    key = (config.get("model_type"), config.get("hidden_size", config.get("n_embd")),
           config.get("num_hidden_layers", config.get("n_layer")))
    if key in PRESETS:
        return PRESETS[key]
    n_layers = int(key[2] or 1)
    first = max(0, round(n_layers * 0.1))
    layers = tuple(l for l in range(first, first + 5) if l < n_layers - 1) or (0,)
    return EditPreset("generic", layers, 15000.0, "no measured preset: papers' λ, layers at ~10 % of depth")
