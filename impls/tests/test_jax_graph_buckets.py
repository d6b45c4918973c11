"""The XLA graph route (``clipbench.jax-xla``, the JAX route off the CPU) compiles per shape
bucket: the same bits as the graph at the exact shape, and a process that clips hundreds of
distinct shapes grows no faster than one calling optax."""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clipbench.impls.own.jax import api, buckets
from clipbench.impls.own.jax.config import Config
from clipbench.impls.own.jax.gradient import clip_jit


def _same_bits(got, want) -> bool:
  return all(np.array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                            np.asarray(b).reshape(-1).view(np.uint8)) for a, b in zip(got, want))


def _exact_shape_graph(op: str, leaves, c, segments=None, num_systems=None, **options):
  """The graph compiled at the leaves' own shapes (how the route ran before the buckets)."""
  per_system = op != "clip_grad_norm"
  leaves, layout = api.check_leaves_and_segments(leaves, segments, num_systems, per_system)
  threshold = api.exact_threshold(c, "c", layout.num_systems)
  p = float(options.get("norm_type", 2.0))
  nonfinite = options.get("nonfinite", "propagate")
  dtypes = tuple(np.dtype(x.dtype) for x in leaves)
  cfg = Config("step" if op == "clip_by_max_step" else "norm", p, nonfinite == "zero",
               layout.num_systems, tuple(layout.sorted_flags),
               any(d == np.float64 for d in dtypes), dtypes, False, op, nonfinite)
  with jax.enable_x64(True):
    outs, norms = clip_jit(cfg, tuple(leaves), layout.segs, api._device_counts(layout.counts),
                           api._device_threshold(threshold))
  return list(outs), norms


def test_buckets_are_powers_of_two():
  assert [buckets.bucket(n) for n in (0, 1, 2, 3, 4, 5, 9, 1000, 1024, 1025)] == \
      [0, 1, 2, 4, 4, 8, 16, 1024, 1024, 2048]


_CASES = {
    # segmented, unsorted ids in one leaf, an empty system (3); system 4 is the vector
    # (3, 4, 1e-30) alone, a step norm a hair above its threshold (a near-tie)
    "per_system": ("clip_by_global_norm", dict(num_systems=5, norm_type=3.0)),
    "max_step": ("clip_by_max_step", dict(num_systems=5, nonfinite="zero")),
    "per_system_min": ("clip_by_global_norm", dict(num_systems=5, norm_type=-np.inf)),
    # one system: the pad joins it (zeros; copies of an element for p = +-inf)
    "global_min": ("clip_grad_norm", dict(norm_type=-np.inf)),
    "global_max_nonfinite": ("clip_grad_norm", dict(norm_type=np.inf, nonfinite="zero")),
    "global_p1": ("clip_grad_norm", dict(norm_type=1.0)),
    # float64 (the wide route): one system read as blocks of several leaves each
    "global_wide": ("clip_grad_norm", dict(norm_type=3.0)),
}


def _case_inputs(name: str):
  rng = np.random.default_rng(7)
  leaves = [rng.standard_normal((13, 3)).astype(np.float32) * 4,
            rng.standard_normal(6).astype(jnp.bfloat16)]
  leaves[0][12] = [3.0, 4.0, 1e-30]  # no zero: a zero pad would be the minimum for p = -inf
  leaves[0][5, 1] = np.float32(1e-41)  # a subnormal
  if name == "global_max_nonfinite":
    leaves[0][2, 2] = np.inf
  if name == "global_wide":
    return leaves + [rng.standard_normal(1500) + 3.0], None, 30.0
  if name.startswith("global"):
    return leaves + [np.array(2.5, np.float32)], None, 4.0  # with a 0-d leaf
  segments = [np.array([0, 0, 1, 1, 1, 2, 2, 2, 2, 0, 1, 2, 4]), np.array([2, 2, 1, 0, 0, 1])]
  c = np.array([1.0, 50.0, 2.0, 1.0, 5.0])
  return leaves, segments, c


