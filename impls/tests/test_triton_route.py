"""The Triton route gives the eager CUDA route's bits, and its decision kernel its decisions.

Both routes compute the canonical definitions of :mod:`clipbench.impls.own.torch`; Triton
decides in one kernel (``decision_kernel``) what the eager route decides as tensor operations
(``certified``). The kernel is held to the operators statement for statement: on the same
measured values both must reach the same decisions, including which systems they leave open.
Run under ``TRITON_INTERPRET=1`` (the Triton kernels on CPU tensors); the eager route on its
accelerator branches.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1")

# pylint: disable=wrong-import-position
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from clipbench.impls.own.torch import branches, eager  # noqa: E402
from clipbench.impls.own.torch.certified import (decide_float32, decide_float64,  # noqa: E402
                                                  exact_value_pieces)
from clipbench.impls.own.torch.floats import U64, gamma  # noqa: E402
from clipbench.impls.own.torch.measure import _around  # noqa: E402
from clipbench.impls.own.triton.kernels import _sum_runs_compensated  # noqa: E402


def _bits(t: torch.Tensor) -> bytes:
  ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
  return t.detach().contiguous().view(ints).numpy().tobytes()


def _batch(rng, dtype, sorted_ids):
  K = int(rng.integers(1, 6))
  scale = 10.0 ** rng.uniform(-3, 3 if dtype in (torch.float16, torch.bfloat16) else 30)
  leaves = [torch.tensor(rng.standard_normal((int(rng.integers(1, 40)), 3)) * scale).to(dtype),
            torch.tensor(rng.standard_normal(int(rng.integers(1, 30))) * scale).to(dtype),
            torch.tensor(rng.standard_normal((4, 2, 3)) * scale).to(torch.float32)]
  ids = [rng.integers(0, K, x.shape[0]) for x in leaves]
  segments = [torch.tensor(np.sort(v) if sorted_ids else v) for v in ids]
  return leaves, segments, K


def _assert_global_norms_give_the_eager_bits(leaves, kwargs, p, c, c_global, context):
  """Triton's clip_by_global_norm (threshold ``c``, ``kwargs``' systems) and clip_grad_norm
  (``c_global``) give the eager CUDA route's bits, outputs and norms."""
  from clipbench.impls.own.triton import implementation as triton_impl
  with branches.accelerator_branches():
    want = eager.clip_by_global_norm(leaves, c, norm_type=p, **kwargs)
    want_global = eager.clip_grad_norm(leaves, c_global, norm_type=p)
  got = triton_impl.clip_by_global_norm(leaves, c, norm_type=p, **kwargs)
  got_global = triton_impl.clip_grad_norm(leaves, c_global, norm_type=p)
  for (outs, norm), (ref_outs, ref_norm) in ((got, want), (got_global, want_global)):
    assert _bits(norm) == _bits(ref_norm), context
    assert [_bits(x) for x in outs] == [_bits(x) for x in ref_outs], context


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_triton_bits_equal_the_eager_cuda_route_bits(dtype):
  from clipbench.impls.own.triton import implementation as triton_impl
  rng = np.random.default_rng(30)
  for trial in range(2):
    leaves, segments, K = _batch(rng, dtype, sorted_ids=trial % 2 == 0)
    kwargs = {"segments": segments, "num_systems": K}
    # float64 with p = 3 takes the exact path on both routes (slow, and no kernel decides).
    for p in (2.0, 1.0, math.inf, -math.inf) + (() if dtype == torch.float64 else (3.0,)):
      with branches.accelerator_branches():
        _, norms = eager.clip_by_global_norm(leaves, math.inf, norm_type=p, **kwargs)
        _, total = eager.clip_grad_norm(leaves, math.inf, norm_type=p)
      n, g = norms.double().numpy(), float(total)
      for c, cg in ((n, g), (np.nextafter(n, 0), math.nextafter(g, 0)), (n / 2, g / 2)):
        _assert_global_norms_give_the_eager_bits(leaves, kwargs, p, c, cg, (trial, p))
    with branches.accelerator_branches():
      _, steps = eager.clip_by_max_step(leaves, math.inf, **kwargs)
      want = eager.clip_by_max_step(leaves, steps.double().numpy() / 2, **kwargs)
    got = triton_impl.clip_by_max_step(leaves, steps.double().numpy() / 2, **kwargs)
    assert [_bits(x) for x in got[0] + [got[1]]] == [_bits(x) for x in want[0] + [want[1]]]


