"""The power sums for leaves of at most 32 bits (no float64 leaf): the fast route.

XLA on CPU runs 64-bit integer operations and integer reductions slowly (far slower than a
float reduction), so leaves of at most 32 bits are widened with float conversions, which are
exact for normal values, and only their subnormals (which float operations would flush) are
rebuilt from 32-bit integer fields. Maxima are then plain float maxima.

Canonical terms: a system whose max |x| is at least 2**-60 drops elements below 2**-126
(float32 subnormals, which XLA's conversions flush; at most ``n (2**-66)**p`` relative, in the
error bound); a smaller ("tiny") system keeps them exactly. Which pass runs depends on the
batch (a tiny system anywhere selects the exact widening for all), the terms never do.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from clipbench.impls.own import decision, double_double
from clipbench.impls.own.jax.formats import exponent_of, pow2
from clipbench.impls.own.jax.pairwise import pairwise_sum_last
from clipbench.impls.own.jax.power_sums import (MAX_HALVED_POWER, extract, fold_grids,
                                                power_term, term_error)
from clipbench.impls.own.jax.systems import (Systems, SystemStats, block, element_counts,
                                             inner_axes, per_group, variadic_reduce, vectors)

_TWO_M149 = 2.0 ** -149
_TWO_M133 = 2.0 ** -133
TINY = 2.0 ** -60  # systems whose max |x| is below this take the exact-widening pass
# Systems of more elements than this take a third grid.
_TWO_GRID_ELEMENTS = 1 << 25


def widen(x, zero_nonfinite: bool = True):
  """(|x| as an exact float64, nan, nonfinite) for a float16/bfloat16/float32 array.

  Normal values convert exactly with a float conversion; a subnormal is its integer fraction
  field times 2**-149 (2**-133 for bfloat16), added in. The conversion's own value of a
  subnormal is zeroed first (a float32 select): XLA's CPU flushes it to 0, but XLA's GPU keeps
  it, which counted every subnormal twice there (the GPU check of 2026-11-26, docs/gpu.md).
  Kept in float32 until the last step: XLA vectorises that far better than a 64-bit select."""
  dt = np.dtype(x.dtype)
  nan = jnp.isnan(x)
  nonfinite = ~jnp.isfinite(x)
  if dt == np.float16:
    v = jnp.abs(x.astype(jnp.float64))  # half-precision conversions keep subnormals
  elif dt == np.float32:
    ab = lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF
    subnormal = ab < 0x800000
    sub = jnp.where(subnormal, ab.astype(jnp.float32), 0.0)
    normal = jnp.where(subnormal, jnp.float32(0.0), jnp.abs(x))
    v = normal.astype(jnp.float64) + sub.astype(jnp.float64) * _TWO_M149
  else:  # bfloat16
    ab = lax.bitcast_convert_type(x, jnp.int16).astype(jnp.int32) & 0x7FFF
    subnormal = ab < 0x80
    sub = jnp.where(subnormal, ab.astype(jnp.float32), 0.0)
    normal = jnp.where(subnormal, jnp.float32(0.0), jnp.abs(x.astype(jnp.float32)))
    v = normal.astype(jnp.float64) + sub.astype(jnp.float64) * _TWO_M133
  if zero_nonfinite:
    v = jnp.where(nonfinite, 0.0, v)
  return v, nan, nonfinite


def _system_flags(nan, nonfinite, systems: Systems, leaf: int):
  """Per-system (has NaN, has non-finite) from per-element flags, with float maxima."""
  code = jnp.where(nan, 2.0, jnp.where(nonfinite, 1.0, 0.0)).astype(jnp.float32)
  fl = systems.row_reduce(jnp.max(code, axis=1), leaf, "max")
  fl = jnp.maximum(fl, 0.0)
  return fl >= 2.0, fl == 1.0


def _exact_extreme(leaves, systems: Systems, p: float, zero_mode: bool):
  """Exact per-system max |x| (p > 0) or min |x| (p < 0), subnormals included."""
  s = systems.num
  best = jnp.zeros(s) if p > 0 else jnp.full(s, jnp.inf)
  for i, x in enumerate(leaves):
    xr = block(x, systems)
    if xr is None:
      continue
    v, _, nonfinite = widen(xr)
    if p > 0:
      best = jnp.maximum(best, systems.row_reduce(jnp.max(v, axis=inner_axes(v)), i, "max"))
    else:
      vm = v if zero_mode else jnp.where(nonfinite, jnp.inf, v)
      best = jnp.minimum(best, systems.row_reduce(jnp.min(vm, axis=inner_axes(v)), i, "min"))
  return best


def _float_max_and_flags(leaf_blocks, systems: Systems, zero_mode: bool):
  """Pass A: per-system max |x| in float32 (exact for a normal max) and a NaN (2) / inf (1)
  code, one variadic reduce and one scatter per leaf."""
  s = systems.num
  m32 = jnp.zeros(s, jnp.float32)
  code = jnp.zeros(s, jnp.float32)
  for i, xr in enumerate(leaf_blocks):
    if xr is None:
      continue
    ax = jnp.abs(xr).astype(jnp.float32)
    nonfinite = ~jnp.isfinite(xr)
    c = jnp.where(jnp.isnan(xr), 2.0, jnp.where(nonfinite, 1.0, 0.0)).astype(jnp.float32)
    if zero_mode:
      ax = jnp.where(nonfinite, 0.0, ax)
    red = variadic_reduce([ax, c], [0.0, 0.0], ["max", "max"], inner_axes(xr))
    both = systems.row_reduce(jnp.stack(red, axis=1), i, "max")  # one scatter
    m32 = jnp.maximum(m32, both[:, 0])
    code = jnp.maximum(code, both[:, 1])
  return m32, jnp.maximum(code, 0.0)


def global_stats(leaves, systems: Systems, p: float, zero_mode: bool) -> SystemStats:
  """finalize inputs of the p-norm of every system (exact sums; see the module docstring)."""
  total_elements = sum(int(x.size) for x in leaves)
  s = systems.num
  count = element_counts(leaves, systems)
  leaf_blocks = [block(x, systems) for x in leaves]
  m32, code = _float_max_and_flags(leaf_blocks, systems, zero_mode)
  has_nan, has_inf = code >= 2.0, code == 1.0
  if not zero_mode:  # a poisoned system's max is irrelevant; keep it finite
    m32 = jnp.where(code > 0, 1.0, m32)
  tiny = (m32.astype(jnp.float64) < TINY) & (count > 0)
  if math.isinf(p):
    exact = lax.cond(jnp.any(tiny) | (p < 0),
                     lambda: _exact_extreme(leaves, systems, p, zero_mode),
                     lambda: m32.astype(jnp.float64))
    ext = jnp.where(count > 0, exact, 0.0)
    ext = jnp.where(jnp.isinf(ext) | jnp.isnan(ext), 0.0, ext)
    zero = ext == 0
    e = exponent_of(ext)
    return SystemStats(s_hi=jnp.ones(s), s_lo=jnp.zeros(s),
                       sc_m=jnp.where(zero, 0.5, ext * pow2(-e - 1)),
                       sc_e=jnp.where(zero, 1, e + 1), rel_err=jnp.zeros(s), zero=zero,
                       nan=has_nan, inf=has_inf)
  mx = lax.cond(jnp.any(tiny), lambda: _exact_extreme(leaves, systems, 1.0, zero_mode),
                lambda: m32.astype(jnp.float64))
  if not zero_mode:
    mx = jnp.where(code > 0, 1.0, mx)
  zero = mx == 0
  k_sys = exponent_of(mx)  # max |x| < 2**(k+1)
  divided = p > MAX_HALVED_POWER
  # Systems of up to 2**25 elements use two grids, larger ones three: a per-system rule (a
  # third grid is only computed when some system could be that large).
  folds = 3 if total_elements > _TWO_GRID_ELEMENTS else 2
  sigmas, log_g, big_l = fold_grids(count, folds)
  tiny_exact = mx < TINY
  scale_inv = jnp.where(zero, 1.0, mx) if divided else pow2(-k_sys - 1)

  def power_sums(widen_exact: bool):
    """Pass B: the exact per-system sums on each grid."""
    sums = [jnp.zeros(s) for _ in range(folds)]
    for i, xr in enumerate(leaf_blocks):
      if xr is None:
        continue
      n_rows = xr.shape[0]
      if widen_exact:
        v, _, _ = widen(xr)
        keep_sub = per_group(systems.per_row(tiny_exact, i, n_rows), xr)
        v = jnp.where(keep_sub | (v >= 2.0 ** -126), v, 0.0)
      else:  # below 2**-126 dropped here too: XLA's CPU flushes it, XLA's GPU would not
        ax = jnp.abs(xr)
        v = jnp.where(jnp.isfinite(xr) & (ax >= 2.0 ** -126), ax, 0.0).astype(jnp.float64)
      consts = systems.per_row(jnp.stack([scale_inv] + list(sigmas), axis=1), i, n_rows)
      f = per_group(consts[:, 0], xr)
      a = v / f if divided else v * f
      t = power_term(a, p)
      pieces = extract([t], [per_group(consts[:, k + 1], xr) for k in range(folds)])
      per_row = jnp.stack(variadic_reduce(pieces, [0.0] * folds, ["sum"] * folds, inner_axes(xr)),
                          axis=1)
      red = systems.row_reduce(per_row, i, "sum")
      sums = [acc + red[:, k] for k, acc in enumerate(sums)]
    return tuple(sums)

  sums = list(lax.cond(jnp.any(tiny), lambda: power_sums(True), lambda: power_sums(False)))
  use3 = big_l > 25
  third = jnp.where(use3, sums[2], 0.0) if folds == 3 else 0.0
  last = jnp.where(use3, log_g[2], log_g[1]) if folds == 3 else log_g[1]
  s_hi, s_lo = double_double.two_sum(jnp, sums[0], sums[1])
  s_hi, s_lo = double_double.fast_two_sum(jnp, s_hi, s_lo + third)
  trunc = count.astype(jnp.float64) * pow2(last) * 0.5
  safe = jnp.where(s_hi > 0, s_hi, 1.0)
  # Dropped subnormals: each below (2**-126 / max)**p of the largest term.
  dropped = jnp.where(tiny_exact, 0.0, count.astype(jnp.float64) * jnp.minimum(
      2.0 ** -124 / jnp.where(zero, 1.0, mx), 1.0) ** p)
  rel = trunc / safe + dropped + 2.0 ** -100 + term_error(p, False, divided) * 1.01
  rel = jnp.where(s_hi > 0, rel, 0.0)
  if divided:
    me = exponent_of(jnp.where(zero, 1.0, mx))
    sc_m, sc_e = jnp.where(zero, 0.5, mx * pow2(-me - 1)), me + 1
  else:
    sc_m, sc_e = jnp.full(s, 0.5), jnp.where(zero, 1, k_sys + 2)  # scale 2**(k+1)
  return SystemStats(s_hi=s_hi, s_lo=s_lo, sc_m=sc_m, sc_e=sc_e, rel_err=rel,
                     zero=zero | (s_hi == 0), nan=has_nan, inf=has_inf)


def step_rel_err(max_d: int) -> float:
  """Relative error bound of a vector's squared norm in :func:`step_stats` (at most max_d
  elements)."""
  return float(decision.sum_rel_err(max_d, 0.0)) + 2.0 ** -100


def step_stats(leaves, systems: Systems, zero_mode: bool) -> SystemStats:
  """Step norm: float64 squares of widened elements never overflow or underflow, each vector
  is summed in a fixed pairwise tree, maxima are float maxima."""
  s = systems.num
  best = jnp.zeros(s)
  has_nan = jnp.zeros(s, bool)
  has_inf = jnp.zeros(s, bool)
  max_d = 1
  keys = []
  for i, x in enumerate(leaves):
    keys.append(None)
    if x.size == 0:
      continue
    vec = vectors(x)
    n_rows, d = vec.shape[0], vec.shape[-1]
    max_d = max(max_d, d)
    v, nan, nonfinite = widen(vec)
    sq = pairwise_sum_last(v * v)
    if not zero_mode:
      sq = jnp.where(jnp.any(nonfinite, axis=-1), 0.0, sq)
    keys[-1] = lax.bitcast_convert_type(sq, jnp.uint64)  # monotone: sq >= 0
    best = jnp.maximum(best, systems.row_reduce(jnp.max(sq, axis=1), i, "max"))
    hn, hi = _system_flags(nan.reshape(n_rows, -1), nonfinite.reshape(n_rows, -1), systems, i)
    has_nan, has_inf = has_nan | hn, has_inf | (hi & ~hn)
  rel = step_rel_err(max_d)
  zero = best == 0
  return SystemStats(s_hi=best, s_lo=jnp.zeros(s), sc_m=jnp.full(s, 0.5),
                     sc_e=jnp.ones(s, jnp.int32), rel_err=jnp.full(s, rel), zero=zero,
                     nan=has_nan, inf=has_inf, vector_keys=tuple(keys))
