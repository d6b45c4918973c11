"""Thin adapters over torch's gradient clipping: ``torch.nn.utils.clip_grad_norm_``.

torch computes, per (device, dtype) group, the p-norm of every gradient tensor, then the p-norm
of those per-tensor norms (``total = ||(||g_1||_p, ..., ||g_k||_p)||_p``), and scales every
gradient in place by ``min(1, max_norm / (total + 1e-6))``. Users apply it to the ``.grad`` of
parameters, so the adapters do exactly that: each input tensor becomes the ``.grad`` of a
``torch.nn.Parameter`` (the same tensor object, not a copy) and the library mutates it. As in a
training loop, the parameters are built once for a set of gradient tensors and reused when the
same tensors come back (``_torch_parameters``), so a timed call is torch's call alone.

Three public entry points are wrapped, each as its users call it:

* ``clip_grad_norm_``: ``clip_grad_norm_(params, max_norm, norm_type, foreach=False)``;
* ``clip_grad_norm_foreach``: the same with ``foreach=True`` (``torch._foreach_*`` kernels);
* ``clip_grads_with_norm_``: ``get_total_norm(grads, norm_type)`` followed by
  ``clip_grads_with_norm_(params, max_norm, total_norm)`` (the two-step API of torch >= 2.6).

Nothing is validated or repaired here: whatever torch does with a threshold, a p, a dtype or a
non-finite value (including raising) is what the conformance suite sees.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from clipbench.impls import frameworks
from clipbench.impls.adapters._torch_parameters import ParametersHolding
from clipbench.protocol import ANY_NORM_TYPE, Capabilities

# torch accepts any float p (it does not reject p < 1), all four float dtypes and mixtures of
# them (grouped per dtype, the per-tensor norms promoted when stacked), and mutates the
# gradients in place.
#
# torch.compile (CPU, torch 2.14.1, measured): the foreach path (foreach=True, and the default
# foreach=None that clip_grads_with_norm_ uses) compiles and recompiles fine. The foreach=False
# path crashes on its first recompilation (new shapes, dtype or max_norm -> automatic dynamic
# shapes): "IndexError: list index out of range" in the shape-env guard builder
# (symbolic_shapes.produce_guards_verbose); dynamic=True fails with "AssertionError: sources must
# not be empty". The same happens in plain user code with parameters built outside the compiled
# function, so it is torch's, and that adapter does not declare the transform.
_COMPILE = ("torch.compile",)


def _capabilities(transforms: tuple[str, ...]) -> Capabilities:
  # Global only, every float dtype, non-finite values propagated (Capabilities' defaults).
  return Capabilities(
      norm_types=ANY_NORM_TYPE, in_place=True, transforms=transforms,
      devices=("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))


def _as_tensor(leaf: Any) -> torch.Tensor:
  # A torch tensor is used as is (torch clips it in place); a numpy array is converted exactly.
  if isinstance(leaf, torch.Tensor):
    return leaf
  return frameworks.to_framework(leaf, "torch")


def _grads_of_parameters(
    leaves: Sequence[Any], holding: ParametersHolding
) -> tuple[list[torch.Tensor], list[torch.nn.Parameter]]:
  """The leaves as tensors, and the parameters holding them as ``.grad``."""
  grads = [_as_tensor(x) for x in leaves]
  return grads, holding(grads)


def _check_nonfinite(nonfinite: str) -> None:
  # torch has one behaviour for NaN/inf (it propagates through the norm); "zero" cannot be
  # expressed with its public API, so the adapter refuses rather than emulates it.
  if nonfinite != "propagate":
    raise NotImplementedError(
        f"nonfinite: torch.nn.utils.clip_grad_norm_ only propagates, got {nonfinite!r}")


_TORCH_GRADS = (
    "import torch\n"
    "torch.set_printoptions(precision=10)\n"
    "grads = [torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16) "
    "if x.dtype.name == 'bfloat16' else torch.from_numpy(x.copy()) for x in leaves]\n"
    "params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]\n"
    "for p, g in zip(params, grads):\n  p.grad = g\n")


class ClipGradNorm:
  """``torch.nn.utils.clip_grad_norm_`` with a fixed ``foreach`` on ``.grad`` of parameters."""

  framework = "torch"

  def __init__(self, foreach: bool):
    self.foreach = foreach
    self._holding = ParametersHolding()
    self.capabilities = _capabilities(_COMPILE if foreach else ())
    # The library call a bug report would show (the suite's reproducer appends it).
    self.reproducer = _TORCH_GRADS + (
        f"norm = torch.nn.utils.clip_grad_norm_(params, threshold, norm_type=norm_type, "
        f"foreach={foreach})\nprint([p.grad for p in params], norm)")
    self.description = (
        f"torch.nn.utils.clip_grad_norm_(foreach={foreach}) on the .grad of parameters "
        "(in place; scale min(1, max/(norm+1e-6)); norm of per-tensor norms)")

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: float, *, norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[torch.Tensor], torch.Tensor]:
    _check_nonfinite(nonfinite)
    grads, params = _grads_of_parameters(leaves, self._holding)
    total_norm = torch.nn.utils.clip_grad_norm_(
        params, max_norm, norm_type=norm_type, foreach=self.foreach)
    return grads, total_norm


class ClipGradsWithNorm:
  """``torch.nn.utils.get_total_norm`` then ``torch.nn.utils.clip_grads_with_norm_``."""

  framework = "torch"

  def __init__(self):
    self._holding = ParametersHolding()
    self.reproducer = _TORCH_GRADS + (
        "norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=norm_type)\n"
        "torch.nn.utils.clip_grads_with_norm_(params, threshold, norm)\n"
        "print([p.grad for p in params], norm)")
    self.capabilities = _capabilities(_COMPILE)
    self.description = (
        "torch.nn.utils.get_total_norm(grads) + clip_grads_with_norm_(params, max, norm) "
        "(defaults: foreach=None, error_if_nonfinite=False; in place)")

  def clip_grad_norm(self, leaves: Sequence[Any], max_norm: float, *, norm_type: float = 2.0,
                     nonfinite: str = "propagate") -> tuple[list[torch.Tensor], torch.Tensor]:
    _check_nonfinite(nonfinite)
    grads, params = _grads_of_parameters(leaves, self._holding)
    total_norm = torch.nn.utils.get_total_norm(
        [p.grad for p in params], norm_type=norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return grads, total_norm


clip_grad_norm_ = ClipGradNorm(foreach=False)
clip_grad_norm_foreach = ClipGradNorm(foreach=True)
clip_grads_with_norm_ = ClipGradsWithNorm()
