"""The Triton passes over the data: one launch per dtype group, a table row per program.

``measure_items`` reads a group's work items (:mod:`.tables`) once and accumulates what the
decisions need into the call's scratch buffer (:mod:`.scratch`); ``apply_items`` writes the
outputs from the decisions. Per system, a program reduces each tile of its item with a
segmented scan (runs of equal system ids) and adds each run's total into its system with one
atomic operation: float64 sums of nonnegative terms in any order stay within the certified
bound, the extracted float64 pieces are exact in any order, and maxima are order-free, so no
output bit depends on the order the atomics land in (the canonical definitions of
:mod:`clipbench.impls.own.torch`). The power sums' scan carries each run's rounding errors
(error-free additions), so a system's sum is within ``gamma(runs + unit additions + 2)`` of
its exact value whatever the scan's tree, where ``gamma`` of its element count is all an
uncompensated scan allows; the atomics count the runs. Why it matters: at a million systems
the element count left a few open for the exact path in nearly every call (``docs/gpu.md``,
section 13). One system (no ids): each program writes its item's partials to a slot of its
own, reduced in item order by the decision kernel.

Interpreter workarounds, harmless on CUDA: no ``other=`` constants in float loads (the
interpreter cannot build bfloat16 constants), bfloat16 is widened and cut through its bits
(the interpreter's bfloat16 conversions lose subnormals; the hardware's is the same shift),
float64 -> bfloat16 casts go through float32 (the rounding toward zero below takes either
neighbour), general p uses ``exp2(p * log2 y)`` (no ``pow`` in the interpreter) with a
correspondingly larger certified error. Launched with ``enable_fp_fusion=False``: no
multiply-add is contracted, as in the interpreter and in eager torch.
"""

from __future__ import annotations

from typing import NamedTuple

try:
  import triton
  import triton.language as tl
except ImportError as e:  # pragma: no cover - triton is installed in this project
  triton = None
  IMPORT_ERROR = f"triton not importable: {e}"
else:
  IMPORT_ERROR = ""

from clipbench.impls.own.triton import tables
from clipbench.impls.own.triton.scratch import WORDS


class Modes(NamedTuple):
  """What a measure launch accumulates (its ``MODE``)."""

  SQUARES: int = 0
  MAGNITUDES: int = 1
  POWERS: int = 2
  EXTREMES: int = 3
  STEPS: int = 4
  PIECES: int = 5


class Bits(NamedTuple):
  """Integer constants of the passes: float64's sign mask and +inf as bits, a table row's
  columns."""

  SIGN_OFF: int = (1 << 63) - 1
  INF_BITS: int = 0x7FF0000000000000
  NCOL: int = tables.NCOL


# The kernels take these (and scratch.WORDS) as constexpr arguments' defaults, not as globals,
# which Triton would compare one by one at each launch (scratch.Words says why).
MODES = Modes()
BITS = Bits()

