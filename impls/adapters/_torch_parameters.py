"""Parameters whose ``.grad`` are the given gradient tensors, built once per set of tensors.

A training loop builds its parameters once; every step, backward writes the gradients into
the same ``.grad`` tensors and ``clip_grad_norm_`` runs on those parameters. The adapters are
handed only the gradient tensors, so each keeps the parameters of the last tensors it was
given: handed the very same tensor objects again (a benchmark's rounds refill them in place),
it reuses them, and the call it makes is the library's alone, as in the user's loop. Any other
tensors get new parameters, so a result never depends on an earlier call.
"""

from __future__ import annotations

from typing import Sequence

import torch


class ParametersHolding:
  """``holding(grads)``: parameters whose ``.grad`` is each of ``grads`` (that very tensor).

  ``torch.nn.Parameter`` rejects integer dtypes ("Only Tensors of floating point ... can
  require gradients"); that error is torch's and propagates unchanged.
  """

  def __init__(self) -> None:
    self._params: list[torch.nn.Parameter] = []

  def __call__(self, grads: Sequence[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = self._params
    if len(params) == len(grads) and all(p.grad is g for p, g in zip(params, grads)):
      return params
    params = []
    for g in grads:
      p = torch.nn.Parameter(torch.empty_like(g))
      p.grad = g
      params.append(p)
    self._params = params
    return params
