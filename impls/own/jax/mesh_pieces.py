"""Which leaves a partitioning rule keeps split, and each device's piece, as XLA tiles them.

A rule's program reads each leaf in a placement it chooses, and XLA moves the leaf there
first. :func:`pieces` (calls without segments, :mod:`.partitioned`) keeps a leaf's splits of
its rows and of its second axis (tensor parallelism's columns), over any mesh axes, so a
device reads its own tile in place; :func:`placements` (per-system calls,
:mod:`.partitioned_segments`, whose ids follow the rows) keeps a split of the rows over one
axis only. Anything else is made whole on every device.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clipbench.impls.own.numba.layout import SUB_BLOCK
from clipbench.impls.own.numba.shard_plan import ShardLayout


def rows_axis(sharding: Any, ndim: int) -> str | None:
  """The mesh axis a leaf's rows are split on, when that is its only split."""
  spec = getattr(sharding, "spec", None)
  if spec is None or ndim == 0 or len(spec) == 0:
    return None
  first = spec[0]
  if isinstance(first, tuple):
    first = first[0] if len(first) == 1 else None
  if not isinstance(first, str) or any(s is not None for s in spec[1:]):
    return None
  return first if sharding.mesh.shape[first] > 1 else None


def shard_rows(rows: int, ranks: int) -> list[int]:
  """Rows of each device along an axis of ``ranks`` devices, as XLA tiles them
  (:func:`_tile`)."""
  return [_tile(rows, ranks, g)[1] for g in range(ranks)]