def test_bfloat16_subnormals_in_and_out_give_the_eager_bits():
  """bfloat16 has float32's exponent range, so its subnormals sit below 2**-126: read
  (leaves of subnormals only) and written (small normal leaves clipped hard). The
  interpreter's own bfloat16 conversions lose them."""
  from clipbench.impls.own.triton import implementation as triton_impl
  rng = np.random.default_rng(31)
  tiny = torch.tensor(rng.standard_normal((6, 3)) * 2.0 ** -130).to(torch.bfloat16)
  small = torch.tensor(rng.standard_normal((5, 3)) * 2.0 ** -72).to(torch.bfloat16)
  leaves, segments = [tiny, small], [torch.tensor([0, 0, 1, 1, 1, 2]), torch.tensor([2] * 5)]
  assert 0 < float(tiny.abs().max()) < 2.0 ** -126
  kwargs = {"segments": segments, "num_systems": 3}
  for p in (2.0, 1.0, math.inf, 3.0):
    for c in (1.0, 2.0 ** -128, 2.0 ** -140):  # kept; subnormal systems clipped; all clipped
      _assert_global_norms_give_the_eager_bits(leaves, kwargs, p, c, c, (p, c))
  for c in (1.0, 2.0 ** -128, 2.0 ** -140):
    with branches.accelerator_branches():
      want = eager.clip_by_max_step(leaves, c, **kwargs)
    got = triton_impl.clip_by_max_step(leaves, c, **kwargs)
    assert [_bits(x) for x in got[0] + [got[1]]] == [_bits(x) for x in want[0] + [want[1]]], c

def _run_decision_kernel(K, kind, p, regions, threshold, norm64=False, unit_roundings=0):
  """The decision kernel on measured values written straight into a scratch buffer."""
  from clipbench.impls.own.triton import decision_kernel as dk
  from clipbench.impls.own.triton import passes
  from clipbench.impls.own.triton.scratch import WORDS, Scratch
  scratch = Scratch(K, 1, 0, torch.device("cpu"))
  for index, values in regions.items():
    scratch.region(index, values.dtype).copy_(values)
  dk.decide_systems[(passes.triton_cdiv(K, passes.DECIDE_BLOCK),)](
      scratch.buffer, scratch.base, K, 1, 0, 0, threshold, 0, passes._bits(p),
      passes._bits(float(unit_roundings)), passes._bits(0.0), KIND=kind,
      P=int(p) if p in (1.0, 2.0) else 1,
      PER_SYSTEM=True, NORM64=norm64, PREC=53 if norm64 else 24, THRESHOLD=1,
      CHECK_THRESHOLD=False, CERTIFIED=True, HAS32=True, HAS64=norm64,
      BLOCK=passes.DECIDE_BLOCK, **passes._LAUNCH)
  f64 = torch.float64
  return (scratch.region(WORDS.ACTION), scratch.region(WORDS.SCALE, f64),
          scratch.region(WORDS.NORM, f64), scratch.region(WORDS.OPEN))


def _near_ties(rng, K):
  """Thresholds around random norms: far above, far below, on them and a few ulps off."""
  norms = np.exp(rng.uniform(-40, 40, K))
  kind = rng.integers(0, 4, K)
  ulps = rng.integers(-3, 4, K)
  c = np.where(kind == 0, norms * 3, np.where(kind == 1, norms / 3, norms))
  near = kind >= 2
  c[near] = [v + u * math.ulp(v) for v, u in zip(c[near], ulps[near])]
  return norms, c


