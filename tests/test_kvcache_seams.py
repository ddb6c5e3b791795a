"""The kvcache area on the shared seams: one attention function with composable transforms
(core.attention), a quantized checkpoint's KV quantization kept under `kvcache evaluate`, methods from
registries, no hidden thread policy."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import build_tiny_llama, run_cli, save_tiny


@pytest.fixture(scope="module")
def kv4_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv4")
    src = save_tiny(root / "src", seed=3, initializer_range=0.3)   # sharp attention: KV noise shows
    out = root / "q"
    code, _, err = run_cli("quantize", "--method", "rtn", src, out, "--w-bits", "16", "--a-bits", "16",
                           "--kv-bits", "4", "--no-eval")
    assert code == 0, err
    return out


def _continuation_nll(model, ids, prefix):
    from llmtool.core.lm import token_nll

    return token_nll(model, ids[None])[0, prefix - 1:].sum().item()


def test_kvcache_evaluate_keeps_checkpoint_kv_quantization(kv4_checkpoint, tiny_text_file):
    """Defect (issue 11): kvcache claimed `_attn_implementation` and dropped quantize's KV quantization,
    so `kvcache evaluate` measured a --kv-bits 4 checkpoint as if it were full precision."""
    from llmtool.core.data import load_text, tokenize
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.quantize.modules import disable_kv_quant

    prefix, cont = 32, 32
    code, stdout, err = run_cli("--json", "kvcache", "evaluate", kv4_checkpoint, "--task", "ppl", "--data",
                                tiny_text_file, "--prefix", str(prefix), "--continuation", str(cont), "--samples", "1")
    assert code == 0, err
    measured = json.loads(stdout)["nll"] * cont

    model, tok = load_model(kv4_checkpoint), load_tokenizer(kv4_checkpoint)
    ids = tokenize(tok, load_text(str(tiny_text_file)))[:prefix + cont]
    with_kv = _continuation_nll(model, ids, prefix)
    disable_kv_quant(model)
    without_kv = _continuation_nll(model, ids, prefix)
    assert abs(with_kv - without_kv) > 1e-3 * cont          # 4-bit KV visibly changes the model
    assert measured == pytest.approx(with_kv, rel=1e-4, abs=1e-4)


def test_transforms_compose_under_eviction(tiny_llama_dir):
    """KV quantization and an eviction mask act together: the logits under both differ from either alone,
    and with both removed the model is back to its original attention."""
    from llmtool.core import arch
    from llmtool.core.attention import transforms
    from llmtool.kvcache.pipeline import KVSpec, generate
    from llmtool.quantize.modules import disable_kv_quant, enable_kv_quant

    model = build_tiny_llama(320, seed=1)
    base_impl = model.config._attn_implementation
    ctx = torch.randint(3, 320, (1, 96), generator=torch.Generator().manual_seed(0))
    evict = KVSpec(evict="snapkv", budget=0.5, window_size=8)
    full = KVSpec()

    def last_logits(spec):
        _, _, logits = generate(model, ctx, None, spec, max_new_tokens=3, return_logits=True)
        return torch.cat(logits)

    plain, evicted = last_logits(full), last_logits(evict)
    enable_kv_quant(model, arch.decoder_layers(model), bits=4, group_size=16)
    assert transforms(arch.attention(arch.decoder_layers(model)[0])) == ["kv-quant"]
    quant, both = last_logits(full), last_logits(evict)
    assert transforms(arch.attention(arch.decoder_layers(model)[0])) == ["kv-quant"]   # kvcache removed its own
    for a, b in ((plain, evicted), (plain, quant), (quant, both), (evicted, both)):
        assert (a - b).abs().max() > 1e-4
    disable_kv_quant(model)
    assert model.config._attn_implementation == base_impl
    assert torch.allclose(last_logits(evict), evicted, atol=1e-5)


def test_transform_order_and_context(tiny_llama_dir):
    """Transforms run in `order`; a `with transform(...)` block leaves nothing behind."""
    from llmtool.core.attention import add_transform, attention_modules, remove_transform, transform

    model = build_tiny_llama(320, seed=2)
    calls = []

    def rec(tag):
        def fn(module, q, k, v, mask, **kw):
            if module.layer_idx == 0:
                calls.append(tag)
            return q, k, v, mask
        return fn

    ids = torch.randint(3, 320, (1, 12))
    with torch.no_grad():
        ref = model(ids).logits
        add_transform(model, "b", rec("b"), order=5)
        with transform(model, "a", rec("a"), order=1):
            out = model(ids).logits
        assert calls == ["a", "b"] and torch.allclose(out, ref, atol=1e-6)
        remove_transform(model, "b")
    assert not any(hasattr(m, "_llmtool_attn_transforms") for m in attention_modules(model))
    assert not model.config._attn_implementation.startswith("llmtool_")


def test_no_hidden_thread_policy():
    """Defect (issue 11): kvcache capped torch at 2 threads; the root --threads is the one policy."""
    import inspect

    from llmtool.kvcache import cli, pipeline

    for mod in (cli, pipeline):
        assert "set_num_threads" not in inspect.getsource(mod)


def test_method_options_from_registry(tiny_llama_dir, tiny_text_file):
    from llmtool.kvcache import adakv, pyramidkv, snapkv, streamingllm  # noqa: F401
    from llmtool.kvcache.eviction import PRESSES
    from llmtool.kvcache.methods import METHODS

    evictions = [c.name for c in METHODS.configs() if getattr(c, "kind", "") == "evict"]
    assert sorted(evictions) == PRESSES.names()
    code, out, _ = run_cli("kvcache", "evaluate", "--help")
    assert code == 0 and all(n in out for n in METHODS.names())
    base = ["kvcache", "evaluate", tiny_llama_dir, "--task", "ppl", "--data", tiny_text_file]
    for extra, word in ((["--method", "kivi", "--budget", "0.5"], "--budget"),
                        (["--method", "streamingllm", "--critical"], "--critical"),
                        (["--method", "snapkv", "--patterns", "8"], "--patterns")):
        code, _, err = run_cli(*base, *extra)
        assert code == 2 and word in err and "does not apply" in err, (extra, err)


def test_config_is_provenance(tiny_llama_dir, tiny_text_file):
    from llmtool.kvcache.methods import METHODS, to_spec

    code, stdout, err = run_cli("--json", "kvcache", "evaluate", tiny_llama_dir, "--task", "ppl", "--data",
                                tiny_text_file, "--prefix", "32", "--continuation", "16", "--samples", "1",
                                "--method", "pyramidkv", "--budget", "0.5", "--window-size", "4", "--critical")
    assert code == 0, err
    res = json.loads(stdout)
    cfg = res["config"]
    assert cfg["method"] == "pyramidkv" and cfg["budget"] == 0.5 and cfg["critical"] is True
    again = METHODS.get_config(cfg["method"]).from_dict(cfg)
    assert to_spec(again).label() == res["method"] == "critical+pyramidkv@0.5"
