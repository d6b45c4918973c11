"""The whole operation as one traceable function (under x64): power sums, the decision, the
near-tie fallback, the reported norms and the apply pass."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from clipbench.impls.own import decision
from clipbench.impls.own.jax import narrow, wide
from clipbench.impls.own.jax.apply import Decision, apply_factors
from clipbench.impls.own.jax.config import Config, Threshold
from clipbench.impls.own.jax.exact_fallback import resolve_ties
from clipbench.impls.own.jax.formats import FORMATS, format_of
from clipbench.impls.own.jax.rounding import round_nearest_bits
from clipbench.impls.own.jax.systems import Systems, SystemStats


class Forward(NamedTuple):
  """The outputs and what the gradient needs of the forward pass."""

  outs: tuple
  norms: Any
  decided: Decision
  stats: SystemStats


def system_stats(cfg: Config, leaves, systems: Systems) -> SystemStats:
  """finalize inputs from the route the leaves' dtypes select."""
  if cfg.op == "step":
    if cfg.precise:
      return wide.step_stats(leaves, [format_of(x.dtype) for x in leaves], systems,
                             cfg.zero_mode)
    return narrow.step_stats(leaves, systems, cfg.zero_mode)
  if cfg.precise:
    return wide.global_stats(leaves, [format_of(x.dtype) for x in leaves], systems, cfg.p,
                             cfg.zero_mode)
  return narrow.global_stats(leaves, systems, cfg.p, cfg.zero_mode)


def _reported_norms(norm_v, stats: SystemStats, nan, inf, precise: bool):
  """norm_v * 2**sc_e rounded to nearest into float64 (float32 without float64 leaves), on
  the bits, so subnormal norms survive; inf and NaN for poisoned systems."""
  norm_dtype = jnp.float64 if precise else jnp.float32
  nb = round_nearest_bits(jnp.where(stats.zero, 0.0, norm_v), stats.sc_e,
                          FORMATS[np.dtype(norm_dtype)])
  norms = lax.bitcast_convert_type(nb, norm_dtype)
  norms = jnp.where(inf, jnp.asarray(jnp.inf, norm_dtype), norms)
  return jnp.where(nan, jnp.asarray(jnp.nan, norm_dtype), norms)


def forward(cfg: Config, leaves, segs, counts, threshold: Threshold) -> Forward:
  """The operation on every system (traceable, under x64)."""
  systems = Systems(segs, cfg.num_systems, cfg.sorted_flags, counts, cfg.may_be_sharded)
  st = system_stats(cfg, leaves, systems)
  nan = st.nan & (not cfg.zero_mode)
  inf = st.inf & ~nan & (not cfg.zero_mode)
  norm_v, action, s_m, s_e, tie = decision.finalize(
      jnp, s_hi=st.s_hi, s_lo=st.s_lo, sc_m=st.sc_m, sc_e=st.sc_e, rel_err=st.rel_err,
      zero=st.zero, nan=nan, inf=inf, c_m=threshold.m, c_e=threshold.e, c_inf=threshold.inf,
      p=2.0 if cfg.op == "step" else cfg.p, precise=cfg.precise)
  action = resolve_ties(cfg, tie, action, threshold, leaves, segs, st.vector_keys)
  norms = _reported_norms(norm_v, st, nan, inf, cfg.precise)
  decided = Decision(action, s_m, s_e)
  # No work moves across this line, where nothing could be fused anyway (the factors need
  # every pass's reductions); without it XLA weighs fusing each leaf's apply with that leaf's
  # passes, and compiles a many-leaf call two to four times slower (docs/sharding.md).
  decided, leaves = lax.optimization_barrier((decided, tuple(leaves)))
  outs = apply_factors(list(leaves), systems, decided, cfg.zero_mode, cfg.precise)
  return Forward(outs, norms, decided, st)
