"""Method contract of `llmtool edit`: one config dataclass per locate-then-edit method (``memit``,
``alphaedit``), registered in :data:`METHODS`; the command's ``--method`` choices and options are
derived from it and an option a method does not have is refused (e.g. ``--mom2-weight`` for
AlphaEdit, whose solve has no λC term; ``--nullspace-threshold`` for MEMIT).

Torch-free (the CLI reads it for ``--help``). :meth:`EditMethodConfig.edit_config` turns a config into
the runtime :class:`llmtool.edit.memit.EditConfig` (layers and λ from the model's preset unless given).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from llmtool.core.registry import MethodConfig, Registry, option

ANCHORS = ("backward", "forward")
METHODS = Registry("edit")


@dataclass
class EditMethodConfig(MethodConfig):
    """Targets (anchor and the z optimisation) and key statistics, shared by every method."""

    anchor: str = option("backward", "backward (MEMIT spreading) or forward (FE replay).", choices=ANCHORS)
    v_lr: float = option(0.1, "Adam lr of the target optimisation.", min=0.0)
    v_steps: int = option(25, "Gradient steps of the target optimisation.", min=1)
    clamp_norm: float = option(0.75, "‖δ‖ ≤ clamp·‖h‖.", min=0.0)
    kl_factor: float = option(0.0625, "Weight of the KL term keeping the subject's meaning.", min=0.0)
    v_weight_decay: float = option(0.5, "Weight decay on δ.", min=0.0)
    mom2_samples: int = option(20000, "Token positions for the key statistics.", min=1)
    z_batch: int = option(8, "Requests whose targets are optimised together (speed and memory only).", min=1)

    def lambda_weight(self, preset_value: float) -> float:
        return preset_value

    def edit_config(self, layers: list[int], preset_lambda: float, batch_size: int = 0):
        from llmtool.edit.anchors import ZConfig
        from llmtool.edit.memit import EditConfig

        return EditConfig(layers=list(layers), method=self.name, anchor=self.anchor,
                          z=ZConfig(v_lr=self.v_lr, v_num_grad_steps=self.v_steps, clamp_norm_factor=self.clamp_norm,
                                    kl_factor=self.kl_factor, v_weight_decay=self.v_weight_decay),
                          mom2_update_weight=self.lambda_weight(preset_lambda), l2=self.l2,
                          nullspace_threshold=getattr(self, "nullspace_threshold", 0.02),
                          batch_size=batch_size, z_batch=self.z_batch)


@METHODS.config
@dataclass
class MemitConfig(EditMethodConfig):
    name: ClassVar[str] = "memit"
    help: ClassVar[str] = "MEMIT least-squares update of mlp.down_proj over the edited layers."
    mom2_weight: Optional[float] = option(None, "λ on the mean key second moment (default: the model's preset, "
                                          "1500 for SmolLM2-135M; 15000 in the papers).", min=0.0)
    l2: float = option(0.0, "μ: ridge on the update.", min=0.0)

    def lambda_weight(self, preset_value: float) -> float:
        return preset_value if self.mom2_weight is None else self.mom2_weight


@METHODS.config
@dataclass
class AlphaEditConfig(EditMethodConfig):
    name: ClassVar[str] = "alphaedit"
    help: ClassVar[str] = "AlphaEdit: the update projected onto the null space of the preserved keys."
    l2: float = option(10.0, "α: ridge on the projected update.", min=0.0)
    nullspace_threshold: float = option(0.02, "Singular values of C below this span the null space.", min=0.0)
