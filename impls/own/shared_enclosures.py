"""Exact decisions of a power sum whose terms lie on several ranks, for a non-integer p: no
magnitude travels, only each rank's interval enclosure of its own part.

A non-integer p has no exact power sum to add up (rule 3's exact norm is decided from mpmath
interval enclosures at rising precision, :func:`clipbench.impls.own.exact.enclosure_sign`). A
rank encloses the power sum of its own terms and sends the enclosure's two endpoints exactly
(mantissa and exponent as Python ints, pickled: about 41 bytes at 96 bits). The ranks'
enclosures are added with outward rounding, so the sum encloses the whole power sum, and any
comparison it decides is the exact one: the decisions, and so the bits, are those of the
unsharded call. One exchange carries every shared system's first enclosure; a higher
precision is exchanged for one system when a comparison asks for it (:meth:`~SharedEnclosures
.sign`, the CUDA route's norm searches), or for every system still open at once
(:meth:`~SharedEnclosures.signs`, the numba route's near-ties: at most one exchange a
precision), and every rank asks in the same order because the decisions are taken on
exchanged values. An enclosure
of nothing is exactly [0, 0] and any nonzero term's is above 0, so a system with no nonzero
term on any rank is known as such.

The one place the sum could differ from a single enclosure of every term: a difference that a
single enclosure decides only at the last precision (12,288 bits) and the wider sum does not,
which reads as a tie (the norm is then within about 2**-12,000 of the threshold, relatively).

Used by the torch CUDA route's sharded calls (:mod:`clipbench.impls.own.torch.oracles`) and
the numba route's sharded near-ties (:mod:`clipbench.impls.own.numba.sharded`).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable, Protocol, Sequence

from clipbench.impls.own.exact import (ENCLOSURE_PRECISIONS, FIRST_ENCLOSURE_BITS, enclosure_sign,
                                      interval_precision, sign_at)


class Enclosed(Protocol):
  """A rank's part of one system's power sum."""

  def enclosure(self, prec: int) -> Any:
    """The part as an ``mpmath.iv`` interval at ``prec`` bits (the context is set to it)."""


class SharedEnclosures:
  """The exchanged enclosures of a call's shared systems, per (system, precision).

  ``local[j]`` is this rank's part of system j's power sum, and ``gather(value)`` returns
  every rank's value in rank order (a collective: every rank must construct this, and then
  call :meth:`sign`, :meth:`signs` or :meth:`enclosure`, with the same arguments in the same
  order).
  """

  def __init__(self, local: Sequence[Enclosed], p: float, gather: Callable[[Any], list[Any]]):
    self.local, self.p, self._gather = list(local), p, gather
    first = FIRST_ENCLOSURE_BITS
    with interval_precision(first):
      mine = [endpoints(part.enclosure(first)) for part in self.local]
    every = gather(mine)
    self._cache = {(j, first): _added([e[j] for e in every], first)
                   for j in range(len(self.local))}
    # The first enclosure's exact midpoint: where a search for the norm starts.
    self.middles = [midpoint(self._cache[j, first]) for j in range(len(self.local))]
    self.empty = [m == 0 for m in self.middles]  # [0, 0]: no nonzero term on any rank

  def enclosure(self, j: int, prec: int):
    """System j's whole power sum at ``prec`` bits (the context is set to it)."""
    if (j, prec) not in self._cache:
      every = self._gather(endpoints(self.local[j].enclosure(prec)))
      self._cache[j, prec] = _added(every, prec)
    return self._cache[j, prec]

  def sign(self, j: int, c: Fraction) -> int:
    """-1, 0, 1 as system j's exact p-norm is <, ==, > the rational ``c`` (each further
    precision it needs is one exchange of system j's enclosure)."""
    if self.empty[j]:
      return (c < 0) - (c > 0)
    return enclosure_sign(lambda prec: self.enclosure(j, prec), self.p, c)

  def signs(self, thresholds: Sequence[Fraction]) -> list[int]:
    """:meth:`sign` of every system against its threshold, with one exchange per further
    precision for all the systems still open (at most one a precision, however many ties)."""
    out: list[int | None] = [(c < 0) - (c > 0) if empty else None
                             for c, empty in zip(thresholds, self.empty)]
    for prec in ENCLOSURE_PRECISIONS:
      still = [j for j, s in enumerate(out) if s is None]
      if not still:
        break
      need = [j for j in still if (j, prec) not in self._cache]
      if need:
        with interval_precision(prec):
          mine = [endpoints(self.local[j].enclosure(prec)) for j in need]
        every = self._gather(mine)
        for i, j in enumerate(need):
          self._cache[j, prec] = _added([e[i] for e in every], prec)
      for j in still:
        out[j] = sign_at(lambda at, j=j: self._cache[j, at], self.p, thresholds[j], prec)
    return [0 if s is None else s for s in out]  # open at the last precision: exact ties


def exchange_bytes(systems: int, prec: int = ENCLOSURE_PRECISIONS[-1]) -> int:
  """A bound on the pickle a rank sends in one exchange of ``systems`` enclosures at ``prec``
  bits: per endpoint a mantissa of at most ``prec`` bits (a pickled long: its bytes, a sign
  byte and a 5-byte opcode) and an exponent (at most 64 bits: 10 bytes), 8 bytes of tuples
  per system, and 32 of pickle framing."""
  return systems * (2 * (math.ceil(prec / 8) + 6 + 10) + 8) + 32


def endpoints(interval) -> tuple[tuple[int, int], tuple[int, int]]:
  """An mpmath interval's endpoints, exactly, as (mantissa, exponent) pairs of Python ints."""
  from mpmath import libmp  # pylint: disable=import-outside-toplevel
  return tuple((int(m), int(e)) for m, e in map(libmp.to_man_exp, interval._mpi_))


def midpoint(interval) -> Fraction:
  """The exact midpoint of an mpmath interval."""
  lo, hi = (Fraction(m) * Fraction(2) ** e for m, e in endpoints(interval))
  return (lo + hi) / 2


def _added(parts, prec: int):
  """The sum of intervals given by exact endpoints, rounded outward to ``prec`` bits."""
  import mpmath  # pylint: disable=import-outside-toplevel
  from mpmath import libmp  # pylint: disable=import-outside-toplevel
  lo = hi = libmp.fzero
  for (lo_m, lo_e), (hi_m, hi_e) in parts:
    lo = libmp.mpf_add(lo, libmp.from_man_exp(lo_m, lo_e), prec, libmp.round_floor)
    hi = libmp.mpf_add(hi, libmp.from_man_exp(hi_m, hi_e), prec, libmp.round_ceiling)
  return mpmath.iv.make_mpf((lo, hi))
