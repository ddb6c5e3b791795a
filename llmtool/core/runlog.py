"""An append-only log of finished runs, so long multi-run benchmarks survive interruption and grow.

A benchmark that trains many runs (arms x faults x seeds) appends each run's record to a JSONL file the
moment it ends, stamped with the *protocol*: every setting that changes a run's result. A later command
with the same protocol reads the runs already there and trains only the missing ones, so a protocol
too long for one sitting (or one machine's session) is accumulated over several commands, and adding
seeds or arms costs only the new runs. Records under another protocol are ignored, never mixed in.
Torch-free.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Hashable


def protocol_of(args, keys, optional: dict | None = None) -> dict:
    """The protocol of ``args`` (an argparse namespace): every setting in ``keys``, plus each ``optional`` setting
    whose value differs from its default there. A setting added to a benchmark later goes in ``optional`` with
    the value every earlier run had, so runs files written before it existed keep matching."""
    out = {k: getattr(args, k) for k in keys}
    out.update({k: getattr(args, k, d) for k, d in (optional or {}).items() if getattr(args, k, d) != d})
    return out


class RunLog:
    """``RunLog(path, protocol, key)``: ``key(record)`` names a run (e.g. (arm, fault, seed)).

    ``done()`` -> {key: record} of the runs under ``protocol`` (the last one wins when a key repeats);
    ``done(ignore=keys)`` also takes runs whose protocol differs only in those settings (for runs that no such
    setting changes); ``append(record)`` writes one finished run (flushed at once). Records come back without the
    protocol."""

    def __init__(self, path: Path | str, protocol: dict, key: Callable[[dict], Hashable]):
        self.path, self.key = Path(path), key
        self.protocol = json.loads(json.dumps(protocol, default=str))  # as it will read back from the file

    def done(self, ignore: tuple[str, ...] = ()) -> dict:
        def settings(protocol):
            return {k: v for k, v in protocol.items() if k not in ignore} if isinstance(protocol, dict) else protocol

        want, out = settings(self.protocol), {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a crash mid-write: that run is simply redone
                    continue
                if settings(rec.pop("protocol", None)) == want:
                    out[self.key(rec)] = rec
        return out

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut = False
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb") as fh:
                fh.seek(-1, 2)
                cut = fh.read(1) != b"\n"  # a line cut by a crash: end it so this record stays whole
        with open(self.path, "a") as fh:
            fh.write(("\n" if cut else "") + json.dumps({**record, "protocol": self.protocol}, default=float) + "\n")
