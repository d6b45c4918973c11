"""The apply pass: each element kept bitwise, NaN-filled, or rounded toward zero from x * s.

Kept systems are selected bitwise (never multiplied by 1.0, which XLA would flush). The factor
``s = s_m * 2**s_e`` is the largest float with ``s n_up <= c``; rounding each ``x * s`` toward
zero keeps the output norm at most ``s n <= c`` (rule 4). Without float64 leaves s has 29 bits,
so ``x * s`` is exact in float64 and one truncation of its bits is the exact RTZ value.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from clipbench.impls.own import decision, double_double
from clipbench.impls.own.jax.formats import (BF16, FloatFormat, bits_of, decode, format_of,
                                             pow2, u64)
from clipbench.impls.own.jax.narrow import widen
from clipbench.impls.own.jax.rounding import rtz_bits
from clipbench.impls.own.jax.systems import Systems, rows


class Decision(NamedTuple):
  """Per system: the action (decision.KEEP/SCALE/NAN_FILL) and the factor s = s_m * 2**s_e."""

  action: Any
  s_m: Any
  s_e: Any


def _select(x, fmt: FloatFormat, act, bits, scaled, nonfinite, zero_mode: bool):
  """The output: x's own bits (keep), the scaled ones, a quiet NaN, or 0 for a non-finite
  element in zero mode."""
  out = jnp.where(act == decision.KEEP, bits, scaled)
  out = jnp.where(act == decision.NAN_FILL, jnp.asarray(fmt.quiet_nan, fmt.udtype), out)
  if zero_mode:
    out = jnp.where(nonfinite, jnp.asarray(0, fmt.udtype), out)
  return lax.bitcast_convert_type(out, x.dtype)


def _apply_wide_leaf(x, act, s_m, s_e, zero_mode: bool):
  """One leaf when some leaf is float64: RTZ of the exact two-product frac * s_m."""
  fmt = format_of(x.dtype)
  dec = decode(x, fmt)
  bits = bits_of(x, fmt)
  p_hi, p_lo = double_double.two_prod(jnp, dec.frac, s_m)
  scaled = rtz_bits(p_hi, p_lo, dec.e + s_e, fmt)
  scaled = jnp.where(dec.zero, jnp.uint64(0), scaled) | (u64(dec.neg) << (fmt.nbits - 1))
  scaled = lax.convert_element_type(scaled, fmt.udtype)
  return _select(x, fmt, act, bits, scaled, dec.nonfinite, zero_mode)


def _float32_bits_as_float64(qb):
  """The float64 value of normal float32 bits, rebuilt on the bits.

  Not ``q.astype(jnp.float64)``: XLA's GPU compiler removes a float64 -> float32 -> float64
  chain of conversions (its excess-precision rewrite, on by default), which skipped the
  rounding the fix-up compares against and broke rule 4 there (the GPU check of 2026-11-26,
  docs/gpu.md)."""
  b = u64(qb)
  bits = (((b >> 23) + (1023 - 127)) << 52) | ((b & 0x7FFFFF) << 29)
  return lax.bitcast_convert_type(bits, jnp.float64)


def _rtz_float32_bits(y):
  """uint32 bits of float64 y >= 0 rounded toward zero into float32: the normal range by a float
  conversion and a one-ulp fix-up; the subnormal range (which the conversion would flush) by
  integer truncation."""
  q = y.astype(jnp.float32)
  qb = lax.bitcast_convert_type(q, jnp.uint32)
  qb = qb - (_float32_bits_as_float64(qb) > y).astype(jnp.uint32)
  sub_units = jnp.floor(y * 2.0 ** 149).astype(jnp.int32).astype(jnp.uint32)
  f32b = jnp.where(y < 2.0 ** -126, sub_units, qb)
  return jnp.where(y < 2.0 ** -149, jnp.uint32(0), f32b)


def _apply_narrow_leaf(x, act, s_val, zero_mode: bool):
  """One leaf of at most 32 bits: x * s (s of 29 bits) is exact in float64; the rounding into
  the leaf dtype uses 32-bit integers."""
  dt = np.dtype(x.dtype)
  fmt = format_of(dt)
  v, _, nonfinite = widen(x)
  y = v * s_val  # exact
  f32b = _rtz_float32_bits(y)
  bits = bits_of(x, fmt)
  sign = bits & (1 << (fmt.nbits - 1))
  if dt == np.float32:
    scaled = f32b | sign
  elif dt == BF16:  # the top half of the float32 bits
    scaled = (f32b >> 16).astype(jnp.uint16) | sign
  else:  # float16: from the RTZ float32 bits, truncating the fraction (or to subnormal units)
    e = ((f32b >> 23) & 0xFF).astype(jnp.int32) - 127
    normal = ((e + 15) << 10).astype(jnp.uint32) | ((f32b & 0x7FFFFF) >> 13)
    subn = jnp.floor(y * 2.0 ** 24).astype(jnp.int32).astype(jnp.uint32)
    h = jnp.where(e >= -14, normal, subn)
    scaled = h.astype(jnp.uint16) | sign
  return _select(x, fmt, act, bits, scaled, nonfinite, zero_mode)


def apply_factors(leaves, systems: Systems, decided: Decision, zero_mode: bool,
                  precise: bool) -> tuple:
  """Every leaf's output under its systems' decisions."""
  action, s_m, s_e = decided
  s_val = jnp.where(s_e < -1021, 0.0, s_m * pow2(s_e))  # (29-bit s; tiny s: all outputs 0)
  outs = []
  for i, x in enumerate(leaves):
    # One system: the leaf on its own axes, so a split along any of them stays put (a 2-D
    # view of a leaf split along an inner axis is one XLA's partitioner would move).
    xr = x if systems.segs is None else rows(x)
    n_rows = xr.shape[0] if xr.ndim else 1
    if systems.segs is None:
      act, sv = action[0], s_val[0]
      sm, se = s_m[0], s_e[0]
    elif precise:
      act = systems.per_row(action, i, n_rows)[:, None]
      sm = systems.per_row(s_m, i, n_rows)[:, None]
      se = systems.per_row(s_e, i, n_rows)[:, None]
    else:  # one gather: the action rides along as a float
      both = systems.per_row(jnp.stack([action.astype(jnp.float64), s_val], axis=1), i, n_rows)
      act, sv = both[:, 0:1].astype(jnp.int8), both[:, 1:2]
    if precise:
      out = _apply_wide_leaf(xr, act, sm, se, zero_mode)
    else:
      out = _apply_narrow_leaf(xr, act, sv, zero_mode)
    outs.append(out.reshape(x.shape))
  return tuple(outs)
