"""Which branch of the CUDA route a tensor takes: the host's, or the accelerator's.

The eager passes and the outputs are cut differently on the CPU (chunks below torch's parallel
grain, on the calling thread) and on an accelerator (whole tensors), and CPU tensors normally
go to the numba kernels (:mod:`.host_route`) before either. Counting what a CUDA call
dispatches (``clipbench.benchmarks.costs``) must see the accelerator's branches on a machine
without one, so :func:`accelerator_branches` makes CPU tensors take them, within a ``with``
block and the current thread or task only (a context variable): the outputs' bits do not
change, only how the work is cut.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

_ACCELERATOR_BRANCHES = contextvars.ContextVar("clipbench_torch_accelerator_branches",
                                               default=False)
_HOST_COPIES = contextvars.ContextVar("clipbench_torch_host_copies", default=False)


def on_host(device: torch.device) -> bool:
  """Whether work on ``device`` takes the host's branches (a CPU device, not overridden)."""
  return device.type == "cpu" and not _ACCELERATOR_BRANCHES.get()


@contextlib.contextmanager
def accelerator_branches() -> Iterator[None]:
  """CPU tensors take the accelerator's branches inside the block (no numba host route)."""
  token = _ACCELERATOR_BRANCHES.set(True)
  try:
    yield
  finally:
    _ACCELERATOR_BRANCHES.reset(token)


@contextlib.contextmanager
def on_host_copies(copies: bool = True) -> Iterator[None]:
  """Marks work on the host's copies of device values (tensors a host read returned): on an
  accelerator it dispatches nothing there and waits for nothing, so a count of what a call
  dispatches leaves it out (:func:`host_copies_only`). ``copies=False``: the work is on the
  device's own tensors, counted as usual."""
  if not copies:
    yield
    return
  token = _HOST_COPIES.set(True)
  try:
    yield
  finally:
    _HOST_COPIES.reset(token)


def host_copies_only() -> bool:
  """Whether the current work is on the host's copies (inside :func:`on_host_copies`)."""
  return _HOST_COPIES.get()
