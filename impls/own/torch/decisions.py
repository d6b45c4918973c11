"""Per-system actions, factors and reported norms: decided on the device, near-ties exactly.

The certified decisions (:mod:`.certified`) settle almost every system as tensor operations
where the data is. Then comes the call's one host transfer (:mod:`.host_read`): the argument
checks that need device values, the number of systems the intervals left open, and which
output branches are needed. Only when a system is open (a near-tie, what a ``norm == max``
test builds) does the host read more: those systems' certified pieces (float64 systems may
still be decided there in Python rationals), then, for what is still open, an exact oracle
(:mod:`.oracles`). All routes compute the same exact function, so they give the same bits.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Callable, NamedTuple, Protocol

import numpy as np
import torch

from clipbench.impls.own import validation
from clipbench.impls.own.decision import KEEP, NAN_FILL, SCALE
from clipbench.impls.own.torch import branches
from clipbench.impls.own.torch.arguments import Threshold
from clipbench.impls.own.torch.certified import Decided, decide_float32, decide_float64
from clipbench.impls.own.torch.formats import (FMT32, FMT64, Ambiguous, Format, fraction_root,
                                               largest_scale, round_norm)
from clipbench.impls.own.torch.host_read import HostRead
from clipbench.impls.own.torch.layout import Batch
from clipbench.impls.own.torch.measure import Measured
from clipbench.impls.own.torch.oracles import ValueOracle, exact_oracles


class Single(NamedTuple):
  """A one-system call's decision as Python values (its outputs take host-side branches)."""

  action: int
  scale: float
  rn32: bool
  rn64: bool


@dataclasses.dataclass
class Plan:
  """Per-system decisions: device tensors of shape (K,), and what the host read of them."""

  action: torch.Tensor  # int8: KEEP, SCALE or NAN_FILL
  scale: torch.Tensor  # float64 s (exact unless s < 2**-1022, see host_scale)
  rn32: torch.Tensor  # float32 rows round x*s to nearest (else toward zero)
  rn64: torch.Tensor  # float64 rows round x*s to nearest (else exactly, on the host)
  norms: torch.Tensor  # float64 reported norms
  rtz32: bool = False  # some SCALEd system's float32 rows round toward zero
  host64: bool = False  # some SCALEd system's float64 rows are computed on the host
  host_scale: dict[int, Fraction] = dataclasses.field(default_factory=dict)
  single: Single | None = None


class ReadHook(Protocol):
  """What a caller adds to the call's one host read, checks first when it arrives, and where
  its open systems' exact norms come from (a sharded call's ranks: :mod:`.sharded_intervals`)."""

  def add(self, reader: HostRead) -> None:
    ...

  def check(self, read: dict[str, np.ndarray]) -> None:
    ...

  def oracles(self, batch: Batch, kind: str, p: float, systems: list[int]) -> dict[int, Any]:
    ...


def decide(batch: Batch, measured: Measured, threshold: Threshold, c: torch.Tensor, kind: str,
           p: float, certified: bool = True, hook: ReadHook | None = None) -> Plan:
  """The plan of one call: device decisions, the one host read, the exact path if needed.

  ``certified=False`` (a test mode) sends every system to the exact path; the bits must not
  change. ``hook`` reads device values of its own with the host read and checks them before
  the argument checks raise, and gives the exact path its oracles.
  """
  todo = ~(measured.nan | measured.inf) & ~measured.zero
  if not certified or measured.exact_only:
    zero = torch.zeros_like(todo)
    decided = Decided(zero, torch.zeros_like(c), torch.zeros_like(c), todo)
  elif measured.pieces is not None:
    decided = decide_float64(measured.pieces, 1 if kind in ("max", "min") else int(p), c,
                             batch.prec, todo)
  else:
    decided = decide_float32(measured.lo, measured.mid, measured.hi, c, todo)
  plan = _assemble(batch, measured, c, decided, todo)
  reader = HostRead()
  reader.add("ambiguous", decided.ambiguous.sum())
  if batch.seg_range is not None:
    reader.add("seg_range", batch.seg_range)
  threshold.check_on_device(reader)
  scaled = plan.action == SCALE
  dtypes = {leaf.x.dtype for leaf in batch.leaves if leaf.numel}
  if torch.float32 in dtypes:
    reader.add("rtz32", (scaled & ~plan.rn32).any())
  if torch.float64 in dtypes:
    reader.add("host64", (scaled & ~plan.rn64).any())
  if not batch.per_system:
    reader.add("single", torch.stack([plan.action.to(torch.float64), plan.scale,
                                      plan.rn32.to(torch.float64),
                                      plan.rn64.to(torch.float64)], 1))
  if hook is not None:
    hook.add(reader)
  read = reader.read()
  if hook is not None:
    hook.check(read)
  raise_for_arguments(batch, threshold, read)
  plan.rtz32 = bool(read.get("rtz32", [False])[0])
  plan.host64 = bool(read.get("host64", [False])[0])
  if read["ambiguous"][0]:
    resolve_exactly(batch, measured, c, kind, p, certified, decided.ambiguous, plan,
                    exact_oracles if hook is None else hook.oracles)
  if plan.host64:
    scales_for_host_rows(plan)
  if not batch.per_system:
    action, scale, rn32, rn64 = (plan.action.item(), plan.scale.item(), plan.rn32.item(),
                                 plan.rn64.item()) if read["ambiguous"][0] else read["single"]
    plan.single = Single(int(action), float(scale), bool(rn32), bool(rn64))
  return plan


