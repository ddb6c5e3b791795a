"""Issue 11 defects in the edit/compress/quantize areas: no hidden thread policy, `edit` honours the
global --dtype, the edit metrics library does not load the evaluate CLI, and the edit method contract
(options of the other method refused, provenance rebuilds the config)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--mom2-samples", "256", "--v-steps", "2", "--layers", "0,1"]


def test_no_product_code_sets_the_thread_count():
    """The one thread policy is core.job.apply_threads (global --threads); areas never call
    torch.set_num_threads themselves."""
    offenders = []
    for area in ("compress", "quantize", "edit"):
        for f in sorted((ROOT / "llmtool" / area).rglob("*.py")):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if re.search(r"\bset_num_threads\s*\(", line):
                    offenders.append(f"{f.relative_to(ROOT)}:{i}")
    assert not offenders, offenders


def test_edit_metrics_do_not_import_the_evaluate_area():
    code = ("import sys\n"
            "from llmtool.edit.metrics import evaluate_requests, pair_scores\n"
            "bad = sorted(m for m in sys.modules if m.startswith('llmtool.evaluate'))\n"
            "assert not bad, bad\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]


def test_edit_honours_global_dtype(tmp_path, tiny_llama_dir, tiny_text_file):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "out"
    code, _, err = run_cli("--dtype", "float64", "edit", "--method", "memit", str(tiny_llama_dir), str(empty), str(out),
                           "--calib-data", str(tiny_text_file), *FAST)
    assert code == 0, err
    assert json.loads((out / "edit_manifest.json").read_text())["dtype"] == "float64"
    prov = json.loads((out / "llmtool.json").read_text())
    assert prov["run"]["dtype"] == "float64"
    from llmtool.edit.methods import METHODS

    cfg = METHODS.get_config(prov["method"]).from_dict(prov["parameters"])
    assert cfg.name == "memit" and cfg.mom2_samples == 256 and cfg.v_steps == 2


@pytest.mark.parametrize("args,needle", [
    (["--method", "memit", "--nullspace-threshold", "0.1"], "--nullspace-threshold does not apply to method 'memit'"),
    (["--method", "alphaedit", "--mom2-weight", "5"], "--mom2-weight does not apply to method 'alphaedit'"),
    (["--method", "memit", "--anchor", "sideways"], "--anchor 'sideways'"),
    (["--method", "rome"], "unknown method 'rome'"),
])
def test_edit_refuses_options_of_other_methods(tmp_path, tiny_llama_dir, args, needle):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run_cli("edit", *args, str(tiny_llama_dir), str(empty), str(tmp_path / "o"))
    assert code == 2 and needle in err, err
    assert not (tmp_path / "o").exists()


def test_edit_method_configs_and_solvers_agree():
    import llmtool.edit.alphaedit  # noqa: F401  (registers its solver)
    from llmtool.edit.memit import METHODS as SOLVERS
    from llmtool.edit.methods import METHODS

    assert METHODS.names() == SOLVERS.names() == ["alphaedit", "memit"]
    cfg = METHODS.build("alphaedit").edit_config([1, 2], preset_lambda=1500.0)
    assert cfg.method == "alphaedit" and cfg.l2 == 10.0 and cfg.nullspace_threshold == 0.02
    cfg = METHODS.build("memit", mom2_weight=7.0).edit_config([1], preset_lambda=1500.0)
    assert cfg.mom2_update_weight == 7.0 and cfg.l2 == 0.0
    assert METHODS.build("memit").edit_config([1], preset_lambda=1500.0).mom2_update_weight == 1500.0