@pytest.mark.parametrize("name", sorted(_CASES))
def test_padded_graph_gives_the_exact_shape_bits(name):
  op, options = _CASES[name]
  leaves, segments, c = _case_inputs(name)
  kwargs = dict(options)
  if segments is not None:
    kwargs["segments"] = segments
  with jax.enable_x64(name == "global_wide"):
    want = _exact_shape_graph(op, leaves, c, **kwargs)
    got = getattr(api.xla_graph, op)([jnp.asarray(x) for x in leaves], c, **kwargs)
  assert _same_bits(got[0], want[0]) and _same_bits([got[1]], [want[1]])
  assert [np.shape(o) for o in got[0]] == [np.shape(x) for x in leaves]


def test_float64_minimum_is_an_element_not_the_grouped_pad():
  """The wide route read one system's float64 leaves as one block padded with zeros to whole
  rows, and for p = -inf the pad was the minimum (norm 0: nothing clipped). Against the numba
  route's bits, called as is and inside jax.jit (where nothing else pads the leaves)."""
  rng = np.random.default_rng(3)
  leaves = [rng.permutation(np.arange(1.0, 1100.0)), np.full((3, 7), 2.0)]
  with jax.enable_x64(True):
    leaves = [jnp.asarray(x) for x in leaves]
    want_outs, want_norm = api.clip_grad_norm(leaves, 0.5, norm_type=-np.inf, route="host")
    assert float(want_norm) == 1.0
    jitted = jax.jit(lambda xs: api.xla_graph.clip_grad_norm(xs, 0.5, norm_type=-np.inf))
    for outs, norm in (api.xla_graph.clip_grad_norm(leaves, 0.5, norm_type=-np.inf),
                       jitted(leaves)):
      assert float(norm) == 1.0
      assert _same_bits(outs, want_outs)


def test_jitted_padding_gives_the_same_bits_eagerly_and_inside_jit(monkeypatch):
  """The path of other backends (padding and cutting back by jitted functions), taken on the
  CPU by declaring the leaves off-CPU, and the call inside a user's jax.jit (not padded: the
  user's compilation holds the graph)."""
  leaves, segments, c = _case_inputs("per_system")
  leaves = [jnp.asarray(x) for x in leaves]
  segments = [jnp.asarray(g) for g in segments]
  want = api.xla_graph.clip_by_global_norm(leaves, c, segments=segments, num_systems=5)
  monkeypatch.setattr(buckets, "_on_one_cpu_device", lambda leaves: False)
  eager = api.xla_graph.clip_by_global_norm(leaves, c, segments=segments, num_systems=5)
  jitted = jax.jit(lambda xs, gs: api.xla_graph.clip_by_global_norm(xs, c, segments=gs,
                                                                     num_systems=5))
  for outs, norms in (eager, jitted(leaves, segments)):
    assert _same_bits(outs, want[0]) and _same_bits([norms], [want[1]])
    assert norms.shape == (5,)


def test_grad_and_vmap_still_work():
  """jax.grad keeps the exact shapes (see api._run); jax.vmap pads with the jitted functions."""
  x = jnp.asarray(np.arange(1, 13, dtype=np.float32).reshape(3, 4))
  grad = jax.grad(lambda v: jnp.sum(api.xla_graph.clip_grad_norm([v], 1e9)[0][0]))(x[1])
  assert np.array_equal(np.asarray(grad), np.ones(4, np.float32))  # kept: the identity
  norms = jax.vmap(lambda row: api.xla_graph.clip_grad_norm([row], 1.0)[1])(x)
  assert np.allclose(np.asarray(norms), np.linalg.norm(np.asarray(x), axis=1), rtol=1e-6)


