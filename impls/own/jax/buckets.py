"""Shape buckets for the XLA graph route: one compilation per bucket of row counts, not per shape.

XLA compiles an executable per exact shape, and on the CPU each one of the exact graph holds
about 85 memory mappings for as long as JAX caches it; a process that clipped a few hundred
systems one at a time (each a new shape) ran past the kernel's mapping limit and died in LLVM.
So a graph compiled on its own (:func:`compiled_alone`) runs on padded copies:

* every leaf's rows (its leading axis) are padded to the next power of two;
* with segments, the pad rows form a system of their own, the last one, with an infinite
  threshold (kept), and the number of systems is padded to the next power of two above the real
  count plus one. No exact sum of a real system changes: a system's bits depend only on its own
  elements (SPEC rule 11, which the graph meets by construction);
* without segments the pad joins the one system, holding values that leave its norm as it is
  (:data:`ZEROS`, :data:`COPIES`), and the graph gets the unpadded element count. Not a second
  system: per-system reductions over a 1-D leaf's rows are scatters, serial on XLA:CPU and
  contended atomics on a GPU, where the one-system graph reduces blocks;
* the outputs are cut back to the real rows and systems.

A graph compiles once per (operation, dtypes, trailing dimensions, row bucket of each leaf,
system bucket), so a relaxation whose batch shrinks from N rows compiles about log2(N) times.

The padding and the cutting back are shape-specific themselves. Concrete leaves on one CPU
device are padded and cut with NumPy (no compilation at all); otherwise (other backends, an
eager ``jax.vmap``) by small jitted functions, one per exact signature, of which only the most
recent :data:`RECENT_SIGNATURES` are kept, so that their executables are freed.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clipbench.impls.own.jax.config import Threshold

# Exact signatures whose pad and trim functions (and so their executables) are kept.
RECENT_SIGNATURES = 64


def bucket(n: int) -> int:
  """The padded size of n: the next power of two (0 stays 0)."""
  return 0 if n <= 0 else 1 << (n - 1).bit_length()


class Trim(NamedTuple):
  """What cuts the padded outputs back: each leaf's real rows (None: a 0-d leaf) and the real
  number of systems."""

  rows: tuple
  num_systems: int


class PaddedCall(NamedTuple):
  """The graph's operands at bucketed shapes."""

  leaves: tuple
  segs: Any  # int32 ids per leaf, the pad rows in system num_systems - 1; None: one system
  counts: Any  # int64 elements per padded system, or None where the ids are traced
  threshold: Threshold
  num_systems: int
  sorted_flags: tuple
  on_host: bool  # padded with NumPy: cut back with NumPy too


def _rows(x) -> int | None:
  return int(x.shape[0]) if x.ndim else None


def _padded_rows(x) -> int:
  return bucket(x.shape[0]) if x.ndim else 1


def _width(x) -> int:
  return math.prod(x.shape[1:]) if x.ndim else 1


def _concrete(*groups) -> bool:
  return not any(isinstance(a, jax.core.Tracer) for group in groups for a in group)


def compiled_alone(*groups) -> bool:
  """Whether the graph will be compiled on its own: every array concrete, or batched by an
  eager ``jax.vmap``. Inside a user's ``jax.jit`` (or any staged trace) the graph is inlined into
  the user's program, which XLA compiles per the user's shapes whatever ours are, so padding
  there would bound nothing and cost a copy of the leaves in and out. Under autodiff the
  transpose of the pad system's gathers would run after the x64 scope has closed, on float64
  cotangents, which fails."""
  pending = [a for group in groups for a in group if isinstance(a, jax.core.Tracer)]
  while pending:
    tracer = pending.pop()
    if type(tracer).__name__ != "BatchTracer":
      return False
    batched = getattr(tracer, "val", None)
    if isinstance(batched, jax.core.Tracer):
      pending.append(batched)
  return True


def _on_one_cpu_device(leaves) -> bool:
  """Whether NumPy can view every leaf in place (a single CPU device; sharded leaves go
  through the jitted path, which keeps their placement)."""
  for x in leaves:
    if isinstance(x, jax.Array):
      devices = x.devices()
      if len(devices) != 1 or next(iter(devices)).platform != "cpu":
        return False
  return True


class Fill(NamedTuple):
  """What the pad rows hold: ``value`` (``None``: copies of the leaf's first row)."""

  value: Any


# A segmented call's pad is a system of its own: ones (zeros would make it tiny).
OWN_SYSTEM = Fill(1)
# Without segments the pad joins the one system, so it must leave its norm as it is: zeros add
# nothing to an exact sum nor to a maximum; for p = +-inf (maximum or minimum |x|, no sum)
# copies of an element already there, which change neither.
ZEROS = Fill(0)
COPIES = Fill(None)


def _host_leaf(x, rows_to: int, fill: Fill) -> Any:
  if not x.ndim or x.shape[0] == rows_to:
    return x
  host = np.asarray(x)
  out = np.empty((rows_to,) + tuple(x.shape[1:]), dtype=x.dtype)
  out[:x.shape[0]] = host
  out[x.shape[0]:] = host[:1] if fill.value is None else fill.value
  return jax.device_put(out)  # a jax.Array like the unpadded leaves: one jit cache entry


