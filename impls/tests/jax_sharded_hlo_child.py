"""Child of ``test_jax_sharded_hlo.py``: compiles sharded calls of the own JAX routes on 4 host
CPU devices and prints, per case, the collectives that move leaf-sized data (JSON lines).

Runs in a process of its own: JAX fixes its device count (``XLA_FLAGS``) when it starts.
"""

from __future__ import annotations

import functools
import json
import sys

from clipbench.impls.tests.host_device_children import DEVICES, use_host_devices

use_host_devices()

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from clipbench import hlo_collectives as collectives  # noqa: E402
from clipbench.impls.own.jax import api  # noqa: E402

# W1-like: 2-D leaves of several sizes (one system); per-system: 3-vector and 1-D leaves whose
# sorted segments put systems across shard boundaries. Every shard of every array holds at
# least 32 KB (64 KB per-system), far more than any per-system vector (16 systems) or an
# exchange of a few flagged systems' exact partials. The FFI route's per-system rounds carry,
# per leaf and shard boundary, the elements of one sub-block (1 KB of float32) and the
# sub-block sums of the block across it, in a chunk rounded up to 4 KiB
# (``partitioned_segments.chunk_bytes``): 8 KiB a device here, whatever the shard's size, so
# the all-gather of every device's chunk (32 KiB) stays apart from a shard's size.
W1_SHAPES = ((1024, 64), (512, 96), (2048, 16), (256, 128))
PER_SYSTEM_SHAPES = ((65536, 3), (131072,))
# float64 leaves, one system: every shard holds more than the near-tie loop's all-reduce of
# one leaf's float64 limb sums (2046 exponents x 5 limbs x 8 bytes; one a leaf, as the leaves
# lie); one leaf's elements are not a multiple of 1,024 (docs/sharding.md).
FLOAT64_SHAPES = ((4000, 30), (2048, 64), (1024, 96), (512, 128))
# Leaves split along their last axis (tensor parallelism's columns), one system; a 3-D leaf
# and one of 120 rows, whose rows have a small power of two. Every shard holds more than the
# near-tie loop's all-reduces of limb sums (6 KB a float32 leaf, 80 KB for float64).
COLUMN_SHAPES = ((512, 256), (1024, 128), (120, 1024), (7, 48, 256))
# Columns each device holds at least a sub-block of (256 elements) in every row, which the FFI
# route reads in place (narrower ones it gathers along the columns: ``mesh_pieces``); on a 2 x 2
# mesh, rows on one axis and columns on the other.
WIDE_COLUMN_SHAPES = ((64, 2048), (128, 1024), (120, 1024), (8, 12, 1024))
# Rows that do not divide among the 4 devices: XLA pads the last shards (placed whole, split
# inside the program, as ``device_put`` refuses uneven shards).
UNEVEN_W1_SHAPES = ((1023, 64), (1021, 96), (2047, 16), (257, 128))
# One leaf of 510 rows (2 x 255): a view of 2 groups of 255 rows is a reshape XLA cannot apply
# to 4 padded shards of 128 rows, so the one-system pass cuts no groups where the device count
# does not divide them (``systems.block``).
UNEVEN_GROUPED_SHAPES = ((1023, 64), (510, 96))
# float64 rows that do not divide among the devices; every shard holds more than a near-tie
# round's all-reduce of one leaf's limb sums (80 KB: the leaves are apart, as they lie).
UNEVEN_FLOAT64_SHAPES = ((4095, 30), (2047, 64), (1023, 96), (511, 128))
UNEVEN_PER_SYSTEM_SHAPES = ((16381, 3), (32766,))
NUM_SYSTEMS = 16
ROUTES = {"graph": "graph", "ffi": "host"}
OPS = ("clip_grad_norm", "clip_by_global_norm", "clip_by_max_step")


def _mesh():
  return jax.make_mesh((DEVICES,), ("shards",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:DEVICES])


def _rows(ndim: int) -> NamedSharding:
  return NamedSharding(_mesh(), P("shards", *([None] * (ndim - 1))))


def _columns(ndim: int) -> NamedSharding:
  return NamedSharding(_mesh(), P(*([None] * (ndim - 1)), "shards"))


