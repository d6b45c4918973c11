"""Exact decisions of a non-integer p's power sum split across ranks, from enclosures alone
(``impls/own/shared_enclosures.py``): the same signs as one exact comparison over every term,
one exchange where the first precision decides, one a precision for a tie, and pickles within
the bound the JAX rule sizes its static tie buffer by."""

from __future__ import annotations

import pickle
import random
from fractions import Fraction

import numpy as np
import pytest

from clipbench.impls.own import exact, shared_enclosures
from clipbench.impls.tests.test_numba_sharded import ThreadGroup, on_every_rank


def _signs(parts_by_rank, p, thresholds, together=False):
  """Every rank's signs of each system against its threshold (one by one, or ``together``),
  and the exchanges it made."""
  group = ThreadGroup(len(parts_by_rank))
  signs: list = [None] * group.size
  exchanges = [0] * group.size

  def rank_main(g: int):
    member = group.member(g)

    def gather(value):
      exchanges[g] += 1
      return member.all_gather_objects(value)

    shared = shared_enclosures.SharedEnclosures(
        [exact.PowerSumTerms(*exact.magnitudes_of(np.asarray(v, np.float64)), p)
         for v in parts_by_rank[g]], p, gather)
    signs[g] = (shared.signs(thresholds) if together else
                [shared.sign(j, c) for j, c in enumerate(thresholds)])

  on_every_rank(group, rank_main)
  return signs, exchanges


@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("p", [1.5, 2.5, 7.25])
def test_signs_are_the_exact_comparison_over_every_term(p, together):
  rng = np.random.default_rng(3)
  systems = [rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4) for n in (1, 7, 50, 300)]
  parts = [np.array_split(v, 3) for v in systems]  # some ranks hold one term, or none
  by_rank = [[parts[j][g] for j in range(len(systems))] for g in range(3)]
  norms = [float(np.sum(np.abs(v) ** p) ** (1 / p)) for v in systems]
  # Below, above and at the float64 nearest each norm (a near-tie the first precision decides).
  for scale in (0.5, 2.0, 1.0):
    thresholds = [Fraction(n * scale) for n in norms]
    signs, exchanges = _signs(by_rank, p, thresholds, together)
    want = [exact.exact_compare(*exact.magnitudes_of(v), p, c)
            for v, c in zip(systems, thresholds)]
    assert signs == [want] * 3
    # One exchange for every system; a tie (a one-term system's float norm can be its term
    # exactly) takes each further precision: for that system alone, or for all ties at once.
    ties = min(want.count(0), 1) if together else want.count(0)
    assert exchanges == [1 + (len(exact.ENCLOSURE_PRECISIONS) - 1) * ties] * 3


@pytest.mark.parametrize("together", [False, True])
def test_an_exact_tie_exchanges_every_precision_in_step(together):
  # 9**1.5 + 16**1.5 + 25**1.5 = 36**1.5, one term on each rank.
  signs, exchanges = _signs([[[9.0]], [[16.0]], [[25.0, 0.0]]], 1.5, [Fraction(36)], together)
  assert signs == [[0]] * 3
  assert exchanges == [len(exact.ENCLOSURE_PRECISIONS)] * 3


def test_ties_together_take_one_exchange_a_precision():
  # Five exact ties (a term and its own norm) and a near-tie beside them, on two ranks.
  by_rank = [[[3.0], [5.0], [0.5], [7.0], [2.0], [3.0, 4.0]], [[], [], [], [], [], [1.0]]]
  thresholds = [Fraction(v) for v in (3.0, 5.0, 0.5, 7.0, 2.0)] + [
      Fraction((3.0 ** 2.5 + 4.0 ** 2.5 + 1.0) ** 0.4)]
  one_by_one, apart = _signs(by_rank, 2.5, thresholds)
  together, exchanges = _signs(by_rank, 2.5, thresholds, together=True)
  assert together == one_by_one and together[0][:5] == [0] * 5
  assert exchanges == [len(exact.ENCLOSURE_PRECISIONS)] * 2
  assert apart == [1 + 5 * (len(exact.ENCLOSURE_PRECISIONS) - 1)] * 2


@pytest.mark.parametrize("together", [False, True])
def test_a_system_with_no_nonzero_term_is_empty(together):
  signs, exchanges = _signs([[[], [0.0]], [[0.0], []]], 2.5, [Fraction(1), Fraction(0)],
                            together)
  assert signs == [[-1, 0]] * 2
  assert exchanges == [1] * 2


@pytest.mark.parametrize("prec", exact.ENCLOSURE_PRECISIONS)
@pytest.mark.parametrize("systems", [1, 3])
def test_pickles_stay_within_the_bound(prec, systems):
  rng = random.Random(prec)
  widest = lambda: ((rng.getrandbits(prec) | 1 << (prec - 1), -(1 << 62)),
                    (-(rng.getrandbits(prec) | 1 << (prec - 1)), (1 << 63) - 1))
  first = [widest() for _ in range(systems)]  # the first exchange: a list, every system's
  later = widest()  # a later one: one system's endpoints
  assert len(pickle.dumps(first)) <= shared_enclosures.exchange_bytes(systems, prec)
  assert len(pickle.dumps(later)) <= shared_enclosures.exchange_bytes(1, prec)
