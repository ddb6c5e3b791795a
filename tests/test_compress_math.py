"""Math of the SVD family on synthetic matrices: whitening optimality, the first-order score,
zero-sum selection invariants and budget, the correction step, singular covariances."""
import math

import pytest
import torch

from llmtool.compress.factorize import ModuleSpec, split_factors, uniform_rank, whitened_svd
from llmtool.compress.whitening import identity_whitener, whitener_from_covariance
from llmtool.compress.zs_svd import pull_subspace_correction, saved_by_drop, select_components


def _xw(seed=0, n=24, m=16, tokens=400):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g, dtype=torch.float64)
    x = torch.randn(tokens, n, generator=g, dtype=torch.float64) @ mix  # correlated inputs
    w = torch.randn(m, n, generator=g, dtype=torch.float64)
    return x, w


def test_whitening_optimality_every_rank():
    x, w = _xw()
    cov = x.T @ x / x.shape[0]
    wh = whitener_from_covariance(cov, eps=1e-12)
    u, s, vh = whitened_svd(w, wh)
    u0, s0, vh0 = torch.linalg.svd(w)
    for k in range(0, min(w.shape) + 1):
        a, b = split_factors(u, s, vh, k, right=wh)
        err = ((w - b @ a) @ x.T).pow(2).sum() / x.shape[0]
        assert float(err) == pytest.approx(float(s[k:].pow(2).sum()), rel=1e-6, abs=1e-9)
        a0, b0 = split_factors(u0, s0, vh0, k)
        plain = ((w - b0 @ a0) @ x.T).pow(2).sum() / x.shape[0]
        assert float(err) <= float(plain) * (1 + 1e-9) + 1e-12


def test_first_order_score_matches_finite_difference():
    from llmtool.compress.zs_svd import predicted_loss_change, singular_value_gradients

    x, w = _xw(seed=1)
    target = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def loss(weight):
        return torch.log1p((x @ weight.T - target).pow(2)).mean()

    wv = w.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss(wv), wv)
    wh = whitener_from_covariance(x.T @ x / x.shape[0], eps=1e-4)
    u, s, vh = whitened_svd(w, wh)
    dl = predicted_loss_change(s, singular_value_gradients(u, vh, grad, wh))
    for i in [0, 3, 7, 15]:
        direction = s[i] * wh.unwhiten(u[:, i:i + 1] @ vh[i:i + 1])
        h = 1e-4
        fd = (loss(w - h * direction) - loss(w + h * direction)) / (2 * h)  # d/dt l(W - t sigma u v^T L^-1) at t=0
        assert float(dl[i]) == pytest.approx(float(fd), rel=1e-4, abs=1e-10)
    # the score must come from the whitened gradient: projecting G itself on (U, V) differs
    wrong = -s * ((u.T @ grad) * vh).sum(1)
    assert not torch.allclose(wrong, dl, rtol=1e-3)


def _random_pool(seed=0, count=12):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 16), (8, 16), (32, 16), (16, 32), (12, 20)]
    specs, sigmas, deltas = [], [], []
    for j in range(count):
        m, n = shapes[j % len(shapes)]
        spec = ModuleSpec(f"m{j}", m, n, has_bias=j % 4 == 0)
        sig = torch.rand(spec.full_rank, generator=g, dtype=torch.float64).sort(descending=True).values
        specs.append(spec)
        sigmas.append(sig)
        deltas.append(torch.randn(spec.full_rank, generator=g, dtype=torch.float64) * sig)
    return specs, sigmas, deltas


