"""Adapter: ``mlx.optimizers.clip_grad_norm`` (global L2 clipping) on MLX's CPU device.

Library call, as an MLX user writes it::

  clipped, total_norm = mlx.optimizers.clip_grad_norm(grads, max_norm)

Rule (MLX 0.32.4, ``mlx/optimizers/optimizers.py``)::

  if max_norm < 0: raise ValueError
  n   = sqrt(sum over leaves of sum(g**2))   # float16 leaves squared in float32, others in
                                             # their own dtype (bfloat16 sums in bfloat16)
  s   = minimum(max_norm / (n + 1e-6), 1.0)
  out = (g * s).astype(g.dtype)              # every element multiplied, ties scaled below 1

MLX is none of the suite's frameworks, so the adapter declares ``framework = "numpy"`` and moves
each leaf into an ``mx.array`` and back, bit for bit: float64 is requested explicitly (a bare
``mx.array`` of a float64 numpy array is float32) and bfloat16 comes back through its bits.
MLX runs here on its CPU device (the ``mlx[cpu]`` Linux wheels); nothing else is changed.
"""

from __future__ import annotations

from typing import Any, Sequence

import ml_dtypes
import numpy as np

import mlx.core as mx
from mlx.optimizers import clip_grad_norm as mlx_clip_grad_norm

from clipbench.impls.adapters import _common
from clipbench.protocol import Capabilities

_LIBRARY = "mlx.optimizers.clip_grad_norm"
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def to_mlx(x: np.ndarray) -> mx.array:
  """``x`` as an ``mx.array`` of the same dtype, bit for bit."""
  x = np.asarray(x)
  if x.dtype == np.float64:
    return mx.array(x, dtype=mx.float64)
  return mx.array(x)


def from_mlx(a: mx.array) -> np.ndarray:
  """An ``mx.array`` as numpy, bit for bit (bfloat16 through its bits)."""
  if a.dtype == mx.bfloat16:
    return np.array(a.view(mx.uint16)).view(_BFLOAT16)
  return np.array(a)


class MlxClipGradNorm:
  """``mlx.optimizers.clip_grad_norm(grads, max_norm)`` on a list of ``mx.array`` leaves."""

  framework = "numpy"
  library = "mlx"
  version = mx.__version__
  name = "mlx.clip_grad_norm"
  description = ("mlx.optimizers.clip_grad_norm(grads, max_norm) on the CPU: scale "
                 "min(max/(norm+1e-6), 1), float16 squares summed in float32")
  # Global L2 only; all four float dtypes and mixtures (each leaf keeps its dtype): exactly
  # Capabilities' defaults.
  capabilities = Capabilities()
  # The library call a bug report would show (the suite's reproducer appends it).
  reproducer = ("import mlx.core as mx\nfrom mlx.optimizers import clip_grad_norm\n"
                "grads = [mx.array(x, dtype=mx.float64) if x.dtype == np.float64 else "
                "mx.array(x) for x in leaves]\n"
                "out, norm = clip_grad_norm(grads, threshold)\nprint(out, norm)")

  def clip_grad_norm(self, leaves: Sequence[np.ndarray], max_norm: float, *,
                     norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[np.ndarray], np.ndarray]:
    # Neither option exists in MLX's API: refuse instead of emulating.
    _common.require_l2_propagate(norm_type, nonfinite, _LIBRARY)
    grads = [to_mlx(x) for x in leaves]
    clipped, total_norm = mlx_clip_grad_norm(grads, max_norm)
    return [from_mlx(g) for g in clipped], from_mlx(mx.array(total_norm))


clip_grad_norm = MlxClipGradNorm()
