"""Checks of a training checkpoint directory given to ``--resume``, before anything in it is loaded.

A resume directory is an input like MODEL and gets the same checks (issue 39, critical 2): the model
weights in it go through :func:`llmtool.core.preflight.checked_model` (a causal LM, no remote code,
safetensors headers checked, pickle-only weights refused), ``trainer_state.json`` must be a JSON object,
and the state files that transformers' ``Trainer`` restores with ``torch.load`` (optimizer, scheduler,
RNG and scaler states) are inspected *without unpickling*: their pickle opcodes are read with
:mod:`pickletools` (which decodes, never executes) and every global they reference must be one of the
few that plain tensor/number/NumPy-RNG state needs. A file that names anything else (``os.system``,
``builtins.exec``, any class) is refused with exit 2 before the Trainer ever opens it; the Trainer's
own loads then run with ``weights_only=True`` (transformers >= 4.5x) as a second line.

``training_args.bin`` (a pickled ``TrainingArguments`` the Trainer writes but never reads back) is not
loaded by anything and is left alone; every other ``*.pt``/``*.pth``/``*.bin``/``*.pkl``/``*.pickle``/
``*.ckpt`` file is checked.
"""
from __future__ import annotations

import json
import pickletools
import zipfile
from pathlib import Path

from llmtool.core.console import UsageError

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
NEVER_LOADED = ("training_args.bin",)
SAFE_GLOBALS = frozenset({
    "collections.OrderedDict", "collections.defaultdict",
    "torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
    "torch._utils._rebuild_sparse_tensor", "torch._utils._rebuild_device_tensor_from_numpy",
    "torch.serialization._get_layout", "torch.Size", "torch.device",
    "torch.FloatStorage", "torch.DoubleStorage", "torch.HalfStorage", "torch.BFloat16Storage", "torch.LongStorage",
    "torch.IntStorage", "torch.ShortStorage", "torch.CharStorage", "torch.ByteStorage", "torch.BoolStorage",
    "torch.storage.UntypedStorage", "torch.storage.TypedStorage",
    "torch.float32", "torch.float16", "torch.bfloat16", "torch.float64", "torch.int64", "torch.int32",
    "torch.uint8", "torch.bool",
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
    "numpy.dtypes.UInt32DType", "numpy.dtypes.Float64DType", "numpy.dtypes.Int64DType",
    "_codecs.encode", "builtins.set", "builtins.frozenset", "builtins.slice", "builtins.complex",
})
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}


def pickle_globals(data: bytes, where: str) -> set[str]:
    """Every ``module.name`` a pickle stream references (GLOBAL/INST/STACK_GLOBAL), found by decoding its
    opcodes; never executes it. An unresolvable STACK_GLOBAL is reported as ``?``."""
    found: set[str] = set()
    memo: dict[int, object] = {}
    recent: list[object] = []
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("GLOBAL", "INST"):
                found.add(str(arg).replace(" ", "."))
                recent.append(None)
            elif name == "STACK_GLOBAL":
                a, b = (recent[-2], recent[-1]) if len(recent) >= 2 else (None, None)
                found.add(f"{a}.{b}" if isinstance(a, str) and isinstance(b, str) else "?")
                recent.append(None)
            elif name in _STRING_OPS:
                recent.append(arg if isinstance(arg, str) else (arg.decode("latin-1") if isinstance(arg, bytes) else None))
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = recent[-1] if recent else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent.append(memo.get(int(arg)))
            else:
                recent.append(None)
            if len(recent) > 64:
                del recent[:32]
    except Exception as e:  # truncated / not a pickle
        raise UsageError(f"{where}: not a readable checkpoint state file ({type(e).__name__})") from None
    return found


def check_pickle_file(path: Path) -> None:
    """Refuse a torch-saved state file whose pickle references anything but tensor/number state."""
    path = Path(path)
    pickles: list[tuple[str, bytes]] = []
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                for info in z.infolist():
                    if info.filename.endswith(".pkl"):
                        if info.file_size > 1 << 30:
                            raise UsageError(f"{path}: pickle record {info.filename} is implausibly large")
                        pickles.append((f"{path}:{info.filename}", z.read(info)))
            if not pickles:
                raise UsageError(f"{path}: a zip file without a torch pickle record")
        else:
            raise UsageError(f"{path}: a legacy (non-zip) pickle file; llmtool never unpickles such files "
                             "(re-save it with torch >= 1.6 or remove it)")
    except (OSError, zipfile.BadZipFile) as e:
        raise UsageError(f"{path}: cannot read ({e})") from None
    for where, data in pickles:
        bad = sorted(pickle_globals(data, where) - SAFE_GLOBALS)
        if bad:
            raise UsageError(f"{where}: the pickle references {', '.join(bad[:3])}, which plain tensor state never "
                             "needs; refusing to load it (llmtool never unpickles code)")


def check_resume_dir(path: Path | str, *, flag: str = "--resume", need_model: bool = True) -> Path:
    """All checks of a Trainer checkpoint directory; returns it. Raises UsageError (exit 2)."""
    from llmtool.core.preflight import checked_model

    path = Path(path).expanduser()
    if not path.is_dir():
        raise UsageError(f"{flag} {path}: not a directory")
    state = path / "trainer_state.json"
    if not state.is_file():
        raise UsageError(f"{flag} {path}: not a checkpoint directory (no trainer_state.json)")
    try:
        st = json.loads(state.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        raise UsageError(f"{state}: invalid JSON") from None
    if not isinstance(st, dict) or not isinstance(st.get("global_step", 0), int):
        raise UsageError(f"{state}: not a trainer state (expected an object with an integer global_step)")
    if need_model or (path / "config.json").exists():
        checked_model(path)
    for f in sorted(path.rglob("*")):
        if f.is_symlink():
            raise UsageError(f"{flag} {path}: {f.name} is a symbolic link; a checkpoint holds plain files")
        if f.is_file() and f.suffix in PICKLE_SUFFIXES and f.name not in NEVER_LOADED:
            check_pickle_file(f)
    return path
