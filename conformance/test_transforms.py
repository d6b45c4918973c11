"""Program transformations an implementation declares: jax.jit, jax.vmap, jax.grad, torch.compile.

* jit: the jitted call gives the eager bits, and equal shapes never retrace;
* vmap: each slice of a vmapped call gives the eager bits of that slice;
* grad: the gradient of sum(output) is finite at a zero input and is the identity (all ones)
  where the norm is below the threshold (rule 3 makes the map the identity there);
* torch.compile: the compiled call gives the eager bits.

Each runs on the session's device (``--device``), on inputs moved there as for every call, and
its outputs must stay there.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from clipbench import devices
from clipbench.conformance import running
from clipbench.conformance.cases import Inputs, case_named
from clipbench.conformance.rules import Violation, first_difference
from clipbench.conformance.running import SESSION, not_applicable
from clipbench.impls import calling, frameworks

TRANSFORMS = ("jit", "vmap", "grad", "torch.compile")
CASES = ("clip_3_4_to_1", "random_float32", "large_batch_interleaved")


def transform_cases(impl, op):
  out = []
  for transform in TRANSFORMS:
    for name in CASES if transform != "grad" else ("tie_3_4",):
      case = case_named(name)
      if op not in case.ops:
        continue
      inputs = SESSION.inputs(case, op)
      reason = not_applicable(impl, op, inputs)
      if reason is None and transform not in impl.capabilities.transforms:
        reason = f"{transform} not declared"
      out.append((f"{transform}-{name}", (transform, case), reason, "float32"))
  return out


def _prepared(impl, op, inputs: Inputs) -> calling.Prepared:
  return running.prepare(impl, op, inputs.leaves, inputs.threshold, **_kw(op, inputs))


def _eager(impl, op, inputs: Inputs):
  prepared = _prepared(impl, op, inputs)
  return prepared, calling.result_to_numpy(calling.run(impl, prepared))


def _on_device(impl, prepared, result, what):
  """``result`` as numpy, once its arrays are found on the session's device."""
  misplaced = running.misplaced(impl, prepared, result)
  if misplaced:
    raise Violation(f"{what} on {running.device()}: {misplaced}")
  return calling.result_to_numpy(result)


def _kw(op, inputs):
  kw = inputs.kwargs(op)
  if op == "clip_grad_norm":
    kw.pop("segments", None), kw.pop("num_systems", None)
  return kw


def _same(a, b, what):
  (la, na), (lb, nb) = a, b
  for i, (x, y) in enumerate(zip(la, lb)):
    if x.tobytes() != y.tobytes():
      j = first_difference(x, y)
      raise Violation(f"{what}: leaves[{i}] element {j} differs from eager: "
                      f"{y.ravel()[j]!r} vs {x.ravel()[j]!r}")
  if na is not None and nb is not None and np.asarray(na).tobytes() != np.asarray(nb).tobytes():
    raise Violation(f"{what}: norms differ from eager: {nb!r} vs {na!r}")


def verify_jit(impl, op, inputs):
  import jax  # pylint: disable=import-outside-toplevel
  prepared, eager = _eager(impl, op, inputs)
  fn = impl.function(op)
  traces = []

  def f(leaves, segments):
    traces.append(1)
    kw = dict(prepared.kwargs)
    if segments is not None:
      kw["segments"] = segments
    return fn(leaves, prepared.threshold, **kw)

  jitted = jax.jit(f)
  segments = prepared.kwargs.get("segments")
  first = _on_device(impl, prepared, frameworks.block_until_ready(
      jitted(prepared.leaves, segments)), "jax.jit")
  _same(eager, first, "jax.jit")
  again = [x * 0.5 for x in prepared.leaves]
  frameworks.block_until_ready(jitted(again, segments))
  if len(traces) != 1:
    raise Violation(f"jax.jit retraced on an equal-shape call ({len(traces)} traces)")


def verify_vmap(impl, op, inputs):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  scales = (1.0, 0.25, 3.0)
  variants = [Inputs([(x.astype(np.float64) * s).astype(x.dtype) for x in inputs.leaves],
                     inputs.threshold, inputs.segments, inputs.num_systems, inputs.norm_type,
                     inputs.nonfinite) for s in scales]
  eagers = [_eager(impl, op, v) for v in variants]
  prepared = eagers[0][0]
  fn = impl.function(op)
  stacked = [jnp.stack([e[0].leaves[i] for e in eagers]) for i in range(len(inputs.leaves))]
  result = jax.vmap(lambda leaves: fn(leaves, prepared.threshold, **prepared.kwargs))(stacked)
  leaves, norms = _on_device(impl, dataclasses.replace(prepared, leaves=stacked), result,
                             "jax.vmap")
  for j, (_, eager) in enumerate(eagers):
    sliced = ([x[j] for x in leaves], None if norms is None else np.asarray(norms)[j])
    _same(eager, sliced, f"jax.vmap slice {j}")


def verify_grad(impl, op, inputs):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  prepared = _prepared(impl, op, inputs)
  fn = impl.function(op)

  def total(leaves):
    out, _ = fn(leaves, prepared.threshold, **prepared.kwargs)
    return sum(jnp.sum(x.astype(jnp.float32)) for x in out)

  zeros = [devices.put(jnp.zeros_like(x), running.device(), "jax") for x in prepared.leaves]
  for name, point in (("a zero input", zeros), ("an input below the threshold",
                                                [x * 0.5 for x in prepared.leaves])):
    grads = jax.grad(total)(point)
    _on_device(impl, dataclasses.replace(prepared, leaves=point), (grads, None),
               f"jax.grad at {name}")
    for i, g in enumerate(grads):
      g = np.asarray(g, dtype=np.float64)
      if not np.isfinite(g).all():
        raise Violation(f"jax.grad at {name}: non-finite gradient {g.ravel()[:4]}")
      if not np.all(g == 1.0):
        raise Violation(f"jax.grad at {name}: expected the identity (ones), got {g.ravel()[:4]}")


def verify_torch_compile(impl, op, inputs):
  import torch  # pylint: disable=import-outside-toplevel
  prepared, eager = _eager(impl, op, inputs)
  fn = impl.function(op)
  compiled = torch.compile(lambda leaves: fn(leaves, prepared.threshold, **prepared.kwargs))
  fresh = _prepared(impl, op, inputs)
  _same(eager, _on_device(impl, fresh, compiled(fresh.leaves), "torch.compile"),
        "torch.compile")


VERIFY = {"jit": verify_jit, "vmap": verify_vmap, "grad": verify_grad,
          "torch.compile": verify_torch_compile}


@pytest.mark.conformance(rule="transform", cases=transform_cases)
def test_declared_transformations_preserve_results(target, check):
  transform, case = target.payload
  inputs = SESSION.inputs(case, target.op)
  check(target, lambda: VERIFY[transform](target.impl, target.op, inputs), inputs)
