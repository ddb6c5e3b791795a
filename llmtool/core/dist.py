"""Rank awareness for multi-process launches (``torchrun``, ``accelerate launch``), in one place.

Under a launcher every rank runs the same command line. The contract every training entry point keeps
(issue 41): the main process (global rank 0) alone writes OUT, provenance, metrics and progress; every
rank trains on its own shard of the data; metrics are reduced across ranks; sampling that must differ
between ranks is seeded with :func:`rank_seed`. :func:`llmtool.core.job.job` applies the first part for
every command through :func:`output_dir` (non-main ranks work in a private scratch directory that is
deleted at the end), and :func:`llmtool.core.console.emit` prints on the main process only.

The rank and world size come from the launcher's environment (``RANK``/``WORLD_SIZE``, set by torchrun
and accelerate), so nothing here imports torch until a collective is needed; the process group is the
one accelerate's ``PartialState`` creates (gloo on CPU, NCCL on CUDA), which transformers' Trainer then
reuses.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name, "")
    return int(v) if v.strip().isdigit() else default


def world_size() -> int:
    return max(1, _env_int("WORLD_SIZE", 1))


def rank() -> int:
    return _env_int("RANK", 0) if world_size() > 1 else 0


def local_rank() -> int:
    return _env_int("LOCAL_RANK", 0) if world_size() > 1 else 0


def is_main() -> bool:
    return rank() == 0


def distributed() -> bool:
    return world_size() > 1


def rank_seed(seed: int) -> int:
    """A per-rank seed for draws that must differ between ranks (sampling, random rewards); rank 0 keeps
    ``seed`` so a 1-process run is unchanged."""
    return int(seed) + 1_000_003 * rank()


def init() -> None:
    """Create the process group (once) when launched with more than one process."""
    if not distributed():
        return
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return
    import torch
    from accelerate import PartialState

    # cpu=True without CUDA: otherwise accelerate sets up a CPU launch as DistributedType.NO (one process each)
    PartialState(cpu=not torch.cuda.is_available())


def _group_ready() -> bool:
    if not distributed():
        return False
    init()
    import torch.distributed as tdist

    return tdist.is_initialized()


def barrier() -> None:
    if _group_ready():
        import torch.distributed as tdist

        tdist.barrier()


def broadcast(obj: Any) -> Any:
    """The main process's ``obj`` (a JSON value) on every rank. Sent as UTF-8 bytes in a tensor, never
    through ``broadcast_object_list`` (which pickles)."""
    if not _group_ready():
        return obj
    import json

    import torch
    import torch.distributed as tdist

    dev = torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else torch.device("cpu")
    data = json.dumps(obj).encode() if is_main() else b""
    n = torch.tensor([len(data)], dtype=torch.long, device=dev)
    tdist.broadcast(n, src=0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if is_main()
           else torch.empty(int(n.item()), dtype=torch.uint8, device=dev))
    tdist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def main_path(path: Path | str) -> Path:
    """The main process's ``path`` on every rank (e.g. the Trainer's checkpoint dir inside the main
    process's temporary OUT, which every rank must share for per-rank RNG files)."""
    return Path(broadcast(str(path)))


def reduce_mean(values: dict[str, float]) -> dict[str, float]:
    """Mean over ranks of each finite float (one all-reduce); a no-op with one process."""
    if not values or not _group_ready():
        return dict(values)
    import torch
    import torch.distributed as tdist

    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if tdist.get_backend() == "nccl":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    t = (t / world_size()).cpu()
    return {k: float(v) for k, v in zip(keys, t.tolist())}


@contextlib.contextmanager
def output_dir(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """The main process: :func:`llmtool.core.checkpoint.atomic_output` (a temporary dir renamed to OUT on
    success). Any other rank: a private scratch directory outside OUT's parent, removed at the end, so
    exactly one OUT exists whatever the number of processes. Non-main ranks are also made quiet."""
    init()  # every rank joins the process group before any work (the Trainer and collectives reuse it)
    if is_main():
        from llmtool.core.checkpoint import atomic_output

        with atomic_output(out, overwrite=overwrite) as tmp:
            yield tmp
        return
    from llmtool.core.console import OPTIONS

    OPTIONS.quiet = True
    tmp = Path(tempfile.mkdtemp(prefix=f"llmtool-rank{rank()}-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
