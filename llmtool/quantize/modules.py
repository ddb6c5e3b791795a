"""Runtime modules of a quantized (and rotated) model, shared by all quantize methods.

* :class:`QuantLinear` — a block Linear: optional online Hadamard on its input (down_proj), dynamic
  per-token activation quantization, and packed low-bit integer weights with per-channel scales
  (buffers ``weight_packed``/``weight_scale``/``weight_shape``, compressed-tensors naming). At 16 bits
  it holds a plain ``weight``. No float copy of the weights is kept: W4A4 on CUDA goes through the triton
  kernel :func:`kernels.w4a4_matmul.w4a4_matmul`; elsewhere the signed codes are cached as int8 (1 byte
  per weight, built on first use, never saved; ``cache_bytes()``) and widened per call: low-bit
  activations (A≤7) multiply their integer codes by them in float32 (the integer sum, exact), weight-only
  settings multiply the activations by the widened codes and scale the output columns
  (:func:`kernels.weight_only.weight_only_mm_codes`; scaling the weight first was 10-20 ms per decode call).
  With bfloat16 activations on the CPU -- and, opt-in (:attr:`QuantLinear.cpu_int4_bf16`,
  ``LLMTOOL_CPU_INT4=bf16``), float32 activations rounded to bfloat16 -- W4A16 uses torch's int4
  weight-only kernel (:func:`kernels.weight_only.int4_mm_cpu`; unit group scales, llmtool's per-channel
  scale on the output; then no int8 cache is built); on CUDA, torch's tinygemm kernel (``_weight_int4pack_mm``) for decode-sized batches and
  a transient bf16/fp16 dequantization + cuBLAS for larger ones (:data:`TINYGEMM_MAX_ROWS`). torch's integer GEMMs (``_int_mm``, ``_weight_int8pack_mm``) and the int4 kernel with
  float32 activations were measured 2–20x slower than this on an AVX2 CPU, so they are not used.
* :class:`LowRankTransition` — the ReSpinQuant residual basis change ``h ↦ h + (h Q) M Qᵀ``.
* :class:`DenseTransition` — ``h ↦ h T`` (exact; used while learning rotations).
* :func:`install_transitions` swaps a decoder layer's class for a subclass whose forward applies the
  transitions to the residual branches (``h_mid = h T_attn + Attn(norm h)``,
  ``h_out = h_mid T_ffn + FFN(norm h_mid)``), keeping all parameter names.
* :func:`enable_kv_quant` adds the ``kv-quant`` transform to the shared attention function
  (:mod:`llmtool.core.attention`): the online head-dim Hadamard on Q and K after RoPE, and K and V
  fake-quantized (asymmetric, groups of ≤128 along the head dim).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from llmtool.core.experts import LinearExperts
from llmtool.kernels._dispatch import use_triton
from llmtool.kernels.hadamard import hadamard_transform
from llmtool.kernels.intpack import pack, packed_width, unpack
from llmtool.kernels.quant import quantize_per_token
from llmtool.kernels.w4a4_matmul import w4a4_matmul
from llmtool.kernels.weight_only import int4_mm_cpu, int4_pack_cpu, weight_only_mm_codes
from llmtool.quantize.quantizers import dequantize_weight, fake_quant_act, fake_quant_act_ste, weight_zero

# rows up to which W4A16 on CUDA uses tinygemm. On an H200 (benchmarks/gpu_check.py, 4096-11008 wide layers)
# tinygemm ran 1.9x faster than the bf16 cuBLAS GEMM at 1 row, on par at 8, and took 0.02-0.06 ms at 16 rows,
# 0.3-0.8 ms at 256 and 2.4-6.3 ms at 2048, where dequantizing to bf16 + cuBLAS took 0.18-0.45 ms (256) and
# 0.26-0.65 ms (2048): the crossover lies between 16 and 256 rows
TINYGEMM_MAX_ROWS = 128


class QuantLinear(nn.Module):
    # float32 activations of W4A16 on the CPU: False = exact float32 product from the int8 codes; True = rounded
    # to bfloat16 through torch's int4 kernel (faster, 0.5 B/weight instead of the 1 B/weight int8 cache)
    cpu_int4_bf16: bool = os.environ.get("LLMTOOL_CPU_INT4", "exact").strip().lower() == "bf16"

    def __init__(self, in_features: int, out_features: int, w_bits: int = 16, a_bits: int = 16,
                 a_symmetric: bool = False, a_clip_ratio: float = 1.0, online_hadamard: bool = False,
                 dtype=torch.float32, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.w_bits, self.a_bits = w_bits, a_bits
        self.a_symmetric, self.a_clip_ratio = a_symmetric, a_clip_ratio
        self.online_hadamard = online_hadamard
        self.observer = None  # callable(x) seeing the (Hadamard-transformed) input, for GPTQ Hessians
        self._kernel_cache: dict = {}
        if w_bits >= 16:
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype))
        else:
            self.register_buffer("weight_packed", torch.zeros(out_features, packed_width(in_features, w_bits),
                                                              dtype=torch.uint8))
            self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float16))
            self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64))
        # a bias (Qwen2's q/k/v) stays in float32 and is added after the product
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> "QuantLinear":
        q = cls(linear.in_features, linear.out_features, w_bits=16, dtype=linear.weight.dtype,
                bias=linear.bias is not None, **kw)
        q.weight.copy_(linear.weight.detach())
        if linear.bias is not None:
            q.bias.copy_(linear.bias.detach().float())
        return q.to(linear.weight.device)

    def set_quantized(self, codes: torch.Tensor, scale: torch.Tensor, bits: int) -> None:
        """Replace the full-precision weight by packed ``bits``-bit codes and per-channel scales."""
        if hasattr(self, "weight"):
            del self.weight
        self.w_bits = bits
        dev = codes.device
        self.register_buffer("weight_packed", pack(codes.to(torch.uint8), bits))
        self.register_buffer("weight_scale", scale.to(torch.float16).reshape(-1, 1).to(dev))
        self.register_buffer("weight_shape", torch.tensor(list(codes.shape), dtype=torch.int64, device=dev))
        self._kernel_cache = {}

    def codes(self) -> torch.Tensor:
        return unpack(self.weight_packed, self.w_bits)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        if self.w_bits >= 16:
            return self.weight.to(dtype)
        return dequantize_weight(self.codes(), self.weight_scale.float(), self.w_bits, dtype)

    def _cached(self, key: str, build):
        """A kernel operand derived from the packed codes, rebuilt when the codes move or change."""
        entry = self._kernel_cache.get(key)
        packed = self.weight_packed
        if entry is None or entry[0] != (packed.device, packed.data_ptr()):
            entry = ((packed.device, packed.data_ptr()), build())
            self._kernel_cache[key] = entry
        return entry[1]

    def cache_bytes(self) -> int:
        """Bytes held by the kernel caches (packed int4/int8 operands)."""
        total = 0
        for _, value in self._kernel_cache.values():
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def _int8_codes(self) -> torch.Tensor:
        """Signed weights ``q = c − zero`` as int8 [out, in] (1 byte per weight)."""
        return self._cached("int8", lambda: (self.codes().to(torch.int16) - weight_zero(self.w_bits)).to(torch.int8))

    def _int4pack(self):
        """(packed weight, group size, unit scales_and_zeros) for torch's CPU int4 weight-only kernel
        (:func:`kernels.weight_only.int4_pack_cpu`), or None when the shape does not fit it."""
        if self.w_bits != 4 or self.weight_packed.is_cuda:
            return None
        return self._cached("int4pack", lambda: int4_pack_cpu(self.codes()))

    def _int4pack_cuda(self):
        """(packed weight, group size, scales_and_zeros) for torch's CUDA int4 weight-only kernel
        (``_weight_int4pack_mm``, the tinygemm kernel; bfloat16 activations), or None when the shape does
        not fit it (in_features a multiple of 32, out_features of 8). The kernel wants the even column in
        the high nibble (llmtool packs it low) and computes ``(c − 8) · scale + zero`` per group."""
        k, n = self.in_features, self.out_features
        group = next((g for g in (256, 128, 64, 32) if k % g == 0), None)
        tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
        if (self.w_bits != 4 or group is None or tiles is None or n % 8
                or not hasattr(torch.ops.aten, "_weight_int4pack_mm")):
            return None

        def build():
            p = self.weight_packed
            swapped = ((p & 0x0F) << 4) | (p >> 4)
            packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), tiles)
            scale = self.weight_scale.to(torch.bfloat16).reshape(1, -1).expand(k // group, -1)
            sz = torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous()
            return packed, group, sz
        return self._cached("int4pack_cuda", build)

    def _load_from_state_dict(self, *args, **kwargs):
        self._kernel_cache = {}
        return super()._load_from_state_dict(*args, **kwargs)

    def _low_bit_act_product(self, x2: torch.Tensor) -> torch.Tensor:
        xc, xs, xz = quantize_per_token(x2, self.a_bits, self.a_symmetric, self.a_clip_ratio)
        if self.w_bits == 4 and use_triton(xc, self.weight_packed):
            return w4a4_matmul(xc, xs, xz, self.weight_packed, self.weight_scale, weight_zero(4))
        # integer sums computed in float32 (exact: |partial sums| < 2^24 for A<=7, W<=8 at these widths) from
        # the int8 codes; the float operand is transient. torch._int_mm would be the integer GEMM, but on
        # AVX2 CPUs it is 2-20x slower than this (benchmarks/quantize_inference.py notes)
        acc = (xc.float() - xz) @ self._int8_codes().float().T
        return acc * xs.float() * self.weight_scale.float().reshape(1, -1)

    def _weight_only_product(self, x2: torch.Tensor) -> torch.Tensor:
        if not x2.is_cuda and self.w_bits == 4 and (x2.dtype == torch.bfloat16 or
                                                    (x2.dtype == torch.float32 and self.cpu_int4_bf16)):
            op = self._int4pack()
            if op is not None:      # torch's int4 weight-only CPU kernel (fast with bf16 activations)
                return int4_mm_cpu(x2, op, self.weight_scale)
        if x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16):
            op = self._int4pack_cuda() if self.w_bits == 4 and x2.dtype == torch.bfloat16 else None
            if op is not None and x2.shape[0] <= TINYGEMM_MAX_ROWS:     # torch's tinygemm int4 kernel
                packed, group, sz = op
                return torch.ops.aten._weight_int4pack_mm(x2.contiguous(), packed, group, sz)
            # larger batches: the weight dequantized transiently in the activation dtype, then cuBLAS
            w = (self.codes().to(torch.int16) - weight_zero(self.w_bits)).to(x2.dtype) * self.weight_scale.to(x2.dtype)
            return F.linear(x2, w)
        return weight_only_mm_codes(x2, self._int8_codes(), self.weight_scale)      # transient float codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.online_hadamard:
            x = hadamard_transform(x)
        if self.observer is not None:
            self.observer(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.w_bits >= 16:
            if self.a_bits < 16:
                x2 = fake_quant_act(x2, self.a_bits, self.a_symmetric, self.a_clip_ratio)
            y = F.linear(x2, self.weight.to(x2.dtype))
        elif self.a_bits <= 7:
            y = self._low_bit_act_product(x2)
        elif self.a_bits < 16:      # A8 is simulated (fake-quantized activations, dequantized weights)
            xq = fake_quant_act(x2, self.a_bits, self.a_symmetric, self.a_clip_ratio)
            y = F.linear(xq.float(), self.dequantized_weight(torch.float32))
        else:
            y = self._weight_only_product(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def to_dense_linear(self) -> nn.Linear:
        """An ``nn.Linear`` with the dequantized weight and the online Hadamard folded in
        (``F.linear(x Hm, W) = F.linear(x, W Hmᵀ)``); activation quantization is not representable and is
        listed by :meth:`dense_export_drops` (``llmtool models export``; core.export's protocol)."""
        ref = self.weight_scale if self.w_bits < 16 else self.weight
        w = self.dequantized_weight(torch.float64)
        if self.online_hadamard:
            eye = torch.eye(self.in_features, dtype=torch.float64, device=w.device)
            w = w @ hadamard_transform(eye).T
        dtype = ref.dtype if ref.is_floating_point() and ref.dtype != torch.float16 else torch.float32
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=dtype,
                        device=ref.device)
        with torch.no_grad():
            lin.weight.copy_(w.to(dtype))
            if self.bias is not None:
                lin.bias.copy_(self.bias.to(dtype))
        return lin

    def dense_export_drops(self) -> list[str]:
        return [f"activation quantization (A{self.a_bits})"] if self.a_bits < 16 else []

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, w_bits={self.w_bits}, a_bits={self.a_bits}, "
                f"online_hadamard={self.online_hadamard}")


