"""Does a sharded call of each own JAX route exchange per-system vectors, not leaves (issue 32)?

One child process (4 host CPU devices, ``jax_sharded_hlo_child.py``) compiles, under
``jax.jit``, each route on leaves whose rows are split over the 4 devices (``NamedSharding``):
W1-like 2-D leaves for ``clip_grad_norm``, 3-vector and 1-D leaves with segments for the
per-system operations. Each optimized HLO's collectives (all-gather, all-to-all,
collective-permute, all-reduce, reduce-scatter, ...) must all be smaller, in bytes, than the
smallest shard of any leaf or segment array. The near-tie branch is in the program whether or
not it runs, so it is checked too; the graph route's near-ties are also run sharded, against
the unsharded call's bits.

The FFI (numba) route passes without segments, for each kind of exchange that sends block
results (its partitioning rule, ``impls/own/jax/partitioned.py``: one all-gather of block
results, one of exact partials in the near-tie ``lax.while_loop``): power sums split into
sub-blocks (p = 2, and in zero mode), maxima merged (p = inf), maxima then double-double
sums split into sub-blocks (p = 8), max-step, a non-integer p (whose near-tie rounds, one per
precision of the enclosures, run in a ``lax.while_loop``); and with segments (per-system
p = 2, 2.5 and max-step, ``partitioned_segments.py``: an all-gather of per-system row
counts, then each round's chunks in a loop). The graph route passes for p = 1, 2 (zero mode
too) with and without segments, and for max-step: its near-ties are settled from exact
integer limb sums the device all-reduces (``exact_fallback.exact_limb_sums``), and max-step's
from the element bits of one chosen vector per system and round (``step_ties``); for p =
+-inf (no near-tie exists); and on float64 leaves (p = 2, -inf), whose one system the wide
route reads, where the leaves may lie split, on each leaf's own axes (1-D leaves whose rows
divide among the devices side by side in blocks). Leaves split by columns (tensor
parallelism), and leaves whose rows do not divide among the devices (split inside the
program), are compiled too, and their sharded bits are checked against the unsharded call's
(rule 14's grid splits 3 columns, unevenly; these are larger): the graph route reads them on
their own axes and passes, float64 included, with its near-ties of float64 leaves split by
columns run sharded too; the FFI route reads columns of at least a sub-block a device in
place, on a 1-D mesh and with rows and columns on the two axes of a 2 x 2 mesh, and passes,
and gathers narrower ones along the columns. The FFI route's float64 cases are its float64
exchanges. The cases that still move leaf-sized data are strict expected failures that turn
into failures the day they stop (then drop the mark). optax's ``clip_by_global_norm`` on the
same leaves is the control that passes: a partitioned program whose only collective is the
all-reduce of per-device partial norms.
"""

from __future__ import annotations

import functools

import pytest

from clipbench.impls.tests import host_device_children as children

CHILD = "clipbench.impls.tests.jax_sharded_hlo_child"
TIE_GATHERS = ("the graph route's near-tie fallback for p other than 1, 2 "
               "(impls/own/jax/exact_fallback.py) passes the leaves' bits to a host callback "
               "under lax.cond, and the partitioned program all-gathers them for it, in the "
               "tie branch only, though every call's temporaries hold the copies. A callback "
               "cannot run per device inside a custom_partitioning rule (use-after-free, "
               "jax-ml/jax#23620); integer p from limb sums on the device was tried and cost "
               "too much compile time and memory in every program (docs/sharding.md; issue "
               "32, part 2)")

FFI_NARROW_COLUMNS = ("the FFI (numba) route reads a leaf's columns in place only where each "
                      "device holds a sub-block (256 elements) of every row or none: its bits "
                      "come from sub-blocks in the order of the rows, and one two devices "
                      "share travels as its elements, so 32 and 64 columns a device "
                      "(COLUMN_SHAPES' first two leaves) are gathered along the columns "
                      "instead (impls/own/jax/mesh_pieces.py; issue 32)")

