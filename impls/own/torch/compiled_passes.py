"""The ``torch.compile`` (inductor) implementation: the eager design, per-leaf passes compiled.

It compiles the per-system passes (row power sums, step norms, the float64 extraction, the
keep-or-scale select) with the row count dynamic and the row width static (inductor's code for
a symbolic width is much slower; the measurements are in ``docs/gpu.md``). The decisions are
the eager ones (tensor operations on the device), so the bits are those of the eager
implementation.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from clipbench.impls.own.torch.api import TorchClipping
from clipbench.impls.own.torch.apply import (apply_global, apply_leaf, scale_toward_zero,
                                             select_rows)
from clipbench.impls.own.torch.eager_passes import EagerKernels, piece_row_sums


def _rows_square(m: torch.Tensor) -> torch.Tensor:
  y = m.to(torch.float64)
  return (y * y).sum(1)


def _rows_abs(m: torch.Tensor) -> torch.Tensor:
  return m.to(torch.float64).abs().sum(1)


def _rows_pow(m: torch.Tensor, scale: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
  y = m.to(torch.float64).abs() * scale.unsqueeze(1)
  return torch.pow(y, p).sum(1)


def _rows_step(m: torch.Tensor) -> torch.Tensor:
  y = m.to(torch.float64)
  return (y * y).sum(2).amax(1)


# Inductor's Triton code computes float16/bfloat16 in float32 and, by default, elides a
# downcast followed by an upcast (``torch._inductor.config.emulate_precision_casts``). The
# rounding toward zero (``apply.scale_toward_zero``) compares the value rounded into the leaf
# dtype with the exact product: with the pair elided it saw the unrounded value, and on CUDA
# float16/bfloat16 outputs broke rules 4, 5 and 11 (NaN from finite input among them; the GPU
# check of 2026-11-26, docs/gpu.md). On the CPU (inductor's C++ code) every check passed
# without it.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def _compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
  """torch.compile(fn) with the row dimension (dim 0) of every input dynamic, the rest static.

  ``dynamic=True`` would make the row width symbolic too, and inductor's code for a symbolic
  inner width is much slower (``docs/gpu.md``); so dim 0 is marked dynamic on a view of each
  input (the caller's tensors are not touched) and automatic dynamic shapes are off; widths
  above 16 are dynamic too. A new dtype or small row width recompiles (a handful of graphs for real
  layouts), so dynamo's recompile limit is raised during the call.
  """
  compiled_fn = torch.compile(fn, fullgraph=True, options=INDUCTOR_OPTIONS)

  def call(*args):
    if torch.compiler.is_compiling():
      return fn(*args)  # inside the caller's own torch.compile: let it trace the function
    views = []
    for a in args:
      if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] >= 2:
        a = a.view(a.shape)
        torch._dynamo.mark_dynamic(a, 0)  # pylint: disable=protected-access
        if a.dim() > 1 and a.shape[1] > 16:
          torch._dynamo.mark_dynamic(a, 1)  # pylint: disable=protected-access
      views.append(a)
    with torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=8192,  # pylint: disable=protected-access
                                    automatic_dynamic_shapes=False):
      return compiled_fn(*views)

  return call


class CompiledKernels(EagerKernels):
  """The same passes as ``EagerKernels``, each per-leaf pass one ``torch.compile``d kernel.

  Narrow rows (the per-system layouts: positions, cells) go to compiled kernels with a static
  width; wide rows and the one-system passes keep the eager code (``_foreach_norm`` reads
  every leaf in one operator; inductor's code for a long or symbolic inner width was slower,
  docs/gpu.md). Graphs are compiled with the row count dynamic (one graph per dtype, rank and
  narrow width, not per row count) and cached by torch.compile itself.
  """

  NARROW = 16

  def __init__(self):
    self._square = _compiled(_rows_square)
    self._abs = _compiled(_rows_abs)
    self._pow = _compiled(_rows_pow)
    self._step = _compiled(_rows_step)
    self._pieces = {p: _compiled(functools.partial(piece_row_sums, p=p)) for p in (1, 2)}
    self._select = _compiled(select_rows)
    self._rtz = _compiled(scale_toward_zero)

  def row_power_sums(self, m, p, scale_rows):
    if m.shape[1] > self.NARROW:
      return super().row_power_sums(m, p, scale_rows)
    if scale_rows is None and p == 2:
      return self._square(m)
    if scale_rows is None and p == 1:
      return self._abs(m)
    if scale_rows is None:
      scale_rows = torch.ones(m.shape[0], dtype=torch.float64, device=m.device)
    return self._pow(m, scale_rows, torch.tensor(p, dtype=torch.float64, device=m.device))

  def row_step_sums(self, m, vec):
    if m.shape[1] > self.NARROW:
      return super().row_step_sums(m, vec)
    return self._step(m.reshape(m.shape[0], -1, vec))

  def row_pieces(self, m, params_rows, p):
    if m.shape[1] > self.NARROW:
      return super().row_pieces(m, params_rows, p)
    return self._pieces[p](m, params_rows)

  def apply(self, batch, plan):
    if not batch.per_system:
      return apply_global(batch.leaves, plan, rtz=lambda x, v: self._rtz(
          x, torch.tensor(v, dtype=torch.float64, device=x.device)))
    return [apply_leaf(leaf, plan, select=self._select if leaf.width <= self.NARROW else
                       select_rows) for leaf in batch.leaves]


compiled = TorchClipping(CompiledKernels(),
                         "torch.compile (inductor) passes on CUDA; on CPU tensors the numba kernels "
                         "(as eager)",
                         transforms=("torch.compile",))
