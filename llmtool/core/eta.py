"""Start-time estimates of long commands: a small cost model, a per-machine calibration, one status line.

A long command describes the work it is about to do as a list of :class:`Stage` s, each computed from the
sizes the user passed (tokens, steps, samples) and the model's shape (read from ``config.json``, no weights
loaded), and calls :func:`announce` before the work starts. ``announce`` turns the stages into seconds and,
when they come to at least ``MIN_PRINT_S`` (10 s), prints one line on stderr through the console's ``info``
(silent under ``--quiet``; stdout is never touched, so ``--json`` output stays one JSON document)::

    estimate: about 4 min (eval 2x4096 tokens, calibration 16x512 tokens, 16 rotation steps)

The estimate (seconds, and the stages) is kept in :data:`LAST`; :func:`llmtool.core.job.job` writes it into
the output's ``report.json``/``llmtool.json`` as ``estimate_seconds`` next to the measured ``seconds``.

Cost model
----------
Each stage has a *kind* and a number of *units* (tokens, decode steps, flops, seconds) that grows linearly
with the sizes the user passed (doubling the tokens doubles a forward stage's units). Per unit, a kind costs
``flops_per_unit`` floating-point operations and/or ``bytes_per_unit`` bytes of weights streamed; seconds are

    K[kind] * units * max(flops_per_unit / gemm_flops, bytes_per_unit / gemv_bytes)

where ``gemm_flops`` (a dense matmul's operations per second) and ``gemv_bytes`` (a matrix-vector product's
weight bytes per second) come from :func:`calibration`, and ``K`` are the constants below:

- ``forward``: units = tokens through the model, 2 x matmul parameters (+ causal attention) flops each;
- ``train``: units = tokens through forward + backward + optimizer, 6 x matmul parameters flops each;
- ``decode``: units = sequential decode steps of a batch: the weights are streamed once per step (bytes) or
  the batch's 2 x parameters flops, whichever is slower;
- ``linalg``: units = flops of factorizations (SVD, eigh, Cholesky, GPTQ's updates), which run far below gemm
  speed;
- ``fixed``: units = seconds (python overheads measured once, e.g. per-request loops).

Every command also pays ``startup`` seconds (imports) plus ``load`` seconds per billion parameters read.

A stage whose real work differs from its nominal count has a multiplier in ``STAGE_K`` (by stage name).

How the constants were fitted: ``benchmarks/estimates.py`` runs each long command on smollm2-135m at a quick
and a ~3x larger size with ``--threads 1`` on the 2-core development machine (shared with other jobs),
recording the stages and the process's wall and CPU time. K, ``STARTUP_S`` and ``LOAD_S_PER_BPARAM`` are
first guesses (the matmul-bound kinds, ppl/pretrain/rtn, came within 0.9-1.3x of the CPU time with them);
``STAGE_K`` was then set from the *quick* runs alone (CPU time minus the other stages' estimate, over the
stage's estimate: the key-covariance whitening runs at ~1/3 of the nominal count, MEMIT's target
optimisation at ~1/3, GPTQ at ~2.3x and rotation training at ~2x), and the *large* runs are the check of
how the estimate scales. The table is ``benchmarks/results/estimates.md``. The estimate is a guide (within
2x of the CPU time in those runs), not a promise: a cold disk cache or another machine differs.

Busy machine: the calibration counts only CPU time, so the stages give the *idle* time; the estimate printed
(and written to report.json) multiplies it by :func:`load_factor`, (1-minute load average + the command's
threads) / cores when that exceeds 1, and the line then also says the idle time. On the shared development
machine this factor was 3-5 at the time of the benchmark.

Calibration: :func:`calibration` times a ~0.1 s matmul and a ~0.05 s matrix-vector product at the command's
thread count and dtype, once per (threads, dtype, device), and caches the numbers in
``$LLMTOOL_HOME/eta-calibration.json`` (``~/.cache/llmtool``). A missing, unreadable or corrupt cache (not
JSON, wrong types, non-positive numbers) is recomputed, never fatal; ``LLMTOOL_ETA_RECALIBRATE=1`` forces a
new measurement (e.g. after a hardware change).

``LLMTOOL_ETA_RECORD=FILE`` appends each announced estimate (seconds, stages with their units, calibration) to
FILE as one JSON line: how ``benchmarks/estimates.py`` reads the exact numbers behind the printed line.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

# seconds per unit multipliers of each kind (see the module docstring for how they were fitted)
K: dict[str, float] = {"forward": 1.6, "train": 2.0, "decode": 1.6, "linalg": 4.0, "fixed": 1.0}
# per-stage multipliers on top of K[kind], fitted where a stage's real work differs from its nominal count
# (benchmarks/estimates.py; see the module docstring)
STAGE_K: dict[str, float] = {"whitening": 0.35, "targets": 0.3, "gptq": 2.3, "rotation training": 2.0}
STARTUP_S = 6.0          # python + torch + transformers imports, argument checks
LOAD_S_PER_BPARAM = 8.0  # reading and building a model, per 1e9 parameters

MIN_PRINT_S = 10.0       # shorter estimates are kept (report.json) but not printed: only long commands say it
# a slow machine's throughput: an estimate under MIN_PRINT_S even at these rates needs no calibration
SLOW = {"gemm_flops": 2e9, "gemv_bytes": 1e9, "key": "slow-default"}

CACHE_NAME = "eta-calibration.json"
LAST: dict | None = None  # the last announced estimate: {"seconds", "stages", "calibration"}


@dataclass
class Stage:
    """One part of a command's planned work. ``units`` scales with the user's sizes; ``label`` says them."""

    name: str
    kind: str
    units: float
    label: str = ""
    flops_per_unit: float = 0.0
    bytes_per_unit: float = 0.0

    def seconds(self, cal: dict) -> float:
        k = STAGE_K.get(self.name, 1.0)
        if self.kind == "fixed":
            return k * K["fixed"] * self.units
        t = max(self.flops_per_unit / cal["gemm_flops"], self.bytes_per_unit / cal["gemv_bytes"])
        return k * K[self.kind] * self.units * t


# ------------------------------------------------------------------------------------------ model shape
@dataclass
class Shape:
    """What the cost model needs of a decoder-only model, from its config.json."""

    params: float         # every parameter
    matmul_params: float  # parameters in the per-token matmuls (layers' projections + LM head)
    layers: int
    hidden: int
    intermediate: int = 0
    q_dim: int = 0
    kv_dim: int = 0
    vocab: int = 0
    bytes_per_param: int = 4

    @classmethod
    def from_config(cls, cfg: dict, bytes_per_param: int = 4) -> "Shape":
        cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg

        def num(value: Any, default: int) -> int:
            return max(1, min(int(value or default), 1 << 24))  # a hostile 1e30 stays a finite estimate

        h = num(cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model"), 512)
        layers = num(cfg.get("num_hidden_layers") or cfg.get("n_layer"), 1)
        inter = num(cfg.get("intermediate_size"), 4 * h)
        vocab = num(cfg.get("vocab_size"), 32000)
        heads = num(cfg.get("num_attention_heads"), max(1, h // 64))
        kv = num(cfg.get("num_key_value_heads"), heads)
        hd = num(cfg.get("head_dim"), max(1, h // heads))
        attn = h * hd * heads * 2 + h * hd * kv * 2
        mlp = 3 * h * inter
        per_layer = attn + mlp
        embed = vocab * h
        tied = bool(cfg.get("tie_word_embeddings", True))
        params = layers * (per_layer + 2 * h) + embed * (1 if tied else 2) + h
        return cls(params=float(params), matmul_params=float(layers * per_layer + embed), layers=layers, hidden=h,
                   intermediate=inter, q_dim=hd * heads, kv_dim=hd * kv, vocab=vocab, bytes_per_param=bytes_per_param)

    def linears(self) -> list[tuple[int, int]]:
        """(out, in) of one decoder layer's projections: q, k, v, o, gate, up, down."""
        h, i = self.hidden, self.intermediate or 4 * self.hidden
        q, kv = self.q_dim or h, self.kv_dim or h
        return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]

    def input_dims(self) -> list[int]:
        """Distinct input widths of one layer's projections (one covariance/Hessian each): qkv, o, gate/up, down."""
        h, i = self.hidden, self.intermediate or 4 * self.hidden
        return [h, self.q_dim or h, h, i]

    @classmethod
    def of(cls, model: Any) -> "Shape":
        """The shape of MODEL (a directory or a packaged alias), from its config.json; never loads weights."""
        from llmtool.core.checkpoint import read_config
        from llmtool.core.console import OPTIONS
        from llmtool.core.models import resolve_model

        cfg = read_config(resolve_model(model))  # a missing/invalid config.json: the command's own one-line error
        try:
            return cls.from_config(cfg, 2 if OPTIONS.dtype in ("float16", "bfloat16") else 4)
        except Exception:  # hostile values (strings, nested objects): the command refuses them; no estimate here
            return cls(params=0.0, matmul_params=0.0, layers=1, hidden=1, intermediate=1, q_dim=1, kv_dim=1, vocab=1)

    def attn_flops(self, context: float) -> float:
        """Causal attention flops per token at ``context`` tokens (scores + weighted sum, averaged)."""
        return 2.0 * self.layers * self.hidden * context


