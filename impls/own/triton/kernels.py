"""The Triton kernels: one program per work item (a fixed-size run of one system's rows).

Each item kernel reduces one item with tile sizes that depend only on the leaf's row width;
``combine`` (one program per system) adds, or takes the max/min of, its items' partials in
item order; ``apply_rows`` writes the outputs. No atomics and no split reductions, so a
system's partial sums are computed by the same instructions in the same order whatever the
other systems are (see :mod:`clipbench.impls.own.triton`).

Arguments are grouped in tuples (Triton passes tuples to kernels): ``items`` is
``(perm, first_row, row_count, system)`` per item (``perm`` maps sorted positions to rows and is
read only when ``HAS_PERM``; kernels that read no system get the first three), ``tile`` the
compile-time ``(HAS_PERM, BLOCK_R, BLOCK_W)``. The PTX for sm_90 is that of the flat
signatures the kernels had before (checked by compiling both without a GPU).
"""

from __future__ import annotations

try:
  import triton
  import triton.language as tl
except ImportError as e:  # pragma: no cover - triton is installed in this project
  triton = None
  IMPORT_ERROR = f"triton not importable: {e}"
else:
  IMPORT_ERROR = ""

if triton is not None:

  @triton.jit
  def _load_f64(ptrs, mask):
    # No `other=` constant: the interpreter cannot build bfloat16 constants.
    return tl.where(mask, tl.load(ptrs, mask=mask).to(tl.float64), 0.0)

  @triton.jit
  def _load_tile(x_ptr, base, rmask, c0, width, BLOCK_W: tl.constexpr):
    """Columns c0 .. c0 + BLOCK_W of the rows at ``base``, as float64 (0 outside), and the mask."""
    cols = c0 + tl.arange(0, BLOCK_W)
    m = rmask[:, None] & (cols < width)[None, :]
    return _load_f64(x_ptr + base[:, None] + cols[None, :], m), m

  @triton.jit
  def _item_span(items):
    """This program's item: its first sorted position and its row count."""
    pid = tl.program_id(0)
    return tl.load(items[1] + pid), tl.load(items[2] + pid)

  @triton.jit
  def _item_rows(items, start, r, count, width, tile: tl.constexpr):
    """Rows r .. r + BLOCK_R of an item: their mask and the offsets of their first elements."""
    HAS_PERM: tl.constexpr = tile[0]
    BLOCK_R: tl.constexpr = tile[1]
    local = r + tl.arange(0, BLOCK_R)
    rmask = local < count
    pos = start + local
    if HAS_PERM:
      row = tl.load(items[0] + pos, mask=rmask, other=0)
    else:
      row = pos
    return rmask, row.to(tl.int64) * width

  @triton.jit
  def item_power_sums(x_ptr, items, scale_ptr, out_ptr, p_ptr, width, MODE: tl.constexpr,
                      tile: tl.constexpr):
    """One work item: float64 sum over its rows of x**2 (MODE 0), |x| (1), (|x| s)**p (2)."""
    BLOCK_R: tl.constexpr = tile[1]
    BLOCK_W: tl.constexpr = tile[2]
    pid = tl.program_id(0)
    p = tl.load(p_ptr)  # float64 (a Python float argument would be float32)
    start, count = _item_span(items)
    sc = tl.load(scale_ptr + tl.load(items[3] + pid))
    acc = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float64)
    for r in range(0, count, BLOCK_R):
      rmask, base = _item_rows(items, start, r, count, width, tile)
      for c0 in range(0, width, BLOCK_W):
        x, _ = _load_tile(x_ptr, base, rmask, c0, width, BLOCK_W)
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
  def item_extremes(x_ptr, items, max_ptr, min_ptr, width, tile: tl.constexpr):
    """One work item: max |x| (NaN if any NaN) and min |x| over its rows."""
    BLOCK_R: tl.constexpr = tile[1]
    BLOCK_W: tl.constexpr = tile[2]
    pid = tl.program_id(0)
    start, count = _item_span(items)
    big = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float64)
    small = tl.full([BLOCK_R, BLOCK_W], float("inf"), dtype=tl.float64)
    nans = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.int32)
    for r in range(0, count, BLOCK_R):
      rmask, base = _item_rows(items, start, r, count, width, tile)
      for c0 in range(0, width, BLOCK_W):
        x, m = _load_tile(x_ptr, base, rmask, c0, width, BLOCK_W)
        a = tl.abs(x)
        is_nan = a != a
        nans += is_nan.to(tl.int32)
        big = tl.maximum(big, tl.where(is_nan, 0.0, a))
        small = tl.minimum(small, tl.where(m & (a == a), a, float("inf")))
    top = tl.max(tl.max(big, axis=1), axis=0)
    has_nan = tl.sum(tl.sum(nans, axis=1), axis=0) > 0
    tl.store(max_ptr + pid, tl.where(has_nan, float("nan"), top))
    tl.store(min_ptr + pid, tl.min(tl.min(small, axis=1), axis=0))

  @triton.jit
  def item_step(x_ptr, items, out_ptr, width, nvec, vec, tile: tl.constexpr):
    """One work item: the largest float64 sum of squares of a step vector in its rows.

    ``tile`` is ``(HAS_PERM, BLOCK_R, BLOCK_V)``: BLOCK_V step vectors of a row at a time.
    """
    BLOCK_R: tl.constexpr = tile[1]
    BLOCK_V: tl.constexpr = tile[2]
    pid = tl.program_id(0)
    start, count = _item_span(items)
    best = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float64)
    nans = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.int32)
    for r in range(0, count, BLOCK_R):
      rmask, base = _item_rows(items, start, r, count, width, tile)
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
  def item_pieces(x_ptr, items, params_ptr, out_ptr, width, SQUARE: tl.constexpr,
                  tile: tl.constexpr):
    """One work item: sums of the error-free extracted pieces (q1, q2, qt, rest), float64.

    ``params`` holds per system (a, b, sigma1, sigma2, sigma_t), as the eager
    ``piece_row_sums`` reads them.
    """
    BLOCK_R: tl.constexpr = tile[1]
    BLOCK_W: tl.constexpr = tile[2]
    pid = tl.program_id(0)
    start, count = _item_span(items)
    k = tl.load(items[3] + pid)
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
      rmask, base = _item_rows(items, start, r, count, width, tile)
      for c0 in range(0, width, BLOCK_W):
        x, _ = _load_tile(x_ptr, base, rmask, c0, width, BLOCK_W)
        y = tl.abs(x)
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
  def combine(part_ptr, first_ptr, count_ptr, out_ptr, stride, MODE: tl.constexpr):
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
  def apply_rows(x_ptr, out_ptr, seg_ptr, per_system, rows, width, tile: tl.constexpr):
    """Output rows: 0 keep, 1 x*s rounded to nearest, 2 x*s rounded toward zero, 3 NaN.

    ``per_system`` is ``(code, s in the rounding dtype, s in float64)`` per system; ``tile``
    ``(HAS_SEG, INT, BLOCK_R, BLOCK_W)`` with INT the integer type of the leaf's width.
    """
    code_ptr, slow_ptr, s64_ptr = per_system
    HAS_SEG: tl.constexpr = tile[0]
    INT: tl.constexpr = tile[1]
    BLOCK_R: tl.constexpr = tile[2]
    BLOCK_W: tl.constexpr = tile[3]
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
