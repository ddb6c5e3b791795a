"""Registry of `llmtool compress` methods. Each method is a small class over the shared pipeline
(:mod:`llmtool.compress.pipeline`): it says which statistics it needs, whether ranks are uniform
or chosen globally, and how one module is decomposed into a :class:`~.factorize.Spectrum`."""
from __future__ import annotations

from llmtool.core.registry import Registry

METHODS = Registry("compress")


def load_all() -> Registry:
    """Import every method module (each registers itself) and return the registry."""
    from llmtool.compress import svd, svd_llm, weighted_svd, zs_methods  # noqa: F401

    return METHODS
