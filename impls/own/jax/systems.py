"""How rows map to systems, the views the reductions run on, and what a pass reports.

With segments a leaf is seen as (rows, elements per row); segment ids assign each row to a
system. Per-system reductions are segment reductions over per-row values, and per-system
values reach the rows by a gather. Without ids (one system) a leaf keeps its own axes
(:func:`block`), so that a leaf split along any axis is reduced where its shards lie.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from clipbench.impls.own.jax.formats import FORMATS

# Groups a leaf's rows are cut into, at most, for a reduction without segments: XLA on CPU
# reduces many groups in parallel but one long group serially.
GROUP_ROWS = 1024
# Elements a group of a leaf's :func:`block` view holds at least: enough work per task for XLA
# on CPU, and few groups per leaf, whose partial results cross devices when a leaf is split
# along an inner axis (each device then holds a part of every group).
MIN_GROUP_ELEMENTS = 1 << 14
# A segment reduction's rows are padded to a multiple of this, the padding's ids out of range
# (dropped). XLA's partitioner pads a leaf whose rows do not divide among the devices, and
# then all-gathers a scatter's indices; rows that divide evenly stay where they are. Eight
# divides among 1, 2, 4 and 8 devices (at 2 the padding may move a few boundary rows); other
# counts move at most a few rows a device, never the leaf. (Reducing a head of a multiple of
# eight rows and the tail apart moves nothing either, but its slices cost more memory.)
SEGMENT_ROWS = 8


class Systems(NamedTuple):
  """How rows map to systems: segment ids per leaf (or None: one system)."""

  segs: Any  # tuple of int32 ids per leaf, or None
  num: int
  sorted: tuple  # per leaf: its ids are sorted (a static hint to the segment reductions)
  counts: Any = None  # elements per system, when known on the host
  # The leaves may be split over devices (``Config.may_be_sharded``): segment reductions pad
  # their rows, and :func:`block` cuts groups only where every split is even.
  may_be_sharded: bool = True

  def row_reduce(self, v, leaf: int, op: str):
    """Per-system reduction of per-row values v (rows, ...) of one leaf."""
    if self.segs is None:
      if op == "sum":
        return jnp.sum(v, axis=0, keepdims=True)
      return (jnp.max if op == "max" else jnp.min)(v, axis=0, keepdims=True)
    return segment_reduce(v, self.segs[leaf], self.num, op, bool(self.sorted[leaf]),
                          self.may_be_sharded)

  def per_row(self, v, leaf: int, rows: int):
    """Per-system values v (S, ...) broadcast to the rows of one leaf."""
    if self.segs is None:
      return jnp.broadcast_to(v[0], (rows,) + v.shape[1:])
    return v[self.segs[leaf]]


def segment_reduce(v, ids, num: int, op: str, ids_sorted: bool, pad_rows: bool = True):
  """``jax.ops.segment_{op}`` of per-row values v (rows, ...), its rows padded to a multiple of
  ``SEGMENT_ROWS`` (the padding's ids are ``num``: dropped, and still sorted). The same
  additions in the same order: no bits change. ``pad_rows`` False: no padding."""
  extra = -v.shape[0] % SEGMENT_ROWS if pad_rows else 0
  if extra:
    v = jnp.pad(v, ((0, extra),) + ((0, 0),) * (v.ndim - 1))
    ids = jnp.pad(ids, (0, extra), constant_values=num)
  fn = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max,
        "min": jax.ops.segment_min}[op]
  return fn(v, ids, num_segments=num, indices_are_sorted=ids_sorted)


class SystemStats(NamedTuple):
  """What a pass hands to ``decision.finalize`` per system (arrays of shape (S,))."""

  s_hi: Any
  s_lo: Any
  sc_m: Any
  sc_e: Any
  rel_err: Any
  zero: Any
  nan: Any
  inf: Any
  vector_keys: Any = None  # max-step: per leaf, a key monotone in each vector's norm (or None)


def rows(x):
  """A leaf as (rows, elements per row) (a 0-d leaf is one row of one element)."""
  if x.ndim == 0:
    return x.reshape(1, 1)
  return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def vectors(x):
  """A leaf as (rows, vectors per row, vector length): max-step's last-axis vectors."""
  n_rows = x.shape[0] if x.ndim else 1
  d = x.shape[-1] if x.ndim >= 2 else 1
  return x.reshape(n_rows, math.prod(x.shape[1:-1]) if x.ndim >= 2 else 1, d)


def counted_elements(leaves, systems: Systems):
  """Elements per system, counted in the graph."""
  count = jnp.zeros(systems.num, jnp.int64)
  for i, x in enumerate(leaves):
    n_rows, width = rows(x).shape
    if n_rows == 0 or width == 0:
      continue
    if systems.segs is None:
      count = count + n_rows * width
    else:
      count = count + segment_reduce(jnp.full(n_rows, width, jnp.int64), systems.segs[i],
                                     systems.num, "sum", bool(systems.sorted[i]),
                                     systems.may_be_sharded)
  return count


def element_counts(leaves, systems: Systems):
  """Elements per system: the host's count when it has one, else counted in the graph."""
  if systems.counts is not None:
    return systems.counts.astype(jnp.int64)
  return counted_elements(leaves, systems)


def nonfinite_flags(nan, nonfinite, systems: Systems, leaf: int, axes):
  """Per-system (has NaN, has inf) of one leaf from per-element flags reduced over axes."""
  flags = (jnp.any(nan, axis=axes).astype(jnp.int32) * 2 +
           jnp.any(nonfinite & ~nan, axis=axes).astype(jnp.int32))
  fl = jnp.maximum(systems.row_reduce(flags, leaf, "max"), 0)
  return fl >= 2, fl == 1


def block(x, systems: Systems):
  """A leaf as the view its reductions run on, over every axis but the first: its rows with
  segments; otherwise (None for an empty leaf) the leaf on its own axes, its rows cut into
  :func:`_groups` groups of consecutive rows along a new first axis.

  The leaf keeps every axis, so a split along any of them (rows, columns: tensor
  parallelism) stays a split of the view, and XLA's partitioner moves nothing to build it;
  a flat view cut into rows would need the leaf's elements in flat order on each device. The
  groups are there for XLA on CPU, which reduces many groups in parallel but one long group
  serially (a leaf of odd rows is one group). Where the leaves may be sharded, groups that
  the device count does not divide become one: the exact sums do not depend on them."""
  if systems.segs is not None:
    return rows(x)
  if x.size == 0:
    return None
  if x.ndim == 0:
    return x.reshape(1, 1)
  groups = _groups(x)
  if systems.may_be_sharded and groups % jax.device_count():
    # Rows that may be split over a mesh axis that does not divide the groups (so not the
    # rows either: XLA pads the last shards) cannot be viewed as groups where they lie, and
    # XLA's partitioner would all-gather the leaf to build the view. A mesh axis divides the
    # device count; where the count divides the groups, every split is even.
    groups = 1
  return x.reshape((groups, x.shape[0] // groups) + x.shape[1:])


def _groups(x) -> int:
  """Groups of a leaf's :func:`block` view: :func:`_group_rows`, and at most one per
  MIN_GROUP_ELEMENTS elements (a power of two)."""
  per_elements = x.size // MIN_GROUP_ELEMENTS
  return max(1, min(_group_rows(x), 1 << (per_elements.bit_length() - 1) if per_elements else 1))


def inner_axes(v) -> tuple[int, ...]:
  """The axes a :func:`block` view is reduced over: all but the first."""
  return tuple(range(1, v.ndim))


def variadic_reduce(arrays, inits, ops, axes: tuple[int, ...]):
  """Several reductions over the same axes in a single variadic XLA reduce (XLA on CPU runs
  one multi-output reduce far faster than separate reductions of a shared fused producer)."""
  fns = {"sum": lax.add, "max": lax.max, "min": lax.min}

  def body(a, b):
    return tuple(fns[op](u, w) for op, u, w in zip(ops, a, b))

  inits = tuple(jnp.asarray(i, a.dtype) for i, a in zip(inits, arrays))
  return lax.reduce(tuple(arrays), inits, body, axes)


def per_group(v, view):
  """Per-group (or per-row) values v (groups,) shaped to broadcast against ``view``."""
  return v.reshape(v.shape + (1,) * (view.ndim - 1))


def _group_rows(x) -> int:
  """Groups of a leaf's rows in a :func:`block` view or a :func:`dtype_blocks` block: the
  largest power of two, at most GROUP_ROWS, that divides the leaf's own rows."""
  n_rows = x.shape[0] if x.ndim else 1
  return min(GROUP_ROWS, n_rows & -n_rows)


def may_lie_split(may_be_sharded: bool) -> bool:
  """Whether a call's leaves may lie split over devices: a call that may be sharded
  (``Config.may_be_sharded``), with more than one device to split them over."""
  return may_be_sharded and jax.device_count() > 1


def grouped(leaves, fmts, systems: Systems):
  """The views a pass that decodes every element reduces, with their formats: with segments,
  each leaf's :func:`rows`; with one system, a few (rows, width) blocks
  (:func:`dtype_blocks`), whose single decode/extract chain each keeps the XLA graph (and its
  compile time) small for models with hundreds of leaves. Where the leaves may lie split
  (:func:`may_lie_split`), a block holds only 1-D leaves whose block rows the devices divide:
  a block lays a leaf's elements out in flat order, which XLA's partitioner builds by moving
  a leaf split along an inner axis (tensor parallelism's columns) or into rows that do not
  divide among the devices. Every other leaf is reduced on its :func:`block` view, a chain of
  its own (compile time grows with those leaves: docs/sharding.md). Empty leaves have no
  view (one system: nothing to reduce)."""
  if systems.segs is not None:
    return [rows(x) for x in leaves], fmts
  apart, joined = apart_and_joined(leaves, systems.may_be_sharded)
  views = [v for v in (block(x, systems) for x in apart) if v is not None]
  views += dtype_blocks(joined)
  return views, [FORMATS[np.dtype(v.dtype)] for v in views]


def apart_and_joined(leaves, may_be_sharded: bool) -> tuple[list, list]:
  """One system's leaves as (those read apart, those that join :func:`dtype_blocks`' blocks).
  Every leaf joins where none may lie split (:func:`may_lie_split`); else only 1-D leaves
  whose block rows the device count divides, the leaves that join a block where they lie:
  such a leaf can be split by its rows only, and each device's rows are then whole rows of
  the block (a mesh axis divides the device count)."""
  if not may_lie_split(may_be_sharded):
    return [], list(leaves)
  devices = jax.device_count()
  joins = [x.ndim == 1 and not _group_rows(x) % devices for x in leaves]
  return ([x for x, j in zip(leaves, joins) if not j], [x for x, j in zip(leaves, joins) if j])


def dtype_blocks(leaves, one_per_dtype: bool = False) -> list:
  """One system's leaves as (rows, width) blocks, one per dtype and block rows.

  A leaf's block rows are a power of two that divides its own rows (:func:`_group_rows`), and
  the leaves of a block are laid side by side along the width. A leaf whose rows are split
  over devices (in as many parts as that power of two holds) is then split the same way in
  the block, and XLA's partitioner moves none of it: a concatenation of the flat leaves one
  after another, cut into rows, it all-gathers. No padding either: a block holds exactly the
  leaves' elements. ``one_per_dtype``: one block per dtype, of the fewest rows any of its
  leaves has (as few as one), for a single scatter per dtype."""
  present = [x for x in leaves if x.size]
  rows_of = {i: _group_rows(x) for i, x in enumerate(present)}
  if one_per_dtype:
    fewest: dict[np.dtype, int] = {}
    for i, x in enumerate(present):
      fewest[np.dtype(x.dtype)] = min(fewest.get(np.dtype(x.dtype), GROUP_ROWS), rows_of[i])
    rows_of = {i: fewest[np.dtype(x.dtype)] for i, x in enumerate(present)}
  groups: dict[tuple, list] = {}
  for i, x in enumerate(present):
    groups.setdefault((np.dtype(x.dtype), rows_of[i]), []).append(x.reshape(rows_of[i], -1))
  return [jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
          for parts in groups.values()]
