"""The shared gate verdicts of benchmarks/gates.py and the gates that use them: a gate whose
precondition did not hold says "not tested" (never "met"), and a gate that can fail still fails."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gates  # noqa: E402
from conftest import load_benchmark as _bench  # noqa: E402


def test_failed_precondition_yields_not_tested_and_skips_the_comparison():
    def boom():
        raise AssertionError("the comparison must not be evaluated without its precondition")

    g = gates.gate("all selected programs reach test 0.99", boom, {}, precondition=False,
                   reason="no rule reached val = 1.0")
    assert g["verdict"] == gates.NOT_TESTED and g["met"] is None
    text = gates.render(g)
    assert text.startswith("not tested: no rule reached val = 1.0") and "met" not in text.replace("measured", "")
    assert gates.verdict({"met": None}) == gates.NOT_TESTED


def test_gate_with_its_precondition_can_fail_and_pass():
    assert gates.gate("x", False, 0.3)["verdict"] == gates.NOT_MET
    assert gates.render(gates.gate("x", False, 0.3)) == "**NOT met** (measured 0.3)"
    assert gates.gate("x", lambda: True)["verdict"] == gates.MET
    assert gates.lines([gates.gate("a", True)]) == ["- a: met"]
    assert gates.render(True) == "met" and gates.render(False, bold=False) == "NOT met"  # legacy bools
    assert gates.tied(0.0, 0.0) and not gates.tied(0.0, 0.01)
    assert gates.saturated([1.0, 0.99999], tol=0.005) and not gates.saturated([1.0, 0.9], tol=0.005)
    assert not gates.saturated([])


def test_learn_program_sanity_gate_is_not_tested_when_nothing_reaches_val_one():
    lp = _bench("learn_program")
    none = [{"rule": "a", "pass_at_k": False, "test_acc": None}, {"rule": "b", "pass_at_k": False, "test_acc": 0.6}]
    assert lp.sanity_gate(none)["verdict"] == gates.NOT_TESTED  # was "met": all() over an empty set
    bad = none + [{"rule": "c", "pass_at_k": True, "test_acc": 0.9}]
    assert lp.sanity_gate(bad)["verdict"] == gates.NOT_MET
    good = none + [{"rule": "c", "pass_at_k": True, "test_acc": 1.0}]
    assert lp.sanity_gate(good)["verdict"] == gates.MET
    # a stored result written before the gate record (a bare True) is re-judged from its rows
    assert lp.sanity_gate_of({"gate_val1_implies_test_ge_0.99": True, "rows": none})["verdict"] == gates.NOT_TESTED


def test_learn_program_keeps_raw_proposals(tmp_path):
    import json

    lp = _bench("learn_program")
    f = tmp_path / "candidates.jsonl"
    f.write_text("\n".join(json.dumps({"idx": i, "raw_text": f"answer {i}", "outcome": "no_code", "val_acc": None,
                                       "error": "no function definition found in the answer", "code": None})
                           for i in range(14)) + "\n")
    raw = lp.raw_proposals(f)
    assert len(raw) == lp.RAW_KEPT == 10 and raw[3]["raw_text"] == "answer 3" and raw[0]["outcome"] == "no_code"


def _cell(excess, val):
    return {"excess_mean": (excess, 0.0), "val_loss": (val, 0.0)}


def test_adagc_fault_gate_not_tested_on_an_unperturbed_or_already_clipped_arm_and_separates_otherwise():
    # issue 43: 'spike score adagc <= global' passed on scores tied at 0 %; the gate is now the grad fault's loss
    # excess, AdaGC below global clipping by a margin
    ad = _bench("train_adagc")
    name = f"grad-fault excess adagc < global - {ad.GATE_MARGIN:g}"
    quiet = {g["gate"]: g for g in ad.acceptance12_gates(_cell(0.0, 4.5), _cell(0.0, 4.5), _cell(0.0, 4.6))}
    assert quiet[name]["verdict"] == gates.NOT_TESTED
    assert quiet["adagc and global beat none (val)"]["verdict"] == gates.MET
    tie = {g["gate"]: g for g in ad.acceptance12_gates(_cell(0.005, 4.5), _cell(0.005, 4.5), _cell(0.02, 4.6))}
    assert tie[name]["verdict"] == gates.NOT_MET
    clipped = {g["gate"]: g for g in ad.acceptance12_gates(_cell(0.0, 4.5), _cell(0.005, 4.5), _cell(0.02, 4.6),
                                                           target_rate=1.0)}
    assert clipped[name]["verdict"] == gates.NOT_TESTED  # the fault tensor is clipped anyway: nothing tested
    better = {g["gate"]: g for g in ad.acceptance12_gates(_cell(0.0, 4.5), _cell(0.005, 4.5), _cell(0.02, 4.6),
                                                          target_rate=0.1)}
    assert better[name]["verdict"] == gates.MET


def _spurious(clip_frac, marker_clip, marker_no_clip):
    def arm(cf, mk):
        return {"per_seed": [{"clip_frac": cf, "eval": {"marker_freq": mk}}] * 2}

    return {"base": {"marker_freq": 0.5},
            "arms": {"random": arm(clip_frac, marker_clip), "random+ratio-no-clip": arm(clip_frac, marker_no_clip)}}


@pytest.mark.parametrize("clip_frac,mc,mn,want", [(0.0005, 0.9, 0.4, gates.NOT_TESTED), (0.03, 0.9, 0.4, gates.MET),
                                                  (0.03, 0.39, 0.41, gates.NOT_MET)])
def test_grpo_clip_ablation_is_not_tested_when_the_clip_does_not_bind(clip_frac, mc, mn, want):
    grpo = _bench("train_grpo")
    assert grpo.clip_gate(_spurious(clip_frac, mc, mn))["verdict"] == want


def test_setpo_pass_at_k_direction_not_tested_when_saturated():
    grpo = _bench("train_grpo")

    def d(g8, s8):
        return {"arms": {"grpo": {"pass@8": g8, "pass@1": 0.5}, "setpo": {"pass@8": s8, "pass@1": 0.5}},
                "paired": {"setpo-grpo": {"pass@1": {"diff": 0.0}, "pass@8": {"diff": s8 - g8},
                                          "distinct_correct": {"diff": 0.1}}}}

    sat = {g["gate"]: g["verdict"] for g in grpo.setpo_directions(d(0.999999, 1.0))}
    assert sat["SetPO pass@8 - GRPO >= -2 points"] == gates.NOT_TESTED
    fell = {g["gate"]: g["verdict"] for g in grpo.setpo_directions(d(0.8, 0.7))}
    assert fell["SetPO pass@8 - GRPO >= -2 points"] == gates.NOT_MET


def test_setpo_largest_k_direction_not_tested_when_grpo_sits_at_the_ceiling():
    """pass@32 >= GRPO's with GRPO at 1.0: SetPO either ties (saturated) or falls, so the gate could only fail.
    pass@8's -2 point tolerance leaves room, so it stays tested at the same GRPO value."""
    grpo = _bench("train_grpo")

    def d(g, s):
        return {"arms": {"grpo": {"pass@8": g, "pass@32": g, "pass@1": 0.5},
                         "setpo": {"pass@8": s, "pass@32": s, "pass@1": 0.5}},
                "paired": {"setpo-grpo": {"pass@1": {"diff": 0.0}, "pass@8": {"diff": s - g},
                                          "pass@32": {"diff": s - g}, "distinct_correct": {"diff": 0.1}}}}

    top = {g["gate"]: g for g in grpo.setpo_directions(d(1.0, 0.99))}
    assert top["SetPO pass@32 - GRPO >= 0"]["verdict"] == gates.NOT_TESTED
    assert "could only fail" in top["SetPO pass@32 - GRPO >= 0"]["reason"]
    assert top["SetPO pass@8 - GRPO >= -2 points"]["verdict"] == gates.MET
    below = {g["gate"]: g["verdict"] for g in grpo.setpo_directions(d(0.97, 0.96))}
    assert below["SetPO pass@32 - GRPO >= 0"] == gates.NOT_MET
    assert {g["gate"]: g["verdict"] for g in grpo.setpo_directions(d(0.97, 0.98))}["SetPO pass@32 - GRPO >= 0"] \
        == gates.MET


