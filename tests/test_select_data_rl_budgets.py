"""benchmarks/select_data_rl_budgets.py: one table across the budgets' reports, refusing reports that are not one
comparison, and judging "SHIFT beats random" per budget only over enough training seeds."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark

SETTINGS = {"model": "m", "budget": 16, "feature_tokens": 48, "steps": 18, "prompts": 8, "lr": 1e-5}


def _arm(acc: float, seeds: int, shift_minus=None, ci=None) -> dict:
    e = {"seeds": seeds, "in_domain": acc, "in_domain_sd": 0.01 if seeds > 1 else None,
         "per_seed_in_domain": [acc] * seeds, "delta_vs_base": acc - 0.3, "delta_vs_base_ci95": [acc - 0.35, acc - 0.25],
         "groups_with_variance": 0.3, "generators_covered": 6.0}
    if shift_minus is not None:
        e.update(shift_minus=shift_minus, shift_minus_ci95=ci)
    return e


def _report(tmp: Path, tag: str, budget: int, arms: dict, **settings) -> None:
    rep = {"base": {"in_domain": 0.3}, "start_checksum": settings.pop("checksum", "abc"),
           "settings": {**SETTINGS, "budget": budget, **settings}, "arms": arms}
    (tmp / f"{tag}.json").write_text(json.dumps(rep))


def test_budgets_are_sorted_and_judged_only_over_three_seeds(tmp_path):
    mod = load_benchmark("select_data_rl_budgets")
    _report(tmp_path, "b16", 16, {"full": _arm(0.45, 3), "shift": _arm(0.40, 3, None),
                                  "random": _arm(0.30, 3, 0.10, [0.04, 0.16])})
    _report(tmp_path, "b7", 7, {"full": _arm(0.45, 3), "shift": _arm(0.20, 3),
                                "random": _arm(0.30, 3, -0.10, [-0.16, -0.04])}, feature_tokens=32)
    _report(tmp_path, "b32", 32, {"full": _arm(0.45, 3), "shift": _arm(0.40, 2),
                                  "random": _arm(0.30, 3, 0.10, [0.04, 0.16])})
    res = mod.summarise(mod.load(["b16", "b32", "b7"], tmp_path))
    assert list(res["budgets"]) == ["7", "16", "32"]
    verdicts = [g["verdict"] for g in res["gates"].values()]
    # B = 7: SHIFT below random; B = 16: above; B = 32: SHIFT has 2 seeds, so the claim is not tested there
    assert verdicts == ["not met", "met", "not tested"]
    md = mod.markdown(res, "cmd")
    assert "| shift | 0.200 ± 0.010 (3) | 0.400 ± 0.010 (3) | 0.400 ± 0.010 (2) |" in md
    assert "| random | -10.0 [-16.0, -4.0] | +10.0 [+4.0, +16.0] | +10.0 [+4.0, +16.0] |" in md
    assert "full" not in res["budgets"]["7"]["arms"]


@pytest.mark.parametrize("change, message", [({"lr": 5e-5}, "differ in lr"), ({"checksum": "zzz"}, "another policy"),
                                             ({"budget": 16}, "share a budget")])
def test_reports_that_are_not_one_comparison_are_refused(tmp_path, change, message):
    mod, change = load_benchmark("select_data_rl_budgets"), dict(change)
    _report(tmp_path, "a", 16, {"shift": _arm(0.4, 3)})
    _report(tmp_path, "b", change.pop("budget", 7), {"shift": _arm(0.4, 3)}, **change)
    with pytest.raises(SystemExit, match=message):
        mod.load(["a", "b"], tmp_path)


def test_pick_only_settings_match_the_training_script():
    pytest.importorskip("reasoning_gym")
    assert load_benchmark("select_data_rl_budgets").PICK_ONLY == load_benchmark("select_data_rl").PICK_ONLY


def test_a_missing_report_is_a_usage_error():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "select_data_rl_budgets.py"), "--tags",
                          "no_such_tag"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: --tags: no report no_such_tag.json in benchmarks/results"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"arms": {}}'])
def test_a_file_that_is_not_a_report_is_refused(tmp_path, text):
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(SystemExit, match="bad.json is not a select_data_rl.py report"):
        load_benchmark("select_data_rl_budgets").load(["bad"], tmp_path)
