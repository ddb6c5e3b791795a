"""The method contract of ``llmtool evade attack``: one config dataclass per ``--method``.

:data:`ATTACK_METHODS` holds the options of each attack (models, bias schedule, ratios, decoding);
the command derives its ``--method`` choices and options from it and refuses an option the chosen
attack does not use (e.g. ``--delete-ratio`` with ``bira``, ``--paraphraser`` with ``word-delete``).
Each config's ``attack`` names its function in :data:`llmtool.evade.attacks.ATTACKS`; provenance is
``config.as_dict()``. Light module: no torch at import (the CLI imports it to build its options).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from llmtool.core.console import UsageError
from llmtool.core.registry import MethodConfig, Registry, option

ATTACK_METHODS: Registry = Registry("evade attack")


@dataclass
class SamplingOptions(MethodConfig):
    """Decoding of attacks that generate text."""

    temperature: float = option(0.7, "Sampling temperature.", min=1e-3)
    top_p: float = option(0.9, "Nucleus mass.", min=0.0, max=1.0)
    batch_size: int = option(16, "Sequences per generate call.", min=1)


@ATTACK_METHODS.config
@dataclass
class VanillaAttack(SamplingOptions):
    name: ClassVar[str] = "vanilla"
    help: ClassVar[str] = "Plain paraphrase (beta = 0, one pass)."
    attack: ClassVar[str] = "vanilla"
    paraphraser: str = option("smollm2-135m", "Rewriter LM (dir or alias).")


@ATTACK_METHODS.config
@dataclass
class ParaphraseAttack(VanillaAttack):
    name: ClassVar[str] = "paraphrase"
    help: ClassVar[str] = "Alias of vanilla."


@ATTACK_METHODS.config
@dataclass
class BiraAttack(VanillaAttack):
    name: ClassVar[str] = "bira"
    help: ClassVar[str] = "Biased paraphrase with adaptive bias relaxation (BIRA)."
    attack: ClassVar[str] = "bira"
    aux_model: Optional[str] = option(None, "Surprisal LM for the suppression set (default: the paraphraser).")
    beta0: Optional[float] = option(None, "Initial logit bias (<= 0); default: calibrated for this rewriter "
                                    "(once, then cached; see evade calibrate-beta).", max=0.0)
    calib_texts: int = option(50, "Austen texts for the beta0 calibration when --beta0 is not given.", min=1)
    beta_step: float = option(1.0, "Relaxation step eta.", min=0.0)
    max_iter: int = option(0, "Attempts (0 = ceil(|beta0|/eta)+1).", min=0)
    percentile: float = option(0.0, "Surprisal percentile q of the suppression set.", min=0.0, max=100.0)

    def validate(self) -> None:
        super().validate()
        if self.beta_step == 0 and self.max_iter != 1:
            raise UsageError("--beta-step 0 never relaxes the bias; give --max-iter 1 or a positive step")


@ATTACK_METHODS.config
@dataclass
class WordDeleteAttack(MethodConfig):
    name: ClassVar[str] = "word-delete"
    help: ClassVar[str] = "Delete a fraction of the words."
    attack: ClassVar[str] = "word-delete"
    delete_ratio: float = option(0.3, "Deletion ratio.", min=0.0, max=1.0)


@ATTACK_METHODS.config
@dataclass
class SynonymAttack(MethodConfig):
    name: ClassVar[str] = "synonym"
    help: ClassVar[str] = "Substitute words by embedding nearest neighbours."
    attack: ClassVar[str] = "synonym"
    paraphraser: str = option("smollm2-135m", "Rewriter LM (dir or alias).")
    synonym_ratio: float = option(0.5, "Substitution ratio.", min=0.0, max=1.0)


@ATTACK_METHODS.config
@dataclass
class EmojiAttack(SamplingOptions):
    name: ClassVar[str] = "emoji"
    help: ClassVar[str] = "Watermarked generator writes an emoji after every word; emojis stripped."
    attack: ClassVar[str] = "emoji"
    scheme: Optional[str] = option(None, "The watermark scheme to generate with (required).")
    generator: str = option("smollm2-135m", "Watermarked generator.")
    scheme_config: Optional[str] = option(None, "JSON object overriding scheme config fields.", flag="--config")
    max_new_tokens: int = option(150, "New tokens per text.", min=1)

    def validate(self) -> None:
        super().validate()
        if self.scheme is None:
            raise UsageError("--method emoji regenerates with the watermark: give --scheme")
        from llmtool.evade.watermarks import SCHEMES

        SCHEMES.get(self.scheme)
