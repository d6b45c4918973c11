"""Child of ``test_jax_partitioned.py``: sharded calls of the FFI route on 4 host CPU devices,
each against the unsharded call on the same values (JSON lines, one per case).

Runs in a process of its own: JAX fixes its device count (``XLA_FLAGS``) when it starts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys

from clipbench.impls.tests.host_device_children import DEVICES, use_host_devices

use_host_devices()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from clipbench.impls.own.jax import api, partitioned, partitioned_segments  # noqa: E402

ROWS = P("shards")


def _mesh(shape=(DEVICES,), names=("shards",)):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                       devices=jax.devices()[:math.prod(shape)])


def _put(x: np.ndarray, spec: P, mesh=None):
  return jax.device_put(x, NamedSharding(mesh or _mesh(), spec))


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize > 1 else a.view(np.uint8)


def _same(got, want) -> bool:
  got, want = list(got), list(want)
  return len(got) == len(want) and all(
      np.asarray(g).shape == np.asarray(w).shape and np.array_equal(_bits(g), _bits(w))
      for g, w in zip(got, want))


def _counts() -> dict:
  c = partitioned.COUNTS
  return {"rounds": c.rounds, "ties": c.ties, "finished": c.finished, "passes": c.passes,
          "columns": c.columns}


def _counted(run):
  """(run's result, the custom calls it made: ``passes`` of a per-system call's chunk loop
  apart, and the leaves written from tiles split by columns dropped)."""
  before = _counts()
  result = run()
  after = _counts()
  counts = {k: after[k] - before[k] for k in after}
  counts.pop("columns")
  return result, counts, counts.pop("passes")


def _global(host, threshold, kwargs, op="clip_grad_norm", specs=None, mesh=None,
            constrain=None):
  """(outputs equal, norms equal, custom-call counts) of the jitted sharded call against the
  unsharded eager call."""
  function = getattr(api, op)
  want_outs, want_norm = function(host, threshold, **kwargs)
  specs = specs or [ROWS] * len(host)
  if constrain is None:
    leaves = [_put(x, s, mesh) for x, s in zip(host, specs)]
    jitted = jax.jit(lambda xs: function(xs, threshold, **kwargs))
  else:  # uneven rows: split inside the jitted function (device_put needs even ones)
    leaves = [jnp.asarray(x) for x in host]
    sharding = [NamedSharding(mesh or _mesh(), s) for s in specs]
    jitted = jax.jit(lambda xs: function(
        [jax.lax.with_sharding_constraint(x, s) for x, s in zip(xs, sharding)], threshold,
        **kwargs))
  columns = partitioned.COUNTS.columns
  (outs, norm), counts, _ = _counted(lambda: jax.block_until_ready(jitted(leaves)))
  return {"outputs": _same(outs, want_outs), "norms": _same([norm], [want_norm]),
          "counts": counts, "columns": partitioned.COUNTS.columns - columns}


def _per_system(host, ids, threshold, kwargs, op="clip_by_global_norm", specs=None,
                constrain=False):
  """As :func:`_global`, for a per-system call: each leaf's ids placed like its rows, and
  the passes of the chunk loop counted apart."""
  function = functools.partial(getattr(api, op), num_systems=int(np.size(threshold)), **kwargs)
  want_outs, want_norms = function(host, threshold, segments=ids)
  specs = specs or [ROWS] * len(host)
  id_specs = [P(*s[:1]) for s in specs]
  if constrain:  # uneven rows: split inside the jitted function (device_put needs even ones)
    leaves, segments = [jnp.asarray(x) for x in host], [jnp.asarray(g) for g in ids]
    split = lambda xs, ss: [jax.lax.with_sharding_constraint(x, NamedSharding(_mesh(), s))
                            for x, s in zip(xs, ss)]
    jitted = jax.jit(lambda xs, gs: function(split(xs, specs), threshold,
                                             segments=split(gs, id_specs)))
  else:
    leaves = [_put(x, s) for x, s in zip(host, specs)]
    segments = [_put(g, s) for g, s in zip(ids, id_specs)]
    jitted = jax.jit(lambda xs, gs: function(xs, threshold, segments=gs))
  (outs, norms), counts, passes = _counted(
      lambda: jax.block_until_ready(jitted(leaves, segments)))
  return {"outputs": _same(outs, want_outs), "norms": _same([norms], [want_norms]),
          "counts": counts, "passes": passes,
          "left_on_host": partitioned_segments.executions_under_way()}


def _refused(host, ids, threshold):
  """An id out of range in one device's rows: the jitted sharded call raises the unsharded
  call's ``ValueError`` message (from every device's custom call), and the custom calls that
  ran wrote nothing."""
  function = functools.partial(api.clip_by_global_norm, num_systems=int(np.size(threshold)))
  try:
    function(host, threshold, segments=ids)
    return {"error": "the unsharded call accepted an id out of range"}
  except ValueError as e:
    want = str(e)
  jitted = jax.jit(lambda xs, gs: function(xs, threshold, segments=gs))
  before = _counts()
  try:
    jax.block_until_ready(jitted([_put(x, ROWS) for x in host], [_put(g, ROWS) for g in ids]))
    return {"error": "the sharded call accepted an id out of range"}
  except Exception as e:  # noqa: BLE001 -- XLA's runtime error carries the custom call's
    message = str(e)
  after = _counts()
  counts = {k: after[k] - before[k] for k in after}
  passes = counts.pop("passes")
  counts.pop("columns")
  return {"outputs": want in message, "norms": True, "counts": counts, "passes": passes,
          "left_on_host": partitioned_segments.executions_under_way(),
          "message": message[-300:]}


def cases():
  rng = np.random.default_rng(7)
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
  # Exact ties: 64 elements of 0.5 have the 2-norm 4 exactly, and 4-vectors of 0.5 the
  # vector norm 1; a threshold just below clips.
  halves = [np.full((16, 4), 0.5, np.float32), np.zeros(8, np.float32)]
  yield "tie-p2-kept", lambda: _global(halves, 4.0, {})
  yield "tie-p2-clipped", lambda: _global(halves, float(np.nextafter(4.0, 0.0)), {})
  yield "tie-step-kept", lambda: _global(halves[:1], 1.0, {}, op="clip_by_max_step")
  # A non-integer p: near-ties from every device's enclosure of its power sum. The 2.5-norm of
  # 64 halves is 2**1.4, irrational: the float64 nearest it is a near-tie that the first
  # precision decides. 9**1.5 + 16**1.5 + 25**1.5 = 36**1.5 exactly, on three devices' rows:
  # every precision is exchanged, one round each.
  yield "near-tie-p2.5", lambda: _global(halves, 2.0 ** 1.4, {"norm_type": 2.5})
  exact_tie = np.zeros((8, 1), np.float32)
  exact_tie[[0, 3, 6], 0] = 9.0, 16.0, 25.0
  yield "exact-tie-p1.5", lambda: _global([exact_tie], 36.0, {"norm_type": 1.5})
  mixed = [f32(64, 96), f32(40, 3), f32(1000), f32(8, 8)]
  yield "p2", lambda: _global(mixed, 1.0, {})
  yield "p2.5", lambda: _global(mixed, 1.0, {"norm_type": 2.5})
  yield "p1", lambda: _global(mixed, 1.0, {"norm_type": 1.0})
  yield "p3", lambda: _global(mixed, 1.0, {"norm_type": 3.0})
  yield "p8-two-rounds", lambda: _global(mixed, 1.0, {"norm_type": 8.0})
  yield "pinf", lambda: _global(mixed, 1.0, {"norm_type": math.inf})
  yield "pminusinf", lambda: _global(mixed, 1.0, {"norm_type": -math.inf})
  yield "step-one-system", lambda: _global(mixed, 0.5, {}, op="clip_by_max_step")
  yield "global-norm-one-system", lambda: _global(mixed, 1.0, {"norm_type": 3.0},
                                                  op="clip_by_global_norm")
  poisoned = [x.copy() for x in mixed]
  poisoned[0][3, 5], poisoned[1][39, 2] = np.nan, np.inf
  yield "nan-propagate", lambda: _global(poisoned, 1.0, {})
  yield "nan-zero", lambda: _global(poisoned, 1.0, {"nonfinite": "zero"})
  yield "bfloat16", lambda: _global([x.astype(ml_dtypes.bfloat16) for x in mixed], 1.0, {})
  yield "float16-p1", lambda: _global([x.astype(np.float16) for x in mixed], 1.0,
                                      {"norm_type": 1.0})
  uneven = [f32(10, 3), f32(3), f32(1, 5), f32(9000)]
  yield "uneven-and-empty-shards", lambda: _global(uneven, 1.0, {}, constrain=True)
  two_d = _mesh((2, 2), ("a", "b"))
  yield "other-axes-whole", lambda: _global(
      mixed, 1.0, {}, specs=[P("a", None), P("b", None), P(), P(None, "a")], mesh=two_d)
  yield "replicated-and-0d", lambda: _global(
      [f32(64, 96), np.float32(3.0), f32(12)], 1.0, {}, specs=[ROWS, P(), P()])
  with jax.enable_x64(True):
    wide = [x.astype(np.float64) for x in mixed]
  yield "float64-p2", lambda: _with_x64(lambda: _global(wide, 1.0, {}))
  yield "float64-pinf", lambda: _with_x64(lambda: _global(wide, 1.0, {"norm_type": math.inf}))
  yield "float64-p1.5", lambda: _with_x64(lambda: _global(wide, 1.0, {"norm_type": 1.5}))
  yield "float64-tie", lambda: _with_x64(lambda: _global(
      [x.astype(np.float64) for x in halves], 4.0, {}))
  yield from column_cases(rng)
  yield "vmap", lambda: _vmap(f32(3, 16, 4))
  yield "grad", lambda: _grad(mixed)
  yield from per_system_cases(rng)


def column_cases(rng):
  """Leaves split along an axis after the first (tensor parallelism), read in place where each
  device holds at least a sub-block of every row (``mesh_pieces``)."""
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
  cols = P(None, "shards")
  # 2-D, 3-D by its second axis, and one by its last (read as rows of its first two axes)
  wide = [f32(64, 1024), f32(16, 8, 256), f32(1000), f32(8, 6, 1024)]
  specs = [cols, cols, ROWS, P(None, None, "shards")]
  yield "columns", lambda: _global(wide, 1.0, {}, specs=specs)
  yield "columns-p8-two-rounds", lambda: _global(wide, 1.0, {"norm_type": 8.0}, specs=specs)
  yield "columns-pinf", lambda: _global(wide, 1.0, {"norm_type": math.inf}, specs=specs)
  # max-step's vectors are the last axis: its rows only stay split, the columns are gathered
  yield "columns-step", lambda: _global(wide, 0.5, {}, op="clip_by_max_step", specs=specs)
  poisoned = [x.copy() for x in wide]
  poisoned[0][3, 700], poisoned[3][7, 5, 1] = np.nan, np.inf
  yield "columns-nan-zero", lambda: _global(poisoned, 1.0, {"nonfinite": "zero"}, specs=specs)
  yield "columns-bfloat16", lambda: _global([x.astype(ml_dtypes.bfloat16) for x in wide], 1.0,
                                            {}, specs=specs)
  yield "columns-float64", lambda: _with_x64(lambda: _global(
      [x.astype(np.float64) for x in wide], 1.0, {}, specs=specs))
  halves = [np.full((4, 1024), 0.5, np.float32)]  # 2-norm 32 exactly
  yield "columns-tie", lambda: _global(halves, 32.0, {}, specs=[cols])
  # Uneven columns (XLA pads the tiles: copied out and in) and narrow ones (gathered).
  yield "columns-uneven", lambda: _global(
      [f32(30, 1030), f32(9, 5, 1030), f32(3, 7, 999), f32(100, 3)], 1.0, {},
      specs=[cols, P(None, None, "shards"), P(None, "shards", None), cols], constrain=True)
  # A 2 x 2 mesh: rows and columns on either axis, both axes on one, a copy along the other.
  grid = _mesh((2, 2), ("a", "b"))
  yield "columns-grid", lambda: _global(
      wide + [f32(4, 5, 8, 512)], 1.0, {"norm_type": 3.0},
      specs=[P("a", "b"), P("b", "a"), P(("a", "b")), P(None, None, ("b", "a")),
             P("b", None, "a")], mesh=grid)
  yield "columns-grid-uneven", lambda: _global(
      [f32(9, 5, 1030), f32(3, 7, 999), f32(10, 1024)], 1.0, {"norm_type": 8.0},
      specs=[P("a", None, "b"), P("b", "a", None), P(None, "a")], mesh=grid, constrain=True)


def plan_cases(rng):
  """Each layout of ``column_cases``' kind, checked below the outputs: each device's tile as
  ``mesh_pieces`` says (against the array's own shards), and the numba kernels' sharded route
  on those tiles, ranks as threads, folding the unsharded call's block sums bit for bit (a
  float32 norm rarely shows a float64 sum's last bit: a plan that reads a tile's elements in
  another order can pass the outputs)."""
  f32 = lambda *s: (rng.standard_normal(s) * np.exp2(rng.integers(-20, 20, s))).astype(
      np.float32)
  grid = _mesh((2, 2), ("a", "b"))
  yield "plan-columns", lambda: _plan(
      [f32(64, 1024), f32(16, 8, 256), f32(1000), f32(8, 6, 1024), f32(100, 3)],
      [P(None, "shards"), P(None, "shards"), ROWS, P(None, None, "shards"), P(None, "shards")],
      _mesh())
  yield "plan-grid", lambda: _plan(
      [f32(64, 1024), f32(16, 8, 256), f32(1000), f32(8, 6, 1024), f32(4, 5, 8, 512)],
      [P("a", "b"), P("b", "a"), P(("a", "b")), P(None, None, ("b", "a")), P("b", None, "a")],
      grid)
  yield "plan-grid-copies", lambda: _plan(
      [f32(12, 6, 1024), f32(4, 8, 999), f32(10, 1024), f32(30, 1032), f32(6, 4, 4, 256)],
      [P("a", None, "b"), P("b", "a", None), P(None, "a"), P(None, ("a", "b")),
       P(None, None, "b")], grid)


def _plan(host, specs, mesh):
  # pylint: disable=import-outside-toplevel
  from clipbench.impls.own.jax import mesh_pieces
  from clipbench.impls.own.numba import general, sharded
  from clipbench.impls.own.numba.layout import Prepared, leaf_layout_of
  from clipbench.impls.own.numba.segments import NO_SEGMENTS
  from clipbench.impls.tests.test_numba_sharded import ThreadGroup, _stats, on_every_rank
  pieces = mesh_pieces.pieces(mesh, [jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                          sharding=NamedSharding(mesh, s))
                                     for x, s in zip(host, specs)])
  tiles_right = True
  tiles = []
  for g, place in enumerate(np.ndindex(*(mesh.shape[a] for a in pieces.axes))):
    where = dict(zip(pieces.axes, place))
    device = mesh.devices[tuple(where.get(a, 0) for a in mesh.axis_names)]
    mine = []
    for i, x in enumerate(host):
      # What the rule's program holds on that device, by JAX's own indexing.
      index = pieces.shardings[i].devices_indices_map(x.shape)[device]
      tile = np.ascontiguousarray(x[index])
      tiles_right &= tile.shape == pieces.held[g][i]
      mine.append(tile.reshape(pieces.held_views[g][i]))
    tiles.append(mine)
  layout = leaf_layout_of(list(pieces.views), [x.dtype for x in host])
  ranks = len(tiles)
  group = ThreadGroup(ranks, point_to_point=False)
  stats: list = [None] * ranks

  def rank_main(g):
    source = sharded.ShardedBlocks(Prepared(tiles[g], leaf_layout_of(
        [t.shape for t in tiles[g]], [t.dtype for t in tiles[g]]), NO_SEGMENTS), layout,
                                   pieces.shards, group.member(g))
    stats[g] = _stats(source, "clip_grad_norm", 2.0, "propagate", layout)

  on_every_rank(group, rank_main)
  flat = [np.ascontiguousarray(x).reshape(v) for x, v in zip(host, pieces.views)]
  want = _stats(general.LocalBlocks(Prepared(flat, layout, NO_SEGMENTS)), "clip_grad_norm",
                2.0, "propagate", layout)
  sums_right = all(np.array_equal(np.asarray(stats[g][k]).view(np.uint8),
                                  np.asarray(v).view(np.uint8))
                   for g in range(ranks) for k, v in want.items())
  return {"tiles": bool(tiles_right), "sums": bool(sums_right), "ranks": ranks,
          "in_place": sum(pieces.by_columns)}


def per_system_cases(rng):
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
  k = 40
  sorted_ids = lambda n: np.sort(rng.integers(0, k, n)).astype(np.int32)
  positions, cell = f32(4000, 3), f32(k, 3, 3)
  ids = [sorted_ids(4000), np.arange(k, dtype=np.int32)]
  thresholds = np.full(k, 1.5, np.float32)
  yield "segments-p2", lambda: _per_system([positions, cell], ids, thresholds, {})
  yield "segments-p1", lambda: _per_system([positions, cell], ids, thresholds,
                                           {"norm_type": 1.0})
  yield "segments-p2.5", lambda: _per_system([positions, cell], ids, thresholds,
                                             {"norm_type": 2.5})
  yield "segments-pinf", lambda: _per_system([positions, cell], ids, thresholds,
                                             {"norm_type": math.inf})
  yield "segments-p8-two-rounds", lambda: _per_system([positions, cell], ids, thresholds,
                                                      {"norm_type": 8.0})
  yield "segments-step", lambda: _per_system([positions], ids[:1], np.full(k, 0.8, np.float32),
                                             {}, op="clip_by_max_step")
  poisoned = positions.copy()
  poisoned[5, 1], poisoned[3000, 0] = np.nan, np.inf
  yield "segments-nan-zero", lambda: _per_system([poisoned, cell], ids, thresholds,
                                                 {"nonfinite": "zero"})
  yield "segments-nan-propagate", lambda: _per_system([poisoned, cell], ids, thresholds, {})
  # Every system's rows on every device: each block straddles, its elements travel, and a
  # device's part of the round needs several passes of the chunk loop.
  yield "segments-interleaved", lambda: _per_system(
      [f32(40000, 3)], [rng.integers(0, k, 40000).astype(np.int32)], thresholds, {})
  yield "segments-uneven-and-empty-shards", lambda: _per_system(
      [f32(10, 3), f32(2), f32(9001)],
      [sorted_ids(10), sorted_ids(2), sorted_ids(9001)], thresholds, {}, constrain=True)
  yield "segments-replicated", lambda: _per_system(
      [positions, cell], ids, thresholds, {}, specs=[ROWS, P()])
  # Four systems of 16 rows of four halves: each norm is 4 exactly, each step norm 1.
  halves, tie_ids = np.full((64, 4), 0.5, np.float32), np.repeat(np.arange(4), 16)
  tie_ids = tie_ids.astype(np.int32)
  yield "segments-tie-kept", lambda: _per_system([halves], [tie_ids],
                                                 np.full(4, 4.0, np.float32), {})
  yield "segments-tie-clipped", lambda: _per_system(
      [halves], [tie_ids], np.full(4, np.nextafter(4.0, 0.0)), {})
  yield "segments-tie-step", lambda: _per_system([halves], [tie_ids], np.ones(4, np.float32),
                                                 {}, op="clip_by_max_step")
  # A non-integer p: near-ties from every device's enclosure of its power sum. The 2.5-norm of
  # 64 halves is 2**1.4, irrational: the float64 nearest it is a near-tie that the first
  # precision decides. 9**1.5 + 16**1.5 + 25**1.5 = 36**1.5 exactly, twice, each system's rows
  # on two devices: every precision is exchanged, for both systems at once.
  yield "segments-near-tie-p2.5", lambda: _per_system(
      [halves], [tie_ids], np.full(4, 2.0 ** 1.4), {"norm_type": 2.5})
  exact_ties = np.zeros((16, 1), np.float32)
  exact_ties[[0, 3, 6, 8, 11, 14], 0] = 9.0, 16.0, 25.0, 9.0, 16.0, 25.0
  yield "segments-exact-tie-p1.5", lambda: _per_system(
      [exact_ties], [np.repeat(np.arange(2, dtype=np.int32), 8)], np.full(2, 36.0),
      {"norm_type": 1.5})
  with jax.enable_x64(True):
    wide, wide_cell = positions.astype(np.float64), cell.astype(np.float64)
  yield "segments-float64", lambda: _with_x64(lambda: _per_system(
      [wide, wide_cell], ids, thresholds.astype(np.float64), {}))
  yield "segments-grad", lambda: _grad_per_system([positions, cell], ids, thresholds)
  out_of_range = sorted_ids(4000)
  out_of_range[3999] = k
  yield "segments-out-of-range", lambda: _refused([positions], [out_of_range], thresholds)


def _with_x64(run):
  with jax.enable_x64(True):
    return run()


def _vmap(batch: np.ndarray):
  """A batch of leaves sharded on their rows, clipped under jax.vmap (the whole call)."""
  clip = lambda x: api.clip_grad_norm([x], 1.0)
  want = jax.vmap(clip)(jnp.asarray(batch))
  got = jax.jit(jax.vmap(clip))(_put(batch, P(None, "shards")))
  return {"outputs": _same(got[0], want[0]), "norms": _same([got[1]], [want[1]]), "counts": {}}


def _grad(host):
  loss = lambda xs: sum(jnp.sum(o * o) for o in api.clip_grad_norm(xs, 1.0)[0])
  want = jax.grad(loss)([jnp.asarray(x) for x in host])
  got = jax.jit(jax.grad(loss))([_put(x, ROWS) for x in host])
  return {"outputs": _same(got, want), "norms": True, "counts": {}}


def _grad_per_system(host, ids, threshold):
  """The gradient through a sharded per-system call (its primal through the rule)."""
  k = int(np.size(threshold))
  loss = lambda xs, gs: sum(jnp.sum(o * o) for o in api.clip_by_global_norm(
      xs, threshold, segments=gs, num_systems=k)[0])
  want = jax.grad(loss)([jnp.asarray(x) for x in host], [jnp.asarray(g) for g in ids])
  (got, counts, passes) = _counted(lambda: jax.block_until_ready(jax.jit(jax.grad(loss))(
      [_put(x, ROWS) for x in host], [_put(g, ROWS) for g in ids])))
  return {"outputs": _same(got, want), "norms": True, "counts": counts, "passes": passes,
          "left_on_host": partitioned_segments.executions_under_way()}


def main() -> int:
  for name, run in list(cases()) + list(plan_cases(np.random.default_rng(11))):
    try:
      row = run()
    except Exception as e:  # noqa: BLE001 -- reported to the test, which fails the case
      row = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    print(json.dumps({"case": name, **row}), flush=True)
  return 0


if __name__ == "__main__":
  with contextlib.suppress(KeyboardInterrupt):
    sys.exit(main())
