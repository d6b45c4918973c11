"""Float formats read and written on their bits: exact magnitudes, keys, powers of two.

XLA on CPU flushes subnormals in every float operation, so nothing here does float arithmetic
on an input: magnitudes are taken apart and powers of two put together with integer operations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

BF16 = np.dtype(ml_dtypes.bfloat16)
KEY_BIAS = 1200  # key exponent offset: every |x| of every dtype has exponent > -1200


@dataclasses.dataclass(frozen=True)
class FloatFormat:
  """Bit layout of a float format: total bits, fraction bits, exponent bias, uint dtype."""

  nbits: int
  mbits: int
  bias: int
  udtype: Any

  @property
  def emax_field(self) -> int:
    """The exponent field of infinities and NaNs."""
    return (1 << (self.nbits - 1 - self.mbits)) - 1

  @property
  def emin(self) -> int:
    """The exponent of the smallest normal number."""
    return 1 - self.bias

  @property
  def layout(self) -> tuple[int, int, int]:
    """(nbits, mbits, bias), as :mod:`clipbench.impls.own.exact` takes it."""
    return self.nbits, self.mbits, self.bias

  @property
  def quiet_nan(self) -> int:
    """Bits of the positive quiet NaN."""
    return (self.emax_field << self.mbits) | (1 << (self.mbits - 1))


FORMATS = {
    np.dtype(np.float16): FloatFormat(16, 10, 15, jnp.uint16),
    BF16: FloatFormat(16, 7, 127, jnp.uint16),
    np.dtype(np.float32): FloatFormat(32, 23, 127, jnp.uint32),
    np.dtype(np.float64): FloatFormat(64, 52, 1023, jnp.uint64),
}
FLOAT64 = FORMATS[np.dtype(np.float64)]


def format_of(dtype: Any) -> FloatFormat:
  return FORMATS[np.dtype(dtype)]


class Decoded(NamedTuple):
  """|x| taken apart exactly (see :func:`decode`)."""

  key: Any  # uint64, monotone in |x| (0 for zero): ((E + KEY_BIAS) << 52) | fraction bits
  frac: Any  # float64 in [1, 2) with |x| = frac * 2**E (1.0 for zero)
  e: Any  # int32 exponent E
  zero: Any
  nonfinite: Any
  nan: Any
  neg: Any


def u64(v):
  return lax.convert_element_type(v, jnp.uint64)


def as_words(v):
  """uint64 values as (..., 2) uint32 words, for a host callback's operands (a width-changing
  bitcast does not lower with x64 off, which is how an enclosing jax.jit lowers the graph)."""
  return jnp.stack([lax.convert_element_type(v & 0xFFFFFFFF, jnp.uint32),
                    lax.convert_element_type(v >> 32, jnp.uint32)], axis=-1)


def bits_of(x, fmt: FloatFormat):
  return lax.bitcast_convert_type(x, fmt.udtype)


def decode(x, fmt: FloatFormat) -> Decoded:
  """Exact decomposition of |x| from its bits (no float arithmetic on x)."""
  b = u64(bits_of(x, fmt))
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
                  (u64(e + KEY_BIAS) << 52) | frac_bits)
  return Decoded(key, frac, e, zero, nonfinite, nan, neg)


def key_value(key):
  """(frac, e) of a key (frac = 0 for key 0)."""
  e = (key >> 52).astype(jnp.int32) - KEY_BIAS
  frac = lax.bitcast_convert_type((jnp.uint64(1023) << 52) | (key & ((1 << 52) - 1)),
                                  jnp.float64)
  return jnp.where(key == 0, 0.0, frac), jnp.where(key == 0, 0, e)


def pow2(e):
  """2.0**e for int arrays e, clipped to the normal range (built from exponent bits)."""
  e = jnp.clip(e.astype(jnp.int64), -1022, 1023)
  return lax.bitcast_convert_type(u64(e + 1023) << 52, jnp.float64)


def bit_length(n):
  n = u64(n)
  return 64 - lax.clz(n).astype(jnp.int32)


def exponent_of(v):
  """e with 2**e <= v < 2**(e+1) for normal float64 v > 0 (0 for v == 0), from the bits."""
  b = lax.bitcast_convert_type(v, jnp.uint64)
  return jnp.where(v > 0, (b >> 52).astype(jnp.int32) - 1023, 0)
