"""Hugging Face checkpoint directories on disk: read/write safetensors (single file or sharded with
an index), lazy per-tensor access for layer-by-layer processing, atomic output directories, and
the ``llmtool.json`` provenance file every command writes beside its output.

Atomicity: outputs are built in a temporary sibling directory and renamed into place at the end;
on any error (or Ctrl-C) the temporary directory is removed, so nothing half-written is left and
the input is never touched.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:  # torch is imported where tensors are written, so `--help` stays light
    import torch

from llmtool.core.console import UsageError

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PROVENANCE = "llmtool.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def regular_file(path: Path) -> os.stat_result:
    """``os.stat`` of an input that must be a regular file, checked *before* it is opened: a directory, a
    FIFO (opening one blocks until a writer appears), a device or a socket is refused, and a symlink loop
    or an unreadable path is a one-line error instead of an OSError."""
    import stat as stat_mod

    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror or type(e).__name__})") from None
    if not stat_mod.S_ISREG(st.st_mode):
        kind = ("a directory" if stat_mod.S_ISDIR(st.st_mode) else "a FIFO" if stat_mod.S_ISFIFO(st.st_mode)
                else "a socket" if stat_mod.S_ISSOCK(st.st_mode) else "a device")
        raise UsageError(f"{path}: not a regular file ({kind})")
    return st


def read_json(path: Path) -> Any:
    """A JSON file given by the user: a regular file, UTF-8, well-formed, not nested beyond the parser's
    recursion limit. Every failure is a one-line :class:`UsageError` naming the file."""
    path = Path(path)
    regular_file(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror or type(e).__name__})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise UsageError(f"{path}: invalid JSON (nested too deeply)") from None


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not (path.exists() or path.is_symlink()):
        raise UsageError(f"{model_dir}: not a model directory (no config.json)")
    config = read_json(path)
    if not isinstance(config, dict):
        raise UsageError(f"{path}: invalid JSON (a config must be a JSON object, found a {type(config).__name__})")
    return config


def _inside(model_dir: Path, name: Any, index: Path) -> Path:
    """The weight file ``name`` of a shard index, refused unless it is a plain relative path inside the
    checkpoint directory (an index must not make llmtool read files elsewhere)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UsageError(f"{index}: not a valid safetensors index (weight file name {name!r})")
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm == ".." or norm.startswith(".." + os.sep):
        raise UsageError(f"{index}: weight file {name!r} lies outside the checkpoint directory (refused)")
    return model_dir / norm


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors weight files of a checkpoint (pickle-only checkpoints are refused: loading a
    pickle runs arbitrary code). Every file must be a regular file inside the checkpoint directory."""
    model_dir = Path(model_dir)
    index = model_dir / SAFE_INDEX
    if index.exists() or index.is_symlink():
        doc = read_json(index)
        try:
            names = sorted(set(doc["weight_map"].values()))
        except (KeyError, TypeError, AttributeError):
            raise UsageError(f"{index}: not a valid safetensors index (no weight_map)") from None
        files = [_inside(model_dir, n, index) for n in names]
        missing = [f.name for f in files if not (f.exists() or f.is_symlink())]
        if missing:
            raise UsageError(f"{index}: names missing weight file {missing[0]}")
        for f in files:
            regular_file(f)
        return files
    single = model_dir / SAFE_SINGLE
    if single.exists() or single.is_symlink():
        regular_file(single)
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        if pickles:
            raise UsageError(f"{model_dir}: only pickle weights ({pickles[0]}); llmtool loads safetensors only "
                             "(convert them with a trusted tool first)")
        raise UsageError(f"{model_dir}: no *.safetensors weights found")
    for f in found:
        regular_file(f)
    return found


SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def check_safetensors(path: Path) -> dict:
    """Validate a safetensors file's header against its size before anything loads it; returns the
    header. A truncated file, a corrupt or oversized header, or tensors outside the file are errors."""
    path = Path(path)
    size = regular_file(path).st_size  # never open a FIFO/directory: that blocks or fails
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UsageError(f"{path}: corrupt safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n <= 1 or n > min(size - 8, 100 * 1024**2):
            raise UsageError(f"{path}: corrupt safetensors file (header length {n} does not fit a {size}-byte file)")
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UsageError(f"{path}: corrupt safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise UsageError(f"{path}: corrupt safetensors file (header is not an object)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = info["data_offsets"]
            width = SAFETENSORS_DTYPES[info["dtype"]]
            count = 1
            for d in info["shape"]:
                count *= int(d)
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{path}: corrupt safetensors file (bad entry for tensor {name!r})") from None
        if not (0 <= lo <= hi) or hi - lo != count * width:
            raise UsageError(f"{path}: corrupt safetensors file (tensor {name!r} has inconsistent offsets)")
        end = max(end, hi)
    if 8 + n + end > size:
        raise UsageError(f"{path}: truncated safetensors file ({size} bytes, header promises {8 + n + end})")
    return header


class LazyCheckpoint:
    """Tensor-by-tensor access to a checkpoint without loading it whole (for layer-wise work)."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        self._where: dict[str, Path] = {}
        for f in weight_files(self.dir):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    self._where[k] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self._where[name]), framework="pt") as h:
            return h.get_tensor(name)

    def load(self, prefix: str = "") -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for k, f in self._where.items():
            if k.startswith(prefix):
                by_file.setdefault(f, []).append(k)
        out = {}
        for f, ks in by_file.items():
            with safe_open(str(f), framework="pt") as h:
                for k in ks:
                    out[k] = h.get_tensor(k)
        return out


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    return LazyCheckpoint(model_dir).load()