class QuantExperts(LinearExperts):
    """The routed experts of an MoE block (Qwen3-MoE, Mixtral) as per-expert :class:`QuantLinear` pairs.

    transformers 5 keeps experts as 3-D tensors (``gate_up_proj [E, 2I, D]``: gate rows then up rows;
    ``down_proj [E, D, I]``) inside one module called as ``experts(hidden [T, D], top_k_index [T, k],
    top_k_weights [T, k])``; this module is called the same way and computes the same sum
    ``Σ_k w_k · down_e(act(gate_e(x)) · up_e(x))`` over the chosen experts, each expert's matrices being
    ordinary block Linears for the quantizers (RTN per expert; GPTQ Hessians from the tokens routed to it;
    online Hadamard on each down input when rotated). The router stays in float. The routed sum and the
    per-expert listing are :class:`llmtool.core.experts.LinearExperts`'s; only the Linears differ."""

    def __init__(self, n: int, hidden: int, inter: int, act_fn, online_hadamard: bool = False,
                 dtype=torch.float32, **quant):
        nn.Module.__init__(self)  # LinearExperts' own __init__ would build float Linears first
        self.num_experts, self.act_fn = n, act_fn
        self.gate_up = nn.ModuleList(QuantLinear(hidden, 2 * inter, dtype=dtype, **quant) for _ in range(n))
        self.down = nn.ModuleList(QuantLinear(inter, hidden, online_hadamard=online_hadamard, dtype=dtype, **quant)
                                  for _ in range(n))

    @classmethod
    def from_experts(cls, experts: nn.Module, gate_up: torch.Tensor, down: torch.Tensor, **kw) -> "QuantExperts":
        n, two_i, d = gate_up.shape
        q = cls(n, d, two_i // 2, experts.act_fn, dtype=gate_up.dtype, **kw)
        with torch.no_grad():
            for e in range(n):
                q.gate_up[e].weight.copy_(gate_up[e].detach())
                q.down[e].weight.copy_(down[e].detach())
        return q.to(gate_up.device)


def resident_bytes(model: nn.Module) -> int:
    """Bytes a (quantized) model holds in memory: its parameters and buffers, each storage counted once (tied
    weights), plus the kernel caches of its :class:`QuantLinear` modules (:meth:`QuantLinear.cache_bytes`)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total + sum(m.cache_bytes() for m in model.modules() if isinstance(m, QuantLinear))


class LowRankTransition(nn.Module):
    """``h ↦ h + (h Q) M Qᵀ`` with ``basis`` Q [D, r] (orthonormal columns) and ``core`` M [r, r]."""

    def __init__(self, hidden: int, rank: int, dtype=torch.float32):
        super().__init__()
        self.register_buffer("basis", torch.zeros(hidden, rank, dtype=dtype))
        self.register_buffer("core", torch.zeros(rank, rank, dtype=dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.basis.shape[1] == 0:
            return h
        q = self.basis.to(h.dtype)
        return h + ((h @ q) @ self.core.to(h.dtype)) @ q.T

    def dense(self) -> torch.Tensor:
        d = self.basis.shape[0]
        return torch.eye(d, dtype=self.basis.dtype) + self.basis @ self.core @ self.basis.T


class DenseTransition(nn.Module):
    """``h ↦ h T`` with ``T`` set from outside (``self.matrix``); identity when unset."""

    def __init__(self):
        super().__init__()
        self.matrix = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.matrix is None else h @ self.matrix.to(h.dtype)


class RotatedNorm(nn.Module):
    """A norm followed by an online D×D product: ``x ↦ norm(x) R`` (Gemma 2/3 under a rotating method; see
    :mod:`llmtool.quantize.rotations`). On a sandwich post-norm ``R`` is the rotation into the stream's basis;
    on a pre-norm (unit gain) it is ``Rᵀ diag(g) R``, the norm's own gain applied in the original basis.
    ``rotation`` is a buffer [D, D] (float32), or ``live``, a tensor set from outside while rotations are
    learned."""

    def __init__(self, norm: nn.Module, rotation: torch.Tensor):
        super().__init__()
        self.norm = norm
        self.register_buffer("rotation", rotation.detach().float().clone())
        self.live = None   # a differentiable rotation while learning (respinquant.training_view)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.live if self.live is not None else self.rotation
        return self.norm(x) @ r.to(x.dtype)


def _install_norm_matrices(layer: nn.Module, pairs) -> None:
    """Wrap each ``(path, matrix)`` norm of the block in :class:`RotatedNorm`, or update its matrix if wrapped."""
    from llmtool.core import arch

    for path, m in pairs:
        norm = layer.get_submodule(path)
        if isinstance(norm, RotatedNorm):
            norm.rotation.copy_(m.detach().float())
        else:
            arch.set_module(layer, path, RotatedNorm(norm, m))


def install_post_norm_rotations(layer: nn.Module, r_attn: torch.Tensor, r_mlp: torch.Tensor) -> None:
    """Wrap the block's attention / MLP output norms (sandwich norms) in :class:`RotatedNorm`."""
    from llmtool.core import arch

    spec = arch.arch_of_layer(layer)
    _install_norm_matrices(layer, ((spec.attn_out_norm, r_attn), (spec.mlp_out_norm, r_mlp)))


def install_pre_norm_matrices(layer: nn.Module, m_in: torch.Tensor, m_ff: torch.Tensor) -> None:
    """Wrap (or update) the block's two pre-norms (attention input, MLP input) in :class:`RotatedNorm` with the
    online matrices ``m_in`` / ``m_ff`` (sandwich-norm families under a rotation: the gain stays online)."""
    from llmtool.core import arch

    spec = arch.arch_of_layer(layer)
    _install_norm_matrices(layer, ((spec.input_norm, m_in), (spec.post_attention_norm, m_ff)))


def pre_norm_matrices(layer: nn.Module) -> tuple[RotatedNorm, RotatedNorm] | None:
    """The block's two pre-norm wrappers installed by :func:`install_pre_norm_matrices`, else None."""
    from llmtool.core import arch

    spec = arch.arch_of_layer(layer)
    mods = tuple(layer.get_submodule(p) for p in (spec.input_norm, spec.post_attention_norm))
    return mods if all(isinstance(m, RotatedNorm) for m in mods) else None


def _transition_forward(self, hidden_states, **kwargs):
    from llmtool.core import arch

    residual = self.attn_transition(hidden_states)
    h = arch.input_norm(self)(hidden_states)
    h, _ = arch.attention(self)(hidden_states=h, **kwargs)
    out_norm = arch.attn_out_norm(self)
    hidden_states = residual + (h if out_norm is None else out_norm(h))
    residual = self.mlp_transition(hidden_states)
    h = arch.mlp(self)(arch.post_attention_norm(self)(hidden_states))
    out_norm = arch.mlp_out_norm(self)
    return residual + (h if out_norm is None else out_norm(h))


_TRANSITION_CLASSES: dict[type, type] = {}


def install_transitions(layer: nn.Module, attn: nn.Module, mlp: nn.Module) -> None:
    """Give ``layer`` the residual transitions ``attn`` and ``mlp`` (swaps its class once)."""
    base = layer.__class__
    if base not in _TRANSITION_CLASSES.values():
        if base not in _TRANSITION_CLASSES:
            _TRANSITION_CLASSES[base] = type(f"Transition{base.__name__}", (base,), {"forward": _transition_forward})
        layer.__class__ = _TRANSITION_CLASSES[base]
    layer.attn_transition = attn
    layer.mlp_transition = mlp


def remove_transitions(layer: nn.Module) -> None:
    for base, sub in _TRANSITION_CLASSES.items():
        if layer.__class__ is sub:
            layer.__class__ = base
            del layer.attn_transition
            del layer.mlp_transition


def _group_fake_quant(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    shape = x.shape
    g = min(group, shape[-1])
    y = fake_quant_act_ste(x.reshape(*shape[:-1], shape[-1] // g, g), bits, symmetric=False)
    return y.reshape(shape)


def kv_quant_transform(module, query, key, value, attention_mask, **kwargs):
    """The KV-quantization transform of the shared attention function (``core.attention``): online
    head-dim Hadamard on Q and K (after RoPE), K and V fake-quantized in groups along the head dim."""
    bits = getattr(module, "kv_bits", 16)
    if bits < 16:
        query = hadamard_transform(query)
        key = _group_fake_quant(hadamard_transform(key), bits, getattr(module, "kv_group_size", 128))
        value = _group_fake_quant(value, bits, getattr(module, "kv_group_size", 128))
    return query, key, value, attention_mask


KV_ATTENTION = "kv-quant"  # the transform's name in core.attention


def enable_kv_quant(model: nn.Module, layers, bits: int, group_size: int = 128) -> None:
    """Quantize K (after RoPE and the online head-dim Hadamard) and V to ``bits`` bits: adds the
    ``kv-quant`` transform to the attention of ``layers`` (composes with other areas' transforms,
    e.g. a KV-cache method's eviction masks)."""
    from llmtool.core import arch
    from llmtool.core.attention import add_transform

    modules = [arch.attention(layer) for layer in layers]
    for m in modules:
        m.kv_bits = bits
        m.kv_group_size = group_size
    add_transform(model, KV_ATTENTION, kv_quant_transform, modules, order=0)


def disable_kv_quant(model: nn.Module) -> None:
    """Remove the ``kv-quant`` transform (the model's attention is as before :func:`enable_kv_quant`)."""
    from llmtool.core.attention import remove_transform

    remove_transform(model, KV_ATTENTION)