# One process: N systems of 1..N atoms (positions (n, 3), charges (n,)) clipped together once,
# then each alone (segments=None: each call a new shape, as in the batch-invariance probe that
# crashed). Rule 11 makes the batched call the oracle: every system alone must give its bits.
_CHURN = textwrap.dedent("""
    import json, sys, time
    seconds = []
    import jax, jax.numpy as jnp, numpy as np, optax
    from clipbench.impls.own.jax import api
    from clipbench.impls.own.jax.gradient import clip_jit
    shapes, optax_shapes, jit_shapes = (int(a) for a in sys.argv[1:4])
    def maps():
      with open("/proc/self/maps") as f:
        return sum(1 for _ in f)
    rng = np.random.default_rng(0)
    # systems[shapes:] only warm up (first compilations): not in the batch, not checked
    systems = [[rng.standard_normal((n, 3)).astype(np.float32),
                rng.standard_normal(n).astype(np.float32)] for n in range(1, shapes + 3)]
    c = rng.uniform(0.5, 20.0, shapes + 2)
    ids = [np.repeat(np.arange(shapes), np.arange(1, shapes + 1))] * 2
    batch = [np.concatenate([s[i] for s in systems[:shapes]]) for i in range(2)]
    outs, norms = api.xla_graph.clip_by_global_norm(batch, c[:shapes], segments=ids,
                                                    num_systems=shapes)
    offsets = np.concatenate([[0], np.cumsum(np.arange(1, shapes + 1))])
    want = [[np.asarray(o)[offsets[k]:offsets[k + 1]] for o in outs] for k in range(shapes)]
    want_norms = np.asarray(norms)
    def same(a, b):
      return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    mismatches = []
    def check(k, outs, norm):
      if k >= shapes:
        return
      if not (all(same(o, w) for o, w in zip(outs, want[k])) and same(norm, want_norms[k:k + 1])):
        mismatches.append(k)
    def ours(k):
      outs, norm = api.xla_graph.clip_by_global_norm(jax.device_put(systems[k]), c[k])
      check(k, outs, norm)
    tx = optax.clip_by_global_norm(1.0)
    def optax_call(k):
      leaves = jax.device_put(systems[k])
      return tx.update(leaves, tx.init(leaves))[0]
    def ours_jit(k):
      f = jax.jit(lambda ls: api.xla_graph.clip_by_global_norm(ls, c[k]))
      outs, norm = f(jax.device_put(systems[k]))
      check(k, outs, norm)
    def optax_jit(k):
      f = jax.jit(lambda ls: tx.update(ls, tx.init(ls))[0])
      return f(jax.device_put(systems[k]))
    def growth(call, ks):
      for k in (shapes, shapes + 1):  # warm-up: first compilations
        jax.block_until_ready(call(k))
      start, began = maps(), time.perf_counter()
      for k in ks:
        jax.block_until_ready(call(k))
      seconds.append(round(time.perf_counter() - began, 1))
      return (maps() - start) / len(ks)
    compiled = clip_jit._cache_size()
    result = {"ours": growth(ours, range(shapes))}
    result["graphs_compiled"] = clip_jit._cache_size() - compiled
    stride = max(1, shapes // optax_shapes)
    result["optax"] = growth(optax_call, range(0, shapes, stride)[:optax_shapes])
    late = range(shapes - jit_shapes, shapes)  # rows in one bucket: a cached inner trace
    result["ours_jit"] = growth(ours_jit, late)
    result["optax_jit"] = growth(optax_jit, late)
    result["mismatches"] = mismatches
    result["seconds"] = seconds
    print(json.dumps(result))
""")


def _churn(shapes: int, optax_shapes: int, jit_shapes: int) -> dict:
  done = subprocess.run([sys.executable, "-c", _CHURN, str(shapes), str(optax_shapes),
                         str(jit_shapes)], capture_output=True, text=True, timeout=3600)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_bounded(result: dict, shapes: int) -> None:
  assert result["mismatches"] == [], result
  # One graph per row bucket (1, 2, 4, ..., the bucket of `shapes`), nothing per shape.
  assert result["graphs_compiled"] <= shapes.bit_length() + 1, result
  assert result["ours"] <= result["optax"], result
  # Inside a user's jax.jit the user's program holds our graph; a fresh jit per shape frees it,
  # so nothing of ours may stay behind (an executable of the graph is ~85 mappings). The
  # count moves by a few either way as the allocator returns arenas.
  assert result["ours_jit"] <= max(result["optax_jit"], 0.0) + 1.0, result


def test_shape_churn_compiles_per_bucket_and_grows_no_faster_than_optax():
  """200 shapes called as is (optax as is on 6 of them: it compiles every operation per
  shape, ~0.8 s each), and 2 inside a user's jax.jit (each a whole compilation of the user's
  program with our graph in it, ~3 s)."""
  _assert_bounded(_churn(200, 6, 2), 200)


@pytest.mark.slow
def test_two_thousand_shapes_survive():
  _assert_bounded(_churn(2000, 20, 3), 2000)
