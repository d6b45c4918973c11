"""Numerics shared by our own implementations: the per-system decision and the exact fallback.

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

All double-double arithmetic uses Dekker's splitting (no fused multiply-add, which neither
numpy nor XLA exposes); XLA does not contract ``a*b - p`` (checked against numpy bit for bit).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Sequence

import numpy as np

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


# ----------------------------------------------------------------------- double-double pieces
def split(xp: Any, a):
  """Veltkamp split: a = hi + lo with hi, lo of at most 26 significant bits (|a| < 2**995)."""
  c = 134217729.0 * a
  hi = c - (c - a)
  return hi, a - hi


def two_prod(xp: Any, a, b):
  """p + e == a * b exactly (Dekker), for moderate a, b (no overflow or underflow)."""
  p = a * b
  ah, al = split(xp, a)
  bh, bl = split(xp, b)
  return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def fast_two_sum(xp: Any, a, b):
  """s + e == a + b exactly, for |a| >= |b| (or a == 0)."""
  s = a + b
  return s, b - (s - a)


def two_sum(xp: Any, a, b):
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def dd_mul(xp: Any, ahi, alo, bhi, blo):
  p, e = two_prod(xp, ahi, bhi)
  e = e + (ahi * blo + alo * bhi)
  return fast_two_sum(xp, p, e)


def dd_int_power(xp: Any, r, n: int):
  """r**n as a double-double (relative error ~ n * 2**-104), for integer n >= 1."""
  hi, lo = r, xp.zeros_like(r)
  acc_hi, acc_lo = None, None
  while n:
    if n & 1:
      if acc_hi is None:
        acc_hi, acc_lo = hi, lo
      else:
        acc_hi, acc_lo = dd_mul(xp, acc_hi, acc_lo, hi, lo)
    n >>= 1
    if n:
      hi, lo = dd_mul(xp, hi, lo, hi, lo)
  return acc_hi, acc_lo


def pow2(xp: Any, e):
  """2.0**e exactly for integer arrays e in [-1022, 1023], built from the exponent bits."""
  if xp is np:
    return np.ldexp(1.0, e.astype(np.int32))
  from jax import lax  # pylint: disable=import-outside-toplevel
  return lax.bitcast_convert_type((e.astype(xp.int64) + 1023) << 52, xp.float64)


def frexp(xp: Any, v):
  """(m, e) with v = m * 2**e, m in [0.5, 1) (0 for v == 0), for normal float64 v >= 0.

  JAX: from the bits (jnp.frexp does not lower inside an enclosing jit with x64 off)."""
  if xp is np:
    return np.frexp(v)
  from jax import lax  # pylint: disable=import-outside-toplevel
  b = lax.bitcast_convert_type(v, xp.uint64)
  e = (b >> 52).astype(xp.int32) - 1022
  m = lax.bitcast_convert_type((b & ((1 << 52) - 1)) | (1022 << 52), xp.float64)
  zero = v == 0
  return xp.where(zero, 0.0, m), xp.where(zero, 0, e)


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


# Double-double exp/log/pow for non-integer p: the root's Newton step and (float64 leaves)
# each |x|**p are then accurate to ~2**-95, so no libm pow error enters the bounds.
LN2_HI = 0.6931471805599453
LN2_LO = 2.3190468138462996e-17
_EXP_SQUARINGS = 4  # |r| <= ln2/2 / 16 < 0.022; each squaring doubles the relative error


def _dd_const(q: Fraction) -> tuple[float, float]:
  hi = float(q)
  return hi, float(q - Fraction(hi))


# Taylor coefficients 1/k! (k = 16..2) as double-doubles: r**16/16! < 2**-110 for |r| < 0.022.
_EXP_COEFFS = tuple(_dd_const(Fraction(1, math.factorial(k))) for k in range(16, 1, -1))
DD_POW_REL_ERR = 2.0 ** -90


def dd_add_d(xp: Any, hi, lo, d):
  """(hi + lo) + d in double-double."""
  s, e = two_sum(xp, hi, d)
  return fast_two_sum(xp, s, e + lo)


def dd_exp(xp: Any, h, l):
  """exp(h + l) as a double-double, for -700 < h < 700 (moderate results only)."""
  k = xp.floor(h / LN2_HI + 0.5)
  p1, e1 = two_prod(xp, k, LN2_HI)
  r_hi, r_lo = two_sum(xp, h, -p1)
  r_hi, r_lo = fast_two_sum(xp, r_hi, r_lo + (l - e1 - k * LN2_LO))
  r_hi = r_hi * 2.0 ** -_EXP_SQUARINGS
  r_lo = r_lo * 2.0 ** -_EXP_SQUARINGS
  # exp(r) - 1 by Horner in double-double (coefficients past 1/2 need no extra precision).
  zero = xp.zeros_like(h)
  a_hi, a_lo = zero + _EXP_COEFFS[0][0], zero + _EXP_COEFFS[0][1]
  for c_hi, c_lo in _EXP_COEFFS[1:]:
    a_hi, a_lo = dd_mul(xp, a_hi, a_lo, r_hi, r_lo)
    a_hi, a_lo = dd_add_d(xp, a_hi, a_lo + c_lo, zero + c_hi)
  a_hi, a_lo = dd_mul(xp, a_hi, a_lo, r_hi, r_lo)   # r/2 + r^2/6 + ...
  a_hi, a_lo = dd_add_d(xp, a_hi, a_lo, zero + 1.0)
  a_hi, a_lo = dd_mul(xp, a_hi, a_lo, r_hi, r_lo)   # r + r^2/2 + ... = exp(r) - 1
  # Squaring 1 + a as a (2 + a) keeps the "minus one" form, free of cancellation.
  for _ in range(_EXP_SQUARINGS):
    t_hi, t_lo = dd_add_d(xp, a_hi, a_lo, zero + 2.0)
    a_hi, a_lo = dd_mul(xp, a_hi, a_lo, t_hi, t_lo)
  e_hi, e_lo = dd_add_d(xp, a_hi, a_lo, zero + 1.0)
  scale = pow2(xp, xp.clip(k, -1000, 1000).astype(xp.int32))
  return e_hi * scale, e_lo * scale


def dd_log(xp: Any, h, l):
  """log(h + l) as a double-double for h > 0 (normal): frexp, then one Newton step."""
  m, e = frexp(xp, h)
  scale = pow2(xp, -e.astype(xp.int32))
  mh, ml = m, l * scale
  y = xp.log(mh)
  x_hi, x_lo = dd_exp(xp, -y, xp.zeros_like(y))
  t_hi, t_lo = dd_mul(xp, mh, ml, x_hi, x_lo)
  t_hi, t_lo = dd_add_d(xp, t_hi, t_lo, xp.zeros_like(y) - 1.0)  # m exp(-y) - 1, tiny
  y_hi, y_lo = fast_two_sum(xp, y, t_hi + t_lo)
  ef = e.astype(y.dtype)
  k_hi, k_lo = two_prod(xp, ef, xp.zeros_like(y) + LN2_HI)
  k_lo = k_lo + ef * LN2_LO
  s_hi, s_lo = two_sum(xp, k_hi, y_hi)
  return fast_two_sum(xp, s_hi, s_lo + (k_lo + y_lo))


def dd_pow(xp: Any, h, l, p: float):
  """(h + l) ** p as a double-double, for h > 0 with a moderate result."""
  y_hi, y_lo = dd_log(xp, h, l)
  z_hi, z_lo = two_prod(xp, y_hi, xp.zeros_like(y_hi) + p)
  z_hi, z_lo = fast_two_sum(xp, z_hi, z_lo + y_lo * p)
  return dd_exp(xp, z_hi, z_lo)


# --------------------------------------------------------------------------------- finalize
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


# ------------------------------------------------------------------------- exact fallback
# Everything here is integer arithmetic on the floats' bits: the JAX implementation calls it
# from an XLA host callback, whose thread flushes subnormals to zero in float operations.
_FORMATS = {2: (16, 10, 15), 4: (32, 23, 127), 8: (64, 52, 1023)}  # itemsize -> layout
_BF16_LAYOUT = (16, 7, 127)


def magnitudes_from_bits(bits: np.ndarray, layout: tuple[int, int, int]):
  """|x| = m * 2**e exactly, from raw bits (any shape); non-finite elements give m = 0."""
  nbits, mbits, bias = layout
  a = bits.astype(np.uint64) & np.uint64((1 << (nbits - 1)) - 1)
  ef = (a >> np.uint64(mbits)).astype(np.int64)
  mf = (a & np.uint64((1 << mbits) - 1)).astype(np.int64)
  normal = ef > 0
  m = np.where(normal, mf | (1 << mbits), mf)
  e = np.where(normal, ef - bias, 1 - bias) - mbits
  m = np.where(ef == (1 << (nbits - 1 - mbits)) - 1, 0, m)
  return m, e


def magnitudes_of(values: np.ndarray, layout: tuple[int, int, int] | None = None):
  """(m, e) of a float array (its own format: bits are reinterpreted, never converted)."""
  values = np.ascontiguousarray(values)
  if layout is None:
    layout = _BF16_LAYOUT if values.dtype.name == "bfloat16" else _FORMATS[values.dtype.itemsize]
  return magnitudes_from_bits(values.view(f"u{values.dtype.itemsize}"), layout)


def _power_sum(m: np.ndarray, e: np.ndarray, p: int) -> Fraction:
  pairs = [(mm, ee) for mm, ee in zip(m.ravel().tolist(), e.ravel().tolist()) if mm]
  if not pairs:
    return Fraction(0)
  low = min(ee for _, ee in pairs) * p
  total = 0
  for mm, ee in pairs:
    total += mm ** p << (ee * p - low)
  return Fraction(total) * Fraction(2) ** low


def exact_compare(m: np.ndarray, e: np.ndarray, p: float, c: Fraction) -> int:
  """-1, 0, 1 as the exact p-norm of magnitudes m * 2**e is <, ==, > the rational c."""
  m = np.asarray(m).ravel()
  e = np.asarray(e).ravel()
  if m.size == 0:
    return -1 if c > 0 else 0
  vals = [Fraction(mm) * Fraction(2) ** ee for mm, ee in zip(m.tolist(), e.tolist())] if \
      math.isinf(p) else None
  if p == math.inf:
    return _sign(max(vals) - c)
  if p == -math.inf:
    return _sign(min(vals) - c)
  if float(p).is_integer():
    return _sign(_power_sum(m, e, int(p)) - c ** int(p))
  return _interval_compare(m, e, p, c)


def _interval_compare(m: np.ndarray, e: np.ndarray, p: float, c: Fraction) -> int:
  import mpmath  # pylint: disable=import-outside-toplevel
  pairs = [(mm, ee) for mm, ee in zip(m.tolist(), e.tolist()) if mm]
  if not pairs:
    return -1 if c > 0 else 0
  if c == 0:
    return 1
  prec = 96
  while prec <= 1 << 14:
    ctx = mpmath.iv
    saved = ctx.prec
    ctx.prec = prec
    try:
      pp = ctx.mpf(p)
      total = ctx.mpf(0)
      for mm, ee in pairs:
        total += ctx.ldexp(ctx.mpf(mm), ee) ** pp
      diff = total - (ctx.mpf(c.numerator) / ctx.mpf(c.denominator)) ** pp
    finally:
      ctx.prec = saved
    if diff.b < 0:
      return -1
    if diff.a > 0:
      return 1
    prec *= 2
  return 0  # indistinguishable at 16k bits: an exact tie


def exact_step_compare(m: np.ndarray, e: np.ndarray, c: Fraction) -> int:
  """Sign of (largest exact L2 norm of the vectors) - c; m, e of shape (vectors, d)."""
  c2 = c * c
  best = -1
  for mv, ev in zip(np.asarray(m).reshape(len(m), -1), np.asarray(e).reshape(len(e), -1)):
    best = max(best, _sign(_power_sum(mv, ev, 2) - c2))
    if best > 0:
      return 1
  return best


def _sign(q: Fraction) -> int:
  return (q > 0) - (q < 0)


def fraction_of_bits(bits: int, layout: tuple[int, int, int] = (64, 52, 1023)) -> Fraction:
  """The exact value of a finite nonnegative float from its bits (no float arithmetic)."""
  m, e = magnitudes_from_bits(np.array([bits], dtype=np.uint64), layout)
  return Fraction(int(m[0])) * Fraction(2) ** int(e[0])


def exact_frexp(c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(c_m, c_e, is_inf) of thresholds, exact for subnormals (host-side, numpy)."""
  c = np.asarray(c, dtype=np.float64)
  is_inf = np.isinf(c)
  m, e = np.frexp(np.where(is_inf, 1.0, c))
  return np.where(is_inf, 1.0, m), e.astype(np.int32), is_inf


