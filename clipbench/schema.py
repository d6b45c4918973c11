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
    "silent-wrong-value": "finite valid input, and the output or norm is off by more than the "
                          "material tolerance (1e-3 relative): zeros, NaN, a flipped sign, an "
                          "overflowed norm, an unclipped output",
    "invalid-input-accepted": "an invalid argument is accepted (a result returned), or refused "
                              "without an error of the documented type that names it",
    "valid-input-rejected": "a valid input raises, crashes or is refused",
    "non-finite-policy": "differs only on inputs that hold NaN or infinity",
    "precision": "finite valid input, and the output or norm is off by more than rounding but "
                 "within the material tolerance (an epsilon in a denominator, a sum in a "
                 "coarse dtype)",
    "rounding-level": "within a few ulp: ties, the strict bound, the norm's last bits",
}

# Everyday inputs: finite, with every nonzero |x| and every nonzero exact system norm within
# float16's normal range, whatever the dtype. Float16 gradients of 300 are everyday; float32
# entries of 1e20, and subnormals, are not. Everything else is the range's edge. SPEC.md's
# severity text says the same.
EVERYDAY_RANGE: tuple[float, float] = (2.0 ** -14, 2.0 ** 15)
EVERYDAY = "everyday"
RANGE_EDGE = "range edge"

# Relative error (of a system's outputs, normwise, or of a reported norm) that harms training:
# beyond it an error is a silent wrong value. Below it and beyond rounding, it is precision.
MATERIAL_TOLERANCE = 1e-3
# Rounding: within this many units of roundoff of the coarsest leaf dtype (4 ulp at the top of
# a binade); rule 4 alone lets the factor sit 4 below max/norm, and each output rounds once.
ROUNDING_UNITS = 8
UNIT_ROUNDOFF: dict[str, float] = {
    "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}

# What the suite records about a case's inputs (``input_class``): ``invalid`` for a spoiled
# argument (the bad-input tests), ``non-finite`` when a leaf holds NaN or infinity, else
# ``finite``; and whether the call returned or raised (``result``).
INPUT_CLASSES: tuple[str, ...] = ("finite", "non-finite", "invalid")
RESULTS: tuple[str, ...] = ("returned", "raised")


def is_everyday(input_class: str, input_min_abs: float, input_max_abs: float,
                norm_min: float, norm_max: float) -> bool:
  """The case's inputs are everyday (see :data:`EVERYDAY_RANGE`); NaN extents (nothing
  nonzero, or not recorded) do not count against it."""
  if input_class == "non-finite":
    return False
  lo, hi = EVERYDAY_RANGE
  return not any(v == v and not lo <= v <= hi for v in (input_min_abs, input_max_abs,
                                                          norm_min, norm_max))


def rounding_tolerance(dtype: str) -> float:
  """Relative error still within rounding for a case of ``dtype`` (``a+b``: the coarsest)."""
  units = [UNIT_ROUNDOFF[d] for d in str(dtype).split("+") if d in UNIT_ROUNDOFF]
  return ROUNDING_UNITS * max(units, default=UNIT_ROUNDOFF["float32"])


def value_severity(rel_error: float, dtype: str) -> str:
  """The class of a measured relative error (NaN, inf: zeros, sign, overflow -> silent)."""
  if not rel_error <= max(MATERIAL_TOLERANCE, rounding_tolerance(dtype)):
    return "silent-wrong-value"
  return "rounding-level" if rel_error <= rounding_tolerance(dtype) else "precision"


def case_severity(listed: str, input_class: str, result: str, rel_error: float,
                  dtype: str) -> str:
  """The class of one deviating case, from what the case data shows; ``listed`` (the
  manifest entry's class) only where the data cannot tell (bits that differ alone and
  batched, a modified input, a transform)."""
  if input_class == "invalid":
    return "invalid-input-accepted"
  if input_class == "non-finite":
    return "non-finite-policy"
  if result == "raised":
    return "valid-input-rejected"
  if rel_error == rel_error:  # measured
    return value_severity(rel_error, dtype)
  return listed


# ``severity`` is the matched manifest entry's class; the report derives each case's own class
# from the columns after it (``case_severity``): ``input_class`` and ``result`` (above),
# ``input_min_abs`` / ``input_max_abs`` (the smallest and largest nonzero finite |x|),
# ``norm_min`` / ``norm_max`` (the smallest and largest nonzero exact system norm) and
# ``rel_error`` (the largest relative error of a system's outputs, normwise, or of a reported
# norm, against the reference; inf for NaN, infinity or a flipped sign; empty when unmeasured).
#
# ``device`` is where the calls ran (``cpu``, ``cuda``, ``cpu:1``...: ``clipbench.devices``);
# a table written before it existed reads as ``cpu``.
CONFORMANCE_COLUMNS: tuple[str, ...] = (
    "impl", "kind", "library", "version", "framework", "device", "op", "rule", "case", "dtype",
    "outcome",
    "severity", "max_ulp_error", "norm_ulp_error", "input_class", "result", "input_min_abs",
    "input_max_abs", "norm_min", "norm_max", "rel_error", "observed", "reason", "reproducer",
    "test_id", "duration_s")

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

# One row per point of the safe-range scan (``clipbench.conformance.safe_range``): an
# implementation, op, dtype and p (``step`` for max-step) on a fixed random input scaled to an
# exact norm near 2**log2_norm and clipped at ``threshold`` (half that norm); ``rounding`` and
# ``material`` are ``pass`` or ``fail`` at the two tolerances; ``check`` is the first rule check
# that failed (one of ``SAFE_RANGE_CHECKS``, empty when it conforms within rounding) and
# ``observed`` its message; ``rel_error`` is as in the conformance table.
SAFE_RANGE_COLUMNS: tuple[str, ...] = (
    "impl", "kind", "library", "version", "op", "dtype", "norm_type", "log2_norm", "threshold",
    "rounding", "material", "rel_error", "check", "observed")
SAFE_RANGE_CHECKS: dict[str, str] = {
    "raised": "raises",
    "structure": "wrong shapes or dtypes",
    "finite-outputs": "NaN, inf or zeros",
    "norm": "wrong norm",
    "bound": "over the bound",
    "factor": "wrong factor",
}
