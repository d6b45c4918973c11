"""Exact norm oracles: ``compare(t) = sign(norm - t)`` from a system's exact elements.

A system whose certified interval cannot decide it (a near-tie) is recomputed here alone,
exactly: int64 limb sums of ``m**2`` (or ``m``) per (system, exponent) bucket for p = 1, 2 and
the step norm (``exact_power_sums``: order-independent, so on any device and in any order the
same), exact integer power sums (:func:`clipbench.impls.own.exact.power_sum`) for other
integer p, mpmath interval enclosures for non-integer p.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np
import torch

from clipbench.impls.own.exact import PowerSumTerms, enclosure_sign, magnitudes_of, power_sum
from clipbench.impls.own.shared_enclosures import SharedEnclosures
from clipbench.impls.own.torch import branches
from clipbench.impls.own.torch.formats import fraction_root, sign
from clipbench.impls.own.torch.floats import pow2
from clipbench.impls.own.torch.layout import Batch, gather
from clipbench.impls.own.torch.measure import scale_exponents


class SumOracle:
  """The exact norm from an exact power sum S (p = 1 or 2): compare(t) = sign(S - t**p)."""

  def __init__(self, total: Fraction, p: int):
    self.power_sum, self.p = total, p

  def compare(self, t: Fraction) -> int:
    return sign(self.power_sum - t ** self.p)

  def approx(self) -> Fraction:
    return fraction_root(self.power_sum, self.p)


class ValueOracle:
  """An exactly known norm (p = +-inf)."""

  def __init__(self, value: float):
    self.value = Fraction(value)

  def compare(self, t: Fraction) -> int:
    return sign(self.value - t)

  def approx(self) -> Fraction:
    return self.value


class PowerOracle:
  """General p: exact integer power sums for integer p, else mpmath interval enclosures.

  ``exact.exact_compare`` would recompute the whole sum at every comparison; the searches of
  :mod:`clipbench.impls.own.torch.formats` make dozens per system, so the exact sum (or the
  enclosure, per precision, for ``exact.enclosure_sign``) is computed once here and kept.
  """

  def __init__(self, magnitudes: np.ndarray, p: float):
    self.mags = [v for v in np.abs(magnitudes.astype(np.float64)).ravel().tolist() if v]
    self.p = p
    self._power_sum = None
    if p.is_integer() and p <= 64 and len(self.mags) <= 200_000:
      self._power_sum = self.exact_power_sum()
    self._terms: PowerSumTerms | None = None  # built at the first enclosure

  def compare(self, t: Fraction) -> int:
    if not self.mags:
      return sign(-t)
    if self._power_sum is not None:
      return sign(self._power_sum - t ** int(self.p))
    return enclosure_sign(self.enclosure, self.p, t)

  def exact_power_sum(self) -> Fraction:
    """The exact sum of the magnitudes' p-th powers (an integer p)."""
    if self._power_sum is None:
      m, e = magnitudes_of(np.array(self.mags, dtype=np.float64))
      return power_sum(m, e, int(self.p))
    return self._power_sum

  def enclosure(self, prec: int):
    """The power sum as an mpmath interval at ``prec`` bits (the context is set to it)."""
    if self._terms is None:
      self._terms = PowerSumTerms(*magnitudes_of(np.array(self.mags, dtype=np.float64)), self.p)
    return self._terms.enclosure(prec)

  def approx(self) -> Fraction:
    if not self.mags:
      return Fraction(0)
    m = max(self.mags)
    total = math.fsum((v / m) ** self.p for v in self.mags)
    return Fraction(m) * Fraction(total ** (1.0 / self.p))


def shared_power_oracles(local: Sequence[PowerOracle], p: float,
                         gather: Callable[[Any], list[Any]]) -> list[SharedPowerOracle]:
  """Oracles of systems whose magnitudes lie on several ranks, a non-integer p: ``local[j]``
  holds this rank's magnitudes of system j, and ``gather(value)`` returns every rank's value
  in rank order (a collective: every rank must call this, and then its oracles' ``compare``,
  with the same arguments in the same order, which decisions made from exchanged values do).
  No magnitude travels: the ranks' enclosures of their power sums are added
  (:class:`clipbench.impls.own.shared_enclosures.SharedEnclosures`)."""
  shared = SharedEnclosures(local, p, gather)
  return [SharedPowerOracle(shared, j) for j in range(len(local))]


class SharedPowerOracle:
  """One system's exact norm from enclosures exchanged between ranks
  (:func:`shared_power_oracles`); its search starts at the first enclosure's midpoint."""

  def __init__(self, shared: SharedEnclosures, j: int):
    self._shared, self._j = shared, j
    self._approx = fraction_root(shared.middles[j], shared.p)

  def compare(self, t: Fraction) -> int:
    return self._shared.sign(self._j, t)

  def approx(self) -> Fraction:
    return self._approx


