"""Deliberately broken implementations: the suite must catch each one by a named rule.

Each is the reference with exactly one defect of a kind seen in real libraries, so that a
catch is the suite noticing *that* defect and nothing else. Each class states beside its
defect the rule that must catch it (``caught_by``); ``CAUGHT_BY`` collects them by the name
the suite loads each one as (``test_suite_catches_broken.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from clipbench import reference
from clipbench.protocol import ANY_NORM_TYPE, Capabilities

_CAPS = Capabilities(per_system=True, per_system_max=True, norm_types=ANY_NORM_TYPE,
                     nonfinite=("propagate", "zero"))


class _Broken:
  caught_by: int  # the SPEC rule that must catch this defect
  framework = "numpy"
  capabilities = _CAPS
  description = "deliberately broken"

  def clip_by_global_norm(self, leaves, max_norm, *, segments=None, num_systems=None,
                          norm_type=2.0, nonfinite="propagate"):
    return self.apply("clip_by_global_norm", leaves, max_norm, segments=segments,
                      num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite)

  def clip_by_max_step(self, leaves, max_step, *, segments=None, num_systems=None,
                       nonfinite="propagate"):
    return self.apply("clip_by_max_step", leaves, max_step, segments=segments,
                      num_systems=num_systems, nonfinite=nonfinite)

  def clip_grad_norm(self, leaves, max_norm, *, norm_type=2.0, nonfinite="propagate"):
    out, norms = self.apply("clip_by_global_norm", leaves, max_norm, norm_type=norm_type,
                            nonfinite=nonfinite)
    return out, norms.reshape(())

  def apply(self, op, leaves, threshold, **kw):
    return getattr(reference, op)(leaves, threshold, **kw)


def _norms(op, leaves, kw):
  """The reference's (correctly rounded) norms, float64."""
  _, norms = getattr(reference, op)([x.copy() for x in leaves], math.inf, **kw)
  return np.asarray(norms, np.float64).ravel()


def _per_system(threshold, count):
  t = np.asarray(threshold, np.float64)
  return np.broadcast_to(t, (count,)).copy() if t.ndim == 0 else t.copy()


class EpsilonInNorm(_Broken):
  """Scales by max / (norm + 1e-6), as torch and brainstate do: ties are clipped."""

  caught_by = 3

  def apply(self, op, leaves, threshold, **kw):
    norms = _norms(op, leaves, kw)
    c = _per_system(threshold, norms.size)
    effective = np.where(norms > 0, c * norms / (norms + 1e-6), c)
    return getattr(reference, op)(leaves, effective, **kw)


eps_in_norm = EpsilonInNorm()


class Float16Accumulation(_Broken):
  """Sums squares in the leaf dtype: float16 [300, 400] overflows to an infinite norm."""

  caught_by = 5

  def apply(self, op, leaves, threshold, **kw):
    if not any(x.dtype == np.float16 for x in leaves):
      return getattr(reference, op)(leaves, threshold, **kw)
    total = sum(np.sum(np.square(x), dtype=x.dtype) for x in leaves)
    norm = float(np.sqrt(total))
    out, norms = getattr(reference, op)(leaves, 0.0 if math.isinf(norm) else threshold, **kw)
    return out, np.full_like(norms, norm)


float16_accumulation = Float16Accumulation()


class OffByOneSegment(_Broken):
  """Assigns the last row of each leaf to the next system (a classic off-by-one)."""

  caught_by = 1

  def apply(self, op, leaves, threshold, **kw):
    segments, count = kw.get("segments"), kw.get("num_systems")
    if segments is not None and count and count > 1:
      shifted = []
      for seg in segments:
        seg = np.array(seg, copy=True)
        if seg.size:
          seg[-1] = (seg[-1] + 1) % count
        shifted.append(seg)
      kw = dict(kw, segments=shifted)
    return getattr(reference, op)(leaves, threshold, **kw)


off_by_one_segment = OffByOneSegment()


