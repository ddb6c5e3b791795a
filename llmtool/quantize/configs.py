"""Method contract of `llmtool quantize`: the shared quantizer settings (:class:`QuantConfig`), one config
dataclass per method, and the registry the CLI is derived from.

This module imports neither torch nor transformers (the CLI reads it to build ``--help``); each
config's :meth:`QuantConfig.rotate` imports its method's implementation when it runs:
``rtn`` (no rotation), ``quarot`` (:mod:`.quarot`), ``spinquant`` / ``respinquant`` (:mod:`.respinquant`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmtool.core.registry import MethodConfig, Registry, option

VALID_BITS = (3, 4, 8, 16)
VALID_KV_BITS = (4, 8, 16)

# name -> QuantConfig subclass
METHODS: Registry = Registry("quantize")


@dataclass
class QuantConfig(MethodConfig):
    """Quantizer settings shared by every method; a method subclasses it, sets ``name``/``help``, adds its
    own fields and implements :meth:`rotate`."""

    w_bits: int = option(4, "Weight bits.", choices=VALID_BITS)
    a_bits: int = option(4, "Activation bits (per token, dynamic).", choices=VALID_BITS)
    kv_bits: int = option(16, "KV-cache bits.", choices=VALID_KV_BITS)
    weight_algorithm: str = option("gptq", "Weight quantizer: gptq or rtn.", choices=("gptq", "rtn"))
    w_clip: bool = option(True, "Per-channel clip-ratio search for weights.")
    a_symmetric: bool = option(False, "Symmetric activations (off: asymmetric).", flag="--a-sym")
    a_clip_ratio: float = option(1.0, "Activation clip ratio in (0, 1].", min=0.0, exclusive_min=True, max=1.0)
    kv_group_size: int = option(128, "Group size of K/V quantization along the head dim.", min=1, cli=False)
    gptq_damp: float = option(0.01, "GPTQ dampening (fraction of the mean Hessian diagonal).", min=0.0, cli=False)
    gptq_block_size: int = option(128, "GPTQ lazy-update block size.", min=1, cli=False)
    seed: int = option(0, "Seed of random rotations and training order (the global --seed).", cli=False)

    @property
    def method(self) -> str:
        return self.name

    def rotate(self, model, calib):
        """Rotate ``model`` in place; returns ``(RotationSet | None, report dict)``."""
        raise NotImplementedError


@METHODS.config
@dataclass
class RTNConfig(QuantConfig):
    name: ClassVar[str] = "rtn"
    help: ClassVar[str] = "Round-to-nearest weights, no rotation (baseline)."
    weight_algorithm: str = option("rtn", "Weight quantizer: gptq or rtn.", choices=("gptq", "rtn"))

    def rotate(self, model, calib):
        return None, {}


@METHODS.config
@dataclass
class QuaRotConfig(QuantConfig):
    name: ClassVar[str] = "quarot"
    help: ClassVar[str] = "Random Hadamard rotations, no training (baseline)."
    # QuaRot's own activation quantizer (its reference runs): symmetric, clip ratio 0.9 (SpinQuant's
    # asymmetric, unclipped quantizer is the shared default of the other methods).
    a_symmetric: bool = option(True, "Symmetric activations (off: asymmetric).", flag="--a-sym")
    a_clip_ratio: float = option(0.9, "Activation clip ratio in (0, 1].", min=0.0, exclusive_min=True, max=1.0)

    def rotate(self, model, calib):
        from llmtool.quantize.quarot import rotate

        return rotate(model, self, calib)


@dataclass
class RotationTrainingConfig(QuantConfig):
    """Settings of Cayley-SGD rotation learning (SpinQuant and ReSpinQuant)."""

    tied: ClassVar[bool] = False
    train_steps: int = option(16, "Cayley SGD steps of rotation learning.", min=0)
    train_batch: int = option(1, "Sequences per rotation-training step.", min=1, cli=False)
    train_seqlen: int = option(256, "Tokens per rotation-training sequence.", min=2)
    lr: float = option(1.5, "Cayley SGD learning rate (cosine schedule).", min=0.0, exclusive_min=True)

    def rotate(self, model, calib):
        from llmtool.quantize.respinquant import rotate

        return rotate(model, self, calib, tied=self.tied)


@METHODS.config
@dataclass
class ReSpinQuantConfig(RotationTrainingConfig):
    name: ClassVar[str] = "respinquant"
    help: ClassVar[str] = "Layer-wise learned rotations with low-rank residual transitions."
    rank: int = option(32, "Residual-transition rank r (0 drops them; the hidden size keeps them exactly).", min=0)


@METHODS.config
@dataclass
class SpinQuantConfig(RotationTrainingConfig):
    name: ClassVar[str] = "spinquant"
    help: ClassVar[str] = "One learned global rotation shared by every layer (baseline)."
    tied: ClassVar[bool] = True


def methods() -> Registry:
    return METHODS