@pytest.mark.parametrize("p", [2.0, 1.0])
def test_decision_kernel_decides_float32_norms_as_the_operators_do(p):
  from clipbench.impls.own.triton import decision_kernel as dk
  from clipbench.impls.own.triton.scratch import WORDS
  rng = np.random.default_rng(31)
  K = 3000
  norms, c = _near_ties(rng, K)
  total = torch.tensor(norms ** p)
  counts = torch.tensor(rng.integers(1, 10 ** 6, K).astype(np.float64))
  # Runs: as many as the elements (ids in no order), or a few (sorted ids, long tiles).
  runs = torch.where(torch.tensor(rng.integers(0, 2, K)) == 0, counts,
                     torch.tensor(rng.integers(1, 20, K).astype(np.float64)))
  counts[:50] = 0.0  # empty systems
  runs[:50] = 0.0
  total[:50] = 0.0
  total[50:60] = math.nan
  total[60:70] = math.inf
  c_t = torch.tensor(c)
  action, scale, norm, open_ = _run_decision_kernel(
      K, dk.KINDS.SUM, p,
      {WORDS.SUMS: total, WORDS.COUNT: counts, WORDS.RUNS: runs.to(torch.int64)}, c_t,
      unit_roundings=3)
  depth = torch.minimum(counts + 1 + 2, runs + 3 + 2)
  mid = torch.sqrt(total) if p == 2 else total
  rel = gamma(depth) * (0.5001 if p == 2 else 1.0001) + 4 * U64
  lo, mid, hi = _around(mid, rel)
  todo = ~torch.isnan(total) & ~torch.isinf(total) & (total != 0)
  want = decide_float32(lo, mid, hi, c_t, todo)
  assert torch.equal(open_ != 0, want.ambiguous)
  decided = todo & ~want.ambiguous
  assert torch.equal(action[decided] == 1, want.clip[decided])
  assert _bits(norm[decided]) == _bits(want.norm[decided])
  assert _bits(scale[decided & want.clip]) == _bits(want.scale[decided & want.clip])
  assert want.ambiguous.sum() > 0 and decided.sum() > K / 2  # both branches were exercised


def test_decision_kernel_decides_float64_norms_as_the_operators_do():
  from clipbench.impls.own.triton import decision_kernel as dk
  from clipbench.impls.own.triton.scratch import WORDS
  rng = np.random.default_rng(32)
  K = 2000
  norms, c = _near_ties(rng, K)
  c_t = torch.tensor(c)
  action, scale, norm, open_ = _run_decision_kernel(
      K, dk.KINDS.MAX, math.inf, {WORDS.BIG: torch.tensor(norms).view(torch.int64),
                                  WORDS.COUNT: torch.ones(K, dtype=torch.float64)}, c_t,
      norm64=True)
  want = decide_float64(exact_value_pieces(torch.tensor(norms)), 1, c_t, 53,
                        torch.ones(K, dtype=torch.bool))
  assert torch.equal(open_ != 0, want.ambiguous)
  decided = ~want.ambiguous
  assert torch.equal(action[decided] == 1, want.clip[decided])
  assert _bits(norm[decided]) == _bits(want.norm[decided])
  assert _bits(scale[decided & want.clip]) == _bits(want.scale[decided & want.clip])
  assert want.ambiguous.sum() > 0 and decided.sum() > K / 2


@triton.jit
def _runs_both_ways(flags, values, out, N: tl.constexpr):
  """Three elements' run totals (h, l) combined as (x + y) + z and as x + (y + z)."""
  i = tl.arange(0, N)
  f, v = tl.load(flags + i), tl.load(values + i)
  g, w = tl.load(flags + N + i), tl.load(values + N + i)
  h, x = tl.load(flags + 2 * N + i), tl.load(values + 2 * N + i)
  zero = tl.zeros_like(v)
  f1, h1, l1, _ = _sum_runs_compensated(*_sum_runs_compensated(f, v, zero, v, g, w, zero, w),
                                        h, x, zero, x)
  f2, h2, l2, _ = _sum_runs_compensated(f, v, zero, v,
                                        *_sum_runs_compensated(g, w, zero, w, h, x, zero, x))
  tl.store(out + i, h1)
  tl.store(out + N + i, l1)
  tl.store(out + 2 * N + i, h2)
  tl.store(out + 3 * N + i, l2)
  tl.store(out + 4 * N + i, (f1 - f2).to(tl.float64))


