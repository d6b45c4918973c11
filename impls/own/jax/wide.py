"""The power sums when some leaf is float64 (x64 on): every element decoded from its bits.

Maxima are integer keys (float maxima would flush subnormals), products are Dekker
two-products, non-integer powers double-double ``exp``/``log``, and the sums use four grids,
so the terms keep ~2**-100 of their relative precision.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from clipbench.impls.own import decision, double_double
from clipbench.impls.own.jax.formats import (FLOAT64, KEY_BIAS, FloatFormat, decode,
                                             key_value, pow2, u64)
from clipbench.impls.own.jax.pairwise import pairwise_dd_sum_last
from clipbench.impls.own.jax.power_sums import extract, fold_grids, precise_terms, term_error
from clipbench.impls.own.jax.systems import (Systems, SystemStats, element_counts, grouped,
                                             inner_axes, nonfinite_flags, per_group,
                                             variadic_reduce, vectors)

_FOLDS = 4
_NO_KEY = 2**64 - 1  # the min-reduction's identity: above every key


def _system_extreme_keys(views, fmts: list[FloatFormat], systems: Systems, zero_mode: bool,
                         want_min: bool):
  """Per-system max (or min) |x| key, NaN/inf flags, element counts and the decoded views
  (:func:`.systems.grouped`'s, reduced over every axis but the first)."""
  s = systems.num
  best = jnp.zeros(s, jnp.uint64) if not want_min else jnp.full(s, jnp.uint64(_NO_KEY))
  has_nan = jnp.zeros(s, bool)
  has_inf = jnp.zeros(s, bool)
  decoded = []
  for i, (v, fmt) in enumerate(zip(views, fmts)):
    dec = decode(v, fmt)
    decoded.append(dec)
    if v.size == 0:
      continue
    # The key and a NaN (2) / inf (1) code in one variadic reduce: XLA would decode the
    # elements again for each reduction of its own.
    code = jnp.where(dec.nan, 2, jnp.where(dec.nonfinite, 1, 0)).astype(jnp.int32)
    if want_min:
      k_use = jnp.where(dec.nonfinite & ~jnp.asarray(zero_mode), jnp.uint64(_NO_KEY), dec.key)
      keys, codes = variadic_reduce([k_use, code], [_NO_KEY, 0], ["min", "max"], inner_axes(v))
      best = jnp.minimum(best, systems.row_reduce(keys, i, "min"))
    else:
      keys, codes = variadic_reduce([dec.key, code], [0, 0], ["max", "max"], inner_axes(v))
      best = jnp.maximum(best, systems.row_reduce(keys, i, "max"))
    fl = jnp.maximum(systems.row_reduce(codes, i, "max"), 0)
    has_nan, has_inf = has_nan | (fl >= 2), has_inf | (fl == 1)
  count = element_counts(views, systems)  # without segments: the unpadded count (.buckets)
  if want_min:
    best = jnp.where(count == 0, jnp.uint64(0), best)
    best = jnp.where(best == jnp.uint64(_NO_KEY), jnp.uint64(0), best)
  return best, has_nan, has_inf, count, decoded


def global_stats(leaves, fmts: list[FloatFormat], systems: Systems, p: float,
                 zero_mode: bool) -> SystemStats:
  """finalize inputs for the p-norm of every system (exact sums)."""
  views, fmts = grouped(leaves, fmts, systems)
  s = systems.num
  if math.isinf(p):
    best, has_nan, has_inf, _, _ = _system_extreme_keys(views, fmts, systems, zero_mode, p < 0)
    frac, e = key_value(best)
    zero = best == 0
    return SystemStats(s_hi=jnp.ones(s), s_lo=jnp.zeros(s),
                       sc_m=jnp.where(zero, 0.5, frac * 0.5), sc_e=jnp.where(zero, 1, e + 1),
                       rel_err=jnp.zeros(s), zero=zero, nan=has_nan, inf=has_inf)
  best, has_nan, has_inf, count, decoded = _system_extreme_keys(views, fmts, systems,
                                                                zero_mode, False)
  mx_frac, k_sys = key_value(best)
  zero = best == 0
  sigmas, log_g, _ = fold_grids(count, _FOLDS)
  sums = [jnp.zeros(s) for _ in range(_FOLDS)]
  divided = False
  for i, dec in enumerate(decoded):
    if dec.frac.size == 0:
      continue
    n_rows = dec.frac.shape[0]
    k_row = per_group(systems.per_row(k_sys, i, n_rows), dec.frac)
    mx_row = per_group(systems.per_row(jnp.where(zero, 1.0, mx_frac), i, n_rows), dec.frac)
    terms, divided = precise_terms(dec.frac, dec.e, k_row, mx_row, p)
    terms = [jnp.where(dec.zero | dec.nonfinite, 0.0, t) for t in terms]
    sig_rows = [per_group(systems.per_row(sg, i, n_rows), dec.frac) for sg in sigmas]
    pieces = extract(terms, sig_rows)
    axes = inner_axes(dec.frac)
    per_row = jnp.stack(variadic_reduce(pieces, [0.0] * len(pieces), ["sum"] * len(pieces),
                                        axes), axis=1)  # exact sums
    red = systems.row_reduce(per_row, i, "sum")
    sums = [acc + red[:, k] for k, acc in enumerate(sums)]
  s_hi, s_lo = double_double.two_sum(jnp, sums[0], sums[1])
  for extra in sums[2:]:
    s_lo = s_lo + extra  # tiny pieces; their rounding is covered by the 2**-100 below
  s_hi, s_lo = double_double.fast_two_sum(jnp, s_hi, s_lo)
  # |S - S_hat| <= n * g_last / 2 (truncation) + the term errors; S_hat >= max term >= 2**-2p.
  trunc = count.astype(jnp.float64) * pow2(log_g[-1]) * 0.5 + count * 2.0 ** -1000
  safe = jnp.where(s_hi > 0, s_hi, 1.0)
  rel = trunc / safe + 2.0 ** -100 + term_error(p, True, divided) * 1.01
  rel = jnp.where(s_hi > 0, rel, 0.0)
  if divided:
    sc_m, sc_e = jnp.where(zero, 0.5, mx_frac * 0.5), jnp.where(zero, 1, k_sys + 1)
  else:
    sc_m, sc_e = jnp.full(s, 0.5), jnp.where(zero, 1, k_sys + 2)  # scale 2**(K+1)
  return SystemStats(s_hi=s_hi, s_lo=s_lo, sc_m=sc_m, sc_e=sc_e, rel_err=rel,
                     zero=zero | (s_hi == 0), nan=has_nan, inf=has_inf)


def step_rel_err(max_d: int) -> float:
  """Relative error bound of the vectors' double-double squared norms (at most max_d
  elements)."""
  return float(decision.sum_rel_err(max_d, 0.0, dd=True)) + 2.0 ** -100


def step_stats(leaves, fmts: list[FloatFormat], systems: Systems,
               zero_mode: bool) -> SystemStats:
  """finalize inputs for the step norm: the largest vector's sum of squares per system.

  Each vector is scaled by a power of two from its own largest element and its squares are
  added in a fixed pairwise tree in double-double; vectors are compared by an exact integer
  key of the scaled sum and its exponent, ties broken by the low part."""
  s = systems.num
  best_key = jnp.zeros(s, jnp.uint64)
  has_nan = jnp.zeros(s, bool)
  has_inf = jnp.zeros(s, bool)
  per_leaf = []
  max_d = 1
  for i, (x, fmt) in enumerate(zip(leaves, fmts)):
    vec = vectors(x)
    n_rows, d = vec.shape[0], vec.shape[-1]
    max_d = max(max_d, d)
    if vec.size == 0:
      per_leaf.append(None)
      continue
    key, frac, e, zz, nonfinite, nan, _ = decode(vec, fmt)
    vmax = jnp.max(jnp.where(nonfinite, jnp.uint64(0), key), axis=-1)
    _, ve = key_value(vmax)
    a = frac * pow2(e - ve[..., None] - 1)
    a = jnp.where(zz | nonfinite | (e - ve[..., None] - 1 < -1000), 0.0, a)
    t_hi, t_lo = double_double.two_prod(jnp, a, a)
    v_hi, v_lo = pairwise_dd_sum_last(t_hi, t_lo)
    v_hi, v_lo = double_double.fast_two_sum(jnp, v_hi, v_lo)
    vbad = jnp.any(nonfinite, axis=-1)
    # The vector's value is v * 4**(ve + 1), v in [1/4, d): key on (total exponent, v's bits).
    vk, _, vexp, vzero, _, _, _ = decode(v_hi, FLOAT64)
    tot_e = vexp + 2 * (ve + 1)
    key_v = (u64(tot_e + 2 * KEY_BIAS) << 52) | (vk & ((1 << 52) - 1))
    drop = vzero | (vmax == 0) | (vbad & (not zero_mode))
    key_v = jnp.where(drop, jnp.uint64(0), key_v)
    best_key = jnp.maximum(best_key, systems.row_reduce(jnp.max(key_v, axis=1), i, "max"))
    hn, hi = nonfinite_flags(nan, nonfinite, systems, i, (1, 2))
    has_nan, has_inf = has_nan | hn, has_inf | hi
    rel_lo = jnp.where(v_hi > 0, v_lo / jnp.where(v_hi > 0, v_hi, 1.0), 0.0)
    per_leaf.append((key_v, rel_lo, n_rows))
  best_rel = jnp.full(s, -jnp.inf)
  for i, item in enumerate(per_leaf):
    if item is None:
      continue
    key_v, rel_lo, n_rows = item
    bk = systems.per_row(best_key, i, n_rows)[:, None]
    cand = jnp.where((key_v == bk) & (bk > 0), rel_lo, -jnp.inf)
    best_rel = jnp.maximum(best_rel, systems.row_reduce(jnp.max(cand, axis=1), i, "max"))
  best_rel = jnp.where(jnp.isfinite(best_rel), best_rel, 0.0)
  zero = best_key == 0
  frac, _ = key_value(best_key)
  tot_e = (best_key >> 52).astype(jnp.int32) - 2 * KEY_BIAS
  # S = frac (1 + rel) 2**tot_e, frac in [1, 2): S = S' 4**K with S' in [1, 4).
  k = jnp.floor_divide(tot_e, 2)
  s_hi = jnp.where(zero, 0.0, frac * pow2(tot_e - 2 * k))
  s_lo = s_hi * best_rel
  rel = step_rel_err(max_d)
  return SystemStats(s_hi=s_hi, s_lo=s_lo, sc_m=jnp.full(s, 0.5),
                     sc_e=jnp.where(zero, 1, k + 1), rel_err=jnp.full(s, rel), zero=zero,
                     nan=has_nan, inf=has_inf,
                     vector_keys=tuple(None if item is None else item[0] for item in per_leaf))
