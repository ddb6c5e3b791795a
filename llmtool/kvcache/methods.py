"""The kvcache method contract: one config dataclass per ``--method`` of ``llmtool kvcache``.

``METHODS`` (a :class:`llmtool.core.registry.Registry`) holds ``full`` (the uncompressed reference),
the eviction methods (``snapkv``, ``pyramidkv``, ``adakv``, ``streamingllm``; each scored by the press
of the same name in :data:`llmtool.kvcache.eviction.PRESSES`, SnapKV-family ones with optional
CriticalKV selection) and the quantized caches (``kivi``, ``patternkv``). The CLI's ``--method``
choices and options are derived from it; an option the chosen method does not have is refused (e.g.
``--budget`` with ``kivi``, ``--critical`` with ``streamingllm``). :func:`to_spec` turns a config into
the :class:`~llmtool.kvcache.pipeline.KVSpec` the pipeline runs; provenance is ``config.as_dict()``.

Adding an eviction method: a press module registered in ``PRESSES`` plus one config class here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmtool.core.console import UsageError
from llmtool.core.registry import MethodConfig, Registry, option

METHODS: Registry = Registry("kvcache", what="KV-cache method")


@METHODS.config
@dataclass
class FullConfig(MethodConfig):
    name: ClassVar[str] = "full"
    help: ClassVar[str] = "Uncompressed cache (reference)."
    kind: ClassVar[str] = "none"


@dataclass
class EvictionConfig(MethodConfig):
    """Prefill-time eviction: keep a fraction ``budget`` of the context's entries per KV head."""

    kind: ClassVar[str] = "evict"
    budget: float = option(1.0, "Fraction of the context's KV entries kept, in (0, 1].", min=0.0, max=1.0,
                           exclusive_min=True)
    window_size: int = option(32, "Observation window (always kept).", min=1)


@dataclass
class ScoredEvictionConfig(EvictionConfig):
    """Eviction scored by pooled window attention (SnapKV family), with optional CriticalKV selection."""

    kernel_size: int = option(5, "SnapKV pooling kernel.", min=1)
    critical: bool = option(False, "CriticalKV two-stage selection on top of the method.")
    first_stage_ratio: float = option(0.5, "CriticalKV stage-1 share of the budget.", min=0.0, max=1.0)


@METHODS.config
@dataclass
class SnapKVConfig(ScoredEvictionConfig):
    name: ClassVar[str] = "snapkv"
    help: ClassVar[str] = "SnapKV: pooled observation-window attention, uniform budget."


@METHODS.config
@dataclass
class PyramidKVConfig(ScoredEvictionConfig):
    name: ClassVar[str] = "pyramidkv"
    help: ClassVar[str] = "PyramidKV: SnapKV scores, budgets shrinking with depth."


@METHODS.config
@dataclass
class AdaKVConfig(ScoredEvictionConfig):
    name: ClassVar[str] = "adakv"
    help: ClassVar[str] = "AdaKV: SnapKV scores, budgets allocated across heads."


@METHODS.config
@dataclass
class StreamingLLMConfig(EvictionConfig):
    name: ClassVar[str] = "streamingllm"
    help: ClassVar[str] = "StreamingLLM: attention sinks plus the recent window."


@dataclass
class QuantConfig(MethodConfig):
    """Quantized cache: prefill exact, later steps read the quantized history plus an exact window."""

    kind: ClassVar[str] = "quant"
    bits: int = option(2, "Quantization bits (16 = identity).", choices=(2, 4, 8, 16))
    group_size: int = option(64, "Quantization group size G (V groups: min(G, head dim)).", min=4)
    residual_length: int = option(64, "Full-precision window R (multiple of G).", min=1)

    def validate(self) -> None:
        super().validate()
        from llmtool.kvcache.kivi import check_quant_args

        check_quant_args(self.bits, self.group_size, self.residual_length)


@METHODS.config
@dataclass
class KIVIConfig(QuantConfig):
    name: ClassVar[str] = "kivi"
    help: ClassVar[str] = "KIVI: K per-channel, V per-token asymmetric quantization."


@METHODS.config
@dataclass
class PatternKVConfig(QuantConfig):
    name: ClassVar[str] = "patternkv"
    help: ClassVar[str] = "PatternKV: quantize residuals to per-head K/V patterns."
    patterns: int = option(32, "Initial K and V patterns per head.", min=1)
    v_gate: bool = option(True, "PatternKV value gate.")


def to_spec(config: MethodConfig, seed: int = 0):
    """The pipeline's :class:`KVSpec` for a method config (validated)."""
    from llmtool.kvcache.pipeline import KVSpec, validate

    kind = getattr(config, "kind", None)
    if kind == "none":
        spec = KVSpec(seed=seed)
    elif kind == "evict":
        spec = KVSpec(evict=config.name, budget=config.budget, window_size=config.window_size, seed=seed)
        if isinstance(config, ScoredEvictionConfig):
            spec.kernel_size, spec.critical = config.kernel_size, config.critical
            spec.first_stage_ratio = config.first_stage_ratio
    elif kind == "quant":
        spec = KVSpec(quant=config.name, bits=config.bits, group_size=config.group_size,
                      residual_length=config.residual_length, seed=seed)
        if isinstance(config, PatternKVConfig):
            spec.k_patterns = spec.v_patterns = config.patterns
            spec.v_gate = config.v_gate
    else:
        raise UsageError(f"kvcache: {config.name!r} is not a KV-cache method config")
    return validate(spec)
