"""The named tuples the kernels take: arguments grouped by what they describe.

numba passes a named tuple as its fields (flattened), so grouping costs nothing in the
compiled code; it keeps every kernel's signature short and says what each argument is. Only a
call from Python pays for it: numba types a named tuple argument in Python, not in C (a few
microseconds per kernel call, docs/cpu-kernels.md).
Arrays hold one entry per leaf, per block or per system, as the field's comment says.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class Leaves(NamedTuple):
  """The leaves as the kernels read them, one entry per leaf."""
  addrs: np.ndarray  # int64 data addresses (for the norm passes: of the gathered copies)
  sizes: np.ndarray  # int64 elements
  codes: np.ndarray  # int8 dtype codes (decode.F16, BF16, F32, F64)
  rowsizes: np.ndarray  # int64 elements per row
  vecs: np.ndarray  # int64 length of the last axis (the max-step vectors), at least 1
  table: np.ndarray  # decode.F16_TABLE


class Blocks(NamedTuple):
  """The blocks of every run: block b is elements [start[b], start[b] + length[b]) of leaf
  ``leaf[b]``, all of system ``system[b]``; in (leaf, system, block) order."""
  leaf: np.ndarray  # int32
  system: np.ndarray  # int32
  start: np.ndarray  # int64
  length: np.ndarray  # int64


class PowerTerm(NamedTuple):
  """The term |x|**p of a power sum: its kind (power_sums.ABS, SQ, INT, POW), p as an int
  (for INT) and as a float."""
  kind: int
  ip: int
  p: float


class Scaling(NamedTuple):
  """Per-system scaling of the double-double sums: terms (|x| * inv * inv2)**p, or
  (|x| / inv)**p when ``divide``."""
  inv: np.ndarray
  inv2: np.ndarray
  divide: bool


class StepMaxima(NamedTuple):
  """Per block: the largest vector sum of squares, (hi + lo) * 4**k, and non-finite flags."""
  k: np.ndarray
  hi: np.ndarray
  lo: np.ndarray
  flags: np.ndarray


class Threshold(NamedTuple):
  """Thresholds c = c_m * 2**c_e (c_m in [0.5, 1) or 0; c_inf for +inf), from exact frexps:
  arrays of one per system, or the scalars of one system."""
  c_m: np.ndarray
  c_e: np.ndarray
  c_inf: np.ndarray


class SystemSums(NamedTuple):
  """What ``decision.finalize`` takes (see that module): the scalars of one system, or arrays
  of one per system."""
  s_hi: float
  s_lo: float
  sc_m: float
  sc_e: int
  rel_err: float
  zero: bool
  nan: bool
  inf: bool


class Decisions(NamedTuple):
  """Per system: action (decision.KEEP/SCALE/NAN_FILL), factor s_m * 2**s_e = s_val, whether
  its non-finite elements become zeros; ``precise`` (a float64 leaf: 53-bit factors)."""
  action: np.ndarray
  s_m: np.ndarray
  s_e: np.ndarray
  s_val: np.ndarray
  zero_sys: np.ndarray
  precise: bool


class RunAction(NamedTuple):
  """What the apply pass does to one run: one system's entries of :class:`Decisions`."""
  action: int
  s_m: float
  s_e: int
  s_val: float
  zero_sys: bool
  precise: bool


class Ids(NamedTuple):
  """The segment id arrays of the fused route, one per leaf: addresses and
  segments.SEG_I64 / SEG_I32 codes."""
  addrs: np.ndarray
  codes: np.ndarray


class FusedRule(NamedTuple):
  """What the fused route computes: L2 (``step`` False) or max-step norms against
  ``threshold`` (arrays of one per system, or of one for every system when
  ``one_threshold``), the step norm's error bound, non-finite mode."""
  threshold: Threshold
  step: bool
  step_rel_err: float
  zero_mode: bool
  one_threshold: bool = False


class FusedOutputs(NamedTuple):
  """What the fused route writes: output leaf addresses, then per system its sum (of
  squares, or largest vector sum for max-step), norm, action, factor and near-tie flag."""
  out_addrs: np.ndarray
  sums: np.ndarray
  norms: np.ndarray
  action: np.ndarray
  s_m: np.ndarray
  s_e: np.ndarray
  tie: np.ndarray


class Split(NamedTuple):
  """How a pass's block result follows from its ``SUB_BLOCK``-element sub-blocks (what a rank
  that holds part of a block computes: :mod:`.sharded`)."""
  kernel: Any  # blocks kernel over sub-blocks: each sub-block's results, as the block folds them
  fold: Any  # fold(block_of, *sub results, *block results): the block results, as the block
  # function folds its sub-blocks (in order, from its start)
  dtypes: tuple  # of the kernel's per-sub-block results
