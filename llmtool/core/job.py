"""One job wrapper for every command that writes an output directory.

``with job("compress", out=OUT, overwrite=..., config=cfg, model=MODEL) as j:`` does, in this order:

1. checks OUT before any work (exists without ``--overwrite``, parent not a writable directory, OUT
   inside the input) and resolves/checks MODEL (a directory with a causal-LM config, or a default alias);
2. seeds python/numpy/torch from the global ``--seed`` and applies the global ``--threads`` policy;
3. yields a :class:`Job` whose ``model``/``tokenizer`` load lazily with the global ``--dtype``/``--device``,
   whose ``dir`` is the temporary output directory, and whose ``report`` collects metrics;
4. on success writes ``llmtool.json`` (command, method config as a dict, source model hash, seed,
   versions, metrics) and ``report.json`` into the directory and renames it to OUT atomically;
   on any error nothing is left.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from llmtool.core.console import OPTIONS

REPORT = "report.json"


def apply_threads(threads: int | None = None) -> None:
    """The one thread policy: ``--threads N`` (or $LLMTOOL_THREADS); unset leaves torch's default."""
    import os

    from llmtool.core.console import UsageError
    from llmtool.core.options import check_count

    n = threads if threads is not None else OPTIONS.threads
    flag = "--threads"
    env = os.environ.get("LLMTOOL_THREADS", "").strip()
    if n is None and env:
        if not env.isdigit() or int(env) < 1:
            raise UsageError(f"$LLMTOOL_THREADS={env!r}: expected a positive integer")
        n, flag = int(env), "$LLMTOOL_THREADS"
    if n is not None:
        check_count(flag, "threads", int(n))  # never more threads than cores (a typo must not fork-bomb)
    if n:
        import torch

        torch.set_num_threads(int(n))


@dataclass
class Job:
    command: str
    dir: Path
    out: Path
    model_arg: str | None = None
    model_path: Path | None = None
    config: Any = None
    report: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    _model: Any = None
    _tokenizer: Any = None

    @property
    def model(self):
        if self._model is None:
            if self.model_arg is None:
                raise RuntimeError(f"{self.command}: this job has no model")
            from llmtool.core.models import load_model

            self._model = load_model(self.model_path or self.model_arg)
        return self._model

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.model_arg is None:
                raise RuntimeError(f"{self.command}: this job has no model")
            from llmtool.core.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path or self.model_arg)
        return self._tokenizer


def config_dict(config: Any) -> dict:
    if config is None:
        return {}
    if hasattr(config, "as_dict"):
        return config.as_dict()
    if hasattr(config, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(config)
    return dict(config)


@contextlib.contextmanager
def job(command: str, out: Path | str, *, overwrite: bool = False, config: Any = None, model: str | None = None,
        inputs: tuple = (), check_model: bool = True, seed: int | None = None,
        write_report: bool = True, check_config: Any = None) -> Iterator[Job]:
    """Run a command's work into a temporary directory that becomes ``out`` on success.

    ``check_config(path, config_dict)`` runs the command's own cheap checks of the checkpoint's
    config.json (architecture, already-quantized, ...) before the weights are read, so a checkpoint
    that is wrong in several ways is refused for the reason that concerns the command."""
    from llmtool.core.checkpoint import check_output, write_provenance

    model_path = None
    if model is not None:
        from llmtool.core.preflight import checked_model, resolve_model

        model_path = checked_model(model, check_config) if check_model else resolve_model(model)
    in_paths = tuple(Path(p) for p in inputs) + ((model_path,) if model_path is not None else ())
    out_path = check_output(Path(out), overwrite, inputs=in_paths)
    from llmtool.core.models import set_seed

    used_seed = set_seed(seed)
    apply_threads()
    start = time.time()
    from llmtool.core import dist

    # one OUT whatever the number of processes: non-main ranks of a launch work in a scratch dir (core/dist.py)
    with dist.output_dir(out_path, overwrite=overwrite) as tmp:
        j = Job(command=command, dir=tmp, out=out_path, model_arg=model, model_path=model_path, config=config)
        yield j
        if not dist.is_main():
            return
        cfg = config_dict(config)
        j.report.setdefault("seconds", round(time.time() - start, 3))
        from llmtool.core import eta

        last = eta.take_last(command)  # the start-time estimate the command printed, beside the measured time
        if last is not None:
            j.report.setdefault("estimate_seconds", last["seconds"])
        if write_report:
            (tmp / REPORT).write_text(json.dumps(j.report, indent=2, default=str))
        write_provenance(tmp, command=command, method=cfg.get("method", ""), params=cfg, source=model_path,
                         metrics=j.report, seed=used_seed, **j.extra)
