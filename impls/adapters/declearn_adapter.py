"""Thin adapters over declearn's ``L2GlobalClipping`` optimizer plug-in (global L2 clipping).

declearn's ``L2GlobalClipping(max_norm).run(gradients)`` computes, on a declearn ``Vector``
(a flat dict ``{name: array}``), the per-coefficient sums of squares ``(g**2).sum()``, adds them
with Python's ``sum`` (starting at 0), takes ``** 0.5``, and returns ``g * min((norm / max)**-1,
1)`` (``max / norm`` on a Vector is implemented as ``(norm / max) ** -1``). It returns a new
Vector (functional) and no norm. An empty Vector is returned as is.

Two vector types are wrapped, each built as declearn users build them:

* ``l2_global_clipping_numpy``: ``declearn.model.sklearn.NumpyVector`` of numpy arrays;
* ``l2_global_clipping_torch``: ``declearn.model.torch.TorchVector`` of torch tensors.

Leaves become the coefficients ``{"leaf0": x0, "leaf1": x1, ...}`` in order (dicts keep insertion
order, so the sum runs in leaf order) and the output coefficients are read back in the same
order. Nothing is validated or converted on declearn's behalf: its dtype promotions (float16 ->
float32 on a TorchVector, float32 + float64 -> float64 on a NumpyVector) and its results are what
the suite sees.

Only ``declearn.model.sklearn`` and ``declearn.model.torch`` are imported: importing
``declearn.model.haiku`` would switch on ``jax_enable_x64`` for the whole process.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from clipbench.impls import frameworks
from clipbench.impls.adapters import _common
from clipbench.protocol import Capabilities

from declearn.model.sklearn import NumpyVector  # pylint: disable=g-bad-import-order
from declearn.optimizer.modules import L2GlobalClipping

# The torch adapter needs torch; without it only that adapter is unavailable.
try:
  import torch
  from declearn.model.torch import TorchVector
  _TORCH_MISSING = ""
except ImportError as e:  # pragma: no cover - torch is installed in the project environment
  torch = TorchVector = None
  _TORCH_MISSING = f"not installed: {e.name or e}"


def _names(n: int) -> list[str]:
  return [f"leaf{i}" for i in range(n)]


def _check_options(norm_type: float, nonfinite: str) -> None:
  # Neither option exists in declearn's module: refuse instead of emulating.
  _common.require_l2_propagate(norm_type, nonfinite, "declearn L2GlobalClipping")


def _capabilities() -> Capabilities:
  # Global L2 only, no norm returned, functional. Both vector types accept float16, bfloat16
  # (numpy through ml_dtypes), float32, float64 and mixtures (they run, promoting dtypes).
  return Capabilities(returns_norm=False)


def _description(vector_type: str) -> str:
  return (f"declearn L2GlobalClipping on a {vector_type}: scale min((norm/max)**-1, 1), "
          "norm = (sum of per-leaf sums of squares) ** 0.5; no norm returned")


def _clip(vector_type: type, leaves: Sequence[Any], max_norm: float) -> list[Any]:
  """``L2GlobalClipping(max_norm).run`` on the leaves as one declearn vector, leaf order kept."""
  names = _names(len(leaves))
  clipped = L2GlobalClipping(max_norm).run(vector_type(dict(zip(names, leaves))))
  return [clipped.coefs[k] for k in names]


class L2GlobalClippingNumpy:
  """``L2GlobalClipping(max_norm).run(NumpyVector({...}))``."""

  framework = "numpy"
  capabilities = _capabilities()
  # The library call a bug report would show (the suite's reproducer appends it).
  reproducer = ("from declearn.model.sklearn import NumpyVector\n"
                "from declearn.optimizer.modules import L2GlobalClipping\n"
                "vector = NumpyVector({f'leaf{i}': x for i, x in enumerate(leaves)})\n"
                "print(L2GlobalClipping(threshold).run(vector).coefs)")
  description = _description("NumpyVector")

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: float, *, norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[np.ndarray], None]:
    _check_options(norm_type, nonfinite)
    return _clip(NumpyVector, leaves, max_norm), None


class L2GlobalClippingTorch:
  """``L2GlobalClipping(max_norm).run(TorchVector({...}))``."""

  framework = "torch"
  available = not _TORCH_MISSING
  unavailable_reason = _TORCH_MISSING
  capabilities = _capabilities()
  # The library call a bug report would show (the suite's reproducer appends it).
  reproducer = ("import torch\nfrom declearn.model.torch import TorchVector\n"
                "from declearn.optimizer.modules import L2GlobalClipping\n"
                "vector = TorchVector({f'leaf{i}': torch.from_numpy(x.copy()) "
                "for i, x in enumerate(leaves)})\n"
                "print(L2GlobalClipping(threshold).run(vector).coefs)")
  description = _description("TorchVector")

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: float, *, norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[Any], None]:
    _check_options(norm_type, nonfinite)
    tensors = [x if isinstance(x, torch.Tensor) else frameworks.to_framework(x, "torch")
               for x in leaves]
    return _clip(TorchVector, tensors, max_norm), None


l2_global_clipping_numpy = L2GlobalClippingNumpy()
l2_global_clipping_torch = L2GlobalClippingTorch()
