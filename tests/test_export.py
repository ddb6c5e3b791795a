"""llmtool's own formats are refused by plain transformers (never loaded as garbage), and
`llmtool models export` turns them into plain transformers checkpoints with the same outputs (issue 18)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli, save_tiny


@pytest.fixture(scope="module")
def tiny96(tmp_path_factory):
    # intermediate 96 = 12 x 8: the online Hadamard before down_proj is a Kronecker product with a
    # non-symmetric 12 x 12 factor, so a transposed fold would be caught
    return save_tiny(tmp_path_factory.mktemp("t96") / "tiny", intermediate_size=96)


def _logits(model, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits.double()


def _plain(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, trust_remote_code=False).eval()


def _make(kind, src, out, *extra):
    if kind == "lowrank":
        argv = ["compress", "--method", "svd", str(src), str(out), "--ratio", "0.3"]
    else:
        argv = ["quantize", str(src), str(out), "--no-eval", "--calib-samples", "4", "--calib-seqlen", "16", *extra]
    code, _, err = run_cli(*argv)
    assert code == 0, err


@pytest.mark.parametrize("kind,extra", [
    ("lowrank", ()),
    ("quant", ("--method", "rtn", "--w-bits", "4", "--a-bits", "16")),
    ("quant", ("--method", "quarot", "--w-bits", "4", "--a-bits", "16")),
])
def test_plain_transformers_refuses_and_export_matches(tiny96, tmp_path, kind, extra):
    import llmtool

    out = tmp_path / "out"
    _make(kind, tiny96, out, *extra)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == f"llmtool_{kind}" and cfg["llmtool_base_config"]["model_type"] == "llama"
    with pytest.raises(ValueError, match=f"llmtool_{kind}"):  # was: a Llama with random weights (ppl 3e11)
        _plain(out)
    ours = llmtool.load(out)
    dense = tmp_path / "dense"
    code, _, err = run_cli("--json", "models", "export", str(out), str(dense))
    assert code == 0, err
    assert "llmtool" not in (dense / "config.json").read_text().replace("llmtool.json", "")
    plain = _plain(dense)
    assert type(plain).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(_logits(plain), _logits(ours), rtol=1e-4, atol=1e-4)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(dense)("hello")["input_ids"]


def test_export_of_w4a4_is_the_weight_only_model_and_says_so(tiny96, tmp_path):
    """Activation quantization has no plain-transformers form: the export equals the quantized model with
    activations at full precision (the rotation and the folded online Hadamard kept), and reports what it left out."""
    import llmtool

    out = tmp_path / "q"
    _make("quant", tiny96, out, "--method", "quarot", "--w-bits", "4", "--a-bits", "4")
    ours = llmtool.load(out)
    for mod in ours.modules():
        if hasattr(mod, "a_bits"):
            mod.a_bits = 16
    code, stdout, err = run_cli("--json", "models", "export", str(out), str(tmp_path / "d"))
    assert code == 0, err
    assert json.loads(stdout)["not_representable"] == ["activation quantization (A4)"]
    torch.testing.assert_close(_logits(_plain(tmp_path / "d")), _logits(ours), rtol=1e-4, atol=1e-4)


def test_export_refuses_modules_without_a_plain_equivalent(tiny96, tmp_path):
    out = tmp_path / "rsq"
    _make("quant", tiny96, out, "--method", "respinquant", "--w-bits", "4", "--a-bits", "16", "--rank", "4",
          "--train-steps", "1", "--train-seqlen", "16")
    code, _, err = run_cli("models", "export", str(out), str(tmp_path / "d"))
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "transition" in lines[0] and "no equivalent" in lines[0], err
    assert not (tmp_path / "d").exists()


def test_marked_outputs_still_pass_the_other_tools_checks(tiny96, tmp_path):
    """The renamed model_type does not hide the base family from llmtool's own checks: quantize still
    refuses a low-rank output for being low-rank (not for an unknown architecture)."""
    out = tmp_path / "lr"
    _make("lowrank", tiny96, out)
    code, _, err = run_cli("quantize", "--method", "rtn", str(out), str(tmp_path / "q"), "--no-eval")
    assert code == 2 and "low-rank" in err
    code, _, err = run_cli("--json", "evaluate", "ppl", str(out), "--max-tokens", "64", "--seqlen", "32")
    assert code == 0, err


QUANT = ["--no-eval", "--calib-samples", "4", "--calib-seqlen", "16"]


@pytest.mark.parametrize("argv", [
    ["compress", "--method", "svd", "{src}", "{out}", "--ratio", "0.3"],
    ["quantize", "--method", "rtn", "{src}", "{out}", "--w-bits", "4", "--a-bits", "16", *QUANT],
    ["quantize", "--method", "quarot", "{src}", "{out}", "--w-bits", "4", "--a-bits", "16", *QUANT],
], ids=["compress-svd", "quantize-rtn", "quantize-quarot"])
def test_export_dense_option_writes_a_plain_checkpoint(tiny96, tmp_path, argv):
    """`--export dense` on compress/quantize: OUT loads with plain transformers and gives llmtool.load's
    logits of the native output of the same run (1e-5); OUT keeps the run's provenance, nothing else is left."""
    import llmtool

    native, dense = tmp_path / "native", tmp_path / "dense"
    for out, extra in ((native, []), (dense, ["--export", "dense"])):
        code, stdout, err = run_cli("--json", *[a.format(src=tiny96, out=out) for a in argv], *extra)
        assert code == 0, err
    assert json.loads(stdout)["export"]["format"] == "dense"
    assert "llmtool" not in (dense / "config.json").read_text().replace("llmtool.json", "")
    plain = _plain(dense)
    assert type(plain).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(_logits(plain), _logits(llmtool.load(native)), rtol=0, atol=1e-5)
    prov = json.loads((dense / "llmtool.json").read_text())
    assert prov["command"] == argv[0] and prov["export"]["source_format"] == f"llmtool_{'lowrank' if argv[0] == 'compress' else 'quant'}"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in ("native", "dense", "llmtool-home")) == []
    assert not any(p.name.startswith(".") for p in dense.iterdir())


