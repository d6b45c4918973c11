"""What an implementation can do, found by calling it: the preflight and the capability probe.

The preflight makes one tiny valid call per operation and checks the calling convention (a
pair ``(leaves, norms)``, one leaf per input leaf, each an array of the implementation's
framework with the input's shape and dtype), so a wrong convention is one message naming the
implementation instead of a failure in every case.

The probe fills in what an implementation does not declare (no ``capabilities``, or a dict
without the key): a tiny call with ``segments``, with per-system thresholds, with each
``norm_type``, with ``nonfinite="zero"`` and with each dtype its framework can hold. A
feature counts as supported when the call returns leaves of the right structure, and as
unsupported when the signature has no such keyword or the call raises TypeError,
NotImplementedError or ValueError naming the argument. Any other outcome (another error, a
wrong value) is support claimed and is left for the conformance tests to judge: a feature
the signature offers is tested, never assumed absent. Declarations always win. Both call on
the session's device (``--device``), as every test does.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Mapping

import numpy as np

from clipbench.impls import calling, frameworks
from clipbench.impls.registry import Implementation
from clipbench.protocol import ANY_NORM_TYPE, DTYPES, Capabilities
from clipbench.conformance.cases import BF16, P_VALUES
from clipbench.conformance.running import CallTimeout, prepare, within_timeout

PROBED_KEYS = ("per_system", "per_system_max", "norm_types", "nonfinite", "dtypes",
               "returns_norm")
_REFUSALS = (TypeError, NotImplementedError, ValueError)


class ConventionError(Exception):
  """The implementation's answer to a tiny valid call breaks the calling convention."""


@dataclasses.dataclass
class Probe:
  """Capabilities after probing, what the probe found, and hints for the maintainer."""

  capabilities: Capabilities
  found: dict[str, Any] = dataclasses.field(default_factory=dict)  # probed key -> value
  hints: list[str] = dataclasses.field(default_factory=list)

  def summary(self) -> str:
    return "; ".join(f"{k}={_show(v)}" for k, v in self.found.items())


def _show(value: Any) -> str:
  if isinstance(value, tuple):
    return "/".join("inf" if v == math.inf else "-inf" if v == -math.inf else
                    f"{v:g}" if isinstance(v, float) else str(v) for v in value) or "none"
  return str(value)


def declared_keys(obj: Any) -> set[str]:
  """Capability keys the implementation object declares itself."""
  declared = getattr(obj, "capabilities", None)
  if isinstance(declared, Capabilities):
    return {f.name for f in dataclasses.fields(Capabilities)}
  if isinstance(declared, Mapping):
    return set(declared)
  return set()


def _leaf(op: str, dtype: Any = np.float32, rows: int = 4) -> np.ndarray:
  values = np.random.default_rng(0).standard_normal((rows, 3)) * 2.0
  return values.astype(dtype)


def _describe(x: Any) -> str:
  shape = tuple(getattr(x, "shape", ()))
  dtype = getattr(getattr(x, "dtype", None), "name", None) or str(getattr(x, "dtype", "?"))
  return f"{type(x).__module__.split('.')[0]}.{type(x).__name__} {dtype} {shape}"


def _is_framework_array(x: Any, framework: str) -> bool:
  module = type(x).__module__
  if framework == "numpy":
    return isinstance(x, np.ndarray)
  prefix = {"jax": ("jax", "jaxlib"), "torch": ("torch",),
            "tensorflow": ("tensorflow", "tf", "keras")}[framework]
  return module.split(".")[0] in prefix and hasattr(x, "shape")


