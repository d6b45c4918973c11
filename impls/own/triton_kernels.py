"""Triton kernels for the three clipping operations, on torch tensors.

CUDA tensors run compiled Triton kernels; with ``TRITON_INTERPRET=1`` set before triton is
first imported, the same kernels run on CPU tensors in Triton's interpreter (that is how CI
tests them: no GPU here). The numerics and the host-side decisions are those of
``torch_kernels`` (see its docstring): the kernels compute per-system power sums, maxima and
step norms with rigorous error bounds, the host takes each decision from the certified
interval or, for near-ties, from an exact recomputation of that system alone, and a last
kernel writes the outputs.

Determinism and batch invariance on hardware
--------------------------------------------
* No atomics. Rows are visited in the order of a stable sort by system (none is needed when
  the segments are already sorted: the contiguous fast path). The rows of each system are cut
  into *work items* of a fixed number of rows, aligned to the system's own first row; one
  program reduces one item with fixed ``BLOCK`` sizes that depend only on the leaf's row
  width, and a second kernel, one program per system, adds its items' partial results in item
  order. No split reductions, no atomics, no batch-dependent launch configuration: a system's
  partial sums are computed by the same instructions in the same order whatever the other
  systems are, so the kernels are run-to-run deterministic and batch-invariant by themselves
  (as ``batch_invariant_ops`` does for matmul rows).
* On top of that, every output bit is a function of the exact values of the system's elements
  (the canonical definitions in ``torch_kernels``): a different summation order could only
  change which systems take the exact path, never a result bit. So the Triton results equal
  the eager torch results bit for bit, which is what the CPU tests check.
* Fused multiply-add contraction (on by default in Triton) is harmless here: squares of
  <= 32-bit values are exact in float64, and the error-free extraction ``(t + s) - s`` only
  ever contracts with an exact product.

What was verified where: every kernel ran under ``TRITON_INTERPRET=1`` on CPU (conformance
suite and bit-for-bit comparisons with the eager implementation). The CUDA path compiles the
same kernels but has not been run on a GPU here.

General p uses ``exp2(p * log2(y))`` (the interpreter has no ``pow``); its error is bounded
per term (``POW_REL_ERR``, ``POW_ABS_ERR``) and the same certification applies.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import torch

from clipbench.impls.own import torch_kernels as tk

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"

try:
  import triton
  import triton.language as tl
except ImportError as e:  # pragma: no cover - triton is installed in this project
  triton = None
  _IMPORT_ERROR = f"triton not importable: {e}"
else:
  _IMPORT_ERROR = ""

# Elements per work item (rows per item = ITEM_ELEMS // row width) and per kernel tile.
ITEM_ELEMS = 1 << 16
TILE_ELEMS = 2048

if triton is not None:

  @triton.jit
  def _load_f64(ptrs, mask):
    # No `other=` constant: the interpreter cannot build bfloat16 constants.
    return tl.where(mask, tl.load(ptrs, mask=mask).to(tl.float64), 0.0)

  @triton.jit
  def _item_power_sums(x_ptr, perm_ptr, item_row_ptr, item_cnt_ptr, item_sys_ptr, scale_ptr,
                       out_ptr, p_ptr, width, HAS_PERM: tl.constexpr, MODE: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """One work item: float64 sum over its rows of x**2 (MODE 0), |x| (1), (|x| s)**p (2)."""
    pid = tl.program_id(0)
    p = tl.load(p_ptr)  # float64 (a Python float argument would be float32)
    start = tl.load(item_row_ptr + pid)
    count = tl.load(item_cnt_ptr + pid)
    sc = tl.load(scale_ptr + tl.load(item_sys_ptr + pid))
    acc = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float64)
    for r in range(0, count, BLOCK_R):
      local = r + tl.arange(0, BLOCK_R)
      rmask = local < count
      pos = start + local
      if HAS_PERM:
        row = tl.load(perm_ptr + pos, mask=rmask, other=0)
      else:
        row = pos
      base = row.to(tl.int64) * width
      for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        m = rmask[:, None] & (cols < width)[None, :]
        x = _load_f64(x_ptr + base[:, None] + cols[None, :], m)
        if MODE == 0:
          t = x * x
        elif MODE == 1:
          t = tl.abs(x)
        else:
          y = tl.abs(x) * sc
          t = tl.where(y > 0, tl.exp2(p * tl.log2(tl.where(y > 0, y, 1.0))), 0.0)
        acc += t
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))

  @triton.jit
  def _item_extremes(x_ptr, perm_ptr, item_row_ptr, item_cnt_ptr, max_ptr, min_ptr, width,
                     HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """One work item: max |x| (NaN if any NaN) and min |x| over its rows."""
    pid = tl.program_id(0)
    start = tl.load(item_row_ptr + pid)
    count = tl.load(item_cnt_ptr + pid)
    big = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float64)
    small = tl.full([BLOCK_R, BLOCK_W], float("inf"), dtype=tl.float64)
    nans = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.int32)
    for r in range(0, count, BLOCK_R):
      local = r + tl.arange(0, BLOCK_R)
      rmask = local < count
      pos = start + local
      if HAS_PERM:
        row = tl.load(perm_ptr + pos, mask=rmask, other=0)
      else:
        row = pos
      base = row.to(tl.int64) * width
      for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        m = rmask[:, None] & (cols < width)[None, :]
        a = tl.abs(_load_f64(x_ptr + base[:, None] + cols[None, :], m))
        is_nan = a != a
        nans += is_nan.to(tl.int32)
        big = tl.maximum(big, tl.where(is_nan, 0.0, a))
        small = tl.minimum(small, tl.where(m & (a == a), a, float("inf")))
    top = tl.max(tl.max(big, axis=1), axis=0)
    has_nan = tl.sum(tl.sum(nans, axis=1), axis=0) > 0
    tl.store(max_ptr + pid, tl.where(has_nan, float("nan"), top))
    tl.store(min_ptr + pid, tl.min(tl.min(small, axis=1), axis=0))

  @triton.jit
  def _item_step(x_ptr, perm_ptr, item_row_ptr, item_cnt_ptr, out_ptr, width, nvec, vec,
                 HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """One work item: the largest float64 sum of squares of a step vector in its rows."""
    pid = tl.program_id(0)
    start = tl.load(item_row_ptr + pid)
    count = tl.load(item_cnt_ptr + pid)
    best = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float64)
    nans = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.int32)
    for r in range(0, count, BLOCK_R):
      local = r + tl.arange(0, BLOCK_R)
      rmask = local < count
      pos = start + local
      if HAS_PERM:
        row = tl.load(perm_ptr + pos, mask=rmask, other=0)
      else:
        row = pos
      base = row.to(tl.int64) * width
      for v0 in range(0, nvec, BLOCK_V):
        vs = v0 + tl.arange(0, BLOCK_V)
        m = rmask[:, None] & (vs < nvec)[None, :]
        acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float64)
        for d in range(0, vec):
          x = _load_f64(x_ptr + base[:, None] + vs[None, :] * vec + d, m)
          acc += x * x
        is_nan = acc != acc
        nans += is_nan.to(tl.int32)
        best = tl.maximum(best, tl.where(is_nan, 0.0, acc))
    top = tl.max(tl.max(best, axis=1), axis=0)
    has_nan = tl.sum(tl.sum(nans, axis=1), axis=0) > 0
    tl.store(out_ptr + pid, tl.where(has_nan, float("nan"), top))

  @triton.jit
  def _item_pieces(x_ptr, perm_ptr, item_row_ptr, item_cnt_ptr, item_sys_ptr, params_ptr,
                   out_ptr, width, HAS_PERM: tl.constexpr, SQUARE: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """One work item: sums of the error-free extracted pieces (q1, q2, qt, rest), float64."""
    pid = tl.program_id(0)
    start = tl.load(item_row_ptr + pid)
    count = tl.load(item_cnt_ptr + pid)
    k = tl.load(item_sys_ptr + pid)
    a = tl.load(params_ptr + k * 5)
    b = tl.load(params_ptr + k * 5 + 1)
    s1 = tl.load(params_ptr + k * 5 + 2)
    s2 = tl.load(params_ptr + k * 5 + 3)
    st = tl.load(params_ptr + k * 5 + 4)
    acc1 = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float64)
    acc2 = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float64)
    acc3 = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float64)
    acc4 = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float64)
    for r in range(0, count, BLOCK_R):
      local = r + tl.arange(0, BLOCK_R)
      rmask = local < count
      pos = start + local
      if HAS_PERM:
        row = tl.load(perm_ptr + pos, mask=rmask, other=0)
      else:
        row = pos
      base = row.to(tl.int64) * width
      for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        m = rmask[:, None] & (cols < width)[None, :]
        y = tl.abs(_load_f64(x_ptr + base[:, None] + cols[None, :], m))
        y = (y * a) * b
        if SQUARE:
          yh = (y.to(tl.int64, bitcast=True) & -134217728).to(tl.float64, bitcast=True)
          yl = y - yh
          t1 = yh * yh
          t2 = 2.0 * (yh * yl)
          t3 = yl * yl
        else:
          t1 = y
        q1 = (t1 + s1) - s1
        r1 = t1 - q1
        q2 = (r1 + s2) - s2
        rest = r1 - q2
        if SQUARE:
          qt = (t2 + st) - st
          rest = rest + (t2 - qt) + t3
          acc3 += qt
        acc1 += q1
        acc2 += q2
        acc4 += rest
    tl.store(out_ptr + pid * 4, tl.sum(tl.sum(acc1, axis=1), axis=0))
    tl.store(out_ptr + pid * 4 + 1, tl.sum(tl.sum(acc2, axis=1), axis=0))
    tl.store(out_ptr + pid * 4 + 2, tl.sum(tl.sum(acc3, axis=1), axis=0))
    tl.store(out_ptr + pid * 4 + 3, tl.sum(tl.sum(acc4, axis=1), axis=0))

  @triton.jit
  def _combine(part_ptr, first_ptr, count_ptr, out_ptr, stride, MODE: tl.constexpr):
    """One program per system: its items' partials in item order (0 sum, 1 max, 2 min)."""
    k = tl.program_id(0)
    first = tl.load(first_ptr + k)
    count = tl.load(count_ptr + k)
    if MODE == 2:
      acc = tl.full([1], float("inf"), dtype=tl.float64)
    else:
      acc = tl.zeros([1], dtype=tl.float64)
    for i in range(0, count):
      v = tl.load(part_ptr + (first + i) * stride + tl.zeros([1], dtype=tl.int64))
      if MODE == 0:
        acc = acc + v
      elif MODE == 1:
        acc = tl.where((v != v) | (acc != acc), float("nan"), tl.maximum(acc, v))
      else:
        acc = tl.minimum(acc, v)
    tl.store(out_ptr + k + tl.zeros([1], dtype=tl.int64), acc)

  @triton.jit
  def _apply(x_ptr, out_ptr, seg_ptr, code_ptr, slow_ptr, s64_ptr, rows, width,
             HAS_SEG: tl.constexpr, INT: tl.constexpr, BLOCK_R: tl.constexpr,
             BLOCK_W: tl.constexpr):
    """Output rows: 0 keep, 1 x*s rounded to nearest, 2 x*s rounded toward zero, 3 NaN."""
    pid = tl.program_id(0)
    rws = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rws < rows
    if HAS_SEG:
      k = tl.load(seg_ptr + rws, mask=rmask, other=0)
    else:
      k = tl.zeros([BLOCK_R], dtype=tl.int64)
    code = tl.load(code_ptr + k, mask=rmask, other=0)[:, None]
    s_low = tl.load(slow_ptr + k, mask=rmask, other=0.0)[:, None]
    s64 = tl.load(s64_ptr + k, mask=rmask, other=0.0)[:, None]
    base = rws.to(tl.int64) * width
    for c0 in range(0, width, BLOCK_W):
      cols = c0 + tl.arange(0, BLOCK_W)
      m = rmask[:, None] & (cols < width)[None, :]
      ptrs = base[:, None] + cols[None, :]
      x = tl.load(x_ptr + ptrs, mask=m)
      rn = (x.to(s_low.dtype) * s_low).to(x.dtype)
      exact = x.to(tl.float64) * s64
      if x.dtype == tl.float64:
        y = exact
      else:
        # Through float32: the interpreter's float64 -> bfloat16 cast is broken. Any
        # neighbour of the exact value will do: the next lines round toward zero.
        y = exact.to(tl.float32).to(x.dtype)
      over = tl.abs(y.to(tl.float64)) > tl.abs(exact)
      bits = y.to(INT, bitcast=True)
      rtz = tl.where(over, bits - 1, bits).to(x.dtype, bitcast=True)
      nan = tl.full([BLOCK_R, BLOCK_W], float("nan"), dtype=tl.float32).to(x.dtype)
      out = tl.where(code == 0, x, tl.where(code == 1, rn, tl.where(code == 2, rtz, nan)))
      tl.store(out_ptr + ptrs, out, mask=m)


