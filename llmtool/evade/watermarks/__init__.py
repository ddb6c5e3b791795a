"""Watermark schemes: ``SCHEMES`` maps a name to its class; :func:`make_scheme` builds one from the
generator's vocabulary size and optional config overrides (a JSON object of config fields)."""
from __future__ import annotations

from llmtool.core.registry import Registry
from llmtool.evade.watermarks.base import Detection, Scheme, build_config, read_config_file
from llmtool.evade.watermarks.dip import DIP
from llmtool.evade.watermarks.exp import EXP
from llmtool.evade.watermarks.kgw import KGW
from llmtool.evade.watermarks.unigram import Unigram

SCHEMES: Registry[type] = Registry("evade", what="scheme")
for _cls in (KGW, Unigram, EXP, DIP):
    SCHEMES.add(_cls.name, _cls)


def make_scheme(name: str, vocab_size: int, overrides: dict | None = None, source: str = "--config") -> Scheme:
    cls = SCHEMES.get(name)
    return cls(vocab_size, build_config(cls.config_cls, overrides, source))


__all__ = ["SCHEMES", "Detection", "Scheme", "make_scheme", "read_config_file"]