# ------------------------------------------------------------------------------------------ stage builders
def _label(label: str | None, default: str) -> str:
    return default if label is None else label  # "" = a stage the line does not name


def forward(name: str, tokens: float, shape: Shape, seqlen: float, label: str | None = None) -> Stage:
    return Stage(name, "forward", float(tokens), _label(label, f"{name} {fmt_count(tokens)} tokens"),
                 flops_per_unit=2 * shape.matmul_params + shape.attn_flops(seqlen))


def train(name: str, tokens: float, shape: Shape, seqlen: float, label: str | None = None) -> Stage:
    return Stage(name, "train", float(tokens), _label(label, f"{name} {fmt_count(tokens)} tokens"),
                 flops_per_unit=6 * shape.matmul_params + 3 * shape.attn_flops(seqlen))


def decode(name: str, steps: float, batch: float, shape: Shape, context: float = 0.0,
           label: str | None = None) -> Stage:
    """``steps`` sequential decode steps of ``batch`` sequences at about ``context`` tokens of context."""
    return Stage(name, "decode", float(steps), _label(label, f"{name} {fmt_count(steps)} steps x {fmt_count(batch)}"),
                 flops_per_unit=batch * (2 * shape.matmul_params + 2 * shape.attn_flops(context)),
                 bytes_per_unit=shape.bytes_per_param * shape.matmul_params)


