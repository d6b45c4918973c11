"""The JAX kernel package's bit-level helpers against exact host arithmetic."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from clipbench import reference
from clipbench.impls.own import exact
from clipbench.impls.own.jax import implementation
from clipbench.impls.own.jax.formats import FORMATS, decode, format_of
from clipbench.impls.own.jax.power_sums import extract, fold_grids
from clipbench.impls.own.jax.rounding import round_nearest_bits, rtz_bits

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]


def _values(rng, dtype, n=400):
  """Normal, subnormal, zero and non-finite values of dtype."""
  fmt = format_of(dtype)
  bits = rng.integers(0, 1 << (fmt.nbits - 1), n, dtype=np.uint64)
  bits[:50] &= np.uint64((1 << fmt.mbits) - 1)  # subnormals and zero
  return bits.astype(f"u{fmt.nbits // 8}").view(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_gives_the_exact_magnitude(dtype):
  x = _values(np.random.default_rng(0), dtype)
  with jax.enable_x64(True):
    dec = decode(jnp.asarray(x), format_of(dtype))
    frac, e = np.asarray(dec.frac), np.asarray(dec.e)
  m, me = exact.magnitudes_of(x)
  for k in range(x.size):
    if not np.isfinite(np.float64(x[k])) or m[k] == 0:
      continue
    assert Fraction(float(frac[k])) * Fraction(2) ** int(e[k]) == \
        Fraction(int(m[k])) * Fraction(2) ** int(me[k])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_toward_zero_of_a_two_term_product(dtype):
  """(p_hi + p_lo) 2**e rounded toward zero, p_hi on the target grid half the time, so the
  one-unit fix for a negative p_lo is exercised."""
  rng = np.random.default_rng(3)
  n = 300
  e_add = rng.integers(-30, 10, n) - (format_of(dtype).bias - 5) * (rng.random(n) < 0.5)
  p_hi = rng.uniform(0.5, 2.0, n)
  on_grid = rng.random(n) < 0.5
  p_hi[on_grid] = np.ldexp(np.ldexp(p_hi[on_grid], e_add[on_grid]).astype(dtype)
                           .astype(np.float64), -e_add[on_grid])
  p_hi = np.where(p_hi == 0, 1.0, p_hi)
  p_lo = np.spacing(p_hi) * rng.uniform(-0.5, 0.5, n)
  with jax.enable_x64(True):
    got = np.asarray(rtz_bits(jnp.asarray(p_hi), jnp.asarray(p_lo), jnp.asarray(e_add),
                              format_of(dtype)))
  got = got.astype(f"u{format_of(dtype).nbits // 8}").view(dtype)
  for k in range(n):
    value = (Fraction(float(p_hi[k])) + Fraction(float(p_lo[k]))) * Fraction(2) ** int(e_add[k])
    below = np.asarray(float(value)).astype(dtype)
    while Fraction(float(below)) > value:
      below = np.nextafter(below, np.zeros((), dtype))
    assert Fraction(float(got[k])) == Fraction(float(below)), k


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_into_a_format_matches_numpy(dtype):
  """Nearest-even and toward-zero bits, subnormal results included (numpy keeps them)."""
  rng = np.random.default_rng(1)
  v = rng.uniform(1.0, 2.0, 500)
  e_add = rng.integers(-30, 10, 500) - (format_of(dtype).bias - 5) * (rng.random(500) < 0.5)
  # Midpoints between neighbours (normal and subnormal): the ties go to even.
  x = np.abs(_values(rng, dtype)[:200].astype(np.float64))
  x = x[np.isfinite(x) & (x > 0) & (x < 1e4)].astype(dtype)
  mid = (x.astype(np.float64) + np.nextafter(x, np.full_like(x, np.inf)).astype(np.float64)) / 2
  m, e = np.frexp(mid)
  v, e_add = np.concatenate([v, m * 2]), np.concatenate([e_add, e - 1])
  exact_vals = np.ldexp(v, e_add)
  with jax.enable_x64(True):
    near = np.asarray(round_nearest_bits(jnp.asarray(v), jnp.asarray(e_add), format_of(dtype)))
    rtz = np.asarray(rtz_bits(jnp.asarray(v), jnp.zeros(v.size), jnp.asarray(e_add),
                              format_of(dtype)))
  expected = exact_vals.astype(dtype)
  assert np.array_equal(near.view(dtype).astype(np.float64), expected.astype(np.float64))
  toward_zero = np.where(expected.astype(np.float64) > exact_vals,
                         np.nextafter(expected, np.zeros(1, dtype)), expected)
  assert np.array_equal(rtz.astype(near.dtype).view(dtype).astype(np.float64),
                        toward_zero.astype(np.float64))


def test_extracted_pieces_sum_exactly_in_any_order():
  rng = np.random.default_rng(2)
  t = rng.random(1000)
  with jax.enable_x64(True):
    sigmas, log_g, _ = fold_grids(jnp.asarray([t.size]), 3)
    pieces = [np.asarray(q) for q in extract([jnp.asarray(t)], [s[0] for s in sigmas])]
  for q, lg in zip(pieces, log_g):
    grid = Fraction(2) ** int(np.asarray(lg)[0])
    assert all(Fraction(float(v)) % grid == 0 for v in q)  # on the grid
    assert float(np.sum(q)) == float(np.sum(q[::-1])) == float(sum(map(Fraction, q)))
  remainder = sum(map(Fraction, t)) - sum(Fraction(float(v)) for q in pieces for v in q)
  last = Fraction(2) ** int(np.asarray(log_g[-1])[0])
  assert abs(remainder) <= t.size * last / 2


def test_far_below_the_max_is_a_zero_term_for_huge_p():
  # p > MAX_HALVED_POWER divides by the max; an element more than 2**1000 below it must add 0
  # (it once added the stand-in's 1**p = 1 and moved the norm by a factor 2**(1/1000)).
  leaves = [np.array([1.0, 1e-310])]
  want = reference.clip_grad_norm(leaves, np.inf, norm_type=1000.0)[1]
  with jax.enable_x64(True):
    got = implementation.clip_grad_norm([jnp.asarray(leaves[0])], np.inf, norm_type=1000.0)[1]
    assert float(got) == float(want) == 1.0


def _float_conversion_round_trips(jaxpr) -> list[str]:
  """Conversions float -> narrower float whose result is converted straight back to a wider
  float, in ``jaxpr`` and every sub-jaxpr."""
  found = []

  def walk(j):
    narrowed = {}
    for eqn in j.eqns:
      if eqn.primitive.name == "convert_element_type":
        src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
        if jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating):
          origin = narrowed.get(eqn.invars[0]) if not hasattr(eqn.invars[0], "val") else None
          if origin is not None and np.dtype(dst).itemsize > np.dtype(src).itemsize:
            found.append(f"{origin} -> {src} -> {dst}")
          if np.dtype(dst).itemsize < np.dtype(src).itemsize:
            narrowed[eqn.outvars[0]] = str(src)
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          if hasattr(sub, "eqns"):
            walk(sub)
          elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)

  walk(jaxpr)
  return found


@pytest.mark.parametrize("dtypes", [(np.float32,), (ml_dtypes.bfloat16,), (np.float16,),
                                    (np.float32, np.float64)])
@pytest.mark.parametrize("op", ["clip_by_global_norm", "clip_by_max_step", "clip_grad_norm"])
def test_the_graph_never_relies_on_a_float_conversion_round_trip(dtypes, op):
  # XLA's GPU compiler removes float64 -> float32 -> float64 chains (excess precision, on by
  # default): a rounding that relies on one is skipped there, which broke rule 4 on a GPU.
  from clipbench.impls.own.jax import xla_graph  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)
  leaves = [jnp.asarray(rng.normal(size=(6, 3)).astype(dt)) for dt in dtypes]
  kwargs = {} if op == "clip_grad_norm" else {"segments": [np.array([0, 0, 1, 1, 2, 2])] *
                                              len(leaves), "num_systems": 3}
  with jax.enable_x64(True):
    jaxpr = jax.make_jaxpr(lambda ls: getattr(xla_graph, op)(ls, 0.5, **kwargs))(leaves)
  assert jaxpr.eqns, "nothing traced"
  assert _float_conversion_round_trips(jaxpr.jaxpr) == []