def check_convention(impl: Implementation, op: str, result: Any, inputs: list[np.ndarray],
                     prepared: list[Any], num_norms: int | None = 1,
                     check_dtype: bool = True) -> None:
  """Raises ConventionError saying how ``result`` breaks the canonical return.

  ``num_norms`` None skips the count of norm values; ``check_dtype`` False the leaf dtypes
  (a probe leaves both to the conformance tests, which say which rule they break).
  """
  norm = "norms" if op != "clip_grad_norm" else "total_norm"
  canonical = f"the canonical return is (leaves, {norm})"
  if not isinstance(result, (tuple, list)):
    raise ConventionError(f"{op} returned a {type(result).__name__}; {canonical}")
  if len(result) != 2:
    raise ConventionError(f"{op} returned a {len(result)}-tuple; {canonical}")
  leaves, norms = result
  if not isinstance(leaves, (list, tuple)):
    raise ConventionError(f"{op} returned leaves as a {type(leaves).__name__}; {canonical} "
                          "with leaves a list, one array per input leaf")
  if len(leaves) != len(inputs):
    raise ConventionError(f"{op} returned {len(leaves)} leaves for {len(inputs)} input "
                          "leaves; the output has one leaf per input leaf")
  for i, (out, x, given) in enumerate(zip(leaves, inputs, prepared)):
    if not _is_framework_array(out, impl.framework):
      raise ConventionError(f"{op} returned leaves[{i}] as {_describe(out)}; framework "
                            f"{impl.framework!r} leaves come back as {impl.framework} arrays")
    if tuple(out.shape) != tuple(x.shape):
      raise ConventionError(f"{op} returned leaves[{i}] of shape {tuple(out.shape)} for an "
                            f"input of shape {x.shape}")
    got = frameworks.to_numpy(out).dtype
    held = _held_dtype(given, x)
    if check_dtype and got != held:
      raise ConventionError(f"{op} returned leaves[{i}] as {got.name} for a {held.name} "
                            "input; each leaf keeps its dtype")
  if norms is not None and num_norms is not None:
    size = int(np.size(frameworks.to_numpy(norms)))
    if size != num_norms:
      raise ConventionError(f"{op} returned {size} norm values for {num_norms} system(s); "
                            f"{canonical}")


def _held_dtype(given: Any, built: np.ndarray) -> np.dtype:
  """The dtype the framework holds an input leaf in (JAX without x64: float32 for float64);
  the built one when the call left the input unreadable (rule 12 says so, not the
  preflight)."""
  try:
    return frameworks.to_numpy(given).dtype
  except Exception:  # pylint: disable=broad-except
    return built.dtype


def _call(impl: Implementation, op: str, leaves: list[np.ndarray], threshold: Any,
          **kw: Any) -> tuple[Any, list[Any]]:
  prepared = prepare(impl, op, leaves, threshold, **kw)
  result = within_timeout(lambda: calling.run(impl, prepared),
                          f"impl {impl.name}: {op} (probe)")
  return result, prepared.leaves


def preflight(impl: Implementation, op: str) -> str | None:
  """One tiny valid call of ``op``; a one-line message when the convention is broken."""
  leaves = [_leaf(op)]
  where = f"impl {impl.name}"
  try:
    prepared = prepare(impl, op, leaves, 1.0)
  except Exception as e:  # pylint: disable=broad-except
    return (f"clipbench could not build {impl.framework} inputs for {where} "
            f"({type(e).__name__}: {e}); is {impl.framework} installed?")
  try:
    result = within_timeout(lambda: calling.run(impl, prepared), f"{where}: {op} (preflight)")
  except CallTimeout as e:
    return str(e)
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return (f"{where}: {op} raised {type(e).__name__}: {first} on a tiny valid call "
            f"{op}([float32 (4, 3)], 1.0)")
  try:
    check_convention(impl, op, result, leaves, prepared.leaves)
  except ConventionError as e:
    return f"{where}: {e}"
  if result[1] is None and impl.capabilities.returns_norm and (
      "returns_norm" in declared_keys(impl.obj)):
    return (f"{where}: {op} returned no norm (None) but declares returns_norm; return the "
            "norm or declare returns_norm=False")
  return None


