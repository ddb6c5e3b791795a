"""The route `code` domain: generated `def f(...)` tasks, hidden tests, sandbox scoring."""
from __future__ import annotations

import json
import re

from conftest import run_cli

from llmtool.route import codetasks
from llmtool.route.tasks import correct, make_split


def test_items_are_deterministic_and_references_pass_their_tests():
    items = [codetasks.item(s) for s in range(40)]
    assert items == [codetasks.item(s) for s in range(40)]
    shapes = {re.sub(r"\d+", "K", it["answer"].split("return ")[1]) for it in items}
    assert len(shapes) >= 8                                  # several families, not one template
    for it in items[:12]:
        row = {"domain": "code", "answer": it["answer"], "tests": it["tests"]}
        assert correct(row, it["answer"]), it


def test_a_wrong_or_missing_function_scores_zero():
    it = codetasks.item(3)
    row = {"domain": "code", "answer": it["answer"], "tests": it["tests"]}
    head, body = it["answer"].split("return ")
    assert not correct(row, head + "return None")
    assert not correct(row, "I do not know.")
    assert not correct(row, head + "return (")               # syntax error: caught in the sandbox
    # the hidden tests tell the constant k from k + 1 (k is each body's last integer literal)
    told = 0
    for seed in range(60):
        it = codetasks.item(seed)
        row = {"domain": "code", "answer": it["answer"], "tests": it["tests"]}
        body = it["answer"].split("return ", 1)[1]
        m = list(re.finditer(r"\d+", body))[-1]
        wrong = body[:m.start()] + str(int(m.group()) + 1) + body[m.end():]
        told += not correct(row, it["answer"].split("return ", 1)[0] + "return " + wrong)
    assert told >= 54, told


def test_extract_code_takes_the_first_function_only():
    out = "```python\ndef f(x):\n    return x + 3\n```\nThis adds three.\ndef g(y):\n    return ("
    assert codetasks.extract_code(out) == "def f(x):\n    return x + 3"
    assert codetasks.extract_code("Sure! def f(n):\n    return n * 2\nprint(f(2))") == "def f(n):\n    return n * 2"
    assert codetasks.extract_code("no code here") == ""


def test_model_output_never_runs_in_process(tmp_path):
    marker = tmp_path / "ran"
    it = codetasks.item(0)
    row = {"domain": "code", "answer": it["answer"], "tests": it["tests"]}
    evil = f"def f(x):\n    open({str(marker)!r}, 'w').write('x')\n    return x"
    assert not correct(row, evil)
    assert not marker.exists()


def test_splits_are_unique_and_disjoint():
    tr = make_split("code", 300, 0, "train")
    te = make_split("code", 60, 500_000, "test", exclude={r["prompt"] for r in tr})
    assert len({r["prompt"] for r in tr}) == 300 and len(te) == 60
    assert not {r["prompt"] for r in tr} & {r["prompt"] for r in te}
    assert all(r["response"] == r["answer"] and r["tests"] for r in tr)


def test_cli_route_data_with_the_code_domain(tmp_path):
    code, out, err = run_cli("--seed", "1", "route", "data", tmp_path / "d", "--domains", "math,code",
                             "--train", "20", "--test", "10", "--json")
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "d" / "test.jsonl").read_text().splitlines()]
    assert {r["domain"] for r in rows} == {"math", "code"}
    assert all("tests" in r for r in rows if r["domain"] == "code")


def test_humaneval_transfer_scores_in_the_sandbox():
    rows = make_split("humaneval", 4, 0, "transfer")
    assert [r["humaneval"]["task_id"] for r in rows] == [f"HumanEval/{i}" for i in range(4)]
    assert all(r["prompt"].startswith(codetasks.HUMANEVAL_INSTRUCTION) for r in rows)
    for r in rows:
        body = r["answer"][len(r["humaneval"]["prompt"]):]
        assert correct(r, body)                       # completion style: the body after the prompt
        assert correct(r, "```python\n" + r["answer"] + "\n```")   # a whole function replaces the stub
        assert not correct(r, "    return None\n")
        assert not correct(r, "")


def test_cli_route_data_humaneval_transfer(tmp_path):
    code, out, err = run_cli("route", "data", tmp_path / "d", "--domains", "code", "--train", "5", "--test", "3",
                             "--transfer", "humaneval", "--json")
    assert code == 0, err
    tx = [json.loads(x) for x in (tmp_path / "d" / "transfer.jsonl").read_text().splitlines()]
    assert len(tx) == 3 and all(r["domain"] == "humaneval" for r in tx)


def test_humaneval_scorer_needs_check_to_return():
    """Issue 39: early exits, forged result lines, always-equal objects and violations never pass."""
    r = make_split("humaneval", 1, 0, "transfer")[0]          # HumanEval/0: has_close_elements -> bool
    body = r["answer"][len(r["humaneval"]["prompt"]):]
    assert correct(r, body)
    forge = ("    import os, json\n    for fd in range(1, 30):\n        try:\n"
             "            os.write(fd, (json.dumps(dict(done=True, ok=True, i=0)) + '\\n').encode())\n"
             "        except OSError:\n            pass\n")
    for bad in (
        "    return True\nimport sys\nsys.exit(0)\n",                       # exit before check
        "    return True\nimport os\nos._exit(0)\n",
        "    import sys\n    sys.exit(0)\n",                                 # exit inside check
        "    import os\n    os._exit(0)\n",
        forge + "    os._exit(0)\n",                                         # forged lines, then exit
        "    class E:\n        def __eq__(self, o):\n            return True\n    return E()\n",
        "    class B(int):\n        def __eq__(self, o):\n            return True\n    return B(0)\n",
        "    try:\n        open('/etc/hostname')\n    except OSError:\n        pass\n" + body,   # violation
    ):
        assert not correct(r, bad), bad