def _assemble(batch: Batch, measured: Measured, c: torch.Tensor, decided: Decided,
              todo: torch.Tensor) -> Plan:
  """Actions, factors and norms from the certified decisions (open systems: KEEP, norm 0)."""
  scaled = decided.clip & ~decided.ambiguous & todo
  nonfinite = measured.nan | measured.inf
  action = torch.where(nonfinite, NAN_FILL, torch.where(scaled, SCALE, KEEP)).to(torch.int8)
  norms = torch.where(todo & ~decided.ambiguous, decided.norm, 0.0)
  norms = torch.where(measured.inf, math.inf, torch.where(measured.nan, math.nan, norms))
  scale = torch.where(scaled, decided.scale, 0.0)
  rn32, rn64 = _nearest_rounding(scale, c, batch.counts)
  return Plan(action, scale, rn32, rn64, norms)


def _nearest_rounding(scale, c, counts):
  """Whether float32 / float64 rows may round x*s to nearest: room for subnormal roundings."""
  trivial = c == 0  # s = 0: x * 0 is exact
  rn32 = ((scale >= 2.0 ** -126) & (c * 2.0 ** 123 >= counts)) | trivial
  rn64 = ((scale >= 2.0 ** -1022) & (c * 2.0 ** 1019 >= counts)) | trivial
  return rn32, rn64


def raise_for_arguments(batch: Batch, threshold: Threshold, read: dict) -> None:
  """The errors of the checks the device made: ids out of range (``seg_range``: each nonempty
  leaf's smallest and largest id), then a bad threshold value."""
  if "seg_range" in read:
    ranges = read["seg_range"].reshape(-1, 2)
    nonempty = [i for i, leaf in enumerate(batch.leaves) if leaf.rows]
    for i, (lo, hi) in zip(nonempty, ranges.tolist()):
      validation.check_segment_range(i, lo, hi, batch.num_systems)
  threshold.raise_if_bad(read)


# ------------------------------------------------------------------------ the exact path
class _Request(NamedTuple):
  c: np.ndarray  # thresholds of the open systems
  p: float
  fmt: Format
  prec: np.ndarray  # factor bits of the open systems: 24 or 53


def decide_one(compare: Callable[[Fraction], int], approx: Fraction, c: float, fmt: Format,
               prec: int):
  """(clip, norm, s) for one nonzero finite system from ``compare(t) = sign(norm - t)``."""
  clip = c != math.inf and compare(Fraction(c)) > 0
  norm = round_norm(compare, approx, fmt)
  s = largest_scale(compare, c, prec, approx) if clip else None
  return clip, norm, s


