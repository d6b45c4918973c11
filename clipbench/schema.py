"""The results tables' schema, declared once: the conformance suite writes it, the report reads it.

Data flows one way (reference <- impls <- conformance / benchmarks -> results -> reports); this
module is the contract between the writers and the reader, so neither side imports the other.
"""

from __future__ import annotations

# What one conformance case came to: ``deviation`` is a failure the manifest lists; ``fail`` and
# ``error`` are unlisted; ``unexpected-pass`` is a listed case that passed (a stale entry).
OUTCOMES: tuple[str, ...] = (
    "pass", "deviation", "fail", "unexpected-pass", "not-applicable", "error")

# Severity classes of a deviation, most harmful first. A reader of the report asks first
# whether a library can silently corrupt an update; everything else is graded below that.
SEVERITIES: dict[str, str] = {
    "silent-wrong-value": "finite valid input, and the output or norm is wrong beyond rounding "
                          "(zeros, NaN, a flipped sign, over the bound by more than a few ulp)",
    "invalid-input-accepted": "an invalid argument is accepted (a result returned), or refused "
                              "without an error of the documented type that names it",
    "valid-input-rejected": "a valid input raises, crashes or is refused",
    "non-finite-policy": "differs only on inputs that hold NaN or infinity",
    "rounding-level": "within a few ulp: ties, the strict bound, the norm's last bits",
}

CONFORMANCE_COLUMNS: tuple[str, ...] = (
    "impl", "kind", "library", "version", "framework", "op", "rule", "case", "dtype", "outcome",
    "severity", "max_ulp_error", "norm_ulp_error", "observed", "reason", "reproducer", "test_id",
    "duration_s")

# Rule 14 (a sharded call gives the unsharded call's bits): its rows carry the largest
# difference between the two in ``max_ulp_error`` (outputs) and ``norm_ulp_error`` (norms), and
# ``observed`` holds each marker below exactly when it is true; the report's sharding column
# reads them (identical bits, or the ulp difference and whether a decision or the bound changed).
SHARDING_RULE = 14
SHARDING_DECISION_CHANGED = "decision changed"  # a system clipped in one run, kept in the other
SHARDING_BOUND_BROKEN = "bound broken"  # the sharded output's exact norm exceeds the threshold

# One row per pytest-benchmark benchmark; ``iqr_s`` is its interquartile range (pytest-benchmark's
# ``stats.iqr``), the spread the report prints beside each median.
BENCHMARK_COLUMNS: tuple[str, ...] = (
    "impl", "kind", "workload", "dtype", "device", "group", "name", "median_s", "min_s",
    "mean_s", "stddev_s", "iqr_s", "rounds", "bytes_moved", "bandwidth_gbs",
    "roofline_seconds")
