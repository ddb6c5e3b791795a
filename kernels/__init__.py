"""llmtool's shared kernels (installed as ``llmtool.kernels``; see the module docstrings)."""
if __name__ != "llmtool.kernels":  # pragma: no cover - only when a checkout's root is on sys.path
    # This folder was found as a top-level ``kernels`` (e.g. ``python -m pytest`` from the checkout root puts
    # the root on sys.path): hand the name over to the installed Hugging Face ``kernels`` package, which
    # transformers imports, or fail as if this folder were not there.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _path)
    if _spec is None or _spec.loader is None:
        del _sys.modules[__name__]
        raise ModuleNotFoundError(f"No module named {__name__!r}", name=__name__)
    _mod = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _mod
    _spec.loader.exec_module(_mod)
