"""core.runlog: finished runs are kept per protocol; a cut last line or another protocol is never reused."""
from llmtool.core.runlog import RunLog


def key(r):
    return (r["arm"], r["seed"])


def test_runs_are_kept_per_protocol_and_a_cut_line_is_redone(tmp_path):
    path = tmp_path / "runs.jsonl"
    log = RunLog(path, {"steps": 10, "lr": 1e-3}, key)
    assert log.done() == {}
    log.append({"arm": "a", "seed": 0, "loss": [1.0, 0.5]})
    RunLog(path, {"steps": 20, "lr": 1e-3}, key).append({"arm": "a", "seed": 0, "loss": [9.0]})
    log.append({"arm": "b", "seed": 1, "loss": [2.0]})
    with open(path, "a") as fh:
        fh.write('{"arm": "c", "seed": 0, "loss": [1')          # a crash mid-write
    done = RunLog(path, {"lr": 1e-3, "steps": 10}, key).done()  # same protocol, keys in another order
    assert done == {("a", 0): {"arm": "a", "seed": 0, "loss": [1.0, 0.5]}, ("b", 1): {"arm": "b", "seed": 1, "loss": [2.0]}}
    assert RunLog(path, {"steps": 20, "lr": 1e-3}, key).done() == {("a", 0): {"arm": "a", "seed": 0, "loss": [9.0]}}
    assert RunLog(path, {"steps": 10}, key).done() == {}
    log.append({"arm": "c", "seed": 0, "loss": [3.0]})          # the run redone after the crash is kept whole
    assert log.done()[("c", 0)] == {"arm": "c", "seed": 0, "loss": [3.0]}


def test_ignored_settings_match_runs_that_differ_only_in_them(tmp_path):
    """done(ignore=...) takes the runs of another value of an ignored setting, and still none under another value of
    any other setting (nor a record without a protocol)."""
    path = tmp_path / "runs.jsonl"
    RunLog(path, {"budget": 16, "lr": 1e-3}, key).append({"arm": "full", "seed": 0, "acc": 0.4})
    RunLog(path, {"budget": 16, "lr": 2e-3}, key).append({"arm": "full", "seed": 1, "acc": 0.9})
    with open(path, "a") as fh:
        fh.write('{"arm": "full", "seed": 2, "acc": 0.1}\n')
    log = RunLog(path, {"budget": 7, "lr": 1e-3}, key)
    assert log.done() == {}
    assert log.done(ignore=("budget",)) == {("full", 0): {"arm": "full", "seed": 0, "acc": 0.4}}
    assert log.done(ignore=("lr",)) == {}


def test_protocol_of_records_an_optional_setting_only_away_from_its_default():
    from argparse import Namespace

    from llmtool.core.runlog import protocol_of

    keys, optional = ("steps", "lr"), {"task": "arith", "layers": 0}
    assert protocol_of(Namespace(steps=4, lr=0.1, task="arith", layers=0), keys, optional) == {"steps": 4, "lr": 0.1}
    assert protocol_of(Namespace(steps=4, lr=0.1), keys, optional) == {"steps": 4, "lr": 0.1}  # older scripts
    assert protocol_of(Namespace(steps=4, lr=0.1, task="mul", layers=0), keys, optional) == \
        {"steps": 4, "lr": 0.1, "task": "mul"}
    assert protocol_of(Namespace(steps=4, lr=0.1, task="arith", layers=2), keys) == {"steps": 4, "lr": 0.1}
