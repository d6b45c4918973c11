"""Standalone reproducers: Python that rebuilds a case's input, makes the call and asserts.

A reproducer is meant for a library's issue tracker, so it depends on no file: small inputs
are written inline as exact float64 literals (``repr`` round-trips, and every leaf dtype
converts exactly to float64 and back), larger ones inline as their bytes (zlib, base85), which
is exact too. It shows the call as the library's users write it (an adapter's ``reproducer``
text) and ends in an assertion: the same call through clipbench, checked against the exact
reference by :func:`departure_from_reference`, which fails for as long as the deviation
stands and passes once the library conforms.
"""

from __future__ import annotations

import base64
import math
import zlib
from typing import Any, Sequence

import numpy as np

from clipbench import devices
from clipbench.conformance import rules, running
from clipbench.conformance.cases import Case, Inputs
from clipbench.conformance.running import SESSION, call, call_reference
from clipbench.impls.registry import Implementation
from clipbench.protocol import OPS

INLINE_LIMIT = 64  # elements up to which an array is written as readable literals

_SUITE_ERRORS = (TypeError, ValueError)  # what the reference raises for a bad argument


# ------------------------------------------------------------------------------ the snippet
def _float(v: float) -> str:
  if math.isnan(v):
    return "np.nan"
  if math.isinf(v):
    return "np.inf" if v > 0 else "-np.inf"
  return repr(v)


def _scalar(v: float) -> str:
  return _float(float(v)).replace("np.", "math.")


def _packed(a: np.ndarray) -> str:
  """``a`` as an exact expression of its bytes: zlib-compressed, base85 text."""
  bits = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
  little = bits.astype(bits.dtype.newbyteorder("<"), copy=False)
  text = base64.b85encode(zlib.compress(np.ascontiguousarray(little).tobytes(), 9)).decode()
  body = (f"np.frombuffer(zlib.decompress(base64.b85decode({text!r})), "
          f"dtype={little.dtype.str!r})")
  if a.ndim != 1:
    body += f".reshape({tuple(a.shape)!r})"
  return body + (".view(ml_dtypes.bfloat16)" if a.dtype.name == "bfloat16" else "")


def _literal(a: np.ndarray) -> str:
  if a.size > INLINE_LIMIT:
    return _packed(a)
  dtype = a.dtype.name
  ctor = "ml_dtypes.bfloat16" if dtype == "bfloat16" else f"np.{dtype}"
  if a.dtype.kind in "iub":
    return f"np.array({a.tolist()!r}, dtype={ctor})"
  values = [_float(v) for v in a.astype(np.float64).ravel().tolist()]
  body = f"np.array([{', '.join(values)}])"
  if a.ndim != 1:
    body += f".reshape({tuple(a.shape)!r})"
  return f"{body}.astype({ctor})"


def _threshold(threshold: Any) -> str:
  if isinstance(threshold, np.ndarray) and threshold.ndim:
    return _literal(threshold)
  return _scalar(float(threshold))


