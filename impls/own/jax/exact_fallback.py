"""Near-ties decided exactly on the host, through a ``jax.pure_callback``, only when one exists.

The callback runs only when some system's threshold lies inside the error bound of its norm
(random data never does). Its XLA thread flushes subnormals in float operations too, so both
sides work on raw bits with integers only, and float64 values cross as pairs of uint32 words.

p = 1, 2 (the norms people clip by): the device sums each tie system's exact power sum as
integer limbs per exponent (:func:`exact_limb_sums`: integer additions, exact in any order,
so a sharded call's partial sums are all-reduced by XLA like any other sum), one system per
round of a ``lax.while_loop``, and the host only compares the rebuilt integer with ``c**p``.
What crosses to the host, and between devices, is a few thousand limb sums, not the leaves.
Max-step: the few vectors that can decide a tie cross, one per system and round
(:mod:`.step_ties`), where the leaves may be sharded (``Config.may_be_sharded``). Other p (and
max-step compiled alone on one device's leaves) pass the leaves' bits to the host, which
decides from every element (:func:`host_ties`); on sharded leaves XLA gathers them for it, in
the tie branch, and every call's temporaries hold the gathered copies. That gather stays: a
callback runs on one device in a partitioned program, and inside a ``custom_partitioning``
rule, where it could run per device, it crashes (jax-ml/jax#23620); a non-integer p has no
exact partial of bounded size, and an integer one's exact power on the device cost too much
memory (docs/sharding.md).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from clipbench.impls.own import decision, exact
from clipbench.impls.own.jax import step_ties
from clipbench.impls.own.jax.config import Config, Threshold
from clipbench.impls.own.jax.formats import FLOAT64, as_words, bits_of, decode, format_of, u64
from clipbench.impls.own.jax.systems import SEGMENT_ROWS, apart_and_joined, dtype_blocks


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
    bits = np.ascontiguousarray(np.asarray(bits))
    if np.dtype(dt).itemsize == 8:  # crossed as (..., 2) uint32 words
      bits = bits.view(np.uint64).reshape(bits.shape[:-1])
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


def _exponents(dtypes) -> tuple[int, int]:
  """The range of E in |x| = m * 2**E (m the integer mantissa) over these formats' finite
  values, subnormals included."""
  fmts = [format_of(dt) for dt in dtypes]
  return (min(f.emin - f.mbits for f in fmts),
          max(f.emax_field - 1 - f.bias - f.mbits for f in fmts))


class LimbScheme(NamedTuple):
  """How |x|**p (p = 1, 2) is cut into integer limbs that sum without overflow."""

  shifts: tuple[int, ...]  # limb j weighs 2**shifts[j] (times 2**(p E))
  capacity: int  # elements one uint64 limb sum holds without overflow


def limb_scheme(dtypes, p: float) -> LimbScheme:
  """Mantissas of at most 24 bits (float32 and narrower) in 12-bit limbs, float64's in 18-bit
  (26-bit for p = 1) ones; every limb product below 2**37."""
  wide = any(format_of(dt).mbits > 23 for dt in dtypes)
  if p == 1:
    return LimbScheme((26, 0), 1 << 37) if wide else LimbScheme((0,), 1 << 40)
  return LimbScheme((72, 54, 36, 18, 0), 1 << 27) if wide else LimbScheme((24, 12, 0), 1 << 39)


def _limbs(m, p: float, scheme: LimbScheme):
  """The limbs of m**p (m a uint64 integer mantissa), stacked on a last axis."""
  if p == 1:
    parts = [m >> 26, m & ((1 << 26) - 1)] if len(scheme.shifts) == 2 else [m]
  elif len(scheme.shifts) == 5:
    a, b, c = m >> 36, (m >> 18) & ((1 << 18) - 1), m & ((1 << 18) - 1)
    parts = [a * a, 2 * a * b, 2 * a * c + b * b, 2 * b * c, c * c]
  else:
    a, b = m >> 12, m & ((1 << 12) - 1)
    parts = [a * a, 2 * a * b, b * b]
  return jnp.stack(parts, axis=-1)


def exact_limb_sums(cfg: Config, leaves, segs, system):
  """(E, limbs) uint64 sums of the limbs of |x|**p, per exponent E of |x| = m 2**E, over the
  finite elements of ``system`` (non-finite ones count as 0: zero mode; in propagate mode a
  system holding them is never a tie). Exact: integer sums in any order and partition."""
  e_lo, e_hi = _exponents(cfg.dtypes)
  scheme = limb_scheme(cfg.dtypes, cfg.p)
  total = jnp.zeros((e_hi - e_lo + 1, len(scheme.shifts)), jnp.uint64)
  if segs is None and cfg.precise:
    # One block per dtype: one scatter, so one all-reduce of float64's 80 KB of sums where the
    # leaves are sharded, not one per leaf. Narrower leaves stay apart, as their pass reads
    # them: as one block they cost more memory (docs/sharding.md). Where the leaves may lie
    # split, a leaf XLA's partitioner would move to build a block stays apart too.
    apart, joined = apart_and_joined(leaves, cfg.may_be_sharded)
    leaves = apart + dtype_blocks(joined, one_per_dtype=True)
  for i, x in enumerate(leaves):
    if not math.prod(x.shape):
      continue
    fmt = format_of(x.dtype)
    bits, seg = bits_of(x, fmt), None if segs is None else segs[i]
    if cfg.may_be_sharded and x.ndim and x.shape[0] % SEGMENT_ROWS:
      # Rows of +0 up to a multiple of SEGMENT_ROWS (they add nothing): XLA gathers the
      # indices of a scatter whose rows do not divide among the devices (systems.SEGMENT_ROWS).
      # The bits are padded, not the floats: XLA on CPU flushes subnormals in float operations.
      rows_padded = (0, -x.shape[0] % SEGMENT_ROWS)
      bits = jnp.pad(bits, (rows_padded,) + ((0, 0),) * (x.ndim - 1))
      seg = None if seg is None else jnp.pad(seg, rows_padded, constant_values=-1)
    b = u64(bits)
    a = b & ((1 << (fmt.nbits - 1)) - 1)
    ef, mf = a >> fmt.mbits, a & ((1 << fmt.mbits) - 1)
    finite = ef != fmt.emax_field
    m = jnp.where(ef > 0, mf | (1 << fmt.mbits), mf)
    e = jnp.where(ef > 0, ef.astype(jnp.int32) - fmt.bias, fmt.emin) - fmt.mbits
    held = finite
    if seg is not None:
      held = held & (seg == system).reshape((-1,) + (1,) * (x.ndim - 1))
    m = jnp.where(held, m, jnp.uint64(0))
    # Scattered from the leaf's own axes, not a flat view: a leaf split along an inner axis
    # (tensor parallelism) then stays where it is, and only the sums are all-reduced.
    index = jnp.clip(e - e_lo, 0, total.shape[0] - 1)
    total = total.at[index].add(_limbs(m, cfg.p, scheme))
  return total


def host_limb_tie(cfg: Config, c_bits, sum_words) -> np.ndarray:
  """Host side of one round: 1 when the exact power sum the limb sums make exceeds c**p."""
  e_lo, _ = _exponents(cfg.dtypes)
  scheme = limb_scheme(cfg.dtypes, cfg.p)
  sums = np.ascontiguousarray(np.asarray(sum_words)).view(np.uint64).reshape(
      -1, len(scheme.shifts))
  p = int(cfg.p)
  total = 0
  for j, shift in enumerate(scheme.shifts):
    for index in np.flatnonzero(sums[:, j]).tolist():
      total += int(sums[index, j]) << (shift + p * index)
  c = exact.fraction_of_bits(int(np.ascontiguousarray(np.asarray(c_bits)).view(np.uint64)[0]))
  exceeds = Fraction(total) * Fraction(2) ** (p * e_lo) > c ** p
  return np.array(1 if exceeds else 0, dtype=np.int8)


def limb_rounds_apply(cfg: Config, leaves) -> bool:
  """Whether this call's ties are settled from limb sums (p = 1, 2, no limb sum can
  overflow)."""
  elements = sum(math.prod(x.shape) for x in leaves)
  return (cfg.op != "step" and cfg.p in (1.0, 2.0) and bool(leaves)
          and elements < limb_scheme(cfg.dtypes, cfg.p).capacity)


def resolve_ties(cfg: Config, tie, action, threshold: Threshold, leaves, segs,
                 vector_keys=None):
  """action with near-ties decided exactly (the host callback runs only if a tie exists);
  ``vector_keys``: max-step's per-vector keys from the pass (``SystemStats.vector_keys``)."""
  if cfg.op != "step" and math.isinf(cfg.p):
    # p = +-inf: the norm is an element, exactly, so finalize's interval has no width and no
    # system is ever a tie; a fallback compiled in anyway would gather sharded leaves for it.
    return action
  if limb_rounds_apply(cfg, leaves):
    return _resolve_by_limb_sums(cfg, tie, action, threshold, leaves, segs)
  if step_ties.rounds_apply(cfg, leaves):
    c_words = jnp.broadcast_to(as_words(threshold_bits(threshold.m, threshold.e)),
                               (cfg.num_systems, 2))
    return step_ties.resolve_step_ties(cfg, tie, action, c_words, leaves, segs, vector_keys)
  return _resolve_from_leaves(cfg, tie, action, threshold, leaves, segs)


