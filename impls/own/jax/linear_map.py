"""A linear map handed to JAX with its own transpose, which ``jax.vmap`` batches.

``jax.custom_derivatives.linear_call`` does the same, but has no batching rule (JAX 0.12), so
``jax.vmap`` of ``jax.grad`` through it raises ``NotImplementedError``. The primitive here is
JAX's documented way of adding an operation (``jax.extend.core.Primitive`` and its rules), and
touches none of JAX's own primitives. Its rules:

* evaluation and lowering: the map's jaxpr;
* JVP: the map itself (it is linear in its linear inputs; its residuals are constants);
* transpose: the transpose's jaxpr, traced only when reverse mode asks for it;
* batching: the map and its transpose each under ``jax.vmap``, every linear input and output
  batched (an unbatched linear input is broadcast first, and JAX sums its cotangent back).

The maps are traced under ``jax.enable_x64``: the per-system tangent is float64 arithmetic
(``gradient.py``), and re-traced with x64 off JAX would make float32 zeros for it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir

linear_map_p = Primitive("clipbench_linear_map")
linear_map_p.multiple_results = True


def _traced(fun: Callable, args) -> ClosedJaxpr:
  with jax.enable_x64(True):
    specs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args]
    return jax.make_jaxpr(fun)(*specs)


def linear_map(fun: Callable, fun_transpose: Callable, residuals: Any, linear: Any):
  """``fun(residuals, linear)``, linear in ``linear``, whose transpose with respect to it is
  ``fun_transpose(residuals, cotangents)`` (the arguments of ``linear_call``)."""
  res_flat, res_tree = jax.tree.flatten(residuals)
  lin_flat, lin_tree = jax.tree.flatten(linear)
  num_res = len(res_flat)
  out_tree = []

  def flat_fun(*args):
    out = fun(jax.tree.unflatten(res_tree, args[:num_res]),
              jax.tree.unflatten(lin_tree, args[num_res:]))
    flat, tree = jax.tree.flatten(out)
    out_tree.append(tree)
    return flat

  callee = _traced(flat_fun, [*res_flat, *lin_flat])

  def flat_transpose(*args):
    lin_cts = fun_transpose(jax.tree.unflatten(res_tree, args[:num_res]),
                            jax.tree.unflatten(out_tree[0], args[num_res:]))
    flat, tree = jax.tree.flatten(lin_cts)
    if tree != lin_tree:
      raise TypeError(f"fun_transpose: returns {tree}, not the linear inputs' {lin_tree}")
    return flat

  @functools.cache
  def transpose() -> ClosedJaxpr:
    return _traced(flat_transpose, [*res_flat, *callee.out_avals])

  out = linear_map_p.bind(*res_flat, *lin_flat, callee=callee, transpose=transpose,
                          num_res=num_res)
  return jax.tree.unflatten(out_tree[0], out)


def _evaluate(*args, callee: ClosedJaxpr, transpose, num_res: int):
  del transpose, num_res
  return jaxpr_as_fun(callee)(*args)


def _jvp(primals, tangents, *, callee, transpose, num_res):
  if not all(type(t) is ad.Zero for t in tangents[:num_res]):
    raise NotImplementedError(
        "a second derivative through a per-system call (its tangent's residuals have "
        "tangents of their own)")
  outs = linear_map_p.bind(*primals, callee=callee, transpose=transpose, num_res=num_res)
  lin_tangents = [ad.instantiate_zeros(t) for t in tangents[num_res:]]
  out_tangents = linear_map_p.bind(*primals[:num_res], *lin_tangents, callee=callee,
                                   transpose=transpose, num_res=num_res)
  return outs, out_tangents


def _transpose(cts, *args, callee, transpose, num_res):
  res = args[:num_res]
  assert not any(ad.is_undefined_primal(r) for r in res)
  cts = [ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct for ct in cts]
  lin_cts = linear_map_p.bind(*res, *cts, callee=transpose(), transpose=lambda: callee,
                              num_res=num_res)
  return [None] * num_res + list(lin_cts)


def _batched(closed: ClosedJaxpr, res_axes, args) -> ClosedJaxpr:
  """``closed`` under ``jax.vmap``: residuals at ``res_axes``, linear inputs and every
  output at axis 0."""
  in_axes = (*res_axes, *[0] * (len(args) - len(res_axes)))
  return _traced(jax.vmap(jaxpr_as_fun(closed), in_axes=in_axes, out_axes=0), args)


def _batch(args, dims, *, callee, transpose, num_res):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
  res, lin = moved[:num_res], moved[num_res:]
  lin = [a if d is not None else jnp.broadcast_to(a, (size, *jnp.shape(a)))
         for a, d in zip(lin, dims[num_res:])]
  res_axes = [None if d is None else 0 for d in dims[:num_res]]
  batched_callee = _batched(callee, res_axes, [*res, *lin])

  @functools.cache
  def batched_transpose() -> ClosedJaxpr:
    cts = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in batched_callee.out_avals]
    return _batched(transpose(), res_axes, [*res, *cts])

  outs = linear_map_p.bind(*res, *lin, callee=batched_callee, transpose=batched_transpose,
                           num_res=num_res)
  return outs, [0] * len(outs)


linear_map_p.def_impl(_evaluate)
linear_map_p.def_abstract_eval(lambda *args, callee, **_: callee.out_avals)
ad.primitive_jvps[linear_map_p] = _jvp
ad.primitive_transposes[linear_map_p] = _transpose
batching.primitive_batchers[linear_map_p] = _batch
mlir.register_lowering(linear_map_p, mlir.lower_fun(_evaluate, multiple_results=True))
