"""von Mises–Fisher numerics on the unit sphere S^{d-1} (shared by GEM and its vMF baselines).

Implements, for the GEM spec (../specs/gem.md §3.1, §3.3 step 4, §6 "Bessel numerics"):

- ``log_iv(v, x)``: log I_v(x) through the exponentially scaled Bessel function (log ive + x) while it
  is representable, else the uniform (Debye) asymptotic expansion
  log I_v(v z) ≈ −½ log(2πv) + vη − ¼ log(1 + z²), η = √(1+z²) + log(z / (1 + √(1+z²))).
- ``log_cd(d, κ)``: the vMF normaliser log C_d(κ) = (d/2−1) log κ − (d/2) log 2π − log I_{d/2−1}(κ).
- ``a_d(d, κ)``: the mean resultant length A_d(κ) = I_{d/2}(κ) / I_{d/2−1}(κ) as a ratio of scaled
  Bessel values (never raw I_v), falling back to the Amos-type bound/continued-fraction-free
  asymptotic form when ive underflows.
- ``kappa_newton(d, R̄)``: exact inverse of A_d by Newton from the Banerjee start (spec §3.3 step 4).
- ``kappa_approx(d, R̄)``: the closed-form approximation κ ≈ (R̄d − R̄³)/(1 − R̄²) (Banerjee et al.
  2005), which the issue's corrections make GEM's default per-cluster κ.
"""
from __future__ import annotations

import numpy as np
from scipy import special


def _log_iv_debye(v: np.ndarray, x: np.ndarray) -> np.ndarray:
    z = x / v
    s = np.sqrt(1.0 + z * z)
    eta = s + np.log(z / (1.0 + s))
    return -0.5 * np.log(2 * np.pi * v) + v * eta - 0.5 * np.log(s)


def log_iv(v: float, x) -> np.ndarray:
    """log I_v(x) for v ≥ 0, x > 0 (vectorised over x)."""
    x = np.asarray(x, dtype=np.float64)
    v_arr = np.full_like(x, float(v))
    with np.errstate(divide="ignore", over="ignore", under="ignore", invalid="ignore"):
        scaled = special.ive(v_arr, x)
        direct = np.log(scaled) + x
    ok = np.isfinite(direct) & (scaled > 1e-300)
    if np.all(ok) or v == 0:
        return direct
    out = direct.copy()
    out[~ok] = _log_iv_debye(v_arr[~ok], x[~ok])
    return out


def log_cd(d: int, kappa) -> np.ndarray:
    """log C_d(κ), the log normaliser of the vMF density on S^{d-1}."""
    kappa = np.asarray(kappa, dtype=np.float64)
    nu = d / 2.0 - 1.0
    return nu * np.log(kappa) - (d / 2.0) * np.log(2 * np.pi) - log_iv(nu, kappa)


def a_d(d: int, kappa) -> np.ndarray:
    """A_d(κ) = I_{d/2}(κ) / I_{d/2−1}(κ) computed as exp(log I_{d/2} − log I_{d/2−1})."""
    kappa = np.asarray(kappa, dtype=np.float64)
    with np.errstate(divide="ignore", over="ignore", under="ignore", invalid="ignore"):
        num, den = special.ive(d / 2.0, kappa), special.ive(d / 2.0 - 1.0, kappa)
        ratio = num / den
    bad = ~np.isfinite(ratio) | (den < 1e-290) | (num < 1e-290)
    if np.any(bad):
        k = kappa[bad] if kappa.ndim else kappa
        ratio = np.array(ratio, dtype=np.float64)
        alt = np.exp(log_iv(d / 2.0, k) - log_iv(d / 2.0 - 1.0, k))
        if ratio.ndim:
            ratio[bad] = alt
        else:
            ratio = alt
    return ratio


def kappa_approx(d: int, rbar) -> np.ndarray:
    """κ ≈ (R̄ d − R̄³) / (1 − R̄²), R̄ clipped to [1e-6, 1 − 1e-9]."""
    r = np.clip(np.asarray(rbar, dtype=np.float64), 1e-6, 1 - 1e-9)
    return (r * d - r ** 3) / (1.0 - r * r)


def kappa_newton(d: int, rbar, steps: int = 20) -> np.ndarray:
    """Solve A_d(κ) = R̄ by Newton with A_d'(κ) = 1 − A² − (d−1)A/κ, from :func:`kappa_approx`."""
    r = np.clip(np.asarray(rbar, dtype=np.float64), 1e-6, 1 - 1e-9)
    k = kappa_approx(d, r)
    for _ in range(steps):
        a = a_d(d, k)
        deriv = 1.0 - a * a - (d - 1.0) * a / k
        step = (a - r) / np.where(np.abs(deriv) > 1e-300, deriv, 1e-300)
        new = np.maximum(k - step, k / 10.0)
        done = np.all(np.abs(new - k) <= 1e-10 * np.abs(k))
        k = new
        if done:
            break
    return k
