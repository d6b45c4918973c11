"""Which leaves a partitioning rule keeps split: rows over one mesh axis, as XLA tiles them.

A leaf whose only split is its rows over one axis (``PartitionSpec(axis, None, ...)``) keeps
it; anything else is made whole on every device by XLA before the rule's program runs
(:mod:`.partitioned`).
"""

from __future__ import annotations

from typing import Any

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


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
  """Rows of each device along an axis of ``ranks`` devices, as XLA tiles them:
  ``ceil(rows / ranks)`` per device, the last ones short or empty."""
  tile = -(-rows // ranks)
  return [max(0, min(tile, rows - g * tile)) for g in range(ranks)]


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