def _route_acc(cross: float):
    acc = {"base": {"math": 0.1, "code": 0.1}, "expert:math": {"math": 0.8, "code": cross},
           "expert:code": {"math": cross, "code": 0.8}, "fusion": {"math": 0.8, "code": 0.8},
           "route-only": {"math": 0.8, "code": 0.8}, "merge-ta": {"math": 0.3, "code": 0.3},
           "merge-dare": {"math": 0.3, "code": 0.3}, "token-select": {"math": 0.5, "code": 0.5},
           "seq-select": {"math": 0.5, "code": 0.5}}
    return acc, {n: sum(v.values()) / 2 for n, v in acc.items()}


@pytest.mark.parametrize("cross,want", [(0.0, gates.NOT_TESTED), (0.2, gates.NOT_MET)])
def test_route_gates_not_tested_with_disjoint_experts(cross, want):
    route = _bench("route")
    acc, mean = _route_acc(cross)
    rq = {"matching_expert_rate": 0.95, "informative_fraction": 0.667}
    by = {g["gate"]: g for g in route.route_gates(acc, mean, rq, ["math", "code"])}
    # fusion 0.8 vs best expert (0.8 + cross) / 2: +0.4 with disjoint experts, +0.3 at cross 0.2 ...
    assert by["FusionRoute mean >= best single expert mean + 15 points"]["verdict"] == (
        gates.NOT_TESTED if cross == 0.0 else gates.MET)
    assert by["routing: matching expert on >= 90 % of informative positions"]["verdict"] == (
        gates.NOT_TESTED if cross == 0.0 else gates.MET)
    rq_low = {"matching_expert_rate": 0.6, "informative_fraction": 0.2}
    low = {g["gate"]: g for g in route.route_gates(acc, mean, rq_low, ["math", "code"])}
    assert low["routing: matching expert on >= 90 % of informative positions"]["verdict"] == want