def snippet(impl_name: str, description: str, op: str, inputs: Inputs,
            library_call: str | None = None, *, rule: int | str | None = None) -> str:
  """The reproducer text for calling ``impl_name``'s ``op`` on ``inputs``.

  ``library_call`` is the implementation's own code for the call (an adapter's
  ``reproducer``), written against the names ``leaves``, ``threshold``, ``segments``,
  ``num_systems`` and ``norm_type``; without it the snippet calls through clipbench. The text
  ends in ``assert problem is None, problem``, where ``problem`` is
  :func:`departure_from_reference` for ``rule`` (the SPEC rule the case checks; without it
  the call is compared with the reference bit for bit).
  Every input is inline (exact literals, or exact packed bytes past ``INLINE_LIMIT``
  elements), so the text runs on its own wherever clipbench is installed. Off the host
  (``--device``), both calls run on the session's device.
  """
  placed = running.device()
  device = "" if placed == devices.HOST else f", device={str(placed)!r}"
  # calling.call places on the first device of a kind only (cpu, cuda).
  call_device = device if str(placed) == "cuda" else ""
  per_system = inputs.segments is not None and op != "clip_grad_norm"
  arrays = [*inputs.leaves, *(inputs.segments or []), inputs.threshold]
  packed = any(isinstance(a, np.ndarray) and a.size > INLINE_LIMIT for a in arrays)
  lines = [f"# {impl_name}: {description}" if description else f"# {impl_name}",
           "import math"]
  if packed:
    lines += ["import base64", "import zlib"]
  lines += ["import ml_dtypes", "import numpy as np", "",
            "from clipbench.conformance.reproducer import departure_from_reference",
            "from clipbench.impls import calling, registry", ""]
  lines.append("leaves = [" + ", ".join(_literal(x) for x in inputs.leaves) + "]")
  if per_system:
    lines.append("segments = [" + ", ".join(_literal(s) for s in inputs.segments) + "]")
    lines.append(f"num_systems = {inputs.num_systems}")
  else:
    lines += ["segments = None", "num_systems = None"]
  lines.append(f"threshold = {_threshold(inputs.threshold)}")
  lines.append(f"norm_type = {_scalar(inputs.norm_type)}")
  lines.append(f"nonfinite = {inputs.nonfinite!r}")
  lines.append("")
  if library_call:
    lines.append(f"# The call as {impl_name}'s users write it:")
    call_lines = library_call.splitlines()
  else:
    kwargs = []
    if per_system:
      kwargs += ["segments=segments", "num_systems=num_systems"]
    if op != "clip_by_max_step" and inputs.norm_type != 2.0:
      kwargs.append("norm_type=norm_type")
    if inputs.nonfinite != "propagate":
      kwargs.append("nonfinite=nonfinite")
    call_lines = [f"impl = registry.load({impl_name!r})",
                  f"out, norms = calling.call(impl, {op!r}, leaves, threshold"
                  + "".join(", " + k for k in kwargs) + call_device + ")",
                  "print(out, norms)"]
  # An error is printed, not raised: whether raising is right is the assertion's to say.
  lines += ["try:", *("  " + line for line in call_lines),
            "except Exception as e:  # pylint: disable=broad-except",
            "  print(type(e).__name__, e)"]
  rule_text = f"rule {rule}" if rule not in (None, "") else "the reference, bit for bit"
  lines += ["",
            f"# What SPEC.md expects ({rule_text}): the same call through clipbench, checked",
            "# against the exact reference. Fails while the deviation stands.",
            f"problem = departure_from_reference(registry.load({impl_name!r}), {op!r}, leaves, "
            "threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, "
            f"nonfinite=nonfinite, rule={rule!r}{device})",
            "assert problem is None, problem"]
  return "\n".join(lines)


# ------------------------------------------------------------------------------- the check
def _describe(out: Any) -> str:
  leaves = getattr(out, "leaves", None) or []
  shown = "; ".join(np.array2string(np.asarray(x).ravel()[:6], precision=9, separator=", ")
                    for x in leaves[:3])
  norms = getattr(out, "norms", None)
  return f"leaves {shown}" + ("" if norms is None else f", norms {np.asarray(norms).ravel()[:6]}")


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _bitwise_departure(impl: Implementation, got: Any, expected: Any) -> str | None:
  for i, (y, r) in enumerate(zip(got.leaves, expected.leaves)):
    if not _same_bits(np.asarray(y), np.asarray(r)):
      return (f"leaves[{i}]: {impl.name} returned {np.asarray(y).dtype.name}"
              f"{list(np.shape(y))} {np.asarray(y).ravel()[:6]}, the reference "
              f"{r.dtype.name}{list(r.shape)} {r.ravel()[:6]}")
  if got.norms is not None and impl.capabilities.returns_norm:
    y = np.asarray(got.norms).ravel()
    r = np.asarray(expected.norms).ravel()
    if y.dtype != r.dtype or y.shape != r.shape or not np.array_equal(y, r, equal_nan=True):
      return f"norms: {impl.name} returned {y!r}, the reference {r!r}"
  return None


