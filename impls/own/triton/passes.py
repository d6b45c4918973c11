"""The Triton route of a call: a fixed number of launches, one host read.

Per call: the scratch buffer is zeroed (one operator); each pass is one launch per dtype group
of leaves (per vector length for max-step) over a table of work items (:mod:`.tables`); one
launch decides every system (:mod:`.decision_kernel`) and writes the call's summary, which the
host reads in one transfer; one launch per dtype group writes the outputs into one buffer per
dtype, cut into the output tensors as views. The exact near-tie path, and the argument errors
the device found, are those of the eager route (:mod:`clipbench.impls.own.torch.decisions`).
"""

from __future__ import annotations

import dataclasses
import os
import struct

import numpy as np
import torch

from clipbench.impls.own.torch import decisions
from clipbench.impls.own.torch.apply import host_scale_toward_zero, with_host_rows
from clipbench.impls.own.torch.arguments import Threshold
from clipbench.impls.own.torch.certified import Pieces
from clipbench.impls.own.torch.decisions import Plan, Single
from clipbench.impls.own.torch.eager_passes import EagerKernels
from clipbench.impls.own.torch.floats import U64, gamma
from clipbench.impls.own.torch.layout import Batch
from clipbench.impls.own.torch.measure import Measured
from clipbench.impls.own.triton import decision_kernel as dk
from clipbench.impls.own.triton import interpreter_scan, kernels, layouts, tables
from clipbench.impls.own.triton.scratch import WORDS, Scratch

# Read once, as triton does: the interpreter is chosen before triton is first imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
if INTERPRET and kernels.triton is not None:
  interpreter_scan.install(kernels.RUN_COMBINES)

# Units per tile: of a one-system measure program, of a per-system one (its segmented scans
# hold more per unit) and of an apply program; powers of two that divide every work item
# (tables.MIN_ITEM_UNITS). Warps per measure and apply program. The values measured best on an
# H200 (docs/gpu.md, section 11).
BLOCK = 1024
SYSTEM_BLOCK = 512
# The narrowest per-system tile: a launch whose items are all short scans tiles no wider than
# its longest item (the next power of two), not SYSTEM_BLOCK units mostly masked off.
MIN_SYSTEM_TILE = 32
APPLY_BLOCK = 1024
WARPS = 4
ROW_UNITS = 8  # per-system sums read rows of at most this many elements as units (0: never)
MAX_VEC = 1024  # elements of a row read at a time (a longer row is read in several steps)
DECIDE_BLOCK = 256  # systems per decision program
_LAUNCH = {"enable_fp_fusion": False}
_DOUBLE, _DOUBLE_BITS = struct.Struct("<d"), struct.Struct("<q")

_TL_DTYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
             torch.float64: "float64"}
_INT_OF = {torch.float16: "int16", torch.bfloat16: "int16", torch.float32: "int32",
           torch.float64: "int64"}


def _tl(name: str):
  return getattr(kernels.tl, name)


def _bits(value: float) -> int:
  """A float64 as the int64 of its bits (a kernel argument that stays float64)."""
  return _DOUBLE_BITS.unpack(_DOUBLE.pack(value))[0]


@dataclasses.dataclass
class ScratchPlan(Plan):
  """A plan whose per-system tensors are regions of the call's scratch buffer."""

  scratch: Scratch | None = None
  layout: layouts.Layout | None = None


