"""docs/cli-conventions.md, enforced over the whole command tree (every area found in llmtool.cli.AREAS)."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from llmtool.cli import AREAS

from typer.core import TyperGroup as Group

AVAILABLE = [(name, mod) for name, (mod, _) in AREAS.items()]

# Names the dialect does not use, with the name it uses instead.
FORBIDDEN = {
    "--output": "OUT (directory) or -o/--out (file)", "--out-dir": "OUT", "--outdir": "OUT",
    "--output-dir": "OUT", "--calib": "--calib-data", "--calibration": "--calib-data",
    "--calibration-data": "--calib-data", "--corpus": "--calib-data or --data", "--bs": "--batch-size",
    "--batch": "--batch-size", "--n-threads": "--threads (global)", "--num-threads": "--threads (global)",
    "--algo": "--method", "--algorithm": "--method", "--variant": "--method",
}


def _walk(cmd, path):
    names = cmd.list_commands(None) if isinstance(cmd, Group) else []
    if not names or getattr(cmd, "invoke_without_command", False):
        yield path, cmd  # a leaf, or a group whose callback is itself a command (`llmtool compress MODEL OUT`)
    for name in names:
        yield from _walk(cmd.get_command(None, name), [*path, name])


def _leaf_commands():
    import typer

    for name, mod in AVAILABLE:
        app = importlib.import_module(mod).app
        if not (app.registered_commands or app.registered_groups or app.registered_callback):
            continue  # an area folder still being built: its cli.py has no command yet
        yield from _walk(typer.main.get_command(app), [name])


def test_every_area_module_imports_without_torch():
    mods = [m for _, m in AVAILABLE]
    code = ("import sys, importlib\n"
            f"for m in {mods!r}:\n"
            "    importlib.import_module(m)\n"
            "    bad = [x for x in ('torch', 'transformers', 'sklearn', 'scipy') if x in sys.modules]\n"
            "    assert not bad, (m, bad)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_option_names_follow_the_dialect():
    problems = []
    for path, cmd in _leaf_commands():
        for param in cmd.params:
            for opt in getattr(param, "opts", []):
                if opt in FORBIDDEN:
                    problems.append(f"{' '.join(path)}: {opt} -> use {FORBIDDEN[opt]}")
            if getattr(param, "param_type_name", "") == "argument" and param.name in ("out", "out_dir"):
                if not param.required:
                    problems.append(f"{' '.join(path)}: OUT must never be defaulted")
            if getattr(param, "param_type_name", "") == "option" and param.name in ("out", "output"):
                if "-o" not in param.opts or "--out" not in param.opts:
                    problems.append(f"{' '.join(path)}: an output file option is -o/--out")
    assert not problems, "\n".join(problems)


def test_no_command_redefines_a_global_option():
    """A global option after the verb is moved before it (cli.hoist_globals), so a command's own --seed or
    --device would silently never receive the value."""
    from llmtool.cli import GLOBAL_FLAGS

    problems = [f"{' '.join(path)}: {opt}" for path, cmd in _leaf_commands() for param in cmd.params
                for opt in getattr(param, "opts", []) if opt in GLOBAL_FLAGS]
    assert not problems, "commands shadowing a global option: " + ", ".join(problems)


def test_method_choices_come_from_a_registry():
    """A command with --method is derived from a registry (core.registry.method_options)."""
    problems = []
    for path, cmd in _leaf_commands():
        if any("--method" in getattr(p, "opts", []) for p in cmd.params):
            if getattr(cmd.callback, "registry", None) is None:
                problems.append(" ".join(path))
    assert not problems, "hand-written --method lists in: " + ", ".join(problems)


@pytest.mark.parametrize("area", [a for a, _ in AVAILABLE])
def test_every_command_has_help_and_takes_json_after_it(area):
    from conftest import run_cli

    for path, _ in _leaf_commands():
        if path[0] != area:
            continue
        code, out, err = run_cli(*path, "--help", "--json")
        assert code == 0, (path, err)
        assert "Usage" in out