def departure_from_reference(impl: Implementation, op: str, leaves: Sequence[np.ndarray],
                             threshold: Any, *, segments: Sequence[np.ndarray] | None = None,
                             num_systems: int | None = None, norm_type: float = 2.0,
                             nonfinite: str = "propagate",
                             rule: int | str | None = None,
                             device: str | None = None) -> str | None:
  """How ``impl``'s ``op`` on these arguments departs from SPEC.md, or None when it does not.

  The call runs on ``device`` (``cpu[:N]``, ``cuda[:N]``; default: the session's, the host
  outside the suite), as the conformance suite's calls do.

  Where the reference rejects the arguments, ``impl`` must raise the same type of error.
  Otherwise ``impl`` must return, and ``rule`` (a SPEC rule number with a check in
  ``clipbench.conformance.rules``) is checked as the suite checks it, with the tolerances the
  rule allows; for any other rule the outputs and norms must equal the reference's bit for
  bit, and for rule 12 the inputs must come back unmodified.

  Raises:
    TypeError: ``impl`` is not a loaded implementation (use ``registry.load``).
    ValueError: ``op`` is not one of the three operations.
  """
  if not isinstance(impl, Implementation):
    raise TypeError(f"impl: expected an Implementation (registry.load(name)), "
                    f"got {type(impl).__name__}")
  if op not in OPS:
    raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
  with running.on_device(running.device() if device is None else device):
    return _departure(impl, op, leaves, threshold, segments, num_systems, norm_type, nonfinite,
                      rule)


def _departure(impl: Implementation, op: str, leaves: Sequence[np.ndarray], threshold: Any,
               segments: Sequence[np.ndarray] | None, num_systems: int | None, norm_type: float,
               nonfinite: str, rule: int | str | None) -> str | None:
  per_system = segments is not None and op != "clip_grad_norm"
  inputs = Inputs(leaves=[np.array(x, copy=True) for x in leaves], threshold=threshold,
                  segments=[np.asarray(s) for s in segments] if per_system else None,
                  num_systems=num_systems if per_system else None, norm_type=norm_type,
                  nonfinite=nonfinite)
  try:
    expected = call_reference(op, inputs.copy())
    rejected = None
  except _SUITE_ERRORS as e:
    expected, rejected = None, e
  got = call(impl, op, inputs.copy())
  if rejected is not None:
    if got.error is None:
      return (f"the reference raises {type(rejected).__name__} ({rejected}); {impl.name} "
              f"returned {_describe(got)}")
    if not isinstance(got.error, type(rejected)):
      return (f"the reference raises {type(rejected).__name__} ({rejected}); {impl.name} "
              f"raised {type(got.error).__name__}: {got.error}")
    return None
  if got.error is not None:
    return (f"{impl.name} raised {type(got.error).__name__}: {got.error}; the reference "
            f"returns {_describe(expected)}")
  number = int(rule) if str(rule).isdigit() else None
  if number in rules.VERIFY:
    case = Case(f"reproducer-{id(inputs)}", (number,), lambda _op: inputs.copy(), ops=(op,))
    try:
      rules.VERIFY[number](impl, op, case)
    except AssertionError as e:
      return f"rule {rule}: {e}"
    finally:
      SESSION.forget(case)
    return None
  if number == 12 and got.misplaced:
    return f"rule 12: on {running.device()}, {impl.name} {got.misplaced}"
  if number == 12 and got.mutated and not impl.capabilities.in_place:
    return f"rule 12: {impl.name} modified input leaves {got.mutated}"
  return _bitwise_departure(impl, got, expected)
