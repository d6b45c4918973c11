"""Argument checks shared by the three operations (SPEC rules 6, 9, 10 and 13).

Every check runs before any work and raises with a message that starts with the name of the
offending argument (``leaves[2]``, ``max_norm``, ``norm_type``, ``segments[1]``, ...), the way
torch's OpInfo ``error_inputs`` pin both the type and the message.

These checks are written independently of the own implementations' (``impls/own/validation``)
on purpose: the reference is the oracle they are judged against, and an oracle sharing their
code would share their mistakes.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from typing import Any, Sequence

import numpy as np

from clipbench.reference.formats import FORMATS

SUPPORTED_DTYPES = tuple(FORMATS)
NONFINITE_MODES = ("propagate", "zero")


def check_leaves(leaves: Any) -> list[np.ndarray]:
  """Rule 9: a list of numpy arrays of float16, bfloat16, float32 or float64."""
  if not isinstance(leaves, (list, tuple)):
    raise TypeError(f"leaves: expected a list of arrays, got {type(leaves).__name__}")
  leaves = [np.asarray(leaf) if isinstance(leaf, np.generic) else leaf for leaf in leaves]
  for i, leaf in enumerate(leaves):
    if not isinstance(leaf, np.ndarray):
      raise TypeError(f"leaves[{i}]: expected a numpy.ndarray, got {type(leaf).__name__}")
    if leaf.dtype.name not in SUPPORTED_DTYPES:
      raise TypeError(f"leaves[{i}]: dtype {leaf.dtype.name} is not supported; expected one of "
                      f"{', '.join(SUPPORTED_DTYPES)}")
  return leaves


def check_threshold(value: Any, name: str, num_systems: int | None) -> list[Fraction | float]:
  """Rule 6: a float >= 0 (inf allowed) or one per system; returns one exact value per system.

  ``num_systems`` None means the operation takes a scalar only (``clip_grad_norm``).
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}: expected a float, got bool")
  if isinstance(value, np.ndarray) and value.ndim > 0:
    if num_systems is None:
      raise ValueError(f"{name}: expected a scalar, got an array of shape {value.shape}")
    if value.shape != (num_systems,):
      raise ValueError(
          f"{name}: expected a scalar or an array of shape ({num_systems},), got shape "
          f"{value.shape}")
    if value.dtype.kind not in "fiu":
      raise TypeError(f"{name}: expected a real array, got dtype {value.dtype.name}")
    values = [_check_one_threshold(v, f"{name}[{k}]") for k, v in enumerate(value.tolist())]
    return values
  if isinstance(value, np.ndarray):
    value = value[()]
  if not isinstance(value, numbers.Real):
    raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
  one = _check_one_threshold(value, name)
  return [one] * (1 if num_systems is None else num_systems)


def _check_one_threshold(v: Any, name: str) -> Fraction | float:
  v = float(v)
  if math.isnan(v):
    raise ValueError(f"{name}: must not be NaN")
  if v < 0:
    raise ValueError(f"{name}: must be >= 0, got {v!r}")
  return math.inf if v == math.inf else Fraction(v)


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


def check_segments(leaves: Sequence[np.ndarray], segments: Any,
                   num_systems: Any) -> tuple[list[np.ndarray], int]:
  """Rule 13: one integer id array per leaf, of length leaf.shape[0], ids in [0, num_systems).

  With ``segments`` None every row belongs to system 0 of 1.
  """
  if segments is None:
    if num_systems not in (None, 1):
      raise ValueError(f"num_systems: must be None or 1 when segments is None, got {num_systems!r}")
    return [np.zeros(leaf.shape[0] if leaf.ndim else 1, dtype=np.int64) for leaf in leaves], 1
  if num_systems is None:
    raise ValueError("num_systems: required when segments is given")
  if isinstance(num_systems, (bool, np.bool_)) or not isinstance(num_systems, numbers.Integral):
    raise ValueError(f"num_systems: expected an integer >= 0, got {num_systems!r}")
  num_systems = int(num_systems)
  if num_systems < 0:
    raise ValueError(f"num_systems: expected an integer >= 0, got {num_systems}")
  if not isinstance(segments, (list, tuple)):
    raise ValueError(
        f"segments: expected None or a list of one integer array per leaf, got "
        f"{type(segments).__name__}")
  if len(segments) != len(leaves):
    raise ValueError(
        f"segments: expected {len(leaves)} arrays (one per leaf), got {len(segments)}")
  checked = []
  for i, (leaf, seg) in enumerate(zip(leaves, segments)):
    seg = np.asarray(seg)
    if leaf.ndim == 0:
      raise ValueError(f"leaves[{i}]: a 0-d leaf has no rows to assign with segments[{i}]")
    if seg.dtype.kind not in "iu":
      raise ValueError(
          f"segments[{i}]: expected an integer array for leaves[{i}], got dtype {seg.dtype.name}")
    if seg.shape != (leaf.shape[0],):
      raise ValueError(
          f"segments[{i}]: expected shape ({leaf.shape[0]},) to match the rows of leaves[{i}], "
          f"got {seg.shape}")
    if seg.size and (seg.min() < 0 or seg.max() >= num_systems):
      bad = seg[(seg < 0) | (seg >= num_systems)][0]
      raise ValueError(
          f"segments[{i}]: system id {bad} of leaves[{i}] is outside [0, {num_systems})")
    checked.append(seg.astype(np.int64))
  return checked, num_systems