class OrderDependentReduction(_Broken):
  """Norms from float32 prefix sums over the whole batch: a system's bits depend on the rest."""

  caught_by = 11

  def apply(self, op, leaves, threshold, **kw):
    norms = _norms(op, leaves, kw)
    segments = kw.get("segments")
    if segments is None or not leaves:
      return getattr(reference, op)(leaves, threshold, **kw)
    squares = np.concatenate([np.square(x.astype(np.float32)).reshape(x.shape[0], -1).sum(
        axis=1) for x in leaves])
    ids = np.concatenate(segments)
    prefix = np.cumsum(squares, dtype=np.float32)
    drifted = norms.copy()
    for k in range(norms.size):
      rows = np.flatnonzero(ids == k)
      if rows.size:
        before = prefix[rows[0] - 1] if rows[0] else np.float32(0)
        approx = float(np.sqrt(max(np.float32(prefix[rows[-1]] - before), 0)))
        drifted[k] = approx if approx > 0 else norms[k]
    c = _per_system(threshold, norms.size)
    effective = np.where(drifted > 0, c * norms / np.maximum(drifted, 1e-300), c)
    out, _ = getattr(reference, op)(leaves, effective, **kw)
    return out, drifted.astype(np.float32)


order_dependent_reduction = OrderDependentReduction()


class TieClipped(_Broken):
  """Clips when norm >= max: a system exactly at the threshold is changed."""

  caught_by = 3

  def apply(self, op, leaves, threshold, **kw):
    t = np.asarray(threshold, np.float64)
    below = np.where(t > 0, np.nextafter(t, 0.0), t)
    if t.ndim == 0:
      below = float(below)
    return getattr(reference, op)(leaves, below, **kw)


tie_clipped = TieClipped()


class MutatesInput(_Broken):
  """Writes its result into the input leaves without declaring itself in-place."""

  caught_by = 12

  def apply(self, op, leaves, threshold, **kw):
    out, norms = getattr(reference, op)(leaves, threshold, **kw)
    for x, y in zip(leaves, out):
      x[...] = y
    return out, norms


mutates_input = MutatesInput()


class WrongP(_Broken):
  """Ignores norm_type and always takes the L2 norm."""

  caught_by = 10

  def apply(self, op, leaves, threshold, **kw):
    kw = {k: v for k, v in kw.items() if k != "norm_type"}
    return getattr(reference, op)(leaves, threshold, **kw)


wrong_p = WrongP()


class NonfiniteLeaks(_Broken):
  """A NaN or inf anywhere makes every system NaN (one norm for the whole batch)."""

  caught_by = 7

  def apply(self, op, leaves, threshold, **kw):
    out, norms = getattr(reference, op)(leaves, threshold, **kw)
    if any(not np.isfinite(x.astype(np.float64)).all() for x in leaves):
      out = [np.full_like(y, np.nan) for y in out]
      norms = np.full_like(norms, np.nan)
    return out, norms


nonfinite_leaks = NonfiniteLeaks()


class RoundToNearest(_Broken):
  """Exact norm, but x * (max/norm) rounded to nearest: overshoots the strict bound."""

  caught_by = 4

  def apply(self, op, leaves, threshold, **kw):
    out, norms = getattr(reference, op)(leaves, threshold, **kw)
    exact = _norms(op, leaves, kw)
    c = _per_system(threshold, exact.size)
    segments = kw.get("segments") or [np.zeros(x.shape[0] if x.ndim else 1, int) for x in leaves]
    result = []
    for x, y, seg in zip(leaves, out, segments):
      y = y.copy()
      for k in np.unique(seg):
        rows = seg == k
        if x.ndim and exact[k] > c[k] and np.isfinite(exact[k]):
          y[rows] = (x[rows].astype(np.float64) * (c[k] / exact[k])).astype(x.dtype)
      result.append(y)
    return result, norms


round_to_nearest = RoundToNearest()


