"""The shared kernels live in the checkout's top-level ``kernels/`` folder and are installed under the import
name ``llmtool.kernels`` (setuptools ``package-dir`` in pyproject.toml; issue 44)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import llmtool
import llmtool.kernels
import llmtool.kernels.weight_only

ROOT = Path(__file__).resolve().parents[1]
EDITABLE = Path(llmtool.__file__).resolve().parent == ROOT / "llmtool"


def test_kernels_import_from_the_top_level_folder_in_a_checkout():
    if not EDITABLE:        # a regular install copies kernels/ into site-packages/llmtool/kernels
        assert Path(llmtool.kernels.__file__).resolve().parent.name == "kernels"
        return
    assert Path(llmtool.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert Path(llmtool.kernels.weight_only.__file__).resolve().parent == ROOT / "kernels"
    assert not (ROOT / "llmtool" / "kernels").exists()        # a stale folder there would shadow the mapping


def test_top_level_kernels_name_is_not_shadowed_from_the_checkout_root():
    """From the checkout root (on sys.path as ''), ``import kernels`` must still give Hugging Face's package
    (transformers imports it), never this folder."""
    code = ("import importlib.util, sys\n"
            "try:\n import kernels\nexcept ModuleNotFoundError:\n print('absent'); sys.exit(0)\n"
            "print(kernels.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    where = out.stdout.strip()
    assert where == "absent" or not Path(where).resolve().is_relative_to(ROOT / "kernels"), where


def test_pyproject_lists_every_package_folder_and_maps_kernels():
    tomllib = pytest.importorskip("tomllib")      # Python >= 3.11
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {"llmtool.kernels": "kernels"}
    listed = set(cfg["packages"])
    on_disk = {".".join(d.relative_to(ROOT).parts) for d in (ROOT / "llmtool").rglob("*")
               if d.is_dir() and "__pycache__" not in d.parts}
    on_disk |= {"llmtool", "llmtool.kernels"}
    assert on_disk == listed, (sorted(on_disk - listed), sorted(listed - on_disk))


def test_package_data_covers_every_data_file():
    """Every non-Python file under llmtool/ (packaged examples, edit requests, HiBayES grades) matches a
    package-data glob, so a regular install ships it (it silently left them out before)."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = []
    for f in (ROOT / "llmtool").rglob("*"):
        if not f.is_file() or f.suffix in (".py", ".pyc") or "__pycache__" in f.parts:
            continue
        pkg = ".".join(f.parent.relative_to(ROOT).parts)
        if not any(fnmatch.fnmatch(f.name, g) for g in data.get(pkg, ())):
            missing.append(str(f.relative_to(ROOT)))
    assert not missing, missing
