"""The call's scratch buffer: what the Triton kernels accumulate, decide and report.

One int64 buffer per call (float64 regions are read through a float64 view of it):

* the *summary*, which the host reads in the call's one transfer: the number of systems the
  certified intervals left open, whether some scaled system's float32 rows round toward zero
  or its float64 rows need the host, the first bad threshold (as ``K - index``, 0 for none), a
  one-system call's decision, and two words per leaf for its segment ids out of range (the
  most negative id, negated, and the largest excess over ``K - 1``; 0 for none);
* from ``base``, per-system regions of K words: the accumulators the measure kernels add or
  max into (zeroed for each call), then what the decision kernel writes;
* the partial results of the one-system passes, ``PART_WORDS`` per work item.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Words(NamedTuple):
  """Where each part of the buffer lies: words of the summary, indices of per-system regions.

  The kernels take :data:`WORDS` as a ``tl.constexpr`` argument's default, not as globals:
  Triton compares every global a kernel reads with its value at compile time, at each launch
  (over a microsecond each, and the decision kernel read some 45), while an argument's value
  goes into the kernel's cache key (``docs/gpu.md``, section 14).
  """

  # The summary's words, then two words per leaf from LEAF_WORDS.
  OPEN_COUNT: int = 0
  RTZ32: int = 1
  HOST64: int = 2
  BAD_THRESHOLD: int = 3
  SINGLE: int = 4  # four words
  LEAF_WORDS: int = 8
  # Accumulators (zeroed): power sums (or the largest step's sum of squares, as bits), the
  # bits of max |x|, INF_BITS minus the bits of min |x|, element counts, "holds a 16/32-bit
  # element", the float64 pieces, and how many atomic additions a system's power sum
  # received (its runs).
  SUMS: int = 0
  BIG: int = 1
  SMALL: int = 2
  COUNT: int = 3
  LOW: int = 4
  Q1: int = 5
  Q2: int = 6
  QT: int = 7
  REST: int = 8
  RUNS: int = 9
  ZEROED: int = 10  # regions zeroed for each call
  # Written by the decision kernel: the float64 bound and exponent of the pieces, the exact
  # max/min |x| (for the host's exact path), then the plan.
  BOUND: int = 10
  E: int = 11
  VALUE: int = 12
  ACTION: int = 13
  SCALE: int = 14
  NORM: int = 15
  RN32: int = 16
  RN64: int = 17
  OPEN: int = 18
  PARTS: int = 19  # then PART_WORDS per one-system work item
  PART_WORDS: int = 4


WORDS = Words()


class Scratch:
  """The buffer of one call with K systems, L leaves and ``items`` one-system work items."""

  def __init__(self, num_systems: int, num_leaves: int, items: int, device: torch.device):
    self.K = num_systems
    self.base = WORDS.LEAF_WORDS + 2 * num_leaves
    size = self.base + WORDS.PARTS * num_systems + WORDS.PART_WORDS * items
    self.buffer = torch.empty(size, dtype=torch.int64, device=device)
    self.buffer[:self.base + WORDS.ZEROED * num_systems].zero_()

  def region(self, index: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The K words of a per-system region, as int64 or float64."""
    start = self.base + index * self.K
    words = self.buffer[start:start + self.K]
    return words.view(dtype) if dtype != torch.int64 else words

  @property
  def summary(self) -> torch.Tensor:
    return self.buffer[:self.base]
