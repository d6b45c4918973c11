"""What one call fixes: the static configuration (``jax.jit``'s static argument) and the
threshold as exact frexp parts."""

from __future__ import annotations

from typing import Any, NamedTuple


class Config(NamedTuple):
  """The static part of a call; hashable, so jax.jit caches one graph per configuration."""

  op: str  # "norm" (p-norm) or "step" (max-step)
  p: float
  zero_mode: bool  # nonfinite="zero"
  num_systems: int
  sorted_flags: tuple  # per leaf: its segment ids are sorted
  precise: bool  # some leaf is float64: the wide route
  dtypes: tuple  # the leaves' numpy dtypes
  host: bool = False  # the numba kernels through XLA FFI (:mod:`.host_route`), not the graph
  api_op: str = ""  # the public operation (the host route's kernels are per operation)
  nonfinite: str = "propagate"
  # Whether the leaves may be sharded (a traced call, or one whose leaves span devices). Then
  # max-step near-ties are settled on the devices (``step_ties``), and segment reductions pad
  # their rows (``systems.SEGMENT_ROWS``). A call compiled alone on one device's leaves hands
  # a tie's leaves to the host and pads nothing: that costs it less, and moves nothing it
  # must not.
  may_be_sharded: bool = True


class Threshold(NamedTuple):
  """Per-system threshold c = m * 2**e exactly (m in [0.5, 1) or 0; inf: c is +inf), so a
  subnormal c survives an XLA CPU that flushes subnormals."""

  m: Any
  e: Any
  inf: Any
