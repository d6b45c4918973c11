"""Baseline: per-system clipping written plainly with ``jax.ops.segment_sum``, under ``jax.jit``.

This is the implementation a user of batched simulations writes first, and the bar our own
kernels must beat by 2x on W2/W3 (issue 4). It is deliberately plain, with no care for the
rules of SPEC.md beyond the obvious; its departures are recorded in the conformance manifest.

  clip_by_global_norm:  n_k = sqrt(segment_sum(sum(x_row ** 2)))  over every leaf
                        out   = x * where(n_k > c_k, c_k / n_k, 1)[segment of the row]
  clip_by_max_step:     m_k = segment_max(||x_vector||_2)         over every leaf
                        out   = x * where(m_k > c_k, c_k / m_k, 1)[segment of the row]

Sums are taken in float32 for float16/bfloat16/float32 leaves (float64 if any leaf is), the
factor is applied in that dtype and the product rounded to the leaf dtype. ``segments=None``
is one system. Only the L2 norm and non-finite propagation exist.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from clipbench.impls.adapters import _common, _jax_common
from clipbench.protocol import Capabilities

framework = "jax"
library = "jax"
version = jax.__version__
description = "plain jax.ops.segment_sum / segment_max clipping under jax.jit"
capabilities = Capabilities(
    per_system=True, per_system_max=True, norm_types=(2.0,),
    dtypes=_jax_common.supported_dtypes(), nonfinite=("propagate",), returns_norm=True,
    in_place=False, transforms=("jit",), mixed_dtypes=True)


def _accumulation_dtype(leaves: Sequence[jax.Array]) -> Any:
  return jnp.float64 if any(x.dtype == jnp.float64 for x in leaves) else jnp.float32


def _rows(x: jax.Array) -> jax.Array:
  """The leaf as (rows, elements of a row); a 0-d leaf is one row."""
  return x.reshape(1, -1) if x.ndim == 0 else x.reshape(x.shape[0], -1)


def _segment_ids(leaves, segments) -> list[jax.Array]:
  if segments is None:
    return [jnp.zeros(_rows(x).shape[0], jnp.int32) for x in leaves]
  return list(segments)


def _scale(leaves, ids, factor) -> list[jax.Array]:
  out = []
  for x, seg in zip(leaves, ids):
    f = factor[seg].astype(factor.dtype)
    out.append((_rows(x).astype(factor.dtype) * f[:, None]).astype(x.dtype).reshape(x.shape))
  return out


@functools.partial(jax.jit, static_argnames=("num_systems",))
def _clip_by_global_norm(leaves, max_norm, ids, num_systems):
  acc = _accumulation_dtype(leaves)
  sq = jnp.zeros(num_systems, acc)
  for x, seg in zip(leaves, ids):
    rows = _rows(x).astype(acc)
    sq = sq + jax.ops.segment_sum(jnp.sum(rows * rows, axis=1), seg, num_segments=num_systems)
  norms = jnp.sqrt(sq)
  c = jnp.asarray(max_norm, acc)
  factor = jnp.where(norms > c, c / norms, jnp.ones_like(norms))
  return _scale(leaves, ids, factor), norms


@functools.partial(jax.jit, static_argnames=("num_systems",))
def _clip_by_max_step(leaves, max_step, ids, num_systems):
  acc = _accumulation_dtype(leaves)
  step = jnp.zeros(num_systems, acc)
  for x, seg in zip(leaves, ids):
    vectors = x.reshape(x.shape[0], -1, x.shape[-1]) if x.ndim >= 2 else x.reshape(-1, 1, 1)
    lengths = jnp.max(jnp.linalg.norm(vectors.astype(acc), axis=-1), axis=1, initial=0.0)
    step = jnp.maximum(step, jax.ops.segment_max(lengths, seg, num_segments=num_systems))
  c = jnp.asarray(max_step, acc)
  factor = jnp.where(step > c, c / step, jnp.ones_like(step))
  return _scale(leaves, ids, factor), step


def clip_by_global_norm(leaves: Sequence[Any], max_norm: Any, *,
                        segments: Sequence[Any] | None = None, num_systems: int | None = None,
                        norm_type: float = 2.0, nonfinite: str = "propagate"):
  _common.require_l2_propagate(norm_type, nonfinite, "the segment_sum baseline")
  leaves = [jnp.asarray(x) for x in leaves]
  ids = _segment_ids(leaves, segments)
  return _clip_by_global_norm(leaves, max_norm, ids, 1 if segments is None else num_systems)


def clip_by_max_step(leaves: Sequence[Any], max_step: Any, *,
                     segments: Sequence[Any] | None = None, num_systems: int | None = None,
                     nonfinite: str = "propagate"):
  _common.require_mode(nonfinite, ("propagate",), "the segment_sum baseline")
  leaves = [jnp.asarray(x) for x in leaves]
  ids = _segment_ids(leaves, segments)
  return _clip_by_max_step(leaves, max_step, ids, 1 if segments is None else num_systems)
