"""The graph route's near-ties for p = 1, 2: settled from exact limb sums the device makes.

``exact_fallback`` settles such a tie from integer limb sums per exponent (exact in any order,
so a sharded call all-reduces them like any other sum) instead of handing every element to
the host. The two ways must agree bit for bit: each case here runs both (the leaves' way
forced through ``limb_rounds_apply``) on exact ties and their neighbouring thresholds, in
every dtype, with subnormals, non-finite elements in zero mode, several systems, under
``jax.jit`` and ``jax.vmap``, and checks that the limb way ran.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import ml_dtypes
import numpy as np
import pytest

from clipbench.impls.own.jax import exact_fallback, xla_graph

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bits(values) -> list[bytes]:
  return [np.asarray(v).tobytes() for v in values]


def _both_ways(monkeypatch, call):
  """(limb way's result, leaves' way's result, its rounds, the leaves' way's host calls)."""
  rounds, calls = [], []
  limb_tie, host_ties = exact_fallback.host_limb_tie, exact_fallback.host_ties

  def counted_round(*args):
    rounds.append(1)
    return limb_tie(*args)

  def counted_call(*args):
    calls.append(1)
    return host_ties(*args)

  monkeypatch.setattr(exact_fallback, "host_limb_tie", counted_round)
  monkeypatch.setattr(exact_fallback, "host_ties", counted_call)
  jax.clear_caches()  # the graph is traced anew for each way (jax.jit caches it per config)
  by_limbs = call()
  assert not calls, "the leaves' way ran where the limb way applies"
  monkeypatch.setattr(exact_fallback, "limb_rounds_apply", lambda cfg, leaves: False)
  jax.clear_caches()
  by_leaves = call()
  monkeypatch.undo()
  jax.clear_caches()
  # Whether a threshold an ulp off the norm is a tie can differ between the two programs
  # (XLA compiles each differently; both intervals are certified): only the bits must agree.
  return by_limbs, by_leaves, len(rounds)


def _tie_leaves(dtype, scale: float):
  """Leaves whose 2-norm is 5 * scale and 1-norm 7 * scale exactly, with zeros around."""
  a = np.zeros((4, 3), dtype)
  a[0, 0], a[3, 2] = 3 * scale, 4 * scale
  return [a, np.zeros(5, dtype)]


def _thresholds(exact: Fraction) -> list[float]:
  c = float(exact)
  assert Fraction(c) == exact
  return [c, float(np.nextafter(c, 0.0))]


@pytest.mark.parametrize("dtype,scale,p,jitted", [
    (np.float16, 2.0 ** -20, 2.0, False),  # subnormal float16 elements
    (BF16, 1.0, 2.0, False),
    (np.float32, 1.0, 2.0, True),
    (np.float32, 2.0 ** -140, 1.0, False),  # subnormal float32 elements
])
def test_global_ties_agree_with_the_leaves_way(monkeypatch, dtype, scale, p, jitted):
  leaves = _tie_leaves(np.dtype(dtype), scale)
  exact = Fraction(scale) * (7 if p == 1 else 5)
  rounds = 0
  for c in _thresholds(exact):
    def call(c=c):
      fn = lambda xs: xla_graph.clip_grad_norm(xs, c, norm_type=p)
      return (jax.jit(fn) if jitted else fn)(leaves)
    (out, norm), (want, want_norm), ran = _both_ways(monkeypatch, call)
    assert _bits(out) == _bits(want) and _bits([norm]) == _bits([want_norm]), c
    rounds += ran
  # A 2-norm's interval cannot decide c == norm; a short 1-norm's sum is exact, its interval
  # a point, and it decides the tie itself.
  assert rounds >= 1 or p == 1, "no tie reached the limb way"


def test_per_system_ties_in_zero_mode_agree_with_the_leaves_way(monkeypatch):
  # System 0: (3, 4) split over rows, with a NaN and an inf that zero mode counts as 0;
  # system 1: a 1-norm tie of a subnormal and normals; system 2 not a tie; system 3 empty.
  x = np.array([[3.0, np.nan], [4.0, np.inf], [2.0 ** -140, 0.5], [1.0, 2.0], [0.25, 0.0]],
               np.float32)
  segments = [np.array([0, 0, 1, 2, 1], np.int32)]
  s1 = Fraction(2.0 ** -140) + Fraction(0.5) + Fraction(0.25)
  for p, c in ((2.0, [5.0, 1.0, 0.5, 1.0]), (1.0, [7.0, float(s1), 1.0, 1.0])):
    def call(p=p, c=c):
      return xla_graph.clip_by_global_norm([x], np.array(c), segments=segments, num_systems=4,
                                           norm_type=p, nonfinite="zero")
    (out, norms), (want, want_norms), rounds = _both_ways(monkeypatch, call)
    assert _bits(out) == _bits(want) and _bits([norms]) == _bits([want_norms]), p
    # System 0's 2-norm equals its threshold: no interval decides it. (A short 1-norm is an
    # exact sum, a point: it decides its tie itself.)
    assert rounds >= 1 or p == 1, "no tie reached the limb way"


def test_vmapped_ties_agree_with_the_leaves_way(monkeypatch):
  batch = np.stack([_tie_leaves(np.dtype(np.float32), s)[0] for s in (1.0, 2.0, 0.5)])

  def call():
    return jax.vmap(lambda x: xla_graph.clip_grad_norm([x], 5.0))(batch)

  (out, norms), (want, want_norms), rounds = _both_ways(monkeypatch, call)
  assert _bits(out) == _bits(want) and _bits([norms]) == _bits([want_norms])
  assert rounds >= 1


def test_float64_ties_agree_with_the_leaves_way(monkeypatch):
  with jax.enable_x64(True):
    leaves = _tie_leaves(np.dtype(np.float64), 2.0 ** -1060)  # subnormal float64 elements
    for c in _thresholds(Fraction(2.0 ** -1060) * 5):
      def call(c=c):
        return xla_graph.clip_grad_norm(leaves, c)
      (out, norm), (want, want_norm), rounds = _both_ways(monkeypatch, call)
      assert _bits(out) == _bits(want) and _bits([norm]) == _bits([want_norm]), c
      assert rounds >= 1


def test_limb_sums_are_the_exact_power_sum():
  """The limbs rebuilt on the host are the exact sum of |x|**p (with a wrong weight for a limb,
  or an exponent off by one, this fails)."""
  rng = np.random.default_rng(7)
  for dtype, p in ((np.float32, 2.0), (np.float32, 1.0), (np.float16, 2.0)):
    x = (rng.standard_normal(50) * 2.0 ** rng.integers(-30, 10, 50)).astype(dtype)
    cfg = exact_fallback.Config("norm", p, False, 1, (True,), False, (np.dtype(dtype),))
    with jax.enable_x64(True):
      sums = np.asarray(exact_fallback.exact_limb_sums(cfg, [x], None, 0))
    e_lo, _ = exact_fallback._exponents(cfg.dtypes)  # pylint: disable=protected-access
    shifts = exact_fallback.limb_scheme(cfg.dtypes, p).shifts
    total = sum(Fraction(int(sums[i, j]) << (shift + int(p) * i))
                for i in range(sums.shape[0]) for j, shift in enumerate(shifts))
    total *= Fraction(2) ** (int(p) * e_lo)
    assert total == sum(abs(Fraction(float(v))) ** int(p) for v in x)
