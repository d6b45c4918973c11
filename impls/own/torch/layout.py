"""The batch layout: each leaf as a (rows, width) matrix of its systems' rows.

Only what the host knows without reading a device value is found here (shapes, dtypes, the
number of systems). What depends on the segment ids (each system's element count, which
systems hold a float16/bfloat16/float32 element, whether the ids are in range) stays on the
device, computed by the kernels' ``prepare`` and read, if at all, with the call's one host
transfer (:mod:`.host_read`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator

import torch


@dataclasses.dataclass(slots=True)
class Leaf:
  """One leaf as a (rows, width) matrix of the systems' rows."""

  x: torch.Tensor  # the leaf (sanitized in nonfinite="zero" mode)
  rows: int
  width: int  # elements per row
  vec: int  # length of the last axis: the step vectors of max-step (1 for 0-d and 1-D leaves)
  seg: torch.Tensor | None  # (rows,) int64 system ids; None: every row belongs to system 0
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
  """The leaves of one call, and per-system facts the kernels' ``prepare`` fills in.

  ``counts`` is each system's element count (float64, on the device); ``prec`` each system's
  factor bits, 24 (the system has an element in a float16/bfloat16/float32 leaf) or 53: an int
  when every system has the same, else a device tensor; ``seg_range`` the smallest and largest
  id each leaf's segments hold, as given (an (L, 2) device tensor, read for the range check).

  The :class:`Leaf` objects are built when a route first reads :attr:`leaves`: a route that
  needs only the tensors, their shapes and dtypes (Triton's, on a cached layout) builds none,
  which matters at 10,000 leaves a call (W4). ``shapes`` names the leaves' dimensions for
  such a cache: the tensors' shapes as given, or after :meth:`with_leaves` each leaf's
  ``(shape, rows, width, vec)``.
  """

  tensors: list[torch.Tensor]  # each leaf's tensor, as the kernels read it (Leaf.x)
  num_systems: int
  device: torch.device
  norm64: bool  # the norm dtype is float64 (some leaf is float64)
  per_system: bool  # segments were given (else one system, the global path)
  counts: torch.Tensor | None = None
  prec: int | torch.Tensor = 24
  seg_range: torch.Tensor | None = None
  _: dataclasses.KW_ONLY
  segs: list[torch.Tensor] | None = None  # the int64 ids given to make_batch
  shapes: tuple = ()
  dtypes: tuple[torch.dtype, ...] = ()
  built: list[Leaf] | None = dataclasses.field(default=None, repr=False)

  @property
  def leaves(self) -> list[Leaf]:
    if self.built is None:
      rows, widths, vecs = _all_dims(self.shapes) if self.tensors else ((), (), ())
      self.built = list(map(Leaf, self.tensors, rows, widths, vecs,
                            itertools.repeat(None) if self.segs is None else self.segs))
    return self.built

  def with_leaves(self, leaves: list[Leaf]) -> Batch:
    """The batch of other leaves (sanitized, contiguous, or with rows left out)."""
    return dataclasses.replace(
        self, tensors=[leaf.x for leaf in leaves], segs=[leaf.seg for leaf in leaves],
        shapes=tuple((leaf.x.shape, leaf.rows, leaf.width, leaf.vec) for leaf in leaves),
        dtypes=tuple(leaf.x.dtype for leaf in leaves), built=leaves)

  @functools.cached_property
  def numel(self) -> int:
    if self.built is None:
      return sum(map(torch.Tensor.numel, self.tensors))
    return sum(leaf.numel for leaf in self.built)


def _dims(shape: torch.Size) -> tuple[int, int, int]:
  """A leaf's rows, elements per row and last axis length."""
  rows = shape[0] if shape else 1
  width = math.prod(shape[1:]) if len(shape) > 1 else 1
  vec = shape[-1] if len(shape) > 1 else 1
  return rows, width, vec


@functools.lru_cache(maxsize=16)
def _all_dims(shapes: tuple[torch.Size, ...]) -> tuple[tuple[int, ...], ...]:
  """The rows, widths and last axes of a call's leaves (a training loop repeats its shapes)."""
  return tuple(zip(*map(_dims, shapes)))


def make_batch(leaves: list[torch.Tensor], segs: list[torch.Tensor] | None,
               num_systems: int, dtypes: tuple[torch.dtype, ...] | None = None) -> Batch:
  """The layout of checked leaves and int64 ids (``segs`` None: one system, the global path);
  ``dtypes``: the leaves' dtypes where the checks read them already."""
  device = leaves[0].device if leaves else torch.device("cpu")
  # C-level maps: a call may have 10,000 leaves (W4).
  shapes = tuple(map(operator.attrgetter("shape"), leaves))
  if dtypes is None:
    dtypes = tuple(map(operator.attrgetter("dtype"), leaves))
  return Batch(list(leaves), num_systems, device, torch.float64 in dtypes, segs is not None,
               segs=segs, shapes=shapes, dtypes=dtypes)


def sanitize(batch: Batch) -> Batch:
  """nonfinite="zero": non-finite elements become +0.0 before anything else (rule 7)."""
  leaves = []
  for leaf in batch.leaves:
    x = torch.where(torch.isfinite(leaf.x), leaf.x, torch.zeros((), dtype=leaf.x.dtype,
                                                                 device=leaf.x.device))
    leaves.append(dataclasses.replace(leaf, x=x, owned=True))
  return batch.with_leaves(leaves)


def gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
  """table[index] along dim 0 (index_select: advanced indexing is much slower on a busy CPU)."""
  return torch.index_select(table, 0, index)
