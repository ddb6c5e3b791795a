"""benchmarks/gpu_check.py ``--parts areas`` (issue 41): one smallest job per area, each argv accepted by the CLI's
own parser (the script's ``--dry-run``), so that a lent GPU's one prepared run does not fail on a typo. The jobs
themselves run on the CPU with ``--device cpu`` (not here: about a minute of two CPU cores)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("areas")
    inp = gpu_check.area_inputs(tmp)
    return gpu_check.area_jobs(tmp, inp), inp


def test_every_area_has_a_job_and_each_argv_parses(jobs):
    rows, inp = jobs
    assert {j["area"] for j in rows} == set(gpu_check.AREAS) == {"train grpo", "route", "kvcache", "edit",
                                                                   "select-data", "bench-agent"}
    commands = [gpu_check.parse_job(j["argv"]) for j in rows]
    assert commands == ["train grpo", "route make-experts", "route train", "kvcache evaluate", "edit apply",
                        "select-data features", "bench-agent run"]
    # the smallest sizes the issue asks for
    argv = {j["job"]: j["argv"] for j in rows}
    grpo = argv["train grpo (2 steps)"]
    assert grpo[grpo.index("--steps") + 1] == "2"
    rt = argv["route train (2 steps)"]
    assert rt[rt.index("--max-steps") + 1] == "2"
    ba = argv["bench-agent run (1 episode)"]
    assert ba[ba.index("--episodes") + 1] == "1"
    assert sum(1 for line in inp["edits"].read_text().splitlines() if line.strip()) == 1
    # the inputs the jobs name exist (outputs do not yet)
    for key in ("model", "model4", "route_base"):
        assert (inp[key] / "config.json").is_file() and (inp[key] / "tokenizer.json").is_file()
    assert all(j["out"] is None or not Path(j["out"]).exists() for j in rows)


def test_parse_job_refuses_a_bad_argv():
    with pytest.raises(Exception, match="--no-such-flag"):
        gpu_check.parse_job(["train", "grpo", "m", "o", "--no-such-flag"])
    with pytest.raises(Exception, match="integer"):
        gpu_check.parse_job(["train", "grpo", "m", "o", "--steps", "abc"])
    with pytest.raises(Exception, match="nosuch"):
        gpu_check.parse_job(["route", "nosuch"])
