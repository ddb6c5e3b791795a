"""The 13 algorithmic binary tasks of LLM-PV (Singhal, Mishra, Malach, Galanti, arXiv 2510.14331,
spec llm-pv §3.5) and the ``input -> label`` dataset format.

Every split is exactly 50/50, inputs are unique across train/val/test, and generation is
deterministic: the derived seed is the first 8 bytes of SHA-256("task|L|train+val|test|seed") masked
to 31 bits, one ``random.Random`` draws everything, train+val+test are drawn together (per class) and
split in order, then each split is shuffled.

Reconstructed choices (ours, where the paper/spec leave room):
- ``parity_rand_k`` positions: ``torch.randperm(L, generator=manual_seed(42))[:k]`` sorted; written to
  ``meta.json`` (the official data may differ if its permutation call differs).
- ``dyck2``: L must be even; valid words come from a uniformly-random-choice walk that keeps the
  depth feasible; negatives are valid words with 1-5 random bit flips that are no longer valid.
- ``prime_decimal`` / ``prime_plus_47``: primality by Miller-Rabin (deterministic bases below 3.3e24,
  40 fixed-seed random bases above). ``prime_plus_47`` positives are p + 47 for a prime p with L digits;
  negatives are L-digit n with n - 47 odd and composite (so the last digit alone does not decide).
- ``graph_has_cycle``: L is the number of edges; an input is the concatenation of L edges ``uAAvBB``
  (2-digit vertex ids, no self loops, no repeated edge); V counts the vertices that appear, C the
  connected components among them; label 1 iff E - V + C > max(1, E // 6). Graphs draw their vertex
  ids from a pool whose size is itself random, which gives both classes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmtool.core.console import UsageError

GENERATOR_VERSION = 1


# ------------------------------------------------------------------------------------------ rules
def parity_all(x: str) -> int:
    return x.count("1") % 2


def parity_first_half(x: str) -> int:
    return x[: len(x) // 2].count("1") % 2


def patternmatch1(x: str) -> int:
    return int("10101010" in x)


def patternmatch2(x: str) -> int:
    return int("00111111" in x)


def random_positions(length: int, k: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(42)
    return sorted(int(i) for i in torch.randperm(length, generator=g)[:k])


def make_parity_rand(k: int) -> Callable[[str], int]:
    cache: dict[int, list[int]] = {}

    def rule(x: str) -> int:
        pos = cache.get(len(x))
        if pos is None:
            pos = cache[len(x)] = random_positions(len(x), k)
        return sum(x[i] == "1" for i in pos) % 2

    return rule


def palindrome(x: str) -> int:
    return int(x == x[::-1])


_PAIRS = {"00": "(", "01": ")", "10": "[", "11": "]"}


def dyck2(x: str) -> int:
    if len(x) % 2:
        return 0
    stack = []
    for i in range(0, len(x), 2):
        c = _PAIRS[x[i:i + 2]]
        if c in "([":
            stack.append(c)
        elif not stack or stack.pop() != ("(" if c == ")" else "["):
            return 0
    return int(not stack)


_MR_SMALL = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
_SMALL_PRIMES = [p for p in range(2, 2000) if all(p % q for q in range(2, int(p ** 0.5) + 1))]
_PRIMORIAL = 1
for _p in _SMALL_PRIMES:
    _PRIMORIAL *= _p


def _mr_round(n: int, d: int, s: int, a: int) -> bool:
    y = pow(a, d, n)
    if y in (1, n - 1):
        return True
    for _ in range(s - 1):
        y = y * y % n
        if y == n - 1:
            return True
    return False


@functools.lru_cache(maxsize=1 << 16)
def is_prime(n: int) -> bool:
    """Miller-Rabin: deterministic below 3.3e24; 27 extra fixed-seed random bases above.

    Cached: the samplers test a number and ``generate`` then labels it with the rule, which tests it again
    (40 modular exponentiations of a 330-bit number per L = 100 prime).
    """
    if n < 2:
        return False
    if n < 2000:
        return n in _SMALL_PRIMES
    if math.gcd(n, _PRIMORIAL) != 1:
        return False
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    if not all(_mr_round(n, d, s, a) for a in _MR_SMALL):
        return False
    if n < 3_317_044_064_679_887_385_961_981:
        return True
    rng = random.Random(n & 0xFFFFFFFF)
    return all(_mr_round(n, d, s, rng.randrange(2, n - 1)) for _ in range(27))


def prime_decimal(x: str) -> int:
    return int(is_prime(int(x)))


CA_TABLE = (0, 1, 1, 1, 1, 0, 0, 0)


def automata_parity(x: str) -> int:
    p = "0" + x + "0"
    return sum(CA_TABLE[4 * int(p[i]) + 2 * int(p[i + 1]) + int(p[i + 2])] for i in range(len(x))) % 2


def sha256_parity(x: str) -> int:
    return bin(int(hashlib.sha256(x.encode("ascii")).hexdigest(), 16)).count("1") % 2


def prime_plus_47(x: str) -> int:
    n = int(x)
    return int(n >= 49 and is_prime(n - 47))


def parse_edges(x: str) -> list[tuple[str, str]]:
    return [(x[i + 1:i + 3], x[i + 4:i + 6]) for i in range(0, len(x), 6)]


def graph_has_cycle(x: str) -> int:
    edges = parse_edges(x)
    parent: dict[str, str] = {}

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for u, v in edges:
        parent.setdefault(u, u)
        parent.setdefault(v, v)
        ru, rv = find(u), find(v)
        if ru != rv:
            parent[ru] = rv
    e, vcount = len(edges), len(parent)
    c = len({find(a) for a in parent})
    return int(e - vcount + c > max(1, e // 6))


# ------------------------------------------------------------------------------------------ samplers
def _bits(rng: random.Random, n: int) -> str:
    return format(rng.getrandbits(n), f"0{n}b") if n else ""


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randrange(10 ** (n - 1), 10 ** n)) if n > 1 else str(rng.randrange(10))


def _bits_sampler(rule):
    def sample(rng, L, label):
        return _bits(rng, L)  # rejection on label is done by the caller
    return sample


def _pattern_sampler(pattern: str):
    def sample(rng, L, label):
        if label == 1:
            x = _bits(rng, L)
            off = rng.randrange(0, L - len(pattern) + 1)
            return x[:off] + pattern + x[off + len(pattern):]
        return _bits(rng, L)
    return sample


def _palindrome_sampler(rng, L, label):
    if label == 1:
        half = _bits(rng, L // 2)
        mid = _bits(rng, L % 2)
        return half + mid + half[::-1]
    return _bits(rng, L)


def _dyck_word(rng: random.Random, L: int) -> str:
    n = L // 2
    out, stack = [], []
    for i in range(n):
        remaining = n - i
        can_close = bool(stack)
        must_close = len(stack) == remaining
        if must_close or (can_close and rng.random() < 0.5):
            out.append("01" if stack.pop() == "(" else "11")
        else:
            b = rng.choice("([")
            stack.append(b)
            out.append("00" if b == "(" else "10")
    return "".join(out)


def _dyck_sampler(rng, L, label):
    w = _dyck_word(rng, L)
    if label == 1:
        return w
    for _ in range(100):
        chars = list(w)
        for i in rng.sample(range(L), rng.randint(1, min(5, L))):
            chars[i] = "1" if chars[i] == "0" else "0"
        y = "".join(chars)
        if not dyck2(y):
            return y
    return w  # rejected by the caller (label mismatch)


def _prime_sampler(rng, L, label):
    lo, hi = 10 ** (L - 1), 10 ** L
    if label == 1:
        n = rng.randrange(max(lo, 2), hi)
        while n < hi and not is_prime(n):
            n += 1
        return str(n) if n < hi else str(lo)
    a_len, b_len = L // 2, L - L // 2
    for _ in range(1000):
        a = rng.randrange(max(2, 10 ** (a_len - 1)), 10 ** a_len) if a_len else 1
        b = rng.randrange(max(2, 10 ** (b_len - 1)), 10 ** b_len)
        if lo <= a * b < hi and a > 1:
            return str(a * b)
    return _digits(rng, L)


def _prime47_sampler(rng, L, label):
    lo, hi = 10 ** (L - 1), 10 ** L
    if label == 1:
        p = rng.randrange(max(2, lo - 47), hi - 47)
        while p + 47 < hi and not is_prime(p):
            p += 1
        return str(p + 47) if lo <= p + 47 < hi else _digits(rng, L)
    n = rng.randrange(lo, hi)
    if (n - 47) % 2 == 0:
        n = n + 1 if n + 1 < hi else n - 1
    return str(n)


def _graph_sampler(rng, L, label):
    pool = rng.randint(max(2, L // 2), max(3, 2 * L))
    pool = min(pool, 100)
    edges: set[tuple[int, int]] = set()
    tries = 0
    while len(edges) < L and tries < 100 * L:
        tries += 1
        u, v = rng.randrange(pool), rng.randrange(pool)
        if u != v and (u, v) not in edges and (v, u) not in edges:
            edges.add((u, v))
    order = list(edges)
    rng.shuffle(order)
    return "".join(f"u{u:02d}v{v:02d}" for u, v in order)


@dataclass(frozen=True)
class Task:
    name: str
    id: str
    rule: Callable[[str], int]
    sampler: Callable
    kind: str  # binary | decimal | graph
    description: str
    min_length: int = 1
    even_length: bool = False
    solvable: bool = True  # a short exact rule exists (sha256_parity, prime_plus_47 and the cycle task excluded)


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("parity_all", "fn_a", parity_all, _bits_sampler(parity_all), "binary", "sum of bits mod 2"),
    Task("parity_first_half", "fn_b", parity_first_half, _bits_sampler(parity_first_half), "binary",
         "parity of the first floor(L/2) bits", min_length=2),
    Task("patternmatch1", "fn_c", patternmatch1, _pattern_sampler("10101010"), "binary",
         'contains "10101010"', min_length=8),
    Task("patternmatch2", "fn_d", patternmatch2, _pattern_sampler("00111111"), "binary",
         'contains "00111111"', min_length=8),
    Task("parity_rand_3", "fn_e", make_parity_rand(3), _bits_sampler(None), "binary",
         "parity of 3 fixed positions (torch randperm, seed 42)", min_length=3),
    Task("parity_rand_10", "fn_f", make_parity_rand(10), _bits_sampler(None), "binary",
         "parity of 10 fixed positions (torch randperm, seed 42)", min_length=10),
    Task("palindrome", "fn_g", palindrome, _palindrome_sampler, "binary", "x equals its reverse", min_length=2),
    Task("dyck2", "fn_h", dyck2, _dyck_sampler, "binary",
         "bit pairs 00 ( 01 ) 10 [ 11 ] form a balanced Dyck-2 word", min_length=4, even_length=True),
    Task("prime_decimal", "fn_i", prime_decimal, _prime_sampler, "decimal", "L-digit number is prime",
         min_length=2),
    Task("automata_parity", "fn_j", automata_parity, _bits_sampler(None), "binary",
         "parity of a rule-30-style cellular-automaton step (table 01111000, zero padded)"),
    Task("sha256_parity", "fn_l", sha256_parity, _bits_sampler(None), "binary",
         "parity of the popcount of SHA-256(x)", solvable=False),
    Task("prime_plus_47", "fn_v", prime_plus_47, _prime47_sampler, "decimal", "n - 47 is prime (n < 49 -> 0)",
         min_length=2, solvable=False),
    Task("graph_has_cycle", "fn_aa", graph_has_cycle, _graph_sampler, "graph",
         "edge list uAAvBB; 1 iff E - V + C > max(1, floor(E/6))", min_length=2, solvable=False),
)}

# The 10 tasks the paper's strong proposer solves exactly (its LLM-PV column at 100 %).
SOLVABLE = [n for n, t in TASKS.items() if t.solvable]


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UsageError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]


def derived_seed(task: str, length: int, n_trainval: int, n_test: int, seed: int) -> int:
    h = hashlib.sha256(f"{task}|{length}|{n_trainval}|{n_test}|{seed}".encode()).digest()
    return int.from_bytes(h[:8], "big") & 0x7FFFFFFF


@dataclass
class Dataset:
    train: list[tuple[str, int]]
    val: list[tuple[str, int]]
    test: list[tuple[str, int]]
    meta: dict


def generate(task: str, length: int, n_train: int = 100, n_val: int = 100, n_test: int = 10_000,
             seed: int = 42, exclude: set[str] | None = None) -> Dataset:
    """Balanced, unique, deterministic splits for one task (``exclude``: inputs that must not appear)."""
    t = get_task(task)
    if length < t.min_length:
        raise UsageError(f"--length {length}: task {task} needs length >= {t.min_length}")
    if t.even_length and length % 2:
        raise UsageError(f"--length {length}: task {task} needs an even length")
    for name, n in (("--train", n_train), ("--val", n_val), ("--test", n_test)):
        if n < 0 or n % 2:
            raise UsageError(f"{name} {n}: must be an even number >= 0 (every split is exactly 50/50)")
    ds = derived_seed(task, length, n_train + n_val, n_test, seed)
    rng = random.Random(ds)
    total = n_train + n_val + n_test
    need = total // 2
    seen: set[str] = set(exclude or ())
    pools: dict[int, list[str]] = {0: [], 1: []}
    budget = 200 * total + 10_000
    attempts = 0
    while min(len(pools[0]), len(pools[1])) < need:
        attempts += 1
        if attempts > budget:
            raise UsageError(
                f"could not draw {need} unique inputs per class for {task} at length {length} "
                f"(got {len(pools[0])}/{len(pools[1])}); the input space is too small -- use smaller splits")
        want = 0 if len(pools[0]) < need and (len(pools[1]) >= need or attempts % 2 == 0) else 1
        x = t.sampler(rng, length, want)
        if x in seen:
            continue
        y = t.rule(x)
        if len(pools[y]) >= need:
            continue
        seen.add(x)
        pools[y].append(x)
    splits = []
    lo = 0
    for n in (n_train, n_val, n_test):
        h = n // 2
        part = [(x, 0) for x in pools[0][lo:lo + h]] + [(x, 1) for x in pools[1][lo:lo + h]]
        rng.shuffle(part)
        splits.append(part)
        lo += h
    meta = {
        "task": task, "id": t.id, "kind": t.kind, "length": length, "rule": t.description,
        "sizes": {"train": n_train, "val": n_val, "test": n_test}, "seed": seed, "derived_seed": ds,
        "class_balance": {k: 0.5 for k in ("train", "val", "test")}, "generator_version": GENERATOR_VERSION,
    }
    if task.startswith("parity_rand_"):
        meta["positions"] = random_positions(length, int(task.rsplit("_", 1)[1]))
    return Dataset(*splits, meta=meta)


# ------------------------------------------------------------------------------------------ files
def format_lines(rows: list[tuple[str, int]]) -> str:
    return "".join(f"{x} -> {y}\n" for x, y in rows)


def write_dataset(ds: Dataset, directory: Path) -> None:
    directory = Path(directory)
    for split in ("train", "val", "test"):
        (directory / f"{split}.txt").write_text(format_lines(getattr(ds, split)), encoding="utf-8")
    (directory / "meta.json").write_text(json.dumps(ds.meta, indent=2) + "\n", encoding="utf-8")


def read_lines(path: Path) -> list[tuple[str, int]]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    rows = []
    try:  # strict: a non-UTF-8 file is refused, not read with replacement characters as inputs
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise UsageError(f"{path}:{line}: not UTF-8 text (byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if " -> " not in line:
            raise UsageError(f"{path}:{n}: expected '<input> -> <0|1>', got {line[:60]!r}")
        x, y = line.rsplit(" -> ", 1)
        x, y = x.strip(), y.strip()
        if y not in ("0", "1"):
            raise UsageError(f"{path}:{n}: label must be 0 or 1, got {y[:20]!r}")
        if not x:
            raise UsageError(f"{path}:{n}: empty input")
        rows.append((x, int(y)))
    if not rows:
        raise UsageError(f"{path}: no examples")
    return rows


def infer_kind(xs: list[str]) -> str:
    if all(set(x) <= {"0", "1"} for x in xs):
        return "binary"
    if all(x.isdigit() for x in xs):
        return "decimal"
    if all(x.startswith("u") and len(x) % 6 == 0 for x in xs):
        return "graph"
    if all(":" in x for x in xs):
        return "tabular"
    return "string"


def read_dataset(directory: Path, need_test: bool = True) -> Dataset:
    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"--data {directory}: not a directory (expected train.txt, val.txt, test.txt)")
    train = read_lines(directory / "train.txt")
    val = read_lines(directory / "val.txt")
    test_path = directory / "test.txt"
    test = read_lines(test_path) if (need_test or test_path.exists()) else []
    meta: dict = {}
    if (directory / "meta.json").is_file():
        try:
            meta = json.loads((directory / "meta.json").read_text())
        except ValueError as e:
            raise UsageError(f"{directory / 'meta.json'}: not valid JSON ({e})") from None
    meta.setdefault("task", meta.get("task") or "user")
    meta.setdefault("kind", infer_kind([x for x, _ in train]))
    lengths = {len(x) for x, _ in train}
    meta.setdefault("length", lengths.pop() if len(lengths) == 1 else None)
    meta.setdefault("sizes", {"train": len(train), "val": len(val), "test": len(test)})
    return Dataset(train, val, test, meta)
