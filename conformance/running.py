"""Calling implementations and the reference on a case, with the session's caches.

The reference is exact and slow, so its result for a (case, op) is computed once per session
and shared by every implementation. An implementation's own result for a (case, op) is also
cached: several rules inspect the same call.

Every call runs on the session's device (``--device``, :func:`set_device`): the inputs are
built on the host, moved to the device in the implementation's framework (:func:`prepare`),
and the outputs checked to be there (:func:`misplaced`) before they come back for the rule
checks, which read numpy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import traceback
from typing import Any, Callable, Iterator

import numpy as np

from clipbench import devices, reference
from clipbench.conformance.cases import Inputs
from clipbench.impls import calling, frameworks
from clipbench.impls.registry import Implementation


@dataclasses.dataclass
class Outcome:
  """What one call did: its outputs (numpy), or the exception it raised."""

  leaves: list[np.ndarray] | None = None
  norms: np.ndarray | None = None
  error: BaseException | None = None
  error_trace: str = ""
  mutated: list[int] = dataclasses.field(default_factory=list)  # indices of modified leaves
  # An output left off the session's device, or an input moved off it, in words ("": none).
  misplaced: str = ""

  def raise_if_error(self) -> None:
    if isinstance(self.error, CallTimeout):
      raise self.error
    if self.error is not None:
      raise AssertionError(
          f"raised {type(self.error).__name__}: {self.error}\n{self.error_trace}")


class CallTimeout(AssertionError):
  """A call of the implementation did not return within the session's ``--timeout``."""


# Seconds one call of an implementation may take (None: no limit), set by the pytest plugin.
# A call that runs longer is abandoned in its worker thread: Python cannot kill a thread, so
# it may go on computing in the background, but the suite records the stuck case and moves on.
_call_timeout: float | None = None


def set_call_timeout(seconds: float | None) -> None:
  """Limits every later call of an implementation to ``seconds`` (None or 0: no limit)."""
  global _call_timeout
  if seconds is not None and (not isinstance(seconds, (int, float)) or seconds < 0):
    raise ValueError(f"timeout: expected seconds >= 0 or None, got {seconds!r}")
  _call_timeout = seconds or None


def within_timeout(fn: Callable[[], Any], what: str) -> Any:
  """Runs ``fn()`` and returns its result; raises :class:`CallTimeout` naming ``what`` when
  it has not returned within the session's timeout (the call itself is left running)."""
  if _call_timeout is None:
    return fn()
  box: dict[str, Any] = {}

  def target():
    try:
      box["result"] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      box["error"] = e

  worker = threading.Thread(target=target, name=f"clipbench call: {what}", daemon=True)
  worker.start()
  worker.join(_call_timeout)
  if worker.is_alive():
    raise CallTimeout(f"{what}: no result within --timeout {_call_timeout:g} s (the call was "
                      "abandoned, still running)")
  if "error" in box:
    raise box["error"]
  return box["result"]


# The device every call of an implementation runs on (``--device``), set by the pytest plugin.
_device: devices.Device = devices.HOST


def set_device(device: devices.Device | str) -> None:
  """Runs every later call of an implementation on ``device`` (``cpu[:N]``, ``cuda[:N]``)."""
  global _device
  _device = devices.parse(device)


def device() -> devices.Device:
  """The device the calls of this session run on."""
  return _device


@contextlib.contextmanager
def on_device(target: devices.Device | str) -> Iterator[devices.Device]:
  """Runs the calls made within on ``target``, then returns to the session's device."""
  before = _device
  set_device(target)
  try:
    yield _device
  finally:
    set_device(before)


def prepare(impl: Implementation, op: str, leaves: list[np.ndarray], threshold: Any,
            **kwargs: Any) -> calling.Prepared:
  """The arguments of one call in ``impl``'s framework: built on the host, then moved to the
  session's device, leaves and segments alike (the threshold stays a Python float or a numpy
  array, as the calling convention has it).

  Raises:
    devices.DeviceUnavailable: the framework cannot reach the device.
  """
  prepared = calling.prepare(impl, op, leaves, threshold, **kwargs)
  moved = dict(prepared.kwargs)
  if moved.get("segments") is not None:
    moved["segments"] = [devices.put(s, _device, impl.framework) for s in moved["segments"]]
  return dataclasses.replace(
      prepared, leaves=[devices.put(x, _device, impl.framework) for x in prepared.leaves],
      kwargs=moved)


def misplaced(impl: Implementation, prepared: calling.Prepared, result: Any) -> str:
  """The first array the call left off the session's device, in words ("" when none): an
  output leaf or norm elsewhere, or an input leaf moved away.

  A call with no array among its leaves (no leaves at all) is told no device, so its norms
  may rightly come back on the framework's default one.
  """
  framework, here = impl.framework, str(_device)
  out, norms = result
  named = [(f"leaves[{i}]", y) for i, y in enumerate(out)] if isinstance(out, (list, tuple)) \
      else []
  if prepared.leaves:
    named.append(("the norms", norms))
  for name, y in named:
    found = devices.where(y, framework)
    if found is not None and found != here:
      return f"returned {name} on {found}, not on {here} where its inputs were"
  for i, x in enumerate(prepared.leaves):
    found = devices.where(x, framework)
    if found == devices.DELETED:
      return f"deleted its input leaves[{i}] (donated it to a computation?)"
    if found is not None and found != here:
      return f"moved its input leaves[{i}] from {here} to {found}"
  return ""


