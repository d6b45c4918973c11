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

import torch

OPEN_COUNT, RTZ32, HOST64, BAD_THRESHOLD, SINGLE = 0, 1, 2, 3, 4  # summary words
LEAF_WORDS = 8  # the first leaf's two words
# Accumulators (zeroed): power sums (or the largest step's sum of squares, as bits), the bits
# of max |x|, INF_BITS minus the bits of min |x|, element counts, "holds a 16/32-bit element",
# the float64 pieces, and how many atomic additions a system's power sum received (its runs).
SUMS, BIG, SMALL, COUNT, LOW, Q1, Q2, QT, REST, RUNS = range(10)
ZEROED = 10
# Written by the decision kernel: the float64 bound and exponent of the pieces, the exact
# max/min |x| (for the host's exact path), then the plan.
BOUND, E, VALUE, ACTION, SCALE, NORM, RN32, RN64, OPEN = range(10, 19)
PARTS = 19
PART_WORDS = 4


class Scratch:
  """The buffer of one call with K systems, L leaves and ``items`` one-system work items."""

  def __init__(self, num_systems: int, num_leaves: int, items: int, device: torch.device):
    self.K = num_systems
    self.base = LEAF_WORDS + 2 * num_leaves
    size = self.base + PARTS * num_systems + PART_WORDS * items
    self.buffer = torch.empty(size, dtype=torch.int64, device=device)
    self.buffer[:self.base + ZEROED * num_systems].zero_()

  def region(self, index: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The K words of a per-system region, as int64 or float64."""
    start = self.base + index * self.K
    words = self.buffer[start:start + self.K]
    return words.view(dtype) if dtype != torch.int64 else words

  @property
  def summary(self) -> torch.Tensor:
    return self.buffer[:self.base]
