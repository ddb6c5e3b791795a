"""In-place LAPACK of the layer-streamed compression: each call equals its torch.linalg reference and
writes into its input's storage."""
import pytest
import torch

from llmtool.compress import lapack_inplace as li
from llmtool.compress.factorize import canonical_signs, whitened_svd
from llmtool.compress.whitening import Whitener


def _spd(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n, generator=g, dtype=dtype)
    return x.T @ x / x.shape[0]


@pytest.mark.parametrize("block", [3, 7, 256])
def test_symmetrize_by_blocks_is_bitwise_the_whole_matrix_average(block):
    c = torch.randn(17, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = (c + c.T) * 0.5
    assert torch.equal(li.symmetrize_(c, block=block), ref)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_cholesky_in_place_equals_torch_and_restores_its_input_on_failure(dtype, tol):
    c = _spd(23, 1, dtype)
    ref = torch.linalg.cholesky(c)
    work = c.clone()
    ptr = work.data_ptr()
    assert li.cholesky_lower_(work)
    assert work.data_ptr() == ptr
    torch.testing.assert_close(work, ref, rtol=tol, atol=tol)
    bad = li.symmetrize_(c.clone())        # as the whitener calls it: the restore mirrors the upper triangle
    bad[5, 5] = -1.0
    work = bad.clone()
    assert not li.cholesky_lower_(work)
    assert torch.equal(work, bad)


@pytest.mark.parametrize("shape", [(9, 20), (20, 9), (12, 12)])
def test_svd_in_place_and_right_solve_equal_torch(shape):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(*shape, generator=g, dtype=torch.float64)
    u0, s0, vh0 = torch.linalg.svd(a, full_matrices=False)
    work = a.clone()
    u, s, vh = li.svd_(work)
    torch.testing.assert_close(s, s0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close((u * s) @ vh, a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(u.T @ u, torch.eye(u.shape[1], dtype=u.dtype), rtol=0, atol=1e-12)
    L = torch.linalg.cholesky(_spd(shape[1], 3))
    ref = torch.linalg.solve_triangular(L, vh, upper=False, left=False)
    ptr = vh.data_ptr()
    q = li.solve_right_lower_(vh, L)
    assert q.data_ptr() == ptr
    torch.testing.assert_close(q, ref, rtol=1e-10, atol=1e-12)


def test_low_memory_whitened_svd_gives_the_same_signed_factors():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(30, 14, generator=g)
    wh = Whitener(torch.linalg.cholesky(_spd(14, 5)), True)
    u0, s0, vh0 = whitened_svd(w, wh)
    u1, s1, vh1 = whitened_svd(w, wh, low_memory=True)
    torch.testing.assert_close(s1, s0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(u1, u0, rtol=1e-9, atol=1e-11)      # same signs: canonical in both paths
    torch.testing.assert_close(vh1, vh0, rtol=1e-9, atol=1e-11)


def test_canonical_signs_make_the_largest_entry_of_each_left_vector_positive():
    u = torch.tensor([[0.1, -0.9], [-0.8, 0.2]], dtype=torch.float64)
    vh = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    u2, vh2 = canonical_signs(u.clone(), vh.clone())
    assert torch.equal(u2, torch.tensor([[-0.1, 0.9], [0.8, -0.2]], dtype=torch.float64))
    assert torch.equal(vh2, -vh)
    assert torch.equal(u2 @ vh2, u @ vh)


@pytest.mark.parametrize("shape", [(300, 40), (40, 300)])
def test_chunked_singular_value_scores_equal_the_whole_product(shape, monkeypatch):
    from llmtool.compress import zs_svd

    monkeypatch.setattr(zs_svd, "SCORE_CHUNK", 7)
    g = torch.Generator().manual_seed(7)
    m, n = shape
    k = min(m, n)
    u = torch.randn(m, k, generator=g)
    qt = torch.randn(k, n, generator=g)
    grad = torch.randn(m, n, generator=g)
    ref = ((u.double().T @ grad.double()) * qt.double()).sum(1)
    got = zs_svd.singular_value_scores(u, qt, grad)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_storage_on_disk_frees_the_memory_inside_and_restores_every_view(tmp_path):
    from llmtool.compress.factorize import storage_on_disk

    t = _spd(31, 8)
    assert li.cholesky_lower_(t)                 # LAPACK through raw views keeps the storage resizable
    ref = t.clone()
    row = t[4]
    with storage_on_disk(t, tmp_path):
        assert t.untyped_storage().nbytes() == 0      # (the file is anonymous: unlinked from the start)
    assert torch.equal(t, ref) and torch.equal(row, ref[4])
    assert list(tmp_path.iterdir()) == []
    shared = torch.from_numpy(_spd(5, 9).numpy())   # numpy-owned memory: left alone, not an error
    with storage_on_disk(shared, tmp_path):
        assert shared.untyped_storage().nbytes() == 5 * 5 * 8


def test_layer_statistics_spilled_to_disk_equal_the_one_pass_statistics(tiny_llama_dir, tmp_path):
    from llmtool.compress.profile import layer_statistics
    from llmtool.core.models import load_model

    model = load_model(tiny_llama_dir, dtype="float64")
    ids = torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    plain = list(layer_statistics(model, ids, batch_size=1))
    spilled = list(layer_statistics(model, ids, batch_size=1, chunk_rows=5, spill_dir=tmp_path))
    for a, b in zip(plain, spilled):
        assert b.gram == {} and set(b.spilled) == set(a.gram) and b.count == a.count
        for source, (path, shape, dtype) in b.spilled.items():
            torch.testing.assert_close(li.read_raw(path, shape, dtype), a.gram[source], rtol=1e-12, atol=1e-12)
    assert list(tmp_path.iterdir()) == []


def test_blocked_canonical_signs_equal_the_whole_matrix_rule(monkeypatch):
    """Columns compared in blocks (wider than one block here) give the signs of the whole-|U| argmax rule."""
    import llmtool.compress.factorize as fz

    monkeypatch.setattr(fz, "SIGN_BLOCK", 7)
    g = torch.Generator().manual_seed(6)
    u = torch.randn(40, 30, generator=g, dtype=torch.float64)
    vh = torch.randn(30, 11, generator=g, dtype=torch.float64)
    ref_sign = torch.sign(u[u.abs().argmax(0), torch.arange(30)])
    u1, vh1 = canonical_signs(u.clone(), vh.clone())
    assert torch.equal(u1, u * ref_sign[None, :]) and torch.equal(vh1, vh * ref_sign[:, None])
    assert (u1[u1.abs().argmax(0), torch.arange(30)] > 0).all()


def test_whitened_basis_releasing_the_whitener_frees_its_factor_and_changes_nothing_else():
    from llmtool.compress.factorize import whitened_basis

    g = torch.Generator().manual_seed(7)
    w = torch.randn(12, 20, generator=g)
    L = torch.linalg.cholesky(_spd(20, 8))
    ref = torch.linalg.solve_triangular(L, torch.linalg.svd(w.double() @ L, full_matrices=False)[2],
                                        upper=False, left=False)
    kept = Whitener(L.clone(), True)
    u0, s0, qt0 = whitened_basis(w, kept, low_memory=True)
    assert torch.equal(kept.L, L)                                  # not released: still usable
    released = Whitener(L.clone(), True)
    u1, s1, qt1 = whitened_basis(w, released, low_memory=True, release_whitener=True)
    assert released.L.untyped_storage().nbytes() == 0              # the [n, n] factor's memory is gone
    assert torch.equal(u1, u0) and torch.equal(s1, s0) and torch.equal(qt1, qt0)
    torch.testing.assert_close(qt0.abs(), ref.abs(), rtol=1e-9, atol=1e-11)   # Q^T = V^T L^{-1} up to signs
