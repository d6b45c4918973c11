"""The decisions in one Triton kernel: the certified tests of :mod:`.certified`, per system.

``decide_systems`` runs, for a block of systems per program, what the eager route runs as
tensor operations (:mod:`clipbench.impls.own.torch.measure` for the intervals,
:mod:`clipbench.impls.own.torch.certified` for the decisions, the plan's assembly in
:mod:`clipbench.impls.own.torch.decisions`), statement for statement, so that both reach the
same decisions (a test holds them to the same bits). One difference: a per-system power sum's
depth may count its runs rather than its elements, as the Triton scan keeps its rounding
errors (:mod:`.kernels`); the eager route's ``index_add_`` cannot. It writes the plan into
the scratch buffer and the call's summary (:mod:`.scratch`), which the host reads once.

Every float64 constant is built as float64 (``f64``): a Python float in a Triton expression
may be taken as a float32 constant (``1 + 2**-50`` would become 1), and Dekker's split
constant needs 28 bits. The kernel is launched with ``enable_fp_fusion=False``: the
double-double products rely on no multiply-add being contracted.
"""

from __future__ import annotations

from typing import NamedTuple

from clipbench.impls.own.triton.kernels import BITS, triton
from clipbench.impls.own.triton.scratch import WORDS


class Kinds(NamedTuple):
  """What the measure passes left for the decisions to read (the kernel's ``KIND``)."""

  SUM: int = 0
  POWER: int = 1
  MAX: int = 2
  MIN: int = 3
  STEP: int = 4
  PIECES: int = 5
  EXACT: int = 6


class Numbers(NamedTuple):
  """The decisions' constants (those of :mod:`clipbench.impls.own.torch.certified`)."""

  FIT_UP: float = 1 + 2.0 ** -50
  FIT_DOWN: float = 1 - 2.0 ** -50
  W24: float = 5.0 * 2.0 ** -26
  W53: float = 5.0 * 2.0 ** -55
  U64: float = 2.0 ** -53
  SPLITTER: float = 134217729.0  # 2**27 + 1
  FLOAT32_OVERFLOW: float = (2 - 2.0 ** -24) * 2.0 ** 127
  REL_SQRT: float = 0.5001
  REL_SUM: float = 1.0001
  POW_REL_ERR: float = 2.0 ** -49  # of a term exp2(p log2 y): see TritonKernels
  POW_ABS_ERR: float = 2.0 ** -50
  STEP24: int = 1 << 29
  INF_BITS: int = BITS.INF_BITS


# Constexpr arguments' defaults of the kernel, not globals (scratch.Words says why).
KINDS = Kinds()
NUMBERS = Numbers()

