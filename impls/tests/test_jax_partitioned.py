"""The FFI route's partitioning rule (``impls/own/jax/partitioned.py``) gives the unsharded bits.

One child process (4 host CPU devices, ``jax_partitioned_child.py``) runs each case jitted on
sharded leaves and compares outputs and norms bit for bit with the unsharded call. The custom
calls each case made are counted (``partitioned.COUNTS``), so a case that silently took the
whole call instead of exchanging partials fails too: every device hands XLA its part of each
round before the decision (one round; two where the maxima come first: p > 6, float64
leaves), and its part of the near-tie round where the threshold ties the norm exactly.
``conformance/test_sharding.py`` runs rule 14's layout grid through the same route.
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
    "tie-p2-kept": TIE, "tie-p2-clipped": TIE, "tie-step-kept": TIE,
    "p2": ONE_ROUND, "p1": ONE_ROUND, "p3": ONE_ROUND, "p8-two-rounds": TWO_ROUNDS,
    "pinf": ONE_ROUND, "pminusinf": ONE_ROUND, "step-one-system": ONE_ROUND,
    "global-norm-one-system": ONE_ROUND, "nan-propagate": ONE_ROUND, "nan-zero": ONE_ROUND,
    "bfloat16": ONE_ROUND, "float16-p1": ONE_ROUND, "uneven-and-empty-shards": ONE_ROUND,
    # A 2x2 mesh: rows split on one axis, two groups of two devices exchange apart.
    "other-axes-whole": ONE_ROUND, "replicated-and-0d": ONE_ROUND,
    "float64-p2": TWO_ROUNDS, "float64-pinf": ONE_ROUND,
    "float64-tie": {"rounds": 2 * DEVICES, "ties": DEVICES, "finished": DEVICES},
    # Batched: the whole call (custom partitioning has no batching rule). Differentiated: the
    # primal through the rule; counted by neither.
    "vmap": {}, "grad": {},
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


def test_every_case_of_the_child_is_expected():
  assert sorted(child_rows()) == sorted(EXPECTED)
