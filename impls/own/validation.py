"""Argument checks shared by every own implementation (SPEC rules 6, 9, 10 and 13).

Run on the host before any work; each message starts with the offending argument, as the
reference's do. The reference keeps its own checks (``clipbench.reference.validation``) on
purpose: an independent oracle is the point.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import ml_dtypes
import numpy as np

from clipbench.protocol import DTYPES as SUPPORTED_DTYPES
from clipbench.protocol import NONFINITE_MODES

def _supported_dtypes() -> frozenset:
  return frozenset(np.dtype(ml_dtypes.bfloat16) if n == "bfloat16" else np.dtype(n)
                   for n in SUPPORTED_DTYPES)


_SUPPORTED = _supported_dtypes()


def check_leaves(leaves: Any, is_array) -> list:
  """Rule 9: a list of arrays (``is_array``) of float16, bfloat16, float32 or float64."""
  if not isinstance(leaves, (list, tuple)):
    raise TypeError(f"leaves: expected a list of arrays, got {type(leaves).__name__}")
  leaves = list(leaves)
  for i, leaf in enumerate(leaves):
    if not is_array(leaf) or leaf.dtype not in _SUPPORTED:
      if not is_array(leaf):
        raise TypeError(f"leaves[{i}]: expected an array, got {type(leaf).__name__}")
      raise TypeError(f"leaves[{i}]: dtype {np.dtype(leaf.dtype).name} is not supported; "
                      f"expected one of {', '.join(SUPPORTED_DTYPES)}")
  return leaves


def all_arrays_of_supported_dtypes(leaves: list, array_type: type) -> bool:
  """Whether every leaf is an ``array_type`` (exactly) of a supported dtype, found with C-level
  maps over the leaves (a call may have 10,000): where not, :func:`check_leaves`'s walk names
  the first bad leaf."""
  return (set(map(type, leaves)) <= {array_type}
          and set(map(operator.attrgetter("dtype"), leaves)) <= _SUPPORTED)


def check_leaf_dtype_name(i: int, dtype_name: str) -> None:
  """Rule 9 for one leaf whose dtype numpy cannot read (torch's), given by its name."""
  if dtype_name not in SUPPORTED_DTYPES:
    raise TypeError(f"leaves[{i}]: dtype {dtype_name} is not supported; "
                    f"expected one of {', '.join(SUPPORTED_DTYPES)}")


def check_threshold(value: Any, name: str, num_systems: int | None):
  """Rule 6: a float >= 0 (+inf allowed), or (per-system ops) one per system.

  Returns a float, or a float64 array of shape (num_systems,).
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}: expected a float, got bool")
  if isinstance(value, np.ndarray) and value.ndim > 0:
    if num_systems is None:
      raise ValueError(f"{name}: expected a scalar, got an array of shape {value.shape}")
    if value.shape != (num_systems,):
      raise ValueError(f"{name}: expected a scalar or an array of shape ({num_systems},), got "
                       f"shape {value.shape}")
    if value.dtype.kind not in "fiu":
      raise TypeError(f"{name}: expected a real array, got dtype {value.dtype.name}")
    arr = value.astype(np.float64)
    bad = np.flatnonzero(np.isnan(arr) | (arr < 0))
    if bad.size:
      k = int(bad[0])
      if math.isnan(arr[k]):
        raise ValueError(f"{name}[{k}]: must not be NaN")
      raise ValueError(f"{name}[{k}]: must be >= 0, got {float(arr[k])!r}")
    return arr
  if isinstance(value, np.ndarray):
    value = value[()]
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}: expected a float, got bool")
  if not isinstance(value, numbers.Real):
    raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
  v = float(value)
  if math.isnan(v):
    raise ValueError(f"{name}: must not be NaN")
  if v < 0:
    raise ValueError(f"{name}: must be >= 0, got {v!r}")
  return v


def check_norm_type(p: Any) -> float:
  """Rule 10: any real p >= 1, +inf or -inf."""
  if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Real):
    raise TypeError(f"norm_type: expected a real number, got {type(p).__name__} {p!r}")
  p = float(p)
  if math.isnan(p) or (p < 1 and p != -math.inf):
    raise ValueError(f"norm_type: must be >= 1, +inf or -inf, got {p!r}")
  return p


def check_nonfinite(mode: Any) -> str:
  if mode not in NONFINITE_MODES:
    raise ValueError(f"nonfinite: expected one of {NONFINITE_MODES}, got {mode!r}")
  return mode


def check_num_systems(segments: Any, num_systems: Any, num_leaves: int) -> int | None:
  """Rule 13 (counts): returns num_systems (None when segments is None)."""
  if segments is None:
    if num_systems not in (None, 1):
      raise ValueError(f"num_systems: must be None or 1 when segments is None, got "
                       f"{num_systems!r}")
    return None
  if num_systems is None:
    raise ValueError("num_systems: required when segments is given")
  if isinstance(num_systems, (bool, np.bool_)) or not isinstance(num_systems, numbers.Integral):
    raise ValueError(f"num_systems: expected an integer >= 0, got {num_systems!r}")
  num_systems = int(num_systems)
  if num_systems < 0:
    raise ValueError(f"num_systems: expected an integer >= 0, got {num_systems}")
  if not isinstance(segments, (list, tuple)):
    raise ValueError(f"segments: expected None or a list of one integer array per leaf, got "
                     f"{type(segments).__name__}")
  if len(segments) != num_leaves:
    raise ValueError(f"segments: expected {num_leaves} arrays (one per leaf), got "
                     f"{len(segments)}")
  return num_systems


def check_segment(i: int, leaf_shape: tuple, seg_shape: tuple, seg_dtype: Any) -> None:
  """Rule 13 (static part of one leaf): an integer id array of shape (rows,)."""
  check_leaf_has_rows(i, leaf_shape)
  dt = np.dtype(seg_dtype)
  _check_ids(i, leaf_shape, seg_shape, dt.kind in "iu", dt.name)


def check_segment_ids(i: int, leaf_shape: tuple, seg_shape: tuple, is_integer: bool,
                      dtype_name: str) -> None:
  """``check_segment`` for ids whose dtype numpy cannot read (torch's): given by its kind."""
  check_leaf_has_rows(i, leaf_shape)
  _check_ids(i, leaf_shape, seg_shape, is_integer, dtype_name)


def check_leaf_has_rows(i: int, leaf_shape: tuple) -> None:
  """Rule 13: a leaf given system ids has rows (is not 0-d)."""
  if len(leaf_shape) == 0:
    raise ValueError(f"leaves[{i}]: a 0-d leaf has no rows to assign with segments[{i}]")


def _check_ids(i: int, leaf_shape: tuple, seg_shape: tuple, is_integer: bool,
               dtype_name: str) -> None:
  if not is_integer:
    raise ValueError(f"segments[{i}]: expected an integer array for leaves[{i}], got dtype "
                     f"{dtype_name}")
  if tuple(seg_shape) != (leaf_shape[0],):
    raise ValueError(f"segments[{i}]: expected shape ({leaf_shape[0]},) to match the rows of "
                     f"leaves[{i}], got {tuple(seg_shape)}")


def check_segment_range(i: int, lo: int, hi: int, num_systems: int, seg=None) -> None:
  """Rule 13 (values): every id in [0, num_systems)."""
  if lo < 0 or hi >= num_systems:
    bad = lo if lo < 0 else hi
    if seg is not None:
      seg = np.asarray(seg)
      bad = int(seg[(seg < 0) | (seg >= num_systems)][0])
    raise ValueError(f"segments[{i}]: system id {bad} of leaves[{i}] is outside "
                     f"[0, {num_systems})")
