"""Written-out correct programs for the 10 tasks with a short rule (what a strong proposer returns).

Used by the replay proposer in tests and in ``benchmarks/learn_program.py`` to show that the
pipeline (prompt -> parse -> sandbox -> select -> test) reproduces the LLM-PV column given a strong
proposer. They are ordinary candidate programs: they run in the sandbox, never in-process.
``parity_rand_3``/``parity_rand_10`` hard-code the positions of the training length (as a program
learned from data would), so they are length-specific by construction.
"""
from __future__ import annotations

import json

from llmtool.learn_program.tasks import random_positions

PROGRAMS: dict[str, str] = {
    "parity_all": "def f(x):\n    return x.count('1') % 2\n",
    "parity_first_half": "def f(x):\n    return x[:len(x) // 2].count('1') % 2\n",
    "patternmatch1": "def f(x):\n    return int('10101010' in x)\n",
    "patternmatch2": "def f(x):\n    return int('00111111' in x)\n",
    "palindrome": "def f(x):\n    return int(x == x[::-1])\n",
    "dyck2": (
        "def f(x):\n"
        "    m = {'00': '(', '01': ')', '10': '[', '11': ']'}\n"
        "    st = []\n"
        "    for i in range(0, len(x), 2):\n"
        "        c = m[x[i:i + 2]]\n"
        "        if c in '([':\n"
        "            st.append(c)\n"
        "        elif not st or st.pop() != {')': '(', ']': '['}[c]:\n"
        "            return 0\n"
        "    return int(not st)\n"
    ),
    "prime_decimal": (
        "def f(x):\n"
        "    n = int(x)\n"
        "    if n < 2:\n"
        "        return 0\n"
        "    small = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71]\n"
        "    for p in small:\n"
        "        if n % p == 0:\n"
        "            return int(n == p)\n"
        "    d, s = n - 1, 0\n"
        "    while d % 2 == 0:\n"
        "        d //= 2\n"
        "        s += 1\n"
        "    for a in small:\n"
        "        y = pow(a, d, n)\n"
        "        if y in (1, n - 1):\n"
        "            continue\n"
        "        for _ in range(s - 1):\n"
        "            y = y * y % n\n"
        "            if y == n - 1:\n"
        "                break\n"
        "        else:\n"
        "            return 0\n"
        "    return 1\n"
    ),
    "automata_parity": (
        "def f(x):\n"
        "    p = '0' + x + '0'\n"
        "    t = [0, 1, 1, 1, 1, 0, 0, 0]\n"
        "    return sum(t[int(p[i:i + 3], 2)] for i in range(len(x))) % 2\n"
    ),
}


def parity_rand_program(length: int, k: int) -> str:
    pos = random_positions(length, k)
    return f"def f(x):\n    return sum(x[i] == '1' for i in {pos}) % 2\n"


def program_for(task: str, length: int) -> str:
    if task.startswith("parity_rand_"):
        return parity_rand_program(length, int(task.rsplit("_", 1)[1]))
    return PROGRAMS[task]


def replay_lines(task: str, length: int, wrong_first: bool = True) -> list[str]:
    """JSONL lines for a replay proposer: (optionally) a wrong answer, then the correct program."""
    lines = []
    if wrong_first:
        lines.append(json.dumps({"raw_text": "The label seems to be the first bit.\n```python\ndef f(x):\n"
                                             "    return int(x[0] == '1')\n```"}))
    lines.append(json.dumps({"raw_text": json.dumps({"code": program_for(task, length)})}))
    return lines
