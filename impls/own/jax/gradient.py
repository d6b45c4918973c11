"""The jitted operation with its custom JVP (``jax.grad`` and ``jax.vmap`` go through it).

The tangent is the identity where a system is kept, the derivative of ``x c / n(x)`` where it
is clipped for finite p, the factor held fixed for p = +-inf and max-step, and zero for
NaN-filled systems. Every coefficient is finite (made safe where unused), so reverse mode never
meets ``0 * inf``, and the gradient is finite at a zero input.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from clipbench.impls.own import decision
from clipbench.impls.own.jax import partitioned, partitioned_segments
from clipbench.impls.own.jax.config import Config
from clipbench.impls.own.jax.formats import pow2
from clipbench.impls.own.jax.forward import forward
from clipbench.impls.own.jax.linear_map import linear_map
from clipbench.impls.own.jax.systems import Systems, rows


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def clip(cfg: Config, leaves, segs, counts, threshold):
  """(outputs, norms) of the operation ``cfg`` describes."""
  if cfg.host:
    route = partitioned if segs is None else partitioned_segments
    return route.traced(cfg.api_op, cfg.p, cfg.nonfinite, cfg.num_systems, leaves,
                       segs, threshold)
  result = forward(cfg, leaves, segs, counts, threshold)
  return result.outs, result.norms


def _relative_norm_change(cfg: Config, systems: Systems, leaves, t_leaves, clipped, k_sys):
  """d n / n per system (0 where not clipped), finite p:
  sum(|a|^(p-1) sign(a) t 2**-k) / sum(|a|^p) with a = x 2**-k."""
  p = cfg.p
  sums = jnp.zeros(cfg.num_systems)
  coefs = []
  for i, x in enumerate(leaves):
    xr = rows(x).astype(jnp.float64)
    n_rows = xr.shape[0]
    clip_row = systems.per_row(clipped, i, n_rows)[:, None]
    scale = systems.per_row(pow2(-k_sys), i, n_rows)[:, None]
    a = jnp.where(clip_row & jnp.isfinite(xr), xr * scale, 0.0)
    sums = sums + systems.row_reduce(jnp.sum(jnp.abs(a) ** p, axis=1), i, "sum")
    coefs.append((jnp.abs(a) ** (p - 1.0)) * jnp.sign(a) * scale)
  inv = jnp.where(clipped & (sums > 0), 1.0 / jnp.where(sums > 0, sums, 1.0), 0.0)
  dots = jnp.zeros(cfg.num_systems)
  for i, (t, coef) in enumerate(zip(t_leaves, coefs)):
    dots = dots + systems.row_reduce(jnp.sum(coef * rows(t).astype(jnp.float64), axis=1), i,
                                     "sum")
  return dots * inv


@clip.defjvp
def _clip_jvp(cfg: Config, primals, tangents):
  leaves, segs, counts, threshold = primals
  # The tangent's coefficients come from the graph's decisions (the same exact decisions as
  # the kernels'; XLA drops the graph's own outputs when the host route gives the primal).
  result = forward(cfg, leaves, segs, counts, threshold)
  primal = clip(cfg, leaves, segs, counts, threshold) if cfg.host else (result.outs,
                                                                         result.norms)
  action, s_m, s_e = result.decided
  s_val = jnp.where(action == decision.SCALE, s_m * pow2(s_e), 0.0)
  k_sys = result.stats.sc_e - 1  # terms were scaled by 2**k (exact power of two)
  residuals = (tuple(leaves), segs, counts, action, s_val, k_sys)
  if segs is None:  # per-system values reach the rows by broadcasts, which JAX transposes
    t_outs = _tangent(cfg, residuals, tuple(tangents[0]))
  else:
    # The tangent is float64 arithmetic, taken under the call's jax.enable_x64. jax.grad
    # transposes it after that context has closed, where JAX's transpose of the per-system
    # gather makes float32 zeros for a float64 cotangent (TypeError); so the transpose is
    # taken here, under x64 too (a primitive of ours: JAX's linear_call has no batching rule,
    # and jax.vmap of jax.grad needs one).
    t_outs = linear_map(functools.partial(_tangent, cfg),
                        functools.partial(_transposed, cfg), residuals, tuple(tangents[0]))
  return primal, (tuple(t_outs), jnp.zeros_like(primal[1]))


def _tangent(cfg: Config, residuals, t_leaves):
  """The outputs' tangent, linear in ``t_leaves``: the identity where a system is kept, the
  derivative of ``x c / n(x)`` where it is clipped."""
  leaves, segs, counts, action, s_val, k_sys = residuals
  with jax.enable_x64(True):
    systems = Systems(segs, cfg.num_systems, cfg.sorted_flags, counts, cfg.may_be_sharded)
    exact_p = cfg.op != "step" and not math.isinf(cfg.p)
    if exact_p:
      rel = _relative_norm_change(cfg, systems, leaves, t_leaves, action == decision.SCALE,
                                  k_sys)
    t_outs = []
    for i, (x, t) in enumerate(zip(leaves, t_leaves)):
      xr = rows(x)
      tr = rows(t)
      n_rows = xr.shape[0]
      keep_row = systems.per_row(action == decision.KEEP, i, n_rows)[:, None]
      s_row = systems.per_row(s_val, i, n_rows)[:, None]
      scaled = tr.astype(jnp.float64) * s_row
      if exact_p:
        rel_row = systems.per_row(rel, i, n_rows)[:, None]
        x_safe = jnp.where(jnp.isfinite(xr), xr.astype(jnp.float64), 0.0)
        scaled = scaled - x_safe * (s_row * rel_row)
      out = jnp.where(keep_row, tr, scaled.astype(t.dtype))
      if cfg.zero_mode:
        out = jnp.where(jnp.isfinite(xr), out, jnp.zeros_like(out))
      t_outs.append(out.reshape(x.shape))
    return tuple(t_outs)


def _transposed(cfg: Config, residuals, cotangents):
  """The transpose of :func:`_tangent` (reverse mode), taken under x64."""
  with jax.enable_x64(True):
    examples = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in residuals[0])
    (t_leaves,) = jax.linear_transpose(functools.partial(_tangent, cfg, residuals),
                                       examples)(tuple(cotangents))
    return tuple(t_leaves)


clip_jit = jax.jit(clip, static_argnums=(0,))