@pytest.mark.parametrize("ratio,keep", [(0.2, 0.0), (0.4, 0.0), (0.6, 0.3)])
def test_zero_sum_invariants_and_budget(ratio, keep):
    specs, sigmas, deltas = _random_pool()
    sel = select_components(specs, sigmas, deltas, ratio, keep_rank_ratio=keep, record=True)
    by_name = {s.name: s for s in specs}
    # tail-only removal: each module loses components full_rank-1, full_rank-2, ... (ascending sigma)
    seen = {}
    for name, idx, d, s, both in sel.trace:
        expected = seen.get(name, by_name[name].full_rank) - 1
        assert idx == expected
        seen[name] = idx
    # running sum bounded by the largest |dL| popped so far while both heaps are non-empty
    biggest = 0.0
    for name, idx, d, s, both in sel.trace:
        biggest = max(biggest, abs(d))
        if not both:
            break
        assert abs(s) <= biggest + 1e-12
    # rank floors
    for spec in specs:
        floor = max(1, math.ceil(keep * spec.break_even))
        assert sel.planned_rank[spec.name] >= floor
    # budget: reached, overshoot below one component or one break-even jump
    assert sel.removed >= sel.target_removed
    max_step = max(max(s.per_rank for s in specs),
                   max(s.out_features * s.in_features - s.break_even * s.per_rank for s in specs))
    assert sel.removed - sel.target_removed < max_step
    assert sel.target_removed == int(ratio * sum(s.dense_params for s in specs))
    # factorised + restored partition the modules; restored are above r*, factorised at or below
    assert set(sel.factorised) | set(sel.restored) == set(by_name)
    assert all(sel.factorised[n] <= by_name[n].break_even for n in sel.factorised)
    assert all(sel.planned_rank[n] > by_name[n].break_even for n in sel.restored)
    assert sel.removed == sum(s.dense_params - s.params_at_rank(sel.planned_rank[s.name]) for s in specs)
    assert sel.running_sum == pytest.approx(sel.predicted_factorised + sel.predicted_restored)


def test_zero_sum_keeps_total_nearer_zero_than_abs_delta():
    specs, sigmas, deltas = _random_pool(seed=3, count=20)
    zs = select_components(specs, sigmas, deltas, 0.4)
    ab = select_components(specs, sigmas, deltas, 0.4, rule="abs-delta")
    assert abs(zs.running_sum) < abs(ab.running_sum)


