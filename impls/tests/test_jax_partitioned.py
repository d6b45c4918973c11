"""The FFI route's partitioning rule (``impls/own/jax/partitioned.py``) gives the unsharded bits.

One child process (4 host CPU devices, ``jax_partitioned_child.py``) runs each case jitted on
sharded leaves and compares outputs and norms bit for bit with the unsharded call. The custom
calls each case made are counted (``partitioned.COUNTS``), so a case that silently took the
whole call instead of exchanging partials fails too: every device hands XLA its part of each
round before the decision (one round; two where the maxima come first: p > 6, float64
leaves), and its part of the near-tie round where the threshold ties the norm exactly.
Leaves split by columns, on one mesh axis or with their rows on another, are read in place
(each device counts the leaves it wrote from such a tile), and the layout's plan is checked
below the outputs, on the float64 block sums. ``conformance/test_sharding.py`` runs rule
14's layout grid through the same route.
"""

from __future__ import annotations

import functools

import pytest

from clipbench.impls.tests import host_device_children as children

CHILD = "clipbench.impls.tests.jax_partitioned_child"
DEVICES = children.DEVICES
ONE_ROUND = {"rounds": DEVICES, "ties": 0, "finished": DEVICES}
TWO_ROUNDS = {"rounds": 2 * DEVICES, "ties": 0, "finished": DEVICES}
TIE = {"rounds": DEVICES, "ties": DEVICES, "finished": DEVICES}
EXPECTED = {
    "tie-p2-kept": TIE, "tie-p2-clipped": TIE, "tie-step-kept": TIE, "near-tie-p2.5": TIE,
    # Every precision of the enclosures, 96 bits to 12,288: eight near-tie rounds a device.
    "exact-tie-p1.5": {"rounds": DEVICES, "ties": 8 * DEVICES, "finished": DEVICES},
    "p2": ONE_ROUND, "p2.5": ONE_ROUND, "p1": ONE_ROUND, "p3": ONE_ROUND,
    "p8-two-rounds": TWO_ROUNDS,
    "pinf": ONE_ROUND, "pminusinf": ONE_ROUND, "step-one-system": ONE_ROUND,
    "global-norm-one-system": ONE_ROUND, "nan-propagate": ONE_ROUND, "nan-zero": ONE_ROUND,
    "bfloat16": ONE_ROUND, "float16-p1": ONE_ROUND, "uneven-and-empty-shards": ONE_ROUND,
    # A 2x2 mesh: rows split on one axis, two groups of two devices exchange apart.
    "other-axes-whole": ONE_ROUND, "replicated-and-0d": ONE_ROUND,
    "float64-p2": TWO_ROUNDS, "float64-pinf": ONE_ROUND, "float64-p1.5": TWO_ROUNDS,
    "float64-tie": {"rounds": 2 * DEVICES, "ties": DEVICES, "finished": DEVICES},
    # Leaves split by columns (``column_cases``), on a 1-D and a 2 x 2 mesh.
    "columns": ONE_ROUND, "columns-p8-two-rounds": TWO_ROUNDS, "columns-pinf": ONE_ROUND,
    "columns-step": ONE_ROUND, "columns-nan-zero": ONE_ROUND, "columns-bfloat16": ONE_ROUND,
    "columns-float64": TWO_ROUNDS, "columns-tie": TIE, "columns-uneven": ONE_ROUND,
    "columns-grid": ONE_ROUND, "columns-grid-uneven": TWO_ROUNDS,
    # Batched: the whole call (custom partitioning has no batching rule). Differentiated: the
    # primal through the rule; counted by neither.
    "vmap": {}, "grad": {},
    # Per-system calls (``partitioned_segments``): the same rounds, each streamed.
    "segments-p2": ONE_ROUND, "segments-p1": ONE_ROUND, "segments-p2.5": ONE_ROUND,
    "segments-pinf": ONE_ROUND, "segments-p8-two-rounds": TWO_ROUNDS,
    "segments-step": ONE_ROUND, "segments-nan-zero": ONE_ROUND,
    "segments-nan-propagate": ONE_ROUND, "segments-interleaved": ONE_ROUND,
    "segments-uneven-and-empty-shards": ONE_ROUND, "segments-replicated": ONE_ROUND,
    "segments-tie-kept": TIE, "segments-tie-clipped": TIE, "segments-tie-step": TIE,
    "segments-near-tie-p2.5": TIE,
    # Two exact ties together: still eight rounds (one by one would be 1 + 7 * 2).
    "segments-exact-tie-p1.5": {"rounds": DEVICES, "ties": 8 * DEVICES, "finished": DEVICES},
    "segments-float64": TWO_ROUNDS, "segments-grad": ONE_ROUND,
    # Refused on every device before any round.
    "segments-out-of-range": {"rounds": 0, "ties": 0, "finished": 0},
}
# Passes of the chunk loop per device and round: one where each system's rows lie in one run
# per leaf (the chunk is sized for that layout); interleaved systems send their elements.
ONE_PASS_A_ROUND = {case for case in EXPECTED if case.startswith("segments-")} - {
    "segments-interleaved", "segments-out-of-range"}


