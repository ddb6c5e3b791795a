"""quantize area: rotation fusion exactness, transitions, Cayley SGD, quantizers, GPTQ, checkpoint
format round trip, no-op at 16 bits, and CLI errors (tiny random Llama from conftest)."""
from __future__ import annotations

import os

# triton fixes interpreter mode when a kernel is decorated; this module imports the kernels too, so
# set it here as well (CPU dispatch never uses triton, so this changes nothing for these tests).
os.environ["TRITON_INTERPRET"] = "1"

import copy
import json

import pytest
import torch

from conftest import build_tiny_llama, run_cli, run_cli_subprocess
from llmtool.quantize import QuaRotConfig, ReSpinQuantConfig, RTNConfig, quantize_
from llmtool.quantize import rotations as R
from llmtool.quantize.api import _replace_linears, install_low_rank_transitions
from llmtool.quantize.gptq import gptq_weight
from llmtool.quantize.quantizers import dequantize_weight, rtn_weight

VOCAB = 320


@pytest.fixture()
def exact_rmsnorm(monkeypatch):
    """HF's RMSNorm upcasts to float32; for the 1e-10 fp64 fusion tests compute it in the input dtype."""
    from transformers.models.llama import modeling_llama

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight.to(x.dtype) * (x * torch.rsqrt(var + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def _tiny64():
    return build_tiny_llama(VOCAB, seed=0, dtype=torch.float64)


def _ids(n=2, s=12, seed=0):
    return torch.randint(0, VOCAB, (n, s), generator=torch.Generator().manual_seed(seed))


def _random_rotations(model, tied, seed=0):
    cfg = model.config
    rot = R.RotationSet(cfg.num_hidden_layers, cfg.hidden_size, R.head_dim(cfg), tied=tied, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in rot.matrices():
            for j in range(p.shape[0]):
                p[j].copy_(R.random_orthogonal(p.shape[-1], g))
    return rot


def _rotated_copy(model, rot, rank=None):
    m = copy.deepcopy(model)
    R.prepare(m)
    R.fuse_down_hadamard(m)
    R.fuse(m, rot)
    if rank is not None:
        install_low_rank_transitions(m, rot, rank)
    _replace_linears(m, RTNConfig(w_bits=16, a_bits=16), rotated=True)
    return m


def test_global_rotation_fusion_is_exact_fp64(exact_rmsnorm):
    model, x = _tiny64(), _ids()
    ref = model(input_ids=x).logits
    m = _rotated_copy(model, _random_rotations(model, tied=True))
    assert (m(input_ids=x).logits - ref).abs().max() < 1e-10


def test_layerwise_fusion_with_exact_transitions_fp64(exact_rmsnorm):
    """Independent R1[i], R2[i], R3[i]: exact at rank D; the low-rank path at rank D equals dense T."""
    model, x = _tiny64(), _ids()
    ref = model(input_ids=x).logits
    rot = _random_rotations(model, tied=False)
    m = _rotated_copy(model, rot, rank=model.config.hidden_size)
    assert (m(input_ids=x).logits - ref).abs().max() < 1e-10
    # dropping the transitions (rank 0) is not exact: the transitions do real work
    m0 = _rotated_copy(model, rot, rank=0)
    assert (m0(input_ids=x).logits - ref).abs().max() > 1e-3


def test_low_rank_transition_matches_dense_orientation():
    from llmtool.quantize.modules import LowRankTransition

    g = torch.Generator().manual_seed(3)
    t = R.random_orthogonal(16, g)
    basis, core = R.approximate_transition(t, 16)
    mod = LowRankTransition(16, 16, dtype=torch.float64)
    mod.basis.copy_(basis)
    mod.core.copy_(core)
    h = torch.randn(5, 16, dtype=torch.float64, generator=g)
    assert torch.allclose(mod(h), h @ t, atol=1e-10)


def _near_identity(d, k, eps, g):
    """An orthogonal T = I + rank-k perturbation: a rotation acting on a random k-dim subspace."""
    q, _ = torch.linalg.qr(torch.randn(d, k, dtype=torch.float64, generator=g))
    a = torch.randn(k, k, dtype=torch.float64, generator=g) * eps
    small = torch.linalg.matrix_exp(a - a.T)
    return torch.eye(d, dtype=torch.float64) + q @ (small - torch.eye(k, dtype=torch.float64)) @ q.T


def test_transition_approximation_properties():
    g = torch.Generator().manual_seed(0)
    d = 32
    t = _near_identity(d, 4, 0.5, g)
    for r in (4, 6, 32):
        basis, core = R.approximate_transition(t, r)
        that = torch.eye(d, dtype=torch.float64) + basis @ core @ basis.T
        assert (that.T @ that - torch.eye(d, dtype=torch.float64)).abs().max() < 1e-10
        assert (that - t).abs().max() < 1e-10  # r >= k recovers T exactly
    # random near-identity rotation: error non-increasing in r, T̂ orthogonal for every r
    a = torch.randn(d, d, dtype=torch.float64, generator=g) * 0.05
    t = torch.linalg.matrix_exp(a - a.T)
    errs = []
    for r in (0, 1, 2, 4, 8, 16, 32):
        basis, core = R.approximate_transition(t, r)
        that = torch.eye(d, dtype=torch.float64) + basis @ core @ basis.T
        assert (that.T @ that - torch.eye(d, dtype=torch.float64)).abs().max() < 1e-10
        errs.append(float(torch.linalg.norm(that - t)))
    assert all(b <= a_ + 1e-12 for a_, b in zip(errs, errs[1:]))
    assert errs[-1] < 1e-10 < errs[0]


def test_tied_rotations_give_zero_cores():
    model = _tiny64()
    rot = _random_rotations(model, tied=True)
    for i in range(model.config.num_hidden_layers):
        for t in R.transitions(rot, i):
            _, core = R.approximate_transition(t.detach(), 8)
            assert core.abs().max() == 0


def test_cayley_sgd_stays_orthogonal_and_descends():
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(R.random_orthogonal(32, g, torch.float32)[None])
    opt = R.CayleySGD([p], lr=1.5)
    eye = torch.eye(32)
    for _ in range(100):
        p.grad = torch.randn(1, 32, 32, generator=g)
        opt.step()
    assert (p[0].T @ p[0] - eye).abs().max() < 1e-5
    # descent: minimise ||R - target||^2 for an orthogonal target
    target = R.random_orthogonal(32, g, torch.float32)
    q = torch.nn.Parameter(torch.eye(32)[None])
    opt = R.CayleySGD([q], lr=1.5)
    first = None
    for _ in range(50):
        loss = ((q[0] - target) ** 2).sum()
        first = first if first is not None else float(loss.detach())
        q.grad = None
        loss.backward()
        opt.step()
    assert float(((q[0] - target) ** 2).sum().detach()) < 0.5 * first


def test_cayley_sgd_non_finite_update_keeps_that_rotation(monkeypatch):
    g = torch.Generator().manual_seed(1)
    r0 = torch.stack([R.random_orthogonal(16, g, torch.float32) for _ in range(3)])
    p = torch.nn.Parameter(r0.clone())
    p.grad = torch.randn(3, 16, 16, generator=g)
    real = torch.linalg.solve

    def solve(a, b, **kw):
        out = real(a, b, **kw)
        out[1] = float("nan")        # the update of matrix 1 came out non-finite
        return out

    monkeypatch.setattr(torch.linalg, "solve", solve)
    R.CayleySGD([p], lr=1.5).step()
    assert torch.isfinite(p).all()
    assert torch.allclose(p[1], r0[1], atol=1e-5) and not torch.allclose(p[0], r0[0], atol=1e-3)
    eye = torch.eye(16)
    assert (p.transpose(-1, -2) @ p - eye).abs().max() < 1e-5


def test_gptq_beats_rtn_on_synthetic_layer():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)  # correlated inputs
    w = torch.randn(48, 64, generator=g)
    h = x.T @ x
    c_g, s_g = gptq_weight(w, h, 4)
    c_r, s_r = rtn_weight(w, 4)
    err_g = ((x @ (dequantize_weight(c_g, s_g, 4) - w).T) ** 2).mean()
    err_r = ((x @ (dequantize_weight(c_r, s_r, 4) - w).T) ** 2).mean()
    assert err_g < 0.8 * err_r


def test_clip_search_never_worse_than_no_clip():
    w = torch.randn(32, 64) * torch.rand(32, 1)
    w[:, 0] *= 20  # outliers
    for bits in (3, 4):
        c0, s0 = rtn_weight(w, bits, clip=False)
        c1, s1 = rtn_weight(w, bits, clip=True)
        e0 = ((dequantize_weight(c0, s0, bits) - w) ** 2).sum(1)
        e1 = ((dequantize_weight(c1, s1, bits) - w) ** 2).sum(1)
        assert (e1 <= e0 + 1e-6).all() and e1.sum() < e0.sum()


@pytest.mark.parametrize("cfg", [RTNConfig(w_bits=16, a_bits=16), QuaRotConfig(w_bits=16, a_bits=16)])
def test_sixteen_bits_is_noop(cfg):
    model = build_tiny_llama(VOCAB, seed=0)
    x = _ids()
    ref = model(input_ids=x).logits
    m = copy.deepcopy(model)
    quantize_(m, cfg, None)
    out = m(input_ids=x).logits
    if cfg.method == "rtn":
        assert torch.equal(out, ref)  # no rotation at 16 bits: bit-identical
    else:
        assert (out - ref).abs().max() < 1e-4  # rotation only: fp32 rounding


def test_respinquant_identity_rotations_16_bits_reproduce_model():
    model = build_tiny_llama(VOCAB, seed=0)
    x = _ids()
    ref = model(input_ids=x).logits
    m = copy.deepcopy(model)
    quantize_(m, ReSpinQuantConfig(w_bits=16, a_bits=16, train_steps=0, rank=8), None)
    assert (m(input_ids=x).logits - ref).abs().max() < 1e-4


def test_quantized_model_differs_and_uses_packed_ints():
    model = build_tiny_llama(VOCAB, seed=0)
    m = copy.deepcopy(model)
    quantize_(m, QuaRotConfig(w_bits=4, a_bits=4), _ids(4, 32, 1))
    q = m.model.layers[0].self_attn.q_proj
    assert q.weight_packed.dtype == torch.uint8 and q.weight_packed.shape == (64, 32)
    assert q.weight_scale.dtype == torch.float16
    x = _ids()
    assert (m(input_ids=x).logits - model(input_ids=x).logits).abs().max() > 1e-3


def test_respinquant_training_changes_rotations_and_keeps_them_orthogonal():
    model = build_tiny_llama(VOCAB, seed=0)
    cfg = ReSpinQuantConfig(w_bits=4, a_bits=4, train_steps=2, train_seqlen=16, rank=8)
    m = copy.deepcopy(model)
    rep = quantize_(m, cfg, _ids(4, 32, 2))
    rot = rep["rotations"]
    from llmtool.kernels.hadamard import hadamard_matrix

    assert (rot.R1[0].detach() - hadamard_matrix(64, torch.float32)).abs().max() > 1e-4
    eye = torch.eye(64)
    assert (rot.R2[1].detach().T @ rot.R2[1].detach() - eye).abs().max() < 1e-4
    assert len(rep["train_losses"]) == 2


def test_cli_roundtrip_reload_bit_exact(tiny_llama_dir, tiny_text_file, tmp_path):
    import llmtool
    from llmtool.core.models import load_tokenizer

    out = tmp_path / "q"
    code, stdout, err = run_cli("--json", "quantize", "--method", "respinquant", tiny_llama_dir, out,
                                "--w-bits", "4", "--a-bits", "4", "--rank", "8", "--train-steps", "2",
                                "--train-seqlen", "16", "--calib-data", tiny_text_file, "--calib-samples", "4",
                                "--calib-seqlen", "32", "--data", tiny_text_file, "--seqlen", "32",
                                "--max-tokens", "128")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["checkpoint_bytes"] < res["source_bytes"]
    cfg = json.loads((out / "config.json").read_text())
    block = cfg["llmtool_quant"]
    assert block["weights"]["bits"] == 4 and block["residual_transition"]["rank"] == 8
    assert cfg["tie_word_embeddings"] is False
    m = llmtool.load(out)
    ids = torch.tensor([load_tokenizer(tiny_llama_dir)("a truth universally acknowledged")["input_ids"]])
    m2 = llmtool.load(out)
    assert torch.equal(m(input_ids=ids).logits, m2(input_ids=ids).logits)
    from llmtool.core import data as data_mod
    from llmtool.core.evalkit import perplexity

    tok = load_tokenizer(tiny_llama_dir)
    ppl = perplexity(m, data_mod.tokenize(tok, data_mod.load_text(tiny_text_file)), seqlen=32, max_tokens=128).ppl
    assert abs(ppl - res["ppl_quant"]) < 1e-9 * ppl  # reload reproduces the in-memory quantized model
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_packed").dtype == torch.uint8
        assert f.get_tensor("model.layers.0.attn_transition.basis").shape == (64, 8)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float16
    assert "model.layers.1.mlp_transition.core" in keys


def test_cli_rtn_w3_reload_matches(tiny_llama_dir, tiny_text_file, tmp_path):
    import llmtool

    out = tmp_path / "r"
    code, stdout, err = run_cli("--json", "quantize", "--method", "rtn", tiny_llama_dir, out, "--w-bits", "3",
                                "--a-bits", "3", "--data", tiny_text_file, "--seqlen", "32", "--max-tokens", "128")
    assert code == 0, err
    res = json.loads(stdout)
    from llmtool.core import data as data_mod
    from llmtool.core.evalkit import perplexity
    from llmtool.core.models import load_tokenizer

    m = llmtool.load(out)
    ids = data_mod.tokenize(load_tokenizer(out), data_mod.load_text(tiny_text_file))
    assert abs(perplexity(m, ids, seqlen=32, max_tokens=128).ppl - res["ppl_quant"]) < 1e-9 * res["ppl_quant"]
    assert m.model.layers[0].mlp.up_proj.weight_packed.shape == (128, 24)
    # provenance is the method config as a dict: it rebuilds the config (run settings beside it)
    from llmtool.quantize.configs import METHODS

    prov = json.loads((out / "llmtool.json").read_text())
    cfg = METHODS.get_config(prov["method"]).from_dict(prov["parameters"])
    assert (cfg.name, cfg.w_bits, cfg.a_bits, cfg.weight_algorithm) == ("rtn", 3, 3, "rtn")
    assert prov["run"]["eval_data"] == str(tiny_text_file) and prov["run"]["seqlen"] == 32
    assert json.loads((out / "report.json").read_text())["ppl_quant"] == res["ppl_quant"]


@pytest.mark.parametrize("args,needle", [
    (["--w-bits", "5"], "--w-bits 5: choose one of 3, 4, 8, 16"),
    (["--a-bits", "2"], "--a-bits 2: choose one of 3, 4, 8, 16"),
    (["--kv-bits", "3"], "--kv-bits 3"),
    (["--method", "gptq9"], "unknown method 'gptq9'"),
    # options of another method are refused, never silently dropped (issue 11)
    (["--method", "rtn", "--rank", "7", "--train-steps", "99"], "--train-steps, --rank does not apply to method 'rtn'"),
    (["--method", "spinquant", "--rank", "7"], "--rank does not apply to method 'spinquant'"),
    (["--method", "quarot", "--lr", "0.5"], "--lr does not apply to method 'quarot'"),
])
def test_cli_bad_options_exit_2(tiny_llama_dir, tmp_path, args, needle):
    code, _, err = run_cli("quantize", tiny_llama_dir, tmp_path / "o", *args)
    assert code == 2 and needle in err, err
    assert not (tmp_path / "o").exists()


def test_cli_unsupported_architecture_exit_2_no_traceback(tmp_path, tiny_llama_dir):
    bad = tmp_path / "gpt2ish"
    bad.mkdir()
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    r = run_cli_subprocess("quantize", "--method", "quarot", bad, tmp_path / "o")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    cfg["architectures"] = ["OlmoForCausalLM"]   # a causal LM of a family core.arch does not know
    cfg["model_type"] = "olmo"
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli("quantize", bad, tmp_path / "o2")
    assert code == 2 and "unsupported architecture" in err


def test_kv_cache_quantization_error_grows_as_bits_shrink():
    model = build_tiny_llama(VOCAB, seed=0)
    x = _ids()
    ref = model(input_ids=x).logits
    errs = {}
    for kv in (16, 8, 4):
        m = copy.deepcopy(model)
        quantize_(m, QuaRotConfig(w_bits=16, a_bits=16, kv_bits=kv), None)
        errs[kv] = float((m(input_ids=x).logits - ref).abs().max().detach())
    assert errs[16] < 1e-4 < errs[8] < errs[4]


@pytest.mark.slow
def test_global_rotation_fusion_fp32_on_smollm2(smollm2_dir):
    """QuaRot rotation of the real model at 16 bits: fp32 logits unchanged (max |Δ| < 1e-3 on logits of
    magnitude ~10-30; relative 1e-4)."""
    from llmtool.core.models import load_model

    model = load_model(smollm2_dir)
    x = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=x).logits
    quantize_(model, QuaRotConfig(w_bits=16, a_bits=16), None)
    out = model(input_ids=x).logits
    assert ((out - ref).abs().max() / ref.abs().max()) < 1e-4


def test_quarot_defaults_to_its_own_activation_quantizer():
    """QuaRot's activation quantizer is symmetric with clip 0.9 (SpinQuant's asymmetric, unclipped one is
    the shared default); the help names the per-method defaults."""
    from llmtool.quantize.configs import METHODS

    q, r = METHODS.build("quarot"), METHODS.build("respinquant")
    assert (q.a_symmetric, q.a_clip_ratio) == (True, 0.9)
    assert (r.a_symmetric, r.a_clip_ratio) == (False, 1.0)
    assert METHODS.build("quarot", a_symmetric=False).a_symmetric is False
    code, out, _ = run_cli("quantize", "--help")
    assert code == 0 and "quarot: 0.9" in " ".join(out.split())