if triton is not None:
  import triton.language as tl

  from clipbench.impls.own.triton.kernels import frexp_exponent, pow2, two_sum

  @triton.jit
  def f64(value: tl.constexpr):
    """A float64 constant, exactly."""
    return tl.full([], value, tl.float64)

  @triton.jit
  def ldexp(x, e):
    """x * 2**e in two exact halves (e int64)."""
    half = e // 2
    half = tl.where(half * 2 > e, half - 1, half)  # floor, whatever // rounds toward
    return x * pow2(half) * pow2(e - half)

  @triton.jit
  def next_down(v):
    """The float64 below v >= 0 (0 stays 0, NaN stays NaN)."""
    bits = v.to(tl.int64, bitcast=True)
    return tl.where(v > 0, (bits - 1).to(tl.float64, bitcast=True), v)

  @triton.jit
  def next_up(v):
    """The float64 above v >= 0 (inf stays inf, NaN stays NaN)."""
    bits = v.to(tl.int64, bitcast=True)
    return tl.where(v < float("inf"), (bits + 1).to(tl.float64, bitcast=True), v)

  @triton.jit
  def gamma(depth, NUMBERS: tl.constexpr):
    d = depth * f64(NUMBERS.U64)
    return d / (1 - d)

  @triton.jit
  def around(mid, rel):
    lo = next_down(mid * (1 - rel))
    return tl.maximum(lo, 0.0), mid, next_up(mid * (1 + rel))

  @triton.jit
  def fast_two_sum(a, b):
    s = a + b
    return s, b - (s - a)

  @triton.jit
  def split(a, NUMBERS: tl.constexpr):
    c = f64(NUMBERS.SPLITTER) * a
    hi = c - (c - a)
    return hi, a - hi

  @triton.jit
  def two_prod(a, b, NUMBERS: tl.constexpr):
    p = a * b
    ah, al = split(a, NUMBERS)
    bh, bl = split(b, NUMBERS)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl

  @triton.jit
  def root(x, p):
    """x**(1/p) for x >= 0 (exp2 of log2 / p)."""
    return tl.where(x > 0, tl.exp2(tl.log2(tl.where(x > 0, x, 1.0)) / p), 0.0)

  @triton.jit
  def power_interval(total, depth, counts, e, p, NUMBERS: tl.constexpr):
    g = gamma(depth, NUMBERS)
    underflow = counts * f64(NUMBERS.POW_ABS_ERR)
    s_lo = ((total - underflow) / ((1 + g) * (1 + f64(NUMBERS.POW_REL_ERR)))
            * (1 - 4 * f64(NUMBERS.U64)))
    s_hi = ((total + underflow) / ((1 - g) * (1 - f64(NUMBERS.POW_REL_ERR)))
            * (1 + 4 * f64(NUMBERS.U64)))
    root_err = (tl.abs(tl.log(tl.maximum(total, f64(1e-300)))) + 4) * f64(2.0 ** -51)
    lo = ldexp(root(tl.maximum(s_lo, 0.0), p) * (1 - root_err), e)
    hi = ldexp(root(s_hi, p) * (1 + root_err), e)
    mid = ldexp(root(total, p), e)
    return tl.where(s_lo > 0, lo, 0.0), mid, hi

  @triton.jit
  def decide_float32(lo, mid, hi, c, todo, NUMBERS: tl.constexpr):
    """:func:`clipbench.impls.own.torch.certified.decide_float32`, per system."""
    finite_c = c < float("inf")
    clip = finite_c & (lo > c)
    keep = (~finite_c) | (hi <= c)
    r = mid.to(tl.float32)
    rb = r.to(tl.int32, bitcast=True)
    prev = tl.where(r > 0, (rb - 1).to(tl.float32, bitcast=True), r).to(tl.float64)
    nxt = tl.where(r < float("inf"), (rb + 1).to(tl.float32, bitcast=True), r).to(tl.float64)
    r64 = r.to(tl.float64)
    m_lo = (r64 + prev) / 2
    m_hi = tl.where(nxt == float("inf"), f64(NUMBERS.FLOAT32_OVERFLOW), (r64 + nxt) / 2)
    exact_r = (lo > m_lo) & (hi < m_hi) & (r64 < float("inf")) & (r64 > 0)
    inf_r = (r64 == float("inf")) & (lo >= f64(NUMBERS.FLOAT32_OVERFLOW))
    decided = todo & (clip | keep) & (exact_r | inf_r)
    norm = tl.where(inf_r, float("inf"), r64)
    work = clip & decided & (c > 0)
    q = c / (tl.where(lo > 0, lo, 1.0) * (1 + f64(NUMBERS.W24)))
    in_range = (q > f64(2.0 ** -1000)) & (q < f64(2.0 ** 1000))
    s0 = tl.where(in_range, q, 1.0).to(tl.int64, bitcast=True) & -NUMBERS.STEP24
    index = tl.full(q.shape, -1, tl.int64)
    chosen = tl.zeros_like(q)
    ok = tl.zeros(q.shape, dtype=tl.int1)
    for j in tl.static_range(3):  # candidates s0 - 1, s0, s0 + 1 steps
      cand = (s0 + (j - 1) * NUMBERS.STEP24).to(tl.float64, bitcast=True)
      grown = cand + cand * f64(NUMBERS.W24)
      fits = hi * grown * f64(NUMBERS.FIT_UP) <= c
      overshoots = lo * grown * f64(NUMBERS.FIT_DOWN) > c
      ok = tl.where(index == j - 1, overshoots, ok)
      index = tl.where(fits, j, index)
      chosen = tl.where(fits, cand, chosen)
    ok = ok & (index >= 0) & (index < 2)
    ambiguous = todo & ~(decided & ~(work & ~(in_range & ok)))
    return clip, norm, tl.where(work, chosen, 0.0), ambiguous

  @triton.jit
  def decide_float64(q1, q2, qt, rest, bound, e, P: tl.constexpr, c, prec24, todo,
                     NUMBERS: tl.constexpr):
    """:func:`clipbench.impls.own.torch.certified.decide_float64`, per system."""
    sh, e1 = two_sum(q1, q2)
    sh, e2 = two_sum(sh, qt)
    sh, e3 = two_sum(sh, rest)
    sh, sl = fast_two_sum(sh, e1 + e2 + e3)
    ds = bound + f64(2.0 ** -102) * tl.abs(sh)
    if P == 2:
      nh = tl.sqrt(sh)
      ph, pl = two_prod(nh, nh, NUMBERS)
      nl = (((sh - ph) - pl) + sl) / (2 * nh)
      nh, nl = fast_two_sum(nh, nl)
      dn = ds / (f64(1.9) * nh) + f64(2.0 ** -100) * nh
    else:
      nh = sh
      nl = sl
      dn = ds
    finite = float("inf")
    valid = (nh < finite) & (nh > 0) & (dn < finite) & (dn < f64(2.0 ** -70) * nh)
    ok_e = (e > -900) & (e < 900)
    ee = tl.where(ok_e, e, 0)
    cs = ldexp(c, -ee)
    valid = valid & ok_e & ((c == finite) | ((cs > f64(2.0 ** -900)) & (cs < f64(2.0 ** 900)))
                            | (c == 0))
    d = (nh - cs) + nl
    far = (cs >= 2 * nh) | (cs <= nh / 2)
    clip = (tl.where(far, cs < nh, d > 0) & (c < finite)) | (c == 0)
    decided = valid & ((c == finite) | (c == 0) | far
                       | (tl.abs(d) > 2 * dn + f64(2.0 ** -104) * nh))
    nh_bits = nh.to(tl.int64, bitcast=True)
    up = (nh_bits + 1).to(tl.float64, bitcast=True) - nh
    down = nh - tl.where(nh > 0, (nh_bits - 1).to(tl.float64, bitcast=True), nh)
    exact_r = ((nl < up / 2 - dn - f64(2.0 ** -104) * nh)
               & (nl > -down / 2 + dn + f64(2.0 ** -104) * nh))
    norm = ldexp(nh, ee)
    decided = (todo & decided & exact_r & (tl.abs(norm) >= f64(2.0 ** -1022))
               & (tl.abs(norm) < finite))
    w = tl.where(prec24, f64(NUMBERS.W24), f64(NUMBERS.W53))
    work = clip & decided & (c > 0)
    q = tl.where(work, cs / nh / (1 + w), 1.0)
    in_range = (q > f64(2.0 ** -990)) & (q < f64(2.0 ** 990))
    step = tl.where(prec24, NUMBERS.STEP24, 1).to(tl.int64)
    s0 = tl.where(in_range, q, 1.0).to(tl.int64, bitcast=True) & -step
    index = tl.full(q.shape, -1, tl.int64)
    chosen = tl.zeros_like(q)
    ok = tl.zeros(q.shape, dtype=tl.int1)
    for j in tl.static_range(8):  # candidates s0 - 4 .. s0 + 3 steps
      cand = (s0 + (j - 4) * step).to(tl.float64, bitcast=True)
      a1, a2 = two_prod(cand, nh, NUMBERS)
      f = ((cs - a1) - a2) - cand * nl - (a1 * w + a2 * w)
      sure = tl.abs(f) > cand * (1 + w) * dn + f64(2.0 ** -100) * cs
      ok = tl.where(index == j - 1, sure & (f < 0), ok)
      index = tl.where(sure & (f >= 0), j, index)
      chosen = tl.where(sure & (f >= 0), cand, chosen)
    ok = ok & (index >= 0) & (index < 7)
    ambiguous = todo & ~(decided & ~(work & ~(in_range & ok)))
    return clip, norm, tl.where(work, chosen, 0.0), ambiguous

  @triton.jit
  def _parts_total(f64p, base, K, n_items, word, BLOCK: tl.constexpr, WORDS: tl.constexpr):
    """The one-system passes' item partials (one word of each), summed in item order."""
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for i in range(0, n_items, BLOCK):
      idx = i + tl.arange(0, BLOCK)
      mi = idx < n_items
      acc += tl.where(mi, tl.load(f64p + base + WORDS.PARTS * K + idx * WORDS.PART_WORDS + word,
                                  mask=mi), 0.0)
    return tl.sum(acc, axis=0)

  @triton.jit
  def decide_systems(scratch, base, K, n_leaves, n_items, n_total, thr, thr_bits, p_bits,
                     depth_bits, rel_bits, KIND: tl.constexpr, P: tl.constexpr,
                     PER_SYSTEM: tl.constexpr, NORM64: tl.constexpr, PREC: tl.constexpr,
                     THRESHOLD: tl.constexpr, CHECK_THRESHOLD: tl.constexpr,
                     CERTIFIED: tl.constexpr, HAS32: tl.constexpr, HAS64: tl.constexpr,
                     BLOCK: tl.constexpr, WORDS: tl.constexpr = WORDS,
                     KINDS: tl.constexpr = KINDS, NUMBERS: tl.constexpr = NUMBERS):
    """Each system's interval, decisions and plan; the call's summary words.

    ``THRESHOLD``: 0 one value given as float64 bits (``thr_bits``), 1 one value per system
    at ``thr``, 2 one value at ``thr``. ``PREC`` the factor bits, 24 or 53, or 0: per system
    (24 where the system holds a 16/32-bit element). ``depth_bits`` (float64 bits): a
    one-system sum's depth, or per system the roundings a unit's sum makes before the scan
    (:func:`clipbench.impls.own.triton.passes._unit_roundings`); ``rel_bits``: the step norms'
    relative error.
    """
    pid = tl.program_id(0)
    k = pid * BLOCK + tl.arange(0, BLOCK)
    mk = k < K
    fp = scratch.to(tl.pointer_type(tl.float64), bitcast=True)
    zero = tl.zeros([BLOCK], dtype=tl.float64)
    p = tl.cast(p_bits, tl.int64).to(tl.float64, bitcast=True)
    if THRESHOLD == 0:
      c = tl.cast(thr_bits, tl.int64).to(tl.float64, bitcast=True) + zero
    elif THRESHOLD == 1:
      c = tl.load(thr + k, mask=mk, other=0.0)
    else:
      c = tl.load(thr) + zero
    if CHECK_THRESHOLD:
      bad = mk & ((c != c) | (c < 0))
      first = tl.min(tl.where(bad, k, K), axis=0)
      tl.atomic_max(scratch + WORDS.BAD_THRESHOLD, K - first, mask=first < K)
      c = tl.where(bad, 0.0, c)
    depth_arg = tl.cast(depth_bits, tl.int64).to(tl.float64, bitcast=True)
    if PER_SYSTEM:
      counts = tl.load(fp + base + WORDS.COUNT * K + k, mask=mk, other=0.0)
      depth = counts + n_leaves + 2
      if KIND == KINDS.SUM:
        # Along any path of a system's sum: a unit's roundings, its run's two-sum total
        # rounded once (the compensation leaves far below one unit), one rounding per further
        # run (atomic); and one to spare. Both bounds hold: the smaller is taken.
        runs = tl.load(scratch + base + WORDS.RUNS * K + k, mask=mk, other=0).to(tl.float64)
        depth = tl.minimum(depth, runs + depth_arg + 2)
    else:
      counts = zero + n_total
      depth = depth_arg + zero
    if KIND != KINDS.SUM and KIND != KINDS.STEP:
      big = tl.load(scratch + base + WORDS.BIG * K + k, mask=mk, other=0).to(tl.float64,
                                                                          bitcast=True)
      nan = big != big
      inf = big == float("inf")
      e = tl.where((big > 0) & (big < float("inf")), frexp_exponent(tl.where(
          (big > 0) & (big < float("inf")), big, 1.0)), 0)
    # The measured values and their intervals (or float64 pieces).
    if KIND == KINDS.SUM or KIND == KINDS.POWER:
      if PER_SYSTEM:
        total = tl.load(fp + base + WORDS.SUMS * K + k, mask=mk, other=0.0)
      else:
        total = tl.where(k == 0, _parts_total(fp, base, K, n_items, 0, BLOCK, WORDS), 0.0)
      if KIND == KINDS.SUM:
        nan = total != total
        inf = total == float("inf")
        zeros = total == 0
        if P == 2:
          mid = tl.sqrt(total)
          rel = gamma(depth, NUMBERS) * f64(NUMBERS.REL_SQRT) + 4 * f64(NUMBERS.U64)
        else:
          mid = total
          rel = gamma(depth, NUMBERS) * f64(NUMBERS.REL_SUM) + 4 * f64(NUMBERS.U64)
        lo, mid, hi = around(mid, rel)
      else:
        zeros = big == 0
        lo, mid, hi = power_interval(total, depth, counts, e, p, NUMBERS)
    elif KIND == KINDS.MAX or KIND == KINDS.MIN:
      if KIND == KINDS.MAX:
        value = big
      else:
        small = NUMBERS.INF_BITS - tl.load(scratch + base + WORDS.SMALL * K + k, mask=mk,
                                           other=0)
        value = tl.where(counts > 0, small.to(tl.float64, bitcast=True), 0.0)
      zeros = value == 0
      tl.store(fp + base + WORDS.VALUE * K + k, value, mask=mk)
      lo = value
      mid = value
      hi = value
    elif KIND == KINDS.STEP:
      best = tl.load(scratch + base + WORDS.SUMS * K + k, mask=mk, other=0).to(tl.float64,
                                                                           bitcast=True)
      nan = best != best
      inf = best == float("inf")
      zeros = best == 0
      lo, mid, hi = around(tl.sqrt(best), tl.cast(rel_bits, tl.int64).to(tl.float64, bitcast=True))
    else:
      zeros = big == 0
    todo = mk & ~nan & ~inf & ~zeros
    if PREC == 0:
      prec24 = tl.load(scratch + base + WORDS.LOW * K + k, mask=mk, other=0) != 0
    else:
      prec24 = tl.full([BLOCK], PREC == 24, tl.int1)
    if KIND == KINDS.EXACT or not CERTIFIED:
      clip = tl.zeros([BLOCK], dtype=tl.int1)
      norm = zero
      s = zero
      ambiguous = todo
    elif NORM64:
      if KIND == KINDS.PIECES:
        if PER_SYSTEM:
          q1 = tl.load(fp + base + WORDS.Q1 * K + k, mask=mk, other=0.0)
          q2 = tl.load(fp + base + WORDS.Q2 * K + k, mask=mk, other=0.0)
          qt = tl.load(fp + base + WORDS.QT * K + k, mask=mk, other=0.0)
          rest = tl.load(fp + base + WORDS.REST * K + k, mask=mk, other=0.0)
          depth = counts + n_leaves + 4
        else:
          q1 = tl.where(k == 0, _parts_total(fp, base, K, n_items, 0, BLOCK, WORDS), 0.0)
          q2 = tl.where(k == 0, _parts_total(fp, base, K, n_items, 1, BLOCK, WORDS), 0.0)
          qt = tl.where(k == 0, _parts_total(fp, base, K, n_items, 2, BLOCK, WORDS), 0.0)
          rest = tl.where(k == 0, _parts_total(fp, base, K, n_items, 3, BLOCK, WORDS), 0.0)
          tl.store(fp + base + WORDS.Q1 * K + k, q1, mask=mk)
          tl.store(fp + base + WORDS.Q2 * K + k, q2, mask=mk)
          tl.store(fp + base + WORDS.QT * K + k, qt, mask=mk)
          tl.store(fp + base + WORDS.REST * K + k, rest, mask=mk)
        n = tl.maximum(counts, 1.0)
        grow = pow2(frexp_exponent(n) + 2)
        s2 = grow * f64(NUMBERS.U64) * grow
        st = f64(2.0 ** -24) * grow
        if P == 2:
          per_elem = f64(NUMBERS.U64) * s2 + f64(NUMBERS.U64) * st
          tail = f64(2.0 ** -50) * (q1 + q2 + qt + 1.0)
        else:
          per_elem = f64(NUMBERS.U64) * s2
          tail = zero
        total_abs = n * per_elem * (1 + 4 * f64(NUMBERS.U64)) + tail
        bound = (gamma(depth, NUMBERS) * total_abs + n * 2 * f64(NUMBERS.U64) * per_elem
                 + n * f64(2.0 ** -100) + n * f64(2.0 ** -1070))
        tl.store(fp + base + WORDS.BOUND * K + k, bound, mask=mk)
        tl.store(fp + base + WORDS.E * K + k, e.to(tl.float64), mask=mk)
        clip, norm, s, ambiguous = decide_float64(q1, q2, qt, rest, bound, e, P, c, prec24,
                                                  todo, NUMBERS)
      else:  # max or min |x|: known exactly
        ok = (value > 0) & (value < float("inf"))
        ev = tl.where(ok, frexp_exponent(tl.where(ok, value, 1.0)), 0)
        clip, norm, s, ambiguous = decide_float64(
            tl.where(ok, ldexp(value, -ev), 0.0), zero, zero, zero, zero, ev, 1, c, prec24,
            todo, NUMBERS)
    else:
      clip, norm, s, ambiguous = decide_float32(lo, mid, hi, c, todo, NUMBERS)
    scaled = clip & ~ambiguous & todo
    action = tl.where(nan | inf, 2, tl.where(scaled, 1, 0)).to(tl.int64)
    norms = tl.where(todo & ~ambiguous, norm, 0.0)
    norms = tl.where(inf, float("inf"), tl.where(nan, float("nan"), norms))
    scale = tl.where(scaled, s, 0.0)
    trivial = c == 0
    rn32 = ((scale >= f64(2.0 ** -126)) & (c * f64(2.0 ** 123) >= counts)) | trivial
    rn64 = ((scale >= f64(2.0 ** -1022)) & (c * f64(2.0 ** 1019) >= counts)) | trivial
    tl.store(scratch + base + WORDS.ACTION * K + k, action, mask=mk)
    tl.store(fp + base + WORDS.SCALE * K + k, scale, mask=mk)
    tl.store(fp + base + WORDS.NORM * K + k, norms, mask=mk)
    tl.store(scratch + base + WORDS.RN32 * K + k, rn32.to(tl.int64), mask=mk)
    tl.store(scratch + base + WORDS.RN64 * K + k, rn64.to(tl.int64), mask=mk)
    tl.store(scratch + base + WORDS.OPEN * K + k, ambiguous.to(tl.int64), mask=mk)
    if not PER_SYSTEM:
      tl.store(fp + base + WORDS.COUNT * K + k, counts, mask=mk)  # for the host's exact path
    tl.atomic_add(scratch + WORDS.OPEN_COUNT, tl.sum(ambiguous.to(tl.int64), axis=0))
    if HAS32:
      tl.atomic_max(scratch + WORDS.RTZ32, tl.max((scaled & ~rn32).to(tl.int64), axis=0))
    if HAS64:
      tl.atomic_max(scratch + WORDS.HOST64, tl.max((scaled & ~rn64).to(tl.int64), axis=0))
    if not PER_SYSTEM:
      first = k == 0
      tl.store(scratch + WORDS.SINGLE + k * 0, action, mask=first)
      tl.store(scratch + WORDS.SINGLE + 1 + k * 0, scale.to(tl.int64, bitcast=True), mask=first)
      tl.store(scratch + WORDS.SINGLE + 2 + k * 0, rn32.to(tl.int64), mask=first)
      tl.store(scratch + WORDS.SINGLE + 3 + k * 0, rn64.to(tl.int64), mask=first)
