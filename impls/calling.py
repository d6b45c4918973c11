"""Calling any implementation through the canonical API with numpy inputs and outputs.

Shared by the conformance suite, ``clipbench bench`` and asv so that every caller passes the
same arguments the same way:

* leaves become arrays of the implementation's framework (exactly, see ``frameworks``);
* ``segments`` become integer arrays of that framework (int32 for JAX and TensorFlow, int64
  for torch and numpy); ``num_systems`` is passed only with segments;
* a scalar threshold is a Python float; a per-system threshold is a numpy float64 array;
* ``norm_type`` is passed only when it is not 2, ``nonfinite`` only when it is not
  ``"propagate"``, so an implementation need not accept keywords it does not use.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from clipbench.impls import frameworks
from clipbench.impls.registry import Implementation


@dataclasses.dataclass
class Prepared:
  """Framework-side arguments of one call, built outside any timed region."""

  op: str
  leaves: list[Any]
  threshold: Any
  kwargs: dict[str, Any]


def segments_to_framework(seg: np.ndarray, framework: str, device: str = "cpu") -> Any:
  seg = np.asarray(seg)
  if framework in ("jax", "tensorflow") and seg.dtype.kind in "iu":
    seg = seg.astype(np.int32)
  elif framework in ("torch", "numpy") and seg.dtype.kind in "iu":
    seg = seg.astype(np.int64)
  return frameworks.to_framework(seg, framework, device)


def prepare(impl: Implementation, op: str, leaves: Sequence[np.ndarray], threshold: Any, *,
            segments: Sequence[np.ndarray] | None = None, num_systems: int | None = None,
            norm_type: float = 2.0, nonfinite: str = "propagate",
            device: str = "cpu") -> Prepared:
  fw = impl.framework
  fw_leaves = [frameworks.to_framework(x, fw, device) for x in leaves]
  if isinstance(threshold, np.ndarray) and threshold.ndim > 0:
    threshold = np.asarray(threshold, dtype=np.float64)
  elif isinstance(threshold, (np.ndarray, np.generic)):
    threshold = float(threshold)
  kwargs: dict[str, Any] = {}
  if segments is not None:
    kwargs["segments"] = [segments_to_framework(s, fw, device) for s in segments]
  if num_systems is not None:
    kwargs["num_systems"] = num_systems
  if op != "clip_by_max_step" and not _is_two(norm_type):
    kwargs["norm_type"] = norm_type
  if nonfinite != "propagate":
    kwargs["nonfinite"] = nonfinite
  return Prepared(op, fw_leaves, threshold, kwargs)


def _is_two(p: Any) -> bool:
  try:
    return float(p) == 2.0
  except (TypeError, ValueError):
    return False


def run(impl: Implementation, prepared: Prepared) -> tuple[Any, Any]:
  """Calls the implementation on prepared arguments; waits for device work to finish."""
  out = impl.function(prepared.op)(prepared.leaves, prepared.threshold, **prepared.kwargs)
  return frameworks.block_until_ready(out)


def result_to_numpy(result: Any) -> tuple[list[np.ndarray], np.ndarray | None]:
  leaves, norms = result
  return [frameworks.to_numpy(x) for x in leaves], (
      None if norms is None else np.asarray(frameworks.to_numpy(norms)))


def call(impl: Implementation, op: str, leaves: Sequence[np.ndarray], threshold: Any,
         **kwargs: Any) -> tuple[list[np.ndarray], np.ndarray | None]:
  """``prepare`` + ``run`` + ``result_to_numpy``: one canonical call with numpy in and out."""
  return result_to_numpy(run(impl, prepare(impl, op, leaves, threshold, **kwargs)))