def _both_ways(flags, values):
  n = flags.numel() // 3
  out = torch.empty(5 * n, dtype=torch.float64)
  _runs_both_ways[(1,)](flags, values, out, N=n)
  return out.view(5, n)


def test_run_scans_are_associative_whatever_the_runs():
  # A parallel scan may associate its combines in any order: the segmented-run operators must
  # give the same totals either way, also when one tile holds a system in two runs (a scan
  # that compared ids instead added a system's first run into its second, on the GPU only).
  rng = np.random.default_rng(33)
  n = 64
  flags = torch.tensor(rng.integers(0, 2, 3 * n), dtype=torch.int32)
  values = torch.tensor(rng.integers(1, 100, 3 * n).astype(np.float64))
  h1, l1, h2, l2, flag_diff = _both_ways(flags, values)
  assert torch.equal(h1, h2) and not l1.any() and not l2.any()  # small integers: exact sums
  assert not flag_diff.any()


def test_run_totals_keep_the_rounding_errors_either_way():
  # Terms of every magnitude in one run: a plain float64 sum loses low bits, h + l keeps them
  # to within far less than one unit of 2**-53 of the exact total (the bound the decision
  # kernel takes for a run); and non-finite terms give a non-finite total, not NaN for inf.
  from fractions import Fraction
  rng = np.random.default_rng(37)
  n = 64
  values = torch.tensor(np.ldexp(rng.uniform(1, 2, 3 * n), rng.integers(-60, 60, 3 * n)))
  h1, l1, h2, l2, _ = _both_ways(torch.zeros(3 * n, dtype=torch.int32), values)
  exact = [sum(Fraction(float(values[j * n + i])) for j in range(3)) for i in range(n)]
  lost = 0
  for h, l in ((h1, l1), (h2, l2)):
    for i in range(n):
      assert abs(Fraction(float(h[i])) + Fraction(float(l[i])) - exact[i]) <= exact[i] * 2.0 ** -100
      lost += Fraction(float(h[i])) != exact[i]
  assert lost > n  # most plain sums were inexact: the error terms carried something
  values[:3] = torch.tensor([math.inf, 1.0, 2.0])
  values[n + 1], values[2 * n + 2] = math.inf, math.nan
  h1, l1, h2, l2, _ = _both_ways(torch.zeros(3 * n, dtype=torch.int32), values)
  assert (h1[:2] + l1[:2]).tolist() == [math.inf] * 2 == (h2[:2] + l2[:2]).tolist()
  assert math.isnan(h1[2] + l1[2]) and math.isnan(h2[2] + l2[2])


def test_per_system_tiles_are_no_wider_than_the_longest_item():
  # A per-system scan runs over its whole tile, masked units included: a launch whose items
  # are all short scans the next power of two above the longest (MIN_SYSTEM_TILE at least),
  # a long one SYSTEM_BLOCK elements' worth; one-system tiles (no scan) stay BLOCK elements.
  from clipbench.impls.own.torch.layout import Leaf
  from clipbench.impls.own.triton import passes, tables

  def tile(rows, per_system, vec):
    leaves = [(i, Leaf(torch.zeros(n, 3), n, 3, 3, None)) for i, n in enumerate(rows)]
    return passes._measure_tile(per_system, vec, tables.work_items(leaves, torch.device("cpu"),
                                                                   steps=vec > 1))

  assert passes.MIN_SYSTEM_TILE == 32 and passes.SYSTEM_BLOCK == 512 and passes.BLOCK == 1024
  # Elements as units: 15, 120 (the longest of two leaves), 6,000 (items of 2,048).
  assert [tile(rows, True, 1) for rows in ([5], [40, 5], [2000])] == [32, 128, 512]
  # Rows of 3 read 4 at a time: 5, 40 and 2,000 rows.
  assert [tile(rows, True, 4) for rows in ([5], [40], [2000])] == [32, 64, 128]
  assert [tile(rows, False, vec) for rows in ([5], [2000]) for vec in (1, 4)] == [1024, 256] * 2


