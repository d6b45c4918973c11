"""Near-ties decided exactly on the host, through a ``jax.pure_callback`` under ``lax.cond``.

The callback runs only when some system's threshold lies inside the error bound of its norm
(random data never does). Its XLA thread flushes subnormals in float operations too, so both
sides work on raw bits with integers only, and float64 values cross as pairs of uint32 words.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from clipbench.impls.own import decision, exact
from clipbench.impls.own.jax.config import Config, Threshold
from clipbench.impls.own.jax.formats import FLOAT64, bits_of, decode, format_of, u64


def host_ties(cfg: Config, tie, c_bits, segs, *leaf_bits) -> np.ndarray:
  """Host side: 1 where the exact norm exceeds c, else 0 (non-finite elements count as 0:
  zero mode; in propagate mode a system holding them is never a tie)."""
  tie = np.asarray(tie)
  out = np.zeros(cfg.num_systems, dtype=np.int8)
  if not tie.any():
    return out
  c_words = np.ascontiguousarray(np.asarray(c_bits)).view(np.uint64).reshape(cfg.num_systems)
  seg_list = None if segs is None else [np.asarray(s) for s in segs]
  decoded = []
  for bits, dt in zip(leaf_bits, cfg.dtypes):
    bits = np.asarray(bits)
    m, e = exact.magnitudes_from_bits(bits, format_of(dt).layout)
    nrows = bits.shape[0] if bits.ndim else 1
    d = bits.shape[-1] if (cfg.op == "step" and bits.ndim >= 2) else 1
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
    if cfg.op == "step":
      signs = [exact.exact_step_compare(m.reshape(-1, m.shape[-1]), e.reshape(-1, m.shape[-1]),
                                        c_k) for m, e in zip(ms, es) if m.size]
      cmp = max(signs, default=-1)
    else:
      cmp = exact.exact_compare(np.concatenate([m.ravel() for m in ms]) if ms else
                                np.zeros(0, np.int64),
                                np.concatenate([e.ravel() for e in es]) if es else
                                np.zeros(0, np.int64), cfg.p, c_k)
    out[k] = 1 if cmp > 0 else 0
  return out


def threshold_bits(c_m, c_e):
  """float64 bits of c = c_m * 2**c_e (c_m in [0.5, 1) or 0), subnormals included, built
  with integer operations."""
  key = decode(c_m, FLOAT64).key
  m53 = key & ((1 << 52) - 1) | (1 << 52)
  ev = c_e.astype(jnp.int32) - 1  # c = (m53 / 2**52) * 2**(c_e - 1)
  sub_shift = jnp.clip(-1022 - ev, 0, 63).astype(jnp.uint64)
  bits = jnp.where(ev >= -1022, (u64(ev + 1023) << 52) | (m53 & ((1 << 52) - 1)),
                   m53 >> sub_shift)
  return jnp.where(c_m == 0, jnp.uint64(0), bits)


def resolve_ties(cfg: Config, tie, action, threshold: Threshold, leaves, segs):
  """action with near-ties decided exactly (the host callback runs only if a tie exists)."""
  # Float64 crosses to the host as raw bits: with x64 off at run time JAX would round a
  # float64 callback operand to float32.
  # Two uint32 words by shifts (a width-changing bitcast does not lower with x64 off, which
  # is how an enclosing jax.jit lowers this graph).
  words = threshold_bits(threshold.m, threshold.e)
  c_bits = jnp.stack([lax.convert_element_type(words & 0xFFFFFFFF, jnp.uint32),
                      lax.convert_element_type(words >> 32, jnp.uint32)], axis=-1)
  leaf_bits = [bits_of(x, format_of(x.dtype)) for x in leaves]

  def call():
    res = jax.pure_callback(
        functools.partial(host_ties, cfg), jax.ShapeDtypeStruct((cfg.num_systems,), jnp.int8),
        tie, c_bits, segs, *leaf_bits, vmap_method="sequential")
    decided = jnp.where(res > 0, jnp.int8(decision.SCALE), jnp.int8(decision.KEEP))
    return jnp.where(tie, decided, action)

  return lax.cond(jnp.any(tie), call, lambda: action)