def resolve_exactly(batch: Batch, measured: Measured, c: torch.Tensor, kind: str, p: float,
                     certified: bool, open_: torch.Tensor, plan: Plan,
                     oracles: Callable[..., dict[int, Any]] = exact_oracles) -> None:
  """Decides the systems the intervals left open on the host, and writes them into ``plan``;
  ``oracles(batch, kind, p, systems)`` gives the exact norms of those the pieces leave open."""
  idx = torch.nonzero(open_).squeeze(1)
  columns = {"c": c.expand_as(open_), "counts": batch.counts.expand_as(open_)}
  if not isinstance(batch.prec, int):
    columns["prec"] = batch.prec.to(torch.float64)
  if measured.values is not None:
    columns["value"] = measured.values
  if measured.pieces is not None and certified:
    pieces = measured.pieces
    columns.update(q1=pieces.q1, q2=pieces.q2, qt=pieces.qt, rest=pieces.rest,
                   bound=pieces.bound, e=pieces.e.to(torch.float64))
  # The columns and the systems' ids (exact in float64) in one host read.
  table = torch.cat([torch.stack(list(columns.values()), 1)[idx],
                     idx.unsqueeze(1).to(torch.float64)], 1).cpu().numpy()
  host = dict(zip(columns, table[:, :-1].T))
  systems = table[:, -1].astype(np.int64).tolist()
  prec = host["prec"] if "prec" in host else np.full(len(systems), batch.prec)
  request = _Request(host["c"], p, FMT64 if batch.norm64 else FMT32, prec.astype(np.int64))
  results: dict[int, tuple] = {}
  still_open = []
  for j, k in enumerate(systems):
    try:
      if "value" in host:  # p = +-inf: the norm is known exactly
        oracle = ValueOracle(float(host["value"][j]))
        compare, est = oracle.compare, oracle.approx()
      elif "q1" in host:
        compare, est = _interval_compare(host, j, int(host["e"][j]), int(p))
      else:
        raise Ambiguous()
      results[j] = decide_one(compare, est, float(request.c[j]), request.fmt,
                              int(request.prec[j]))
    except Ambiguous:
      still_open.append(j)
  exact = oracles(batch, kind, p, [systems[j] for j in still_open])
  for j in still_open:
    oracle = exact[systems[j]]
    if oracle.compare(Fraction(0)) != 0:  # else a zero norm (e.g. an all-zero system)
      results[j] = decide_one(oracle.compare, oracle.approx(), float(request.c[j]), request.fmt,
                              int(request.prec[j]))
  _write_back(plan, systems, results, host)


def _write_back(plan: Plan, systems: list[int], results: dict[int, tuple], host: dict) -> None:
  """The open systems' decisions into the device tensors (and their flags into the plan)."""
  n = len(systems)
  action = np.full(n, KEEP, np.float64)
  scale, norms = np.zeros(n), np.zeros(n)
  for j, (clip, norm, s) in results.items():
    norms[j] = norm
    if clip:
      action[j], scale[j] = SCALE, float(s)
      plan.host_scale[systems[j]] = s
  with branches.on_host_copies():  # host tensors: nothing dispatched on the device
    rn32, rn64 = (r.numpy() for r in _nearest_rounding(
        torch.from_numpy(scale), torch.from_numpy(host["c"]), torch.from_numpy(host["counts"])))
  table = np.stack([action, scale, norms, rn32, rn64], 1)
  dev = plan.action.device
  values = torch.empty(table.shape, dtype=torch.float64, device=dev).copy_(
      torch.from_numpy(table))
  idx = torch.tensor(systems, dtype=torch.int64).to(dev)
  for column, target in enumerate((plan.action, plan.scale, plan.norms, plan.rn32, plan.rn64)):
    column_values = values[:, column]
    if target.dtype == torch.bool:
      column_values = column_values != 0
    target.index_copy_(0, idx, column_values.to(target.dtype))
  scaled = action == SCALE
  plan.rtz32 |= bool(np.any(scaled & ~rn32))
  plan.host64 |= bool(np.any(scaled & ~rn64))


def scales_for_host_rows(plan: Plan) -> None:
  """Exact factors of the systems whose float64 rows are computed on the host (read here)."""
  rows = torch.nonzero((plan.action == SCALE) & (plan.rn64 == 0)).squeeze(1)
  for k, s in zip(rows.cpu().tolist(), plan.scale[rows].cpu().tolist()):
    plan.host_scale.setdefault(k, Fraction(s))  # device-decided s: exact normal floats


def _interval_compare(host: dict, j: int, e: int, p: int):
  """compare(t) from the certified float64 pieces of open system j, or raise Ambiguous."""
  mid = sum(Fraction(float(host[name][j])) for name in ("q1", "q2", "qt", "rest"))
  bound = Fraction(float(host["bound"][j]))
  s_lo, s_hi = mid - bound, mid + bound
  scale = Fraction(2) ** -e

  def compare(t: Fraction) -> int:
    target = (t * scale) ** p
    if s_hi < target:
      return -1
    if s_lo > target:
      return 1
    raise Ambiguous()

  approx = fraction_root(max(mid, Fraction(0)), p) * Fraction(2) ** e
  return compare, approx
