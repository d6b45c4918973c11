"""Argument checks for torch tensors: adapters over the shared checks (rules 6, 9, 10, 13).

The rules and their messages live once, in :mod:`clipbench.impls.own.validation`; what is here
only turns torch objects into what those checks read (a torch dtype into its name and kind),
plus what only torch has: one device for all leaves, and checks of device values left to the
device (segment ids in range, tensor thresholds), read back with the call's one host transfer.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Sequence

import numpy as np
import torch

from clipbench.impls.own import validation
from clipbench.impls.own.torch.host_read import HostRead
from clipbench.impls.own.validation import check_nonfinite, check_norm_type

__all__ = ["Threshold", "check_leaves", "check_leaves_and_dtypes", "check_threshold",
           "check_norm_type", "check_nonfinite", "check_segments"]


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
  return str(dtype).removeprefix("torch.")


def check_leaves(leaves: Any) -> list[torch.Tensor]:
  """Rule 9: a list of torch tensors of float16, bfloat16, float32 or float64, one device."""
  return check_leaves_and_dtypes(leaves)[0]


def check_leaves_and_dtypes(leaves: Any) -> tuple[list[torch.Tensor], tuple[torch.dtype, ...]]:
  """:func:`check_leaves`, and the leaves' dtypes, read once (a call may have 10,000 leaves,
  and the layout reads them too: ``layout.make_batch``)."""
  if not isinstance(leaves, (list, tuple)):
    raise TypeError(f"leaves: expected a list of tensors, got {type(leaves).__name__}")
  dtypes = _dtypes_if_all_valid(leaves)
  if dtypes is not None:
    return list(leaves), dtypes
  device = None
  for i, leaf in enumerate(leaves):
    if not isinstance(leaf, torch.Tensor):
      raise TypeError(f"leaves[{i}]: expected a torch.Tensor, got {type(leaf).__name__}")
    validation.check_leaf_dtype_name(i, _dtype_name(leaf.dtype))
    if device is None:
      device = leaf.device
    elif leaf.device != device:
      raise ValueError(f"leaves[{i}]: on {leaf.device}, expected {device} like leaves[0]")
  return list(leaves), tuple(leaf.dtype for leaf in leaves)


def _dtypes_if_all_valid(leaves: Sequence[Any]) -> tuple[torch.dtype, ...] | None:
  """The leaves' dtypes if every leaf passes :func:`check_leaves`, else None, found with
  C-level maps over the leaves (a call may have 10,000); when not, the leaf by leaf walk
  names the first bad one."""
  if not all(issubclass(kind, torch.Tensor) for kind in set(map(type, leaves))):
    return None
  dtypes = tuple(map(operator.attrgetter("dtype"), leaves))
  try:
    for dtype in set(dtypes):
      validation.check_leaf_dtype_name(0, _dtype_name(dtype))
  except (TypeError, ValueError):
    return None
  if len(set(map(operator.attrgetter("device"), leaves))) > 1:
    return None
  return dtypes


@dataclasses.dataclass
class Threshold:
  """A checked threshold: values on the host, or a tensor whose values the device checks.

  A tensor threshold on the leaves' device is checked there: its shape and dtype at once,
  its values (NaN, negative) on the device, read with the call's one host transfer
  (:meth:`check_on_device`, then :meth:`raise_if_bad`).
  """

  name: str
  values: np.ndarray | None = None  # float64, one per system (one when ``scalar``)
  tensor: torch.Tensor | None = None  # float64, flat: one value, or one per system
  scalar: bool = True

  def on(self, device: torch.device) -> torch.Tensor:
    """The thresholds as a float64 device tensor of one value, or one per system."""
    if self.tensor is not None:
      return self.tensor.to(device)
    if self.values.size == 1:
      return torch.full((1,), float(self.values[0]), dtype=torch.float64, device=device)
    out = torch.empty(self.values.shape, dtype=torch.float64, device=device)
    return out.copy_(torch.from_numpy(self.values))

  def check_on_device(self, reader: HostRead) -> None:
    """Adds the index of the first bad value (or -1) and that value to the host read."""
    if self.tensor is None:
      return
    t = self.tensor
    bad = torch.isnan(t) | (t < 0)
    index = torch.arange(t.numel(), device=t.device)
    first = torch.where(bad, index, t.numel()).amin()
    reader.add(f"{self.name}:bad", torch.stack([first, t[first.clamp(max=t.numel() - 1)]
                                                .view(torch.int64)]))

  def raise_if_bad(self, read: dict[str, np.ndarray]) -> None:
    """Raises the host check's error for the first bad value the device found, if any."""
    if self.tensor is None:
      return
    first, bits = (int(v) for v in read[f"{self.name}:bad"])
    if first >= self.tensor.numel():
      return
    value = np.array([bits], np.int64).view(np.float64)[0]
    if self.scalar:
      validation.check_threshold(value, self.name, None)
    values = np.zeros(self.tensor.numel())
    values[first] = value
    validation.check_threshold(values, self.name, values.size)


def _placeholder(t: torch.Tensor) -> np.ndarray:
  """An array of a tensor's shape and dtype kind, for the shared checks of shape and dtype."""
  dtype = (np.bool_ if t.dtype == torch.bool else np.complex128 if t.dtype.is_complex else
           np.float64 if t.dtype.is_floating_point else np.int64)
  return np.zeros(tuple(t.shape), dtype)


def check_threshold(value: Any, name: str, num_systems: int | None,
                    device: torch.device | None = None) -> Threshold:
  """Rule 6: a float >= 0 (+inf allowed) or, per system, an array of shape (num_systems,).

  ``num_systems`` None means a scalar only (``clip_grad_norm``). A tensor on ``device`` keeps
  its values there (checked by the device); anything else is checked here, on the host.
  """
  if isinstance(value, torch.Tensor) and device is not None and value.device == device:
    validation.check_threshold(_placeholder(value), name, num_systems)  # shape and dtype
    return Threshold(name, tensor=value.detach().reshape(-1).to(torch.float64),
                     scalar=value.dim() == 0)
  if isinstance(value, torch.Tensor):
    value = value.detach().cpu().numpy()
  checked = validation.check_threshold(value, name, num_systems)
  if isinstance(checked, np.ndarray):
    return Threshold(name, values=checked, scalar=False)
  return Threshold(name, values=np.full(1, checked, dtype=np.float64))


def check_segments(leaves: Sequence[torch.Tensor], segments: Any, num_systems: Any,
                   ids_on_device: bool = False) -> tuple[list[torch.Tensor] | None, int]:
  """Rule 13: one integer id tensor per leaf, of length leaf.shape[0], ids in [0, K).

  Returns the ids as int64 tensors on the leaves' device (None when ``segments`` is None)
  and the number of systems K (1 when ``segments`` is None). With ``ids_on_device`` the ids'
  range is left to the device (the kernels' ``prepare``, read with the call's one host
  transfer); the rest is checked here.
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
    if seg.numel() and not ids_on_device:
      lo, hi = torch.aminmax(seg)
      validation.check_segment_range(i, int(lo), int(hi), num_systems)
    checked.append(seg)
  return checked, num_systems
