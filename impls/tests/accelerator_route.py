"""Our eager torch implementation on its CUDA route, with CPU tensors: a conformance target.

On the CPU, ``clipbench.torch`` hands CPU tensors to the numba kernels (its host route), so
the suite never sees what a GPU runs. Inside ``branches.accelerator_branches()`` CPU tensors
take the accelerator's branches instead (the CUDA route, cut as on a GPU): checked with
``pytest conformance --impl clipbench.impls.tests.accelerator_route:eager``
(``test_accelerator_route.py``).
"""

from __future__ import annotations

import dataclasses

from clipbench.impls.own.torch import branches
from clipbench.impls.own.torch import eager as _eager


class _OnAcceleratorBranches:
  """``inner``'s three operations, each run inside ``branches.accelerator_branches()``."""

  framework = "torch"

  def __init__(self, inner, name: str):
    self._inner = inner
    self.name = name
    self.version = inner.version
    self.description = inner.description + " (its CUDA route, on CPU tensors)"
    self.capabilities = dataclasses.replace(inner.capabilities, devices=("cpu",))

  def clip_by_global_norm(self, *args, **kwargs):
    with branches.accelerator_branches():
      return self._inner.clip_by_global_norm(*args, **kwargs)

  def clip_by_max_step(self, *args, **kwargs):
    with branches.accelerator_branches():
      return self._inner.clip_by_max_step(*args, **kwargs)

  def clip_grad_norm(self, *args, **kwargs):
    with branches.accelerator_branches():
      return self._inner.clip_grad_norm(*args, **kwargs)


eager = _OnAcceleratorBranches(_eager, "clipbench.torch@accelerator-branches")
