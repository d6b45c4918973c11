"""The CPU route: tensors on the CPU are clipped by the numba kernels, read and written in place.

Why: torch's CPU kernels reduce in float32 or, for exact float64 sums, need a converted copy of
every leaf, and the per-system scatter and gather passes of the torch route are several times
the memory roofline; the numba kernels are at it (``docs/cpu-kernels.md``). ``Tensor.numpy()``
and ``torch.from_numpy`` share memory, so the leaves are read in place and the kernels' output
arrays (recycled buffers, no page faults) become the output tensors without a copy. Global
clipping of C-contiguous leaves hands the kernels their addresses instead of arrays
(:func:`leaves_at`): on many small leaves, making an array per leaf was most of the call.

The bits are the numba kernels' (exact decisions, batch-invariant by their fixed block order):
the CUDA route (torch passes or Triton) computes the torch canonical factor instead, so a CPU
and a CUDA call may differ in the last bits of the factor, each conforming. The eager and
compiled implementations share this route on the CPU, so they agree bit for bit there, and
neither compiles anything on the CPU (no recompilation when row counts change).
"""

from __future__ import annotations

import operator
from typing import Any

import ml_dtypes
import numpy as np
import torch

from clipbench.impls.own.numba import api as numba_api
from clipbench.impls.own.numba.buffers import LeavesAt
from clipbench.impls.own.torch import branches

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_VIEWABLE = frozenset((torch.float32, torch.float64, torch.float16))  # Tensor.numpy() types
_NUMPY_DTYPE = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                torch.float16: np.dtype(np.float16), torch.bfloat16: _BFLOAT16}
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def applies(leaves: list[torch.Tensor]) -> bool:
  """The route takes every call on CPU tensors (outputs never carry an autograd graph, as on
  the CUDA route, which runs under ``torch.no_grad``). The leaves are checked ones
  (``arguments.check_leaves``), so all on one device: the first leaf's says."""
  return not leaves or branches.on_host(leaves[0].device)


def to_numpy(x: torch.Tensor) -> np.ndarray:
  """A numpy view of a CPU tensor (bfloat16 through its bits; a copy only if not contiguous)."""
  x = x.detach().resolve_neg()
  if not x.is_contiguous():
    x = x.contiguous()
  if x.dtype == torch.bfloat16:
    return x.view(torch.int16).numpy().view(_BFLOAT16)
  return x.numpy()


def numpy_views(leaves: list[torch.Tensor]) -> list[np.ndarray]:
  """:func:`to_numpy` of each leaf; for the usual call (contiguous float16, float32 or float64
  tensors outside autograd) by C-level maps over the leaves, a call may have 10,000."""
  if (set(map(_DTYPE, leaves)) <= _VIEWABLE and all(map(torch.Tensor.is_contiguous, leaves))
      and not any(map(_REQUIRES_GRAD, leaves)) and not any(map(torch.Tensor.is_neg, leaves))):
    return list(map(torch.Tensor.numpy, leaves))
  return [to_numpy(x) for x in leaves]


def leaves_at(leaves: list[torch.Tensor]) -> LeavesAt | None:
  """The leaves by address, shape and dtype (no array made per leaf), or None unless every
  one is C-contiguous and reads as its values (no negation bit: a view whose memory holds
  the negated values)."""
  if not all(map(torch.Tensor.is_contiguous, leaves)) or any(map(torch.Tensor.is_neg, leaves)):
    return None
  return LeavesAt(np.fromiter(map(torch.Tensor.data_ptr, leaves), np.int64, len(leaves)),
                  tuple(map(_SHAPE, leaves)),
                  tuple(map(_NUMPY_DTYPE.__getitem__, map(_DTYPE, leaves))), readonly=True)


def to_tensors(arrays: list[np.ndarray]) -> list[torch.Tensor]:
  """:func:`to_tensor` of each array (a C-level map when none is bfloat16)."""
  if _BFLOAT16 in set(map(_DTYPE, arrays)):
    return [to_tensor(a) for a in arrays]
  return list(map(torch.from_numpy, arrays))


def to_tensor(a: np.ndarray) -> torch.Tensor:
  """A tensor sharing a numpy array's memory (bfloat16 through its bits)."""
  if a.dtype == _BFLOAT16:
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
  return torch.from_numpy(a)


def clip(op: str, leaves: list[torch.Tensor], segments: list[torch.Tensor] | None,
         num_systems: int, c: np.ndarray, p: float, nonfinite: str,
         norm_dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
  """(outputs, per-system norms) of checked arguments, by the numba kernels.

  Inside a graph it runs as the custom operator ``clipbench::numba_clip``, so that in a user's
  ``torch.compile`` graph it is one opaque node (dynamo does not trace the kernels' NumPy
  code, and a new row count needs no recompilation: the fake implementation gives the
  output shapes symbolically)."""
  if not torch.compiler.is_compiling():
    # Outside a graph the operator's dispatch adds nothing but its output-aliasing check,
    # which is quadratic in the number of leaves (a third of a second for 10,000).
    return _run_kernels(op, leaves, segments, num_systems, np.asarray(c, np.float64), p,
                        nonfinite, norm_dtype)
  results = numba_clip(list(leaves), list(segments or []), torch.from_numpy(np.asarray(
      c, np.float64).reshape(-1)), op, float(p), nonfinite, int(num_systems),
      segments is not None, norm_dtype == torch.float64)
  return results[:-1], results[-1]


@torch.library.custom_op("clipbench::numba_clip", mutates_args=(), device_types="cpu")
def numba_clip(leaves: list[torch.Tensor], segments: list[torch.Tensor], c: torch.Tensor,
               op: str, p: float, nonfinite: str, num_systems: int, has_segments: bool,
               norm64: bool) -> list[torch.Tensor]:
  """The outputs, then the per-system norms."""
  outs, norms = _run_kernels(op, leaves, segments if has_segments else None, num_systems,
                             c.numpy(), p, nonfinite,
                             torch.float64 if norm64 else torch.float32)
  return outs + [norms]


@numba_clip.register_fake
def _numba_clip_shapes(leaves, segments, c, op, p, nonfinite, num_systems, has_segments,
                       norm64):
  norms = torch.empty(num_systems if has_segments else 1,
                      dtype=torch.float64 if norm64 else torch.float32)
  return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in leaves] + [norms]


def _run_kernels(op: str, leaves: list[torch.Tensor], segments: list[torch.Tensor] | None,
                 num_systems: int, c: np.ndarray, p: float, nonfinite: str,
                 norm_dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
  kwargs: dict[str, Any] = {"nonfinite": nonfinite}
  if op == "clip_grad_norm":
    at = leaves_at(leaves)
    if at is not None:
      outs, norms = numba_api.clip_grad_norm_at(at, float(c.reshape(-1)[0]), p, nonfinite)
    else:
      outs, norms = numba_api.clip_grad_norm(numpy_views(leaves), c.reshape(-1)[0],
                                             norm_type=p, **kwargs)
  else:
    host = numpy_views(leaves)
    kwargs.update(segments=None if segments is None else [to_numpy(g) for g in segments],
                  num_systems=num_systems if segments is not None else None)
    threshold = c if segments is not None else c.reshape(-1)[0]
    if op == "clip_by_max_step":
      outs, norms = numba_api.clip_by_max_step(host, threshold, **kwargs)
    else:
      outs, norms = numba_api.clip_by_global_norm(host, threshold, norm_type=p, **kwargs)
  norms = torch.from_numpy(np.ascontiguousarray(np.asarray(norms).reshape(-1)))
  return to_tensors(outs), norms.to(norm_dtype)
