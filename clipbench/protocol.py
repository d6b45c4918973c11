"""The protocol shared by the reference, the implementations and their judges.

Names everyone uses (operations, dtypes, non-finite modes, frameworks, the SPEC's rule titles)
and what an implementation declares it can do.

The conformance suite applies a test only when the implementation declares the property it
needs; anything outside the declaration is skipped with the reason, never counted as a pass.
An outside implementation may declare ``capabilities`` as a :class:`Capabilities`, as a plain
dict with the same keys, or not at all (then the defaults below apply).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Mapping

OPS = ("clip_by_global_norm", "clip_by_max_step", "clip_grad_norm")
DTYPES = ("float16", "bfloat16", "float32", "float64")
NONFINITE_MODES = ("propagate", "zero")
FRAMEWORKS = ("numpy", "jax", "torch", "tensorflow")

ANY_NORM_TYPE = "any"

# The rules of ``reference/SPEC.md``: number -> title, exactly as its ``## Rule N. Title``
# headings read (a test holds the two together). Tables and reports take titles from here.
RULES: Mapping[int, str] = types.MappingProxyType({
    1: "Domain of the norm",
    2: "Max-step norm",
    3: "At or below the threshold: bitwise unchanged",
    4: "Above the threshold: one factor, strict bound",
    5: "Norm accuracy, no overflow or underflow",
    6: "The threshold",
    7: "Non-finite input",
    8: "Empty input",
    9: "Dtypes",
    10: "p-norms",
    11: "Batch invariance",
    12: "Inputs are not modified",
    13: "Bad segments",
    14: "Sharded leaves: the bits of the unsharded call",
})


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """Declared abilities of one implementation.

  Attributes:
    per_system: accepts ``segments``/``num_systems`` (many systems in one call).
    per_system_max: accepts an array of per-system thresholds.
    norm_types: ``"any"`` (every p >= 1 and +-inf) or the tuple of accepted p values.
    dtypes: leaf dtypes accepted (names from ``DTYPES``).
    nonfinite: non-finite modes implemented (``"propagate"``, ``"zero"``).
    returns_norm: the norms it returns are the library's own (False: it returns None).
    in_place: it writes its result into the input leaves (as torch's ``clip_grad_norm_``).
    transforms: program transformations it supports: ``"jit"``, ``"vmap"``, ``"grad"``
      (JAX) and ``"torch.compile"``.
    devices: devices it runs on: ``"cpu"``, ``"cuda"``.
    mixed_dtypes: accepts leaves of different dtypes in one call.
  """

  per_system: bool = False
  per_system_max: bool = False
  norm_types: Any = (2.0,)
  dtypes: tuple[str, ...] = DTYPES
  nonfinite: tuple[str, ...] = ("propagate",)
  returns_norm: bool = True
  in_place: bool = False
  transforms: tuple[str, ...] = ()
  devices: tuple[str, ...] = ("cpu",)
  mixed_dtypes: bool = True

  def supports_norm_type(self, p: float) -> bool:
    if self.norm_types == ANY_NORM_TYPE:
      return True
    return any(p == q or (math.isnan(p) and math.isnan(q)) for q in self.norm_types)

  @property
  def any_norm_type(self) -> bool:
    return self.norm_types == ANY_NORM_TYPE

  def summary(self) -> str:
    p = "any p" if self.any_norm_type else "p in " + ",".join(_fmt_p(q) for q in self.norm_types)
    parts = [
        "per-system" if self.per_system else "global only",
        p,
        "/".join(self.dtypes),
        "nonfinite=" + "/".join(self.nonfinite),
    ]
    if self.per_system_max:
      parts.append("per-system max")
    if not self.returns_norm:
      parts.append("no norm returned")
    if self.in_place:
      parts.append("in-place")
    if self.transforms:
      parts.append("+".join(self.transforms))
    if self.devices != ("cpu",):
      parts.append("devices=" + "/".join(self.devices))
    return "; ".join(parts)


def _fmt_p(p: float) -> str:
  return "inf" if p == math.inf else "-inf" if p == -math.inf else f"{p:g}"


def as_capabilities(declared: Capabilities | Mapping[str, Any] | None) -> Capabilities:
  """Normalizes a declaration (dataclass, dict or None) into :class:`Capabilities`."""
  if declared is None:
    return Capabilities()
  if isinstance(declared, Capabilities):
    return declared
  if isinstance(declared, Mapping):
    known = {f.name for f in dataclasses.fields(Capabilities)}
    unknown = set(declared) - known
    if unknown:
      raise ValueError(
          f"capabilities: unknown keys {sorted(unknown)}; known keys are {sorted(known)}")
    values = dict(declared)
    for key in ("dtypes", "nonfinite", "transforms", "devices"):
      if key in values:
        values[key] = tuple(values[key])
    if "norm_types" in values and values["norm_types"] != ANY_NORM_TYPE:
      values["norm_types"] = tuple(float(p) for p in values["norm_types"])
    return Capabilities(**values)
  raise TypeError(
      f"capabilities must be a Capabilities, a mapping or None, not {type(declared).__name__}")