def test_code_scorer_ignores_forged_lines_and_fails_violations():
    it = codetasks.item(5)
    row = {"domain": "code", "answer": it["answer"], "tests": it["tests"]}
    head, ret = it["answer"].split("return ", 1)
    recs = [json.dumps(dict(i=i, ok=True, value=exp)) for i, (_, exp) in enumerate(it["tests"])]
    forge = ("    import os\n    for fd in range(1, 30):\n        for line in %r:\n            try:\n"
             "                os.write(fd, (line + '\\n').encode())\n            except OSError:\n"
             "                pass\n" % (recs,))
    assert correct(row, it["answer"])
    assert not correct(row, head.rstrip() + "\n" + forge + "    return None")          # forged, wrong values
    assert not correct(row, head.rstrip() + "\n" + forge + "    os._exit(0)")          # forged, then exit
    leak = head.rstrip() + "\n    try:\n        open('/etc/hostname')\n    except OSError:\n        pass\n" \
        "    return " + ret
    assert not correct(row, leak)                                       # right values, but a violation


# ------------------------------------------------------------------------------------- joint (issue 42)
def _joint_row(seed: int) -> dict:
    it = codetasks.joint_item(seed)
    return {"domain": "joint", "answer": it["answer"], "tests": it["tests"], "literal": it["literal"],
            "arith": it["arith"], "prompt": it["question"]}


def test_joint_items_need_the_sum_as_a_literal():
    items = [codetasks.joint_item(s) for s in range(40)]
    assert items == [codetasks.joint_item(s) for s in range(40)]
    assert len({re.sub(r"\d+", "K", it["answer"].split("return ")[1]) for it in items}) >= 6
    passed_expr = 0
    for s in range(30):
        row = _joint_row(s)
        a, op, b = row["arith"].split()
        c = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert row["literal"] == str(c) and 10 <= c <= 99 and c not in (int(a), int(b))
        assert f"C is the value of {row['arith']}." in row["prompt"] and "C as a single integer literal" in row["prompt"]
        assert correct(row, row["answer"]), row                         # the reference passes
        head, body = row["answer"].split("return ")
        expr = body.replace(row["literal"], f"({row['arith']})")
        assert not correct(row, head + "return " + expr)                # the right values, no literal: wrong
        # ...while the same text passes the plain code scorer (the tests alone do not tell them apart)
        passed_expr += codetasks.score(row, head + "return " + expr) == 1.0
        assert not correct(row, row["literal"])                          # the math expert's bare number: wrong
        assert not correct(row, head + "return " + body.replace(row["literal"], str(c + 1)))  # wrong constant
        assert not correct(row, head + "return " + body.replace(row["literal"], a))           # an operand
    assert passed_expr == 30


def test_joint_literal_is_a_whole_number_token():
    assert codetasks.has_literal("def f(x):\n    return x + 82", "82")
    assert codetasks.has_literal("def f(x):\n    return [e * 82 for e in x]", "82")
    for other in ("return x + 182", "return x + 821", "return x + 8.2", "return x + 82.0", "return x + v82",
                  "return x + 37 + 45"):
        assert not codetasks.has_literal("def f(x):\n    " + other, "82"), other


def test_joint_set_from_route_data_transfer(tmp_path):
    code, out, err = run_cli("route", "data", tmp_path / "d", "--domains", "math,code", "--train", "5", "--test", "4",
                             "--transfer", "joint", "--json")
    assert code == 0, err
    tx = [json.loads(x) for x in (tmp_path / "d" / "transfer.jsonl").read_text().splitlines()]
    assert len(tx) == 4 and all(r["domain"] == "joint" and r["literal"] and r["tests"] for r in tx)
    assert all(correct(r, r["answer"]) for r in tx)
    train = (tmp_path / "d" / "train.jsonl").read_text()
    assert not any(r["prompt"] in train for r in tx)
    # trainable=False: joint cannot be a training domain
    code, _, err = run_cli("route", "data", tmp_path / "e", "--domains", "math,joint", "--train", "5", "--test", "4")
    assert code == 2 and "transfer-only" in err


def test_format_ok_parses_but_never_runs(tmp_path):
    from llmtool.route.tasks import format_ok

    assert format_ok("math", "42") and format_ok("math", " -7\n") and not format_ok("math", "42 apples")
    assert not format_ok("math", "def f(x):\n    return 42")
    assert format_ok("code", "def f(x):\n    return x + 1") and format_ok("joint", "```python\ndef f(x):\n    return 3\n```")
    assert not format_ok("code", "def f(x):\n    return (") and not format_ok("code", "42")
    marker = tmp_path / "ran"
    assert format_ok("code", f"def f(x):\n    open({str(marker)!r}, 'w').write('x')\n    return x")
    assert not marker.exists()                        # parsed, not executed
