"""The call's one host transfer: every device value the host must see, read together.

On a GPU each read of a device value on the host waits for the device (a synchronization),
so the CUDA route collects what it needs -- the argument checks that depend on device values
(segment ids in range, tensor thresholds), the count of near-ties, which output branches are
needed -- into one int64 buffer and reads it once. More reads happen only for a near-tie (the
exact path) or an argument error.
"""

from __future__ import annotations

import numpy as np
import torch


class HostRead:
  """Device values gathered under names, then read in one transfer (``read``)."""

  def __init__(self) -> None:
    self._parts: list[torch.Tensor] = []
    self._fields: dict[str, tuple[int, int, str]] = {}
    self._size = 0

  def add(self, name: str, values: torch.Tensor) -> None:
    """Adds a tensor (any shape; float64, integer or bool) to be read as ``name``."""
    if values.dtype == torch.float64:
      kind, bits = "float64", values.reshape(-1).view(torch.int64)
    else:
      kind, bits = ("bool" if values.dtype == torch.bool else "int64"), values.reshape(-1)
      if bits.dtype != torch.int64:
        bits = bits.to(torch.int64)
    self._fields[name] = (self._size, self._size + bits.numel(), kind)
    self._size += bits.numel()
    self._parts.append(bits)

  def read(self) -> dict[str, np.ndarray]:
    """Every added tensor as a flat numpy array, from one device-to-host copy."""
    if not self._parts:
      return {}
    buffer = self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)
    host = buffer.cpu().numpy()
    out = {}
    for name, (start, stop, kind) in self._fields.items():
      part = host[start:stop]
      out[name] = part.view(np.float64) if kind == "float64" else (
          part.astype(bool) if kind == "bool" else part)
    return out