# Leaves each device wrote from a tile split by columns, summed over the devices: a leaf read
# in place counts once a device; narrower columns (``columns-uneven``'s 3-vectors) and
# max-step's are gathered along the columns and count none.
COLUMNS_READ_IN_PLACE = {
    "columns": 3 * DEVICES, "columns-p8-two-rounds": 3 * DEVICES, "columns-pinf": 3 * DEVICES,
    "columns-step": 0, "columns-nan-zero": 3 * DEVICES, "columns-bfloat16": 3 * DEVICES,
    "columns-float64": 3 * DEVICES, "columns-tie": DEVICES, "columns-uneven": 3 * DEVICES,
    "columns-grid": 4 * DEVICES, "columns-grid-uneven": 3 * DEVICES,
}


@functools.cache
def child_rows() -> dict[str, dict]:
  rows = children.child_rows(CHILD, timeout_s=600)
  return {row["case"]: row for row in rows}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_partitioned_call_gives_the_unsharded_bits(case):
  row = child_rows().get(case)
  assert row is not None, f"{CHILD} printed no row for {case}"
  assert "error" not in row, row["error"]
  assert row["outputs"] and row["norms"], row
  assert row["counts"] == EXPECTED[case], (
      f"{case}: custom calls {row['counts']}, expected {EXPECTED[case]}")


@pytest.mark.parametrize("case", sorted(c for c in EXPECTED if c.startswith("segments-")))
def test_per_system_rounds_stream_in_chunks(case):
  """The tables of row counts and each round of a per-system call take one pass of the chunk
  loop per device where each system's rows lie in one run per leaf, several where the systems
  are interleaved (their elements travel); a refused call stops after its tables. No
  execution's state stays on the host."""
  row = child_rows()[case]
  counts = EXPECTED[case]
  exchanges = DEVICES + (counts["rounds"] + counts["ties"]) // DEVICES * DEVICES
  if case in ONE_PASS_A_ROUND:
    assert row["passes"] == exchanges, row
  elif case == "segments-interleaved":
    assert row["passes"] > exchanges, row
  else:
    assert row["passes"] == DEVICES, row
  assert row["left_on_host"] == 0, row


@pytest.mark.parametrize("case", sorted(COLUMNS_READ_IN_PLACE))
def test_columns_are_read_in_place(case):
  row = child_rows()[case]
  assert row["columns"] == COLUMNS_READ_IN_PLACE[case], row


# ``plan_cases``: leaves split by columns on a 1-D mesh, rows and columns on a 2 x 2 mesh, and
# copies along an axis a leaf is not split on; how many leaves each reads in place.
PLANS = {"plan-columns": 3, "plan-grid": 4, "plan-grid-copies": 5}


@pytest.mark.parametrize("case", sorted(PLANS))
def test_every_device_folds_the_unsharded_block_sums_from_its_tile(case):
  """Each device's tile is the one the program holds (JAX's own indexing of the rule's
  shardings), and the numba kernels' sharded route on the tiles, as ``mesh_pieces`` lays
  them out, folds the unsharded call's float64 sums bit for bit. A wrong rank order or
  column stretch fails here where the float32 outputs may not show it."""
  row = child_rows()[case]
  assert "error" not in row, row["error"]
  assert row["tiles"] and row["sums"] and row["in_place"] == PLANS[case], row


def test_every_case_of_the_child_is_expected():
  assert sorted(child_rows()) == sorted(set(EXPECTED) | set(PLANS))
