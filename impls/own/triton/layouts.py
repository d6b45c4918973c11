"""A call's launch layout, kept between calls: what depends only on its leaves' addresses,
shapes and dtypes (and its segment ids' addresses).

A training loop clips the same gradient tensors every step, so the Python work a call does
per leaf -- grouping the leaves into work-item tables (:mod:`.tables`), placing each output in
its dtype's buffer, uploading the tables -- is done once per layout and kept, by
:func:`signature`, in a small cache. A call whose layout is cached walks its leaves only in
a few C-level maps (their addresses, shapes and dtypes) and to cut its outputs, which keeps
its host work near a microsecond a leaf (``docs/gpu.md``, section 6).

A layout holds integers and device tables only, never the caller's tensors, so it keeps no
memory of theirs alive; two calls with the same signature address the same bytes in the same
way, whichever tensor objects they pass.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import torch

from clipbench.impls.own.torch.layout import Batch, Leaf
from clipbench.impls.own.triton import tables

_CACHE_SIZE = 64
_cache: collections.OrderedDict = collections.OrderedDict()
_last: tuple[tuple, Layout] | None = None  # the key and layout of the last call


@dataclasses.dataclass(frozen=True)
class Outputs:
  """One dtype's outputs: cut from one buffer, written by one apply launch over ``table``.

  Each output starts at a multiple of :data:`tables.ALIGNMENT` bytes of the buffer (as the
  allocation does), so that the kernel's full tiles store 16 bytes at a time; ``cuts`` is
  None when no output needs padding (the buffer is cut by ``sizes``), else the sizes of the
  outputs and of the gaps between them, alternating."""

  dtype: torch.dtype
  positions: tuple[int, ...]  # the leaves', in the call
  sizes: list[int]
  cuts: list[int] | None
  total: int  # elements of the buffer
  table: tables.Table
  shaped: tuple[tuple[int, torch.Size], ...]  # (index in ``positions``, shape) of leaves not 1-D


@dataclasses.dataclass
class Layout:
  """What a call's launches need that its signature determines (the module docstring)."""

  device: torch.device
  numel: int
  longest: int  # the longest last axis of a nonempty leaf (1 for 0-d and 1-D leaves)
  dtypes: frozenset  # of the nonempty leaves
  low: bool  # some nonempty leaf is float16, bfloat16 or float32
  empty: tuple[int, ...]  # leaves without elements (their outputs are copies)
  empty_with_rows: tuple[int, ...]  # of those, the ones whose ids still need a range check
  leaves: list[tuple[int, Leaf]]  # the nonempty leaves, as first seen (shapes, ids: not x)
  _groups: dict = dataclasses.field(default_factory=dict)
  _outputs: list[Outputs] | None = None

  def groups(self, steps: bool, rows_upto: int,
             max_vec: int) -> list[tuple[tuple[torch.dtype, int], tables.Table]]:
    """The nonempty leaves by dtype and by the padded length read at a time of their rows
    (for step norms, and for leaves whose last axis is at most ``rows_upto`` long; 1:
    elements), rows at most ``max_vec`` long: one table, one launch each."""
    key = (steps, rows_upto, max_vec)
    if key not in self._groups:
      members: dict[tuple[torch.dtype, int], list[tuple[int, Leaf]]] = {}
      for i, leaf in self.leaves:
        if steps and leaf.vec == 0:
          continue
        as_rows = steps or 1 < leaf.vec <= rows_upto
        vec = min(_pow2_at_least(leaf.vec), max_vec) if as_rows else 1
        members.setdefault((leaf.x.dtype, vec), []).append((i, leaf))
      # Rows of one element are elements: as rows or not, the same table.
      self._groups[key] = [(k, tables.work_items(group, self.device, steps=steps or k[1] > 1))
                           for k, group in members.items()]
    return self._groups[key]

  def outputs(self) -> list[Outputs]:
    """The outputs by dtype, and the apply launch's table of each."""
    if self._outputs is None:
      by_dtype: dict[torch.dtype, list[tuple[int, Leaf]]] = {}
      for i, leaf in self.leaves:
        by_dtype.setdefault(leaf.x.dtype, []).append((i, leaf))
      self._outputs = []
      for dtype, members in by_dtype.items():
        sizes = [leaf.numel for _, leaf in members]
        align = max(1, tables.ALIGNMENT // dtype.itemsize)
        padded = [-(-size // align) * align for size in sizes]
        offsets = np.cumsum([0] + padded[:-1]).tolist()
        gaps = padded != sizes
        cuts = [n for size, room in zip(sizes, padded) for n in (size, room - size)]
        shaped = tuple((j, leaf.x.shape) for j, (_, leaf) in enumerate(members)
                       if leaf.x.dim() != 1)
        self._outputs.append(Outputs(
            dtype, tuple(i for i, _ in members), sizes, cuts if gaps else None, sum(padded),
            tables.work_items(members, self.device, out_offsets=offsets), shaped))
    return self._outputs


def signature(batch: Batch) -> tuple:
  """What a layout depends on: the leaves' addresses, shapes and dtypes, the ids' addresses,
  the device, and the table constants (which the tuning script changes)."""
  ids = None
  if batch.per_system:
    ids = tuple(0 if seg is None else seg.data_ptr() for seg in batch.segs)
  # The batch's shapes and dtypes are the leaves' (contiguous copies and sanitized leaves
  # keep both); only the addresses are read here.
  return (batch.device, tuple(map(torch.Tensor.data_ptr, batch.tensors)),
          batch.shapes, batch.dtypes, ids, tables.MIN_ITEM_UNITS, tables.MAX_ITEM_UNITS,
          tables.TARGET_ITEMS, tables.ALIGNMENT)


def layout_of(batch: Batch) -> Layout:
  """The layout of a prepared batch (contiguous leaves), from the cache when it is there."""
  global _last  # pylint: disable=global-statement
  key = signature(batch)
  # A training loop passes the same leaves every step: the last layout costs one comparison
  # of the keys, where the cache hashes a key (10,000 addresses and shapes at W4) and compares
  # it twice (the lookup, and the move to the end).
  last = _last
  if last is not None and last[0] == key:
    return last[1]
  layout = _cache.get(key)
  if layout is not None:
    _cache.move_to_end(key)
  else:
    layout = _build(batch)
    _cache[key] = layout
    if len(_cache) > _CACHE_SIZE:
      _cache.popitem(last=False)
  _last = (key, layout)
  return layout


def clear() -> None:
  """Forgets every layout (after the table constants change)."""
  global _last  # pylint: disable=global-statement
  _cache.clear()
  _last = None


def _build(batch: Batch) -> Layout:
  # The layout keeps the leaves' facts, not their tensors: each kept Leaf holds an empty
  # stand-in of the leaf's dtype and shape, and of its ids.
  nonempty, empty, empty_with_rows = [], [], []
  for i, leaf in enumerate(batch.leaves):
    if leaf.numel:
      nonempty.append((i, dataclasses.replace(leaf, x=_StandIn(leaf.x), seg=None if leaf.seg
                                              is None else _StandIn(leaf.seg))))
    else:
      empty.append(i)
      if leaf.rows:
        empty_with_rows.append(i)
  return Layout(
      device=batch.device, numel=batch.numel, longest=max((leaf.vec for _, leaf in nonempty), default=1),
      dtypes=frozenset(leaf.x.dtype for _, leaf in nonempty),
      low=any(leaf.low for _, leaf in nonempty), empty=tuple(empty),
      empty_with_rows=tuple(empty_with_rows), leaves=nonempty)


class _StandIn:
  """A tensor's address, dtype and shape: what a table reads of a leaf or its ids."""

  __slots__ = ("_address", "dtype", "shape")

  def __init__(self, t: torch.Tensor):
    self._address, self.dtype, self.shape = t.data_ptr(), t.dtype, t.shape

  def data_ptr(self) -> int:
    return self._address

  def dim(self) -> int:
    return len(self.shape)

  def element_size(self) -> int:
    return self.dtype.itemsize


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, (max(n, 1) - 1).bit_length())
