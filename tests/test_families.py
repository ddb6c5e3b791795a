"""The support matrix: every model-reaching command × every family of ``llmtool.core.arch``.

Each family is a tiny random model built from its transformers config class (2 layers, hidden 64, vocabulary
of the test tokenizer, 2 experts for the MoE families; norm gains and biases perturbed so that ``w`` and
``1 + w`` RMSNorms differ), saved with safetensors. Each cell runs the command (through the CLI where cheap,
else the library function the CLI calls) and checks a property that fails when the family is mishandled,
or checks that the command refuses with one line naming the method, the family and the layout property.

The matrix in docs/families.md is generated from :data:`COMMANDS` and :data:`REFUSED` (each refusal's
property is verified by its cell), and ``test_matrix_is_current`` fails when the committed table is stale:

    python tests/test_families.py --write docs/families.md

``test_broken_adapter_*`` break the adapter on purpose (a fused slice order, a norm kind, a sandwich norm)
and show that the matching property check fails.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TINY_TEXT, build_tokenizer, run_cli  # noqa: E402

import torch  # noqa: E402

from llmtool.core import arch  # noqa: E402
from llmtool.core.console import UsageError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "families.md"
BEGIN, END = "<!-- families-matrix:begin -->", "<!-- families-matrix:end -->"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0,
               eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, hidden_activation="gelu_pytorch_tanh")
# family -> (transformers config class, overrides); sliding windows of 8 tokens make the sliding layers slide
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", dict(_GEMMA, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(_GEMMA, layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=2, num_experts_per_tok=1, sliding_window=None)),
}
FAMILIES = tuple(FAMILY_CONFIGS)

# command -> (what runs, the property checked)
COMMANDS = {
    "evaluate ppl": ("CLI", "the reported perplexity equals exp of the model's own mean token loss"),
    "compress": ("CLI (svd, every Linear at full rank) + `llmtool.load`",
                 "full-rank factors (fused and per-module) reload to the original logits"),
    "quantize rtn": ("CLI W4A16 + `llmtool.load`", "the reloaded model equals RTN applied to every block Linear "
                     "(fused ones included) of the original"),
    "quantize quarot": ("CLI W16A16 + `llmtool.load`", "rotations without quantization leave the logits unchanged"),
    "quantize respinquant": ("library `quantize_` W16A16, 2 rotation-learning steps, rank = hidden",
                             "learned rotations and residual transitions without quantization leave the logits "
                             "unchanged"),
    "kvcache snapkv": ("library `kvcache.pipeline.generate`", "full-budget eviction decodes the same tokens as "
                       "plain greedy decoding (sliding layers included); at budget 0.5 sliding layers keep every entry"),
    "edit memit": ("library `memit.edit_batch`, one request, λ = 0",
                   "the rank-one edit moves the layer output at the subject key onto a reachable target"),
    "edit keystone": ("library `probe_activations` / `ablated`", "ablating no neuron changes nothing; ablating a "
                      "neuron of each family equals zeroing that role's weight row (column for ffn)"),
    "train sft": ("CLI, 4 steps on one fixed batch", "the loss goes down"),
    "train grpo": ("CLI (1 step) + the GRPO clipped surrogate on a fixed batch", "3 steps raise the surrogate"),
    "route generate": ("library `decode_loop` with an expert stream, left-padded batch",
                       "decodes the same tokens as plain greedy decoding"),
    "bench-agent run": ("library `HFAgent.act`, two turns with cache reuse",
                        "decodes as plain greedy decoding; the second turn equals a fresh agent's"),
    "generate (evade, evaluate tasks/judge, learn-program)": (
        "library `core.lm.generate` (the shared decoding of these commands), a left-padded batch of two",
        "decodes the same tokens as plain greedy decoding"),
}

_EXPERTS = arch.P_EXPERTS
_ROT = ("quantize quarot", "quantize respinquant")
REFUSED: dict[tuple[str, str], str] = {
    **{("edit memit", f): _EXPERTS for f in ("qwen3_moe", "mixtral")},
    **{("edit keystone", f): _EXPERTS for f in ("qwen3_moe", "mixtral")},
}
# what the refusal says, for the table (the cell checks the property name and family in the message)
REASONS = {
    (_EXPERTS, "edit memit"): "the down projection is one of several experts chosen per token: no one matrix "
                              "to write",
    (_EXPERTS, "edit keystone"): "MLP neurons live in per-expert tensors; attention families run "
                                 "(`--families q,k,v,o`)",
}


# ------------------------------------------------------------------------------------------ models
def build_model(family: str, seed: int = 0):
    import transformers

    cls_name, over = FAMILY_CONFIGS[family]
    cfg = getattr(transformers, cls_name)(**{**_COMMON, "vocab_size": len(_tok()), **over})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    cfg.architectures = [type(model).__name__]
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


_TOK = []


def _tok():
    if not _TOK:
        _TOK.append(build_tokenizer())
    return _TOK[0]


def save_family(family: str, path: Path) -> Path:
    if not (path / "config.json").exists():
        build_model(family).save_pretrained(path, safe_serialization=True)
        _tok().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: save_family(f, root / f) for f in FAMILIES}


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ids(n: int = 20, seed: int = 0) -> torch.Tensor:
    ids = _tok()(TINY_TEXT, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[seed: seed + n])[None]


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids).logits.float()


def _close(a, b, tol):
    err = float((a - b).abs().max() / b.abs().max())
    assert err < tol, f"relative max error {err:.3g} >= {tol}"


@torch.no_grad()
def greedy(model, ids: list[int], n: int, eos: int | None = None) -> list[int]:
    """Plain greedy decoding: the whole sequence recomputed each step, no cache (the reference)."""
    seq = list(ids)
    out = []
    for _ in range(n):
        nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        if eos is not None and nxt == eos:
            break
        out.append(nxt)
        seq.append(nxt)
    return out


# ------------------------------------------------------------------------------------------ cells
def cell_ppl(family, d, tmp):
    text = tmp / "t.txt"
    text.write_text(TINY_TEXT)
    code, out, err = run_cli("--json", "evaluate", "ppl", d, "--data", text, "--seqlen", "24", "--max-tokens", "24")
    assert code == 0, err
    ppl = json.loads(out)["ppl"]
    ids = _tok()(TINY_TEXT, add_special_tokens=False)["input_ids"][:24]
    with torch.no_grad():
        loss = _load(d)(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert abs(ppl - float(loss.exp())) < 1e-3 * ppl, (ppl, float(loss.exp()))


def cell_compress(family, d, tmp):
    import llmtool
    from llmtool.compress.methods import make_config
    from llmtool.compress.run import compress

    from llmtool.core.experts import unfuse_experts

    model = _load(d)
    unfuse_experts(model)   # what compress does: per-expert Linears (MoE families)
    mods = dict(model.named_modules())
    names = [n for layer in arch.module_names(model) for n in layer]
    full = {n: min(mods[n].weight.shape) for n in names}
    cfg = dataclasses.replace(make_config("svd", ratio=0.01), forced_ranks=full)
    code, _, err = run_cli("compress", "--method", "svd", d, tmp / "preflight", "--ratio", "0.01")  # CLI refusals
    if code == 2:
        raise UsageError(err.strip().removeprefix("error: "))
    compress(str(d), tmp / "c", cfg)
    low = llmtool.load(tmp / "c")
    assert sum(type(m).__name__ == "LowRankLinear" for m in low.modules()) == len(names)
    ids = _ids()
    _close(_logits(low, ids), _logits(model, ids), 1e-4)


def _rtn_reference(model, bits: int):
    from llmtool.quantize.modules import QuantLinear
    from llmtool.quantize.quantizers import rtn_weight
    from llmtool.quantize.runner import make_config

    clip = make_config("rtn", w_bits=bits).w_clip
    with torch.no_grad():
        for layer in arch.decoder_layers(model):
            weights = [lin.weight for lin in arch.block_linears(layer).values()]  # fused ones as one Linear
            if arch.is_moe_layer(layer):   # and every expert's gate_up [2I, D] and down [D, I]
                ex, spec = arch.experts(layer), arch.arch_of_layer(layer)
                weights += [getattr(ex, spec.experts.gate_up)[e] for e in range(arch.n_experts(layer))]
                weights += [getattr(ex, spec.experts.down)[e] for e in range(arch.n_experts(layer))]
            for w in weights:
                q = QuantLinear(w.shape[1], w.shape[0])
                q.set_quantized(*rtn_weight(w, bits, clip), bits)
                w.copy_(q.dequantized_weight(w.dtype))
        for w in (arch.embed(model).weight, arch.lm_head(model).weight):
            w.copy_(w.half().float())
    return model


def cell_rtn(family, d, tmp):
    import llmtool

    code, _, err = run_cli("quantize", "--method", "rtn", d, tmp / "q", "--w-bits", "4", "--a-bits", "16",
                           "--no-eval")
    if code == 2:
        raise UsageError(err.strip().removeprefix("error: "))
    assert code == 0, err
    q = llmtool.load(tmp / "q")
    ids = _ids()
    _close(_logits(q, ids), _logits(_rtn_reference(_load(d), 4), ids), 1e-4)


def _rotation_cell(method):
    def cell(family, d, tmp):
        import llmtool
        from llmtool.quantize.api import quantize_
        from llmtool.quantize.runner import check_family, make_config

        check_family(json.loads((d / "config.json").read_text()), method)   # the preflight's refusal
        model, ids = _load(d), _ids()
        before = _logits(model, ids)
        if method == "quarot":   # the CLI, its checkpoint format and llmtool.load
            code, _, err = run_cli("quantize", "--method", "quarot", d, tmp / "q", "--w-bits", "16", "--a-bits",
                                   "16", "--weight-algorithm", "rtn", "--no-eval")
            assert code == 0, err
            _close(_logits(llmtool.load(tmp / "q"), ids), before, 1e-4)
            return
        # learned rotations (2 Cayley steps through the training view), transitions kept exactly (rank = D)
        calib = torch.cat([_ids(16, s) for s in range(2)])
        quantize_(model, make_config(method, w_bits=16, a_bits=16, train_steps=2, train_seqlen=16,
                                     rank=model.config.hidden_size), calib)
        _close(_logits(model, ids), before, 1e-4)
    return cell


def cell_kvcache(family, d, tmp):
    from llmtool.kvcache.pipeline import KVSpec, generate

    model, ids = _load(d), _ids(20)
    ref = greedy(model, ids[0].tolist(), 6)
    toks, _, _ = generate(model, ids, None, KVSpec(evict="snapkv", budget=1.0, window_size=4), max_new_tokens=6)
    assert list(toks) == ref, (toks, ref)
    toks, stats, _ = generate(model, ids, None, KVSpec(evict="snapkv", budget=0.5, window_size=4), max_new_tokens=2)
    kinds = arch.attention_kinds(model.config)
    held = [layer.keys.shape[-2] for layer in stats.extra["cache"].layers]
    for kind, n in zip(kinds, held):
        if kind == "sliding":
            assert n == ids.shape[1] + 1, f"a sliding layer was evicted ({n} entries)"
        else:
            assert n < ids.shape[1], f"a full layer kept {n} of {ids.shape[1]} entries at budget 0.5"


def _memit_request():
    from llmtool.edit.requests import EditRequest

    return EditRequest(prompt="{} is in", subject="The Eiffel Tower", target_new="Rome")


def cell_memit(family, d, tmp, model=None):
    from llmtool.edit.anchors import bare_batch
    from llmtool.edit.layerio import capture_at, down_proj
    from llmtool.edit.memit import EditConfig, MemitSolve, edit_batch, hidden_at

    model = model if model is not None else _load(d)
    tok, req, layer = _tok(), _memit_request(), 1
    d_ff = down_proj(model, layer).weight.shape[1]
    batch, pos = bare_batch(tok, [req], "cpu")
    # a reachable target: the layer output when the down projection's output at the key moves by delta
    g = torch.Generator().manual_seed(3)
    delta = 0.5 * torch.randn(model.config.hidden_size, generator=g)
    rows = torch.arange(1)

    def bump(mod, inp, out):
        out = out.clone()
        out[rows, pos] += delta * out[rows, pos].norm() / delta.norm()
        return out
    h = down_proj(model, layer).register_forward_hook(bump)
    z = capture_at(model, batch, pos, [layer], "out")[layer].double()
    h.remove()
    before = hidden_at(model, tok, [req], [layer])[layer]
    cfg = EditConfig(layers=[layer], mom2_update_weight=0.0, l2=0.0, solver="pinv")
    zeros = torch.zeros(d_ff, d_ff, dtype=torch.float64)
    edit_batch(model, tok, [req], cfg, ["{}"], {layer: MemitSolve(zeros, cfg)}, {layer: zeros.clone()},
               targets={layer: z})
    after = hidden_at(model, tok, [req], [layer])[layer]
    ratio = float((after - z).norm() / (before - z).norm())
    assert ratio < 1e-2, f"remaining residual ratio {ratio:.3g} (the edit missed its target)"


def cell_keystone(family, d, tmp, model=None):
    from llmtool.edit.keystone import DEFAULT_FAMILIES, MODULES, Neuron, ablated, probe_activations

    model = model if model is not None else _load(d)
    ids = _ids(12)
    acts = probe_activations(model, [ids[0]], list(DEFAULT_FAMILIES))
    base = _logits(model, ids)
    with ablated(model, []):
        assert torch.equal(_logits(model, ids), base)
    for fam in DEFAULT_FAMILIES:
        c = int(acts[fam][0, 0].argmax())
        with ablated(model, [Neuron(fam, 0, c)]):
            hooked = _logits(model, ids)
        layer = arch.decoder_layers(model)[0]
        w, b = arch.role_weight(layer, MODULES[fam]), arch.role_bias(layer, MODULES[fam])
        saved = [t.detach().clone() for t in (w, b) if t is not None]
        with torch.no_grad():
            (w[:, c] if fam == "ffn" else w[c]).zero_()
            if b is not None and fam != "ffn":
                b[c].zero_()
        zeroed = _logits(model, ids)
        with torch.no_grad():
            for t, s in zip([t for t in (w, b) if t is not None], saved):
                t.copy_(s)
        assert not torch.equal(hooked, base), f"ablating {fam} channel {c} changed nothing"
        _close(hooked, zeroed, 1e-5)


def cell_sft(family, d, tmp):
    data = tmp / "sft.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "Q: ", "completion": "The capital of France is Paris."})
                              for _ in range(4)))
    code, _, err = run_cli("train", "sft", d, tmp / "sft", "--data", data, "--steps", "4", "--max-length", "24",
                           "--lr", "3e-3")
    assert code == 0, err
    losses = [json.loads(x)["loss"] for x in (tmp / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0], losses


def cell_grpo(family, d, tmp):
    from llmtool.train.grpo import token_surrogate

    code, _, err = run_cli("train", "grpo", d, tmp / "grpo", "--data", "gen:arith:8:1", "--steps", "1",
                           "--group-size", "2", "--prompts-per-rollout", "2", "--mini-batch", "4", "--micro-batch",
                           "4", "--max-new-tokens", "3", "--reward", "random:0.5")
    assert code == 0, err
    model = _load(d).train()
    seqs = torch.cat([_ids(12, s) for s in range(4)])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def logp():
        lp = torch.log_softmax(model(input_ids=seqs).logits[:, :-1].float(), -1)
        return lp.gather(-1, seqs[:, 1:, None]).squeeze(-1)[:, 4:]   # the "completion" tokens
    with torch.no_grad():
        old = logp()
    objs = []
    for _ in range(3):
        obj, _ = token_surrogate(logp(), old, adv)
        loss = -obj.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        objs.append(float(obj.mean().detach()))
    assert objs[-1] > objs[0], objs


def cell_route(family, d, tmp):
    from llmtool.route.decoding import FusionChooser, decode_loop
    from llmtool.route.vocab import VocabView

    model, tok = _load(d), _tok()
    prompts = [_ids(14)[0].tolist(), _ids(9, 20)[0].tolist()]   # left padding on the shorter one
    vocab = VocabView.of([model], tok)
    res = decode_loop(prompts, FusionChooser(None, [model], vocab, mode="expert", k=0), eos_ids=[], pad_id=0,
                      max_new_tokens=5)
    for p, r in zip(prompts, res):
        assert r.token_ids == greedy(model, p, 5), (r.token_ids, greedy(model, p, 5))


def cell_bench_agent(family, d, tmp):
    from llmtool.bench_agent.agents import HFAgent

    model, tok = _load(d), _tok()
    agent = HFAgent(str(d), model=model, tokenizer=tok, max_new_tokens=5, stop=())
    msgs = [{"role": "user", "content": "The capital of France is"}]
    turn = agent.act(msgs)
    ref = greedy(model, agent.render(msgs), 5, eos=tok.eos_token_id)
    assert turn.content == tok.decode(ref, skip_special_tokens=True).strip(), (turn.content, ref)
    msgs2 = msgs + [{"role": "assistant", "content": turn.content}, {"role": "user", "content": "And of Italy is"}]
    second = agent.act(msgs2)   # reuses the cached prefix
    fresh = HFAgent(str(d), model=model, tokenizer=tok, max_new_tokens=5, stop=()).act(msgs2)
    assert second.content == fresh.content and agent.reused_tokens > 0


def cell_lm_generate(family, d, tmp):
    from llmtool.core.lm import generate

    model = _load(d)
    prompts = [_ids(14)[0].tolist(), _ids(9, 20)[0].tolist()]
    outs = generate(model, _tok(), prompts, max_new_tokens=5, batch_size=2)
    for p, o in zip(prompts, outs):
        ref = greedy(model, p, 5, eos=_tok().eos_token_id)
        assert o[0].token_ids == ref, (o[0].token_ids, ref)


CELLS = {
    "evaluate ppl": cell_ppl,
    "compress": cell_compress,
    "quantize rtn": cell_rtn,
    "quantize quarot": _rotation_cell("quarot"),
    "quantize respinquant": _rotation_cell("respinquant"),
    "kvcache snapkv": cell_kvcache,
    "edit memit": cell_memit,
    "edit keystone": cell_keystone,
    "train sft": cell_sft,
    "train grpo": cell_grpo,
    "route generate": cell_route,
    "bench-agent run": cell_bench_agent,
    "generate (evade, evaluate tasks/judge, learn-program)": cell_lm_generate,
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_cell(command, family, family_dirs, tmp_path):
    prop = REFUSED.get((command, family))
    if prop is None:
        CELLS[command](family, family_dirs[family], tmp_path)
        return
    with pytest.raises(UsageError) as e:
        CELLS[command](family, family_dirs[family], tmp_path)
    msg = str(e.value)
    assert family in msg and prop in msg and "\n" not in msg, msg


# ------------------------------------------------------------------------------------------ the adapter
def test_every_family_is_in_the_adapter_and_its_layout_is_data():
    assert set(FAMILIES) == set(arch.FAMILIES)
    props = {f: set(arch.properties(build_model(f).config)) for f in FAMILIES}
    assert arch.P_BIAS in props["qwen2"] and arch.P_QK_NORM in props["qwen3"] and arch.P_FUSED in props["phi3"]
    assert {arch.P_PLUS_ONE, arch.P_POST_NORMS, arch.P_SLIDING, arch.P_SOFTCAP, arch.P_EMBED_SCALE,
            arch.P_GEGLU} <= props["gemma2"]
    assert {arch.P_QK_NORM, arch.P_SLIDING} <= props["gemma3_text"] and arch.P_EXPERTS in props["qwen3_moe"]
    assert props["llama"] == set()


@pytest.mark.parametrize("family", FAMILIES)
def test_role_weights_are_the_models_own_projections(family):
    """role_weight slices reproduce the family's own q/k/v and gate/up outputs (fused or not)."""
    model = build_model(family)
    layer = arch.decoder_layers(model)[0]
    mods = arch.block_linears(layer)
    for name, lin in mods.items():
        x = torch.randn(3, lin.in_features)
        fused = arch.arch_of(model).fused.get(name)
        roles = fused.roles if fused else (name,)
        want = torch.cat([x @ arch.role_weight(layer, r).T for r in roles], -1)
        _close(lin(x) - (0 if lin.bias is None else lin.bias), want, 1e-6)
    assert arch.attention_kinds(model.config) == {"gemma2": ["sliding", "full"], "gemma3_text": ["sliding", "full"]
                                                 }.get(family, ["full", "full"])


