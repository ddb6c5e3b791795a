"""Shared instrumentation used by compress, quantize and edit (core.arch, core.calib) and the compress
method contract: architecture roles across the Llama/Mistral/Qwen2 families, layer-by-layer replay
statistics equal to a plain full forward, and options of other methods refused."""
import json

import pytest
import torch
from conftest import build_tiny_llama, run_cli

from llmtool.core import arch
from llmtool.core.calib import InputStatistics, first_layer_inputs, input_statistics, replay_layers
from llmtool.core.console import UsageError
from llmtool.core.hooks import forward_hooks

VOCAB = 320
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _family(name):
    import transformers

    cfg_cls, model_cls = {"mistral": ("MistralConfig", "MistralForCausalLM"),
                          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[name]
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**SMALL)).eval()


@pytest.fixture(scope="module")
def llama():
    return build_tiny_llama(VOCAB, seed=0, dtype=torch.float64).eval()


def _ids(n, t, seed=1):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ core.arch
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_roles_resolve_to_the_block_linears_in_every_family(family, llama):
    model = llama if family == "llama" else _family(family)
    names = arch.linear_names(model)
    assert len(names) == len(arch.decoder_layers(model)) == model.config.num_hidden_layers
    expected = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert names[1] == [f"model.layers.1.{s}" for s in expected]
    layer = arch.decoder_layers(model)[1]
    assert arch.linear(layer, "down") is layer.mlp.down_proj and arch.attention(layer) is layer.self_attn
    assert arch.input_norm(layer) is layer.input_layernorm and arch.final_norm(model) is model.model.norm
    assert arch.lm_head(model) is model.lm_head and arch.embed(model) is model.model.embed_tokens
    cfg = model.config
    assert arch.head_dim(model) * arch.n_heads(model) == cfg.hidden_size
    assert arch.n_kv_heads(model) == cfg.num_key_value_heads
    assert arch.input_source("model.layers.1.self_attn.v_proj") == "model.layers.1.self_attn.q_proj"
    assert arch.input_source("model.layers.1.mlp.up_proj") == "model.layers.1.mlp.gate_proj"
    assert arch.input_source("model.layers.1.mlp.down_proj") == "model.layers.1.mlp.down_proj"


def test_unsupported_and_biased_families_are_refused(llama):
    with pytest.raises(UsageError, match="unsupported architecture model_type='gpt2'"):
        arch.arch_of({"model_type": "gpt2"}, "llmtool quantize")
    assert arch.require(llama, "llmtool quantize", bias_free=True).family == "llama"
    with pytest.raises(UsageError, match="biased projections"):
        arch.require(_family("qwen2"), "llmtool quantize", bias_free=True)
    arch.require(_family("qwen2"), "llmtool compress")  # compress handles biases


def test_set_linear_swaps_the_module(llama):
    import copy

    m = copy.deepcopy(llama)
    layer = arch.decoder_layers(m)[0]
    new = torch.nn.Linear(64, 64, bias=False).double()
    arch.set_linear(layer, "o", new)
    assert layer.self_attn.o_proj is new


# ------------------------------------------------------------------------------------------ core.calib
def test_replayed_layer_statistics_equal_a_full_forward(llama):
    """Layer-by-layer replay from captured layer-0 inputs gives the same X^T X, sum|x| and counts as
    hooks over one ordinary forward pass of the whole model."""
    ids = _ids(5, 12)
    names = [n for layer in arch.linear_names(llama) for n in layer]
    with torch.no_grad(), input_statistics(llama, names, abs_sum=True) as ref:
        llama(input_ids=ids)
    groups = arch.linear_names(llama)
    for step in replay_layers(llama, ids, batch_size=2):
        stats = InputStatistics(abs_on=True)
        with forward_hooks(llama, groups[step.index], stats.hook):
            step.forward(keep=True)
        for n in groups[step.index]:
            assert stats.count[n] == ref.count[n] == 5 * 12
            torch.testing.assert_close(stats.gram[n], ref.gram[n], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(stats.abs_sum[n], ref.abs_sum[n], rtol=1e-10, atol=1e-10)


def test_replay_feeds_a_changed_layer_forward(llama):
    """A layer changed during its step (as GPTQ does) feeds its *new* outputs to the next layer."""
    import copy

    m = copy.deepcopy(llama)
    ids = _ids(2, 8)
    seen = []
    for step in replay_layers(m, ids):
        seen.append(step.inputs[0][0].clone())
        if step.index == 0:
            with torch.no_grad():
                arch.linear(step.layer, "down").weight.mul_(2.0)
    h = {}

    def grab(mod, args, kw):
        h["x"] = (args[0] if args else kw["hidden_states"]).clone()

    with torch.no_grad():
        handle = arch.decoder_layers(m)[1].register_forward_pre_hook(grab, with_kwargs=True)
        m(input_ids=ids)
        handle.remove()
    torch.testing.assert_close(seen[1], h["x"], rtol=1e-10, atol=1e-10)


def test_first_layer_inputs_chunks_are_the_batch(llama):
    ids = _ids(5, 10)
    whole = first_layer_inputs(llama, ids)
    parts = first_layer_inputs(llama, ids, batch_size=2)
    assert [p[0].shape[0] for p in parts] == [2, 2, 1] and len(whole) == 1
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), whole[0][0])