def _grid(ndim: int) -> NamedSharding:
  mesh = jax.make_mesh((2, DEVICES // 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:DEVICES])
  return NamedSharding(mesh, P("a", "b", *([None] * (ndim - 2))) if ndim > 1 else P(("a", "b")))


def _whole(ndim: int) -> NamedSharding:
  del ndim
  return NamedSharding(_mesh(), P())


def _case(op: str, dtype=np.float32, columns: bool | str = False, uneven: bool | str = False):
  """``columns``: True (COLUMN_SHAPES), "wide" (WIDE_COLUMN_SHAPES) or "grid" (those on a
  2 x 2 mesh)."""
  rng = np.random.default_rng(0)
  shapes = W1_SHAPES if op == "clip_grad_norm" else PER_SYSTEM_SHAPES
  if dtype == np.float64:
    shapes = FLOAT64_SHAPES
  if columns:
    shapes = COLUMN_SHAPES if columns is True else WIDE_COLUMN_SHAPES
  if uneven:
    shapes = UNEVEN_W1_SHAPES if op == "clip_grad_norm" else UNEVEN_PER_SYSTEM_SHAPES
    if uneven == "grouped":
      shapes = UNEVEN_GROUPED_SHAPES
    if dtype == np.float64:
      shapes = UNEVEN_FLOAT64_SHAPES
  place = (_grid if columns == "grid" else _columns if columns else _whole if uneven
           else _rows)
  leaves = [jax.device_put(rng.standard_normal(s).astype(dtype), place(len(s)))
            for s in shapes]
  if op == "clip_grad_norm":
    return leaves, None
  # sorted ids, each system's rows a run that may straddle a shard boundary
  segments = [jax.device_put((np.arange(s[0]) * NUM_SYSTEMS // s[0]).astype(np.int32),
                             place(1)) for s in shapes]
  return leaves, segments


def _split_rows(arrays):
  """Inside the program: each array's rows split over the devices (unevenly, padded)."""
  return [jax.lax.with_sharding_constraint(x, _rows(x.ndim)) for x in arrays]


def smallest_shard(leaves, segments) -> int:
  """Bytes of the smallest shard of any leaf or segment array."""
  arrays = list(leaves) + list(segments or ())
  return min(int(np.prod(a.shape)) * a.dtype.itemsize // DEVICES for a in arrays)


# Cases beyond one per (route, operation): name -> (operation, keyword arguments, one system).
VARIANTS = {
    "clip_grad_norm-p1": ("clip_grad_norm", {"norm_type": 1.0}, False),
    "clip_grad_norm-pinf": ("clip_grad_norm", {"norm_type": float("inf")}, False),
    "clip_grad_norm-p8": ("clip_grad_norm", {"norm_type": 8.0}, False),  # maxima, then sums
    "clip_grad_norm-zero": ("clip_grad_norm", {"nonfinite": "zero"}, False),
    # a non-integer p: near-ties from enclosures, one round a precision (FFI route)
    "clip_grad_norm-p2.5": ("clip_grad_norm", {"norm_type": 2.5}, False),
    "clip_by_global_norm-p2.5": ("clip_by_global_norm", {"norm_type": 2.5}, False),
    "clip_by_max_step-one-system": ("clip_by_max_step", {}, True),
    # float64 leaves: the graph's wide route reads one system's leaves as a few blocks
    "clip_grad_norm-float64": ("clip_grad_norm", {}, False),
    "clip_grad_norm-float64-pmin": ("clip_grad_norm", {"norm_type": float("-inf")}, False),
    # leaves split by columns (COLUMN_SHAPES)
    "clip_grad_norm-columns": ("clip_grad_norm", {}, False),
    "clip_grad_norm-columns-p1": ("clip_grad_norm", {"norm_type": 1.0}, False),
    "clip_grad_norm-columns-pinf": ("clip_grad_norm", {"norm_type": float("inf")}, False),
    "clip_grad_norm-columns-float64": ("clip_grad_norm", {}, False),
    "clip_grad_norm-columns-wide": ("clip_grad_norm", {}, False),
    "clip_grad_norm-columns-wide-p8": ("clip_grad_norm", {"norm_type": 8.0}, False),
    "clip_grad_norm-columns-grid": ("clip_grad_norm", {}, False),
    # rows split unevenly (UNEVEN_*_SHAPES)
    "clip_grad_norm-uneven": ("clip_grad_norm", {}, False),
    "clip_grad_norm-uneven-grouped": ("clip_grad_norm", {}, False),
    "clip_by_global_norm-uneven": ("clip_by_global_norm", {}, False),
    "clip_by_global_norm-uneven-p1": ("clip_by_global_norm", {"norm_type": 1.0}, False),
    "clip_by_max_step-uneven": ("clip_by_max_step", {}, False),
    "clip_grad_norm-uneven-float64": ("clip_grad_norm", {}, False),
}
FLOAT64_VARIANTS = ("clip_grad_norm-float64", "clip_grad_norm-float64-pmin",
                    "clip_grad_norm-columns-float64", "clip_grad_norm-uneven-float64")
COLUMN_VARIANTS = ("clip_grad_norm-columns", "clip_grad_norm-columns-p1",
                   "clip_grad_norm-columns-pinf", "clip_grad_norm-columns-float64")
WIDE_COLUMN_VARIANTS = ("clip_grad_norm-columns-wide", "clip_grad_norm-columns-wide-p8",
                        "clip_grad_norm-columns-grid")


UNEVEN_VARIANTS = ("clip_grad_norm-uneven", "clip_grad_norm-uneven-grouped",
                   "clip_by_global_norm-uneven",
                   "clip_by_global_norm-uneven-p1", "clip_by_max_step-uneven",
                   "clip_grad_norm-uneven-float64")


# The graph route: near-ties settled from limb sums (p = 1, 2, zero mode), vector by vector
# (max-step), from the leaves (other p), or never (p = +-inf: the norm is an element).
GRAPH_VARIANTS = ("clip_grad_norm-p1", "clip_grad_norm-pinf", "clip_grad_norm-p8",
                  "clip_grad_norm-zero") + FLOAT64_VARIANTS + COLUMN_VARIANTS[:3] + (
                      UNEVEN_VARIANTS)
# The FFI route's partitioning rule keeps splits of the rows and of columns at least a
# sub-block wide (impls/own/jax/mesh_pieces.py).
FFI_VARIANTS = tuple(v for v in VARIANTS if v not in COLUMN_VARIANTS + UNEVEN_VARIANTS) + (
    "clip_grad_norm-columns",)


def compiled_text(route: str, op: str) -> tuple[str, int, bool | None]:
  """The compiled per-device program's text, the smallest shard's bytes, and, for leaves split
  by columns or into uneven rows inside the program (which rule 14's grid does not lay out)
  and the leaf of 2 x 255 rows (one group here, where unsharded it has two), whether the
  sharded call gave the unsharded call's bits (None: not run)."""
  if op in FLOAT64_VARIANTS:
    with jax.enable_x64(True):
      return _compiled_text(route, op, np.float64)
  return _compiled_text(route, op, np.float32)


def _compiled_text(route: str, name: str, dtype) -> tuple[str, int, bool | None]:
  op, kwargs, one_system = VARIANTS.get(name, (name, {}, False))
  columns = (name in COLUMN_VARIANTS or (name in WIDE_COLUMN_VARIANTS and (
      "grid" if name.endswith("-grid") else "wide")))
  uneven = name in UNEVEN_VARIANTS and ("grouped" if name.endswith("-grouped") else True)
  leaves, segments = _case("clip_grad_norm" if one_system else op, dtype, columns, uneven)
  split = _split_rows if uneven else list
  function = functools.partial(getattr(api, op), **kwargs)
  if route == "optax":
    import optax  # pylint: disable=import-outside-toplevel
    clip = optax.clip_by_global_norm(1.0)
    jitted = jax.jit(lambda xs: clip.update(xs, clip.init(xs))[0])
    return jitted.lower(leaves).compile().as_text(), smallest_shard(leaves, segments), None
  def kept(result):  # outputs keep the split, as a sharded step keeps them
    outs, *rest = result
    return (split(list(outs)), *rest)

  if segments is None:
    jitted = jax.jit(lambda xs: kept(function(split(xs), 1.0, route=route)))
    lowered = jitted.lower(leaves)
  else:
    jitted = jax.jit(lambda xs, gs: kept(function(split(xs), 1.0, segments=split(gs),
                                                  num_systems=NUM_SYSTEMS, route=route)))
    lowered = jitted.lower(leaves, segments)
  compiled = lowered.compile()
  same = None
  if columns or uneven:
    host = [np.asarray(x) for x in leaves]
    if segments is None:
      got, want = compiled(leaves), function(host, 1.0, route=route)
    else:
      got = compiled(leaves, segments)
      want = function(host, 1.0, segments=[np.asarray(g) for g in segments],
                      num_systems=NUM_SYSTEMS, route=route)
    same = all(np.asarray(g).tobytes() == np.asarray(w).tobytes()
               for g, w in zip(list(got[0]) + [got[1]], list(want[0]) + [want[1]]))
  return compiled.as_text(), smallest_shard(leaves, segments), same


def _step_tie():
  """(leaves, segments, thresholds) of a max-step near-tie the graph route settles on the
  device: system 0's longest vectors have norm 5 exactly, repeated (one round settles them
  all) and once in another order; system 5's one such vector sits in the 1-D leaf's last
  shard, on another device than its other rows."""
  rng = np.random.default_rng(1)
  vec = (rng.standard_normal(PER_SYSTEM_SHAPES[0]) * 0.1).astype(np.float32)
  flat = (rng.standard_normal(PER_SYSTEM_SHAPES[1]) * 0.1).astype(np.float32)
  vec[:1024:3] = (3, 4, 0)
  vec[5] = (0, 4, 3)
  flat[-1000] = 5.0
  segs = [np.repeat(np.arange(NUM_SYSTEMS, dtype=np.int32), s[0] // NUM_SYSTEMS)
          for s in PER_SYSTEM_SHAPES]
  segs[1][-1000] = 5
  thresholds = np.full(NUM_SYSTEMS, 1.0)
  thresholds[0] = thresholds[5] = 5.0  # kept: every candidate of system 0 is checked
  return [vec, flat], segs, thresholds


def _norm_tie(p: float):
  """(float64 leaves, threshold) of a one-system near-tie: COLUMN_SHAPES' leaves of ones with
  444 zeros spread over them, so 686**2 ones: the 2-norm is 686 and the 1-norm 686**2, the
  threshold exactly. Split by columns, every device holds ones of every leaf."""
  leaves = [np.ones(s) for s in COLUMN_SHAPES]
  rng = np.random.default_rng(2)
  for x in leaves:
    x.reshape(-1)[rng.choice(x.size, 111, replace=False)] = 0.0
  assert sum(int(x.sum()) for x in leaves) == 686 ** 2
  return leaves, 686.0 if p == 2 else 686.0 ** 2


def tie_rows():
  """The sharded jitted graph route against the unsharded eager call, bit for bit, with the
  device rounds it made (max-step's vector rounds, p = 1, 2's limb-sum rounds) and the leaves'
  way's calls (there must be none)."""
  from clipbench.impls.own.jax import exact_fallback, step_ties  # noqa: E402
  calls = {"rounds": 0, "leaves": 0}

  def counted(fn, key):
    def wrapped(*args):
      calls[key] += 1
      return fn(*args)
    return wrapped

  step_ties.host_round = counted(step_ties.host_round, "rounds")
  exact_fallback.host_limb_tie = counted(exact_fallback.host_limb_tie, "rounds")
  exact_fallback.host_ties = counted(exact_fallback.host_ties, "leaves")

  def row(name, want, got):
    same = all(np.asarray(g).tobytes() == np.asarray(w).tobytes()
               for g, w in zip(list(got[0]) + [got[1]], list(want[0]) + [want[1]]))
    print(json.dumps({"tie": name, "same": same, **calls}), flush=True)

  leaves, segs, c = _step_tie()
  function = functools.partial(api.clip_by_max_step, route="graph", num_systems=NUM_SYSTEMS)
  want = function(leaves, c, segments=segs)
  calls.update(rounds=0, leaves=0)
  got = jax.jit(lambda xs, gs: function(xs, c, segments=gs))(
      [jax.device_put(x, _rows(x.ndim)) for x in leaves],
      [jax.device_put(g, _rows(1)) for g in segs])
  row("step-at-5.0", want, got)
  # float64 leaves split by columns: each leaf's limb sums are all-reduced where it lies.
  with jax.enable_x64(True):
    for p in (1.0, 2.0):
      leaves, c = _norm_tie(p)
      function = functools.partial(api.clip_grad_norm, norm_type=p, route="graph")
      want = function(leaves, c)
      calls.update(rounds=0, leaves=0)
      got = jax.jit(lambda xs: function(xs, c))(
          [jax.device_put(x, _columns(x.ndim)) for x in leaves])
      row(f"columns-float64-p{p:g}-at-norm", want, got)


def main() -> int:
  tie_rows()
  for name, route in list(ROUTES.items()) + [("optax", "optax")]:
    for op in (OPS + FFI_VARIANTS) if route == "host" else (OPS + GRAPH_VARIANTS) if (
        route == "graph") else ("clip_grad_norm",):
      text, smallest, same = compiled_text(route, op)
      found = collectives.collectives(text)
      # The uneven cases' own splitting (with_sharding_constraint) is the caller's doing.
      big = [c for c in collectives.leaf_sized(text, smallest)
             if not c.op_name.endswith("sharding_constraint")]
      print(json.dumps({"route": name, "op": op, "smallest_shard": smallest,
                        "collectives": len(found), "same_bits": same,
                        "leaf_sized": [[c.opcode, c.name, c.result.nbytes,
                                        c.operands.nbytes, c.op_name[-80:]] for c in big]}),
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
