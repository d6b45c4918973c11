"""The output stage: each system's rows kept bitwise, scaled by its factor, or filled with NaN.

How a leaf applies SCALE depends on its dtype and on the factor (the canonical definitions in
:mod:`clipbench.impls.own.torch`): float32 and float64 leaves round ``x * s`` to nearest when the
system's factor and threshold leave room for subnormal roundings, float16/bfloat16 leaves (and
float32 ones without that room) round the exact float64 product toward zero, and float64
leaves without it are computed exactly on the host (thresholds near 1e-300 only).

A one-system call knows its decision on the host (read with the call's one transfer), so its
outputs are one ``_foreach`` operator per dtype (or one pass over a concatenated buffer where
rounding toward zero needs float64); a per-system call selects per row on the device, from
the per-system decisions, with a fixed set of operators per leaf.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from clipbench.impls.own.decision import KEEP, NAN_FILL, SCALE
from clipbench.impls.own.torch.decisions import Plan
from clipbench.impls.own.torch.eager_passes import flat_blocks
from clipbench.impls.own.torch.formats import FMT64, round_to
from clipbench.impls.own.torch.layout import Leaf, gather


def _step_toward_zero(y: torch.Tensor, over: torch.Tensor) -> torch.Tensor:
  """y with the elements flagged ``over`` moved one float toward zero (bit arithmetic)."""
  ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[y.element_size()]
  bits = y.view(ints)
  return torch.where(over, bits - 1, bits).view(y.dtype)


def scale_toward_zero(x: torch.Tensor, s: torch.Tensor | float) -> torch.Tensor:
  """x * s rounded toward zero into x's dtype (x * s is exact in float64 for <= 32-bit x)."""
  exact = x.to(torch.float64) * s
  y = exact.to(x.dtype)
  over = y.to(torch.float64).abs() > exact.abs()
  return _step_toward_zero(y, over)


def host_scale_toward_zero(values: np.ndarray, s: Fraction) -> np.ndarray:
  """float64 x * s rounded toward zero exactly (Python rationals; extreme thresholds only)."""
  out = []
  for v in values.ravel().tolist():
    q = Fraction(v) * s
    r = round_to(abs(q), FMT64.prec, FMT64.emin, "down")
    out.append(math.copysign(float(r), v))
  return np.array(out, dtype=np.float64).reshape(values.shape)


# ------------------------------------------------------------------------ one system
def apply_global(leaves: list[Leaf], plan: Plan, rtz=scale_toward_zero) -> list[torch.Tensor]:
  """Outputs of a one-system call: the same decision, known on the host, for every leaf.

  ``rtz`` rounds one flat block toward zero (a compiled kernel may stand in for the eager one).
  """
  decision = plan.single
  out: list[torch.Tensor | None] = [None] * len(leaves)
  groups: dict[torch.dtype, list[int]] = {}
  for i, leaf in enumerate(leaves):
    if leaf.numel == 0:
      out[i] = leaf.x if leaf.owned else leaf.x.clone()
    else:
      groups.setdefault(leaf.x.dtype, []).append(i)
  for dtype, where in groups.items():
    xs = [leaves[i].x for i in where]
    if decision.action == KEEP:
      ys = [torch.empty_like(x) for x in xs]
      torch._foreach_copy_(ys, xs)  # pylint: disable=protected-access
    elif decision.action == NAN_FILL:
      ys = torch._foreach_mul(xs, math.nan)  # pylint: disable=protected-access
    elif (dtype == torch.float32 and decision.rn32) or (dtype == torch.float64 and
                                                         decision.rn64):
      ys = torch._foreach_mul(xs, decision.scale)  # pylint: disable=protected-access
    elif dtype == torch.float64:
      ys = [torch.as_tensor(host_scale_toward_zero(x.detach().cpu().numpy(),
                                                   plan.host_scale[0]), device=x.device)
            for x in xs]
    else:
      ys = [y.view(x.shape) for x, y in zip(xs, _blockwise(xs, lambda block: rtz(
          block, decision.scale)))]
    for i, y in zip(where, ys):
      out[i] = y
  return out


def _blockwise(xs: list[torch.Tensor], fn) -> list[torch.Tensor]:
  """fn over the tensors concatenated into flat blocks, cut back into one output per tensor."""
  sizes = [x.numel() for x in xs]
  blocks = [fn(block) for block in flat_blocks(xs)]
  flat = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
  return list(torch.split(flat, sizes))


# ------------------------------------------------------------------------ per system
def select_rows(m: torch.Tensor, action: torch.Tensor, s_rows: torch.Tensor) -> torch.Tensor:
  """Rows kept bitwise (a select, no multiply by 1), scaled to nearest, or filled with NaN."""
  return torch.where(action == KEEP, m, torch.where(action == NAN_FILL, math.nan, m * s_rows))


def apply_leaf(leaf: Leaf, plan: Plan, select=select_rows) -> torch.Tensor:
  """The output of one leaf of a per-system call: each row by its system's decision.

  ``select`` does the common case, every scaled row rounded to nearest (a compiled kernel may
  stand in for the eager one).
  """
  x = leaf.x
  if leaf.numel == 0:
    return x if leaf.owned else x.clone()
  m, seg = leaf.matrix(), leaf.seg
  action = gather(plan.action, seg).unsqueeze(1)
  dtype = x.dtype
  if (dtype == torch.float32 and not plan.rtz32) or (dtype == torch.float64 and
                                                      not plan.host64):
    return select(m, action, gather(plan.scale.to(dtype), seg).unsqueeze(1)).reshape(x.shape)
  s64 = gather(plan.scale, seg).unsqueeze(1)
  if dtype == torch.float64:
    scaled = with_host_rows(m, seg, m * s64, plan)
  else:
    scaled = scale_toward_zero(m, s64)
    if dtype == torch.float32:  # some systems round toward zero, the others to nearest
      nearest = gather(plan.rn32, seg).unsqueeze(1)
      scaled = torch.where(nearest, m * s64.to(dtype), scaled)
  out = torch.where(action == KEEP, m, torch.where(action == NAN_FILL, math.nan, scaled))
  return out.reshape(x.shape)


def with_host_rows(m: torch.Tensor, seg: torch.Tensor, scaled: torch.Tensor,
                   plan: Plan) -> torch.Tensor:
  """``scaled`` with the float64 rows of the systems whose factor leaves no room rewritten:
  ``m``'s rows times the exact factor, rounded toward zero on the host."""
  for k, s in plan.host_scale.items():
    if plan.action[k].item() != SCALE or plan.rn64[k].item():
      continue
    rows = torch.nonzero(seg == k).squeeze(1)
    if rows.numel():
      values = host_scale_toward_zero(m[rows].cpu().numpy(), s)
      scaled[rows] = torch.as_tensor(values, device=m.device)
  return scaled