CASES = [
    pytest.param("optax", "clip_grad_norm"),
    pytest.param("graph", "clip_grad_norm"),
    pytest.param("graph", "clip_grad_norm-p1"),
    pytest.param("graph", "clip_grad_norm-pinf"),
    pytest.param("graph", "clip_grad_norm-zero"),
    pytest.param("graph", "clip_by_global_norm"),
    pytest.param("graph", "clip_grad_norm-p8",
                 marks=pytest.mark.xfail(strict=True, reason=TIE_GATHERS)),
    pytest.param("graph", "clip_by_max_step"),
    pytest.param("graph", "clip_grad_norm-float64"),
    pytest.param("graph", "clip_grad_norm-float64-pmin"),
    pytest.param("graph", "clip_grad_norm-columns"),
    pytest.param("graph", "clip_grad_norm-columns-p1"),
    pytest.param("graph", "clip_grad_norm-columns-pinf"),
    pytest.param("graph", "clip_grad_norm-uneven"),
    pytest.param("graph", "clip_grad_norm-uneven-grouped"),
    pytest.param("graph", "clip_by_global_norm-uneven"),
    pytest.param("graph", "clip_by_global_norm-uneven-p1"),
    pytest.param("graph", "clip_by_max_step-uneven"),
    pytest.param("graph", "clip_grad_norm-uneven-float64"),
    pytest.param("graph", "clip_grad_norm-columns-float64"),
    pytest.param("ffi", "clip_grad_norm"),
    pytest.param("ffi", "clip_grad_norm-pinf"),
    pytest.param("ffi", "clip_grad_norm-p8"),
    pytest.param("ffi", "clip_grad_norm-zero"),
    pytest.param("ffi", "clip_grad_norm-p2.5"),
    pytest.param("ffi", "clip_by_global_norm-p2.5"),
    pytest.param("ffi", "clip_by_max_step-one-system"),
    pytest.param("ffi", "clip_grad_norm-float64"),
    pytest.param("ffi", "clip_grad_norm-float64-pmin"),
    pytest.param("ffi", "clip_grad_norm-columns",
                 marks=pytest.mark.xfail(strict=True, reason=FFI_NARROW_COLUMNS)),
    pytest.param("ffi", "clip_grad_norm-columns-wide"),
    pytest.param("ffi", "clip_grad_norm-columns-wide-p8"),
    pytest.param("ffi", "clip_grad_norm-columns-grid"),
    pytest.param("ffi", "clip_by_global_norm"),
    pytest.param("ffi", "clip_by_max_step"),
]

@functools.cache
def child_rows() -> list[dict]:
  return children.child_rows(CHILD, timeout_s=300)


def compiled_cases() -> dict[tuple[str, str], dict]:
  return {(row["route"], row["op"]): row for row in child_rows() if "route" in row}


TIES = ("step-at-5.0", "columns-float64-p1-at-norm", "columns-float64-p2-at-norm")


@pytest.mark.parametrize("case", TIES)
def test_sharded_graph_ties_give_the_unsharded_bits(case):
  """A max-step near-tie, and float64 leaves split by columns whose norm is the threshold,
  sharded over 4 devices and settled on them, give the unsharded bits; the device way ran and
  the leaves' way did not."""
  rows = {row["tie"]: row for row in child_rows() if "tie" in row}
  assert sorted(rows) == sorted(TIES)
  row = rows[case]
  assert row["same"] and row["rounds"] >= 1 and row["leaves"] == 0, row


@pytest.mark.parametrize("route,op", CASES)
def test_sharded_call_moves_no_leaf_sized_collective(route, op):
  row = compiled_cases()[(route, op)]
  # A partitioned program has collectives (the per-system partials): none means the parse
  # found nothing, and the check below would pass on nothing.
  assert row["collectives"] > 0, row
  # Leaves split by columns or into uneven rows inside the program are outside rule 14's
  # grid, and the 2 x 255 rows' view differs from the unsharded call's: their bits are
  # checked here.
  checked = "columns" in op or "uneven" in op
  assert row["same_bits"] is (True if checked else None), row
  assert not row["leaf_sized"], (
      f"{route} {op}: collectives of at least {row['smallest_shard']} bytes (a leaf's "
      f"shard): {row['leaf_sized']}")


def test_the_parser_finds_a_leaf_sized_all_gather():
  from clipbench import hlo_collectives as collectives  # pylint: disable=import-outside-toplevel
  text = ("ENTRY %main (p: f32[64,128]) -> f32[256,128] {\n"
          "  %p = f32[64,128]{1,0} parameter(0)\n"
          "  ROOT %all-gather = f32[256,128]{1,0} all-gather(%p), channel_id=1, "
          "dimensions={0}, metadata={op_name=\"xs[0]\"}\n"
          "  %all-reduce.1 = (f64[16]{0}, s8[16]{0}) all-reduce(%a, %b), to_apply=%add\n"
          "}\n")
  found = collectives.collectives(text)
  assert [(c.opcode, c.result.elements, c.operands.elements) for c in found] == [
      ("all-gather", 256 * 128, 64 * 128), ("all-reduce", 16, 0)]
  assert [c.name for c in collectives.leaf_sized(text, 64 * 128 * 4)] == ["all-gather"]
  assert collectives.leaf_sized(text, 256 * 128 * 4 + 1) == []
  assert collectives.bytes_sent(text) == 64 * 128 * 4
