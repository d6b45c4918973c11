"""The public operations: host-side checks, then the jitted core under a scoped x64."""

from __future__ import annotations

import functools
import math
import types
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from clipbench.impls.own import exact, validation
from clipbench.impls.own.jax.config import Config, Threshold
from clipbench.impls.own.jax.formats import FLOAT64, decode
from clipbench.impls.own.jax import buckets, host_route
from clipbench.impls.own.jax.gradient import clip_jit
from clipbench.protocol import ANY_NORM_TYPE, DTYPES, Capabilities

framework = "jax"
version = jax.__version__
description = ("numba kernels through XLA FFI on the CPU (inside jax.jit), an exact XLA graph "
               "elsewhere; exact decisions")
X64 = bool(jax.config.jax_enable_x64)
capabilities = Capabilities(
    per_system=True, per_system_max=True, norm_types=ANY_NORM_TYPE,
    dtypes=DTYPES if X64 else tuple(d for d in DTYPES if d != "float64"),
    nonfinite=("propagate", "zero"), returns_norm=True, in_place=False,
    transforms=("jit", "vmap", "grad"), devices=("cpu",), mixed_dtypes=True)


class SystemLayout(NamedTuple):
  """How the checked leaves' rows map to systems."""

  segs: Any  # tuple of int32 id arrays, or None (one system)
  counts: Any  # int64 elements per system when every id array is concrete, else None
  num_systems: int
  sorted_flags: tuple  # per leaf: its ids are sorted


ONE_SYSTEM = SystemLayout(None, None, 1, ())


def _is_array(a) -> bool:
  return hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, (bool, int, float))


def _concrete(a) -> bool:
  return not isinstance(a, jax.core.Tracer)


def check_leaves_and_segments(leaves, segments, num_systems,
                              per_system: bool) -> tuple[list, SystemLayout]:
  """Rules 9 and 13 on what is concrete (under tracing the value checks on ids are skipped)."""
  leaves = validation.check_leaves(leaves, _is_array)
  leaves = [jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in leaves]
  if not per_system:
    return leaves, ONE_SYSTEM
  count = validation.check_num_systems(segments, num_systems, len(leaves))
  if count is None:
    return leaves, ONE_SYSTEM
  segs, flags = [], []
  counts = np.zeros(count, dtype=np.int64)
  for i, (leaf, seg) in enumerate(zip(leaves, segments)):
    if not _is_array(seg):
      seg = np.asarray(seg)
    validation.check_segment(i, tuple(leaf.shape), tuple(seg.shape), seg.dtype)
    is_sorted = False
    if _concrete(seg):
      host = np.asarray(seg)
      if host.size:
        lo, hi = int(host.min()), int(host.max())
        validation.check_segment_range(i, lo, hi, count, host if (lo < 0 or hi >= count)
                                       else None)
        is_sorted = bool(np.all(host[1:] >= host[:-1]))
        if counts is not None:
          width = math.prod(leaf.shape[1:])
          counts += np.bincount(host, minlength=count)[:count] * width
      else:
        is_sorted = True
    else:
      counts = None  # traced ids: counted in the graph
    segs.append(jnp.asarray(seg).astype(jnp.int32) if seg.dtype != jnp.int32 else
                jnp.asarray(seg))
    flags.append(is_sorted)
  return leaves, SystemLayout(tuple(segs), counts, count, tuple(flags))


def exact_threshold(value, name: str, count: int | None) -> Threshold:
  """Rule 6, then the per-system threshold as exact frexp parts (numpy); a traced threshold
  is taken as max(c, 0) (jax, under x64)."""
  s = 1 if count is None else count
  if isinstance(value, jax.core.Tracer):
    with jax.enable_x64(True):
      c = jnp.broadcast_to(jnp.asarray(value, jnp.float64), (s,))
      c = jnp.where(jnp.isnan(c) | (c < 0), 0.0, c)
      c_inf = jnp.isinf(c)
      dec = decode(c, FLOAT64)
      return Threshold(jnp.where(dec.zero | c_inf, 0.0, dec.frac * 0.5),
                       jnp.where(dec.zero, 0, dec.e + 1), c_inf)
  if _is_array(value) and not isinstance(value, np.ndarray):
    value = np.asarray(value)
  c = validation.check_threshold(value, name, count)
  c = np.broadcast_to(np.asarray(c, dtype=np.float64), (s,))
  return Threshold(*exact.exact_frexp(c))


def _host_route() -> bool:
  """The numba kernels serve the call (:mod:`.host_route`): when JAX computes on the CPU."""
  return jax.default_backend() == "cpu"