def local_shape(shape: tuple, ranks: int) -> tuple:
  """A rows-split leaf's buffer on each device (XLA pads the short ones)."""
  return (-(-shape[0] // ranks),) + tuple(shape[1:])


def placements(mesh: Any, arg_shapes) -> tuple[str | None, tuple]:
  """(the axis rows are split on, or None; per array its sharding in the rule's program):
  rows on the first rows-split array's axis where an array is split so, else whole."""
  axes = [rows_axis(a.sharding, len(a.shape)) for a in arg_shapes]
  axis = next((a for a in axes if a is not None), None)
  whole = NamedSharding(mesh, P())
  return axis, tuple(NamedSharding(mesh, P(axis, *[None] * (len(a.shape) - 1)))
                     if a_axis == axis and axis is not None else whole
                     for a, a_axis in zip(arg_shapes, axes))


class Pieces(NamedTuple):
  """Every device's piece of every leaf in a rule's program (:func:`pieces`)."""

  axes: tuple[str, ...]  # mesh axes the devices exchange over, in mesh order; () none
  shardings: tuple  # per leaf, its sharding in the program
  shards: ShardLayout  # one system, leaves as ``views``; ranks: linear index over ``axes``
  views: tuple  # per leaf, the (rows, row size) the plan reads it as (else its shape)
  buffers: tuple  # per leaf, its buffer's shape on a device (XLA pads short tiles)
  held: tuple  # per rank, per leaf: the shape of the tile it holds (a copy's too)
  held_views: tuple  # the same as ``views`` read it
  by_columns: tuple  # per leaf, whether it is split along an axis after its first


def _axes(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _tile(size: int, ways: int, index: int) -> tuple[int, int]:
  """(start, length) of tile ``index`` of ``ways`` along an axis of ``size``: XLA's tiling,
  ``ceil(size / ways)`` a tile, the last ones short or empty."""
  tile = -(-size // ways)
  start = min(index * tile, size)
  return start, min(tile, size - start)


class _Kept(NamedTuple):
  """The splits of a leaf that a rule's program keeps."""

  rows: tuple = ()  # mesh axes splitting its first axis
  columns: tuple = ()  # mesh axes splitting axis ``dim``
  dim: int = 1


def _kept(shape: tuple, sharding: Any, mesh: Any, rows_only: bool) -> _Kept:
  """A leaf's splits of its first axis and of one other, ``dim``, with every axis between
  them whole: the leaf is then read as rows of ``shape[:dim]``, each device holding one
  stretch of each (a ``ShardLayout``'s columns). Other splits are dropped (those axes made
  whole), and so is ``dim``'s where ``rows_only`` (max-step: its vectors are the last axis,
  and a block's result is not merged from pieces of one vector), or where some tile's
  stretch of a row is neither empty, whole, nor at least ``SUB_BLOCK`` elements: the numba
  route's bits come from sub-blocks in the order of the rows, and a sub-block two devices
  share travels as its elements, so narrower columns (a relaxation's 3-vectors) would send
  nearly every element; they are gathered along that axis instead."""
  spec = tuple(getattr(sharding, "spec", None) or ())
  if not shape or not spec:
    return _Kept()
  entries = [tuple(a for a in _axes(e) if mesh.shape.get(a, 1) > 1) for e in spec]
  entries += [()] * (len(shape) - len(entries))
  split = [k for k in range(1, len(shape)) if entries[k]]
  if len(split) != 1 or rows_only:
    return _Kept(entries[0])
  dim = split[0]
  ways, inner = math.prod(mesh.shape[a] for a in entries[dim]), math.prod(shape[dim + 1:])
  widths = {_tile(shape[dim], ways, g)[1] * inner for g in range(ways)}
  if not all(w in (0, inner * shape[dim]) or w >= SUB_BLOCK for w in widths):
    return _Kept(entries[0])
  return _Kept(entries[0], entries[dim], dim)


def _spec(kept: _Kept, ndim: int) -> P:
  entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes
  entries = [None] * ndim
  entries[0] = entry(kept.rows)
  if kept.columns:
    entries[kept.dim] = entry(kept.columns)
  return P(*entries)


def pieces(mesh: Any, arg_shapes, rows_only: bool = False) -> Pieces:
  """Each leaf (``arg_shapes``: shapes with shardings) split as it is along its first axis
  and one other (the first only where ``rows_only``), over any axes of ``mesh``
  (:func:`_kept`), and every device's tile.

  The devices that exchange are those along the axes some leaf is split on; along another
  axis, each group of them runs the same program apart. Within a group, a device whose tile
  of a leaf is a copy of another's (that leaf is not split along one of the group's axes)
  counts none of its rows, and holds whole rows in the plan's order, after the others; it
  still scales its copy. A leaf split along an axis ``dim`` > 1 is read as rows of
  ``shape[:dim]``: for one system (no segments) the blocks, cut from the run's elements in
  order, are the same."""
  shapes = [tuple(a.shape) for a in arg_shapes]
  kept = [_kept(s, a.sharding, mesh, rows_only) for s, a in zip(shapes, arg_shapes)]
  used = {a for k in kept for a in k.rows + k.columns}
  axes = tuple(a for a in mesh.axis_names if a in used)
  shardings = tuple(NamedSharding(mesh, _spec(k, len(s)) if (k.rows or k.columns) else P())
                    for s, k in zip(shapes, kept))
  places = [dict(zip(axes, place)) for place in np.ndindex(*(mesh.shape[a] for a in axes))]
  ranks, nl = len(places), len(shapes)
  linear = lambda place, over: int(np.ravel_multi_index(
      tuple(place[a] for a in over), tuple(mesh.shape[a] for a in over))) if over else 0
  counts = np.zeros((ranks, nl, 1), np.int64)
  starts = np.zeros((nl, ranks), np.int64)
  columns = np.zeros((nl, ranks, 2), np.int64)
  measured = np.ones((nl, ranks), bool)
  held = [[()] * nl for _ in range(ranks)]
  held_views = [[()] * nl for _ in range(ranks)]
  views, buffers = [], []
  for i, (shape, k) in enumerate(zip(shapes, kept)):
    ways = [1] * len(shape)
    if shape:
      ways[0] = math.prod(mesh.shape[a] for a in k.rows)
    if k.columns:
      ways[k.dim] = math.prod(mesh.shape[a] for a in k.columns)
    # The plan's rows: the first axis, times the whole ones before ``dim``.
    middle = math.prod(shape[1:k.dim]) if k.columns else 1
    inner = math.prod(shape[k.dim + 1:]) if k.columns else 1
    views.append((shape[0] * middle, math.prod(shape[1:]) // middle) if k.columns else shape)
    rowsize = math.prod(views[-1][1:]) if shape else 1
    columns[i, :, 1] = rowsize
    buffers.append(tuple(-(-d // w) for d, w in zip(shape, ways)))
    for g, place in enumerate(places):
      first, count = _tile(shape[0], ways[0], linear(place, k.rows)) if shape else (0, 1)
      tile = list(shape)
      if shape:
        tile[0] = count
      left, width = 0, 0
      if k.columns:
        left, width = _tile(shape[k.dim], ways[k.dim], linear(place, k.columns))
        tile[k.dim] = width
      held[g][i] = tuple(tile)
      held_views[g][i] = (count * middle, width * inner) if k.columns else tuple(tile)
      measured[i, g] = not (k.rows or k.columns) or all(
          place[a] == 0 for a in axes if a not in k.rows + k.columns)
      counts[g, i, 0] = count * middle if measured[i, g] else 0
      starts[i, g] = first * middle
      if measured[i, g] and k.columns:
        columns[i, g] = (left * inner, (left + width) * inner)
  split = np.array([bool(k.rows or k.columns) for k in kept])
  # Each leaf's ranks in the order of their rows, then columns; copies last.
  order = np.lexsort((counts[:, :, 0].T, columns[:, :, 0], starts, ~measured))
  order = np.where(split[:, None], order, np.arange(ranks))
  shards = ShardLayout(counts, order.astype(np.int64), ~split, columns)
  return Pieces(axes, shardings, shards, tuple(views), tuple(buffers),
                tuple(tuple(h) for h in held), tuple(tuple(h) for h in held_views),
                tuple(bool(k.columns) for k in kept))