if triton is not None:

  @triton.jit
  def pow2(e):
    """2.0**e for int64 e in [-1074, 1023], exactly (from the exponent bits, in two steps)."""
    first = tl.minimum(tl.maximum(e, -1022), 1023)
    rest = tl.minimum(tl.maximum(e - first, -1022), 1023)
    return (((first + 1023) << 52).to(tl.float64, bitcast=True)
            * ((rest + 1023) << 52).to(tl.float64, bitcast=True))

  @triton.jit
  def frexp_exponent(v):
    """e with finite v > 0 in [2**(e-1), 2**e), as int64 (subnormals too)."""
    sub = v < 2.2250738585072014e-308
    w = tl.where(sub, v * 18446744073709551616.0, v)  # 2**64
    field = (w.to(tl.int64, bitcast=True) >> 52) & 0x7FF
    return tl.where(sub, field - 1022 - 64, field - 1022)

  @triton.jit
  def two_sum(a, b):
    """s = a + b rounded, and its rounding error e: a + b == s + e exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)

  # Segmented scans: ``f`` flags the first unit of a run (a new system id, or the tile's first
  # unit). (f1, v1) + (f2, v2) = (f1 | f2, v2 if f2 else v1 + v2) is associative whatever the
  # flags (its float additions up to rounding, which the bounds take for any tree), so a
  # parallel scan gives each unit the total of its run up to it; comparing ids instead
  # (v1 + v2 when k1 == k2) is not, when a tile holds a system's units in two runs.
  @triton.jit
  def _sum_runs_compensated(f1, h1, l1, n1, f2, h2, l2, n2):
    """A run's total as ``h + l``: ``h`` its float64 sum, ``l`` the sum of the additions'
    rounding errors (Knuth's error-free two-sum), so that ``h + l`` is within about
    ``(units * 2**-53)**2`` of the exact total whatever tree the scan combines in, and ``n``
    its units. An infinite or NaN ``h`` carries no error term."""
    cut = f2 != 0
    # two_sum(h1, h2), written out: under the interpreter each call of a device function
    # from a combine function re-patches triton.language (milliseconds).
    s = h1 + h2
    bb = s - h1
    err = (h1 - (s - bb)) + (h2 - bb)
    err = tl.where(tl.abs(s) < float("inf"), err, 0.0)
    return (f1 | f2, tl.where(cut, h2, s), tl.where(cut, l2, (l1 + l2) + err),
            tl.where(cut, n2, n1 + n2))

  @triton.jit
  def _max_runs(f1, a1, b1, n1, f2, a2, b2, n2):
    cut = f2 != 0
    return (f1 | f2, tl.where(cut, a2, tl.maximum(a1, a2)), tl.where(cut, b2, tl.maximum(b1, b2)),
            tl.where(cut, n2, n1 + n2))

  @triton.jit
  def _pieces_runs(f1, a1, b1, c1, d1, f2, a2, b2, c2, d2):
    cut = f2 != 0
    return (f1 | f2, tl.where(cut, a2, a1 + a2), tl.where(cut, b2, b1 + b2),
            tl.where(cut, c2, c1 + c2), tl.where(cut, d2, d1 + d2))

  # The segmented scans' combine functions: under the interpreter, their scans run as a
  # log-step scan over whole arrays (.interpreter_scan), not Triton's loop over elements.
  RUN_COMBINES = (_sum_runs_compensated, _max_runs, _pieces_runs)

  @triton.jit
  def _work_item(table, DTYPE: tl.constexpr, BITS: tl.constexpr):
    """This program's table row: the leaf (a typed pointer), its ids, its first unit, how many
    units, units per row, and the row itself."""
    row = table + tl.program_id(0) * BITS.NCOL
    return (tl.load(row).to(tl.pointer_type(DTYPE), bitcast=True),
            tl.load(row + 1).to(tl.pointer_type(tl.int64), bitcast=True),
            tl.load(row + 2), tl.load(row + 3), tl.load(row + 4), row)

  @triton.jit
  def _widened(v):
    """``v`` in float64, exactly. bfloat16 through its bits: the interpreter's bfloat16
    conversions lose subnormals (bfloat16 has float32's exponent range), and on CUDA the
    hardware conversion is this same shift."""
    if v.dtype == tl.bfloat16:
      v = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float64)

  @triton.jit
  def _bfloat16_toward_zero(v):
    """float32 ``v`` cut to bfloat16 toward zero: its top 16 bits (the interpreter's own cast
    loses subnormals)."""
    return (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

  @triton.jit
  def _load_f64(ptrs, mask):
    # No `other=` constant: the interpreter cannot build bfloat16 constants.
    return tl.where(mask, _widened(tl.load(ptrs, mask=mask)), 0.0)

  # Tiles of a 16-byte aligned leaf: its pointers are stated to be contiguous over the tile,
  # from a 16-byte aligned first element (items and tiles start at multiples of the tile), and
  # a full tile is loaded (stored) without a mask, so the compiler emits 16-byte accesses. The
  # hints are given where the pointers are computed: on a helper's argument they are lost.
  # The interpreter ignores them.
  @triton.jit
  def _load_tile(ptrs, m, full, ALIGNED: tl.constexpr):
    if ALIGNED:
      if full:
        v = tl.load(ptrs)
      else:
        v = tl.load(ptrs, mask=m)
    else:
      v = tl.load(ptrs, mask=m)
    return v

  @triton.jit
  def _store_tile(ptrs, values, m, full, ALIGNED: tl.constexpr):
    if ALIGNED:
      if full:
        tl.store(ptrs, values)
      else:
        tl.store(ptrs, values, mask=m)
    else:
      tl.store(ptrs, values, mask=m)

  @triton.jit
  def _system_scale(f64, base, K, key, valid, n_total, PER_SYSTEM: tl.constexpr,
                    WORDS: tl.constexpr):
    """Per unit: e of its system's max |x| (frexp's exponent, 0 for 0 or non-finite), and the
    system's element count (for the float64 extraction's grids)."""
    if PER_SYSTEM:
      k = tl.where(valid, key, 0)
      big = tl.load(f64 + base + WORDS.BIG * K + k, mask=valid, other=0.0)
      count = tl.load(f64 + base + WORDS.COUNT * K + k, mask=valid, other=1.0)
    else:
      big = tl.load(f64 + base + WORDS.BIG * K) + tl.zeros_like(key).to(tl.float64)
      count = tl.zeros_like(key).to(tl.float64) + n_total
    ok = (big > 0) & (big < float("inf"))
    return tl.where(ok, frexp_exponent(tl.where(ok, big, 1.0)), 0), tl.maximum(count, 1.0)

  @triton.jit
  def measure_items(table, scratch, base, K, n_total, slot0, p_bits, DTYPE: tl.constexpr,
                    MODE: tl.constexpr, PER_SYSTEM: tl.constexpr, COUNTS: tl.constexpr,
                    FLAG_LOW: tl.constexpr, SQUARE: tl.constexpr, VEC: tl.constexpr,
                    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, WORDS: tl.constexpr = WORDS,
                    MODES: tl.constexpr = MODES, BITS: tl.constexpr = BITS):
    """One work item of one leaf: what the MODE accumulates, per system or into its slot.

    ``base`` is the first per-system word of the scratch buffer; the summary words before it
    hold each leaf's worst segment ids (ids below 0, and above K - 1, as excesses: 0 means
    none). ``COUNTS`` adds each system's element count; ``FLAG_LOW`` marks the systems that
    hold an element of this (float16/bfloat16/float32) group. ``ALIGNED``: every leaf of the
    group starts at a 16-byte boundary (see ``_load_tile``). ``VEC`` > 1 (``STEPS``, and the
    per-system ``SQUARES`` and ``MAGNITUDES``): the units are rows, read VEC elements at a time.
    """
    pid = tl.program_id(0)
    x, ids, start, count, per_row, row = _work_item(table, DTYPE, BITS)
    leaf = tl.load(row + 5)
    unit = tl.load(row + 6)
    f64 = scratch.to(tl.pointer_type(tl.float64), bitcast=True)
    p = tl.cast(p_bits, tl.int64).to(tl.float64, bitcast=True)
    lanes = tl.arange(0, BLOCK)
    acc_a = tl.zeros([BLOCK], dtype=tl.float64)
    acc_b = tl.zeros([BLOCK], dtype=tl.float64)
    acc_c = tl.zeros([BLOCK], dtype=tl.float64)
    acc_d = tl.zeros([BLOCK], dtype=tl.float64)
    top = tl.zeros([BLOCK], dtype=tl.int64)
    bottom = tl.zeros([BLOCK], dtype=tl.int64)
    below = tl.zeros([BLOCK], dtype=tl.int64)
    above = tl.zeros([BLOCK], dtype=tl.int64)
    for off in range(0, count, BLOCK):
      u = off + lanes
      m = u < count
      units = start + u
      if PER_SYSTEM:
        # One division per unit: a unit's neighbours share its row unless it is the row's
        # first (or last) unit, and only then is the neighbouring row's id read.
        rows_of = units // per_row
        place = units - rows_of * per_row
        raw = tl.load(ids + rows_of, mask=m, other=0)
        valid = m & (raw >= 0) & (raw < K)
        below = tl.maximum(below, tl.where(m & (raw < 0), -raw, 0))
        above = tl.maximum(above, tl.where(m & (raw >= K), raw - K + 1, 0))
        later = m & (u + 1 < count) & (lanes < BLOCK - 1)
        nxt = tl.load(ids + rows_of + 1, mask=later & (place == per_row - 1), other=0)
        nxt = tl.where(place == per_row - 1, nxt, raw)
        end = valid & (~later | (nxt != raw))
        earlier = m & (lanes > 0)
        prv = tl.load(ids + rows_of - 1, mask=earlier & (place == 0), other=0)
        prv = tl.where(place == 0, prv, raw)
        first = (~earlier | (prv != raw)).to(tl.int32)
        key = tl.where(valid, raw, -1)
      else:
        valid = m
        key = tl.zeros([BLOCK], dtype=tl.int64)
      if MODE == MODES.STEPS or VEC > 1:
        # Units are rows of ``unit`` elements (step vectors, or a per-system leaf's short last
        # axis): each row's squares (magnitudes) summed, VEC elements at a time.
        d = tl.arange(0, VEC)
        row_sum = tl.zeros([BLOCK], dtype=tl.float64)
        for c in range(0, unit, VEC):
          vm = valid[:, None] & (c + d[None, :] < unit)
          v = _load_f64(x + units[:, None] * unit + c + d[None, :], vm)
          if MODE == MODES.MAGNITUDES:
            row_sum += tl.sum(tl.abs(v), axis=1)
          else:
            row_sum += tl.sum(v * v, axis=1)
        if MODE == MODES.STEPS:
          a_bits = tl.where(valid, row_sum.to(tl.int64, bitcast=True) & BITS.SIGN_OFF, 0)
          b_bits = tl.zeros([BLOCK], dtype=tl.int64)
        weight = unit.to(tl.int32)
      else:
        ptrs = x + units
        if ALIGNED:
          ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), BLOCK)
        full = off + BLOCK <= count
        v = tl.where(valid, _widened(_load_tile(ptrs, valid, full, ALIGNED)), 0.0)
        weight = 1
      if MODE == MODES.EXTREMES:
        a_bits = tl.where(valid, v.to(tl.int64, bitcast=True) & BITS.SIGN_OFF, 0)
        # NaN left out
        b_bits = tl.where(valid, BITS.INF_BITS - tl.minimum(a_bits, BITS.INF_BITS), 0)
      if VEC > 1 and MODE != MODES.STEPS:
        term = row_sum
      elif MODE == MODES.SQUARES:
        term = v * v
      elif MODE == MODES.MAGNITUDES:
        term = tl.abs(v)
      elif MODE == MODES.POWERS:
        e, _ = _system_scale(f64, base, K, key, valid, n_total, PER_SYSTEM, WORDS)
        y = tl.abs(v) * pow2(-e)
        term = tl.where(y > 0, tl.exp2(p * tl.log2(tl.where(y > 0, y, 1.0))), 0.0)
      elif MODE == MODES.PIECES:
        e, n = _system_scale(f64, base, K, key, valid, n_total, PER_SYSTEM, WORDS)
        half = -e // 2  # floor division: a * b = 2**-e, each a normal float
        half = tl.where(half * 2 > -e, half - 1, half)
        grow = pow2(frexp_exponent(n) + 2)
        s1 = grow
        s2 = grow * 1.1102230246251565e-16 * grow  # sigma1 * u * grow
        st = grow * 5.9604644775390625e-08  # 2**-24 * grow
        y = (tl.abs(v) * pow2(half)) * pow2(-e - half)
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
        else:
          qt = tl.zeros_like(q1)
      ones = tl.where(valid, weight, 0)  # int32: a tile's count is exact, in fewer registers
      if PER_SYSTEM:
        if MODE == MODES.EXTREMES:
          _, a_run, b_run, n_run = tl.associative_scan((first, a_bits, b_bits, ones), 0,
                                                       _max_runs)
          tl.atomic_max(scratch + base + WORDS.BIG * K + key, a_run, mask=end)
          tl.atomic_max(scratch + base + WORDS.SMALL * K + key, b_run, mask=end)
        elif MODE == MODES.STEPS:
          _, a_run, b_run, n_run = tl.associative_scan((first, a_bits, b_bits, ones), 0,
                                                       _max_runs)
          tl.atomic_max(scratch + base + WORDS.SUMS * K + key, a_run, mask=end)
        elif MODE == MODES.PIECES:
          _, a_run, b_run, c_run, d_run = tl.associative_scan((first, q1, q2, qt, rest), 0,
                                                              _pieces_runs)
          tl.atomic_add(f64 + base + WORDS.Q1 * K + key, a_run, mask=end)
          tl.atomic_add(f64 + base + WORDS.Q2 * K + key, b_run, mask=end)
          tl.atomic_add(f64 + base + WORDS.QT * K + key, c_run, mask=end)
          tl.atomic_add(f64 + base + WORDS.REST * K + key, d_run, mask=end)
          n_run = ones
        else:
          terms = tl.where(valid, term, 0.0)
          _, h_run, l_run, n_run = tl.associative_scan(
              (first, terms, tl.zeros_like(terms), ones), 0, _sum_runs_compensated)
          tl.atomic_add(f64 + base + WORDS.SUMS * K + key, h_run + l_run, mask=end)
          tl.atomic_add(scratch + base + WORDS.RUNS * K + key, tl.full([BLOCK], 1, tl.int64),
                        mask=end)
        if COUNTS:
          tl.atomic_add(f64 + base + WORDS.COUNT * K + key, n_run.to(tl.float64), mask=end)
        if FLAG_LOW:
          tl.atomic_max(scratch + base + WORDS.LOW * K + key, tl.full([BLOCK], 1, tl.int64),
                        mask=end)
      else:
        if MODE == MODES.EXTREMES or MODE == MODES.STEPS:
          top = tl.maximum(top, a_bits)
          bottom = tl.maximum(bottom, b_bits)
        elif MODE == MODES.PIECES:
          acc_a += tl.where(valid, q1, 0.0)
          acc_b += tl.where(valid, q2, 0.0)
          acc_c += tl.where(valid, qt, 0.0)
          acc_d += tl.where(valid, rest, 0.0)
        else:
          acc_a += tl.where(valid, term, 0.0)
    if PER_SYSTEM:
      worst_below = tl.max(below, axis=0)
      worst_above = tl.max(above, axis=0)
      tl.atomic_max(scratch + WORDS.LEAF_WORDS + 2 * leaf, worst_below, mask=worst_below > 0)
      tl.atomic_max(scratch + WORDS.LEAF_WORDS + 2 * leaf + 1, worst_above, mask=worst_above > 0)
    else:
      if MODE == MODES.EXTREMES:
        tl.atomic_max(scratch + base + WORDS.BIG * K, tl.max(top, axis=0))
        tl.atomic_max(scratch + base + WORDS.SMALL * K, tl.max(bottom, axis=0))
      elif MODE == MODES.STEPS:
        tl.atomic_max(scratch + base + WORDS.SUMS * K, tl.max(top, axis=0))
      else:
        slot = f64 + base + WORDS.PARTS * K + (slot0 + pid) * WORDS.PART_WORDS
        tl.store(slot, tl.sum(acc_a, axis=0))
        tl.store(slot + 1, tl.sum(acc_b, axis=0))
        tl.store(slot + 2, tl.sum(acc_c, axis=0))
        tl.store(slot + 3, tl.sum(acc_d, axis=0))

  @triton.jit
  def apply_items(table, out, scratch, base, K, DTYPE: tl.constexpr, INT: tl.constexpr,
                  PER_SYSTEM: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
                  WORDS: tl.constexpr = WORDS, BITS: tl.constexpr = BITS):
    """One work item's outputs: each element kept, x*s to nearest or toward zero, or NaN.

    float32 elements round to nearest where their system's ``rn32`` says so, float64 where
    ``rn64`` does (elsewhere the host rewrites those rows exactly), float16/bfloat16 always
    toward zero (x*s is exact in float64 for them). ``ALIGNED``: every leaf, and its place in
    ``out``, starts at a 16-byte boundary (see ``_load_tile``).
    """
    x, ids, start, count, per_row, row = _work_item(table, DTYPE, BITS)
    y_out = out + tl.load(row + 7)
    f64 = scratch.to(tl.pointer_type(tl.float64), bitcast=True)
    lanes = tl.arange(0, BLOCK)
    for off in range(0, count, BLOCK):
      u = off + lanes
      m = u < count
      full = off + BLOCK <= count
      units = start + u
      if PER_SYSTEM:
        k = tl.load(ids + units // per_row, mask=m, other=0)
      else:
        k = tl.zeros([BLOCK], dtype=tl.int64)
      action = tl.load(scratch + base + WORDS.ACTION * K + k, mask=m, other=0)
      s64 = tl.load(f64 + base + WORDS.SCALE * K + k, mask=m, other=0.0)
      if DTYPE == tl.float32:
        nearest = tl.load(scratch + base + WORDS.RN32 * K + k, mask=m, other=1) != 0
      elif DTYPE == tl.float64:
        nearest = tl.load(scratch + base + WORDS.RN64 * K + k, mask=m, other=1) != 0
      else:
        nearest = tl.zeros([BLOCK], dtype=tl.int1)
      ptrs = x + units
      dest = y_out + units
      if ALIGNED:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), BLOCK)
        dest = tl.max_contiguous(tl.multiple_of(dest, 16), BLOCK)
      xv = _load_tile(ptrs, m, full, ALIGNED)
      if DTYPE == tl.float64:
        rn = xv * s64
        exact = rn
        y = rn
      else:
        rn = (xv.to(tl.float32) * s64.to(tl.float32)).to(DTYPE)
        exact = _widened(xv) * s64
        # Through float32: the interpreter's float64 -> bfloat16 cast is broken. Either
        # neighbour of the exact value will do: the next lines round toward zero.
        if DTYPE == tl.bfloat16:
          y = _bfloat16_toward_zero(exact.to(tl.float32))
        else:
          y = exact.to(tl.float32).to(DTYPE)
      over = tl.abs(_widened(y)) > tl.abs(exact)
      bits = y.to(INT, bitcast=True)
      rtz = tl.where(over, bits - 1, bits).to(DTYPE, bitcast=True)
      nan = tl.full([BLOCK], float("nan"), dtype=tl.float32).to(DTYPE)
      scaled = tl.where(nearest, rn, rtz)
      result = tl.where(action == 0, xv, tl.where(action == 1, scaled, nan))
      _store_tile(dest, result, m, full, ALIGNED)