def test_break_even_accounting():
    spec = ModuleSpec("w", 16, 32)
    r_star = spec.break_even
    assert r_star == (16 * 32 - 1) // 48 and r_star * 48 < 16 * 32 <= (r_star + 1) * 48
    assert saved_by_drop(spec, r_star + 1) == 0
    assert saved_by_drop(spec, r_star) == 16 * 32 - r_star * 48
    assert saved_by_drop(spec, r_star - 1) == 48
    assert uniform_rank(spec, 0.0) == 16 and uniform_rank(spec, 0.5) == int(0.5 * 16 * 32 // 48)


@pytest.mark.parametrize("count", [1, 3])
def test_pull_subspace_correction_identity(count):
    g = torch.Generator().manual_seed(count)
    grads = [torch.randn(12, 9, generator=g, dtype=torch.float64) for _ in range(count)]
    residual = torch.randn(12, 9, generator=g, dtype=torch.float64)
    dw = pull_subspace_correction(grads, residual)
    for gi in grads:
        assert float((gi * dw).sum()) == pytest.approx(float((gi * residual).sum()), rel=1e-6)
    assert float(dw.norm()) <= float(residual.norm())
    if count == 1:
        gg = grads[0]
        expected = (gg * residual).sum() / ((gg * gg).sum() + 1e-6) * gg
        torch.testing.assert_close(dw, expected)


def test_singular_covariance_with_duplicated_channels():
    x, w = _xw(seed=2, n=16)
    x = torch.cat([x, x[:, :4]], dim=1)  # 4 duplicated input channels: exactly singular covariance
    w = torch.cat([w, torch.randn(w.shape[0], 4, dtype=torch.float64)], dim=1)
    cov = x.T @ x / x.shape[0]
    assert torch.linalg.matrix_rank(cov) < cov.shape[0]
    for eps in (1e-4, 1e-300):  # 1e-300: Cholesky of the singular matrix must fail or stay finite
        wh = whitener_from_covariance(cov, eps=eps)
        u, s, vh = whitened_svd(w, wh)
        a, b = split_factors(u, s, vh, 8, right=wh)
        assert torch.isfinite(a).all() and torch.isfinite(b).all() and torch.isfinite(s).all()
    # an indefinite "covariance" forces the eigen fallback (non-triangular L, general solves)
    bad = cov.clone()
    bad[0, 0] = -1.0
    bad[3, 5] = float("nan")
    wh = whitener_from_covariance(bad, eps=1e-4)
    assert not wh.triangular and torch.isfinite(wh.L).all()
    rows = torch.randn(5, bad.shape[0], dtype=torch.float64)
    torch.testing.assert_close(wh.unwhiten(rows) @ wh.L, rows)
    torch.testing.assert_close(wh.whiten_gradient(rows) @ wh.L.T, rows)


def test_identity_whitener_is_plain_svd():
    _, w = _xw(seed=4)
    u, s, vh = whitened_svd(w, identity_whitener(w.shape[1]))
    torch.testing.assert_close(s, torch.linalg.svdvals(w))


def test_whitener_overwrite_is_the_same_factor_and_only_then_reuses_the_input():
    x, _ = _xw(seed=5, n=12)
    cov = x.T @ x / x.shape[0]
    cov[0, 1] += 1e-9                        # not exactly symmetric, as an accumulated Gram need not be
    kept = cov.clone()
    plain = whitener_from_covariance(cov, eps=1e-4)
    assert torch.equal(cov, kept)           # the default never modifies its input
    inplace = whitener_from_covariance(cov, eps=1e-4, overwrite=True)
    torch.testing.assert_close(inplace.L, plain.L, rtol=1e-12, atol=1e-14)   # another LAPACK: equal to rounding
    assert plain.triangular and inplace.triangular
    assert inplace.L.data_ptr() == cov.data_ptr()   # overwrite on the CPU: the factor is built in cov's storage


def test_whitener_overwrite_falls_back_like_the_copying_path_when_not_positive_definite():
    x, _ = _xw(seed=6, n=10)
    cov = x.T @ x / x.shape[0]
    cov[2, 2] = -5.0                          # indefinite: Cholesky fails, the eigen fallback runs on the input
    plain = whitener_from_covariance(cov, eps=1e-4)
    inplace = whitener_from_covariance(cov.clone(), eps=1e-4, overwrite=True)
    assert not plain.triangular and not inplace.triangular
    torch.testing.assert_close(inplace.L @ inplace.L.T, plain.L @ plain.L.T, rtol=1e-10, atol=1e-12)


def test_source_whiteners_share_one_factor_per_input_and_match_per_module():
    from llmtool.compress.factorize import ModuleSpec
    from llmtool.compress.profile import LayerStatistics
    from llmtool.compress.streamed import source_whiteners

    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
             "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"]
    stats = LayerStatistics()
    stats.add("model.layers.0.self_attn.q_proj", torch.randn(40, 6, dtype=torch.float64))
    stats.add("model.layers.0.mlp.gate_proj", torch.randn(40, 6, dtype=torch.float64))
    stats.add("model.layers.0.mlp.down_proj", torch.randn(40, 9, dtype=torch.float64))
    expected = {n: whitener_from_covariance(stats.covariance(n), 1e-4).L for n in names}
    got = [(spec.name, wh, last) for spec, wh, last in
           source_whiteners(stats, [ModuleSpec(n, 4, 6) for n in names], 1e-4)]
    assert [n for n, _, _ in got] == names
    assert [last for _, _, last in got] == [False, True, True, True]   # k is q/k's last; gate and down alone
    got = [(n, wh) for n, wh, _ in got]
    for n, wh in got:
        torch.testing.assert_close(wh.L, expected[n], rtol=1e-12, atol=1e-14)
    assert got[0][1] is got[1][1]            # q and k read one input: one whitener
    assert stats.gram == {}                  # every Gram is consumed