def exact_power_sums(values: torch.Tensor, group: torch.Tensor, num_groups: int,
                     p: int) -> list[Fraction]:
  """Exact sum of ``|values|**p`` (p = 1 or 2) per group, as Python rationals.

  Every float64 magnitude is ``M * 2**E`` with a 53-bit integer M; M (p = 1) or M**2 (p = 2,
  from three 18-bit limbs) is cut into int64 limb products below 2**38, accumulated per
  (group, E) with ``index_add_`` in int64, which is exact and order-independent, and the few
  buckets are combined with Python integers.
  """
  out = [Fraction(0)] * num_groups
  if values.numel() == 0:
    return out
  values = values.detach().to(torch.float64).abs()
  chunk = 1 << 24  # keeps every int64 bucket sum below 2**63
  totals: dict[int, int] = {}
  base = None
  for start in range(0, values.numel(), chunk):
    v, g = values[start:start + chunk], group[start:start + chunk]
    mant, expo = torch.frexp(v)
    m = torch.ldexp(mant, torch.tensor(53, dtype=torch.int32, device=v.device)).to(torch.int64)
    e = expo.to(torch.int64) - 53
    if p == 1:
      limbs = torch.stack([m >> 26, m & ((1 << 26) - 1)], dim=1)
      shifts = (26, 0)
    else:
      a, b, c = m >> 36, (m >> 18) & ((1 << 18) - 1), m & ((1 << 18) - 1)
      limbs = torch.stack([a * a, 2 * a * b, 2 * a * c + b * b, 2 * b * c, c * c], dim=1)
      shifts = (72, 54, 36, 18, 0)
      e = 2 * e
    e_min = int(e.min())
    span = int(e.max()) - e_min + 1
    key = g.to(torch.int64) * span + (e - e_min)
    uniq, inverse = torch.unique(key, return_inverse=True)
    sums = torch.zeros(uniq.numel(), limbs.shape[1], dtype=torch.int64, device=v.device)
    sums.index_add_(0, inverse, limbs)
    for k, row in zip(uniq.tolist(), sums.tolist()):
      gi, ei = divmod(k, span)
      ei += e_min
      value = sum(r << s for r, s in zip(row, shifts))
      if value:
        if base is None or ei < base:
          if base is not None:
            for key_g in totals:
              totals[key_g] <<= base - ei
          base = ei
        totals[gi] = totals.get(gi, 0) + (value << (ei - base))
  for gi, total in totals.items():
    out[gi] = Fraction(total) * Fraction(2) ** base
  return out


# The most values of open systems read to the host for their exact sums (8 MiB of float64): a
# few systems' elements; a giant system's are summed where they lie.
HOST_VALUES = 1 << 20


