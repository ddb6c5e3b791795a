"""Device placement of every compress and quantize method, checked on CPU CI (issue 18): each method runs
on a tiny model under the simulated accelerator of tests/device_split.py, which records every op that
would combine a GPU tensor with a CPU-born one on a CUDA run (the failures `--device cuda` used to hit:
whitening's regulariser built on the CPU, the GPTQ Hessian copied to the CPU, CPU gradients against
GPU weights)."""
import pytest
import torch
from conftest import build_tiny_llama
from device_split import DeviceSplit

from llmtool.compress.methods import METHODS as COMPRESS
from llmtool.compress.pipeline import compress_model
from llmtool.quantize.api import quantize_
from llmtool.quantize.configs import METHODS as QUANTIZE
from llmtool.quantize.runner import make_config


@pytest.fixture(autouse=True)
def _fresh_kernel_caches():
    # tensors cached by an earlier test outside the simulator carry no tag and would count as accelerator
    # tensors here (a false alarm that depended on the test order)
    from llmtool.kernels import hadamard

    hadamard._small_factor.cache_clear()
    yield


def _ids(n, seed):
    return torch.randint(0, 128, (n, 32), generator=torch.Generator().manual_seed(seed))


def test_the_simulator_flags_cpu_born_tensors_and_accepts_device_aware_code():
    w = torch.randn(4, 4)
    with DeviceSplit() as d:
        d.place(w)
        _ = w @ torch.eye(4, dtype=w.dtype, device=w.device)             # fine on a GPU
        _ = w @ torch.eye(4).to(w.device)                                   # fine
        _ = w + torch.tensor(2.0)                                           # 0-dim CPU tensors are fine
        _ = w[torch.tensor([0, 1])]                                         # CPU indices are fine
        assert d.mixups == []
        _ = w @ torch.eye(4)                                                # fails on a GPU
        _ = w * w.cpu().sum(1, keepdim=True)                                # fails on a GPU
        g = torch.ones(4, 4).cpu()
        _ = torch.linalg.solve_triangular(torch.eye(4, device=w.device), g, upper=False)
    assert [name for name, _ in d.mixups] == ["matmul", "mul", "linalg_solve_triangular"]
    assert all("test_device_split" not in where for _, where in d.mixups)


CASES = [(name, {}) for name in COMPRESS.names()] + [
    ("zs-svd", {"correction": "pull-subspace"}), ("svd-llm", {"correction": "pull-subspace"}),
    ("fwsvd", {"grad_samples": 2})]


@pytest.mark.parametrize("name, kw", CASES, ids=[f"{n}{'-' + '-'.join(k) if k else ''}" for n, k in CASES])
def test_compress_methods_keep_tensors_on_the_weights_device(name, kw):
    model = build_tiny_llama(128)
    calib, grad = _ids(4, 0), _ids(2, 1)
    cfg = COMPRESS.get_config(name)(ratio=0.3, batch_size=2, **kw)
    with DeviceSplit() as d:
        d.place(model, calib, grad)
        compress_model(model, cfg, calib, grad)
        model(input_ids=calib)
    assert d.mixups == [], sorted(set(d.mixups))


@pytest.mark.parametrize("name", QUANTIZE.names())
def test_quantize_methods_keep_tensors_on_the_weights_device(name):
    model = build_tiny_llama(128)
    calib = _ids(2, 2)
    with DeviceSplit() as d:
        d.place(model, calib)
        quantize_(model, make_config(name), calib)
        model(input_ids=calib)
    assert d.mixups == [], sorted(set(d.mixups))