def _host_ids(seg, rows_to: int, pad_id: int) -> np.ndarray:
  ids = np.full(rows_to, pad_id, dtype=np.int32)
  ids[:seg.shape[0]] = np.asarray(seg)
  return ids


@functools.lru_cache(maxsize=RECENT_SIGNATURES)
def _device_pad(rows_to: tuple, pad_id: int, fill: Fill, signature: tuple):
  """The jitted padding of one exact signature (leaf and id shapes and dtypes)."""
  del signature  # part of the cache key only: jax.jit specializes on it by itself

  def pad(leaves, segs):
    out_leaves = []
    for x, to in zip(leaves, rows_to):
      if x.ndim and to > x.shape[0]:
        extra = (to - x.shape[0],) + x.shape[1:]
        rows = (jnp.broadcast_to(x[:1], extra) if fill.value is None else
                jnp.full(extra, fill.value, x.dtype))
        x = jnp.concatenate([x, rows])
      out_leaves.append(x)
    out_ids = [jnp.concatenate([ids, jnp.full(to - ids.shape[0], pad_id, jnp.int32)])
               for ids, to in zip(segs, rows_to)]
    return tuple(out_leaves), tuple(out_ids)

  return jax.jit(pad)


@functools.lru_cache(maxsize=RECENT_SIGNATURES)
def _device_trim(trim: Trim, signature: tuple):
  """The jitted cutting back of one exact signature (the padded outputs' shapes and dtypes)."""
  del signature

  def cut(outs, norms):
    return (tuple(o if n is None else o[:n] for o, n in zip(outs, trim.rows)),
            norms[:trim.num_systems])

  return jax.jit(cut)


def _signature(*groups) -> tuple:
  return tuple((tuple(a.shape), np.dtype(a.dtype)) for group in groups for a in group)


def _padded_threshold(threshold: Threshold, num_systems: int) -> Threshold:
  """The real systems' thresholds, then +inf (keep) for the empty and pad systems."""
  extra = num_systems - int(np.shape(threshold.m)[0])
  if not extra:
    return threshold
  parts = []
  for part, fill in zip(threshold, (0.0, 0, True)):
    if _concrete([part]):
      host = np.asarray(part)
      parts.append(np.concatenate([host, np.full(extra, fill, host.dtype)]))
    else:
      parts.append(jnp.concatenate([part, jnp.full(extra, fill, part.dtype)]))
  return Threshold(*parts)


def _padded_counts(leaves, counts, num_systems: int, rows_to) -> np.ndarray:
  """Elements per padded system: the real counts, zeros, then the pad's."""
  out = np.zeros(num_systems, dtype=np.int64)
  out[:len(counts)] = counts
  out[-1] = sum((to - x.shape[0]) * _width(x) for x, to in zip(leaves, rows_to) if x.ndim)
  return out


def pad_call(leaves, segs, counts, num_systems: int, sorted_flags: tuple, threshold: Threshold,
             extreme: bool) -> tuple[PaddedCall, Trim]:
  """The call at bucketed shapes, and how to cut its outputs back. ``segs`` None: one system,
  whose element count then goes to the graph as ``counts``, as it counted the unpadded leaves;
  ``counts`` None: traced ids. ``extreme``: the norm is a maximum or minimum (p = +-inf)."""
  rows_to = tuple(_padded_rows(x) for x in leaves)
  if segs is None:
    fill, padded_systems, flags = (COPIES if extreme else ZEROS), 1, tuple(sorted_flags)
    count = sum(int(np.size(x)) for x in leaves)
    counts = np.array([count], dtype=np.int64)
    trim = Trim(tuple(_rows(x) for x in leaves), 1)
  else:
    fill, padded_systems, flags = OWN_SYSTEM, bucket(num_systems + 1), tuple(sorted_flags)
    if counts is not None:
      counts = _padded_counts(leaves, counts, padded_systems, rows_to)
    trim = Trim(tuple(_rows(x) for x in leaves), num_systems)
  pad_id = padded_systems - 1
  on_host = _concrete(leaves, segs or ()) and _on_one_cpu_device(leaves)
  if on_host:
    padded_leaves = tuple(_host_leaf(x, to, fill) for x, to in zip(leaves, rows_to))
    ids = None if segs is None else tuple(_host_ids(g, to, pad_id)
                                          for g, to in zip(segs, rows_to))
  else:
    pad = _device_pad(rows_to, pad_id, fill, _signature(leaves, segs or ()))
    padded_leaves, ids = pad(tuple(leaves), tuple(segs or ()))
    ids = None if segs is None else ids
  return PaddedCall(padded_leaves, ids, counts, _padded_threshold(threshold, padded_systems),
                    padded_systems, flags, on_host), trim


def trim_outputs(outs, norms, trim: Trim, on_host: bool):
  """The graph's outputs cut back to the real rows and systems."""
  if on_host and _concrete(outs, [norms]):
    host = [o if n is None or o.shape[0] == n else np.asarray(o)[:n]
            for o, n in zip(outs, trim.rows)]
    cut = [i for i, h in enumerate(host) if isinstance(h, np.ndarray)]
    moved = jax.device_put([host[i] for i in cut] + [np.asarray(norms)[:trim.num_systems]])
    for i, array in zip(cut, moved):
      host[i] = array
    return host, moved[-1]
  cut = _device_trim(trim, _signature(outs, [norms]))
  outs, norms = cut(tuple(outs), norms)
  return list(outs), norms
