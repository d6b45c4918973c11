"""The three clipping operations in JAX (jit-compiled XLA), exact and batch-invariant.

Numerical design (SPEC rules 3-5 and 11 by construction, not by XLA's choices):

* **Order-free exact sums (rule 11).** XLA picks its own reduction and scatter orders, which
  change with shapes and fusion, so no fixed summation order can be imposed. Instead every
  per-system sum is exact: each term ``t = (|x| / 2**(K+1))**p <= 1`` (K the exponent of the
  system's max |x|, found in a first pass) is split by ``q = (t + sigma) - sigma`` into pieces
  on two per-system grids ``g1 = 2**(L+1-52)``, ``g2 = g1 2**(L-52)`` (``n < 2**L`` elements;
  a third grid above 2**25 elements), on which any sum of n pieces is exact in float64. Sums of
  exact values are independent of order, association, scatter, fusion, row interleaving, leaf
  split and batch composition, so a system's bits depend only on its own elements, for the
  segmented, sorted and ``segments=None`` paths alike. The dropped remainder (below
  ``n g_last / 2``) joins a rigorous error bound.
* **Float64 without global x64.** The core runs under ``jax.enable_x64(True)`` (scoped, so
  callers keep x64 off) and is cached by ``jax.jit`` on shapes and static arguments. Inside an
  enclosing ``jax.jit`` the graph is lowered with x64 off; the ops used here lower correctly
  then (``jnp.frexp`` does not, so frexp is done on the bits).
* **XLA flushes subnormals** in every float operation on CPU. Leaves of at most 32 bits are
  widened with exact float conversions, subnormals rebuilt from their integer fraction field;
  results are rounded into bits with integer operations. Canonical rule: a system whose max
  is at least 2**-60 leaves out elements below 2**-126 (at most ``n (2**-66)**p`` relative,
  inside the error bound), a smaller one keeps them exactly, so the bits never depend on which
  pass the batch selected. Float64 leaves (x64 on) take a slower path: integer keys for maxima,
  Dekker two-products, double-double ``exp``/``log`` for non-integer p, four grids.
* **Decision and factor**: ``decision.finalize`` (shared with the numba kernels): double-double
  root, threshold against an interval around the norm; a near-tie is settled exactly on the
  host by a ``jax.pure_callback`` under ``lax.cond`` (only when one exists; integer arithmetic,
  since the callback thread flushes subnormals too). The factor is the largest s with
  ``s n_up <= c``, cut to 29 bits without float64 leaves, so ``x * s`` is exact in float64 and
  one truncation of its bits is the exact RTZ value: the output norm is ``<= s n <= c``.
  Kept systems are selected bitwise (never multiplied by 1.0, which XLA would flush).
* **Max-step** sums each vector's squares in a fixed pairwise tree over the last axis
  (elementwise adds: deterministic), then takes float maxima (exact).

Speed: on CPU XLA runs multi-output reductions of fused float64 work, scatters and gathers
slowly, and the exact sums need two passes over the data (max, then pieces) plus the apply
pass; expect several times the roofline (the numba kernels are the fast CPU implementation).

Transforms: ``jax.jit`` (concrete arguments are validated on the host first; under tracing the
value checks on segments are skipped and a traced threshold is clamped to ``max(c, 0)``),
``jax.vmap``, ``jax.grad`` (a custom JVP: the identity where a system is kept, the derivative
of ``x c / n(x)`` where it is clipped for finite p, the factor held fixed for p = +-inf and
max-step, zero for NaN-filled systems; finite at a zero input). Verified by
``conformance/test_transforms.py``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from clipbench.protocol import ANY_NORM_TYPE, DTYPES, Capabilities
from clipbench.impls.own import decision, double_double, exact, validation

framework = "jax"
version = jax.__version__
description = "jit-compiled JAX/XLA; exact per-system sums (order-free), exact decisions"
X64 = bool(jax.config.jax_enable_x64)
capabilities = Capabilities(
    per_system=True, per_system_max=True, norm_types=ANY_NORM_TYPE,
    dtypes=DTYPES if X64 else tuple(d for d in DTYPES if d != "float64"),
    nonfinite=("propagate", "zero"), returns_norm=True, in_place=False,
    transforms=("jit", "vmap", "grad"), devices=("cpu",), mixed_dtypes=True)

_BF16 = np.dtype(ml_dtypes.bfloat16)


class _Fmt:
  """Bit layout of a float format: total bits, fraction bits, exponent bias, uint dtype."""

  def __init__(self, nbits: int, mbits: int, bias: int, udtype):
    self.nbits, self.mbits, self.bias, self.udtype = nbits, mbits, bias, udtype
    self.emax_field = (1 << (nbits - 1 - mbits)) - 1
    self.emin = 1 - bias


_FMTS = {
    np.dtype(np.float16): _Fmt(16, 10, 15, jnp.uint16),
    _BF16: _Fmt(16, 7, 127, jnp.uint16),
    np.dtype(np.float32): _Fmt(32, 23, 127, jnp.uint32),
    np.dtype(np.float64): _Fmt(64, 52, 1023, jnp.uint64),
}
_KEY_BIAS = 1200  # key exponent offset: every |x| of every dtype has exponent > -1200


# ------------------------------------------------------------------------ bit-level helpers
def _u64(v):
  return lax.convert_element_type(v, jnp.uint64)


def _bits_of(x, fmt: _Fmt):
  return lax.bitcast_convert_type(x, fmt.udtype)


def _decode(x, fmt: _Fmt):
  """Exact decomposition of |x| from its bits (no float arithmetic on x).

  Returns:
    key: uint64, monotone in |x| (0 for zero): ((E + bias) << 52) | fraction bits;
    frac: float64 in [1, 2) with |x| = frac * 2**E (1.0 for zero);
    e: int32 exponent E;
    zero, nonfinite, nan, neg: bool.
  """
  b = _u64(_bits_of(x, fmt))
  sign_shift = fmt.nbits - 1
  neg = (b >> sign_shift) & 1 == 1
  a = b & ((1 << sign_shift) - 1)
  ef = a >> fmt.mbits
  mf = a & ((1 << fmt.mbits) - 1)
  nonfinite = ef == fmt.emax_field
  nan = nonfinite & (mf != 0)
  normal = ef > 0
  m = jnp.where(normal, mf | (1 << fmt.mbits), mf)
  e_int = jnp.where(normal, ef.astype(jnp.int32) - fmt.bias, fmt.emin) - fmt.mbits
  nb = 64 - lax.clz(m).astype(jnp.int32)  # bit length of the integer mantissa
  zero = (m == 0) & ~nonfinite
  m53 = jnp.where(zero | nonfinite, 1 << 52, m << jnp.clip(53 - nb, 0, 63).astype(jnp.uint64))
  e = jnp.where(zero | nonfinite, 0, e_int + nb - 1)
  frac_bits = m53 & ((1 << 52) - 1)
  frac = lax.bitcast_convert_type((jnp.uint64(1023) << 52) | frac_bits, jnp.float64)
  key = jnp.where(zero | nonfinite, jnp.uint64(0),
                  (_u64(e + _KEY_BIAS) << 52) | frac_bits)
  return key, frac, e, zero, nonfinite, nan, neg


def _key_value(key):
  """(frac, e) of a key (frac = 0 for key 0)."""
  e = (key >> 52).astype(jnp.int32) - _KEY_BIAS
  frac = lax.bitcast_convert_type((jnp.uint64(1023) << 52) | (key & ((1 << 52) - 1)),
                                  jnp.float64)
  return jnp.where(key == 0, 0.0, frac), jnp.where(key == 0, 0, e)


def _pow2(e):
  """2.0**e for int arrays e, clipped to the normal range (built from exponent bits)."""
  e = jnp.clip(e.astype(jnp.int64), -1022, 1023)
  return lax.bitcast_convert_type(_u64(e + 1023) << 52, jnp.float64)


def _bit_length(n):
  n = _u64(n)
  return 64 - lax.clz(n).astype(jnp.int32)


def _round_nearest_bits(v, e_add, fmt: _Fmt):
  """Bits (fmt) of v * 2**e_add rounded to nearest-even; v float64 >= 0 normal or 0; inf
  past the range. Integer arithmetic only."""
  b = _u64(lax.bitcast_convert_type(v, jnp.uint64))
  ev = (b >> 52).astype(jnp.int32) - 1023 + e_add.astype(jnp.int32)
  m53 = (b & ((1 << 52) - 1)) | (1 << 52)
  shift = 52 - fmt.mbits + jnp.maximum(fmt.emin - ev, 0)
  shift_c = jnp.clip(shift, 0, 63).astype(jnp.uint64)
  units = jnp.where(shift >= 64, jnp.uint64(0), m53 >> shift_c)
  rem = jnp.where(shift >= 64, m53, m53 & ((jnp.uint64(1) << shift_c) - 1))
  half = jnp.where(shift >= 64, jnp.uint64(1) << 63, jnp.uint64(1) << (shift_c - 1))
  half = jnp.where(shift >= 65, jnp.uint64(1) << 63, half)
  up = (rem > half) | ((rem == half) & ((units & 1) == 1))
  up = up & (shift < 65)
  normal = ev >= fmt.emin
  # Normal: biased exponent field + fraction (the carry of a round-up moves into the exponent,
  # up to infinity); subnormal: the units are the bits.
  bits = jnp.where(normal, (_u64(ev - fmt.emin + 1) << fmt.mbits) + (units - (1 << fmt.mbits)),
                   units) + up.astype(jnp.uint64)
  inf_bits = jnp.uint64(fmt.emax_field) << fmt.mbits
  bits = jnp.where(ev > fmt.bias, inf_bits, jnp.minimum(bits, inf_bits))
  bits = jnp.where(v == 0, jnp.uint64(0), bits)
  return lax.convert_element_type(bits, fmt.udtype)


def _rtz_bits(p_hi, p_lo, e_add, fmt: _Fmt):
  """Bits (fmt) of (p_hi + p_lo) * 2**e_add rounded toward zero, for p_hi in [0.5, 2) (or 0)
  and |p_lo| <= ulp(p_hi)/2 (p_hi + p_lo exact): integer truncation plus a one-unit fix."""
  b = _u64(lax.bitcast_convert_type(p_hi, jnp.uint64))
  ev = (b >> 52).astype(jnp.int32) - 1023 + e_add.astype(jnp.int32)
  m53 = (b & ((1 << 52) - 1)) | (1 << 52)
  shift = 52 - fmt.mbits + jnp.maximum(fmt.emin - ev, 0)
  shift_c = jnp.clip(shift, 0, 63).astype(jnp.uint64)
  units = jnp.where(shift >= 64, jnp.uint64(0), m53 >> shift_c)
  dropped = jnp.where(shift >= 64, m53, m53 & ((jnp.uint64(1) << shift_c) - 1))
  normal = ev >= fmt.emin
  bits = jnp.where(normal, (_u64(ev - fmt.emin + 1) << fmt.mbits) + (units - (1 << fmt.mbits)),
                   units)
  # Exactly on the grid but the exact product is a hair below: one unit toward zero.
  bits = bits - ((dropped == 0) & (p_lo < 0) & (bits > 0)).astype(jnp.uint64)
  bits = jnp.where(p_hi == 0, jnp.uint64(0), bits)
  return bits


# ----------------------------------------------------------------------- per-system plumbing
class _Systems:
  """How rows map to systems: segment ids per leaf (or None: one system)."""

  def __init__(self, segs, num_systems: int, sorted_flags, counts=None):
    self.segs = segs
    self.num = num_systems
    self.sorted = sorted_flags
    self.counts = counts  # elements per system, when known on the host

  def row_reduce(self, v, leaf: int, op: str):
    """Per-system reduction of per-row values v (rows, ...) of one leaf."""
    if self.segs is None:
      if op == "sum":
        return jnp.sum(v, axis=0, keepdims=True)
      return (jnp.max if op == "max" else jnp.min)(v, axis=0, keepdims=True)
    fn = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max,
          "min": jax.ops.segment_min}[op]
    return fn(v, self.segs[leaf], num_segments=self.num,
              indices_are_sorted=bool(self.sorted[leaf]))

  def per_row(self, v, leaf: int, rows: int):
    """Per-system values v (S, ...) broadcast to the rows of one leaf."""
    if self.segs is None:
      return jnp.broadcast_to(v[0], (rows,) + v.shape[1:])
    return v[self.segs[leaf]]


def _rows(x):
  """A leaf as (rows, elements per row) (a 0-d leaf is one row of one element)."""
  if x.ndim == 0:
    return x.reshape(1, 1)
  return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def _fold_grids(count, folds: int):
  """Per-system extraction constants: sigma_k = 1.5 * 2**E_k, grid g_k = 2**(E_k - 52).

  With L = bit_length(n) (n < 2**L) and terms in [0, 1]: g_1 = 2**(L + 1 - 52) and
  g_{k+1} = g_k * 2**(L - 52), so any sum of n pieces of one grid stays below 2**53 g_k."""
  L = jnp.maximum(_bit_length(count), 1)
  log_g = [L + 1 - 52]
  for _ in range(folds - 1):
    log_g.append(log_g[-1] + L - 52)
  sigmas = [1.5 * _pow2(lg + 52) for lg in log_g]
  return sigmas, log_g, L


def _extract(terms, sigmas):
  """Pieces q_k of each term on grids g_k (t = q_1 + ... + q_K + remainder, exactly)."""
  pieces = [[] for _ in sigmas]
  for t in terms:
    r = t
    for k, sig in enumerate(sigmas):
      q = (r + sig) - sig
      pieces[k].append(q)
      r = r - q
  return [functools.reduce(jnp.add, ps) if len(ps) > 1 else ps[0] for ps in pieces]


# ------------------------------------------------------------------------------ the core
def _leaf_info(leaves):
  return [_FMTS[np.dtype(x.dtype)] for x in leaves]


def _system_max_keys(leaves, fmts, systems: _Systems, zero_mode: bool, want_min: bool):
  """Per-system max (or min) |x| key, NaN/inf flags and element counts."""
  s = systems.num
  best = jnp.zeros(s, jnp.uint64) if not want_min else jnp.full(s, jnp.uint64(2**64 - 1))
  has_nan = jnp.zeros(s, bool)
  has_inf = jnp.zeros(s, bool)
  count = jnp.zeros(s, jnp.int64)
  decoded = []
  for i, (x, fmt) in enumerate(zip(leaves, fmts)):
    xr = _rows(x)
    key, frac, e, zero, nonfinite, nan, neg = _decode(xr, fmt)
    decoded.append((key, frac, e, zero, nonfinite, nan, neg))
    rows, width = xr.shape
    if rows == 0 or width == 0:
      continue
    if want_min:
      k_use = jnp.where(nonfinite & ~jnp.asarray(zero_mode), jnp.uint64(2**64 - 1), key)
      red = systems.row_reduce(jnp.min(k_use, axis=1), i, "min")
      best = jnp.minimum(best, red)
    else:
      red = systems.row_reduce(jnp.max(key, axis=1), i, "max")
      best = jnp.maximum(best, red)
    flags = (jnp.any(nan, axis=1).astype(jnp.int32) * 2 +
             jnp.any(nonfinite & ~nan, axis=1).astype(jnp.int32))
    fl = systems.row_reduce(flags, i, "max") if systems.segs is None else \
        jax.ops.segment_max(flags, systems.segs[i], num_segments=s,
                            indices_are_sorted=bool(systems.sorted[i]))
    fl = jnp.maximum(fl, 0)
    has_nan = has_nan | (fl >= 2)
    has_inf = has_inf | (fl == 1)
    if systems.segs is None:
      count = count + rows * width
    else:
      count = count + jax.ops.segment_sum(jnp.full(rows, width, jnp.int64), systems.segs[i],
                                          num_segments=s,
                                          indices_are_sorted=bool(systems.sorted[i]))
  if want_min:
    best = jnp.where(count == 0, jnp.uint64(0), best)
    best = jnp.where(best == jnp.uint64(2**64 - 1), jnp.uint64(0), best)
  return best, has_nan, has_inf, count, decoded


def _terms(frac, e, k_sys, mx_frac, p: float, precise: bool):
  """Exact-or-deterministic terms (|x| / 2**(K+1))**p (each <= 1), as a list of arrays."""
  a = frac * _pow2(e - k_sys - 1)
  a = jnp.where(e - k_sys - 1 < -1000, 0.0, a)
  if p > 512.0:
    # (1/2)**p underflows: scale by the max itself, a = |x| / max (the max term is 1).
    q = frac / mx_frac
    a = q * _pow2(e - k_sys)
    a = jnp.where(e - k_sys < -1000, 0.0, a)
    if precise:
      lo = (frac - q * mx_frac) / mx_frac  # not needed to be exact: bounded below
      return list(double_double.dd_pow(jnp, jnp.where(a > 0, a, 1.0), lo * 0.0, p)), True
    return [jnp.where(a > 0, a ** p, 0.0)], True
  if p == 1.0:
    return [a], False
  if p == 2.0:
    if not precise:
      return [a * a], False  # exact: at most 24 significant bits squared
    hi, lo = double_double.two_prod(jnp, a, a)
    return [hi, lo], False
  if float(p).is_integer() and p <= 64:
    if not precise:
      t = a * a
      for _ in range(int(p) - 2):
        t = t * a
      return [t], False
    hi, lo = double_double.dd_int_power(jnp, a, int(p))
    return [hi, lo], False
  safe = jnp.where(a > 0, a, 1.0)
  if precise:
    hi, lo = double_double.dd_pow(jnp, safe, jnp.zeros_like(safe), p)
    return [jnp.where(a > 0, hi, 0.0), jnp.where(a > 0, lo, 0.0)], False
  return [jnp.where(a > 0, safe ** p, 0.0)], False


def _term_error(p: float, precise: bool, divided: bool) -> float:
  if divided:
    err = (double_double.DD_POW_REL_ERR if precise else decision.POW_REL_ERR) + p * 1.01 * \
        decision.U64
    return err * (2.0 if precise else 1.0)
  if p in (1.0, 2.0):
    return 0.0
  if float(p).is_integer() and p <= 64:
    return 2.0 ** -100 * p if precise else (p - 1) * 1.01 * decision.U64
  return double_double.DD_POW_REL_ERR if precise else decision.POW_REL_ERR


# ----------------------------------------------- fast path: no float64 leaf (32-bit ints)
# XLA on CPU runs 64-bit integer operations and integer reductions slowly (measured 10-50x
# a float reduction), so leaves of at most 32 bits are widened with float conversions, which
# are exact for normal values, and only their subnormals (which float operations would flush)
# are rebuilt from 32-bit integer fields. Maxima are then plain float maxima.
_TWO_M149 = 2.0 ** -149
_TWO_M133 = 2.0 ** -133


def _widen(x, zero_nonfinite: bool = True):
  """(|x| as an exact float64, nan, nonfinite) for a float16/bfloat16/float32 array.

  Normal values convert exactly with a float conversion; a subnormal (which the conversion
  flushes to 0) is its integer fraction field times 2**-149 (2**-133 for bfloat16), added in
  (the two terms are never both nonzero). Kept in float32 until the last step: XLA vectorises
  that far better than a 64-bit select."""
  dt = np.dtype(x.dtype)
  nan = jnp.isnan(x)
  nonfinite = ~jnp.isfinite(x)
  if dt == np.float16:
    v = jnp.abs(x.astype(jnp.float64))  # half-precision conversions keep subnormals
  elif dt == np.float32:
    ab = lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF
    sub = jnp.where(ab < 0x800000, ab.astype(jnp.float32), 0.0)
    v = jnp.abs(x).astype(jnp.float64) + sub.astype(jnp.float64) * _TWO_M149
  else:  # bfloat16
    ab = lax.bitcast_convert_type(x, jnp.int16).astype(jnp.int32) & 0x7FFF
    sub = jnp.where(ab < 0x80, ab.astype(jnp.float32), 0.0)
    v = jnp.abs(x.astype(jnp.float32)).astype(jnp.float64) + sub.astype(jnp.float64) * _TWO_M133
  if zero_nonfinite:
    v = jnp.where(nonfinite, 0.0, v)
  return v, nan, nonfinite


def _exponent_of(v):
  """e with 2**e <= v < 2**(e+1) for normal float64 v > 0 (0 for v == 0), from the bits."""
  b = lax.bitcast_convert_type(v, jnp.uint64)
  return jnp.where(v > 0, (b >> 52).astype(jnp.int32) - 1023, 0)


def _vreduce(arrays, inits, ops, axis: int = 1):
  """Several reductions over one axis in a single variadic XLA reduce (XLA on CPU runs one
  multi-output reduce far faster than separate reductions of a shared fused producer)."""
  fns = {"sum": lax.add, "max": lax.max, "min": lax.min}

  def body(a, b):
    return tuple(fns[op](u, w) for op, u, w in zip(ops, a, b))

  inits = tuple(jnp.asarray(i, a.dtype) for i, a in zip(inits, arrays))
  return lax.reduce(tuple(arrays), inits, body, (axis,))


def _system_flags(nan, nonfinite, systems: _Systems, leaf: int):
  """Per-system (has NaN, has inf) from per-element flags, with float maxima."""
  code = jnp.where(nan, 2.0, jnp.where(nonfinite, 1.0, 0.0)).astype(jnp.float32)
  fl = systems.row_reduce(jnp.max(code, axis=1), leaf, "max")
  fl = jnp.maximum(fl, 0.0)
  return fl >= 2.0, fl == 1.0


def _counts(leaves, systems: _Systems):
  if systems.counts is not None:
    return systems.counts.astype(jnp.int64)
  count = jnp.zeros(systems.num, jnp.int64)
  for i, x in enumerate(leaves):
    rows, width = _rows(x).shape
    if rows == 0 or width == 0:
      continue
    if systems.segs is None:
      count = count + rows * width
    else:
      count = count + jax.ops.segment_sum(jnp.full(rows, width, jnp.int64), systems.segs[i],
                                          num_segments=systems.num,
                                          indices_are_sorted=bool(systems.sorted[i]))
  return count


_TINY = 2.0 ** -60  # systems whose max |x| is below this take the exact-widening path


def _blocks(x, systems: _Systems):
  """(leaf index-free) 2-D views for reductions: a leaf's rows with segments; otherwise the
  flat leaf as up to _GROUP_ROWS rows plus a one-row tail (XLA on CPU reduces many rows in
  parallel, one long row serially). Slices fuse into their consumers: no copy."""
  if systems.segs is not None:
    return [_rows(x)]
  flat = x.reshape(-1)
  n = flat.shape[0]
  if n == 0:
    return []
  rows = min(_GROUP_ROWS, n)
  width = n // rows
  main = rows * width
  out = [flat[:main].reshape(rows, width)]
  if main < n:
    out.append(flat[main:].reshape(1, n - main))
  return out


def _fast_global_stats(leaves, systems: _Systems, p: float, zero_mode: bool):
  """finalize inputs of the p-norm for leaves of at most 32 bits (exact sums, see top).

  Canonical terms: a system whose max |x| is at least 2**-60 drops elements below 2**-126
  (float32 subnormals, which XLA's conversions flush; at most n (2**-66)**p relative, in the
  error bound); a smaller ("tiny") system keeps them exactly. The pass that runs depends on
  the batch (a tiny system anywhere selects the exact widening for all), the terms never do."""
  total_elements = sum(int(x.size) for x in leaves)
  s = systems.num
  count = _counts(leaves, systems)
  blocks = [_blocks(x, systems) for x in leaves]
  # Pass A: max |x| in float32 (exact for a normal max) and NaN/inf flags, one variadic reduce.
  m32 = jnp.zeros(s, jnp.float32)
  code = jnp.zeros(s, jnp.float32)
  for i, bl in enumerate(blocks):
    for xr in bl:
      ax = jnp.abs(xr).astype(jnp.float32)
      nonfinite = ~jnp.isfinite(xr)
      c = jnp.where(jnp.isnan(xr), 2.0, jnp.where(nonfinite, 1.0, 0.0)).astype(jnp.float32)
      if zero_mode:
        ax = jnp.where(nonfinite, 0.0, ax)
      red = _vreduce([ax, c], [0.0, 0.0], ["max", "max"])
      both = systems.row_reduce(jnp.stack(red, axis=1), i, "max")  # one scatter
      m32 = jnp.maximum(m32, both[:, 0])
      code = jnp.maximum(code, both[:, 1])
  code = jnp.maximum(code, 0.0)
  has_nan, has_inf = code >= 2.0, code == 1.0
  if not zero_mode:  # a poisoned system's max is irrelevant; keep it finite
    m32 = jnp.where(code > 0, 1.0, m32)
  tiny = (m32.astype(jnp.float64) < _TINY) & (count > 0)
  if math.isinf(p):
    exact = lax.cond(jnp.any(tiny) | (p < 0),
                     lambda: _exact_extreme(leaves, systems, p, zero_mode),
                     lambda: m32.astype(jnp.float64))
    ext = jnp.where(count > 0, exact, 0.0)
    ext = jnp.where(jnp.isinf(ext) | jnp.isnan(ext), 0.0, ext)
    zero = ext == 0
    e = _exponent_of(ext)
    return dict(s_hi=jnp.ones(s), s_lo=jnp.zeros(s),
                sc_m=jnp.where(zero, 0.5, ext * _pow2(-e - 1)), sc_e=jnp.where(zero, 1, e + 1),
                rel_err=jnp.zeros(s), zero=zero, nan=has_nan, inf=has_inf)
  mx = lax.cond(jnp.any(tiny), lambda: _exact_extreme(leaves, systems, 1.0, zero_mode),
                lambda: m32.astype(jnp.float64))
  if not zero_mode:
    mx = jnp.where(code > 0, 1.0, mx)
  zero = mx == 0
  k_sys = _exponent_of(mx)  # max |x| < 2**(k+1)
  divided = p > 512.0
  # Systems of up to 2**25 elements use two grids, larger ones three: a per-system rule (a
  # third grid is only computed when some system could be that large).
  folds = 3 if total_elements > (1 << 25) else 2
  sigmas, log_g, big_l = _fold_grids(count, folds)
  tiny_exact = mx < _TINY
  scale_inv = jnp.where(zero, 1.0, mx) if divided else _pow2(-k_sys - 1)

  def pass_b(widen_exact: bool):
    sums = [jnp.zeros(s) for _ in range(folds)]
    for i, bl in enumerate(blocks):
      for xr in bl:
        rows = xr.shape[0]
        if widen_exact:
          v, _, _ = _widen(xr)
          keep_sub = systems.per_row(tiny_exact, i, rows)[:, None]
          v = jnp.where(keep_sub | (v >= 2.0 ** -126), v, 0.0)
        else:
          v = jnp.where(jnp.isfinite(xr), jnp.abs(xr), 0.0).astype(jnp.float64)
        consts = systems.per_row(jnp.stack([scale_inv] + list(sigmas), axis=1), i, rows)
        f = consts[:, 0:1]
        a = v / f if divided else v * f
        t = _power_term(a, p)
        pieces = _extract([t], [consts[:, k + 1:k + 2] for k in range(folds)])
        per_row = jnp.stack(_vreduce(pieces, [0.0] * folds, ["sum"] * folds), axis=1)
        red = systems.row_reduce(per_row, i, "sum")
        sums = [acc + red[:, k] for k, acc in enumerate(sums)]
    return tuple(sums)

  sums = list(lax.cond(jnp.any(tiny), lambda: pass_b(True), lambda: pass_b(False)))
  use3 = big_l > 25
  third = jnp.where(use3, sums[2], 0.0) if folds == 3 else 0.0
  last = jnp.where(use3, log_g[2], log_g[1]) if folds == 3 else log_g[1]
  s_hi, s_lo = double_double.two_sum(jnp, sums[0], sums[1])
  s_hi, s_lo = double_double.fast_two_sum(jnp, s_hi, s_lo + third)
  trunc = count.astype(jnp.float64) * _pow2(last) * 0.5
  safe = jnp.where(s_hi > 0, s_hi, 1.0)
  # Dropped subnormals: each below (2**-126 / max)**p of the largest term.
  dropped = jnp.where(tiny_exact, 0.0, count.astype(jnp.float64) * jnp.minimum(
      2.0 ** -124 / jnp.where(zero, 1.0, mx), 1.0) ** p)
  rel = trunc / safe + dropped + 2.0 ** -100 + _term_error(p, False, divided) * 1.01
  rel = jnp.where(s_hi > 0, rel, 0.0)
  if divided:
    me = _exponent_of(jnp.where(zero, 1.0, mx))
    sc_m, sc_e = jnp.where(zero, 0.5, mx * _pow2(-me - 1)), me + 1
  else:
    sc_m, sc_e = jnp.full(s, 0.5), jnp.where(zero, 1, k_sys + 2)  # scale 2**(k+1)
  return dict(s_hi=s_hi, s_lo=s_lo, sc_m=sc_m, sc_e=sc_e, rel_err=rel,
              zero=zero | (s_hi == 0), nan=has_nan, inf=has_inf)


def _power_term(a, p: float):
  """a**p for 0 <= a <= 1 in float64 (exact for p = 1, and for p = 2 with <= 26-bit a)."""
  if p == 1.0:
    return a
  if p == 2.0:
    return a * a
  if float(p).is_integer() and p <= 64:
    t = a * a
    for _ in range(int(p) - 2):
      t = t * a
    return t
  return jnp.where(a > 0, jnp.where(a > 0, a, 1.0) ** p, 0.0)


def _exact_extreme(leaves, systems: _Systems, p: float, zero_mode: bool):
  """Exact per-system max |x| (p > 0) or min |x| (p < 0), subnormals included."""
  s = systems.num
  best = jnp.zeros(s) if p > 0 else jnp.full(s, jnp.inf)
  for i, x in enumerate(leaves):
    for xr in _blocks(x, systems):
      v, _, nonfinite = _widen(xr)
      if p > 0:
        best = jnp.maximum(best, systems.row_reduce(jnp.max(v, axis=1), i, "max"))
      else:
        vm = v if zero_mode else jnp.where(nonfinite, jnp.inf, v)
        best = jnp.minimum(best, systems.row_reduce(jnp.min(vm, axis=1), i, "min"))
  return best


def _fast_step_stats(leaves, systems: _Systems, zero_mode: bool):
  """Step norm for leaves of at most 32 bits: float64 squares never overflow or underflow,
  each vector summed in a fixed pairwise tree, maxima in float."""
  s = systems.num
  best = jnp.zeros(s)
  has_nan = jnp.zeros(s, bool)
  has_inf = jnp.zeros(s, bool)
  max_d = 1
  for i, x in enumerate(leaves):
    rows = x.shape[0] if x.ndim else 1
    d = x.shape[-1] if x.ndim >= 2 else 1
    if x.size == 0:
      continue
    max_d = max(max_d, d)
    vec = x.reshape(rows, math.prod(x.shape[1:-1]) if x.ndim >= 2 else 1, d)
    v, nan, nonfinite = _widen(vec)
    sq = _pairwise_sum_last(v * v)
    if not zero_mode:
      sq = jnp.where(jnp.any(nonfinite, axis=-1), 0.0, sq)
    best = jnp.maximum(best, systems.row_reduce(jnp.max(sq, axis=1), i, "max"))
    hn, hi = _system_flags(nan.reshape(rows, -1), nonfinite.reshape(rows, -1), systems, i)
    has_nan, has_inf = has_nan | hn, has_inf | (hi & ~hn)
  rel = float(decision.sum_rel_err(max_d, 0.0)) + 2.0 ** -100
  zero = best == 0
  return dict(s_hi=best, s_lo=jnp.zeros(s), sc_m=jnp.full(s, 0.5), sc_e=jnp.ones(s, jnp.int32),
              rel_err=jnp.full(s, rel), zero=zero, nan=has_nan, inf=has_inf)


def _fast_apply_leaf(x, act, s_val, zero_mode: bool):
  """Output of one leaf of at most 32 bits: keep (bitwise), NaN, or RTZ(x * s) with s of 29
  bits, so x * s is exact in float64; the rounding into the leaf dtype uses 32-bit ints."""
  dt = np.dtype(x.dtype)
  v, nan, nonfinite = _widen(x)
  y = v * s_val  # exact
  # float32 RTZ bits of y: normal range by a float conversion and a one-ulp fix-up; the
  # float32 subnormal range (which the conversion would flush) by integer truncation.
  q = y.astype(jnp.float32)
  qb = lax.bitcast_convert_type(q, jnp.uint32)
  qb = qb - (q.astype(jnp.float64) > y).astype(jnp.uint32)
  sub_units = jnp.floor(y * 2.0 ** 149).astype(jnp.int32).astype(jnp.uint32)
  f32b = jnp.where(y < 2.0 ** -126, sub_units, qb)
  f32b = jnp.where(y < 2.0 ** -149, jnp.uint32(0), f32b)
  if dt == np.float32:
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits & 0x80000000
    scaled = f32b | sign
    nan_bits = jnp.uint32(0x7FC00000)
    zero_bits = jnp.uint32(0)
  elif dt == _BF16:
    bits = lax.bitcast_convert_type(x, jnp.uint16)
    sign = bits & 0x8000
    scaled = (f32b >> 16).astype(jnp.uint16) | sign
    nan_bits = jnp.uint16(0x7FC0)
    zero_bits = jnp.uint16(0)
  else:  # float16: from the RTZ float32 bits, truncating the fraction (or to subnormal units)
    bits = lax.bitcast_convert_type(x, jnp.uint16)
    sign = bits & 0x8000
    e = ((f32b >> 23) & 0xFF).astype(jnp.int32) - 127
    normal = ((e + 15) << 10).astype(jnp.uint32) | ((f32b & 0x7FFFFF) >> 13)
    subn = jnp.floor(y * 2.0 ** 24).astype(jnp.int32).astype(jnp.uint32)
    h = jnp.where(e >= -14, normal, subn)
    scaled = h.astype(jnp.uint16) | sign
    nan_bits = jnp.uint16(0x7E00)
    zero_bits = jnp.uint16(0)
  out = jnp.where(act == decision.KEEP, bits, scaled)
  out = jnp.where(act == decision.NAN_FILL, nan_bits, out)
  if zero_mode:
    out = jnp.where(nonfinite, zero_bits, out)
  return lax.bitcast_convert_type(out, x.dtype)


_GROUP_ROWS = 1024


def _grouped(leaves, fmts, systems: _Systems):
  """With one system (segments=None), the leaves of each dtype as one zero-padded
  (rows, width) block: one decode/extract chain per dtype keeps the XLA graph (and its compile
  time) small for models with hundreds of leaves, and XLA on CPU reduces many rows in parallel
  but one long row serially. Sums are exact and zeros add nothing, so no bit changes."""
  if systems.segs is not None:
    return leaves, fmts
  groups: dict[np.dtype, list] = {}
  for x in leaves:
    if x.size:
      groups.setdefault(np.dtype(x.dtype), []).append(x.reshape(-1))
  out = []
  for dt, parts in groups.items():
    flat = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    n = flat.shape[0]
    rows = min(_GROUP_ROWS, n)
    width = -(-n // rows)
    if rows * width != n:
      flat = jnp.concatenate([flat, jnp.zeros(rows * width - n, flat.dtype)])
    out.append(flat.reshape(rows, width))
  return out, [_FMTS[k] for k in groups]


def _global_stats(leaves, fmts, systems: _Systems, p: float, zero_mode: bool, precise: bool):
  """finalize inputs for the p-norm of every system (exact sums, see the docstring)."""
  leaves, fmts = _grouped(leaves, fmts, systems)
  if math.isinf(p):
    best, has_nan, has_inf, count, _ = _system_max_keys(leaves, fmts, systems, zero_mode,
                                                        p < 0)
    frac, e = _key_value(best)
    zero = best == 0
    one = jnp.ones(systems.num)
    return dict(s_hi=one, s_lo=jnp.zeros(systems.num), sc_m=jnp.where(zero, 0.5, frac * 0.5),
                sc_e=jnp.where(zero, 1, e + 1), rel_err=jnp.zeros(systems.num), zero=zero,
                nan=has_nan, inf=has_inf)
  best, has_nan, has_inf, count, decoded = _system_max_keys(leaves, fmts, systems, zero_mode,
                                                            False)
  mx_frac, k_sys = _key_value(best)
  zero = best == 0
  folds = 4 if precise else 3
  sigmas, log_g, big_l = _fold_grids(count, folds)
  sums = [jnp.zeros(systems.num) for _ in range(folds)]
  divided = False
  for i, (x, (key, frac, e, zz, nonfinite, nan, neg)) in enumerate(zip(leaves, decoded)):
    rows, width = frac.shape
    if rows == 0 or width == 0:
      continue
    k_row = systems.per_row(k_sys, i, rows)[:, None]
    mx_row = systems.per_row(jnp.where(zero, 1.0, mx_frac), i, rows)[:, None]
    terms, divided = _terms(frac, e, k_row, mx_row, p, precise)
    terms = [jnp.where(zz | nonfinite, 0.0, t) for t in terms]
    sig_rows = [systems.per_row(sg, i, rows)[:, None] for sg in sigmas]
    pieces = _extract(terms, sig_rows)
    per_row = jnp.stack([jnp.sum(q, axis=1) for q in pieces], axis=1)  # exact sums
    red = systems.row_reduce(per_row, i, "sum")
    sums = [acc + red[:, k] for k, acc in enumerate(sums)]
  # Systems of at most 2**25 elements use two grids, larger ones three (four with float64
  # leaves): a per-system rule, so a small system's bits never depend on a big neighbour.
  use3 = big_l > 25
  if not precise:
    sums[2] = jnp.where(use3, sums[2], 0.0)
    last = jnp.where(use3, log_g[2], log_g[1])
  else:
    last = log_g[3]
  s_hi, s_lo = double_double.two_sum(jnp, sums[0], sums[1])
  for extra in sums[2:]:
    s_lo = s_lo + extra  # tiny pieces; their rounding is covered by the 2**-100 below
  s_hi, s_lo = double_double.fast_two_sum(jnp, s_hi, s_lo)
  # |S - S_hat| <= n * g_last / 2 (truncation) + the term errors; S_hat >= max term >= 2**-2p.
  trunc = count.astype(jnp.float64) * _pow2(last) * 0.5 + count * 2.0 ** -1000
  safe = jnp.where(s_hi > 0, s_hi, 1.0)
  rel = trunc / safe + 2.0 ** -100 + _term_error(p, precise, divided) * 1.01
  rel = jnp.where(s_hi > 0, rel, 0.0)
  if divided:
    sc_m, sc_e = jnp.where(zero, 0.5, mx_frac * 0.5), jnp.where(zero, 1, k_sys + 1)
  else:
    sc_m, sc_e = jnp.full(systems.num, 0.5), jnp.where(zero, 1, k_sys + 2)  # scale 2**(K+1)
  return dict(s_hi=s_hi, s_lo=s_lo, sc_m=sc_m, sc_e=sc_e, rel_err=rel, zero=zero | (s_hi == 0),
              nan=has_nan, inf=has_inf)


def _pairwise_sum_last(v):
  """Sum over the last axis in a fixed pairwise tree (elementwise adds: deterministic)."""
  d = v.shape[-1]
  width = 1 << max(0, (d - 1).bit_length())
  if width != d:
    v = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (width - d,), v.dtype)], axis=-1)
  while v.shape[-1] > 1:
    h = v.shape[-1] // 2
    v = v[..., :h] + v[..., h:]
  return v[..., 0]


def _pairwise_dd_sum_last(hi, lo):
  d = hi.shape[-1]
  width = 1 << max(0, (d - 1).bit_length())
  if width != d:
    pad = jnp.zeros(hi.shape[:-1] + (width - d,), hi.dtype)
    hi = jnp.concatenate([hi, pad], axis=-1)
    lo = jnp.concatenate([lo, pad], axis=-1)
  while hi.shape[-1] > 1:
    h = hi.shape[-1] // 2
    s, e = double_double.two_sum(jnp, hi[..., :h], hi[..., h:])
    hi, lo = s, e + (lo[..., :h] + lo[..., h:])
  return hi[..., 0], lo[..., 0]


def _step_stats(leaves, fmts, systems: _Systems, zero_mode: bool, precise: bool):
  """finalize inputs for the step norm: the largest vector's sum of squares per system.

  Each vector is scaled by a power of two from its own largest element and its squares are
  added in a fixed pairwise tree (double-double with float64 leaves); vectors are compared by
  an exact integer key of the scaled sum and its exponent, ties broken by the low part."""
  s = systems.num
  best_key = jnp.zeros(s, jnp.uint64)
  has_nan = jnp.zeros(s, bool)
  has_inf = jnp.zeros(s, bool)
  per_leaf = []
  max_d = 1
  f64 = _FMTS[np.dtype(np.float64)]
  for i, (x, fmt) in enumerate(zip(leaves, fmts)):
    rows = x.shape[0] if x.ndim else 1
    d = x.shape[-1] if x.ndim >= 2 else 1
    vec = x.reshape(rows, math.prod(x.shape[1:-1]) if x.ndim >= 2 else 1, d)
    max_d = max(max_d, d)
    if vec.size == 0:
      per_leaf.append(None)
      continue
    key, frac, e, zz, nonfinite, nan, neg = _decode(vec, fmt)
    vmax = jnp.max(jnp.where(nonfinite, jnp.uint64(0), key), axis=-1)
    _, ve = _key_value(vmax)
    a = frac * _pow2(e - ve[..., None] - 1)
    a = jnp.where(zz | nonfinite | (e - ve[..., None] - 1 < -1000), 0.0, a)
    if precise:
      t_hi, t_lo = double_double.two_prod(jnp, a, a)
      v_hi, v_lo = _pairwise_dd_sum_last(t_hi, t_lo)
      v_hi, v_lo = double_double.fast_two_sum(jnp, v_hi, v_lo)
    else:
      v_hi = _pairwise_sum_last(a * a)
      v_lo = jnp.zeros_like(v_hi)
    vbad = jnp.any(nonfinite, axis=-1)
    # The vector's value is v * 4**(ve + 1), v in [1/4, d): key on (total exponent, v's bits).
    vk, _, vexp, vzero, _, _, _ = _decode(v_hi, f64)
    tot_e = vexp + 2 * (ve + 1)
    key_v = (_u64(tot_e + 2 * _KEY_BIAS) << 52) | (vk & ((1 << 52) - 1))
    drop = vzero | (vmax == 0) | (vbad & (not zero_mode))
    key_v = jnp.where(drop, jnp.uint64(0), key_v)
    best_key = jnp.maximum(best_key, systems.row_reduce(jnp.max(key_v, axis=1), i, "max"))
    flags = (jnp.any(nan, axis=(1, 2)).astype(jnp.int32) * 2 +
             jnp.any(nonfinite & ~nan, axis=(1, 2)).astype(jnp.int32))
    fl = jnp.maximum(systems.row_reduce(flags, i, "max"), 0)
    has_nan = has_nan | (fl >= 2)
    has_inf = has_inf | (fl == 1)
    rel_lo = jnp.where(v_hi > 0, v_lo / jnp.where(v_hi > 0, v_hi, 1.0), 0.0)
    per_leaf.append((key_v, rel_lo, rows))
  best_rel = jnp.zeros(s)
  if precise:
    best_rel = jnp.full(s, -jnp.inf)
    for i, item in enumerate(per_leaf):
      if item is None:
        continue
      key_v, rel_lo, rows = item
      bk = systems.per_row(best_key, i, rows)[:, None]
      cand = jnp.where((key_v == bk) & (bk > 0), rel_lo, -jnp.inf)
      best_rel = jnp.maximum(best_rel, systems.row_reduce(jnp.max(cand, axis=1), i, "max"))
    best_rel = jnp.where(jnp.isfinite(best_rel), best_rel, 0.0)
  zero = best_key == 0
  frac, _ = _key_value(best_key)
  tot_e = (best_key >> 52).astype(jnp.int32) - 2 * _KEY_BIAS
  # S = frac (1 + rel) 2**tot_e, frac in [1, 2): S = S' 4**K with S' in [1, 4).
  k = jnp.floor_divide(tot_e, 2)
  s_hi = jnp.where(zero, 0.0, frac * _pow2(tot_e - 2 * k))
  s_lo = s_hi * best_rel
  rel = float(decision.sum_rel_err(max_d, 0.0, dd=precise)) + 2.0 ** -100
  return dict(s_hi=s_hi, s_lo=s_lo, sc_m=jnp.full(s, 0.5), sc_e=jnp.where(zero, 1, k + 1),
              rel_err=jnp.full(s, rel), zero=zero, nan=has_nan, inf=has_inf)


# ---------------------------------------------------------------------- exact tie fallback
_LAYOUTS = {np.dtype(np.float16): (16, 10, 15), _BF16: (16, 7, 127),
            np.dtype(np.float32): (32, 23, 127), np.dtype(np.float64): (64, 52, 1023)}


def _host_ties(cfg, tie, c_bits, segs, *leaf_bits):
  """Host side of the near-tie fallback: 1 where the exact norm exceeds c, else 0.

  It runs on an XLA thread that flushes subnormals in float operations, so it works on the
  raw bits with integers only (non-finite elements count as 0: zero mode; in propagate mode a
  system holding them is never a tie)."""
  op, p, zero_mode, num_systems, _, _, dtypes = cfg
  del zero_mode
  tie = np.asarray(tie)
  out = np.zeros(num_systems, dtype=np.int8)
  if not tie.any():
    return out
  c_words = np.ascontiguousarray(np.asarray(c_bits)).view(np.uint64).reshape(num_systems)
  seg_list = None if segs is None else [np.asarray(s) for s in segs]
  decoded = []
  for bits, dt in zip(leaf_bits, dtypes):
    bits = np.asarray(bits)
    m, e = exact.magnitudes_from_bits(bits, _LAYOUTS[np.dtype(dt)])
    nrows = bits.shape[0] if bits.ndim else 1
    d = bits.shape[-1] if (op == "step" and bits.ndim >= 2) else 1
    shape = (nrows, math.prod(bits.shape[1:]) // d if bits.ndim else 1, d)
    decoded.append((m.reshape(shape), e.reshape(shape)))
  for k in np.flatnonzero(tie).tolist():
    c_k = exact.fraction_of_bits(int(c_words[k]))
    ms, es = [], []
    for i, (m, e) in enumerate(decoded):
      if seg_list is not None:
        m, e = m[seg_list[i] == k], e[seg_list[i] == k]
      ms.append(m)
      es.append(e)
    if op == "step":
      signs = [exact.exact_step_compare(m.reshape(-1, m.shape[-1]), e.reshape(-1, m.shape[-1]),
                                           c_k) for m, e in zip(ms, es) if m.size]
      cmp = max(signs, default=-1)
    else:
      cmp = exact.exact_compare(np.concatenate([m.ravel() for m in ms]) if ms else
                                   np.zeros(0, np.int64),
                                   np.concatenate([e.ravel() for e in es]) if es else
                                   np.zeros(0, np.int64), p, c_k)
    out[k] = 1 if cmp > 0 else 0
  return out


def _threshold_bits(c_m, c_e):
  """float64 bits of c = c_m * 2**c_e (c_m in [0.5, 1) or 0), subnormals included, built
  with integer operations."""
  key, frac, e, zero, _, _, _ = _decode(c_m, _FMTS[np.dtype(np.float64)])
  m53 = key & ((1 << 52) - 1) | (1 << 52)
  ev = c_e.astype(jnp.int32) - 1  # c = (m53 / 2**52) * 2**(c_e - 1)
  sub_shift = jnp.clip(-1022 - ev, 0, 63).astype(jnp.uint64)
  bits = jnp.where(ev >= -1022, (_u64(ev + 1023) << 52) | (m53 & ((1 << 52) - 1)),
                   m53 >> sub_shift)
  return jnp.where(c_m == 0, jnp.uint64(0), bits)


def _resolve_ties(cfg, tie, action, c_m, c_e, leaves, segs):
  """action with near-ties decided exactly (a host callback, run only if a tie exists)."""
  op, p, zero_mode, num_systems, _, _, dtypes = cfg
  # Float64 crosses to the host as raw bits: with x64 off at run time JAX would round a
  # float64 callback operand to float32.
  # Two uint32 words by shifts (a width-changing bitcast does not lower with x64 off, which
  # is how an enclosing jax.jit lowers this graph).
  words = _threshold_bits(c_m, c_e)
  c_bits = jnp.stack([lax.convert_element_type(words & 0xFFFFFFFF, jnp.uint32),
                      lax.convert_element_type(words >> 32, jnp.uint32)], axis=-1)
  leaf_bits = [_bits_of(x, _FMTS[np.dtype(x.dtype)]) for x in leaves]

  def call():
    res = jax.pure_callback(
        functools.partial(_host_ties, cfg), jax.ShapeDtypeStruct((num_systems,), jnp.int8),
        tie, c_bits, segs, *leaf_bits, vmap_method="sequential")
    decided = jnp.where(res > 0, jnp.int8(decision.SCALE), jnp.int8(decision.KEEP))
    return jnp.where(tie, decided, action)

  return lax.cond(jnp.any(tie), call, lambda: action)


# ------------------------------------------------------------------------------ apply pass
def _apply_leaf(x, fmt: _Fmt, act, s_m, s_e, zero_mode: bool, precise: bool):
  """Output bits of one leaf: bitwise copy (keep), NaN (poisoned) or RTZ(x * s) (scale)."""
  key, frac, e, zz, nonfinite, nan, neg = _decode(x, fmt)
  bits = _bits_of(x, fmt)
  if precise:
    p_hi, p_lo = double_double.two_prod(jnp, frac, s_m)
  else:
    p_hi, p_lo = frac * s_m, jnp.zeros_like(frac)  # exact: <= 24 x 29 bits
  scaled = _rtz_bits(p_hi, p_lo, e + s_e, fmt)
  scaled = jnp.where(zz, jnp.uint64(0), scaled) | (_u64(neg) << (fmt.nbits - 1))
  scaled = lax.convert_element_type(scaled, fmt.udtype)
  nan_bits = {16: 0x7E00 if fmt.mbits == 10 else 0x7FC0, 32: 0x7FC00000,
              64: 0x7FF8000000000000}[fmt.nbits]
  out = jnp.where(act == decision.KEEP, bits, scaled)
  out = jnp.where(act == decision.NAN_FILL, jnp.asarray(nan_bits, fmt.udtype), out)
  if zero_mode:
    out = jnp.where(nonfinite, jnp.asarray(0, fmt.udtype), out)
  return lax.bitcast_convert_type(out, x.dtype)


# --------------------------------------------------------------------------------- forward
def _forward(cfg, leaves, segs, counts, c_m, c_e, c_inf):
  """(outputs, norms, action, s_m, s_e): the whole operation (traceable, under x64)."""
  op, p, zero_mode, num_systems, sorted_flags, precise, _ = cfg
  fmts = _leaf_info(leaves)
  systems = _Systems(segs, num_systems, sorted_flags, counts)
  if op == "step":
    st = (_step_stats(leaves, fmts, systems, zero_mode, precise) if precise else
          _fast_step_stats(leaves, systems, zero_mode))
    p_eff = 2.0
  else:
    st = (_global_stats(leaves, fmts, systems, p, zero_mode, precise) if precise else
          _fast_global_stats(leaves, systems, p, zero_mode))
    p_eff = p
  nan = st["nan"] & (not zero_mode)
  inf = st["inf"] & ~nan & (not zero_mode)
  norm_v, action, s_m, s_e, tie = decision.finalize(
      jnp, s_hi=st["s_hi"], s_lo=st["s_lo"], sc_m=st["sc_m"], sc_e=st["sc_e"],
      rel_err=st["rel_err"], zero=st["zero"], nan=nan, inf=inf, c_m=c_m, c_e=c_e,
      c_inf=c_inf, p=p_eff, precise=precise)
  action = _resolve_ties(cfg, tie, action, c_m, c_e, leaves, segs)
  norm_fmt = _FMTS[np.dtype(np.float64 if precise else np.float32)]
  norm_dtype = jnp.float64 if precise else jnp.float32
  nb = _round_nearest_bits(jnp.where(st["zero"], 0.0, norm_v), st["sc_e"], norm_fmt)
  norms = lax.bitcast_convert_type(nb, norm_dtype)
  norms = jnp.where(inf, jnp.asarray(jnp.inf, norm_dtype), norms)
  norms = jnp.where(nan, jnp.asarray(jnp.nan, norm_dtype), norms)
  outs = []
  s_val = jnp.where(s_e < -1021, 0.0, s_m * _pow2(s_e))  # (29-bit s; tiny s: all outputs 0)
  for i, (x, fmt) in enumerate(zip(leaves, fmts)):
    xr = _rows(x)
    rows = xr.shape[0]
    if systems.segs is None:
      act, sv = action[0], s_val[0]
      sm, se = s_m[0], s_e[0]
    elif precise:
      act = systems.per_row(action, i, rows)[:, None]
      sm = systems.per_row(s_m, i, rows)[:, None]
      se = systems.per_row(s_e, i, rows)[:, None]
    else:  # one gather: the action rides along as a float
      both = systems.per_row(jnp.stack([action.astype(jnp.float64), s_val], axis=1), i, rows)
      act, sv = both[:, 0:1].astype(jnp.int8), both[:, 1:2]
    if precise:
      out = _apply_leaf(xr, fmt, act, sm, se, zero_mode, precise)
    else:
      out = _fast_apply_leaf(xr, act, sv, zero_mode)
    outs.append(out.reshape(x.shape))
  return tuple(outs), norms, action, s_m, s_e, st


# ---------------------------------------------------------------------------- the gradient
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _clip(cfg, leaves, segs, counts, c_m, c_e, c_inf):
  outs, norms, *_ = _forward(cfg, leaves, segs, counts, c_m, c_e, c_inf)
  return outs, norms


@_clip.defjvp
def _clip_jvp(cfg, primals, tangents):
  """Identity where a system is kept; d(x c / n(x)) where it is clipped (finite p); the
  factor held fixed for p = +-inf and max-step; zero for NaN-filled systems. Every
  coefficient is finite (made safe where unused), so reverse mode never meets 0 * inf."""
  op, p, zero_mode, num_systems, sorted_flags, precise, _ = cfg
  leaves, segs, counts, c_m, c_e, c_inf = primals
  t_leaves = tangents[0]
  outs, norms, action, s_m, s_e, st = _forward(cfg, leaves, segs, counts, c_m, c_e, c_inf)
  systems = _Systems(segs, num_systems, sorted_flags, counts)
  clipped = action == decision.SCALE
  s_val = jnp.where(clipped, s_m * _pow2(s_e), 0.0)
  exact_p = op != "step" and not math.isinf(p)
  k_sys = st["sc_e"] - 1  # terms were scaled by 2**k (exact power of two)
  if exact_p:
    # d n / n = sum(|a|^(p-1) sign(a) t 2**-k) / sum(|a|^p), a = x 2**-k.
    sums = jnp.zeros(num_systems)
    coefs = []
    for i, (x, t) in enumerate(zip(leaves, t_leaves)):
      xr = _rows(x).astype(jnp.float64)
      rows = xr.shape[0]
      clip_row = systems.per_row(clipped, i, rows)[:, None]
      scale = systems.per_row(_pow2(-k_sys), i, rows)[:, None]
      a = jnp.where(clip_row & jnp.isfinite(xr), xr * scale, 0.0)
      sums = sums + systems.row_reduce(jnp.sum(jnp.abs(a) ** p, axis=1), i, "sum")
      coefs.append((jnp.abs(a) ** (p - 1.0)) * jnp.sign(a) * scale)
    inv = jnp.where(clipped & (sums > 0), 1.0 / jnp.where(sums > 0, sums, 1.0), 0.0)
    dots = jnp.zeros(num_systems)
    for i, (x, t, coef) in enumerate(zip(leaves, t_leaves, coefs)):
      tr = _rows(t).astype(jnp.float64)
      rows = tr.shape[0]
      dots = dots + systems.row_reduce(jnp.sum(coef * tr, axis=1), i, "sum")
    rel = dots * inv  # d n / n per system (0 where not clipped)
  t_outs = []
  for i, (x, t) in enumerate(zip(leaves, t_leaves)):
    xr = _rows(x)
    tr = _rows(t)
    rows = xr.shape[0]
    keep_row = systems.per_row(action == decision.KEEP, i, rows)[:, None]
    s_row = systems.per_row(s_val, i, rows)[:, None]
    scaled = tr.astype(jnp.float64) * s_row
    if exact_p:
      rel_row = systems.per_row(rel, i, rows)[:, None]
      x_safe = jnp.where(jnp.isfinite(xr), xr.astype(jnp.float64), 0.0)
      scaled = scaled - x_safe * (s_row * rel_row)
    out = jnp.where(keep_row, tr, scaled.astype(t.dtype))
    if zero_mode:
      out = jnp.where(jnp.isfinite(xr), out, jnp.zeros_like(out))
    t_outs.append(out.reshape(x.shape))
  t_norms = jnp.zeros_like(norms)
  return (outs, norms), (tuple(t_outs), t_norms)


_clip_jit = jax.jit(_clip, static_argnums=(0,))


# ------------------------------------------------------------------------------- host side
def _is_array(a) -> bool:
  return hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, (bool, int, float))


def _concrete(a) -> bool:
  return not isinstance(a, jax.core.Tracer)


def _check(leaves, segments, num_systems, per_system: bool):
  """Rules 9 and 13 on what is concrete; returns (leaves, segs, count, sorted flags)."""
  leaves = validation.check_leaves(leaves, _is_array)
  leaves = [jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in leaves]
  if not per_system:
    return leaves, (None, None), 1, ()
  count = validation.check_num_systems(segments, num_systems, len(leaves))
  if count is None:
    return leaves, (None, None), 1, ()
  segs, flags = [], []
  counts = np.zeros(count, dtype=np.int64)
  for i, (leaf, seg) in enumerate(zip(leaves, segments)):
    if not _is_array(seg):
      seg = np.asarray(seg)
    validation.check_segment(i, tuple(leaf.shape), tuple(seg.shape), seg.dtype)
    is_sorted = False
    if _concrete(seg):
      host = np.asarray(seg)
      if host.size:
        lo, hi = int(host.min()), int(host.max())
        validation.check_segment_range(i, lo, hi, count, host if (lo < 0 or hi >= count)
                                     else None)
        is_sorted = bool(np.all(host[1:] >= host[:-1]))
        if counts is not None:
          width = math.prod(leaf.shape[1:])
          counts += np.bincount(host, minlength=count)[:count] * width
      else:
        is_sorted = True
    else:
      counts = None  # traced ids: counted in the graph
    segs.append(jnp.asarray(seg).astype(jnp.int32) if seg.dtype != jnp.int32 else
                jnp.asarray(seg))
    flags.append(is_sorted)
  return leaves, (tuple(segs), counts), count, tuple(flags)


def _threshold(value, name: str, count: int | None):
  """(c_m, c_e, c_inf) per system, exact; a traced threshold is taken as max(c, 0)."""
  s = 1 if count is None else count
  if isinstance(value, jax.core.Tracer):
    with jax.enable_x64(True):
      c = jnp.broadcast_to(jnp.asarray(value, jnp.float64), (s,))
      c = jnp.where(jnp.isnan(c) | (c < 0), 0.0, c)
      c_inf = jnp.isinf(c)
      key, frac, e, zero, nonfinite, nan, neg = _decode(c, _FMTS[np.dtype(np.float64)])
      return jnp.where(zero | c_inf, 0.0, frac * 0.5), jnp.where(zero, 0, e + 1), c_inf
  if _is_array(value) and not isinstance(value, np.ndarray):
    value = np.asarray(value)
  c = validation.check_threshold(value, name, count)
  c = np.broadcast_to(np.asarray(c, dtype=np.float64), (s,))
  c_m, c_e, c_inf = exact.exact_frexp(c)
  return c_m, c_e, c_inf


def _run(op, leaves, segs_counts, count, sorted_flags, thr, p, nonfinite):
  segs, counts = segs_counts
  dtypes = tuple(np.dtype(x.dtype) for x in leaves)
  precise = any(d == np.float64 for d in dtypes)
  cfg = (op, float(p), nonfinite == "zero", int(count), tuple(sorted_flags), precise, dtypes)
  c_m, c_e, c_inf = thr
  with jax.enable_x64(True):
    c_m = jnp.asarray(c_m, jnp.float64)
    c_e = jnp.asarray(c_e, jnp.int32)
    c_inf = jnp.asarray(c_inf, bool)
    counts = None if counts is None else jnp.asarray(counts, jnp.int64)
    outs, norms = _clip_jit(cfg, tuple(leaves), segs, counts, c_m, c_e, c_inf)
  return list(outs), norms


def clip_by_global_norm(leaves: Sequence[Any], max_norm: Any, *, segments: Any = None,
                        num_systems: Any = None, norm_type: Any = 2.0,
                        nonfinite: str = "propagate"):
  """Per-system p-norm clipping; see the module docstring."""
  leaves, segs, count, srt = _check(leaves, segments, num_systems, True)
  thr = _threshold(max_norm, "max_norm", count)
  p = validation.check_norm_type(norm_type)
  nonfinite = validation.check_nonfinite(nonfinite)
  return _run("norm", leaves, segs, count, srt, thr, p, nonfinite)


def clip_by_max_step(leaves: Sequence[Any], max_step: Any, *, segments: Any = None,
                     num_systems: Any = None, nonfinite: str = "propagate"):
  """Per-system max-step clipping: the largest last-axis vector norm is at most max_step."""
  leaves, segs, count, srt = _check(leaves, segments, num_systems, True)
  thr = _threshold(max_step, "max_step", count)
  nonfinite = validation.check_nonfinite(nonfinite)
  return _run("step", leaves, segs, count, srt, thr, 2.0, nonfinite)


def clip_grad_norm(leaves: Sequence[Any], max_norm: Any, *, norm_type: Any = 2.0,
                   nonfinite: str = "propagate"):
  """Global p-norm clipping of all leaves together; returns the leaves and the 0-d norm."""
  leaves, _, _, _ = _check(leaves, None, None, False)
  thr = _threshold(max_norm, "max_norm", None)
  p = validation.check_norm_type(norm_type)
  nonfinite = validation.check_nonfinite(nonfinite)
  outs, norms = _run("norm", leaves, (None, None), 1, (), thr, p, nonfinite)
  return outs, norms.reshape(())


class _Implementation:
  """The registry object (``clipbench.impls.own.jax_kernels:implementation``)."""

  framework = framework
  version = version
  description = description
  capabilities = capabilities
  clip_by_global_norm = staticmethod(clip_by_global_norm)
  clip_by_max_step = staticmethod(clip_by_max_step)
  clip_grad_norm = staticmethod(clip_grad_norm)


implementation = _Implementation()