def test_full_tiles_tails_items_and_unaligned_leaves_give_the_eager_bits(monkeypatch):
  # Tiles of 16-byte aligned leaves are read and written unmasked and 16 bytes at a time on a
  # GPU; a leaf that starts elsewhere (a view one element in) takes the masked way for its
  # whole group. Leaves long enough for several work items (of the shortest length, to keep
  # the interpreter's work small), full tiles and a tail, rows read as units and elements,
  # rows that straddle tiles and items, sorted and unsorted ids: the eager route's bits.
  from clipbench.impls.own.torch.layout import Leaf
  from clipbench.impls.own.triton import implementation as triton_impl, tables
  monkeypatch.setattr(tables, "MIN_ITEM_UNITS", 1024)
  monkeypatch.setattr(tables, "TARGET_ITEMS", 1 << 20)
  rng = np.random.default_rng(34)
  rows = 1200  # as rows, two items; as elements, four (three full tiles, then a tail)
  base = torch.tensor(rng.standard_normal((rows + 1, 3)), dtype=torch.float32)
  for aligned in (True, False):
    big = base[:rows] if aligned else base.view(-1)[1:1 + 3 * rows].view(rows, 3)
    assert (big.data_ptr() % tables.ALIGNMENT == 0) == aligned
    table = tables.work_items([(0, Leaf(big, rows, 3, 3, None))], big.device)
    assert (table.aligned, table.items) == (aligned, -(-3 * rows // table.item_units))
    leaves = [big, torch.tensor(rng.standard_normal(2500), dtype=torch.float32)]
    for sorted_ids in (True, False):
      ids = [rng.integers(0, 7, rows), rng.integers(0, 7, 2500)]
      segments = [torch.tensor(np.sort(v) if sorted_ids else v) for v in ids]
      kwargs = {"segments": segments, "num_systems": 7}
      with branches.accelerator_branches():
        _, norms = eager.clip_by_global_norm(leaves, math.inf, **kwargs)
        _, steps = eager.clip_by_max_step(leaves, math.inf, **kwargs)
        _, total = eager.clip_grad_norm(leaves, math.inf)
        want = [eager.clip_by_global_norm(leaves, norms.double().numpy() / 2, **kwargs),
                eager.clip_by_max_step(leaves, steps.double().numpy() / 2, **kwargs),
                eager.clip_grad_norm(leaves, float(total) / 2)]
      got = [triton_impl.clip_by_global_norm(leaves, norms.double().numpy() / 2, **kwargs),
             triton_impl.clip_by_max_step(leaves, steps.double().numpy() / 2, **kwargs),
             triton_impl.clip_grad_norm(leaves, float(total) / 2)]
      for (outs, norm), (ref_outs, ref_norm) in zip(got, want):
        assert _bits(norm) == _bits(ref_norm), (aligned, sorted_ids)
        assert [_bits(x) for x in outs] == [_bits(x) for x in ref_outs], (aligned, sorted_ids)
        assert all(x.data_ptr() % tables.ALIGNMENT == 0 for x in outs)


def test_rows_longer_than_a_tile_give_the_eager_bits():
  # Step vectors (and rows) longer than a tile are read a part at a time: a (3, 1100) leaf's
  # steps once made a tile of no unit at all.
  from clipbench.impls.own.triton import implementation as triton_impl
  rng = np.random.default_rng(35)
  leaves = [torch.tensor(rng.standard_normal((3, 1100)), dtype=torch.float32),
            torch.tensor(rng.standard_normal((4, 600)), dtype=torch.float32),
            torch.tensor(rng.standard_normal((5, 3)), dtype=torch.float32)]
  kwargs = {"segments": [torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1, 1]),
                         torch.tensor([1, 0, 0, 1, 1])], "num_systems": 2}
  with branches.accelerator_branches():
    _, steps = eager.clip_by_max_step(leaves, math.inf, **kwargs)
    _, norms = eager.clip_by_global_norm(leaves, math.inf, **kwargs)
    want = [eager.clip_by_max_step(leaves, steps.double().numpy() / 2, **kwargs),
            eager.clip_by_global_norm(leaves, norms.double().numpy() / 2, **kwargs)]
  got = [triton_impl.clip_by_max_step(leaves, steps.double().numpy() / 2, **kwargs),
         triton_impl.clip_by_global_norm(leaves, norms.double().numpy() / 2, **kwargs)]
  for (outs, norm), (ref_outs, ref_norm) in zip(got, want):
    assert _bits(norm) == _bits(ref_norm)
    assert [_bits(x) for x in outs] == [_bits(x) for x in ref_outs]


