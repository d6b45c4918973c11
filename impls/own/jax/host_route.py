"""The CPU route: the numba kernels, called directly on concrete arrays and through an XLA FFI
custom call inside a traced graph (``jax.jit``, ``jax.vmap``, ``jax.grad``).

Why: on the CPU the numba kernels run at the memory roofline, and an XLA graph of the same
exact arithmetic does not come near it (multi-output reductions of float64 work, scatters and
gathers are slow on XLA:CPU, and the exact sums take several passes; ``docs/cpu-kernels.md``).
A graph also costs a compilation per shape: about a hundred memory mappings each, which is what
killed long relaxations whose batch shrinks as systems converge. On this route:

* a call on concrete arrays compiles nothing: the leaves are read in place (``np.asarray`` of a
  CPU ``jax.Array`` is a view) and the outputs handed back as ``jax.Array`` (one copy);
* a traced call becomes one custom call whose results XLA allocates and the kernels fill
  (:mod:`.xla_ffi`), so inside a user's ``jax.jit`` clipping costs what the kernels cost;
* the bits are the numba kernels' (exact decisions, batch-invariant by their fixed block
  order), the same whether the call is traced or not. A sharded call is partitioned (each
  device clips its rows from exchanged block results: :mod:`.partitioned` without segments,
  :mod:`.partitioned_segments` with them); elsewhere XLA's SPMD partitioner, which does not
  partition a custom call without a rule, gathers the operands and every device runs the
  whole call. Either way sharded and unsharded
  calls give the same bits (SPEC rule 14).

Other backends keep the XLA graph (:mod:`.forward`), which is also registered on the CPU as
``clipbench.jax-xla`` so that it stays under test.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clipbench.impls.own.jax import xla_ffi
from clipbench.impls.own.jax.config import Threshold
from clipbench.impls.own.numba import api as numba_api
from clipbench.impls.own.numba.buffers import LeavesAt, array_at, writing_into

TARGET = "clipbench_numba_clip"


class CallSpec(NamedTuple):
  """What a traced call fixes: the operation and every operand's shape and dtype."""

  op: str  # "clip_grad_norm", "clip_by_global_norm" or "clip_by_max_step"
  p: float
  nonfinite: str
  num_systems: int
  leaf_shapes: tuple
  leaf_dtypes: tuple  # numpy dtypes
  segment_shapes: tuple
  has_segments: bool  # a per-system call with ids (possibly of no leaves): else one system
  threshold_size: int
  norms_dtype: np.dtype


_SPECS: list[CallSpec] = []
_KEYS: dict[CallSpec, int] = {}
_SPECS_LOCK = threading.Lock()


def _key(spec: CallSpec) -> int:
  with _SPECS_LOCK:
    if spec not in _KEYS:
      _KEYS[spec] = len(_SPECS)
      _SPECS.append(spec)
    return _KEYS[spec]


def threshold_values(m: np.ndarray, e: np.ndarray, inf: np.ndarray) -> np.ndarray:
  """c = m * 2**e exactly (numpy's ldexp keeps subnormals), +inf where flagged."""
  c = np.ldexp(np.asarray(m, np.float64), np.asarray(e, np.int64))
  return np.where(np.asarray(inf, bool), np.inf, c)


