"""The public operations: arguments checked once, then the fused or the general route.

Validation (SPEC rules 6, 9, 10, 13, in that order of precedence: leaves, segments,
threshold, p, non-finite mode) uses the shared checks of :mod:`clipbench.impls.own.validation`.
A per-system L2 or max-step call whose leaves and ids qualify (float32, sorted-looking int32
or int64 ids) first tries the fused route with its checked threshold; the fused kernel
validates the ids as it scans them and hands back any call it cannot finish, which then
continues on the general route from the arguments already checked, so both routes raise the
same errors.
"""

from __future__ import annotations

from typing import Any, Sequence

import numba
import numpy as np

from clipbench.impls.own import validation
from clipbench.impls.own.numba import fused, general
from clipbench.impls.own.numba.buffers import LeavesAt
from clipbench.impls.own.numba.layout import leaf_layout
from clipbench.impls.own.numba.segments import NO_SEGMENTS, checked_segments
from clipbench.protocol import ANY_NORM_TYPE, DTYPES, Capabilities

framework = "numpy"
version = numba.__version__
description = "numba kernels over blocks of systems (thread pool); exact decisions, RTZ scaling"
capabilities = Capabilities(
    per_system=True, per_system_max=True, norm_types=ANY_NORM_TYPE, dtypes=DTYPES,
    nonfinite=("propagate", "zero"), returns_norm=True, in_place=False, transforms=(),
    devices=("cpu",), mixed_dtypes=True)


def _checked_leaves(leaves: Any) -> list[np.ndarray]:
  """Rule 9: NumPy scalars are taken as 0-d arrays."""
  if isinstance(leaves, (list, tuple)):
    if validation.all_arrays_of_supported_dtypes(leaves, np.ndarray):
      return list(leaves)
    leaves = [np.asarray(x) if isinstance(x, np.generic) else x for x in leaves]
  return validation.check_leaves(leaves, lambda a: isinstance(a, np.ndarray))


def _valid_or_none(check, *args: Any) -> Any:
  """check(*args), or None where it raises: an invalid argument is left to the general
  route, which raises its error in rule order."""
  try:
    return check(*args)
  except (TypeError, ValueError):
    return None


def _per_system(leaves: Any, threshold: Any, name: str, segments: Any, num_systems: Any,
                norm_type: Any, nonfinite: Any, step: bool):
  """A per-system call: the fused route where it qualifies, else (or when it hands the call
  back) the general route."""
  leaves = _checked_leaves(leaves)
  layout = leaf_layout(leaves)
  p = 2.0 if step else _valid_or_none(validation.check_norm_type, norm_type)
  checked = None
  if p == 2.0 and fused.qualifies(leaves, segments, num_systems, nonfinite):
    checked = _valid_or_none(validation.check_threshold, threshold, name, num_systems)
    if checked is not None:
      out = fused.run(leaves, layout, checked, segments, num_systems, nonfinite == "zero", step)
      if out is not None:
        return out
  segs = checked_segments(leaves, segments, num_systems)
  if checked is None:
    checked = validation.check_threshold(threshold, name, segs.num_systems)
  if p is None:
    p = validation.check_norm_type(norm_type)  # raises: the error comes after the threshold's
  nonfinite = validation.check_nonfinite(nonfinite)
  return general.run(leaves, layout, checked, segs, p, nonfinite, step)


def clip_by_global_norm(leaves: Sequence[np.ndarray], max_norm: Any, *, segments: Any = None,
                        num_systems: Any = None, norm_type: Any = 2.0,
                        nonfinite: str = "propagate") -> tuple[list[np.ndarray], np.ndarray]:
  """Per-system p-norm clipping (numpy in, numpy out): each system's leaves are scaled by one
  factor so that its norm is at most its ``max_norm``, and kept bit for bit when it already is."""
  return _per_system(leaves, max_norm, "max_norm", segments, num_systems, norm_type, nonfinite,
                     False)


def clip_by_max_step(leaves: Sequence[np.ndarray], max_step: Any, *, segments: Any = None,
                     num_systems: Any = None,
                     nonfinite: str = "propagate") -> tuple[list[np.ndarray], np.ndarray]:
  """Per-system max-step clipping: the largest last-axis vector norm is at most max_step."""
  return _per_system(leaves, max_step, "max_step", segments, num_systems, 2.0, nonfinite, True)


def clip_grad_norm(leaves: Sequence[np.ndarray], max_norm: Any, *, norm_type: Any = 2.0,
                   nonfinite: str = "propagate") -> tuple[list[np.ndarray], np.ndarray]:
  """Global p-norm clipping of all leaves together; returns the leaves and the 0-d norm."""
  leaves = _checked_leaves(leaves)
  threshold = validation.check_threshold(max_norm, "max_norm", None)
  p = validation.check_norm_type(norm_type)
  nonfinite = validation.check_nonfinite(nonfinite)
  outs, norms = general.run(leaves, leaf_layout(leaves), threshold, NO_SEGMENTS, p, nonfinite)
  return outs, norms.reshape(())


def clip_grad_norm_at(leaves: LeavesAt, max_norm: Any, p: float,
                      nonfinite: str) -> tuple[list[np.ndarray], np.ndarray]:
  """:func:`clip_grad_norm` of leaves known by address, all arguments checked by the caller
  (a framework's own checks): the general route reads the addresses, and no array is made
  per leaf, which is most of a call's host work on many small leaves (W4's 10,000)."""
  outs, norms = general.run(leaves, leaf_layout(leaves), max_norm, NO_SEGMENTS, p, nonfinite)
  return outs, norms.reshape(())


class _Implementation:
  """The registry object (``clipbench.impls.own.numba:implementation``)."""

  framework = framework
  version = version
  description = description
  capabilities = capabilities
  clip_by_global_norm = staticmethod(clip_by_global_norm)
  clip_by_max_step = staticmethod(clip_by_max_step)
  clip_grad_norm = staticmethod(clip_grad_norm)


implementation = _Implementation()
