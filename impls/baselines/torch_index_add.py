"""Baseline: per-system clipping written plainly in eager torch with ``index_add_``.

This is the implementation a torch user of batched simulations writes first (torch-sim's
``batched_vdot`` is the same pattern), and the bar the own torch kernels must meet on W2/W3 and
max-step (issue 17). It is the torch twin of ``baseline.jax-segment-sum``: deliberately plain,
with no care for the rules of SPEC.md beyond the obvious; its departures are recorded in the
conformance manifest.

  clip_by_global_norm:  n_k = sqrt(index_add_(sum(x_row ** 2)))              over every leaf
                        out   = x * min(1, c_k / n_k)[segment of the row]
  clip_by_max_step:     m_k = scatter_reduce_(max(||x_vector||_2), "amax")  over every leaf
                        out   = x * min(1, c_k / m_k)[segment of the row]

The factor is the plain ``min(1, c / n)`` (``(c / n).clamp(max=1)``), not torch
``clip_grad_norm_``'s ``c / (n + 1e-6)``: the epsilon clips systems already within the bound
and hides nothing a user of per-system clipping needs hidden. ``clamp`` lets a NaN factor
through, so a system whose norm is NaN comes back NaN.

Sums are taken in float32 for float16/bfloat16/float32 leaves (float64 if any leaf is), the
factor is applied in that dtype and the product rounded to the leaf dtype. ``segments=None``
is one system. Only the L2 norm and non-finite propagation exist. Called eagerly, as written.
The per-row gather of the factor is ``index_select`` rather than ``factor[seg]``: the same
values, and advanced indexing runs several times slower on CPU tensors, so the bar is not
lowered by an idiom.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from clipbench.impls import frameworks
from clipbench.impls.adapters import _common
from clipbench.protocol import Capabilities

framework = "torch"
library = "torch"
version = torch.__version__
description = "plain torch index_add_ / scatter_reduce_ clipping, eager"
capabilities = Capabilities(
    per_system=True, per_system_max=True, norm_types=(2.0,), nonfinite=("propagate",),
    returns_norm=True, in_place=False, mixed_dtypes=True,
    devices=("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))

_NAME = "the index_add_ baseline"


def _as_tensor(leaf: Any) -> torch.Tensor:
  return leaf if isinstance(leaf, torch.Tensor) else frameworks.to_framework(leaf, "torch")


def _accumulation_dtype(leaves: Sequence[torch.Tensor]) -> torch.dtype:
  return torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32


def _device(leaves: Sequence[torch.Tensor]) -> torch.device:
  return leaves[0].device if leaves else torch.device("cpu")


def _rows(x: torch.Tensor) -> torch.Tensor:
  """The leaf as (rows, elements of a row); a 0-d leaf is one row."""
  return x.reshape(1, -1) if x.dim() == 0 else x.reshape(x.shape[0], -1)


def _segment_ids(leaves: Sequence[torch.Tensor], segments) -> list[torch.Tensor]:
  if segments is None:
    return [torch.zeros(_rows(x).shape[0], dtype=torch.int64, device=x.device) for x in leaves]
  return [torch.as_tensor(s) for s in segments]


def _factor(norms: torch.Tensor, threshold: Any) -> torch.Tensor:
  c = torch.as_tensor(threshold, dtype=norms.dtype, device=norms.device)
  return (c / norms).clamp(max=1.0)


def _scale(leaves, ids, factor) -> list[torch.Tensor]:
  out = []
  for x, seg in zip(leaves, ids):
    per_row = factor.index_select(0, seg)
    out.append((_rows(x).to(factor.dtype) * per_row[:, None]).to(x.dtype).reshape(x.shape))
  return out


def _num_systems(segments, num_systems: int | None) -> int:
  return 1 if segments is None else num_systems


def clip_by_global_norm(leaves: Sequence[Any], max_norm: Any, *,
                        segments: Sequence[Any] | None = None, num_systems: int | None = None,
                        norm_type: float = 2.0, nonfinite: str = "propagate"):
  _common.require_l2_propagate(norm_type, nonfinite, _NAME)
  leaves = [_as_tensor(x) for x in leaves]
  ids = _segment_ids(leaves, segments)
  acc = _accumulation_dtype(leaves)
  sq = torch.zeros(_num_systems(segments, num_systems), dtype=acc, device=_device(leaves))
  for x, seg in zip(leaves, ids):
    rows = _rows(x).to(acc)
    sq.index_add_(0, seg, (rows * rows).sum(dim=1))
  norms = sq.sqrt()
  return _scale(leaves, ids, _factor(norms, max_norm)), norms


def clip_by_max_step(leaves: Sequence[Any], max_step: Any, *,
                     segments: Sequence[Any] | None = None, num_systems: int | None = None,
                     nonfinite: str = "propagate"):
  _common.require_mode(nonfinite, ("propagate",), _NAME)
  leaves = [_as_tensor(x) for x in leaves]
  ids = _segment_ids(leaves, segments)
  acc = _accumulation_dtype(leaves)
  step = torch.zeros(_num_systems(segments, num_systems), dtype=acc, device=_device(leaves))
  for x, seg in zip(leaves, ids):
    vectors = x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() >= 2 else x.reshape(-1, 1, 1)
    lengths = torch.linalg.vector_norm(vectors.to(acc), dim=-1).amax(dim=1)
    step.scatter_reduce_(0, seg, lengths, reduce="amax")
  return _scale(leaves, ids, _factor(step, max_step)), step