@pytest.mark.parametrize("family", FAMILIES)
def test_calibration_replay_equals_the_forward(family):
    """Layer-by-layer replay (svd-llm / zs-svd statistics, GPTQ) feeds every layer the mask and rotary
    embeddings of its own attention kind: the replayed last layer equals the model's own forward."""
    from llmtool.core.calib import replay_layers

    model, ids = build_model(family), torch.cat([_ids(20), _ids(20, 30)])
    layers = arch.decoder_layers(model)
    want = {}
    h = layers[-1].register_forward_hook(lambda m, i, o: want.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    _logits(model, ids)
    h.remove()
    for step in replay_layers(model, ids, batch_size=1):
        outs = step.forward()
    _close(torch.cat(outs), want["h"], 1e-5)


def test_eviction_on_an_all_sliding_model_is_refused_by_name(monkeypatch):
    """Mistral-style configs with a sliding window on every layer: sliding layers are not evicted, so a
    budget below 1 would evict nothing; the refusal names the property."""
    from llmtool.kvcache.pipeline import KVSpec, generate

    monkeypatch.setitem(FAMILY_CONFIGS, "mistral", ("MistralConfig", dict(sliding_window=8)))
    model = build_model("mistral")
    assert arch.attention_kinds(model.config) == ["sliding", "sliding"]
    with pytest.raises(UsageError, match=r"mistral \(sliding-window layers\)"):
        generate(model, _ids(20), None, KVSpec(evict="snapkv", budget=0.5, window_size=4), max_new_tokens=2)
    toks, _, _ = generate(model, _ids(20), None, KVSpec(evict="snapkv", budget=1.0, window_size=4), max_new_tokens=4)
    assert list(toks) == greedy(model, _ids(20)[0].tolist(), 4)


def test_broken_fused_slice_fails_the_rotation_property(family_dirs, tmp_path, monkeypatch):
    """Phi-3 with q and k swapped in the adapter's qkv_proj split: the QuaRot property check fails."""
    spec = arch.FAMILIES["phi3"]
    broken = dataclasses.replace(spec, fused={**spec.fused, "qkv": arch.Fused("self_attn.qkv_proj", ("q", "v", "k"))})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _rotation_cell("quarot")("phi3", family_dirs["phi3"], tmp_path / "a")    # passes with the real adapter
    monkeypatch.setitem(arch.FAMILIES, "phi3", broken)
    with pytest.raises(AssertionError, match="relative max error"):
        _rotation_cell("quarot")("phi3", family_dirs["phi3"], tmp_path / "b")


@pytest.mark.parametrize("change", [dict(norm="rmsnorm"), dict(mlp_out_norm=None)])
def test_broken_gemma_norms_fail_the_edit_property(family_dirs, tmp_path, monkeypatch, change):
    """Gemma 3 with the norm kind ``rmsnorm`` (gain w instead of 1 + w) or without its post-feedforward norm:
    MEMIT's rank-one edit misses its target."""
    monkeypatch.setitem(arch.FAMILIES, "gemma3_text", dataclasses.replace(arch.FAMILIES["gemma3_text"], **change))
    with pytest.raises(AssertionError, match="missed its target"):
        cell_memit("gemma3_text", family_dirs["gemma3_text"], tmp_path)


@pytest.mark.parametrize("change", [dict(norm="rmsnorm"), dict(attn_out_norm=None, mlp_out_norm=None)])
def test_broken_gemma_norms_fail_the_rotation_property(family_dirs, tmp_path, monkeypatch, change):
    """Gemma 2 read as an `rmsnorm` family (gains w folded instead of 1 + w) or without its sandwich norms
    (rotations fused into o_proj/down_proj rows, no online rotation): the ReSpinQuant property check fails."""
    monkeypatch.setitem(arch.FAMILIES, "gemma2", dataclasses.replace(arch.FAMILIES["gemma2"], **change))
    with pytest.raises(AssertionError, match="relative max error"):
        _rotation_cell("respinquant")("gemma2", family_dirs["gemma2"], tmp_path)


def test_broken_keystone_offset_fails_the_ablation_property(family_dirs, tmp_path, monkeypatch):
    """Phi-3 with the hooks reading k at q's offset of qkv_proj: the ablation no longer equals zeroing k's row."""
    spec = arch.FAMILIES["phi3"]
    broken = dataclasses.replace(spec, fused={**spec.fused, "qkv": arch.Fused("self_attn.qkv_proj", ("k", "q", "v"))})
    model = _load(family_dirs["phi3"])
    import llmtool.edit.keystone as ks

    monkeypatch.setattr(ks, "DEFAULT_FAMILIES", ("k",))
    cell_keystone("phi3", None, tmp_path, model=model)                 # passes with the real adapter
    real = arch.role_weight
    monkeypatch.setattr(arch, "role_weight", lambda layer, role, a=None: real(layer, role, spec))  # rows: real
    monkeypatch.setitem(arch.FAMILIES, "phi3", broken)                                         # hooks: broken
    with pytest.raises(AssertionError, match="relative max error"):
        cell_keystone("phi3", None, tmp_path, model=model)


# ------------------------------------------------------------------------------------------ hostile configs
def _hostile(tmp_path, family, edit) -> tuple[int, str]:
    d = save_family(family, tmp_path / family)
    edit(d)
    text = tmp_path / "t.txt"
    text.write_text(TINY_TEXT)
    return run_cli("evaluate", "ppl", d, "--data", text)[::2]


def _drop_key(key):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        del cfg[key]
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _rewrite_tensors(fn):
    def edit(d):
        from safetensors.torch import load_file, save_file

        f = d / "model.safetensors"
        sd = load_file(f)
        fn(sd)
        save_file(sd, f, metadata={"format": "pt"})
    return edit


@pytest.mark.parametrize("family,edit,needle", [
    ("qwen3", _drop_key("head_dim"), "has no head_dim"),
    ("gemma3_text", _drop_key("head_dim"), "has no head_dim"),
    ("phi3", _rewrite_tensors(lambda sd: sd.__setitem__("model.layers.1.self_attn.qkv_proj.weight",
                                                        sd["model.layers.1.self_attn.qkv_proj.weight"][:-16])),
     "model.layers.1.self_attn.qkv_proj.weight has shape [112, 64], config.json implies [128, 64]"),
    ("qwen3_moe", _rewrite_tensors(lambda sd: sd.pop("model.layers.0.mlp.gate.weight")),
     "has no model.layers.0.mlp.gate.weight"),
    ("qwen3_moe", _drop_key("num_experts_per_tok"), "num_experts_per_tok=None"),
])
def test_hostile_family_configs_are_one_line_errors(tmp_path, family, edit, needle):
    code, err = _hostile(tmp_path, family, edit)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------------------ the matrix
def render() -> str:
    fams = list(FAMILIES)
    lines = [BEGIN, "", "| command | " + " | ".join(f"`{f}`" for f in fams) + " |",
             "|---|" + "---|" * len(fams)]
    for cmd in COMMANDS:
        cells = []
        for f in fams:
            prop = REFUSED.get((cmd, f))
            cells.append("✓" if prop is None else f"refused: {prop} — {REASONS[(prop, cmd)]}")
        lines.append(f"| {cmd} | " + " | ".join(cells) + " |")
    lines += ["", "What each cell runs and the property it checks (a refused cell checks the one-line refusal "
              "naming the method, the family and the property):", ""]
    lines += [f"- **{cmd}** — {how}: {prop}." for cmd, (how, prop) in COMMANDS.items()]
    lines += ["", "Layout properties per family (`llmtool.core.arch.properties` of the test configs):", ""]
    for f in fams:
        props = arch.properties(build_model(f).config) if "torch" in sys.modules else []
        lines.append(f"- `{f}`: {', '.join(props) or 'Llama layout'}")
    lines += ["", END]
    return "\n".join(lines)


def test_matrix_is_current():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC.name} has no generated matrix block"
    block = text[text.index(BEGIN): text.index(END) + len(END)]
    assert block == render(), f"{DOC.name} is stale: run `python tests/test_families.py --write docs/families.md`"


def write(path: Path) -> None:
    text = path.read_text() if path.exists() else ""
    block = render()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        write(Path(sys.argv[2]))
        print(f"wrote {sys.argv[2]}")
    else:
        print("usage: python tests/test_families.py --write docs/families.md")