def linalg(name: str, flops: float, label: str = "") -> Stage:
    return Stage(name, "linalg", float(flops), label, flops_per_unit=1.0)


def fixed(name: str, seconds: float, label: str = "") -> Stage:
    return Stage(name, "fixed", float(seconds), label or name)


# ------------------------------------------------------------------------------------------ calibration
def _cache_path() -> Path:
    from llmtool.core.defaults import home

    return home() / CACHE_NAME


def _key(threads: int, dtype: str, device: str) -> str:
    return f"threads={threads},dtype={dtype},device={device}"


def _valid(entry: Any) -> bool:
    return isinstance(entry, dict) and all(
        isinstance(entry.get(k), (int, float)) and not isinstance(entry.get(k), bool)
        and math.isfinite(entry[k]) and entry[k] > 0 for k in ("gemm_flops", "gemv_bytes"))


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def measure(dtype: str = "float32", device: str = "cpu", budget_s: float = 0.1) -> dict:
    """Time a matmul (flops/s) and a matrix-vector product (weight bytes/s) for about ``budget_s`` each."""
    import torch

    dt = getattr(torch, dtype, torch.float32)
    if not isinstance(dt, torch.dtype):
        dt = torch.float32
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    threads = max(1, torch.get_num_threads())

    def rate(fn, work: float, budget: float) -> float:
        fn()  # warm-up
        sync()
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while True:
            fn()
            n += 1
            sync()
            dt_ = time.perf_counter() - t0
            if dt_ >= budget or n >= 10_000:
                # on CPU, time other processes took from this one's threads is not counted (a calibration
                # on a busy machine would otherwise make every later estimate too long)
                cpu = (time.process_time() - c0) / threads if dev.type == "cpu" else dt_
                return n * work / max(min(dt_, cpu) if cpu > 0 else dt_, 1e-9)

    a = torch.randn(256, 1024, dtype=dt, device=dev)
    b = torch.randn(1024, 1024, dtype=dt, device=dev)
    gemm = rate(lambda: a @ b, 2.0 * 256 * 1024 * 1024, budget_s)
    w = torch.randn(4096, 4096, dtype=dt, device=dev)  # 64 MB in fp32: out of cache, as model weights are
    x = torch.randn(4096, 1, dtype=dt, device=dev)
    gemv = rate(lambda: w @ x, float(w.numel() * w.element_size()), budget_s / 2)
    return {"gemm_flops": gemm, "gemv_bytes": gemv, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def calibration(threads: int | None = None, dtype: str | None = None, device: str | None = None,
                path: Path | None = None, force: bool | None = None) -> dict:
    """This machine's throughput at (threads, dtype, device), from the cache or measured (then cached).

    A corrupt cache file is replaced, an unwritable one is ignored: calibration never fails a command."""
    import torch

    from llmtool.core.console import OPTIONS

    threads = int(threads or torch.get_num_threads())
    dtype = dtype or OPTIONS.dtype or "float32"
    device = device or OPTIONS.device or "cpu"
    path = path or _cache_path()
    force = bool(os.environ.get("LLMTOOL_ETA_RECALIBRATE", "").strip() not in ("", "0")) if force is None else force
    key = _key(threads, dtype, device)
    data = _read_cache(path)
    if not force and _valid(data.get(key)):
        return {**data[key], "key": key, "cached": True}
    entry = measure(dtype, device)
    data = {k: v for k, v in data.items() if _valid(v)}  # drop whatever else was there (corrupt entries)
    data[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return {**entry, "key": key, "cached": False}


# ------------------------------------------------------------------------------------------ estimate
def fmt_count(n: float) -> str:
    n = float(n)
    if n >= 1e6:
        return f"{n / 1e6:.3g}M"
    if n >= 1e4:
        return f"{n / 1e3:.3g}k"
    return f"{n:.0f}" if n == int(n) or n >= 100 else f"{n:.3g}"


def fmt_seconds(s: float) -> str:
    if s < 60:
        return f"about {max(5, int(round(s / 5.0)) * 5)} s" if s >= 5 else "a few seconds"
    if s < 3600:
        return f"about {round(s / 60.0)} min" if s >= 90 else "about 1 min"
    h, m = divmod(int(round(s / 60.0)), 60)
    return f"about {h} h {m} min" if m else f"about {h} h"


def estimate(stages: Iterable[Stage], cal: dict, params: float = 0.0) -> dict:
    """Seconds of ``stages`` plus start-up and model loading (``params`` parameters; 0 = no model)."""
    stages = list(stages)
    per = {s.name: 0.0 for s in stages}
    for s in stages:
        per[s.name] += s.seconds(cal)
    overhead = STARTUP_S + LOAD_S_PER_BPARAM * params / 1e9
    return {"seconds": overhead + sum(per.values()), "overhead_seconds": overhead, "stage_seconds": per}


def line(stages: Iterable[Stage], seconds: float) -> str:
    labels = [s.label for s in stages if s.label]
    return f"estimate: {fmt_seconds(seconds)}" + (f" ({', '.join(labels)})" if labels else "")


def load_factor(threads: int | None = None) -> float:
    """How much slower than idle this machine runs a new job of ``threads`` threads now: the 1-minute load
    average plus those threads over the cores this process may use (1 on an idle machine)."""
    try:
        from llmtool.core.options import available_cpus

        if threads is None:
            import torch

            threads = torch.get_num_threads()
        return max(1.0, (os.getloadavg()[0] + threads) / available_cpus())
    except (OSError, AttributeError, ImportError):  # pragma: no cover - no load average on this platform
        return 1.0


def announce(stages: Iterable[Stage], params: float = 0.0, what: str = "") -> dict | None:
    """Estimate ``stages`` and print the one ``estimate:`` status line (stderr; silent under --quiet, and
    for estimates under :data:`MIN_PRINT_S`: a short command says nothing).

    Returns the estimate (also kept in :data:`LAST`), or None where it could not be computed: an estimate
    never fails a command."""
    global LAST
    from llmtool.core.console import info

    stages = list(stages)
    try:
        est = estimate(stages, SLOW, params)
        cal = SLOW
        if est["seconds"] >= MIN_PRINT_S:  # short even on a slow machine: no calibration needed
            from llmtool.core.job import apply_threads

            apply_threads()  # calibrate at the thread count the command will run with
            cal = calibration()
            est = estimate(stages, cal, params)
    except Exception as e:  # pragma: no cover - a broken torch install etc.: the command itself will say
        if os.environ.get("LLMTOOL_DEBUG"):
            raise
        info(f"estimate: unavailable ({type(e).__name__})")
        return None
    idle = est["seconds"]
    factor = load_factor() if cal is not SLOW else 1.0
    LAST = {"seconds": round(idle * factor, 1), "idle_seconds": round(idle, 1), "load_factor": round(factor, 2),
            "command": what, "params": params,
            "stages": [{**asdict(s), "seconds": round(s.seconds(cal), 2)} for s in stages],
            "overhead_seconds": round(est["overhead_seconds"], 1),
            "calibration": {k: cal[k] for k in ("gemm_flops", "gemv_bytes", "key")}}
    from llmtool.core.dist import is_main

    if is_main():
        if idle >= MIN_PRINT_S:
            info(line(stages, idle * factor) + (f"; this machine is busy (load {factor:.1f}x its cores): "
                                                f"{fmt_seconds(idle)} when idle" if factor >= 1.25 else ""))
        record = os.environ.get("LLMTOOL_ETA_RECORD", "").strip()
        if record:  # benchmarks/estimates.py: the exact estimate and its stages, one JSON line per command
            try:
                with open(record, "a") as fh:
                    fh.write(json.dumps(LAST) + "\n")
            except OSError:
                pass
    return LAST


def take_last(command: str | None = None) -> dict | None:
    """The last estimate, then forgotten (so it is written into one output only); with ``command``, only an
    estimate announced by the same command (first word: ``learn-program run`` is job ``learn-program``), so
    that a command without an estimate never reports one left over by another in the same process."""
    global LAST
    last, LAST = LAST, None
    if last is not None and command is not None and \
            str(last.get("command", "")).split()[:1] != str(command).split()[:1]:
        return None
    return last
