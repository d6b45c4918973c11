"""The batch layout: each leaf as a (rows, width) matrix of its systems' rows.

Facts that do not depend on the values (rows and elements per system, which systems hold a
float16/bfloat16/float32 element, whether a leaf's ids are sorted) are found once here, before
any pass reads the data.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch


@dataclasses.dataclass
class Leaf:
  """One leaf as a (rows, width) matrix of the systems' rows."""

  x: torch.Tensor  # the leaf (sanitized in nonfinite="zero" mode)
  rows: int
  width: int  # elements per row
  vec: int  # length of the last axis: the step vectors of max-step (1 for 0-d and 1-D leaves)
  seg: torch.Tensor | None  # (rows,) int64 system ids; None: every row belongs to system 0
  _: dataclasses.KW_ONLY
  counts: torch.Tensor | None = None  # (K,) rows of each system in this leaf
  present: np.ndarray | None = None  # (K,) the system has rows in this leaf
  sorted: bool = True  # ids nondecreasing: each system's rows are one contiguous run
  owned: bool = False  # x is a fresh tensor (so it may be returned as is)

  @property
  def low(self) -> bool:
    return self.x.dtype != torch.float64

  @property
  def numel(self) -> int:
    return self.rows * self.width

  def matrix(self) -> torch.Tensor:
    return self.x.reshape(self.rows, self.width)


@dataclasses.dataclass
class Batch:
  """The leaves of one call and per-system facts that do not depend on values."""

  leaves: list[Leaf]
  num_systems: int
  device: torch.device
  norm64: bool  # the norm dtype is float64 (some leaf is float64)
  counts: np.ndarray  # (K,) elements per system
  has_low: np.ndarray  # (K,) the system has an element in a float16/bfloat16/float32 leaf
  per_system: bool  # segments were given (else one system, the global path)


def make_batch(leaves: list[torch.Tensor], segs: list[torch.Tensor] | None,
               num_systems: int) -> Batch:
  """The layout of checked leaves and int64 ids (``segs`` None: one system, the global path)."""
  device = leaves[0].device if leaves else torch.device("cpu")
  out, counts = [], np.zeros(num_systems, np.int64)
  has_low = np.zeros(num_systems, bool)
  total, any_low = 0, False
  for i, x in enumerate(leaves):
    shape = x.shape
    rows = shape[0] if shape else 1
    width = math.prod(shape[1:]) if len(shape) > 1 else 1
    vec = shape[-1] if len(shape) > 1 else 1
    low = x.dtype != torch.float64
    if segs is None:
      out.append(Leaf(x, rows, width, vec, None))
      total += rows * width
      any_low = any_low or (low and rows * width > 0)
      continue
    seg = segs[i]
    per_t = torch.bincount(seg, minlength=num_systems)
    per = per_t.cpu().numpy()
    is_sorted = rows < 2 or bool((seg[1:] >= seg[:-1]).all())
    out.append(Leaf(x, rows, width, vec, seg, counts=per_t, present=per > 0, sorted=is_sorted))
    counts += per * width
    if low and width:
      has_low |= per > 0
  if segs is None:
    counts[0], has_low[0] = total, any_low
  norm64 = any(x.dtype == torch.float64 for x in leaves)
  return Batch(out, num_systems, device, norm64, counts, has_low, segs is not None)


def sanitize(batch: Batch) -> Batch:
  """nonfinite="zero": non-finite elements become +0.0 before anything else (rule 7)."""
  leaves = []
  for leaf in batch.leaves:
    x = torch.where(torch.isfinite(leaf.x), leaf.x, torch.zeros((), dtype=leaf.x.dtype,
                                                                 device=leaf.x.device))
    leaves.append(dataclasses.replace(leaf, x=x, owned=True))
  return dataclasses.replace(batch, leaves=leaves)


def gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
  """table[index] along dim 0 (index_select: advanced indexing is much slower on a busy CPU)."""
  return torch.index_select(table, 0, index)