def run_kernels(spec: CallSpec, leaves: list[np.ndarray] | LeavesAt,
                segments: list[np.ndarray] | None,
                c: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
  """The numba kernels on host arrays (outputs into an enclosing ``writing_into``). Global
  clipping of XLA's buffers (``LeavesAt``, checked when the call was traced) goes straight
  to the general route, which reads their addresses: no array is made per leaf."""
  if spec.op == "clip_grad_norm":
    if isinstance(leaves, LeavesAt):
      return numba_api.clip_grad_norm_at(leaves, c.reshape(()), spec.p, spec.nonfinite)
    return numba_api.clip_grad_norm(leaves, c.reshape(()), norm_type=spec.p,
                                    nonfinite=spec.nonfinite)
  if isinstance(leaves, LeavesAt):
    leaves = list(leaves)
  # No segments: one system, which the kernels take as segments=None and a scalar threshold.
  ids, count = (segments, spec.num_systems) if spec.has_segments else (None, None)
  threshold = c if spec.has_segments else c.reshape(-1)[0]
  if spec.op == "clip_by_max_step":
    return numba_api.clip_by_max_step(leaves, threshold, segments=ids, num_systems=count,
                                      nonfinite=spec.nonfinite)
  return numba_api.clip_by_global_norm(leaves, threshold, segments=ids, num_systems=count,
                                       norm_type=spec.p, nonfinite=spec.nonfinite)


def _execute(key: int, args: np.ndarray, rets: np.ndarray) -> None:
  """The FFI body: operands (leaves, segments, threshold parts) in place, results filled."""
  spec = _SPECS[key]
  nl, ns = len(spec.leaf_shapes), len(spec.segment_shapes)
  leaves = LeavesAt(args[:nl], spec.leaf_shapes, spec.leaf_dtypes, True)
  segments = [array_at(int(a), s, np.dtype(np.int32), True)
              for a, s in zip(args[nl:nl + ns], spec.segment_shapes)]
  t = spec.threshold_size
  m, e, inf = (array_at(int(a), (t,), np.dtype(d), True)
               for a, d in zip(args[nl + ns:nl + ns + 3], (np.float64, np.int32, np.bool_)))
  c = threshold_values(m, e, inf)
  # A traced threshold was never checked: as on the graph route, NaN or negative means 0.
  c = np.where(np.isnan(c) | (c < 0), 0.0, c)
  with writing_into(LeavesAt(rets[:nl], spec.leaf_shapes, spec.leaf_dtypes, False)):
    _, norms = run_kernels(spec, leaves, segments, c)
  norms_out = array_at(int(rets[nl]), (spec.num_systems,), spec.norms_dtype, False)
  norms_out[...] = np.asarray(norms).reshape(-1)


def call_spec(op: str, p: float, nonfinite: str, num_systems: int, leaves, segments,
              threshold: Threshold) -> CallSpec:
  """The :class:`CallSpec` of a traced call."""
  precise = any(np.dtype(x.dtype) == np.float64 for x in leaves)
  return CallSpec(op, float(p), nonfinite, int(num_systems),
                  tuple(tuple(int(d) for d in x.shape) for x in leaves),
                  tuple(np.dtype(x.dtype) for x in leaves),
                  tuple(tuple(int(d) for d in g.shape) for g in segments or ()),
                  segments is not None, int(np.size(threshold.m)),
                  np.dtype(np.float64 if precise else np.float32))


def threshold_operands(threshold: Threshold) -> tuple:
  """The threshold's parts as the custom call takes them (call under x64)."""
  return (jnp.asarray(threshold.m, jnp.float64).reshape(-1),
          jnp.asarray(threshold.e, jnp.int32).reshape(-1),
          jnp.asarray(threshold.inf, bool).reshape(-1))


def whole_call(spec: CallSpec, leaves, segments, m, e, inf):
  """(outputs, per-system norms) as one custom call on whole operands (traceable)."""
  xla_ffi.register(TARGET, _execute)
  results = [jax.ShapeDtypeStruct(s, d) for s, d in zip(spec.leaf_shapes, spec.leaf_dtypes)]
  results.append(jax.ShapeDtypeStruct((spec.num_systems,), spec.norms_dtype))
  call = jax.ffi.ffi_call(TARGET, results, vmap_method="sequential")
  out = call(jnp.asarray(_key(spec), jnp.int32), *leaves, *(segments or ()), m, e, inf)
  return tuple(out[:-1]), out[-1]


def traced(op: str, p: float, nonfinite: str, num_systems: int, leaves, segments,
           threshold: Threshold):
  """(outputs, per-system norms) as one custom call (traceable; call under x64)."""
  spec = call_spec(op, p, nonfinite, num_systems, leaves, segments, threshold)
  return whole_call(spec, leaves, segments, *threshold_operands(threshold))


def eager(op: str, p: float, nonfinite: str, num_systems: int, leaves, segments,
          threshold: Threshold):
  """(outputs, per-system norms) of concrete arrays: the kernels on host views, no graph."""
  precise = any(x.dtype == np.float64 for x in leaves)
  spec = CallSpec(op, float(p), nonfinite, int(num_systems), (), (), (), segments is not None,
                  0, np.dtype(np.float64 if precise else np.float32))
  host = [np.asarray(x) for x in leaves]
  segs = None if segments is None else [np.asarray(g) for g in segments]
  c = threshold_values(threshold.m, threshold.e, threshold.inf).reshape(-1)
  outs, norms = run_kernels(spec, host, segs, c)
  norms = np.asarray(norms, dtype=spec.norms_dtype).reshape(-1)
  return list(jax.device_put(list(outs))), jnp.asarray(norms)


def is_concrete(*arrays: Any) -> bool:
  """No tracer among the arrays (an eager call)."""
  tracer = jax.core.Tracer
  return not any(isinstance(a, tracer) for group in arrays for a in group)