def test_bench_agent_base_ir_not_tested_when_the_base_model_never_acts():
    ba = _bench("bench_agent")
    silent = {m: {"orig_calls": 0, "alias_calls": 0} for m in ("none", "dual-ori-first", "dual-syn-first")}
    r = {"base_ir": {"ir": 1.0}, "base": silent}
    assert ba.base_ir_gate(r)["verdict"] == gates.NOT_TESTED  # was "met": IR = 1 by definition
    acting = dict(silent, **{"dual-ori-first": {"orig_calls": 9, "alias_calls": 1}})
    assert ba.base_ir_gate({"base_ir": {"ir": 1.0}, "base": acting})["verdict"] == gates.MET
    assert ba.base_ir_gate({"base_ir": {"ir": 3.0}, "base": acting})["verdict"] == gates.NOT_MET


def test_select_data_collapse_gate_not_tested_without_a_kmeans_collapse():
    sd = _bench("select_data")

    def row(method, h, mx, top2, mn):
        return {"method": method, "norm_entropy": h, "max_share": mx, "top2_share": top2, "min_share": mn,
                "mean_cos": 0.5}

    summary = [row("gem", 0.99, 0.047, 0.09, 0.0175), row("movmf-em", 0.97, 0.08, 0.15, 0.014),
               row("kmeans", 0.96, 0.078, 0.15, 0.012)]
    g = sd.gem_gates(summary, 24)
    assert g["collapse_top2_le_half_kmeans"]["verdict"] == gates.NOT_TESTED  # K-Means top-2 0.15 < 6/24
    assert g["entropy_ge_kmeans"]["verdict"] == gates.MET
    beside = g["entropy_ge_kmeans"]["measured"]["gem"]  # balance reported beside the coherence metrics
    assert beside["mean_cos"] == 0.5 and beside["silhouette_cos"] == "not measured"
    collapsed = summary[:2] + [row("kmeans", 0.8, 0.30, 0.45, 0.001)]
    assert sd.gem_gates(collapsed, 24)["collapse_top2_le_half_kmeans"]["verdict"] == gates.MET
    half = summary[:2] + [row("kmeans", 0.8, 0.15, 0.26, 0.001)]  # collapsed (0.26 >= 0.25); GEM 0.14 > 0.13
    half[0] = row("gem", 0.99, 0.1, 0.14, 0.0175)
    assert sd.gem_gates(half, 24)["collapse_top2_le_half_kmeans"]["verdict"] == gates.NOT_MET


def test_sysr_verdict_is_the_paired_difference_and_not_tested_without_errors():
    ev = _bench("evaluate")

    def cell(bench, f, a_only, b_only, both, lo, hi):
        return {"a": "sysr", "b": "sh-shared", "benchmark": bench, "budget_frac": f, "difference": (a_only - b_only) / 100,
                "ci_low": lo, "ci_high": hi, "a_only": a_only, "b_only": b_only, "both": both}

    clean = [cell("x", f, 0, 0, 0, 0.0, 0.0) for f in (0.1, 0.2)]
    v = {r["benchmark"]: r for r in ev.sysr_verdicts(clean, 100)}
    assert v["x"]["verdict"].startswith("not tested")
    better = [cell("x", 0.1, 0, 30, 10, -0.4, -0.2), cell("x", 0.2, 0, 20, 0, -0.3, -0.1)]
    v = {r["benchmark"]: r for r in ev.sysr_verdicts(better, 100)}
    assert v["pooled"]["verdict"].startswith("SySR lower") and v["pooled"]["ci95"][1] < 0
    worse = [cell("x", 0.1, 30, 0, 10, 0.2, 0.4), cell("x", 0.2, 20, 0, 0, 0.1, 0.3)]
    assert {r["benchmark"]: r for r in ev.sysr_verdicts(worse, 100)}["pooled"]["verdict"].startswith("sh-shared lower")


def test_bench_agent_pipe_rerun_head_names_the_command_behind_the_rows():
    """A --only pipe rerun that replaces every row of a model's results file makes its command the file's head
    (the Gemma file kept an earlier base-only command above rows it no longer held); with other rows kept, the head
    stays and the rerun gets its own "Run alone" line."""
    ba = _bench("bench_agent")
    old = {"command": "old", "config": {"a": 1}, "pipe": {"grid-nav": {"command": "old"}}, "gates": {}}
    ba.pipe_rerun_head(old, "grid-nav", "new", {"a": 2})
    assert old["command"] == "new" and old["config"] == {"a": 2}
    kept = {"command": "old", "config": {}, "pipe": {"grid-nav": {}, "twx-coin": {}}, "gates": {}}
    ba.pipe_rerun_head(kept, "grid-nav", "new", {})
    assert kept["command"] == "old"
    with_uh = {"command": "old", "config": {}, "pipe": {}, "ultrahorizon": {"rows": []}, "gates": {}}
    ba.pipe_rerun_head(with_uh, "grid-nav", "new", {})
    assert with_uh["command"] == "old"
    fresh = {"command": "", "config": {}, "pipe": {}, "gates": {}}
    ba.pipe_rerun_head(fresh, "grid-nav", "new", {"b": 1})
    assert fresh["command"] == "new"