def test_export_dense_option_refusals_and_atomicity(tiny96, tmp_path, monkeypatch):
    """ReSpinQuant's transitions have no plain form: refused before the run (exit 2, one line). An export
    that fails after the run leaves neither OUT nor a temporary directory."""
    from llmtool.core import export
    from llmtool.core.console import UsageError

    out = tmp_path / "rsq"
    code, _, err = run_cli("quantize", "--method", "respinquant", str(tiny96), str(out), "--w-bits", "4",
                           "--a-bits", "16", *QUANT, "--export", "dense")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "transitions" in err, err

    def broken(*a, **k):
        raise UsageError("export failed")

    monkeypatch.setattr(export, "export_checkpoint", broken)
    code, _, err = run_cli("quantize", "--method", "rtn", str(tiny96), str(out), "--w-bits", "4", "--a-bits", "16",
                           *QUANT, "--export", "dense")
    assert code == 2 and "export failed" in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "llmtool-home") == []


def test_export_option_choices(tiny96, tmp_path):
    code, _, err = run_cli("compress", "--method", "svd", str(tiny96), str(tmp_path / "c"), "--ratio", "0.3",
                           "--export", "compressed-tensors")
    assert code == 2 and "choose one of native, dense, remote-code" in err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("argv", [
    ["compress", "--method", "svd", "{src}", "{out}", "--ratio", "0.3", "--export", "dense"],
    ["quantize", "--method", "rtn", "{src}", "{out}", "--w-bits", "4", "--a-bits", "16", *QUANT,
     "--export", "compressed-tensors"],
], ids=["compress-dense", "quantize-ct"])
def test_interrupted_export_run_leaves_nothing(tiny96, tmp_path, monkeypatch, capsys, argv):
    """Ctrl-C while the method runs inside the export's temporary directory: exit 130, one line, no OUT and
    no temporary directory (the run's scratch output lives inside the export's)."""
    import sys

    from llmtool.cli import main
    from llmtool.core import models

    def interrupted(*a, **k):
        assert list(tmp_path.glob(".out.tmp-*/*native.tmp-*")), "the interrupt should arrive mid-run"
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load_model", interrupted)
    monkeypatch.setattr(sys, "argv", ["llmtool", *[a.format(src=tiny96, out=tmp_path / "out") for a in argv]])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 130 and err.strip() == "error: interrupted", err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "llmtool-home") == []


def test_remote_code_export_keeps_factors_and_loads_in_transformers(tiny96, tmp_path):
    """`--format remote-code`: the factors stay factors (same files), and plain transformers with
    trust_remote_code builds the factorised model with llmtool's logits; the streamed compress output too."""
    from transformers import AutoModelForCausalLM

    import llmtool
    from llmtool.core.checkpoint import load_state_dict

    out = tmp_path / "lr"
    code, _, err = run_cli("compress", "--method", "svd-llm", str(tiny96), str(out), "--ratio", "0.3",
                           "--calib-samples", "4", "--calib-seqlen", "16", "--stream")
    assert code == 0, err
    ours = llmtool.load(out)
    rc = tmp_path / "rc"
    code, stdout, err = run_cli("--json", "models", "export", str(out), str(rc), "--format", "remote-code")
    assert code == 0, err
    cfg = json.loads((rc / "config.json").read_text())
    assert cfg["model_type"] == "llmtool_lowrank_llama" and cfg["auto_map"]["AutoModelForCausalLM"].endswith("LlmtoolLowRankForCausalLM")
    with pytest.raises(ValueError):          # ships code: refused without the flag
        _plain(rc)
    theirs = AutoModelForCausalLM.from_pretrained(rc, local_files_only=True, trust_remote_code=True).eval()
    low = [n for n, m in theirs.named_modules() if type(m).__name__ == "LowRankLinear"]
    assert sorted(low) == sorted(json.loads((out / "config.json").read_text())["llmtool_lowrank"]["ranks"])
    torch.testing.assert_close(_logits(theirs), _logits(ours), rtol=1e-5, atol=1e-5)
    a, b = load_state_dict(out), load_state_dict(rc)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # compress --export remote-code writes the same; a quantized checkpoint is refused in one line
    rc2 = tmp_path / "rc2"
    code, _, err = run_cli("compress", "--method", "svd", str(tiny96), str(rc2), "--ratio", "0.3",
                           "--export", "remote-code")
    assert code == 0, err and (rc2 / "modeling_llmtool_lowrank.py").is_file()
    q = tmp_path / "q"
    _make("quant", tiny96, q, "--method", "rtn", "--w-bits", "4", "--a-bits", "16")
    code, _, err = run_cli("models", "export", str(q), str(tmp_path / "x"), "--format", "remote-code")
    assert code == 2 and "low-rank" in err and not (tmp_path / "x").exists()
