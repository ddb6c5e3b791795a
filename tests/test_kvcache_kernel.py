"""kv_quant triton kernels vs their torch references under TRITON_INTERPRET=1 (tiny sizes)."""
from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import llmtool.kernels.kv_quant  # noqa: E402

kvq = importlib.reload(llmtool.kernels.kv_quant)  # re-decorate the kernels in interpreter mode


@pytest.mark.skipif(not kvq.HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_triton_pack_unpack_match_reference(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 32, generator=g) * 3
    scale, mn = kvq.group_stats(x, bits)
    ref = kvq.pack_reference(x, scale, mn, bits)
    tri = kvq.pack_triton(x, scale, mn, bits)
    assert torch.equal(ref, tri)
    assert torch.equal(kvq.unpack_reference(ref, scale, mn, bits), kvq.unpack_triton(ref, scale, mn, bits))