# ------------------------------------------------------------------------------ validation
# Host-side argument checks (SPEC rules 6, 9, 10, 13), run before any work; each message
# starts with the offending argument, as the reference's do.
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
NONFINITE_MODES = ("propagate", "zero")


def _supported_dtypes() -> frozenset:
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  return frozenset(np.dtype(ml_dtypes.bfloat16) if n == "bfloat16" else np.dtype(n)
                   for n in SUPPORTED_DTYPES)


_SUPPORTED = _supported_dtypes()


def check_leaves(leaves: Any, is_array) -> list:
  """Rule 9: a list of arrays (``is_array``) of float16, bfloat16, float32 or float64."""
  if not isinstance(leaves, (list, tuple)):
    raise TypeError(f"leaves: expected a list of arrays, got {type(leaves).__name__}")
  leaves = list(leaves)
  for i, leaf in enumerate(leaves):
    if not is_array(leaf) or leaf.dtype not in _SUPPORTED:
      if not is_array(leaf):
        raise TypeError(f"leaves[{i}]: expected an array, got {type(leaf).__name__}")
      raise TypeError(f"leaves[{i}]: dtype {np.dtype(leaf.dtype).name} is not supported; "
                      f"expected one of {', '.join(SUPPORTED_DTYPES)}")
  return leaves


