"""The choice-valued options of `train grpo` (surrogate and aggregation), torch-free so the command checks
them in its preflight, before torch is imported (a bad value used to be refused only after the imports)."""
from __future__ import annotations

from llmtool.core.console import UsageError

LOSS_TYPES = ("clip", "ratio", "pi")
LOSS_AGGS = ("seq-mean", "token-mean", "seq-sum-norm")


def check_loss_choices(loss_type: str, loss_agg: str) -> None:
    """One `error:` line for an unknown ``--loss`` or ``--loss-agg`` value."""
    if loss_type not in LOSS_TYPES:
        raise UsageError(f"--loss {loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
    if loss_agg not in LOSS_AGGS:
        raise UsageError(f"--loss-agg {loss_agg!r}: choose one of {', '.join(LOSS_AGGS)}")