def save_state_dict(
    tensors: Mapping[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = 2 * 1024**3,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Save tensors as safetensors (sharded with an HF index above ``max_shard_bytes``).
    Tensors sharing storage (tied weights) are stored once under the first name."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    seen: dict[tuple[int, int, tuple], str] = {}
    unique: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen[key] = name
        unique[name] = t.detach().contiguous().cpu()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in unique.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        path = out_dir / SAFE_SINGLE
        save_file(shards[0], str(path), metadata=meta)
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata=meta)
        paths.append(out_dir / fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in unique.values())
    (out_dir / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths


BASE_CONFIG_KEY = "llmtool_base_config"
# config.json and llmtool.json of llmtool-only formats say how to load them: plain transformers' refusal
# ("does not recognize this architecture ... update Transformers") cannot name `llmtool models export`.
HOW_TO_LOAD = ("written by llmtool: load with llmtool.load(DIR) (pip install llmtool); plain transformers refuses "
               "this model type, `llmtool models export DIR DENSE` writes a plain transformers checkpoint of it")


def mark_llmtool_format(config: dict, model_type: str, architecture: str) -> dict:
    """config.json of a checkpoint only llmtool can run (low-rank factors, packed integer weights).

    ``model_type`` and ``architectures`` are renamed (e.g. ``llmtool_lowrank`` /
    ``LlmtoolLowRankForCausalLM``) so that plain transformers refuses the directory with "does not recognize
    this architecture" instead of building the base model, finding none of its weights and initialising them
    at random; the base values move to ``llmtool_base_config``, from which ``llmtool.load`` rebuilds the
    model. ``llmtool models export DIR OUT`` writes a plain transformers checkpoint."""
    cfg = dict(config)
    base = cfg.pop(BASE_CONFIG_KEY, None) or {"model_type": cfg.get("model_type"),
                                              "architectures": cfg.get("architectures")}
    cfg["model_type"] = model_type
    cfg["architectures"] = [architecture]
    cfg[BASE_CONFIG_KEY] = base
    cfg["how_to_load"] = HOW_TO_LOAD
    return cfg


def base_config_dict(config: dict) -> dict:
    """The base model's config.json of a :func:`mark_llmtool_format` config (unchanged otherwise)."""
    if BASE_CONFIG_KEY not in config:
        return dict(config)
    cfg = {k: v for k, v in config.items() if k not in (BASE_CONFIG_KEY, "how_to_load")}
    cfg.update({k: v for k, v in config[BASE_CONFIG_KEY].items() if v is not None})
    return cfg


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def source_hash(model_dir: Path) -> str:
    """sha256 over config.json and the weight files (names and bytes), identifying the source."""
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    files = [model_dir / "config.json", *weight_files(model_dir)]
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def dir_size_bytes(path: Path, pattern: str = "*.safetensors") -> int:
    return sum(f.stat().st_size for f in Path(path).glob(pattern))


def check_output(out: Path, overwrite: bool, inputs: tuple[Path, ...] = ()) -> Path:
    """Validate an output path before any work: it must not exist unless --overwrite, must not be
    (or lie inside) an input, and its parent must be a writable directory (or creatable) on an ordinary
    file system (not /proc or /sys). Leftovers of killed writers of the same OUT are cleaned first (see
    :func:`clean_stale_temps`), so that a refused run cleans them too."""
    try:
        out = Path(out).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop on the way
        raise UsageError(f"{out}: cannot use it as an output ({getattr(e, 'strerror', None) or e})") from None
    for src in inputs:
        src = Path(src).resolve()
        if out == src or src in out.parents:
            raise UsageError(f"{out}: output would overwrite or nest inside the input {src}")
    for pseudo in ("/proc", "/sys", "/dev"):
        if str(out) == pseudo or str(out).startswith(pseudo + "/"):
            raise UsageError(f"{out}: cannot write an output under {pseudo} (a kernel pseudo file system)")
    with contextlib.suppress(OSError):
        clean_stale_temps(out)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise UsageError(f"{out}: already exists (pass --overwrite to replace it)")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{out}: cannot create it, {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{out}: cannot write there ({parent} is not writable)")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _dead_writer(p: Path, prefix: str) -> bool:
    """Whether ``p`` (``prefix`` + ``PID[-...]``) was left by a process that no longer runs."""
    pid = p.name[len(prefix):].split("-", 1)[0]
    return pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))


def _remove(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


def clean_stale_temps(out: Path) -> list[Path]:
    """Remove what killed writers of ``out`` left behind (their PID is gone):

    - ``.OUT.tmp-PID-*``: the temporary output of a run killed before its rename;
    - ``.OUT.old-PID``: the previous OUT of an ``--overwrite`` run killed between its two renames. When
      OUT is missing (killed after moving the old OUT aside, before moving the new one in), the old OUT
      is put back (the interrupted run's result is incomplete by definition: its temp dir is removed);
      when OUT exists (killed after the second rename), the old one is removed.

    Called by every output check, so a refused run cleans up too."""
    out = Path(out)
    removed: list[Path] = []
    if not out.parent.is_dir():
        return removed
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        if _dead_writer(p, f".{out.name}.tmp-"):
            _remove(p)
            removed.append(p)
    olds = sorted((p for p in out.parent.glob(f".{out.name}.old-*") if _dead_writer(p, f".{out.name}.old-")),
                  key=lambda p: p.lstat().st_mtime, reverse=True)
    for p in olds:
        if not (out.exists() or out.is_symlink()):
            p.rename(out)  # the newest previous OUT comes back
        else:
            _remove(p)
        removed.append(p)
    return removed


def _ordinary_modes(root: Path) -> None:
    """Give files the permissions an ordinary write would (safetensors writes its files 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink() and (p.stat().st_mode & 0o777) == 0o600:
            p.chmod(0o666 & ~mask)


@contextlib.contextmanager
def atomic_output(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out`` only if the block succeeds.

    Without ``overwrite`` the final rename refuses to replace an ``out`` that appeared meanwhile (a
    second writer gets "already exists", never a silently lost result). Temp dirs of killed runs on
    the same ``out`` are removed first."""
    out = check_output(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise UsageError(f"{out}: cannot create it ({e.strerror or type(e).__name__})") from None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the output is an ordinary directory
        yield tmp
        _ordinary_modes(tmp)
        if out.exists() or out.is_symlink():
            if not overwrite:
                raise UsageError(f"{out}: already exists (written by another run meanwhile; pass --overwrite to replace it)")
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:  # e.g. SIGTERM between the two renames: the previous OUT comes back
                if not (out.exists() or out.is_symlink()):
                    old.rename(out)
                raise
            _remove(old)  # a kill here leaves .OUT.old-PID beside the new OUT: the next run removes it
        else:
            try:
                os.mkdir(out)  # claims the name atomically: a concurrent writer fails here
            except FileExistsError:
                raise UsageError(f"{out}: already exists (written by another run meanwhile)") from None
            tmp.rename(out)  # replaces the empty directory we just created
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(out: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary file path that becomes ``out`` only if the block succeeds (never replacing an
    existing file unless ``overwrite``; caches use the default, user outputs pass their --overwrite)."""
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"{out}: is a directory (give a file path)")
    check_output(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent)
    except OSError as e:
        raise UsageError(f"{out}: cannot create it ({e.strerror or type(e).__name__})") from None
    os.close(fd)
    os.chmod(tmp, 0o644)
    try:
        yield Path(tmp)
        if overwrite:
            os.replace(tmp, out)
        else:
            try:
                os.link(tmp, out)  # fails if out exists: no silent replacement
            except FileExistsError:
                raise UsageError(f"{out}: already exists (pass --overwrite to replace it)") from None
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_provenance(
    out_dir: Path, command: str, method: str, params: Mapping[str, Any], source: Path | None = None,
    metrics: Mapping[str, Any] | None = None, **extra: Any,
) -> dict:
    """Write ``llmtool.json``: what made this output (command, method, every parameter, the source
    model's path and hash) and what was measured."""
    from llmtool import __version__

    record = {
        "llmtool_version": __version__,
        "command": command,
        "method": method,
        "parameters": dict(params),
        "source": None if source is None else {"path": str(source), "sha256": source_hash(source)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "metrics": dict(metrics or {}),
        **extra,
    }
    with contextlib.suppress(OSError, ValueError):  # an llmtool-only format: say how to load it
        if BASE_CONFIG_KEY in json.loads((Path(out_dir) / "config.json").read_text()):
            record.setdefault("how_to_load", HOW_TO_LOAD)
    (Path(out_dir) / PROVENANCE).write_text(json.dumps(record, indent=2, default=str))
    return record


def read_provenance(model_dir: Path) -> dict | None:
    p = Path(model_dir) / PROVENANCE
    return json.loads(p.read_text()) if p.is_file() else None