def test_a_cached_layout_serves_the_same_addresses_and_only_those(monkeypatch):
  # A call's tables and output places are kept by its leaves' addresses, shapes and dtypes
  # (``layouts``). The same tensors again: nothing rebuilt, and no Leaf object made (a call of
  # 10,000 leaves walks them in C-level maps only). Other tensors of the same shapes at other
  # addresses, a leaf made non-contiguous, float16 in place of float32: rebuilt, and every
  # output the eager route's (a stale layout would read the first tensors' bytes).
  from clipbench.impls.own.torch import layout as torch_layout
  from clipbench.impls.own.triton import implementation as triton_impl, layouts, tables
  built, made = [], []
  build = tables.work_items
  monkeypatch.setattr(tables, "work_items", lambda *a, **k: built.append(1) or build(*a, **k))

  class CountedLeaf(torch_layout.Leaf):
    __slots__ = ()

    def __init__(self, *args, **kwargs):
      made.append(1)
      super().__init__(*args, **kwargs)

  monkeypatch.setattr(torch_layout, "Leaf", CountedLeaf)
  layouts.clear()
  rng = np.random.default_rng(36)

  def leaves_of(seed_shift, dtype=torch.float32):
    return [torch.tensor(rng.standard_normal(n) * (1 + seed_shift), dtype=dtype)
            for n in (5, 130, 1, 64)] + [torch.tensor(rng.standard_normal((7, 3)), dtype=dtype)]

  def check(leaves):
    with branches.accelerator_branches():
      _, total = eager.clip_grad_norm(leaves, math.inf)
      ref_outs, ref_norm = eager.clip_grad_norm(leaves, float(total) / 2)
    made.clear()  # the eager route's own
    outs, norm = triton_impl.clip_grad_norm(leaves, float(total) / 2)
    assert _bits(norm) == _bits(ref_norm)
    assert [_bits(x) for x in outs] == [_bits(x) for x in ref_outs]
    assert [x.shape for x in outs] == [x.shape for x in leaves]

  first = leaves_of(0)
  check(first)
  assert built and made  # the first call builds its layout (and Leaf objects to do it)
  built.clear(), made.clear()
  check(first)
  assert (built, made) == ([], [])
  second = leaves_of(1)  # ``first`` stays alive: its addresses cannot be reused
  check(second)
  assert built
  built.clear()
  check(first)  # not the last call's layout: the cache's, nothing rebuilt
  check(second)
  assert built == []
  strided = leaves_of(2)
  strided[4] = strided[4].t()  # (3, 7), not contiguous: copied, so a new address every call
  check(strided)
  check(leaves_of(3, torch.float16))
  assert len(built) >= 2


def _four_squares(n: int) -> list[int]:
  """Four integers whose squares sum to ``n``."""
  for a in range(math.isqrt(n), -1, -1):
    for b in range(math.isqrt(n - a * a), -1, -1):
      rest = n - a * a - b * b
      for c in range(math.isqrt(rest), -1, -1):
        d = math.isqrt(rest - c * c)
        if c * c + d * d == rest:
          return [a, b, c, d]
  raise AssertionError(n)


