"""`llmtool quantize`: ReSpinQuant with its baselines (QuaRot, SpinQuant, RTN), packed int storage.

``quantize_(model, config, calib)`` with one config dataclass per method:
:class:`RTNConfig`, :class:`QuaRotConfig`, :class:`SpinQuantConfig`, :class:`ReSpinQuantConfig`.
Names are imported lazily so that mounting the CLI does not import torch.
"""
_EXPORTS = {
    "METHODS": "llmtool.quantize.api", "QuantConfig": "llmtool.quantize.api", "quantize_": "llmtool.quantize.api",
    "QuaRotConfig": "llmtool.quantize.quarot", "RTNConfig": "llmtool.quantize.rtn",
    "ReSpinQuantConfig": "llmtool.quantize.respinquant", "SpinQuantConfig": "llmtool.quantize.respinquant",
}


def register_all():
    """Import every method module so that METHODS lists them all."""
    import importlib

    for mod in ("rtn", "quarot", "respinquant"):
        importlib.import_module(f"llmtool.quantize.{mod}")
    from llmtool.quantize.api import METHODS

    return METHODS


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        register_all()
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
