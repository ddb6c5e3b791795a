"""`llmtool quantize`: ReSpinQuant with its baselines (QuaRot, SpinQuant, RTN), packed int storage.

``quantize_(model, config, calib)`` with one config dataclass per method (:mod:`.configs`):
:class:`RTNConfig`, :class:`QuaRotConfig`, :class:`SpinQuantConfig`, :class:`ReSpinQuantConfig`.
Names are imported lazily so that mounting the CLI does not import torch.
"""
_EXPORTS = {
    "METHODS": "llmtool.quantize.configs", "QuantConfig": "llmtool.quantize.configs",
    "QuaRotConfig": "llmtool.quantize.configs", "RTNConfig": "llmtool.quantize.configs",
    "ReSpinQuantConfig": "llmtool.quantize.configs", "SpinQuantConfig": "llmtool.quantize.configs",
    "quantize_": "llmtool.quantize.api",
}


def register_all():
    """The registry of every method's config (kept for callers of the old name)."""
    from llmtool.quantize.configs import METHODS

    return METHODS


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
