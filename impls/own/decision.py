"""The per-system decision shared by our own implementations: norm, keep/scale/NaN, factor.

Every own implementation reduces each system to a few accumulated numbers (by its own, fast,
per-element pass) and then makes the same per-system decisions. Those decisions are the
delicate part of SPEC rules 3-5, so they are written once here, vectorised over systems in an
array namespace ``xp`` that is either ``numpy`` (the numba implementation, on the host) or
``jax.numpy`` (inside the JAX implementation's jitted graph, under a scoped x64).

What a pass hands over, per system k (arrays of shape ``(S,)``):

* ``s_hi + s_lo``: a power sum ``S'`` of scaled magnitudes, ``S' = sum (|x| / scale)**p``, with
  a rigorous relative error bound ``rel_err`` (``|S' - S_hat| <= rel_err * S_hat``). For
  max-step it is the largest vector's sum of squares (``p = 2``).
* ``scale``: a positive float (a power of two, or the system's max |x|) so that
  ``norm = scale * S' ** (1/p)``; for ``p = +-inf`` the norm is ``scale`` itself (max or min |x|).
* ``zero``: the exact norm is 0 (no elements, or all of them zero);
* ``nan``/``inf``: the system holds a NaN / an infinity (``nonfinite="propagate"`` only).

``finalize`` turns these into the reported norm, an action (keep bitwise, scale, fill with NaN)
and the factor ``s = s_m * 2**s_e`` (``s_m`` in [0.5, 1), or 0 when the threshold is 0):

1. the p-th root is taken in double-double (a Newton step on a double-double power), so the
   norm is known to ``eps = rel_err/p + ~2**-80`` relative;
2. the threshold is compared with an interval ``[n(1-eps), n(1+eps)]`` (in a scaled domain, so
   nothing overflows or underflows): below it the system is kept, above it clipped; a threshold
   inside it is a *near-tie* and is flagged for ``exact_compare`` (exact integer or interval
   arithmetic on the system's elements, on the host). Near-ties need the system within ~1e-9
   (relative) of its threshold, which random data never is, so the fallback costs nothing in
   practice, and the no-op at ``norm <= max`` is decided exactly (rule 3);
3. ``s`` is the largest float with ``s * n_up <= c`` for an upper bound ``n_up`` of the norm;
   each element is then rounded toward zero (by the caller), so the output norm is at most
   ``s * n <= c`` exactly (rule 4). With ``precise=False`` (no float64 leaf) ``s`` is also cut
   to 29 significant bits: then ``x * s`` is exact in float64 for every float32/bfloat16/
   float16 ``x``, and one rounding toward zero into the leaf dtype is the exact RTZ result; the
   cut costs at most 2**-28 relative, far inside the 4u (u = 2**-24) that rule 4 allows.

The double-double pieces live in :mod:`clipbench.impls.own.double_double`, the exact
near-tie comparisons in :mod:`clipbench.impls.own.exact`, the argument checks in
:mod:`clipbench.impls.own.validation`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from clipbench.impls.own.double_double import (DD_POW_REL_ERR, dd_int_power, dd_pow,
                                               fast_two_sum, frexp, pow2, two_prod, two_sum)

KEEP, SCALE, NAN_FILL = 0, 1, 2

# Relative error margin covering the double-double roundings of the root and the products
# below (their true size is ~2**-100; the Newton remainder is ~2**-86 at worst).
_DD_MARGIN = 2.0 ** -80
# Bits kept in s when no leaf is float64: x * s is then exact in float64 for 24-bit x.
SHORT_SCALE_BITS = 29
# Integer p up to this use a double-double power in the Newton step; larger p use pow().
_MAX_DD_POWER = 64
# Relative error bound of libm/XLA pow() on float64 (documented < 1 ulp; taken as 2 ulp).
POW_REL_ERR = 2.0 ** -51
U64 = 2.0 ** -53


def sum_rel_err(count, term_rel_err: float, dd: bool = False):
  """Rigorous relative error of a float64 sum of ``count`` nonnegative terms, any order.

  Each term carries a relative error ``term_rel_err``; recursive summation of n terms adds at
  most gamma_{n-1} = (n-1)u/(1-(n-1)u). A double-double sum adds ~n * 2**-104.
  """
  n = np.asarray(count, dtype=np.float64)
  if dd:
    acc = n * 2.0 ** -102
  else:
    k = np.maximum(n - 1.0, 0.0) * U64
    acc = k / np.maximum(1.0 - k, 0.5)
  return term_rel_err + acc * (1.0 + term_rel_err) + 2.0 ** -1000



def root(xp: Any, s_hi, s_lo, rel_err, p: float):
  """(r_hi, r_lo, eps): S ** (1/p) in double-double and a bound on its relative error."""
  if p == 1.0:
    r_hi, r_lo = fast_two_sum(xp, s_hi, s_lo)
    return r_hi, r_lo, rel_err + _DD_MARGIN
  pos = s_hi > 0
  safe = xp.where(pos, s_hi, 1.0)
  q_err = 0.0
  if p == 2.0:
    r = xp.sqrt(safe)
    q_hi, q_lo = two_prod(xp, r, r)
  elif float(p).is_integer() and p <= _MAX_DD_POWER:
    r = safe ** (1.0 / p)
    q_hi, q_lo = dd_int_power(xp, r, int(p))
  else:
    r = safe ** (1.0 / p)
    q_hi, q_lo = dd_pow(xp, r, xp.zeros_like(r), p)
    q_err = DD_POW_REL_ERR
  # One Newton step r <- r (1 + (S - r**p) / (p r**p)); the residual is formed exactly.
  d_hi, d_lo = two_sum(xp, safe, -q_hi)
  delta = (d_hi + (d_lo + (xp.where(pos, s_lo, 0.0) - q_lo))) / (p * q_hi)
  r_hi, r_lo = fast_two_sum(xp, r, r * delta)
  eps = rel_err / p + rel_err * rel_err + q_err / p + _DD_MARGIN
  return xp.where(pos, r_hi, 0.0), xp.where(pos, r_lo, 0.0), eps


def finalize(xp: Any, *, s_hi, s_lo, sc_m, sc_e, rel_err, zero, nan, inf, c_m, c_e, c_inf,
             p: float, precise: bool):
  """Per-system decision (see the module docstring); everything stays in a moderate range.

  The scale arrives as ``sc_m * 2**sc_e`` and the threshold as ``c = c_m * 2**c_e`` (``c_m`` in
  [0.5, 1) or 0, ``c_inf`` when c is +inf), both from exact frexps, so that subnormals survive
  an XLA CPU that flushes them to zero; the norm leaves the same way, as ``norm_v * 2**sc_e``.

  Returns:
    norm_v: float64 with norm = norm_v * 2**sc_e (caller rounds it into the norm dtype);
    action: int8 KEEP/SCALE/NAN_FILL;
    s_m, s_e: the factor s = s_m * 2**s_e (s_m = 0 for a zero threshold);
    tie: the threshold is within the error bound of the norm: decide it exactly.
  """
  if math.isinf(p):
    r_hi, r_lo, eps = xp.ones_like(sc_m), xp.zeros_like(sc_m), 0.0
  else:
    r_hi, r_lo, eps = root(xp, s_hi, s_lo, rel_err, p)
  # The norm is T * 2**sc_e with T = sc_m * r in [~0.25, ~n]: moderate, whatever the data.
  t_hi, t_lo = two_prod(xp, sc_m, r_hi)
  t_hi, t_lo = fast_two_sum(xp, t_hi, t_lo + sc_m * r_lo)
  if isinstance(eps, float) and eps == 0.0:
    up = lo = t_hi  # p = +-inf: T is an element of the system, exactly
  else:
    slack = t_hi * eps
    up = xp.nextafter(t_hi + (t_lo + slack), xp.full_like(t_hi, xp.inf))
    lo = xp.nextafter(t_hi + (t_lo - slack), xp.zeros_like(t_hi))
  norm_v = t_hi + t_lo

  d = c_e.astype(xp.int32) - sc_e.astype(xp.int32)
  c_pos = c_m > 0
  c_t = c_m * pow2(xp, xp.clip(d, -1000, 1000))
  keep = c_inf | zero | (c_pos & ((d >= 1000) | ((d > -1000) & (c_t >= up))))
  clip = ~keep & (~c_pos | (d <= -1000) | (c_t < lo))
  tie = ~keep & ~clip

  # s: the largest float q with q * T_up <= c_m, then s = q * 2**d.
  active = ~(keep | zero)
  if precise:
    margin = t_lo + t_hi * (eps + 2.0 ** -100)

    def fits(q):  # q * (t_hi + margin) <= c_m, decided with an exact product
      prod, err = two_prod(xp, q, t_hi)
      return (prod - c_m) + err + q * margin <= 0

    q = c_m / xp.where(active, t_hi + margin, 1.0)  # within ~1 ulp of the answer
    for _ in range(3):
      q = xp.where(fits(q), q, xp.nextafter(q, xp.zeros_like(q)))
    for _ in range(2):
      nxt = xp.nextafter(q, xp.full_like(q, xp.inf))
      q = xp.where(fits(nxt), nxt, q)
  else:
    q = c_m / xp.where(active, up, 1.0)
    q = q * (1.0 - 2.0 ** -50)  # RN of c_m/up is at most 1 ulp above; this steps below
  q_m, q_e = frexp(xp, q)
  if not precise:
    q_m = xp.floor(q_m * 2.0 ** SHORT_SCALE_BITS) * 2.0 ** -SHORT_SCALE_BITS
  s_m = xp.where(c_m == 0, 0.0, q_m)
  s_e = xp.where(c_m == 0, 0, q_e.astype(xp.int32) + d)

  poisoned = nan | inf
  action = xp.where(poisoned, NAN_FILL, xp.where(keep, KEEP, SCALE)).astype(xp.int8)
  return norm_v, action, s_m, s_e.astype(xp.int32), tie & ~poisoned


def compose_norm(norm_v: np.ndarray, sc_e: np.ndarray, zero, nan, inf,
                 dtype: np.dtype) -> np.ndarray:
  """numpy: the reported norms in ``dtype`` (ldexp and one rounding; inf past the range)."""
  with np.errstate(over="ignore", under="ignore"):
    norm = np.ldexp(norm_v, sc_e.astype(np.int32))
    norm = np.where(zero, 0.0, norm)
    norm = np.where(inf, np.inf, norm)
    norm = np.where(nan, np.nan, norm)
    return norm.astype(dtype)
