"""Child of ``test_jax_partitioned.py``: sharded calls of the FFI route on 4 host CPU devices,
each against the unsharded call on the same values (JSON lines, one per case).

Runs in a process of its own: JAX fixes its device count (``XLA_FLAGS``) when it starts.
"""

from __future__ import annotations

import contextlib
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

from clipbench.impls.own.jax import api, partitioned  # noqa: E402

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
  return {"rounds": c.rounds, "ties": c.ties, "finished": c.finished}


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
  before = _counts()
  outs, norm = jitted(leaves)
  jax.block_until_ready((outs, norm))
  after = _counts()
  return {"outputs": _same(outs, want_outs), "norms": _same([norm], [want_norm]),
          "counts": {k: after[k] - before[k] for k in after}}


def cases():
  rng = np.random.default_rng(7)
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
  # Exact ties: 64 elements of 0.5 have the 2-norm 4 exactly, and 4-vectors of 0.5 the
  # vector norm 1; a threshold just below clips.
  halves = [np.full((16, 4), 0.5, np.float32), np.zeros(8, np.float32)]
  yield "tie-p2-kept", lambda: _global(halves, 4.0, {})
  yield "tie-p2-clipped", lambda: _global(halves, float(np.nextafter(4.0, 0.0)), {})
  yield "tie-step-kept", lambda: _global(halves[:1], 1.0, {}, op="clip_by_max_step")
  mixed = [f32(64, 96), f32(40, 3), f32(1000), f32(8, 8)]
  yield "p2", lambda: _global(mixed, 1.0, {})
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
  yield "float64-tie", lambda: _with_x64(lambda: _global(
      [x.astype(np.float64) for x in halves], 4.0, {}))
  yield "vmap", lambda: _vmap(f32(3, 16, 4))
  yield "grad", lambda: _grad(mixed)


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


def main() -> int:
  for name, run in cases():
    try:
      row = run()
    except Exception as e:  # noqa: BLE001 -- reported to the test, which fails the case
      row = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    print(json.dumps({"case": name, **row}), flush=True)
  return 0


if __name__ == "__main__":
  with contextlib.suppress(KeyboardInterrupt):
    sys.exit(main())
