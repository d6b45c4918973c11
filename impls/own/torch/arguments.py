"""Argument checks for torch tensors: adapters over the shared checks (rules 6, 9, 10, 13).

The rules and their messages live once, in :mod:`clipbench.impls.own.validation`; what is here
only turns torch objects into what those checks read (a tensor threshold into a numpy array, a
torch dtype into its name and kind), plus what only torch has: one device for all leaves.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np
import torch

from clipbench.impls.own import validation
from clipbench.impls.own.validation import check_nonfinite, check_norm_type

__all__ = ["check_leaves", "check_threshold", "check_norm_type", "check_nonfinite",
           "check_segments"]


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
  return str(dtype).removeprefix("torch.")


def check_leaves(leaves: Any) -> list[torch.Tensor]:
  """Rule 9: a list of torch tensors of float16, bfloat16, float32 or float64, one device."""
  if not isinstance(leaves, (list, tuple)):
    raise TypeError(f"leaves: expected a list of tensors, got {type(leaves).__name__}")
  device = None
  for i, leaf in enumerate(leaves):
    if not isinstance(leaf, torch.Tensor):
      raise TypeError(f"leaves[{i}]: expected a torch.Tensor, got {type(leaf).__name__}")
    validation.check_leaf_dtype_name(i, _dtype_name(leaf.dtype))
    if device is None:
      device = leaf.device
    elif leaf.device != device:
      raise ValueError(f"leaves[{i}]: on {leaf.device}, expected {device} like leaves[0]")
  return list(leaves)


def check_threshold(value: Any, name: str, num_systems: int | None) -> np.ndarray:
  """Rule 6: a float >= 0 (+inf allowed) or, per system, an array of shape (num_systems,).

  ``num_systems`` None means a scalar only (``clip_grad_norm``). Returns float64 values, one
  per system (one when ``num_systems`` is None).
  """
  if isinstance(value, torch.Tensor):
    value = value.detach().cpu().numpy()
  checked = validation.check_threshold(value, name, num_systems)
  if isinstance(checked, np.ndarray):
    return checked
  return np.full(1 if num_systems is None else num_systems, checked, dtype=np.float64)


def check_segments(leaves: Sequence[torch.Tensor], segments: Any,
                   num_systems: Any) -> tuple[list[torch.Tensor] | None, int]:
  """Rule 13: one integer id tensor per leaf, of length leaf.shape[0], ids in [0, K).

  Returns the ids as int64 tensors on the leaves' device (None when ``segments`` is None)
  and the number of systems K (1 when ``segments`` is None).
  """
  if segments is None and isinstance(num_systems, bool):
    # The shared check takes True for 1 (True == 1); a count is never a bool.
    raise ValueError(f"num_systems: must be None or 1 when segments is None, got "
                     f"{num_systems!r}")
  num_systems = validation.check_num_systems(segments, num_systems, len(leaves))
  if segments is None:
    return None, 1
  checked = []
  for i, (leaf, seg) in enumerate(zip(leaves, segments)):
    validation.check_leaf_has_rows(i, tuple(leaf.shape))
    if not isinstance(seg, torch.Tensor):
      seg = torch.as_tensor(np.asarray(seg))
    is_integer = not (seg.dtype.is_floating_point or seg.dtype.is_complex
                      or seg.dtype == torch.bool)
    validation.check_segment_ids(i, tuple(leaf.shape), tuple(seg.shape), is_integer,
                                 _dtype_name(seg.dtype))
    seg = seg.to(device=leaf.device, dtype=torch.int64)
    if seg.numel():
      lo, hi = torch.aminmax(seg)
      validation.check_segment_range(i, int(lo), int(hi), num_systems)
    checked.append(seg)
  return checked, num_systems
