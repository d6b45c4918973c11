"""Max-step near-ties decided from the few vectors that can decide them, not from every element.

A system is a near-tie when no vector's computed norm is certainly above its threshold c but
the largest may be. Only a vector whose computed squared norm lies within a relative
:data:`CANDIDATE_MARGIN` of the system's largest can exceed c exactly (each computed value is
far closer than that to its exact one): these are the *candidates*, usually one per system.

Each round of a ``lax.while_loop`` takes, in every open system, its candidate of lowest position
(leaves in order, then rows, then vectors) and hands that vector's element bits to the host
(a masked sum over the rows: on leaves sharded by rows, an all-reduce of (systems, d) words),
which compares its exact squared norm with c**2 in integers. A vector above c settles its system
(scale). Otherwise it leaves the candidates, with every candidate of the same magnitudes in its
leaf (rows repeated many times cost one round), and a system with no candidate left keeps its
step. Nothing leaf-sized crosses to the host or between devices.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from clipbench.impls.own import decision, exact
from clipbench.impls.own.jax import narrow, wide
from clipbench.impls.own.jax.config import Config
from clipbench.impls.own.jax.formats import as_words, bits_of, format_of, u64
from clipbench.impls.own.jax.systems import Systems, vectors

CANDIDATE_MARGIN = 2.0 ** -30
_NO_POSITION = np.iinfo(np.int32).max


def rounds_apply(cfg: Config, leaves) -> bool:
  """Whether this call's max-step ties are settled vector by vector (``Config.may_be_sharded``;
  positions fit int32, which an enclosing ``jax.jit`` with x64 off can still lower)."""
  vector_count = sum(math.prod(vectors(x).shape[:2]) for x in leaves)
  return (cfg.op == "step" and cfg.may_be_sharded and bool(leaves)
          and vector_count < _NO_POSITION)


def key_margin(cfg: Config, leaves) -> int:
  """How far below a system's largest key a candidate's key may lie.

  A key falls by at least one part in 2**53 of its value per unit; a vector can exceed c only
  if its computed value is within about 3 relative errors of the largest, far inside the
  margin (checked here, for vectors too long for it, by widening the margin)."""
  max_d = max((vectors(x).shape[-1] for x in leaves), default=1)
  rel = (wide if cfg.precise else narrow).step_rel_err(max_d)
  return math.ceil(max(CANDIDATE_MARGIN, 8.0 * rel) * 2.0 ** 53)


def host_round(cfg: Config, offsets: tuple[int, ...], open_, position, c_words,
               *leaf_words) -> np.ndarray:
  """Host side of one round: per open system, 1 when its chosen vector's exact norm exceeds c."""
  open_ = np.asarray(open_)
  position = np.asarray(position)
  c_bits = np.ascontiguousarray(np.asarray(c_words)).view(np.uint64).reshape(-1)
  out = np.zeros(cfg.num_systems, dtype=np.int8)
  for k in np.flatnonzero(open_).tolist():
    leaf = int(np.searchsorted(offsets, position[k], side="right")) - 1
    words = np.ascontiguousarray(np.asarray(leaf_words[leaf]))[k]
    bits = words.view(np.uint64).reshape(-1)
    m, e = exact.magnitudes_from_bits(bits, format_of(cfg.dtypes[leaf]).layout)
    c = exact.fraction_of_bits(int(c_bits[k]))
    out[k] = 1 if exact.exact_step_compare(m.reshape(1, -1), e.reshape(1, -1), c) > 0 else 0
  return out


def resolve_step_ties(cfg: Config, tie, action, c_words, leaves, segs, vector_keys):
  """action with max-step near-ties decided exactly (no host call unless a tie exists).

  ``c_words``: each system's threshold as float64 bits in (systems, 2) uint32 words;
  ``vector_keys``: per leaf, the pass's key of each vector, monotone in its computed squared
  norm (None for an empty leaf)."""
  systems = Systems(segs, cfg.num_systems, cfg.sorted_flags, None, cfg.may_be_sharded)
  margin = jnp.uint64(key_margin(cfg, leaves))
  keys = list(vector_keys)
  vecs, offsets, positions = [], [], []
  start = 0
  for x in leaves:
    vec = vectors(x)
    n_rows, per_row, _ = vec.shape
    vecs.append(vec)
    offsets.append(start)
    positions.append(start + lax.broadcasted_iota(jnp.int32, (n_rows, per_row), 0) * per_row +
                     lax.broadcasted_iota(jnp.int32, (n_rows, per_row), 1))
    start += n_rows * per_row
  # Magnitude bits (sign cleared), in the leaf's own width: a masked sum over rows that holds
  # one vector picks it out exactly.
  mags = [bits_of(v, format_of(v.dtype)) & ((1 << (format_of(v.dtype).nbits - 1)) - 1)
          for v in vecs]

  def system_reduce(values, reduce_op: str, init):
    out = init
    for i, v in enumerate(values):
      if v is not None:
        reduced = systems.row_reduce(jnp.max(v, axis=1) if reduce_op == "max" else
                                     jnp.min(v, axis=1), i, reduce_op)
        out = jnp.maximum(out, reduced) if reduce_op == "max" else jnp.minimum(out, reduced)
    return out

  def rows_of(v, i):
    return systems.per_row(v, i, vecs[i].shape[0])[:, None]

  def one_round(state):
    open_, decided, cands = state
    chosen = system_reduce([None if c is None else jnp.where(c, positions[i], _NO_POSITION)
                         for i, c in enumerate(cands)], "min",
                        jnp.full(cfg.num_systems, _NO_POSITION, jnp.int32))
    live = open_ & (chosen != _NO_POSITION)  # a system out of candidates keeps its step
    picked = []
    for i, c in enumerate(cands):
      if c is None:
        picked.append(jnp.zeros((cfg.num_systems, vecs[i].shape[-1]), mags[i].dtype))
        continue
      hit = c & (positions[i] == rows_of(chosen, i))
      masked = jnp.where(hit[..., None], mags[i], jnp.zeros((), mags[i].dtype))
      picked.append(systems.row_reduce(jnp.sum(masked, axis=1, dtype=mags[i].dtype), i, "sum"))
    res = jax.pure_callback(
        functools.partial(host_round, cfg, tuple(offsets)),
        jax.ShapeDtypeStruct((cfg.num_systems,), jnp.int8), live, chosen, c_words,
        *[as_words(u64(w)) for w in picked], vmap_method="sequential")
    exceeds = live & (res > 0)
    decided = jnp.where(exceeds, jnp.int8(decision.SCALE), decided)
    kept = []
    for i, c in enumerate(cands):
      if c is None:
        kept.append(None)
        continue
      in_leaf = (chosen >= offsets[i]) & (chosen < offsets[i] + math.prod(c.shape))
      same = jnp.all(mags[i] == systems.per_row(picked[i], i, c.shape[0])[:, None, :], axis=-1)
      kept.append(c & ~(same & rows_of(in_leaf, i)) & ~rows_of(exceeds, i))
    return live & ~exceeds, decided, tuple(kept)

  def settle():
    best = system_reduce(keys, "max", jnp.zeros(cfg.num_systems, jnp.uint64))
    floor = jnp.where(best > margin, best - margin, jnp.uint64(1))
    candidates = tuple(None if k is None else (k >= rows_of(floor, i)) & rows_of(tie, i)
                       for i, k in enumerate(keys))
    decided = jnp.where(tie, jnp.int8(decision.KEEP), action)
    return lax.while_loop(lambda state: jnp.any(state[0]), one_round,
                          (tie, decided, candidates))[1]

  return lax.cond(jnp.any(tie), settle, lambda: action)