_INT_OF = {torch.float16: "int16", torch.bfloat16: "int16", torch.float32: "int32",
           torch.float64: "int64"}


def _pow2(n: int, cap: int) -> int:
  return min(cap, 1 << max(0, (max(n, 1) - 1).bit_length()))


@dataclasses.dataclass
class Items:
  """Work items of one leaf: runs of at most ``rows_per_item`` rows of one system."""

  perm: torch.Tensor | None  # sorted position -> row (None: rows already sorted)
  row: torch.Tensor  # first sorted position of each item
  count: torch.Tensor  # rows of each item
  system: torch.Tensor  # system of each item
  first: torch.Tensor  # per system: its first item
  per_system: torch.Tensor  # per system: number of items
  num: int


def make_items(seg: torch.Tensor | None, rows: int, K: int, rows_per_item: int,
               is_sorted: bool, device) -> Items:
  """Items aligned to each system's first row (a system's items do not depend on others)."""
  if seg is None:
    counts = torch.tensor([rows], dtype=torch.int64, device=device)
    perm = None
  else:
    counts = torch.bincount(seg, minlength=K)
    perm = None if is_sorted else torch.sort(seg, stable=True).indices
  starts = torch.cumsum(counts, 0) - counts
  per_system = (counts + rows_per_item - 1) // rows_per_item
  first = torch.cumsum(per_system, 0) - per_system
  num = int(per_system.sum())
  system = torch.repeat_interleave(torch.arange(counts.numel(), device=device), per_system)
  j = torch.arange(num, device=device) - first[system]
  row = starts[system] + j * rows_per_item
  count = torch.minimum(torch.full_like(row, rows_per_item), counts[system] - j * rows_per_item)
  return Items(perm, row, count, system, first, per_system, num)


