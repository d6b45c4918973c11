"""Work-item tables: one launch reads every leaf of a group through a table of addresses.

As apex's ``multi_tensor_apply`` and torch's ``_foreach`` kernels do, a pass over many leaves
is one launch: program ``i`` reads row ``i`` of an int64 table, which names a leaf by its
address and the run of its elements (or step vectors) the program covers. A leaf's address is
cast back to a typed pointer in the kernel, so one launch spans every leaf of one dtype.

A table depends only on the leaves' addresses and shapes (and the segment ids' addresses), so
a training loop that clips the same gradient tensors every step uploads it once: tables are
kept with the rest of a call's layout (:mod:`.layouts`).

A work item's length is chosen per table: long enough that a program's fixed costs (its table
row, its atomics) are paid over many tiles, short enough that a call of a few million elements
still has enough programs to fill the card (a few items per multiprocessor): a power of two
between :data:`MIN_ITEM_UNITS` and :data:`MAX_ITEM_UNITS`, near ``units / TARGET_ITEMS``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from clipbench.impls.own.torch.layout import Leaf

# Columns of a table row: the leaf's address, its segment ids' address (0: one system), the
# first unit (element or step vector) of the item and their count, units per row, the leaf's
# position in the call, the unit's length in elements, and (apply) the leaf's offset in its
# dtype's output buffer.
COLUMNS = ("address", "ids", "start", "count", "per_row", "leaf", "unit", "out")
NCOL = len(COLUMNS)
# Units per work item (the last item of a leaf holds the rest): see the module docstring.
# Multiples of every kernel's tile, so that items and tiles start where a tile would.
# The values measured best on an H200 (docs/gpu.md, section 11).
MIN_ITEM_UNITS = 1 << 11
MAX_ITEM_UNITS = 1 << 16
TARGET_ITEMS = 8192
ALIGNMENT = 16  # bytes: where a leaf must start for the kernels' 16-byte loads


@dataclasses.dataclass(frozen=True)
class Table:
  """A group's work items on the device: how many, of how many units each (the last of a leaf
  holds the rest), the most units one item holds (less than ``item_units`` when every leaf is
  shorter), how many units in all, and whether every leaf (and its place in the output
  buffer) starts at an :data:`ALIGNMENT` boundary."""

  rows: torch.Tensor  # (items, NCOL) int64
  items: int
  item_units: int
  longest: int
  units: int
  aligned: bool


def item_units(units: int) -> int:
  """The work-item length for a table of ``units`` units (module docstring)."""
  want = max(1, -(-units // TARGET_ITEMS))
  return min(MAX_ITEM_UNITS, max(MIN_ITEM_UNITS, 1 << (want - 1).bit_length()))


def work_items(leaves: list[tuple[int, Leaf]], device: torch.device, steps: bool = False,
               out_offsets: list[int] | None = None) -> Table:
  """The table of a group of ``(position, leaf)`` (nonempty, one dtype).

  Units are elements, or with ``steps`` the leaves' step vectors (their last axis).
  ``out_offsets`` gives each leaf's first element in its output buffer (apply tables).
  """
  size = item_units(sum(leaf.numel // max(leaf.vec if steps else 1, 1) for _, leaf in leaves))
  rows = _rows(leaves, steps, out_offsets, size)
  host = torch.from_numpy(rows)
  device_rows = host if device.type == "cpu" else torch.empty(
      host.shape, dtype=torch.int64, device=device).copy_(host)
  itemsize = leaves[0][1].x.element_size()
  aligned = bool(np.all(rows[:, 0] % ALIGNMENT == 0)
                 and np.all(rows[:, 7] * itemsize % ALIGNMENT == 0))
  return Table(device_rows, rows.shape[0], size, int(rows[:, 3].max()), int(rows[:, 3].sum()),
               aligned)


def _rows(leaves: list[tuple[int, Leaf]], steps: bool, out_offsets: list[int] | None,
          size: int) -> np.ndarray:
  unit = np.array([leaf.vec if steps else 1 for _, leaf in leaves], np.int64)
  units = np.array([leaf.numel for _, leaf in leaves], np.int64) // np.maximum(unit, 1)
  per_row = np.array([leaf.width for _, leaf in leaves], np.int64) // np.maximum(unit, 1)
  items = (units + size - 1) // size
  owner = np.repeat(np.arange(len(leaves)), items)
  first = np.cumsum(items) - items
  start = (np.arange(owner.size) - first[owner]) * size
  rows = np.empty((owner.size, NCOL), np.int64)
  rows[:, 0] = np.array([leaf.x.data_ptr() for _, leaf in leaves], np.int64)[owner]
  rows[:, 1] = np.array([0 if leaf.seg is None else leaf.seg.data_ptr() for _, leaf in leaves],
                        np.int64)[owner]
  rows[:, 2] = start
  rows[:, 3] = np.minimum(size, units[owner] - start)
  rows[:, 4] = np.maximum(per_row, 1)[owner]
  rows[:, 5] = np.array([i for i, _ in leaves], np.int64)[owner]
  rows[:, 6] = unit[owner]
  rows[:, 7] = 0 if out_offsets is None else np.array(out_offsets, np.int64)[owner]
  return rows
