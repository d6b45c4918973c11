"""The passes of the torch implementation (``EagerKernels``) run by the Triton kernels.

The host side of each pass: the work items of a leaf, the launches, and the per-system
results handed to the shared torch decisions (so the bits are those of the eager
implementation).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import torch

from clipbench.impls.own.torch.apply import (HOST_CODE, KEEP_CODE, Plan, apply_leaf,
                                             leaf_codes)
from clipbench.impls.own.torch.eager_passes import EagerKernels
from clipbench.impls.own.torch.layout import Batch, Leaf
from clipbench.impls.own.triton import kernels

# Read once, as triton does: the interpreter is chosen before triton is first imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"

# Elements per work item (rows per item = ITEM_ELEMS // row width) and per kernel tile.
ITEM_ELEMS = 1 << 16
TILE_ELEMS = 2048

_INT_OF = {torch.float16: "int16", torch.bfloat16: "int16", torch.float32: "int32",
           torch.float64: "int64"}


def _pow2(n: int, cap: int) -> int:
  return min(cap, 1 << max(0, (max(n, 1) - 1).bit_length()))


@dataclasses.dataclass
class Items:
  """Work items of one leaf: runs of at most ``rows_per_item`` rows of one system."""

  perm: torch.Tensor | None  # sorted position -> row (None: rows already sorted)
  row: torch.Tensor  # first sorted position of each item
  count: torch.Tensor  # rows of each item
  system: torch.Tensor  # system of each item
  first: torch.Tensor  # per system: its first item
  per_system: torch.Tensor  # per system: number of items
  num: int

  @property
  def has_perm(self) -> bool:
    return self.perm is not None

  def rows(self) -> tuple[torch.Tensor, ...]:
    """``(perm, first_row, row_count)``: the kernels' ``items`` where no system is read."""
    perm = self.perm if self.perm is not None else _placeholder(self.row.device)
    return perm, self.row, self.count

  def pointers(self) -> tuple[torch.Tensor, ...]:
    """The kernels' ``items`` tuple (a placeholder stands for an absent ``perm``)."""
    return self.rows() + (self.system,)


def _placeholder(device) -> torch.Tensor:
  return torch.zeros(1, dtype=torch.int64, device=device)


def make_items(seg: torch.Tensor | None, rows: int, K: int, rows_per_item: int,
               is_sorted: bool, device) -> Items:
  """Items aligned to each system's first row (a system's items do not depend on others)."""
  if seg is None:
    counts = torch.tensor([rows], dtype=torch.int64, device=device)
    perm = None
  else:
    counts = torch.bincount(seg, minlength=K)
    perm = None if is_sorted else torch.sort(seg, stable=True).indices
  starts = torch.cumsum(counts, 0) - counts
  per_system = (counts + rows_per_item - 1) // rows_per_item
  first = torch.cumsum(per_system, 0) - per_system
  num = int(per_system.sum())
  system = torch.repeat_interleave(torch.arange(counts.numel(), device=device), per_system)
  j = torch.arange(num, device=device) - first[system]
  row = starts[system] + j * rows_per_item
  count = torch.minimum(torch.full_like(row, rows_per_item), counts[system] - j * rows_per_item)
  return Items(perm, row, count, system, first, per_system, num)


