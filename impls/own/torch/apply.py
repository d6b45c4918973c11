"""The output stage: each system's rows kept bitwise, scaled by its factor, or filled with NaN.

How a leaf applies SCALE depends on its dtype and on the factor (the canonical definitions in
:mod:`clipbench.impls.own.torch`): float32 and float64 leaves round ``x * s`` to nearest when the
system's factor and threshold leave room for subnormal roundings, float16/bfloat16 leaves (and
float32 ones without that room) round the exact float64 product toward zero, and float64
leaves without it are computed exactly on the host (thresholds near 1e-300 only).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Callable

import numpy as np
import torch

from clipbench.impls.own.decision import KEEP, NAN_FILL
from clipbench.impls.own.torch import branches
from clipbench.impls.own.torch.formats import FMT64, round_to
from clipbench.impls.own.torch.layout import Leaf, gather

# How a leaf applies SCALE to a system's rows.
_RN, _RTZ, _HOST = 1, 2, 3


@dataclasses.dataclass
class Plan:
  """Per-system decisions (numpy arrays of shape (K,))."""

  action: np.ndarray  # KEEP, SCALE or NAN_FILL
  scale: np.ndarray  # float64 value of s (exact unless s < 2**-1022, see host_scale)
  rn32: np.ndarray  # float32 leaves round x*s to nearest (else toward zero)
  rn64: np.ndarray  # float64 leaves round x*s to nearest (else exact on the host)
  norms: np.ndarray  # reported norms (float64 values)
  host_scale: dict[int, Fraction]  # exact s where float64 leaves need the host route


def _route(leaf: Leaf, plan: Plan) -> np.ndarray:
  if leaf.x.dtype == torch.float32:
    return np.where(plan.rn32, _RN, _RTZ)
  if leaf.x.dtype == torch.float64:
    return np.where(plan.rn64, _RN, _HOST)
  return np.full(plan.action.shape, _RTZ)


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


def _host_scale_toward_zero(values: np.ndarray, s: Fraction) -> np.ndarray:
  """float64 x * s rounded toward zero exactly (Python rationals; extreme thresholds only)."""
  out = []
  for v in values.ravel().tolist():
    q = Fraction(v) * s
    r = round_to(abs(q), FMT64.prec, FMT64.emin, "down")
    out.append(math.copysign(float(r), v))
  return np.array(out, dtype=np.float64).reshape(values.shape)


KEEP_CODE, RN_CODE, RTZ_CODE, NAN_CODE, HOST_CODE = 0, 1, 2, 3, 4


def leaf_codes(leaf: Leaf, plan: Plan) -> np.ndarray:
  """Per system, what this leaf does to its rows: keep, x*s to nearest / toward zero, NaN, host."""
  route = _route(leaf, plan)
  scale_code = np.where(route == _RN, RN_CODE, np.where(route == _RTZ, RTZ_CODE, HOST_CODE))
  return np.where(plan.action == KEEP, KEEP_CODE,
                  np.where(plan.action == NAN_FILL, NAN_CODE, scale_code)).astype(np.int8)


def elementwise(x: torch.Tensor, fn: Callable[[torch.Tensor, torch.Tensor], Any],
                chunk: int) -> torch.Tensor:
  """A new tensor of x's shape filled by ``fn(x_part, out_part)`` over flat chunks.

  On CPU the chunks are below torch's parallel grain: each op runs on the calling thread,
  which on a busy machine is several times faster than torch's OpenMP region (it waits for
  every thread at each op's end). Other devices take the whole tensor at once.
  """
  out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
  xf, of = x.reshape(-1), out.view(-1)
  n = xf.numel()
  if not branches.on_host(x.device) or n <= chunk:
    fn(xf, of)
    return out
  for a in range(0, n, chunk):
    fn(xf[a:a + chunk], of[a:a + chunk])
  return out


def apply_global(leaves: list[Leaf], plan: Plan, chunk: int,
                 rtz: Callable[[torch.Tensor, float], torch.Tensor] | None = None
                 ) -> list[torch.Tensor]:
  """Outputs of a one-system call: the same action on every leaf.

  Small leaves (on an accelerator, every leaf) are multiplied together by one
  ``_foreach_mul`` per dtype: one launch for all of them.
  """
  whole_rtz = rtz  # a compiled kernel takes the whole leaf; the eager one goes by chunks
  s = float(plan.scale[0]) if plan.scale.size else 0.0
  out: list[torch.Tensor | None] = [None] * len(leaves)
  small: dict[torch.dtype, list[int]] = {}
  code_of: dict[torch.dtype, int] = {}
  for i, leaf in enumerate(leaves):
    x = leaf.x
    if x.dtype not in code_of:
      code_of[x.dtype] = int(leaf_codes(leaf, plan)[0])
    code = code_of[x.dtype] if leaf.numel else KEEP_CODE
    if code == KEEP_CODE:
      out[i] = x if leaf.owned else elementwise(x, lambda a, o: o.copy_(a), chunk)
    elif code == NAN_CODE:
      out[i] = elementwise(x, lambda a, o: o.fill_(math.nan), chunk)
    elif code == RN_CODE and (leaf.numel <= chunk or not branches.on_host(x.device)):
      small.setdefault(x.dtype, []).append(i)
    elif code == RN_CODE:
      st = torch.tensor(s, dtype=x.dtype, device=x.device)
      out[i] = elementwise(x, lambda a, o, st=st: torch.mul(a, st, out=o), chunk)
    elif code == RTZ_CODE and whole_rtz is not None:
      out[i] = whole_rtz(x, s)
    elif code == RTZ_CODE:
      out[i] = elementwise(x, lambda a, o: o.copy_(scale_toward_zero(a, s)), chunk)
    else:
      vals = _host_scale_toward_zero(x.detach().cpu().numpy(), plan.host_scale[0])
      out[i] = torch.as_tensor(vals, device=x.device).reshape(x.shape)
  for dtype, idx in small.items():
    st = torch.tensor(s, dtype=dtype, device=leaves[idx[0]].x.device)
    for i, y in zip(idx, torch._foreach_mul([leaves[i].x for i in idx], st)):  # pylint: disable=protected-access
      out[i] = y
  return out


def apply_leaf(leaf: Leaf, plan: Plan, chunk: int = 1 << 15) -> torch.Tensor:
  """The output of one leaf of a per-system call (eager torch)."""
  x = leaf.x
  if leaf.numel == 0:
    return x if leaf.owned else x.clone()
  if leaf.seg is None:
    return apply_global([leaf], plan, chunk)[0]
  codes = leaf_codes(leaf, plan)
  present = set(np.unique(codes[leaf.present]).tolist())
  if present == {KEEP_CODE}:
    return x if leaf.owned else elementwise(x, lambda a, o: o.copy_(a), chunk)
  m = leaf.matrix()
  dev = x.device
  if present <= {KEEP_CODE, RN_CODE}:
    keep_sys = torch.as_tensor(codes == KEEP_CODE, device=dev)
    s_sys = torch.as_tensor(plan.scale, dtype=torch.float64, device=dev).to(x.dtype)
    out = torch.empty_like(m)
    step = leaf.rows if not branches.on_host(dev) else max(1, chunk // max(leaf.width, 1))
    for r0 in range(0, leaf.rows, step):
      seg = leaf.seg[r0:r0 + step]
      block = m[r0:r0 + step]
      y = block * gather(s_sys, seg).unsqueeze(1)
      if KEEP_CODE in present:
        torch.where(gather(keep_sys, seg).unsqueeze(1), block, y, out=out[r0:r0 + step])
      else:
        out[r0:r0 + step] = y
    return out.reshape(x.shape)
  code_rows = gather(torch.as_tensor(codes, device=dev), leaf.seg)
  s_rows = gather(torch.as_tensor(plan.scale, dtype=torch.float64, device=dev), leaf.seg)
  out = m.clone()
  for code in sorted(present - {KEEP_CODE}):
    idx = torch.nonzero(code_rows == code).squeeze(1)
    rows = m[idx]
    if code == RN_CODE:
      out[idx] = rows * s_rows[idx].to(x.dtype).unsqueeze(1)
    elif code == RTZ_CODE:
      out[idx] = scale_toward_zero(rows, s_rows[idx].unsqueeze(1))
    elif code == NAN_CODE:
      out[idx] = math.nan
    else:
      for k in np.flatnonzero((codes == HOST_CODE) & leaf.present).tolist():
        sel = torch.nonzero(leaf.seg == k).squeeze(1)
        vals = _host_scale_toward_zero(m[sel].cpu().numpy(), plan.host_scale[k])
        out[sel] = torch.as_tensor(vals, device=dev)
  return out.reshape(x.shape)