def not_applicable(impl: Implementation, op: str, inputs: Inputs) -> str | None:
  """Why a case lies outside what ``impl`` declares (None when it applies)."""
  caps = impl.capabilities
  if op not in impl.ops:
    return f"does not provide {op}"
  if inputs.per_system and op != "clip_grad_norm" and not caps.per_system:
    return "not per-system"
  if isinstance(inputs.threshold, np.ndarray) and not caps.per_system_max:
    return "no per-system thresholds"
  if op != "clip_by_max_step" and not caps.supports_norm_type(inputs.norm_type):
    return "L2 only" if tuple(caps.norm_types) == (2.0,) else (
        f"norm_type={inputs.norm_type:g} not supported")
  missing = sorted(inputs.dtypes - set(caps.dtypes))
  if missing:
    return f"{', '.join(missing)} not supported"
  if len(inputs.dtypes) > 1 and not caps.mixed_dtypes:
    return "mixed dtypes not supported"
  # With finite input the two non-finite modes agree, so only a case that holds non-finite
  # values (or asks for "zero") needs the mode declared.
  has_nonfinite = any(not np.isfinite(x.astype(np.float64)).all() for x in inputs.leaves)
  if (has_nonfinite or inputs.nonfinite != "propagate") and inputs.nonfinite not in caps.nonfinite:
    return f"nonfinite={inputs.nonfinite!r} not supported"
  return None


def call(impl: Implementation, op: str, inputs: Inputs) -> Outcome:
  """Calls ``impl`` on a copy of ``inputs`` on the session's device; records errors, modified
  inputs and arrays off the device."""
  kw = inputs.kwargs(op)
  if op == "clip_grad_norm":
    kw.pop("segments", None), kw.pop("num_systems", None)
  try:
    prepared = prepare(impl, op, inputs.leaves, inputs.threshold, **kw)
  except Exception as e:  # pylint: disable=broad-except
    return Outcome(error=e, error_trace=traceback.format_exc(limit=-3))
  originals = [x.copy() for x in inputs.leaves]
  try:
    result = within_timeout(lambda: calling.run(impl, prepared), f"impl {impl.name}: {op}")
    if not isinstance(result, (tuple, list)) or len(result) != 2:
      # Blame the return convention, not whatever unpacking it would have broken.
      shape = f"a {len(result)}-tuple" if isinstance(result, (tuple, list)) else (
          f"a {type(result).__name__}")
      raise TypeError(f"impl {impl.name}: {op} returned {shape}; the canonical return is "
                      "(leaves, norms)")
    leaves, norms = calling.result_to_numpy(result)
  except CallTimeout as e:
    return Outcome(error=e)
  except Exception as e:  # pylint: disable=broad-except
    outcome = Outcome(error=e, error_trace=traceback.format_exc(limit=-3))
  else:
    outcome = Outcome(leaves=leaves, norms=norms, misplaced=misplaced(impl, prepared, result))
  after = [_read_back(x) for x in prepared.leaves]
  outcome.mutated = [i for i, (a, b) in enumerate(zip(originals, after))
                     if b is None or a.tobytes() != np.asarray(b).tobytes()]
  return outcome


def _read_back(x: Any) -> np.ndarray | None:
  """An input leaf's values after the call; None when they cannot be read (the call moved it
  to a device that holds no data, or freed it)."""
  try:
    return frameworks.to_numpy(x)
  except Exception:  # pylint: disable=broad-except
    return None


def call_reference(op: str, inputs: Inputs) -> Outcome:
  fn = getattr(reference, op)
  kw = inputs.kwargs(op)
  if op == "clip_grad_norm":
    kw.pop("segments", None), kw.pop("num_systems", None)
  leaves, norms = fn([x.copy() for x in inputs.leaves], inputs.threshold, **kw)
  return Outcome(leaves=leaves, norms=np.asarray(norms))


class Session:
  """Per-session caches of reference results, implementation results and exact norms."""

  def __init__(self):
    self._reference: dict[tuple[str, str], Outcome] = {}  # (case, op)
    self._impl: dict[tuple[str, str, str, str], Outcome] = {}  # (impl, case, op, device)
    self._inputs: dict[tuple[str, str], Inputs] = {}  # (case, op)

  def inputs(self, case, op: str) -> Inputs:
    key = (case.name, op)
    if key not in self._inputs:
      self._inputs[key] = case.build(op)
    return self._inputs[key].copy()

  def reference(self, case, op: str) -> Outcome:
    key = (case.name, op)
    if key not in self._reference:
      self._reference[key] = call_reference(op, self.inputs(case, op))
    return self._reference[key]

  def forget(self, case) -> None:
    """Drops every cached result of ``case`` (generated cases are used once)."""
    for cache, position in ((self._reference, 0), (self._impl, 1), (self._inputs, 0)):
      for key in [k for k in cache if k[position] == case.name]:
        del cache[key]

  def result(self, impl: Implementation, case, op: str) -> Outcome:
    """The call of ``impl`` on ``case`` on the session's device, made once."""
    key = (impl.name, case.name, op, str(_device))
    if key not in self._impl:
      self._impl[key] = call(impl, op, self.inputs(case, op))
    return self._impl[key]


SESSION = Session()


def finite(x: np.ndarray) -> np.ndarray:
  return np.isfinite(x.astype(np.float64))


def is_nan(v) -> bool:
  return isinstance(v, float) and math.isnan(v)
