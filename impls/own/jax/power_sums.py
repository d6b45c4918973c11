"""Order-free exact power sums: terms (|x| / scale)**p split onto per-system grids.

XLA picks its own reduction and scatter orders, so no summation order can be imposed; instead
every per-system sum is exact. Each term ``t <= 1`` is split by ``q = (t + sigma) - sigma`` into
pieces on grids ``g1 = 2**(L+1-52)``, ``g2 = g1 2**(L-52)``, ... (``n < 2**L`` elements), on which
any sum of n pieces is exact in float64, so it does not depend on order, fusion or batching.
The dropped remainder (below ``n g_last / 2``) joins a rigorous error bound.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from clipbench.impls.own import decision, double_double
from clipbench.impls.own.jax.formats import bit_length, pow2

# Integer powers up to this are products (double-double with float64 leaves), larger ones pow.
MAX_INT_POWER = 64
# p above this: (1/2)**p underflows, so terms are divided by the system's max instead.
MAX_HALVED_POWER = 512.0


def is_small_int_power(p: float) -> bool:
  return float(p).is_integer() and p <= MAX_INT_POWER


def fold_grids(count, folds: int):
  """Per-system extraction constants: sigma_k = 1.5 * 2**E_k, grid g_k = 2**(E_k - 52).

  With L = bit_length(n) (n < 2**L) and terms in [0, 1]: g_1 = 2**(L + 1 - 52) and
  g_{k+1} = g_k * 2**(L - 52), so any sum of n pieces of one grid stays below 2**53 g_k.
  Returns (sigmas, log2 of the grids, L)."""
  big_l = jnp.maximum(bit_length(count), 1)
  log_g = [big_l + 1 - 52]
  for _ in range(folds - 1):
    log_g.append(log_g[-1] + big_l - 52)
  sigmas = [1.5 * pow2(lg + 52) for lg in log_g]
  return sigmas, log_g, big_l


def extract(terms, sigmas):
  """Pieces q_k of each term on grids g_k (t = q_1 + ... + q_K + remainder, exactly)."""
  pieces = [[] for _ in sigmas]
  for t in terms:
    r = t
    for k, sig in enumerate(sigmas):
      q = (r + sig) - sig
      pieces[k].append(q)
      r = r - q
  return [functools.reduce(jnp.add, ps) if len(ps) > 1 else ps[0] for ps in pieces]


def term_error(p: float, precise: bool, divided: bool) -> float:
  """Relative error bound of one term (|x| / scale)**p as :func:`power_term` or
  :func:`precise_terms` computes it."""
  if divided:
    err = (double_double.DD_POW_REL_ERR if precise else decision.POW_REL_ERR) + p * 1.01 * \
        decision.U64
    return err * (2.0 if precise else 1.0)
  if p in (1.0, 2.0):
    return 0.0
  if is_small_int_power(p):
    return 2.0 ** -100 * p if precise else (p - 1) * 1.01 * decision.U64
  return double_double.DD_POW_REL_ERR if precise else decision.POW_REL_ERR


def power_term(a, p: float):
  """a**p for 0 <= a <= 1 in float64 (exact for p = 1, and for p = 2 with <= 26-bit a)."""
  if p == 1.0:
    return a
  if p == 2.0:
    return a * a
  if is_small_int_power(p):
    t = a * a
    for _ in range(int(p) - 2):
      t = t * a
    return t
  return jnp.where(a > 0, jnp.where(a > 0, a, 1.0) ** p, 0.0)


def precise_terms(frac, e, k_sys, mx_frac, p: float):
  """Terms (|x| / 2**(K+1))**p (each <= 1) of |x| = frac 2**e as lists of double-double parts,
  and whether they were divided by the max instead (p > MAX_HALVED_POWER)."""
  a = frac * pow2(e - k_sys - 1)
  a = jnp.where(e - k_sys - 1 < -1000, 0.0, a)
  if p > MAX_HALVED_POWER:
    # (1/2)**p underflows: scale by the max itself, a = |x| / max (the max term is 1).
    q = frac / mx_frac
    a = q * pow2(e - k_sys)
    a = jnp.where(e - k_sys < -1000, 0.0, a)
    lo = (frac - q * mx_frac) / mx_frac  # not needed to be exact: bounded below
    hi, lo = double_double.dd_pow(jnp, jnp.where(a > 0, a, 1.0), lo * 0.0, p)
    # An element far below the max (a == 0 here) is a term of 0, not of the stand-in's 1.
    return [jnp.where(a > 0, hi, 0.0), jnp.where(a > 0, lo, 0.0)], True
  if p == 1.0:
    return [a], False
  if p == 2.0:
    hi, lo = double_double.two_prod(jnp, a, a)
    return [hi, lo], False
  if is_small_int_power(p):
    hi, lo = double_double.dd_int_power(jnp, a, int(p))
    return [hi, lo], False
  safe = jnp.where(a > 0, a, 1.0)
  hi, lo = double_double.dd_pow(jnp, safe, jnp.zeros_like(safe), p)
  return [jnp.where(a > 0, hi, 0.0), jnp.where(a > 0, lo, 0.0)], False
