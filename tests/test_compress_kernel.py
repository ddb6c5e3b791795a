"""Low-rank matmul kernel: triton (interpreter on CPU) vs the torch reference, and the dispatcher."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the triton import in kernels.lowrank_matmul

import pytest  # noqa: E402
import torch  # noqa: E402

from llmtool.kernels import lowrank_matmul as lm  # noqa: E402


@pytest.mark.skipif(not lm.HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("shape,bias", [((5, 40, 7, 33), True), ((37, 64, 20, 48), False), ((2, 3, 17, 40, 3, 9), True)])
def test_triton_matches_reference(shape, bias):
    torch.manual_seed(0)
    *lead, k, r, n = shape
    x = torch.randn(*lead, k)
    a, b = torch.randn(r, k), torch.randn(n, r)
    bb = torch.randn(n) if bias else None
    ref = lm.lowrank_matmul_reference(x, a, b, bb)
    out = lm.lowrank_matmul_triton(x, a, b, bb, block_m=16, block_k=16, block_r=16, block_n=16)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_dispatcher_uses_reference_on_cpu():
    torch.manual_seed(1)
    x, a, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    assert torch.equal(lm.lowrank_matmul(x, a, b), (x @ a.T) @ b.T)


@pytest.mark.skipif(not lm.HAVE_TRITON, reason="triton not installed")
def test_triton_rejects_bad_shapes():
    with pytest.raises(ValueError):
        lm.lowrank_matmul_triton(torch.randn(2, 8), torch.randn(3, 7), torch.randn(5, 3))