class TritonKernels(EagerKernels):
  """The passes, decisions and outputs of a call as Triton launches (module docstring)."""

  # exp2(p * log2(y)) for y <= 1: relative error <= (1.4 |p log2 y| + 3) u per term, whose
  # largest absolute value over y in [0, 1] is below 2**-51 (taken with margins).
  POW_REL_ERR = 2.0 ** -49
  POW_ABS_ERR = 2.0 ** -50

  def _check_device(self, batch: Batch) -> None:
    if batch.tensors and batch.device.type != "cuda" and not INTERPRET:
      raise ValueError(f"leaves[0]: on {batch.device}; the Triton implementation needs CUDA "
                       "tensors, or TRITON_INTERPRET=1 for CPU tensors")

  def prepare(self, batch: Batch) -> Batch:
    """Leaves and ids made contiguous (the kernels address them flat); the rest is found by
    the kernels themselves. A call with no element at all is the eager route's (nothing to
    launch, and with no leaves no device to launch on)."""
    self._check_device(batch)
    if not _has_elements(batch):
      return super().prepare(batch)
    low = any(t.dtype != torch.float64 and t.numel() for t in batch.tensors)
    batch.prec = 24 if low or not batch.norm64 else 53  # per system where both (see _resolve)
    # Over the tensors, in C-level maps: the Leaf objects are built only when one is copied.
    if not (all(map(torch.Tensor.is_contiguous, batch.tensors)) and
            all(map(torch.Tensor.is_contiguous, batch.segs or ()))):
      batch = batch.with_leaves([dataclasses.replace(
          leaf, x=leaf.x.contiguous(), seg=None if leaf.seg is None else leaf.seg.contiguous())
          for leaf in batch.leaves])
    return batch

  # ------------------------------------------------------------------------------ the call
  def plan(self, batch: Batch, kind: str, p: float, threshold: Threshold,
           certified: bool = True) -> Plan:
    if not _has_elements(batch):
      return super().plan(batch, kind, p, threshold, certified)
    K, dev = batch.num_systems, batch.device
    per_system = batch.per_system
    # Per system, the float32 (and narrower) sums of squares or magnitudes read short rows as
    # units: a scan over rows, not over their elements.
    rows = ROW_UNITS if per_system and kind == "sum" and p in (1.0, 2.0) and not batch.norm64 \
        else 0
    layout = layouts.layout_of(batch)
    groups = layout.groups(kind == "step" and not batch.norm64, rows, MAX_VEC)
    items = sum(t.items for _, t in groups) if not per_system else 0
    scratch = Scratch(K, len(batch.tensors), items, dev)
    norm64 = batch.norm64
    low = layout.low
    modes, kinds = kernels.MODES, dk.KINDS

    def measure(mode: int, **flags) -> None:
      self._measure(scratch, groups, batch, layout.numel, mode, **flags)

    if kind == "step" and norm64:  # the exact path for every system: only the flags here
      measure(modes.EXTREMES, counts=True, low=low)
      decide_kind = kinds.EXACT
    elif kind == "step":
      measure(modes.STEPS, counts=True, low=False)
      decide_kind = kinds.STEP
    elif kind == "sum" and p in (1.0, 2.0) and not norm64:
      measure(modes.SQUARES if p == 2 else modes.MAGNITUDES, counts=True, low=False)
      decide_kind = kinds.SUM
    else:
      measure(modes.EXTREMES, counts=True, low=norm64 and low)
      if kind in ("max", "min"):
        decide_kind = kinds.MAX if kind == "max" else kinds.MIN
      elif norm64 and p in (1.0, 2.0):
        measure(modes.PIECES, square=p == 2, counts=False, low=False)
        decide_kind = kinds.PIECES
      elif norm64:
        decide_kind = kinds.EXACT
      else:
        measure(modes.POWERS, p=p, counts=False, low=False)
        decide_kind = kinds.POWER
    self._check_ids_of_empty_leaves(scratch, batch, layout)
    depth = _unit_roundings(groups) if per_system else _depth(groups)
    self._decide(scratch, batch, layout, threshold, decide_kind, p, items, depth, certified, low)
    plan = self._read(scratch, batch, threshold, kind, p, certified)
    plan.layout = layout
    return plan

  @staticmethod
  def _check_ids_of_empty_leaves(scratch: Scratch, batch: Batch,
                                 layout: layouts.Layout) -> None:
    """Leaves with rows but no element launch nothing: their ids' range goes into the summary
    by tensor operations (the kernels' own words for every other leaf)."""
    K = batch.num_systems
    for i in layout.empty_with_rows:
      lo, hi = torch.aminmax(batch.leaves[i].seg)
      words = scratch.buffer[WORDS.LEAF_WORDS + 2 * i:WORDS.LEAF_WORDS + 2 * i + 2]
      words.copy_(torch.stack([(-lo).clamp(min=0), (hi - K + 1).clamp(min=0)]))

  def _measure(self, scratch: Scratch, groups, batch: Batch, numel: int, mode: int,
               counts: bool, low: bool, p: float = 2.0, square: bool = False) -> None:
    """One launch per group: what ``mode`` accumulates, into the scratch buffer."""
    slot = 0
    for (dtype, vec), table in groups:
      kernels.measure_items[(table.items,)](
          table.rows, scratch.buffer, scratch.base, batch.num_systems, numel, slot,
          _bits(p), DTYPE=_tl(_TL_DTYPE[dtype]), MODE=mode, PER_SYSTEM=batch.per_system,
          COUNTS=counts and batch.per_system, FLAG_LOW=low and dtype != torch.float64,
          SQUARE=square, VEC=vec, ALIGNED=table.aligned,
          BLOCK=_measure_tile(batch.per_system, vec, table), num_warps=WARPS, **_LAUNCH)
      slot += table.items

  def _decide(self, scratch: Scratch, batch: Batch, layout: layouts.Layout,
              threshold: Threshold, decide_kind: int, p: float, items: int, depth: int,
              certified: bool, low: bool) -> None:
    """One launch: every system's decisions, the plan and the summary. ``depth``: for one
    system, the additions along any path of its float64 sums (``_depth``); per system, the
    roundings of a unit's sum (``_unit_roundings``)."""
    K = batch.num_systems
    if threshold.tensor is not None:
      thr, thr_bits = threshold.tensor, 0
      mode = 2 if threshold.tensor.numel() == 1 else 1
    elif threshold.values.size == 1:
      thr, thr_bits, mode = scratch.buffer, _bits(float(threshold.values[0])), 0
    else:
      thr, thr_bits, mode = threshold.on(batch.device), 0, 1
    rel = gamma(layout.longest + 1) * 0.5001 + 4 * U64
    dtypes = layout.dtypes
    prec = (0 if batch.per_system else 24) if batch.norm64 and low else (
        53 if batch.norm64 else 24)
    if K:
      dk.decide_systems[(triton_cdiv(K, DECIDE_BLOCK),)](
          scratch.buffer, scratch.base, K, len(batch.tensors), items, layout.numel, thr,
          thr_bits, _bits(p), _bits(float(depth)), _bits(rel), KIND=decide_kind,
          P=int(p) if decide_kind in (dk.KINDS.SUM, dk.KINDS.PIECES) else 1,
          PER_SYSTEM=batch.per_system,
          NORM64=batch.norm64, PREC=prec, THRESHOLD=mode,
          CHECK_THRESHOLD=threshold.tensor is not None, CERTIFIED=certified,
          HAS32=torch.float32 in dtypes, HAS64=torch.float64 in dtypes, BLOCK=DECIDE_BLOCK,
          **_LAUNCH)

  def _read(self, scratch: Scratch, batch: Batch, threshold: Threshold, kind: str, p: float,
            certified: bool) -> Plan:
    """The call's one host read, its argument errors, and the exact path where needed."""
    K = batch.num_systems
    words = scratch.summary.cpu().numpy()
    f64 = torch.float64
    plan = ScratchPlan(scratch.region(WORDS.ACTION), scratch.region(WORDS.SCALE, f64),
                       scratch.region(WORDS.RN32), scratch.region(WORDS.RN64),
                       scratch.region(WORDS.NORM, f64), rtz32=bool(words[WORDS.RTZ32]),
                       host64=bool(words[WORDS.HOST64]), scratch=scratch)
    read = {}
    if batch.per_system:
      below, above = words[WORDS.LEAF_WORDS::2], words[WORDS.LEAF_WORDS + 1::2]
      ranges = [(-int(b) if b else 0, int(a) + K - 1 if a else max(K - 1, 0))
                for (b, a), leaf in zip(zip(below, above), batch.leaves) if leaf.rows]
      read["seg_range"] = np.array(ranges, np.int64).reshape(-1)
    if threshold.tensor is not None:
      bad = int(words[WORDS.BAD_THRESHOLD])
      first = K - bad if bad else threshold.tensor.numel()
      bits = 0
      if first < threshold.tensor.numel():
        bits = int(threshold.tensor[first].view(torch.int64).item())  # on the way to the error
      read[f"{threshold.name}:bad"] = np.array([first, bits], np.int64)
    decisions.raise_for_arguments(batch, threshold, read)
    if words[WORDS.OPEN_COUNT]:
      self._resolve(scratch, batch, threshold, kind, p, certified, plan)
    if plan.host64:
      decisions.scales_for_host_rows(plan)
    if not batch.per_system:
      single = words[WORDS.SINGLE:WORDS.SINGLE + 4]
      if words[WORDS.OPEN_COUNT]:
        single = [plan.action.item(), plan.scale.view(torch.int64).item(), plan.rn32.item(),
                  plan.rn64.item()]
      plan.single = Single(int(single[0]), _DOUBLE.unpack(_DOUBLE_BITS.pack(int(single[1])))[0],
                           bool(single[2]), bool(single[3]))
    return plan

  def _resolve(self, scratch: Scratch, batch: Batch, threshold: Threshold, kind: str, p: float,
               certified: bool, plan: Plan) -> None:
    """The open systems, on the host: the eager route's exact path over the scratch data."""
    f64 = torch.float64
    batch.counts = scratch.region(WORDS.COUNT, f64)
    if batch.norm64 and batch.per_system and batch.prec == 24:  # float64 and narrower leaves
      batch.prec = torch.where(scratch.region(WORDS.LOW) != 0, 24, 53)
    zero = torch.zeros(batch.num_systems, dtype=torch.bool, device=batch.device)
    measured = Measured(zero, zero, zero)
    if kind in ("max", "min"):
      measured.values = scratch.region(WORDS.VALUE, f64)
    elif kind == "sum" and batch.norm64 and p in (1.0, 2.0):
      measured.pieces = Pieces(*(scratch.region(r, f64) for r in (
          WORDS.Q1, WORDS.Q2, WORDS.QT, WORDS.REST, WORDS.BOUND, WORDS.E)))
    open_ = scratch.region(WORDS.OPEN) != 0
    decisions.resolve_exactly(batch, measured, threshold.on(batch.device), kind, p, certified,
                              open_, plan)

  # ------------------------------------------------------------------------------ outputs
  def apply(self, batch: Batch, plan: Plan) -> list[torch.Tensor]:
    self._check_device(batch)
    if not _has_elements(batch):
      return super().apply(batch, plan)
    layout = plan.layout
    out: list[torch.Tensor | None] = [None] * len(batch.tensors)
    for i in layout.empty:
      leaf = batch.leaves[i]
      out[i] = leaf.x if leaf.owned else leaf.x.clone()
    K = batch.num_systems
    for group in layout.outputs():
      flat = torch.empty(group.total, dtype=group.dtype, device=batch.device)
      kernels.apply_items[(group.table.items,)](
          group.table.rows, flat, plan.scratch.buffer, plan.scratch.base, K,
          DTYPE=_tl(_TL_DTYPE[group.dtype]), INT=_tl(_INT_OF[group.dtype]),
          PER_SYSTEM=batch.per_system, ALIGNED=group.table.aligned, BLOCK=APPLY_BLOCK,
          num_warps=WARPS, **_LAUNCH)
      # One split of the buffer (into the outputs and the gaps between them, if any), and a
      # view only where a leaf is not 1-D: W4 has 10,000 leaves. The operator itself: torch.split's
      # Python wrapper adds a cost per piece.
      pieces = list(torch.split_with_sizes(flat, group.sizes) if group.cuts is None else
                    torch.split_with_sizes(flat, group.cuts)[::2])
      for j, shape in group.shaped:
        pieces[j] = pieces[j].view(shape)
      if len(pieces) == len(out):
        out = pieces
      else:
        for i, y in zip(group.positions, pieces):
          out[i] = y
      if group.dtype == torch.float64 and plan.host64:
        self._host_rows(batch, plan, group.positions, out)
    return out

  def _host_rows(self, batch: Batch, plan: Plan, positions, out) -> None:
    """float64 outputs of the systems whose factor leaves no room: exactly, on the host."""
    for i in positions:
      leaf = batch.leaves[i]
      if not batch.per_system:
        values = host_scale_toward_zero(leaf.x.detach().cpu().numpy(), plan.host_scale[0])
        out[i].copy_(torch.as_tensor(values, device=leaf.x.device).view(leaf.x.shape))
        continue
      with_host_rows(leaf.matrix(), leaf.seg, out[i].view(leaf.rows, leaf.width), plan)


