"""Reverse mode through per-system calls of the own JAX implementation (``jax.grad``).

The custom JVP (``impls/own/jax/gradient.py``) computes the tangent in float64 under the
call's ``jax.enable_x64``, and brings per-system values linear in the tangents to the rows of
each leaf (a gather). ``jax.grad`` used to transpose that after the context had closed; with
x64 off in the caller (JAX's default) the gather's transpose scattered a float64 cotangent into
float32 zeros, and every per-system ``jax.grad`` raised ``TypeError``. The JVP now hands JAX
its transpose, taken under x64 (``linear_map``, a primitive of ours that ``jax.vmap``
batches). Checked here on both routes, with x64 off as a user has it:

* the gradient exists and is finite, clipped systems included;
* it is the transpose of the JVP: ``<w, J v>`` from ``jax.jvp`` equals ``<J^T w, v>`` from
  ``jax.vjp`` for random v, w (a transpose of the wrong linear map fails this);
* one system given as segments has the gradient of the call without segments (which brings
  the value to the rows by a broadcast, never affected), bit for bit;
* ``jax.vmap`` of ``jax.grad`` batches, with segments and without: every slice has its own
  gradient's bits (with segments it raised ``NotImplementedError`` while the transpose went
  through JAX's ``linear_call``, which has no batching rule), jitted too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clipbench.impls.own.jax import api

ROUTES = ("graph", "host")


def _leaves(rng, rows: int, systems: int, scale: float):
  return [jnp.asarray((rng.standard_normal((rows, 3)) * scale).astype(np.float32)),
          jnp.asarray((rng.standard_normal((systems, 2)) * scale).astype(np.float32))]


def _ids(rng, rows: int, systems: int):
  return [jnp.asarray(np.sort(rng.integers(0, systems, rows)).astype(np.int32)),
          jnp.arange(systems, dtype=jnp.int32)]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("p", [1.0, 3.0])
@pytest.mark.parametrize("scale", [1e-30, 1e20])
def test_grad_is_the_transpose_of_the_jvp(route, p, scale):
  assert not jax.config.jax_enable_x64  # the caller's default, where the transpose failed
  rng = np.random.default_rng(int(p * 10) + int(np.log10(scale)) + 100)
  systems = 5
  leaves, ids = _leaves(rng, 40, systems, scale), _ids(rng, 40, systems)
  # About half of the systems clipped: the tangent of a clipped system is not the identity.
  threshold = np.full(systems, 1.2 * scale, np.float32)

  def f(xs):
    return api.clip_by_global_norm(xs, threshold, segments=ids, num_systems=systems,
                                   norm_type=p, route=route)[0]

  v = [jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)) for x in leaves]
  w = [jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)) for x in leaves]
  _, jv = jax.jvp(f, (leaves,), (v,))
  _, pullback = jax.vjp(f, leaves)
  (jtw,) = pullback(w)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jtw)
  forward = sum(float(np.dot(np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()))
                for a, b in zip(w, jv))
  backward = sum(float(np.dot(np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()))
                 for a, b in zip(jtw, v))
  assert backward == pytest.approx(forward, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("route", ROUTES)
def test_one_system_as_segments_has_the_gradient_without_segments(route):
  rng = np.random.default_rng(5)
  leaves = _leaves(rng, 30, 1, 1.0)
  ids = [jnp.zeros(30, jnp.int32), jnp.zeros(1, jnp.int32)]

  def loss(xs, segments):
    kw = {} if segments is None else {"segments": segments, "num_systems": 1}
    out = api.clip_by_global_norm(xs, np.float32(0.5), route=route, **kw)[0]
    return sum(jnp.sum(o * o * (i + 1)) for i, o in enumerate(out))

  with_ids = jax.grad(loss)(leaves, ids)
  without = jax.grad(loss)(leaves, None)
  for a, b in zip(with_ids, without):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("route", ROUTES)
def test_vmap_of_grad_without_segments_gives_each_slice_its_gradient(route):
  """Without segments the tangent is plain JAX operations (the transpose under x64 is for
  calls with segments only), which ``jax.vmap`` batches."""
  batch = jnp.asarray(np.random.default_rng(9).standard_normal((3, 40, 3)).astype(np.float32))

  def loss(x):
    return jnp.sum(api.clip_grad_norm([x], 1.0, route=route)[0][0] ** 2)

  batched = jax.vmap(jax.grad(loss))(batch)
  for i in range(batch.shape[0]):
    assert np.asarray(batched[i]).tobytes() == np.asarray(jax.grad(loss)(batch[i])).tobytes()


def _per_system_loss(route: str, systems: int, p: float):
  def loss(xs, segments, threshold):
    out = api.clip_by_global_norm(xs, threshold, segments=segments, num_systems=systems,
                                  norm_type=p, route=route)[0]
    return sum(jnp.sum(o * o * (i + 1)) for i, o in enumerate(out))
  return loss


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("batched", ["leaves", "first-leaf", "leaves-and-ids"])
def test_vmap_of_grad_with_segments_gives_each_slice_its_gradient(route, batched):
  """``jax.vmap`` of ``jax.grad`` through a per-system call (``linear_map``'s batching rule):
  every slice has the gradient of that slice alone, bit for bit; with one leaf batched and
  the other not (the rule broadcasts its tangent), and with each slice's own segment ids."""
  rng = np.random.default_rng({"leaves": 11, "first-leaf": 12, "leaves-and-ids": 13}[batched])
  systems, batch = 5, 3
  slices = [_leaves(rng, 40, systems, 1.0) for _ in range(batch)]
  ids = [_ids(rng, 40, systems) for _ in range(batch)]
  threshold = np.full(systems, 1.2, np.float32)
  grad = jax.grad(_per_system_loss(route, systems, 2.0))
  stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  if batched == "leaves":
    got = jax.vmap(grad, in_axes=(0, None, None))(stack(slices), ids[0], threshold)
    want = [grad(slices[j], ids[0], threshold) for j in range(batch)]
  elif batched == "first-leaf":
    shared = slices[0][1]
    got = jax.vmap(grad, in_axes=([0, None], None, None))(
        [stack([s[0] for s in slices]), shared], ids[0], threshold)
    want = [grad([s[0], shared], ids[0], threshold) for s in slices]
  else:
    got = jax.vmap(grad, in_axes=(0, 0, None))(stack(slices), stack(ids), threshold)
    want = [grad(slices[j], ids[j], threshold) for j in range(batch)]
  got = [[g[j] for g in got] for j in range(batch)]
  for j in range(batch):
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in got[j])
    for a, b in zip(got[j], want[j]):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (j, a, b)


@pytest.mark.parametrize("route", ROUTES)
def test_jitted_vmap_of_grad_with_segments_matches_the_eager_one(route):
  rng = np.random.default_rng(14)
  systems = 4
  slices = [_leaves(rng, 24, systems, 1e-3) for _ in range(2)]
  ids = _ids(rng, 24, systems)
  threshold = np.full(systems, 1e-3, np.float32)
  batched = jax.vmap(jax.grad(_per_system_loss(route, systems, 3.0)), in_axes=(0, None, None))
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *slices)
  eager, jitted = batched(stacked, ids, threshold), jax.jit(batched)(stacked, ids, threshold)
  for a, b in zip(eager, jitted):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