class UpcastsFloat16(_Broken):
  """Returns float16 leaves as float32 (as kups and brainstate do for mixed trees)."""

  caught_by = 9

  def apply(self, op, leaves, threshold, **kw):
    out, norms = getattr(reference, op)(leaves, threshold, **kw)
    return [y.astype(np.float32) if y.dtype == np.float16 else y for y in out], norms


upcasts_float16 = UpcastsFloat16()


class AcceptsNegativeMax(_Broken):
  """No validation of the threshold: a negative max flips the sign of the output."""

  caught_by = 6

  def apply(self, op, leaves, threshold, **kw):
    t = np.asarray(threshold, np.float64)
    if np.any(t < 0) or np.any(np.isnan(t)):
      return [-x for x in leaves], _norms(op, leaves, kw)
    return getattr(reference, op)(leaves, threshold, **kw)


accepts_negative_max = AcceptsNegativeMax()


class FlushesSubnormals(_Broken):
  """Multiplies by 1.0 on a flush-to-zero path: subnormal outputs become 0."""

  caught_by = 3

  def apply(self, op, leaves, threshold, **kw):
    out, norms = getattr(reference, op)(leaves, threshold, **kw)
    flushed = []
    for y in out:
      tiny = np.finfo(y.dtype).tiny if y.dtype.kind == "f" and y.dtype.name != "bfloat16" else (
          np.float32(np.finfo(np.float32).tiny))
      y = y.copy()
      y[np.abs(y.astype(np.float64)) < float(tiny)] = 0
      flushed.append(y)
    return flushed, norms


flushes_subnormals = FlushesSubnormals()


class RaisesForEmpty(_Broken):
  """reduce() over no leaves, as kups does: an empty tree raises TypeError."""

  caught_by = 8

  def apply(self, op, leaves, threshold, **kw):
    if not leaves or all(x.size == 0 for x in leaves):
      raise TypeError("reduce() of empty iterable with no initial value")
    return getattr(reference, op)(leaves, threshold, **kw)


raises_for_empty = RaisesForEmpty()


class PerShardNorm(_Broken):
  """Clips each shard by the norm of its own rows (a norm read from the local shard, as
  DTensor norms did in pytorch/pytorch#170862): exact on one device, wrong when sharded."""

  caught_by = 14
  framework = "jax"
  # Called eagerly (no "jit"): it reads each leaf's placement from the concrete jax.Array.
  capabilities = dataclasses.replace(_CAPS, dtypes=("float16", "bfloat16", "float32"))

  def apply(self, op, leaves, threshold, **kw):
    import jax  # pylint: disable=import-outside-toplevel
    segments = kw.get("segments")
    host = dict(kw, segments=None if segments is None else [np.asarray(s) for s in segments])
    values = [np.asarray(x) for x in leaves]
    devices = sorted({d for x in leaves for d in x.sharding.device_set}, key=lambda d: d.id)
    if len(devices) < 2:
      out, norms = getattr(reference, op)(values, threshold, **host)
      return [jax.numpy.asarray(y) for y in out], jax.numpy.asarray(norms)
    out = [np.empty_like(x) for x in values]
    norms = None
    for device in reversed(devices):  # the first device's rows and norm are written last
      local = [_local_rows(x, device) for x in leaves]
      local_kw = dict(host, segments=None if segments is None else [
          s[rows] for s, rows in zip(host["segments"], local)])
      part, part_norms = getattr(reference, op)([x[rows] for x, rows in zip(values, local)],
                                                threshold, **local_kw)
      for y, piece, rows in zip(out, part, local):
        y[rows] = piece
      norms = part_norms
    return [jax.numpy.asarray(y) for y in out], jax.numpy.asarray(norms)


def _local_rows(x, device) -> slice:
  """The rows of ``x`` that ``device`` holds (none when it holds no shard of ``x``)."""
  for shard in x.addressable_shards:
    if shard.device == device:
      return shard.index[0] if x.ndim else slice(None)
  return slice(0, 0)


per_shard_norm = PerShardNorm()


