"""Method contract of `llmtool compress`: one config dataclass per method, registered in :data:`METHODS`
(the CLI's ``--method`` choices and options are derived from it).

Settings every method has live in :class:`CompressConfig`; groups of methods share mixins:
gradient methods (``--grad-samples/--grad-seqlen``), whitened methods (``--eps`` and the
truncate -> correct -> re-truncate stages), and global-selection methods (``--keep-rank-ratio``).
Each config names the class that decomposes one module (``impl``, imported only when it runs, so this
module imports no torch); that class says which statistics it needs and whether ranks are uniform.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar, Optional

from llmtool.core.console import UsageError
from llmtool.core.registry import MethodConfig, Registry, option

METHODS = Registry("compress")
CORRECTIONS = ("none", "pull-subspace")


@dataclass
class CompressConfig(MethodConfig):
    """What every compression run has (the command sets these from its own options)."""

    impl: ClassVar[str] = ""    # "module:Class" of the per-module decomposition
    needs_data: ClassVar[bool] = True
    ratio: float = option(0.4, "Fraction of target-module parameters removed.", min=0.0, max=1.0,
                          exclusive_min=True, exclusive_max=True, cli=False)
    calib_data: str = option("austen-train", "Calibration text.", cli=False)
    calib_samples: int = option(32, "Calibration sequences.", min=1, cli=False)
    calib_seqlen: int = option(512, "Tokens per calibration sequence.", min=2, cli=False)
    batch_size: int = option(4, "Calibration sequences per forward.", min=1, cli=False)
    seed: int = option(0, "Seed (the global --seed).", cli=False)
    forced_ranks: Optional[dict] = option(None, "Library/test hook: skip selection, use these ranks.", cli=False)

    def decomposer(self):
        module, _, cls = self.impl.partition(":")
        return getattr(importlib.import_module(module), cls)()

    def resolved_keep_rank_ratio(self) -> float:
        return 0.0

    def resolved_stages(self) -> int:
        return 1


@dataclass
class _Gradient(CompressConfig):
    grad_samples: int = option(1, "Sequences for the loss gradient.", min=1)
    grad_seqlen: int = option(512, "Tokens per gradient sequence.", min=2)
    grad_seed: Optional[int] = option(None, "Seed of the gradient windows' positions (default: --seed + 1); "
                                      "rerun with other values to see the spread over windows.")

    def resolved_grad_seed(self) -> int:
        return self.seed + 1 if self.grad_seed is None else self.grad_seed


@dataclass
class _Whitened(CompressConfig):
    eps: float = option(1e-4, "Jitter added to the token-averaged covariance.", min=0.0, exclusive_min=True)
    correction: str = option("none", "Correction between stages.", choices=CORRECTIONS)
    stages: Optional[int] = option(None, "Truncate -> correct -> re-truncate stages "
                                   "(default 1, or 2 with --correction pull-subspace).", min=1)
    proj_samples: int = option(1, "Sequences for the correction gradient.", min=1)
    proj_seqlen: int = option(1024, "Last tokens of each correction sequence.", min=2)

    def resolved_stages(self) -> int:
        if self.stages is not None:
            return self.stages
        return 1 if self.correction == "none" else 2

    def validate(self) -> None:
        super().validate()
        if self.resolved_stages() > 1 and self.correction == "none":
            raise UsageError("--stages > 1 needs --correction pull-subspace "
                             "(stages repeat truncate -> correct -> re-truncate)")


@dataclass
class _Global(_Whitened):
    keep_rank_ratio: Optional[float] = option(None, "Rank floor as a fraction of the break-even rank "
                                              "(default 0 for ratio <= 0.4, else 0.3).", min=0.0, max=1.0)

    def resolved_keep_rank_ratio(self) -> float:
        if self.keep_rank_ratio is not None:
            return self.keep_rank_ratio
        return 0.0 if self.ratio <= 0.4 + 1e-9 else 0.3


@METHODS.config
@dataclass
class ZSSVDConfig(_Global, _Gradient):
    name: ClassVar[str] = "zs-svd"
    help: ClassVar[str] = "Zero-sum global selection over whitened SVD components (ZS-SVD)."
    impl: ClassVar[str] = "llmtool.compress.zs_methods:ZeroSumSVD"


@METHODS.config
@dataclass
class AbsDeltaConfig(_Global, _Gradient):
    name: ClassVar[str] = "abs-delta"
    help: ClassVar[str] = "Ablation: smallest |predicted loss change| first, no sign balancing."
    impl: ClassVar[str] = "llmtool.compress.zs_methods:AbsDeltaSVD"


@METHODS.config
@dataclass
class SigmaGlobalConfig(_Global):
    name: ClassVar[str] = "sigma-global"
    help: ClassVar[str] = "Ablation: smallest whitened singular value first, no gradients."
    impl: ClassVar[str] = "llmtool.compress.zs_methods:SigmaGlobalSVD"


@METHODS.config
@dataclass
class SVDLLMConfig(_Whitened):
    name: ClassVar[str] = "svd-llm"
    help: ClassVar[str] = "Whitened SVD at uniform ranks (SVD-LLM baseline)."
    impl: ClassVar[str] = "llmtool.compress.svd_llm:WhitenedSVD"


@METHODS.config
@dataclass
class SVDConfig(CompressConfig):
    name: ClassVar[str] = "svd"
    help: ClassVar[str] = "Plain truncated SVD at uniform ranks, no data (baseline)."
    impl: ClassVar[str] = "llmtool.compress.svd:PlainSVD"
    needs_data: ClassVar[bool] = False


@METHODS.config
@dataclass
class FWSVDConfig(_Gradient):
    name: ClassVar[str] = "fwsvd"
    help: ClassVar[str] = "Fisher-weighted SVD at uniform ranks (baseline)."
    impl: ClassVar[str] = "llmtool.compress.weighted_svd:FisherWeightedSVD"


@METHODS.config
@dataclass
class ASVDConfig(CompressConfig):
    name: ClassVar[str] = "asvd"
    help: ClassVar[str] = "Activation-aware SVD at uniform ranks (baseline)."
    impl: ClassVar[str] = "llmtool.compress.weighted_svd:ActivationAwareSVD"


def load_all() -> Registry:
    """The registry of every method's config."""
    return METHODS


def make_config(method: str, **kw) -> CompressConfig:
    """The validated config of ``method`` (an option the method does not have is refused)."""
    return METHODS.build(method, **kw)  # type: ignore[return-value]