def test_input_statistics_match_explicit_gram():
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    s = InputStatistics(abs_on=True)
    s.add("a", x[:2])
    s.add("a", x[2:])
    flat = x.reshape(-1, 5)
    torch.testing.assert_close(s.gram["a"], flat.T @ flat)
    torch.testing.assert_close(s.covariance("a"), flat.T @ flat / 21)
    torch.testing.assert_close(s.abs_mean("a"), flat.abs().mean(0))


def test_chunked_input_statistics_equal_one_shot_and_stay_in_place():
    """``chunk_rows``: the same Gram / |x| sums to rounding, accumulated into one tensor (no new Gram per add)."""
    x = torch.randn(4, 50, 6, dtype=torch.float32)
    one, chunked = InputStatistics(abs_on=True), InputStatistics(abs_on=True, chunk_rows=7)
    for part in x.split(3):
        one.add("a", part)
    chunked.add("a", x[:1])
    gram_id = id(chunked.gram["a"])
    chunked.add("a", x[1:])
    assert id(chunked.gram["a"]) == gram_id and chunked.gram["a"].dtype == torch.float64
    assert chunked.count["a"] == one.count["a"] == 200
    torch.testing.assert_close(chunked.gram["a"], one.gram["a"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked.abs_sum["a"], one.abs_sum["a"], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ compress contract
def _args(model, out, *extra, calib):
    return ["compress", str(model), str(out), "--calib-data", str(calib), "--calib-samples", "4",
            "--calib-seqlen", "32", *extra]


@pytest.mark.parametrize("extra,needle", [
    (["--method", "svd", "--grad-samples", "2"], "--grad-samples does not apply to method 'svd'"),
    (["--method", "svd-llm", "--keep-rank-ratio", "0.2"], "--keep-rank-ratio does not apply to method 'svd-llm'"),
    (["--method", "fwsvd", "--correction", "pull-subspace"], "--correction does not apply to method 'fwsvd'"),
    (["--method", "zs-svd", "--keep-rank-ratio", "1.5"], "--keep-rank-ratio 1.5: must be <= 1"),
])
def test_options_of_other_methods_are_refused(tiny_llama_dir, tiny_text_file, tmp_path, extra, needle):
    out = tmp_path / "out"
    code, _, err = run_cli(*_args(tiny_llama_dir, out, "--ratio", "0.4", *extra, calib=tiny_text_file))
    assert code == 2 and needle in err, err
    assert not out.exists()


def test_provenance_rebuilds_the_config(tiny_llama_dir, tiny_text_file, tmp_path):
    from llmtool.compress.methods import METHODS

    out = tmp_path / "svd"
    code, _, err = run_cli("--seed", "3", *_args(tiny_llama_dir, out, "--method", "svd", "--ratio", "0.3",
                                                 calib=tiny_text_file))
    assert code == 0, err
    prov = json.loads((out / "llmtool.json").read_text())
    cfg = METHODS.get_config(prov["method"]).from_dict(prov["parameters"])
    assert cfg.name == "svd" and cfg.ratio == 0.3 and cfg.seed == 3 and cfg.calib_samples == 4
    assert json.loads((out / "report.json").read_text())["ranks"] == prov["ranks"]