class TritonKernels(tk.EagerKernels):
  """The passes of ``torch_kernels.EagerKernels`` as Triton kernels (see module docstring)."""

  # exp2(p * log2(y)) for y <= 1: relative error <= (1.4 |p log2 y| + 3) u per term, whose
  # largest absolute value over y in [0, 1] is below 2**-51 (taken with margins).
  POW_REL_ERR = 2.0 ** -49
  POW_ABS_ERR = 2.0 ** -50

  def _check_device(self, batch: tk.Batch) -> None:
    if batch.leaves and batch.device.type != "cuda" and not INTERPRET:
      raise ValueError(f"leaves[0]: on {batch.device}; the Triton implementation needs CUDA "
                       "tensors, or TRITON_INTERPRET=1 for CPU tensors")

  def _leaf_view(self, leaf: tk.Leaf, K: int, is_sorted: bool, flat: bool):
    # is_sorted: the leaf's rows are already grouped by system (no permutation needed).
    """(matrix, items, blocks) for one leaf; global leaves are read as one flat column."""
    if leaf.seg is None and flat:
      m = leaf.x.reshape(-1, 1)
    else:
      m = leaf.matrix()
    m = m.contiguous()
    rows, width = m.shape
    rpi = max(1, ITEM_ELEMS // max(width, 1))
    items = make_items(leaf.seg, rows, K if leaf.seg is not None else 1, rpi, is_sorted,
                       m.device)
    block_w = _pow2(width, 64)
    block_r = max(1, TILE_ELEMS // block_w)
    return m, items, block_r, block_w

  def _combine(self, parts: torch.Tensor, items: Items, mode: int, stride: int = 1,
               offset: int = 0) -> torch.Tensor:
    k = items.first.numel()
    out = torch.empty(k, dtype=torch.float64, device=parts.device)
    if k:
      _combine[(k,)](parts.reshape(-1)[offset:], items.first, items.per_system, out, stride,
                     MODE=mode)
    return out

  def _dummy(self, device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)

  # ------------------------------------------------------------------ power sums (float32)
  def power_sums(self, batch: tk.Batch, p: float,
                 scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    self._check_device(batch)
    K = batch.num_systems
    dev = batch.device
    sums = torch.zeros(K, dtype=torch.float64, device=dev)
    scale_t = torch.as_tensor(np.ones(max(K, 1)) if scale is None else scale,
                              dtype=torch.float64, device=dev)
    mode = 0 if (p == 2 and scale is None) else 1 if (p == 1 and scale is None) else 2
    p_t = torch.tensor([p], dtype=torch.float64, device=dev)
    worst = 1
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      m, items, block_r, block_w = self._leaf_view(leaf, K, leaf.sorted, flat=True)
      parts = torch.empty(items.num, dtype=torch.float64, device=dev)
      _item_power_sums[(items.num,)](
          m, items.perm if items.perm is not None else self._dummy(dev), items.row,
          items.count, items.system, scale_t, parts, p_t, m.shape[1],
          HAS_PERM=items.perm is not None, MODE=mode, BLOCK_R=block_r, BLOCK_W=block_w)
      combined = self._combine(parts, items, 0)
      if leaf.seg is None:
        sums[0] += combined[0]
        worst = max(worst, ITEM_ELEMS + items.num)
      else:
        sums += combined
    depth = np.minimum(batch.counts, worst if not batch.per_system else batch.counts)
    return sums.cpu().numpy(), depth + len(batch.leaves) + 2

  # ----------------------------------------------------------------------- maxima, minima
  def extremes(self, batch: tk.Batch, want_min: bool) -> tuple[np.ndarray, np.ndarray | None]:
    self._check_device(batch)
    K = batch.num_systems
    dev = batch.device
    big = torch.zeros(K, dtype=torch.float64, device=dev)
    small = torch.full((K,), math.inf, dtype=torch.float64, device=dev)
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      m, items, block_r, block_w = self._leaf_view(leaf, K, leaf.sorted, flat=True)
      hi = torch.empty(items.num, dtype=torch.float64, device=dev)
      lo = torch.empty(items.num, dtype=torch.float64, device=dev)
      _item_extremes[(items.num,)](
          m, items.perm if items.perm is not None else self._dummy(dev), items.row,
          items.count, hi, lo, m.shape[1], HAS_PERM=items.perm is not None, BLOCK_R=block_r,
          BLOCK_W=block_w)
      leaf_big = self._combine(hi, items, 1)
      leaf_small = self._combine(lo, items, 2)
      if leaf.seg is None:
        big[:1] = torch.maximum(big[:1], leaf_big)
        small[:1] = torch.minimum(small[:1], leaf_small)
      else:
        big = torch.maximum(big, leaf_big)
        small = torch.minimum(small, leaf_small)
    big = big.cpu().numpy()
    if not want_min:
      return big, None
    small = small.cpu().numpy()
    small[batch.counts == 0] = 0.0
    return big, small

  # --------------------------------------------------------------------------- step norms
  def step_sums(self, batch: tk.Batch) -> tuple[np.ndarray, int]:
    self._check_device(batch)
    K = batch.num_systems
    dev = batch.device
    best = torch.zeros(K, dtype=torch.float64, device=dev)
    longest = 1
    for leaf in batch.leaves:
      if leaf.numel == 0 or leaf.vec == 0:
        continue
      longest = max(longest, leaf.vec)
      m, items, _, _ = self._leaf_view(leaf, K, leaf.sorted, flat=False)
      nvec = leaf.width // leaf.vec
      block_v = _pow2(nvec, 64)
      block_r = max(1, TILE_ELEMS // block_v)
      parts = torch.empty(items.num, dtype=torch.float64, device=dev)
      _item_step[(items.num,)](
          m, items.perm if items.perm is not None else self._dummy(dev), items.row,
          items.count, parts, leaf.width, nvec, leaf.vec, HAS_PERM=items.perm is not None,
          BLOCK_R=block_r, BLOCK_V=block_v)
      combined = self._combine(parts, items, 1)
      if leaf.seg is None:
        best[:1] = torch.maximum(best[:1], combined)
      else:
        best = torch.maximum(best, combined)
    return best.cpu().numpy(), longest

  # -------------------------------------------------------------- float64 pieces (extraction)
  def _accumulate_pieces(self, batch: tk.Batch, p: int,
                         params: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    self._check_device(batch)
    K = batch.num_systems
    dev = batch.device
    acc = torch.zeros(K, 4, dtype=torch.float64, device=dev)
    params = params.contiguous()
    worst = 1
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      m, items, block_r, block_w = self._leaf_view(leaf, K, leaf.sorted, flat=True)
      parts = torch.empty(items.num, 4, dtype=torch.float64, device=dev)
      _item_pieces[(items.num,)](
          m, items.perm if items.perm is not None else self._dummy(dev), items.row,
          items.count, items.system, params, parts, m.shape[1],
          HAS_PERM=items.perm is not None, SQUARE=p == 2, BLOCK_R=block_r, BLOCK_W=block_w)
      cols = torch.stack([self._combine(parts, items, 0, stride=4, offset=j) for j in range(4)],
                         1)
      if leaf.seg is None:
        acc[:1] += cols
        worst = max(worst, ITEM_ELEMS + items.num)
      else:
        acc += cols
    depth = batch.counts if batch.per_system else np.minimum(batch.counts, worst)
    return acc.cpu().numpy(), depth + len(batch.leaves) + 4

  # -------------------------------------------------------------------------------- apply
  def apply(self, batch: tk.Batch, plan: tk.Plan) -> list[torch.Tensor]:
    self._check_device(batch)
    return [self._apply_leaf(leaf, plan) for leaf in batch.leaves]

  def _apply_leaf(self, leaf: tk.Leaf, plan: tk.Plan) -> torch.Tensor:
    codes = tk.leaf_codes(leaf, plan)
    used = codes if leaf.present is None else codes[leaf.present]
    if leaf.numel == 0 or np.any(used == tk.HOST_CODE):
      return tk.apply_leaf(leaf, plan)  # empty, or an exact host computation (extreme s)
    if not np.any(used != tk.KEEP_CODE):
      return leaf.x if leaf.owned else leaf.x.clone()
    x = leaf.x
    dev = x.device
    code_t = torch.as_tensor(codes, device=dev)
    s64 = torch.as_tensor(plan.scale, dtype=torch.float64, device=dev)
    m = leaf.matrix().contiguous()
    out = torch.empty_like(m)
    rows, width = m.shape
    block_w = _pow2(width, 64)
    block_r = max(1, TILE_ELEMS // block_w)
    grid = (triton.cdiv(rows, block_r),)
    seg = leaf.seg if leaf.seg is not None else self._dummy(dev)
    s_low = s64 if x.dtype == torch.float64 else s64.to(torch.float32)
    _apply[grid](m, out, seg, code_t, s_low, s64, rows, width,
                 HAS_SEG=leaf.seg is not None, INT=getattr(tl, _INT_OF[x.dtype]),
                 BLOCK_R=block_r, BLOCK_W=block_w)
    return out.reshape(x.shape)


def _availability() -> tuple[bool, str]:
  if triton is None:
    return False, _IMPORT_ERROR
  if torch.cuda.is_available() or INTERPRET:
    return True, ""
  return False, "no CUDA device, and TRITON_INTERPRET=1 is not set (CPU runs need the interpreter)"


available, unavailable_reason = _availability()
implementation = tk.TorchClipping(
    TritonKernels(), "Triton kernels: one program per (system, fixed-size row chunk), no atomics",
    devices=(("cuda",) if torch.cuda.is_available() else ()) + (("cpu",) if INTERPRET else ()))
implementation.available = available
implementation.unavailable_reason = unavailable_reason
