"""A simulated accelerator for CPU CI: catches the device mix-ups that only fail on a GPU.

On a CUDA run, a tensor made by a factory without ``device=`` (``torch.eye(n)``, ``torch.zeros(...)``,
a CPU ``Generator`` draw, ``torch.from_numpy``) lives on the CPU, and combining it with the model's CUDA
weights raises. On a CPU-only machine nothing fails, so such bugs ship silently. :class:`DeviceSplit`
is a ``TorchFunctionMode`` that tags every tensor with where it would live on a GPU run:

* ``"accel"``: the model's parameters and buffers, the inputs given to :meth:`DeviceSplit.place`, any
  tensor moved with ``.to(t.device)`` / ``.to(t)`` where ``t`` is an accelerator tensor, ``.cuda()``,
  factories with ``device=t.device`` of an accelerator tensor (a ``torch.device`` of unknown origin
  counts as the accelerator), and every result of an op with an accelerator input;
* ``"cpu"``: factories without ``device=`` (or ``device="cpu"`` or the device of a CPU tensor),
  ``.cpu()``, ``.to("cpu")``, ``torch.from_numpy``, and results of ops whose inputs are all CPU.

An op that combines an ``accel`` tensor with a ``cpu`` tensor of one or more dimensions (CUDA accepts
only 0-dim CPU tensors there) is recorded as a mix-up with the llmtool source line that issued it.
Cross-device ``copy_``/``to`` and indexing with CPU index tensors are legal on CUDA and are not flagged.
"""
from __future__ import annotations

import os
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "llmtool"))
FACTORIES = {torch.eye, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.randn, torch.rand,
             torch.randint, torch.randperm, torch.tensor, torch.linspace, torch.as_tensor, torch.normal,
             torch.logspace, torch.tril_indices, torch.triu_indices}
LEGAL_MIXED = {"copy_", "to", "__getitem__", "__setitem__", "index_select", "index", "index_put_", "gather",
               "scatter_", "__get__", "__set__", "size", "dim", "numel", "item", "tolist", "__len__", "__repr__",
               "__format__", "data_ptr", "element_size", "is_floating_point", "new_empty", "new_zeros",
               "new_ones", "new_full", "new_tensor", "zeros_like", "ones_like", "empty_like", "full_like",
               "rand_like", "randn_like", "clone", "detach", "contiguous", "requires_grad_", "numpy", "__bool__",
               "__index__", "__int__", "__float__", "expand_as", "view_as", "reshape_as", "type_as"}


def _tag(t):
    # never-seen tensors (nn.Parameter wrappers, tensors made inside C++) count as accelerator tensors:
    # only tensors positively known to be CPU-born are checked, so the check has no false alarms
    return getattr(t, "_sim_device", "accel") if isinstance(t, torch.Tensor) else None


def _set(obj, tag):
    flat, _ = tree_flatten(obj)
    for t in flat:
        if isinstance(t, torch.Tensor):
            try:
                t._sim_device = tag
            except (AttributeError, RuntimeError):
                pass


class DeviceSplit(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.mixups: list[tuple[str, str]] = []
        self._device_tags: dict[int, str] = {}     # id(torch.device from t.device) -> t's tag
        self._keep: list = []                      # keeps those device objects alive (ids stay unique)

    def _device_tag(self, dev) -> str:
        if isinstance(dev, str):
            return "cpu" if dev.startswith("cpu") else "accel"
        return self._device_tags.get(id(dev), "accel")

    def place(self, *objs) -> None:
        """Mark modules (their parameters and buffers) and tensors as living on the accelerator."""
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                for t in list(obj.parameters()) + list(obj.buffers()):
                    t._sim_device = "accel"
            else:
                _set(obj, "accel")

    def _where(self) -> str:
        for fr in reversed(traceback.extract_stack()[:-2]):
            if fr.filename.startswith(ROOT):
                return f"{os.path.relpath(fr.filename, os.path.dirname(ROOT))}:{fr.lineno} ({fr.name})"
        return "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        out = func(*args, **kwargs)
        if isinstance(out, torch.device) and args and isinstance(args[0], torch.Tensor):   # t.device
            self._device_tags[id(out)] = _tag(args[0])
            self._keep.append(out)
            return out
        if func in FACTORIES or name == "from_numpy":
            dev = kwargs.get("device")
            _set(out, "cpu" if dev is None else self._device_tag(dev))
            return out
        if name in ("cpu", "to", "cuda") and args and out is args[0]:
            # on this CPU-only machine the move is a no-op returning the same object; on a GPU run it
            # returns another tensor, so give the result its own identity (a view) before tagging it
            out = out.view_as(out)
        if name == "cpu":
            _set(out, "cpu")
            return out
        if name in ("to", "cuda"):
            target = None
            if name == "cuda":
                target = "accel"
            for a in list(args[1:]) + list(kwargs.values()):
                if isinstance(a, torch.Tensor):
                    target = _tag(a)
                    break
                if isinstance(a, (torch.device, str)):
                    target = self._device_tag(a)
                    break
            src = _tag(args[0]) if args else None
            _set(out, target or src or "cpu")
            return out
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        tags = {_tag(t) for t in tensors}
        if "accel" in tags and name not in LEGAL_MIXED:
            bad = [t for t in tensors if _tag(t) == "cpu" and t.dim() > 0]
            if bad:
                self.mixups.append((name, self._where()))
        if tensors:
            _set(out, "accel" if "accel" in tags else "cpu")
        return out