def _signature_refuses(fn: Any, names: tuple[str, ...]) -> bool:
  """True when ``fn``'s signature has none of ``names`` and no ``**kwargs``."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return False
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    return False
  return not any(p.name in names for p in params)


def _accepts(impl: Implementation, op: str, keywords: tuple[str, ...],
             leaves: list[np.ndarray], threshold: Any = 1.0, num_norms: int | None = None,
             mentions: tuple[str, ...] | None = (), **kw: Any) -> bool:
  """Whether a call using the keyword(s) ``keywords`` is supported (see the module docstring).

  A refusal (TypeError, NotImplementedError, ValueError) counts as "unsupported" when its
  message names one of ``keywords`` or ``mentions``; with ``mentions=None``, any refusal does.
  """
  if keywords and _signature_refuses(impl.function(op), keywords):
    return False
  try:
    result, prepared = _call(impl, op, leaves, threshold, **kw)
  except CallTimeout:
    return True
  except _REFUSALS as e:
    message = str(e)
    names = keywords + (mentions or ())
    if mentions is None or isinstance(e, NotImplementedError) or any(
        n in message for n in names):
      return False
    return True
  except Exception:  # pylint: disable=broad-except
    return True
  try:
    check_convention(impl, op, result, leaves, prepared, num_norms, check_dtype=False)
  except ConventionError:
    return False
  return True


def _holds(impl: Implementation, dtype: np.dtype) -> bool:
  """Whether the framework keeps ``dtype`` (JAX without x64 turns float64 into float32)."""
  try:
    held = frameworks.to_numpy(frameworks.to_framework(np.zeros(2, dtype), impl.framework))
  except Exception:  # pylint: disable=broad-except
    return False
  return held.dtype == dtype


def _x64_hint(impl: Implementation) -> str:
  return (f"impl {impl.name}: float64 comes back float32 from JAX (x64 is off): declare "
          "capabilities={'dtypes': ('float16', 'bfloat16', 'float32')} or enable "
          "jax.config.update('jax_enable_x64', True)")


def probe(impl: Implementation) -> Probe:
  """The implementation's capabilities, with every undeclared probed key found by a call."""
  caps = impl.capabilities
  declared = declared_keys(impl.obj)
  found: dict[str, Any] = {}
  hints: list[str] = []
  ops = impl.ops
  system_op = next((op for op in ("clip_by_global_norm", "clip_by_max_step") if op in ops),
                   None)
  norm_op = next((op for op in ("clip_grad_norm", "clip_by_global_norm") if op in ops), None)
  any_op = system_op or norm_op
  f32 = [_leaf(any_op)] if any_op else []
  batch = dict(segments=[np.array([0, 1, 0, 1])], num_systems=2)

  if "per_system" not in declared and system_op:
    found["per_system"] = _accepts(impl, system_op, ("segments", "num_systems"), f32,
                                   num_norms=None, **batch)
  per_system = found.get("per_system", caps.per_system)
  if "per_system_max" not in declared and system_op:
    found["per_system_max"] = per_system and _accepts(
        impl, system_op, (), f32, np.array([1.0, 2.0]), num_norms=None, mentions=None,
        **batch)
  if "norm_types" not in declared and norm_op:
    ps = tuple(p for p in P_VALUES if p != 2.0 and _accepts(
        impl, norm_op, ("norm_type",), f32, norm_type=p))
    found["norm_types"] = ANY_NORM_TYPE if len(ps) == len(P_VALUES) - 1 else (2.0,) + ps
  if "nonfinite" not in declared and any_op:
    zero = _accepts(impl, any_op, ("nonfinite",), f32, nonfinite="zero")
    found["nonfinite"] = ("propagate", "zero") if zero else ("propagate",)
  if "dtypes" not in declared and any_op:
    kept = []
    for name in DTYPES:
      dtype = BF16 if name == "bfloat16" else np.dtype(name)
      if not _holds(impl, dtype):
        if impl.framework == "jax" and name == "float64":
          hints.append(_x64_hint(impl))
        continue
      if _accepts(impl, any_op, (), [_leaf(any_op, dtype)], mentions=("dtype", name)):
        kept.append(name)
    found["dtypes"] = tuple(kept)
  elif impl.framework == "jax" and "float64" in caps.dtypes and not _holds(
      impl, np.dtype(np.float64)):
    hints.append(_x64_hint(impl))
  if "returns_norm" not in declared and any_op:
    try:
      result, _ = _call(impl, any_op, f32, 1.0)
      found["returns_norm"] = not (isinstance(result, (tuple, list)) and len(result) == 2 and
                                   result[1] is None)
    except Exception:  # pylint: disable=broad-except
      pass
  return Probe(dataclasses.replace(caps, **found), found, hints)