def _resolve_by_limb_sums(cfg: Config, tie, action, threshold: Threshold, leaves, segs):
  """One tie system per round: its limb sums on the device, the comparison on the host."""
  c_words = jnp.broadcast_to(as_words(threshold_bits(threshold.m, threshold.e)),
                             (cfg.num_systems, 2))

  def one_round(state):
    open_, decided = state
    system = lax.argmax(open_.astype(jnp.int32), 0, jnp.int32)  # int32: x64 may be off
    sums = exact_limb_sums(cfg, leaves, segs, system)
    res = jax.pure_callback(
        functools.partial(host_limb_tie, cfg), jax.ShapeDtypeStruct((), jnp.int8),
        c_words[system], as_words(sums), vmap_method="sequential")
    verdict = jnp.where(res > 0, jnp.int8(decision.SCALE), jnp.int8(decision.KEEP))
    return open_.at[system].set(False), decided.at[system].set(verdict)

  return lax.while_loop(lambda state: jnp.any(state[0]), one_round, (tie, action))[1]


def _resolve_from_leaves(cfg: Config, tie, action, threshold: Threshold, leaves, segs):
  """Every tie decided from every element on the host."""
  # Float64 crosses to the host as raw bits in uint32 words: with x64 off at run time JAX
  # would round a float64 callback operand to float32, and cut a uint64 one to its low word.
  c_bits = as_words(threshold_bits(threshold.m, threshold.e))
  leaf_bits = [as_words(bits_of(x, format_of(x.dtype))) if format_of(x.dtype).nbits == 64
               else bits_of(x, format_of(x.dtype)) for x in leaves]

  def call():
    res = jax.pure_callback(
        functools.partial(host_ties, cfg), jax.ShapeDtypeStruct((cfg.num_systems,), jnp.int8),
        tie, c_bits, segs, *leaf_bits, vmap_method="sequential")
    decided = jnp.where(res > 0, jnp.int8(decision.SCALE), jnp.int8(decision.KEEP))
    return jnp.where(tie, decided, action)

  return lax.cond(jnp.any(tie), call, lambda: action)
