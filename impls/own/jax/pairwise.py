"""Sums over the last axis in a fixed pairwise tree: elementwise adds, so XLA cannot reorder
them and each vector's sum is deterministic (max-step's squared vector norms)."""

from __future__ import annotations

import jax.numpy as jnp

from clipbench.impls.own import double_double


def _padded_width(d: int) -> int:
  return 1 << max(0, (d - 1).bit_length())


def _padding(v, width: int):
  """The zeros that pad v's last axis to width."""
  return jnp.zeros(v.shape[:-1] + (width - v.shape[-1],), v.dtype)


def pairwise_sum_last(v):
  """Sum over the last axis in a fixed pairwise tree."""
  width = _padded_width(v.shape[-1])
  if width != v.shape[-1]:
    v = jnp.concatenate([v, _padding(v, width)], axis=-1)
  while v.shape[-1] > 1:
    h = v.shape[-1] // 2
    v = v[..., :h] + v[..., h:]
  return v[..., 0]


def pairwise_dd_sum_last(hi, lo):
  """The same tree in double-double: (hi, lo) of the sum of hi + lo over the last axis."""
  width = _padded_width(hi.shape[-1])
  if width != hi.shape[-1]:
    pad = _padding(hi, width)
    hi = jnp.concatenate([hi, pad], axis=-1)
    lo = jnp.concatenate([lo, pad], axis=-1)
  while hi.shape[-1] > 1:
    h = hi.shape[-1] // 2
    s, e = double_double.two_sum(jnp, hi[..., :h], hi[..., h:])
    hi, lo = s, e + (lo[..., :h] + lo[..., h:])
  return hi[..., 0], lo[..., 0]