def check_threshold(value: Any, name: str, num_systems: int | None):
  """Rule 6: a float >= 0 (+inf allowed), or (per-system ops) one per system.

  Returns a float, or a float64 array of shape (num_systems,).
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}: expected a float, got bool")
  if isinstance(value, np.ndarray) and value.ndim > 0:
    if num_systems is None:
      raise ValueError(f"{name}: expected a scalar, got an array of shape {value.shape}")
    if value.shape != (num_systems,):
      raise ValueError(f"{name}: expected a scalar or an array of shape ({num_systems},), got "
                       f"shape {value.shape}")
    if value.dtype.kind not in "fiu":
      raise TypeError(f"{name}: expected a real array, got dtype {value.dtype.name}")
    arr = value.astype(np.float64)
    bad = np.flatnonzero(np.isnan(arr) | (arr < 0))
    if bad.size:
      k = int(bad[0])
      if math.isnan(arr[k]):
        raise ValueError(f"{name}[{k}]: must not be NaN")
      raise ValueError(f"{name}[{k}]: must be >= 0, got {float(arr[k])!r}")
    return arr
  if isinstance(value, np.ndarray):
    value = value[()]
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}: expected a float, got bool")
  try:
    import numbers  # pylint: disable=import-outside-toplevel
    real = isinstance(value, numbers.Real)
  except ImportError:  # pragma: no cover
    real = False
  if not real:
    raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
  v = float(value)
  if math.isnan(v):
    raise ValueError(f"{name}: must not be NaN")
  if v < 0:
    raise ValueError(f"{name}: must be >= 0, got {v!r}")
  return v


def check_norm_type(p: Any) -> float:
  """Rule 10: any real p >= 1, +inf or -inf."""
  import numbers  # pylint: disable=import-outside-toplevel
  if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Real):
    raise TypeError(f"norm_type: expected a real number, got {type(p).__name__} {p!r}")
  p = float(p)
  if math.isnan(p) or (p < 1 and p != -math.inf):
    raise ValueError(f"norm_type: must be >= 1, +inf or -inf, got {p!r}")
  return p


def check_nonfinite(mode: Any) -> str:
  if mode not in NONFINITE_MODES:
    raise ValueError(f"nonfinite: expected one of {NONFINITE_MODES}, got {mode!r}")
  return mode


def check_num_systems(segments: Any, num_systems: Any, num_leaves: int) -> int | None:
  """Rule 13 (counts): returns num_systems (None when segments is None)."""
  import numbers  # pylint: disable=import-outside-toplevel
  if segments is None:
    if num_systems not in (None, 1):
      raise ValueError(f"num_systems: must be None or 1 when segments is None, got "
                       f"{num_systems!r}")
    return None
  if num_systems is None:
    raise ValueError("num_systems: required when segments is given")
  if isinstance(num_systems, (bool, np.bool_)) or not isinstance(num_systems, numbers.Integral):
    raise ValueError(f"num_systems: expected an integer >= 0, got {num_systems!r}")
  num_systems = int(num_systems)
  if num_systems < 0:
    raise ValueError(f"num_systems: expected an integer >= 0, got {num_systems}")
  if not isinstance(segments, (list, tuple)):
    raise ValueError(f"segments: expected None or a list of one integer array per leaf, got "
                     f"{type(segments).__name__}")
  if len(segments) != num_leaves:
    raise ValueError(f"segments: expected {num_leaves} arrays (one per leaf), got "
                     f"{len(segments)}")
  return num_systems


def check_segment(i: int, leaf_shape: tuple, seg_shape: tuple, seg_dtype: Any) -> None:
  """Rule 13 (static part of one leaf): an integer id array of shape (rows,)."""
  if len(leaf_shape) == 0:
    raise ValueError(f"leaves[{i}]: a 0-d leaf has no rows to assign with segments[{i}]")
  dt = np.dtype(seg_dtype)
  if dt.kind not in "iu":
    raise ValueError(f"segments[{i}]: expected an integer array for leaves[{i}], got dtype "
                     f"{dt.name}")
  if tuple(seg_shape) != (leaf_shape[0],):
    raise ValueError(f"segments[{i}]: expected shape ({leaf_shape[0]},) to match the rows of "
                     f"leaves[{i}], got {tuple(seg_shape)}")


def check_segment_range(i: int, lo: int, hi: int, num_systems: int, seg=None) -> None:
  """Rule 13 (values): every id in [0, num_systems)."""
  if lo < 0 or hi >= num_systems:
    bad = lo if lo < 0 else hi
    if seg is not None:
      seg = np.asarray(seg)
      bad = int(seg[(seg < 0) | (seg >= num_systems)][0])
    raise ValueError(f"segments[{i}]: system id {bad} of leaves[{i}] is outside "
                     f"[0, {num_systems})")
