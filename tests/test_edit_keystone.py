"""Tests of keystone neurons: probe statistic, planted neuron, hook = surgery, K = 0, exact masking."""
from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_llama, build_tokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model64():
    tok = build_tokenizer()
    m = build_tiny_llama(len(tok), seed=5, dtype=torch.float64, num_hidden_layers=4)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _ids(n=3, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (length,), generator=g) for _ in range(n)]


def test_probe_statistic_equals_manual(model64):
    from llmtool.edit.keystone import DEFAULT_FAMILIES, module_of, probe_activations

    ids = _ids()
    acts = probe_activations(model64, ids, list(DEFAULT_FAMILIES))
    got = {}
    hs = []
    for f in DEFAULT_FAMILIES:
        for l in range(4):
            m = module_of(model64, f, l)
            if f == "ffn":
                hs.append(m.register_forward_pre_hook(lambda mod, i, f=f, l=l: got.__setitem__((f, l), i[0][0])))
            else:
                hs.append(m.register_forward_hook(lambda mod, i, o, f=f, l=l: got.__setitem__((f, l), o[0])))
    for p, x in enumerate(ids):
        model64(input_ids=x[None])
        for (f, l), y in got.items():
            assert (acts[f][p, l] - y.abs().mean(0)).abs().max() < 1e-10
    for h in hs:
        h.remove()


def test_planted_neuron_ranks_first(model64):
    from llmtool.edit.keystone import module_of, probe_activations, rank_neurons

    up = module_of(model64, "up", 2)
    saved = up.weight[7].clone()
    up.weight[7] *= 100
    try:
        ranked = rank_neurons(probe_activations(model64, _ids(), ["q", "up", "ffn"]), "worst-rank")
        assert ranked[0].key == ("up", 2, 7)
    finally:
        up.weight[7] = saved


def test_hook_equals_surgery_and_empty_set_is_noop(model64):
    from llmtool.edit.keystone import Neuron, ablated, module_of

    x = _ids(1)[0][None]
    ref = model64(input_ids=x).logits
    with ablated(model64, []):
        assert torch.equal(model64(input_ids=x).logits, ref)
    for fam in ("q", "o", "gate", "ffn"):
        n = Neuron(fam, 1, 5)
        with ablated(model64, [n]):
            hooked = model64(input_ids=x).logits
        m = module_of(model64, fam, 1)
        saved = m.weight.clone()
        if fam == "ffn":
            m.weight[:, 5] = 0
        else:
            m.weight[5] = 0
        cut = model64(input_ids=x).logits
        m.weight.copy_(saved)
        assert (hooked - cut).abs().max() < 1e-6 and (hooked - ref).abs().max() > 0


def test_keystone_sft_masking_is_exact(model64):
    """Keystone SFT on the shared trainer (core.trainer.sft) moves only the selected rows/columns."""
    import copy

    from llmtool.edit.keystone import Neuron
    from llmtool.edit.keystone_sft import RowDeltas, SFTConfig, finetune

    m = copy.deepcopy(model64).float()
    base = {k: v.clone() for k, v in m.state_dict().items()}
    sel = [Neuron("up", 1, 3), Neuron("o", 2, 10), Neuron("ffn", 3, 20)]
    d = RowDeltas(m, sel)
    assert d.trainable_count() == 64 + 64 + (64 + 64 + 64)  # rows × in_features (+ down column)
    d.remove()
    assert set(m.state_dict()) == set(base)  # removing the deltas leaves the model as it was
    rows = [{"prompt": f"Q: {a} plus {b}?\nA:", "response": f" {a + b}"} for a, b in zip(range(10, 18), range(30, 38))]
    res = finetune(m, build_tokenizer(), rows, SFTConfig(lr=1e-2, weight_decay=0.1, max_steps=20, batch_size=4), "keystone",
                   sel)
    assert res["trainable_parameters"] == 64 + 64 + (64 + 64 + 64) and len(res["records"]) == 20
    assert set(res["delta_state"]) >= {"model.layers.1.mlp.up_proj.weight.delta", "model.layers.3.mlp.down_proj.weight.delta"}
    after = m.state_dict()
    assert set(after) == set(base)  # merged: no delta parameter left behind
    touched = {"model.layers.1.mlp.up_proj.weight": ("row", 3), "model.layers.2.self_attn.o_proj.weight": ("row", 10),
               "model.layers.3.mlp.gate_proj.weight": ("row", 20), "model.layers.3.mlp.up_proj.weight": ("row", 20),
               "model.layers.3.mlp.down_proj.weight": ("col", 20)}
    for k, v in base.items():
        if k not in touched:
            assert torch.equal(after[k], v), k
            continue
        kind, c = touched[k]
        keep = torch.ones_like(v, dtype=torch.bool)
        if kind == "row":
            keep[c] = False
        else:
            keep[:, c] = False
        assert torch.equal(after[k][keep], v[keep]), k
        assert not torch.equal(after[k][~keep], v[~keep]), k


def test_keystone_find_then_finetune_cli_changes_only_keystone_rows(tmp_path, tiny_llama_dir):
    """End to end: `keystone find` ranks neurons, `keystone finetune --trainable keystone` writes a
    checkpoint in which only the selected rows (and the down_proj columns of ffn neurons) moved."""
    import json

    from safetensors.torch import load_file

    from conftest import run_cli

    ks = tmp_path / "keystone.json"
    code, _, err = run_cli("edit", "keystone", "find", str(tiny_llama_dir), "--out", str(ks), "--top", "20")
    assert code == 0, err
    out = tmp_path / "sft"
    code, stdout, err = run_cli("--json", "edit", "keystone", "finetune", str(tiny_llama_dir), str(out),
                                "--neurons", str(ks), "--k", "5", "--max-steps", "3", "--n-train", "16",
                                "--lr", "1e-2", "--batch-size", "4")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["trainable"] == "keystone" and res["steps"] == 3
    a, b = load_file(str(tiny_llama_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    delta = load_file(str(out / "keystone_delta.safetensors"))
    allowed = {}
    for name, idx in delta.items():
        for kind in ("rows", "cols"):
            suffix = f".weight.{kind}_index"
            if name.endswith(suffix):
                allowed[name[: -len(suffix)] + ".weight"] = (kind, set(idx.tolist()))
    changed = 0
    for k in a:
        diff = (a[k] != b[k])
        if not diff.any():
            continue
        changed += 1
        kind, idx = allowed[k]  # a changed tensor must be a selected module
        moved = diff.any(1) if kind == "rows" else diff.any(0)
        assert set(torch.nonzero(moved).flatten().tolist()) <= idx
    assert changed > 0
    manifest = json.loads((out / "trainable_manifest.json").read_text())
    assert manifest["trainable"] == "keystone" and len(manifest["neurons"]) == 5