def gather_values(batch: Batch, systems: Sequence[int],
                  vectors: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
  """Per leaf: the elements (or step vectors) of ``systems`` and their index in ``systems``.

  A leaf whose ids are sorted (systems laid out one after another, as batched relaxations lay
  them out) gives each system's rows as one run, found by binary search: no pass over its
  rows but one read of its ids for the order, with one host read for every leaf's runs and
  order together. A leaf whose ids are not sorted is read whole (its ids looked up, and the
  rows that hold a system found: one host read more)."""
  K, dev = batch.num_systems, batch.device
  wanted = torch.as_tensor(list(systems), dtype=torch.int64, device=dev)
  leaves = [leaf for leaf in batch.leaves
            if leaf.numel and not (vectors and leaf.vec == 0)]
  searched = [leaf for leaf in leaves if leaf.seg is not None]
  n = len(systems)
  runs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
  if searched and n:
    located = torch.stack([_runs_and_order(leaf.seg.contiguous(), wanted)
                           for leaf in searched]).cpu().numpy()
    runs = {id(leaf): (row[:n], row[n:2 * n]) for leaf, row in zip(searched, located)
            if row[2 * n]}
  lookup = None
  out = []
  for leaf in leaves:
    m = leaf.matrix()
    if leaf.seg is None:  # every row is system 0's
      if 0 not in systems:
        continue
      rows = torch.arange(leaf.rows, device=dev)
      owner = torch.full((leaf.rows,), list(systems).index(0), dtype=torch.int64, device=dev)
    elif id(leaf) in runs:
      lo, hi = runs[id(leaf)]
      if not (hi - lo).any():
        continue
      rows = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])).to(dev)
      owner = torch.from_numpy(np.repeat(np.arange(n), hi - lo)).to(dev)
    else:
      if lookup is None:
        lookup = torch.full((K,), -1, dtype=torch.int64, device=dev)
        lookup[wanted] = torch.arange(n, device=dev)
      g = gather(lookup, leaf.seg)
      rows = torch.nonzero(g >= 0).squeeze(1)
      if rows.numel() == 0:
        continue
      owner = g[rows]
    vals = m[rows].to(torch.float64)
    per = leaf.vec if vectors else 1
    vals = vals.reshape(-1, per) if vectors else vals.reshape(-1)
    out.append((vals, owner.repeat_interleave(leaf.width // per)))
  return out


def _runs_and_order(ids: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
  """Where each wanted id's run would start and end in ``ids``, and 1 if ``ids`` is sorted
  (only then are those the runs), as one int64 vector."""
  return torch.cat([torch.searchsorted(ids, wanted), torch.searchsorted(ids, wanted, right=True),
                    torch.all(ids[1:] >= ids[:-1]).reshape(1).to(torch.int64)])


def on_host_if_small(parts: list[tuple[torch.Tensor, torch.Tensor]], limit: int = HOST_VALUES
                     ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
  """``parts`` (:func:`gather_values`) read to the host in one read when they hold at most
  ``limit`` values, and whether they were: the exact sums of a few systems' elements then run
  there (inside :func:`.branches.on_host_copies`) with no more round trips. A larger gather (a
  near-tie in a giant system) stays where it is, as do parts already on the host."""
  if not parts or branches.on_host(parts[0][0].device) or \
      sum(v.numel() for v, _ in parts) > limit:
    return parts, False
  flat = torch.cat([torch.cat([v.reshape(-1), g.to(torch.float64)]) for v, g in parts]).cpu()
  out, start = [], 0
  with branches.on_host_copies():
    for v, g in parts:
      values = flat[start:start + v.numel()].reshape(v.shape)
      start += v.numel()
      out.append((values, flat[start:start + g.numel()].to(torch.int64)))
      start += g.numel()
  return out, True


def exact_oracles(batch: Batch, kind: str, p: float, systems: list[int]) -> dict[int, Any]:
  """Exact norm oracles for the given systems (their exact elements, no rounding).

  ``kind`` is "sum" or "step": a max or min |x| is known exactly, with no oracle needed.
  """
  if not systems:
    return {}
  if kind == "step":
    return _step_oracles(batch, systems)
  parts, read = on_host_if_small(gather_values(batch, systems))
  if p in (1.0, 2.0):
    if parts:
      with branches.on_host_copies(read):
        values = torch.cat([v for v, _ in parts])
        group = torch.cat([g for _, g in parts])
        sums = exact_power_sums(values, group, len(systems), int(p))
    else:
      sums = [Fraction(0)] * len(systems)
    return {k: SumOracle(sums[i], int(p)) for i, k in enumerate(systems)}
  with branches.on_host_copies(read):
    values = np.concatenate([v.cpu().numpy() for v, _ in parts]) if parts else np.zeros(0)
    group = np.concatenate([g.cpu().numpy() for _, g in parts]) if parts else np.zeros(0, int)
  return {k: PowerOracle(values[group == i], p) for i, k in enumerate(systems)}


def _step_oracles(batch: Batch, systems: list[int]) -> dict[int, Any]:
  parts, read = on_host_if_small(gather_values(batch, systems, vectors=True))
  with branches.on_host_copies(read):
    return _largest_step_sums(parts, systems)


def _largest_step_sums(parts: list[tuple[torch.Tensor, torch.Tensor]],
                       systems: list[int]) -> dict[int, Any]:
  """Each system's exact largest step norm, as a sum-of-squares oracle."""
  best = {k: Fraction(0) for k in systems}
  if parts:
    # Candidates: vectors whose float64 sum of squares is close to their system's largest.
    vals = [v for v, _ in parts]
    groups = [g for _, g in parts]
    dev = vals[0].device
    big = torch.zeros(len(systems), dtype=torch.float64, device=dev)
    for v, g in zip(vals, groups):
      big.scatter_reduce_(0, g, v.abs().amax(1), "amax")
    e = scale_exponents(big)
    half = torch.div(-e, 2, rounding_mode="floor")
    a, b = pow2(half), pow2(-e - half)  # a * b = 2**-e, each a normal float
    approx = [((v * a[g].unsqueeze(1) * b[g].unsqueeze(1)) ** 2).sum(1)
              for v, g in zip(vals, groups)]
    top = torch.zeros(len(systems), dtype=torch.float64, device=dev)
    for a, g in zip(approx, groups):
      top.scatter_reduce_(0, g, a, "amax")
    flat_vals, flat_ids, cand_group, offset = [], [], [], 0
    for v, g, a in zip(vals, groups, approx):
      keep = a >= top[g] * (1 - 2.0 ** -30)
      cv = v[keep]
      ids = torch.arange(offset, offset + cv.shape[0], device=cv.device)
      flat_vals.append(cv.reshape(-1))
      flat_ids.append(ids.repeat_interleave(cv.shape[1]))
      cand_group.append(g[keep])
      offset += cv.shape[0]
    sums = exact_power_sums(torch.cat(flat_vals), torch.cat(flat_ids), offset, 2)
    for gi, total in zip(torch.cat(cand_group).tolist(), sums):
      k = systems[gi]
      best[k] = max(best[k], total)
  return {k: SumOracle(best[k], 2) for k in systems}