def _reference_on_arrays(op, leaves, threshold, kw):
  """The reference's result for framework arrays (leaves and segments), in numpy."""
  from clipbench.impls import frameworks  # pylint: disable=import-outside-toplevel
  host = dict(kw, segments=None if kw.get("segments") is None else [
      frameworks.to_numpy(g) for g in kw["segments"]])
  return getattr(reference, op)([frameworks.to_numpy(x) for x in leaves], threshold, **host)


class DonatesInputs(_Broken):
  """Right outputs, but the caller's arrays are gone afterwards: deleted, as a jitted step with
  ``donate_argnums`` leaves them (XLA moves their buffers into the outputs)."""

  caught_by = 12
  framework = "jax"
  capabilities = dataclasses.replace(_CAPS, dtypes=("float16", "bfloat16", "float32"))

  def apply(self, op, leaves, threshold, **kw):
    import jax  # pylint: disable=import-outside-toplevel
    out, norms = _reference_on_arrays(op, leaves, threshold, kw)
    placed = [jax.device_put(jax.numpy.asarray(y), x.sharding) for x, y in zip(leaves, out)]
    norms = jax.numpy.asarray(norms)
    if leaves:
      norms = jax.device_put(norms, leaves[0].sharding)
    for x in leaves:
      x.delete()
    return placed, norms


donates_inputs = DonatesInputs()


class MovesInputs(_Broken):
  """Right outputs where the inputs were, but the caller's tensors moved to the host
  afterwards (``x.data = x.data.cpu()``, as a careless offload does). Only a run on a GPU shows
  it (a host tensor has no other device to go to): see :data:`CAUGHT_ON_SEVERAL_DEVICES`."""

  caught_by = 12
  framework = "torch"

  def apply(self, op, leaves, threshold, **kw):
    from clipbench.impls import frameworks  # pylint: disable=import-outside-toplevel
    out, norms = _reference_on_arrays(op, leaves, threshold, kw)
    device = str(leaves[0].device) if leaves else "cpu"
    placed = [frameworks.to_framework(y, "torch", str(x.device)) for x, y in zip(leaves, out)]
    for x in leaves:
      x.data = x.data.cpu()
    return placed, frameworks.to_framework(np.asarray(norms), "torch", device)


moves_inputs = MovesInputs()


class ReturnsOnAnotherDevice(_Broken):
  """Returns right outputs on another device than its inputs' (as a ``jax.device_put(out,
  jax.devices()[0])`` before returning does, wherever the caller placed the inputs).

  Only a process with several devices can show it, so it is not in :data:`CAUGHT_BY` (whose
  implementations the suite must catch in any process): see :data:`CAUGHT_ON_SEVERAL_DEVICES`.
  """

  caught_by = 12
  framework = "jax"
  capabilities = dataclasses.replace(_CAPS, dtypes=("float16", "bfloat16", "float32"))

  def apply(self, op, leaves, threshold, **kw):
    import jax  # pylint: disable=import-outside-toplevel
    out, norms = _reference_on_arrays(op, leaves, threshold, kw)
    given = {d for x in leaves for d in x.devices()}
    other = next((d for d in jax.devices("cpu") + jax.devices() if d not in given),
                 jax.devices()[0])
    return ([jax.device_put(jax.numpy.asarray(y), other) for y in out],
            jax.device_put(jax.numpy.asarray(norms), other))


returns_on_another_device = ReturnsOnAnotherDevice()

# Defects the suite can only see where there are several devices, by the name the suite loads
# each one as: conformance/tests runs the JAX one with two JAX host devices (--device cpu:1),
# the torch one where there is a GPU (--device cuda).
CAUGHT_ON_SEVERAL_DEVICES = {"returns_on_another_device": 12, "moves_inputs": 12}

# The rule that must catch each one, by the name the suite loads it as.
CAUGHT_BY = {name: impl.caught_by for name, impl in list(globals().items())
             if isinstance(impl, _Broken) and name not in CAUGHT_ON_SEVERAL_DEVICES}
