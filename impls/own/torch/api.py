"""The canonical API over torch tensors: checks, layout, passes, decisions, outputs."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from clipbench.impls.own.torch.arguments import (check_leaves_and_dtypes, check_nonfinite,
                                                 check_norm_type, check_segments,
                                                 check_threshold)
from clipbench.impls.own.torch.eager_passes import EagerKernels
from clipbench.impls.own.torch.layout import make_batch, sanitize
from clipbench.impls.own.torch import host_route, sharded
from clipbench.protocol import ANY_NORM_TYPE, NONFINITE_MODES, Capabilities


class _Call(NamedTuple):
  """One call's arguments past the leaves, as the caller gave them (unchecked)."""

  op: str
  threshold: Any
  threshold_name: str  # "max_norm" or "max_step": the name error messages use
  segments: Any
  num_systems: Any
  norm_type: Any
  nonfinite: Any


class TorchClipping:
  """The canonical API over torch tensors (eager, compiled or Triton passes)."""

  framework = "torch"

  def __init__(self, kernels: EagerKernels, description: str,
               transforms: tuple[str, ...] = (), certified: bool = True,
               devices: tuple[str, ...] | None = None, cpu_kernels: bool = True):
    self.kernels = kernels
    self.cpu_kernels = cpu_kernels  # CPU tensors go to the numba kernels (:mod:`.host_route`)
    self.description = description
    self.certified = certified
    if devices is None:
      devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    self.capabilities = Capabilities(
        per_system=True, per_system_max=True, norm_types=ANY_NORM_TYPE,
        nonfinite=NONFINITE_MODES, transforms=transforms, devices=devices)
    self.version = torch.__version__

  def clip_by_global_norm(self, leaves, max_norm, *, segments=None, num_systems=None,
                          norm_type=2.0, nonfinite="propagate"):
    """Scales each system so that its p-norm is at most ``max_norm``; returns (leaves, norms)."""
    return self._run(leaves, _Call("clip_by_global_norm", max_norm, "max_norm", segments,
                                   num_systems, norm_type, nonfinite))

  def clip_by_max_step(self, leaves, max_step, *, segments=None, num_systems=None,
                       nonfinite="propagate"):
    """Scales each system so that its largest step vector norm is at most ``max_step``."""
    return self._run(leaves, _Call("clip_by_max_step", max_step, "max_step", segments,
                                   num_systems, 2.0, nonfinite))

  def clip_grad_norm(self, leaves, max_norm, *, norm_type=2.0, nonfinite="propagate"):
    """Global p-norm clipping of all leaves together; returns (leaves, 0-d total norm)."""
    out, norms = self._run(leaves, _Call("clip_grad_norm", max_norm, "max_norm", None, None,
                                         norm_type, nonfinite))
    return out, norms.reshape(())

  def _run(self, leaves: Any, call: _Call) -> tuple[list[torch.Tensor], torch.Tensor]:
    if sharded.has_dtensor(leaves):
      return sharded.clip_sharded(self, leaves, call)
    op = call.op
    leaves, dtypes = check_leaves_and_dtypes(leaves)
    on_host = self.cpu_kernels and host_route.applies(leaves)
    device = leaves[0].device if leaves else torch.device("cpu")
    segs, K = check_segments(leaves, call.segments, call.num_systems, ids_on_device=not on_host)
    threshold = check_threshold(call.threshold, call.threshold_name,
                                None if op == "clip_grad_norm" else K,
                                device=None if on_host else device)
    p = 2.0 if op == "clip_by_max_step" else check_norm_type(call.norm_type)
    nonfinite = check_nonfinite(call.nonfinite)
    if on_host:
      norm64 = torch.float64 in dtypes
      return host_route.clip(op, leaves, segs, K, np.broadcast_to(threshold.values, (K,)), p,
                             nonfinite, torch.float64 if norm64 else torch.float32)
    kind = ("step" if op == "clip_by_max_step" else "max" if p == math.inf else
            "min" if p == -math.inf else "sum")
    with torch.no_grad():
      batch = self.kernels.prepare(make_batch(leaves, segs, K, dtypes))
      if nonfinite == "zero":
        batch = sanitize(batch)
      plan = self.kernels.plan(batch, kind, p, threshold, self.certified)
      out = self.kernels.apply(batch, plan)
    return out, plan.norms.to(torch.float64 if batch.norm64 else torch.float32)


eager = TorchClipping(EagerKernels(), "torch eager: the numba kernels on CPU tensors; on CUDA "
                      "certified float64 sums, exact near-ties")
