"""The ``torch.compile`` (inductor) implementation: the eager design, per-leaf passes compiled.

It compiles the per-system passes (row power sums, step norms, the float64 extraction, the
keep-or-scale select) with the row count dynamic and the row width static (inductor's code for
a symbolic width is much slower; the measurements are in ``docs/gpu.md``). The host-side
decisions are the eager ones, so the bits are those of the eager implementation.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from clipbench.impls.own.torch.api import TorchClipping
from clipbench.impls.own.torch.apply import (KEEP_CODE, RN_CODE, Plan, apply_global, apply_leaf,
                                             leaf_codes, scale_toward_zero)
from clipbench.impls.own.torch.eager_passes import EagerKernels, piece_row_sums
from clipbench.impls.own.torch.layout import Batch, Leaf, gather


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


def _apply_rows(m: torch.Tensor, keep: torch.Tensor, s_leaf: torch.Tensor) -> torch.Tensor:
  """Rows kept bitwise (a select, no multiply by 1) or scaled by their system's s (nearest)."""
  return torch.where(keep.unsqueeze(1), m, m * s_leaf.unsqueeze(1))


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

  The one-system (global) norm keeps the eager cache-blocked loop: inductor's float32 ->
  float64 reduction was slower than it (``docs/gpu.md``), and the loop is already one read of
  the data.

  Graphs are compiled with the row count dynamic (one graph per dtype, rank and narrow width,
  not per row count) and cached by torch.compile itself; the host-side decisions are the
  eager ones, so the bits are those of the eager implementation.
  """

  def __init__(self):
    self._square = _compiled(_rows_square)
    self._abs = _compiled(_rows_abs)
    self._pow = _compiled(_rows_pow)
    self._step = _compiled(_rows_step)
    self._pieces = {p: _compiled(functools.partial(piece_row_sums, p=p)) for p in (1, 2)}
    self._apply = _compiled(_apply_rows)
    self._rtz = _compiled(scale_toward_zero)

  def _rows(self, m: torch.Tensor, p: float, scale_rows: torch.Tensor | None) -> torch.Tensor:
    if scale_rows is None and p == 2:
      return self._square(m)
    if scale_rows is None and p == 1:
      return self._abs(m)
    if scale_rows is None:
      scale_rows = torch.ones(m.shape[0], dtype=torch.float64, device=m.device)
    return self._pow(m, scale_rows, torch.tensor(p, dtype=torch.float64, device=m.device))

  # Narrow rows (the per-system layouts: positions, cells) go to compiled kernels with a
  # static width; wide rows keep the eager cache-blocked code (inductor's code for a long
  # or symbolic inner width was slower than it, docs/gpu.md).
  NARROW = 16

  def _row_power_sums(self, leaf: Leaf, p: float, scale: torch.Tensor | None,
                      buf: torch.Tensor) -> torch.Tensor:
    if leaf.width > self.NARROW:
      return super()._row_power_sums(leaf, p, scale, buf)
    return self._rows(leaf.matrix(), p, None if scale is None else gather(scale, leaf.seg))

  def _row_step_sums(self, leaf: Leaf, buf: torch.Tensor) -> torch.Tensor:
    if leaf.width > self.NARROW:
      return super()._row_step_sums(leaf, buf)
    return self._step(leaf.matrix().reshape(leaf.rows, -1, leaf.vec))

  def _piece_row_sums(self, m: torch.Tensor, p: int, params: torch.Tensor) -> torch.Tensor:
    if m.shape[1] > self.NARROW:
      return piece_row_sums(m, params, p)
    return self._pieces[p](m, params)

  def _rows_per_block(self, m: torch.Tensor) -> int:
    if m.shape[1] > self.NARROW:
      return super()._rows_per_block(m)
    return max(1, m.shape[0])  # one compiled kernel per leaf (it parallelizes itself)

  def apply(self, batch: Batch, plan: Plan) -> list[torch.Tensor]:
    if not batch.per_system:
      return apply_global(batch.leaves, plan, self.CHUNK, rtz=lambda x, v: self._rtz(
          x, torch.tensor(v, dtype=torch.float64, device=x.device)))
    return [self._apply_leaf(leaf, plan) for leaf in batch.leaves]

  def _apply_leaf(self, leaf: Leaf, plan: Plan) -> torch.Tensor:
    codes = leaf_codes(leaf, plan)
    used = codes[leaf.present]
    if leaf.numel == 0 or np.any(used > RN_CODE):
      # Empty, or rows rounded toward zero / NaN / exact on the host: the eager path.
      # (inductor vectorizes neither the bit step nor mixed float64/float32 selects here.)
      return apply_leaf(leaf, plan, self.CHUNK)
    if not np.any(used == RN_CODE):
      return leaf.x if leaf.owned else leaf.x.clone()
    x = leaf.x
    dev = x.device
    keep = gather(torch.as_tensor(codes == KEEP_CODE, device=dev), leaf.seg)
    s_rows = gather(torch.as_tensor(plan.scale, dtype=torch.float64, device=dev).to(x.dtype),
                     leaf.seg)
    return self._apply(leaf.matrix(), keep, s_rows).reshape(x.shape)


compiled = TorchClipping(CompiledKernels(),
                         "torch.compile (inductor) passes on CUDA; on CPU tensors the numba kernels "
                         "(as eager)",
                         transforms=("torch.compile",))