def test_norms_near_a_rounding_midpoint_are_decided_by_the_runs_not_the_elements(monkeypatch):
  # Each system's norm sits 2**-44 (relative) above a float32 midpoint m = 2k + 1: squares of
  # 2k, four integers summing to 4k + 1, and 64 ones. 1,400 zero rows give each system 4,000
  # elements more, whose count alone (gamma(4,200) ~ 2**-42) could not decide the rounding;
  # the compensated runs (a dozen tiles each) do. A norm exactly on its midpoint stays open
  # (the exact path rounds it to even), one 2**-50 off may go either way: the eager bits.
  from clipbench.impls.own.triton import implementation as triton_impl, passes
  from clipbench.impls.own.triton.scratch import WORDS
  rng = np.random.default_rng(38)
  ones_of = [64, 64, 0, 1]
  rows, ids, mids = [], [], []
  for system, ones in enumerate(ones_of):
    k = int(rng.integers(1 << 23, 1 << 24))
    mids.append(2 * k + 1)
    a, b, c, d = _four_squares(4 * k + 1)
    mine = [[2 * k, a, b], [c, d, 0]] + [[1, 1, 1]] * (ones // 3) + [[1, 0, 0]] * (ones % 3)
    mine += [[0, 0, 0]] * 1400
    rows += mine
    ids += [system] * len(mine)
  leaves = [torch.tensor(rows, dtype=torch.float32)]
  kwargs = {"segments": [torch.tensor(ids)], "num_systems": len(ones_of)}
  threshold = np.array(mids, np.float64) / 3
  opened, runs = [], []
  resolve = passes.TritonKernels._resolve

  def recorded(self, scratch, *args):
    opened.append((scratch.region(WORDS.OPEN) != 0).tolist())
    runs.append(scratch.region(WORDS.RUNS).tolist())
    return resolve(self, scratch, *args)

  monkeypatch.setattr(passes.TritonKernels, "_resolve", recorded)
  with branches.accelerator_branches():
    ref_outs, ref_norm = eager.clip_by_global_norm(leaves, threshold, **kwargs)
  outs, norm = triton_impl.clip_by_global_norm(leaves, threshold, **kwargs)
  assert _bits(norm) == _bits(ref_norm)
  assert [_bits(x) for x in outs] == [_bits(x) for x in ref_outs]
  # Above its midpoint a norm rounds up; on it, to the even neighbour of 2k and 2k + 2.
  on_midpoint = mids[2] - 1 if (mids[2] // 2) % 2 == 0 else mids[2] + 1
  assert norm.tolist()[:3] == [mids[0] + 1, mids[1] + 1, on_midpoint]
  assert len(opened) == 1 and opened[0][:3] == [False, False, True]
  # Rows are the units (tiles of SYSTEM_BLOCK // 4 of them): a run per tile a system touches.
  tile = passes.SYSTEM_BLOCK // 4
  starts = np.searchsorted(ids, np.arange(len(ones_of)))
  ends = np.append(starts[1:], len(ids))
  assert runs[0] == ((ends - 1) // tile - starts // tile + 1).tolist()


def test_a_global_norm_near_a_rounding_midpoint_is_decided_by_an_items_tiles(monkeypatch):
  # One system of 524,288 elements in 512 work items of one tile: a program's lanes add over
  # their own item's tiles only, so the interval is ~2**-42.7 wide, where counting every tile
  # of the call made it 2**-41.5 and left this norm, 2**-43.1 above its midpoint, open.
  from clipbench.impls.own.triton import implementation as triton_impl, passes, tables
  monkeypatch.setattr(tables, "MIN_ITEM_UNITS", passes.BLOCK)
  rng = np.random.default_rng(39)
  k = int(rng.integers(1 << 23, 1 << 24))
  mid = 2 * k + 1
  ones = round(2.0 * mid * mid * 2.0 ** -43.1)  # the norm sits ones / (2 mid**2) above mid
  values = np.zeros(1 << 19, np.float32)
  values[:5] = [2 * k] + _four_squares(4 * k + 1)
  values[5:5 + ones] = 1.0
  leaves = [torch.tensor(values)]
  resolved = []
  resolve = passes.TritonKernels._resolve
  monkeypatch.setattr(passes.TritonKernels, "_resolve",
                      lambda self, *args: resolved.append(1) or resolve(self, *args))
  with branches.accelerator_branches():
    ref_outs, ref_norm = eager.clip_grad_norm(leaves, mid / 3)
  outs, norm = triton_impl.clip_grad_norm(leaves, mid / 3)
  assert _bits(norm) == _bits(ref_norm) and float(norm) == mid + 1
  assert [_bits(x) for x in outs] == [_bits(x) for x in ref_outs]
  assert resolved == []
