"""Float64 values rounded into a float format's bits with integer operations.

Float conversions would flush subnormal results on XLA's CPU, so a result is cut on its bits:
the float64 significand shifted onto the target format's grid (normal or subnormal), then
rounded to nearest-even (the reported norms) or toward zero (the clipped elements).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from clipbench.impls.own.jax.formats import FloatFormat, u64


class OnGrid(NamedTuple):
  """A float64 value times 2**e_add cut to the units of a format's grid."""

  units: Any  # the kept significand units
  dropped: Any  # the dropped significand bits
  shift: Any  # how many significand bits were dropped (>= 64: all of them)
  shift_c: Any  # shift clipped to [0, 63], as uint64
  ev: Any  # int32 exponent of the value


def _on_grid(v, e_add, fmt: FloatFormat) -> OnGrid:
  """v * 2**e_add cut onto fmt's grid, for float64 v normal (the caller handles 0)."""
  b = u64(lax.bitcast_convert_type(v, jnp.uint64))
  ev = (b >> 52).astype(jnp.int32) - 1023 + e_add.astype(jnp.int32)
  m53 = (b & ((1 << 52) - 1)) | (1 << 52)
  shift = 52 - fmt.mbits + jnp.maximum(fmt.emin - ev, 0)
  shift_c = jnp.clip(shift, 0, 63).astype(jnp.uint64)
  units = jnp.where(shift >= 64, jnp.uint64(0), m53 >> shift_c)
  dropped = jnp.where(shift >= 64, m53, m53 & ((jnp.uint64(1) << shift_c) - 1))
  return OnGrid(units, dropped, shift, shift_c, ev)


def _truncated_bits(g: OnGrid, fmt: FloatFormat):
  """uint64 bits (fmt) of the value truncated onto the grid.

  Normal: biased exponent field + fraction (the carry of a later round-up moves into the
  exponent, up to infinity); subnormal: the units are the bits."""
  normal = g.ev >= fmt.emin
  return jnp.where(normal, (u64(g.ev - fmt.emin + 1) << fmt.mbits) + (g.units - (1 << fmt.mbits)),
                   g.units)


def round_nearest_bits(v, e_add, fmt: FloatFormat):
  """Bits (fmt) of v * 2**e_add rounded to nearest-even; v float64 >= 0 normal or 0; inf
  past the range."""
  g = _on_grid(v, e_add, fmt)
  half = jnp.where(g.shift >= 64, jnp.uint64(1) << 63, jnp.uint64(1) << (g.shift_c - 1))
  half = jnp.where(g.shift >= 65, jnp.uint64(1) << 63, half)
  up = (g.dropped > half) | ((g.dropped == half) & ((g.units & 1) == 1))
  up = up & (g.shift < 65)
  bits = _truncated_bits(g, fmt) + up.astype(jnp.uint64)
  inf_bits = jnp.uint64(fmt.emax_field) << fmt.mbits
  bits = jnp.where(g.ev > fmt.bias, inf_bits, jnp.minimum(bits, inf_bits))
  bits = jnp.where(v == 0, jnp.uint64(0), bits)
  return lax.convert_element_type(bits, fmt.udtype)


def rtz_bits(p_hi, p_lo, e_add, fmt: FloatFormat):
  """Bits (fmt) of (p_hi + p_lo) * 2**e_add rounded toward zero, for p_hi in [0.5, 2) (or 0)
  and |p_lo| <= ulp(p_hi)/2 (p_hi + p_lo exact): integer truncation plus a one-unit fix."""
  g = _on_grid(p_hi, e_add, fmt)
  bits = _truncated_bits(g, fmt)
  # Exactly on the grid but the exact product is a hair below: one unit toward zero.
  bits = bits - ((g.dropped == 0) & (p_lo < 0) & (bits > 0)).astype(jnp.uint64)
  return jnp.where(p_hi == 0, jnp.uint64(0), bits)