class TritonKernels(EagerKernels):
  """The passes of ``EagerKernels`` as Triton kernels (see the package docstring)."""

  # exp2(p * log2(y)) for y <= 1: relative error <= (1.4 |p log2 y| + 3) u per term, whose
  # largest absolute value over y in [0, 1] is below 2**-51 (taken with margins).
  POW_REL_ERR = 2.0 ** -49
  POW_ABS_ERR = 2.0 ** -50

  def _check_device(self, batch: Batch) -> None:
    if batch.leaves and batch.device.type != "cuda" and not INTERPRET:
      raise ValueError(f"leaves[0]: on {batch.device}; the Triton implementation needs CUDA "
                       "tensors, or TRITON_INTERPRET=1 for CPU tensors")

  def _leaf_view(self, leaf: Leaf, K: int, flat: bool):
    """(matrix, items, tile) for one leaf; global leaves are read as one flat column.

    ``tile`` is the item kernels' ``(HAS_PERM, BLOCK_R, BLOCK_W)``.
    """
    if leaf.seg is None and flat:
      m = leaf.x.reshape(-1, 1)
    else:
      m = leaf.matrix()
    m = m.contiguous()
    rows, width = m.shape
    rpi = max(1, ITEM_ELEMS // max(width, 1))
    items = make_items(leaf.seg, rows, K if leaf.seg is not None else 1, rpi, leaf.sorted,
                       m.device)
    block_w = _pow2(width, 64)
    return m, items, (items.has_perm, max(1, TILE_ELEMS // block_w), block_w)

  def _combine(self, parts: torch.Tensor, items: Items, mode: int, stride: int = 1,
               offset: int = 0) -> torch.Tensor:
    k = items.first.numel()
    out = torch.empty(k, dtype=torch.float64, device=parts.device)
    if k:
      kernels.combine[(k,)](parts.reshape(-1)[offset:], items.first, items.per_system, out,
                            stride, MODE=mode)
    return out

  # ------------------------------------------------------------------ power sums (float32)
  def power_sums(self, batch: Batch, p: float,
                 scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    self._check_device(batch)
    K = batch.num_systems
    dev = batch.device
    sums = torch.zeros(K, dtype=torch.float64, device=dev)
    scale_t = torch.as_tensor(np.ones(max(K, 1)) if scale is None else scale,
                              dtype=torch.float64, device=dev)
    mode = 0 if (p == 2 and scale is None) else 1 if (p == 1 and scale is None) else 2
    p_t = torch.tensor([p], dtype=torch.float64, device=dev)
    worst = 1
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      m, items, tile = self._leaf_view(leaf, K, flat=True)
      parts = torch.empty(items.num, dtype=torch.float64, device=dev)
      kernels.item_power_sums[(items.num,)](m, items.pointers(), scale_t, parts, p_t,
                                            m.shape[1], MODE=mode, tile=tile)
      combined = self._combine(parts, items, 0)
      if leaf.seg is None:
        sums[0] += combined[0]
        worst = max(worst, ITEM_ELEMS + items.num)
      else:
        sums += combined
    depth = np.minimum(batch.counts, worst if not batch.per_system else batch.counts)
    return sums.cpu().numpy(), depth + len(batch.leaves) + 2

  # ----------------------------------------------------------------------- maxima, minima
  def extremes(self, batch: Batch, want_min: bool) -> tuple[np.ndarray, np.ndarray | None]:
    self._check_device(batch)
    K = batch.num_systems
    dev = batch.device
    big = torch.zeros(K, dtype=torch.float64, device=dev)
    small = torch.full((K,), math.inf, dtype=torch.float64, device=dev)
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      m, items, tile = self._leaf_view(leaf, K, flat=True)
      hi = torch.empty(items.num, dtype=torch.float64, device=dev)
      lo = torch.empty(items.num, dtype=torch.float64, device=dev)
      kernels.item_extremes[(items.num,)](m, items.rows(), hi, lo, m.shape[1], tile=tile)
      leaf_big = self._combine(hi, items, 1)
      leaf_small = self._combine(lo, items, 2)
      if leaf.seg is None:
        big[:1] = torch.maximum(big[:1], leaf_big)
        small[:1] = torch.minimum(small[:1], leaf_small)
      else:
        big = torch.maximum(big, leaf_big)
        small = torch.minimum(small, leaf_small)
    big = big.cpu().numpy()
    if not want_min:
      return big, None
    small = small.cpu().numpy()
    small[batch.counts == 0] = 0.0
    return big, small

  # --------------------------------------------------------------------------- step norms
  def step_sums(self, batch: Batch) -> tuple[np.ndarray, int]:
    self._check_device(batch)
    K = batch.num_systems
    dev = batch.device
    best = torch.zeros(K, dtype=torch.float64, device=dev)
    longest = 1
    for leaf in batch.leaves:
      if leaf.numel == 0 or leaf.vec == 0:
        continue
      longest = max(longest, leaf.vec)
      m, items, _ = self._leaf_view(leaf, K, flat=False)
      nvec = leaf.width // leaf.vec
      block_v = _pow2(nvec, 64)
      tile = (items.has_perm, max(1, TILE_ELEMS // block_v), block_v)
      parts = torch.empty(items.num, dtype=torch.float64, device=dev)
      kernels.item_step[(items.num,)](m, items.rows(), parts, leaf.width, nvec, leaf.vec,
                                      tile=tile)
      combined = self._combine(parts, items, 1)
      if leaf.seg is None:
        best[:1] = torch.maximum(best[:1], combined)
      else:
        best = torch.maximum(best, combined)
    return best.cpu().numpy(), longest

  # -------------------------------------------------------------- float64 pieces (extraction)
  def _accumulate_pieces(self, batch: Batch, p: int,
                         params: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    self._check_device(batch)
    K = batch.num_systems
    dev = batch.device
    acc = torch.zeros(K, 4, dtype=torch.float64, device=dev)
    params = params.contiguous()
    worst = 1
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      m, items, tile = self._leaf_view(leaf, K, flat=True)
      parts = torch.empty(items.num, 4, dtype=torch.float64, device=dev)
      kernels.item_pieces[(items.num,)](m, items.pointers(), params, parts, m.shape[1],
                                        SQUARE=p == 2, tile=tile)
      cols = torch.stack([self._combine(parts, items, 0, stride=4, offset=j) for j in range(4)],
                         1)
      if leaf.seg is None:
        acc[:1] += cols
        worst = max(worst, ITEM_ELEMS + items.num)
      else:
        acc += cols
    depth = batch.counts if batch.per_system else np.minimum(batch.counts, worst)
    return acc.cpu().numpy(), depth + len(batch.leaves) + 4

  # -------------------------------------------------------------------------------- apply
  def apply(self, batch: Batch, plan: Plan) -> list[torch.Tensor]:
    self._check_device(batch)
    return [self._apply_leaf(leaf, plan) for leaf in batch.leaves]

  def _apply_leaf(self, leaf: Leaf, plan: Plan) -> torch.Tensor:
    codes = leaf_codes(leaf, plan)
    used = codes if leaf.present is None else codes[leaf.present]
    if leaf.numel == 0 or np.any(used == HOST_CODE):
      return apply_leaf(leaf, plan)  # empty, or an exact host computation (extreme s)
    if not np.any(used != KEEP_CODE):
      return leaf.x if leaf.owned else leaf.x.clone()
    x = leaf.x
    dev = x.device
    code_t = torch.as_tensor(codes, device=dev)
    s64 = torch.as_tensor(plan.scale, dtype=torch.float64, device=dev)
    m = leaf.matrix().contiguous()
    out = torch.empty_like(m)
    rows, width = m.shape
    block_w = _pow2(width, 64)
    block_r = max(1, TILE_ELEMS // block_w)
    seg = leaf.seg if leaf.seg is not None else _placeholder(dev)
    s_low = s64 if x.dtype == torch.float64 else s64.to(torch.float32)
    tile = (leaf.seg is not None, getattr(kernels.tl, _INT_OF[x.dtype]), block_r, block_w)
    kernels.apply_rows[(kernels.triton.cdiv(rows, block_r),)](
        m, out, seg, (code_t, s_low, s64), rows, width, tile=tile)
    return out.reshape(x.shape)