def _measure_tile(per_system: bool, vec: int, table: tables.Table) -> int:
  """Units per tile of a measure launch: BLOCK (SYSTEM_BLOCK per system) elements, as units
  of ``vec``. Per system, no wider than the launch's longest item: a segmented scan runs over
  its whole tile, masked units included, on the GPU as under the interpreter (there as array
  operations over the tile; short items are what most tests and conformance cases hold).
  One-system tiles have no scan, and narrowing them would only add compiled variants."""
  full = max(1, (SYSTEM_BLOCK if per_system else BLOCK) // vec)
  if not per_system:
    return full
  return min(full, max(MIN_SYSTEM_TILE, 1 << (table.longest - 1).bit_length()))


def _depth(groups) -> int:
  """A bound on the float64 additions along any path of a one-system sum: a row's sum (rows
  as units), one lane addition per tile of a work item (a program's lanes accumulate over its
  item's tiles), a tile's lane sums (at most a tile), the decision kernel's sum of the items'
  partials (one lane addition per block of items, then across its lanes), and 8 to spare.
  Counting the tiles of an item, not of the call, is what keeps a model of a billion elements
  off the exact path (``docs/gpu.md``, section 13)."""
  row = max((vec for (_, vec), _ in groups), default=1)
  tiles = max((-(-table.item_units // max(1, BLOCK // vec)) for (_, vec), table in groups),
              default=0)
  items = sum(table.items for _, table in groups)
  return row + tiles + BLOCK + triton_cdiv(items, DECIDE_BLOCK) + DECIDE_BLOCK + 8


def _unit_roundings(groups) -> int:
  """The roundings along any path of a unit's float64 sum in a per-system pass: a row read
  ``vec`` elements at a time holds at most ``vec`` of them (``Layout.groups``), and a sum of
  n nonzero terms rounds at most n - 1 times whatever its tree; an element is its own unit."""
  return max((vec - 1 for (_, vec), _ in groups), default=0)


def _has_elements(batch: Batch) -> bool:
  return any(map(torch.Tensor.numel, batch.tensors))


def triton_cdiv(a: int, b: int) -> int:
  return -(-a // b)