def _run(op: str, api_op: str, leaves, layout: SystemLayout, threshold: Threshold, p: float,
         nonfinite: str, route: str):
  dtypes = tuple(np.dtype(x.dtype) for x in leaves)
  precise = any(d == np.float64 for d in dtypes)
  host = route == "host" or (route == "auto" and _host_route())
  if host and host_route.is_concrete(leaves, layout.segs or (), tuple(threshold)):
    return host_route.eager(api_op, p, nonfinite, layout.num_systems, leaves, layout.segs,
                            threshold)
  if host or not buckets.compiled_alone(leaves, layout.segs or (), tuple(threshold)):
    # The host route's custom call costs no compilation per shape; inside a staged trace the
    # user's compilation holds the graph (buckets.compiled_alone).
    cfg = Config(op, float(p), nonfinite == "zero", int(layout.num_systems),
                 tuple(layout.sorted_flags), precise, dtypes, host, api_op, nonfinite)
    with jax.enable_x64(True):
      outs, norms = clip_jit(cfg, tuple(leaves), layout.segs, _device_counts(layout.counts),
                             _device_threshold(threshold))
    return list(outs), norms
  with jax.enable_x64(True):
    padded, trim = buckets.pad_call(leaves, layout.segs, layout.counts, layout.num_systems,
                                    layout.sorted_flags, threshold,
                                    op == "norm" and math.isinf(p))
    cfg = Config(op, float(p), nonfinite == "zero", padded.num_systems, padded.sorted_flags,
                 precise, dtypes, False, api_op, nonfinite, _spans_devices(leaves))
    outs, norms = clip_jit(cfg, padded.leaves, padded.segs, _device_counts(padded.counts),
                           _device_threshold(padded.threshold))
    return buckets.trim_outputs(outs, norms, trim, padded.on_host)


def _spans_devices(leaves) -> bool:
  """Whether some leaf of a call compiled alone may lie on several devices (a leaf batched by
  an eager ``jax.vmap`` is looked at through its batch tracer)."""
  for x in leaves:
    while isinstance(x, jax.core.Tracer):
      x = getattr(x, "val", None)
      if x is None:
        return True
    sharding = getattr(x, "sharding", None)
    if sharding is not None and len(sharding.device_set) > 1:
      return True
  return False


def _device_threshold(threshold: Threshold) -> Threshold:
  """The threshold's parts as the graph takes them (call under x64)."""
  return Threshold(jnp.asarray(threshold.m, jnp.float64), jnp.asarray(threshold.e, jnp.int32),
                   jnp.asarray(threshold.inf, bool))


def _device_counts(counts):
  return None if counts is None else jnp.asarray(counts, jnp.int64)


def clip_by_global_norm(leaves: Sequence[Any], max_norm: Any, *, segments: Any = None,
                        num_systems: Any = None, norm_type: Any = 2.0,
                        nonfinite: str = "propagate", route: str = "auto"):
  """Per-system p-norm clipping: each system's leaves are scaled so that its p-norm is at most
  max_norm; returns the leaves and the per-system norms. ``route``: "auto" (the numba kernels
  on the CPU, the XLA graph elsewhere), "host" or "graph"."""
  leaves, layout = check_leaves_and_segments(leaves, segments, num_systems, True)
  threshold = exact_threshold(max_norm, "max_norm", layout.num_systems)
  p = validation.check_norm_type(norm_type)
  nonfinite = validation.check_nonfinite(nonfinite)
  return _run("norm", "clip_by_global_norm", leaves, layout, threshold, p, nonfinite, route)


def clip_by_max_step(leaves: Sequence[Any], max_step: Any, *, segments: Any = None,
                     num_systems: Any = None, nonfinite: str = "propagate",
                     route: str = "auto"):
  """Per-system max-step clipping: the largest last-axis vector norm is at most max_step;
  returns the leaves and the per-system step norms."""
  leaves, layout = check_leaves_and_segments(leaves, segments, num_systems, True)
  threshold = exact_threshold(max_step, "max_step", layout.num_systems)
  nonfinite = validation.check_nonfinite(nonfinite)
  return _run("step", "clip_by_max_step", leaves, layout, threshold, 2.0, nonfinite, route)


def clip_grad_norm(leaves: Sequence[Any], max_norm: Any, *, norm_type: Any = 2.0,
                   nonfinite: str = "propagate", route: str = "auto"):
  """Global p-norm clipping of all leaves together; returns the leaves and the 0-d norm."""
  leaves, layout = check_leaves_and_segments(leaves, None, None, False)
  threshold = exact_threshold(max_norm, "max_norm", None)
  p = validation.check_norm_type(norm_type)
  nonfinite = validation.check_nonfinite(nonfinite)
  outs, norms = _run("norm", "clip_grad_norm", leaves, layout, threshold, p, nonfinite, route)
  return outs, norms.reshape(())


def _registry_object(route: str, what: str) -> types.SimpleNamespace:
  return types.SimpleNamespace(
      framework=framework, version=version, description=what, capabilities=capabilities,
      clip_by_global_norm=functools.partial(clip_by_global_norm, route=route),
      clip_by_max_step=functools.partial(clip_by_max_step, route=route),
      clip_grad_norm=functools.partial(clip_grad_norm, route=route))


# The registry objects: ``clipbench.impls.own.jax:implementation`` (the numba kernels through
# XLA FFI on the CPU) and ``:xla_graph`` (the XLA graph that other backends run, kept under
# test on the CPU).
implementation = _registry_object("auto", description)
xla_graph = _registry_object("graph", "the XLA graph route on every backend (GPU's route)")
