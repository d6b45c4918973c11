"""The graph route's near-ties settled on the device: limb sums for p = 1, 2, chosen vectors for
max-step.

``exact_fallback`` settles a p = 1, 2 tie from integer limb sums per exponent (exact in any
order, so a sharded call all-reduces them like any other sum), and ``step_ties`` settles a
max-step tie from the few vectors that can decide it, instead of handing every element to the
host. Each way must agree bit for bit with the leaves' way: each case here runs both (the
leaves' way forced through ``limb_rounds_apply`` and ``step_ties.rounds_apply``) on exact ties
and their neighbouring thresholds, in every dtype, with subnormals, non-finite elements in
zero mode, several systems, under ``jax.jit`` and ``jax.vmap``, and checks that the device way
ran.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import ml_dtypes
import numpy as np
import pytest

from clipbench.impls.own.jax import exact_fallback, step_ties, xla_graph

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bits(values) -> list[bytes]:
  return [np.asarray(v).tobytes() for v in values]


def _both_ways(monkeypatch, call):
  """(device way's result, leaves' way's result, the device way's host rounds)."""
  rounds, calls = [], []
  limb_tie, step_round, host_ties = (exact_fallback.host_limb_tie, step_ties.host_round,
                                     exact_fallback.host_ties)

  def counted(fn, into):
    def wrapped(*args):
      into.append(1)
      return fn(*args)
    return wrapped

  monkeypatch.setattr(exact_fallback, "host_limb_tie", counted(limb_tie, rounds))
  monkeypatch.setattr(step_ties, "host_round", counted(step_round, rounds))
  monkeypatch.setattr(exact_fallback, "host_ties", counted(host_ties, calls))
  jax.clear_caches()  # the graph is traced anew for each way (jax.jit caches it per config)
  by_device = call()
  assert not calls, "the leaves' way ran where a device way applies"
  monkeypatch.setattr(exact_fallback, "limb_rounds_apply", lambda cfg, leaves: False)
  monkeypatch.setattr(step_ties, "rounds_apply", lambda cfg, leaves: False)
  jax.clear_caches()
  by_leaves = call()
  monkeypatch.undo()
  jax.clear_caches()
  # Whether a threshold an ulp off the norm is a tie can differ between the two programs
  # (XLA compiles each differently; both intervals are certified): only the bits must agree.
  return by_device, by_leaves, len(rounds)


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


@pytest.mark.parametrize("dtype,p", [
    (np.float32, 2.0), (np.float32, 1.0), (np.float16, 2.0), (BF16, 2.0), (np.float64, 2.0),
    (np.float64, 1.0)])
def test_limb_sums_are_the_exact_power_sum(dtype, p):
  """The limbs rebuilt on the host are the exact sum of |x|**p, subnormals and the largest
  finite value included (with a wrong weight for a limb, or an exponent off by one, this
  fails)."""
  rng = np.random.default_rng(7)
  dtype = np.dtype(dtype)
  span = {2: 12, 4: 100, 8: 900}[dtype.itemsize] if dtype != BF16 else 100
  x = (rng.standard_normal(50) * 2.0 ** rng.integers(-span, span // 8, 50)).astype(dtype)
  info = ml_dtypes.finfo(dtype)
  x[:3] = [info.smallest_subnormal, info.max, -info.tiny]
  cfg = exact_fallback.Config("norm", p, False, 1, (True,), dtype == np.float64, (dtype,))
  with jax.enable_x64(True):
    sums = np.asarray(exact_fallback.exact_limb_sums(cfg, [x], None, 0))
  e_lo, _ = exact_fallback._exponents(cfg.dtypes)  # pylint: disable=protected-access
  shifts = exact_fallback.limb_scheme(cfg.dtypes, p).shifts
  total = sum(Fraction(int(sums[i, j]) << (shift + int(p) * i))
              for i in range(sums.shape[0]) for j, shift in enumerate(shifts))
  total *= Fraction(2) ** (int(p) * e_lo)
  assert total == sum(abs(Fraction(float(v))) ** int(p) for v in x)


def _step_leaves(dtype):
  """Three systems of 3-vectors: system 0's longest vectors have norm 5 exactly, (3, 4, 0)
  many times over and in two other orders; system 1 one vector of norm 13 exactly among short
  ones; system 2 short ones only. A 1-D leaf (vectors of one element) adds to system 1."""
  x = np.zeros((12, 2, 3), dtype)
  x[0:6, :, 0], x[0:6, :, 1] = 3, 4
  x[6, 0] = (4, 3, 0)
  x[7, 1] = (0, -4, 3)
  x[8, 0], x[9, 1] = (5, 12, 0), (1, 1, 1)
  x[10, 0], x[11, 1] = (0.5, 0, 0), (0, 0.25, 0)
  segments = np.array([0] * 8 + [1, 1, 2, 2], np.int32)
  y = np.array([2.0, -3.0, 0.5], dtype)
  return [x, y], [segments, np.array([1, 1, 2], np.int32)]


@pytest.mark.parametrize("dtype,nonfinite", [
    (np.float32, "zero"), (BF16, "propagate"), (np.float64, "propagate")])
def test_step_ties_agree_with_the_leaves_way(monkeypatch, dtype, nonfinite):
  leaves, segments = _step_leaves(np.dtype(dtype))
  if nonfinite == "zero":
    leaves[0][1, 1, 2] = np.nan  # counts as 0 in zero mode: the vector stays (3, 4, 0)
    leaves[0][10, 1, 0] = np.inf
  rounds = 0
  with jax.enable_x64(np.dtype(dtype) == np.float64):
    for c0, c1 in ((5.0, 13.0), (float(np.nextafter(5.0, 0.0)), float(np.nextafter(13.0, 0.0)))):
      thresholds = np.array([c0, c1, 0.5])
      def call(thresholds=thresholds):
        fn = lambda xs, segs: xla_graph.clip_by_max_step(
            xs, thresholds, segments=segs, num_systems=3, nonfinite=nonfinite)
        return jax.jit(fn)(leaves, segments)
      (out, norms), (want, want_norms), ran = _both_ways(monkeypatch, call)
      assert _bits(out) == _bits(want) and _bits([norms]) == _bits([want_norms]), thresholds
      rounds += ran
  # System 0 at c = 5: (3, 4, 0) repeated is one round, its two reorderings two more.
  assert rounds >= 3, rounds


def test_step_ties_of_one_system_and_under_vmap_agree_with_the_leaves_way(monkeypatch):
  leaves, _ = _step_leaves(np.dtype(np.float32))
  batch = np.stack([leaves[0] * s for s in (1.0, 2.0, 0.5)]).astype(np.float32)

  def call():  # jitted: an eager vmap of one device's leaves takes the leaves' way
    return jax.jit(jax.vmap(lambda x: xla_graph.clip_by_max_step([x], 13.0)))(batch)

  (out, norms), (want, want_norms), rounds = _both_ways(monkeypatch, call)
  assert _bits(out) == _bits(want) and _bits([norms]) == _bits([want_norms])
  assert rounds >= 1


def test_a_step_tie_decides_by_the_exact_norm():
  """(3, 4, 0) at c = 5 keeps its step, an ulp below c scales it, whichever way settles it
  (the other tests compare the two ways with each other)."""
  x = np.zeros((4, 3), np.float32)
  x[2] = (3, 4, 0)
  for c, scaled in ((5.0, False), (float(np.nextafter(5.0, 0.0)), True)):
    # Jitted over the leaves only: a traced float64 threshold would be cut to float32.
    for call in (xla_graph.clip_by_max_step,
                 jax.jit(lambda xs, c: xla_graph.clip_by_max_step(xs, c), static_argnums=1)):
      out, _ = call([x], c)
      assert (np.asarray(out[0])[2] != x[2]).any() == scaled, c


def test_an_eager_call_on_one_device_settles_ties_from_the_leaves(monkeypatch):
  """Compiled alone on one device's leaves, a max-step tie takes the leaves' way, which costs
  the compilation less (``Config.may_be_sharded``); under ``jax.jit`` the device way."""
  ways = []
  for name, module, fn in (("leaves", exact_fallback, "host_ties"),
                           ("device", step_ties, "host_round")):
    def counted(*args, original=getattr(module, fn), name=name):
      ways.append(name)
      return original(*args)
    monkeypatch.setattr(module, fn, counted)
  jax.clear_caches()
  steps = np.zeros((4, 3), np.float32)
  steps[2] = (3, 4, 0)
  xla_graph.clip_by_max_step([steps], 5.0)
  assert ways == ["leaves"], ways
  ways.clear()
  jax.jit(lambda xs: xla_graph.clip_by_max_step(xs, 5.0))([steps])
  assert ways and set(ways) == {"device"}, ways


def test_float64_leaves_reach_the_leaves_way_whole():
  """Per-system p = 2.5 ties (no limb scheme: the leaves' way) in float64 decide by the exact
  norms, on shapes the route pads to its buckets. The leaves' bits cross as uint32 words: as
  uint64 operands they reached the host cut to their low words there (x64 is off where the
  callback's operands are converted), and it decided from garbage."""
  with jax.enable_x64(True):
    x = np.zeros((12, 2, 3))
    x[1, 1, 1], x[5, 0, 0] = 1.5 + 2.0 ** -40, 3.0  # each system's norm is this element
    segments = [np.repeat(np.arange(3, dtype=np.int32), 4)]
    for below in (False, True):
      c = np.array([x[1, 1, 1], x[5, 0, 0], 1.0])
      c = np.nextafter(c, 0.0) if below else c
      out, _ = xla_graph.clip_by_global_norm([x], c, segments=segments, num_systems=3,
                                             norm_type=2.5)
      changed = np.asarray(out[0]) != x
      assert (changed[1, 1, 1], changed[5, 0, 0]) == (below, below), c
