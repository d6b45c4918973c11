"""Measured safe ranges: over which system norms an implementation conforms on ordinary input.

For each implementation, operation, dtype and p (1, 2, 3, inf where it takes p; the step norm
for max-step; by default one of ``clip_grad_norm`` and ``clip_by_global_norm``, whose global
forms compute the same norm), one fixed-seed random input is scaled so that its exact norm is
2**e, for every e from where its elements turn subnormal to where they would overflow the
dtype (every :data:`DEFAULT_STEPS` binades; ``--profile thorough``: every binade and op), and
clipped at half its exact norm, so every call clips. Each point is judged at two tolerances:

* ``rounding``: the rule checks of ``rules.py`` (rules 4 and 5: finite outputs, one factor
  within a few ulp, the strict bound, the norm within 2 ulp);
* ``material``: the relative error of ``measure.relative_error`` is not a silent wrong value
  (``clipbench.schema.value_severity``: within 1e-3, or rounding where the dtype is coarser).

A scan, not a bisection: nothing assumes that pass and fail are monotone in the norm. Every
point is a row of the results table ``SAFE_RANGE_COLUMNS``; the report draws the ranges.

``python -m clipbench.conformance.safe_range --results results/safe_range.csv [--impl NAME]
[--device cuda]``: the calls run on the device, as in the conformance suite.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
import time
from typing import Sequence

import numpy as np

from clipbench.conformance import measure, rules, running
from clipbench.conformance.cases import Inputs
from clipbench.conformance.running import Outcome, call, call_reference, not_applicable
from clipbench.reference.formats import FORMATS
from clipbench.schema import SAFE_RANGE_COLUMNS, value_severity

SEED = 33
ROWS = (16, 8)  # two leaves of 3-vectors: 72 elements, rows for the step norm
P_VALUES = (2.0, 1.0, 3.0, math.inf)  # the common one first: a budget leaves out the last
STEP_NORM = "step"  # the norm_type column of clip_by_max_step
# The default steps (in log2 of the norm) keep the whole scan within a few minutes on two
# cores (our JAX kernels take ~60 ms a call): about 20-35 points per dtype, float16's 40
# binades at every 2nd (the dtype people train in, where overflow is everyday), bfloat16's and
# float32's 280 at every 8th, float64's 2,100 at every 64th; ``thorough`` takes every binade.
DEFAULT_STEPS = {"float16": 2, "bfloat16": 8, "float32": 8, "float64": 64}
# Seconds of an implementation's own calls after which its remaining scans are left out (the
# last of :func:`groups`: p = inf, 3, 1 first), and say so. Triton's interpreter (no GPU)
# takes ~0.2 s a call and JAX kernels that compile for each threshold ~60 ms: unbounded, they
# would take minutes each.
DEFAULT_BUDGET_S = 8.0


def exponents(dtype: str, step: int) -> list[int]:
  """log2 of the norms scanned: from elements around the smallest subnormal to the largest
  binade the elements still fit in (the norm is a few times the largest element)."""
  fmt = FORMATS[dtype]
  low, high = fmt.emin - fmt.prec + 2, fmt.emax
  return list(range(high, low - 1, -step))[::-1]


def _norm(x: np.ndarray, op: str, p: float) -> float:
  if op == "clip_by_max_step":
    return float(np.max(np.linalg.norm(x, axis=1)))
  return float(np.linalg.norm(x.ravel(), ord=p))


def inputs_at(op: str, dtype: str, p: float, e: int) -> Inputs | None:
  """The fixed input scaled to an exact norm near 2**e, threshold half its exact norm; None
  when the scaled elements do not fit the dtype."""
  rng = np.random.default_rng(SEED)
  base = rng.standard_normal((sum(ROWS), 3))
  scaled = base * (2.0 ** (e - math.log2(_norm(base, op, p))))
  dt = FORMATS[dtype].dtype
  with np.errstate(over="ignore"):
    cast = scaled.astype(dt)
  if not np.isfinite(cast.astype(np.float64)).all():
    return None
  leaves = [cast[:ROWS[0]].copy(), cast[ROWS[0]:].copy()]
  probe = Inputs(leaves, 1.0, norm_type=p)
  exact = rules.exact_norm(op, probe, leaves)
  if exact.is_zero:
    return None
  threshold = float(exact.approximate()) / 2
  if not 0 < threshold < math.inf:
    return None
  return Inputs(leaves, threshold, norm_type=p if op != "clip_by_max_step" else 2.0)


def judge(impl, op: str, inputs: Inputs, systems: list, out: Outcome,
          ref: Outcome) -> tuple[str, str, float]:
  """(the check that failed first, its message; "" and "" when none; the relative error)."""
  if out.error is not None:
    return "raised", f"raised {type(out.error).__name__}: {out.error}"[:200], math.nan
  checks = (("structure", lambda: rules.check_structure(inputs, out, op, impl)),
            ("finite-outputs", lambda: rules.check_finite_outputs(op, inputs, out, systems, ref)),
            ("norm", lambda: rules.check_norms(op, inputs, out, systems, impl)),
            ("bound", lambda: rules.check_bound(op, inputs, out, systems)),
            ("factor", lambda: rules.check_factor(op, inputs, out, systems)))
  failed, violation = "", ""
  for name, check in checks:
    try:
      check()
    except AssertionError as e:
      failed, violation = name, str(e).splitlines()[0][:200]
      break
  return failed, violation, measure.relative_error(op, inputs, out, ref,
                                                    impl.capabilities.returns_norm)


def default_ops(impl) -> tuple[str, ...]:
  """One global-norm entry point (``clip_grad_norm`` where it has one: the same system norm as
  ``clip_by_global_norm``'s global form) and the max-step one: the ops a default scan covers."""
  norm_ops = [op for op in ("clip_grad_norm", "clip_by_global_norm") if op in impl.ops]
  return tuple(norm_ops[:1] + [op for op in impl.ops if op == "clip_by_max_step"])


def groups(impl, ops: Sequence[str] | None = None, dtypes: Sequence[str] | None = None,
           norm_types: Sequence[float] = P_VALUES) -> list[tuple[str, str, float]]:
  """(dtype, op, p) of every scan ``impl`` gets (``ops``, ``dtypes``, ``norm_types``: only
  those, where it supports them), in the order a budget keeps them: every dtype at its first
  op and p (the L2 norm), then the other ops, then the other p."""
  caps = impl.capabilities
  found = []
  chosen = sorted((o for o in impl.ops if ops is None or o in ops),
                  key=lambda o: o == "clip_by_max_step")
  for rank_op, op in enumerate(chosen):
    ps = (2.0,) if op == "clip_by_max_step" else tuple(
        p for p in norm_types if caps.supports_norm_type(p))
    for rank_p, p in enumerate(ps):
      for rank_d, dtype in enumerate(d for d in FORMATS if d in caps.dtypes and (
          dtypes is None or d in dtypes)):
        found.append(((rank_p, rank_op, rank_d), (dtype, op, p)))
  return [group for _, group in sorted(found)]


# The inputs, their systems (exact norms) and the reference's result of each point, shared by
# every implementation: exact arithmetic is most of a scan's cost.
_REFERENCE: dict[tuple[str, str, float, int], tuple[Inputs, list, Outcome] | None] = {}


def _reference(op: str, dtype: str, p: float, e: int) -> tuple[Inputs, list, Outcome] | None:
  key = (op, dtype, p, e)
  if key not in _REFERENCE:
    inputs = inputs_at(op, dtype, p, e)
    _REFERENCE[key] = None if inputs is None else (
        inputs, rules.systems_of(op, inputs), call_reference(op, inputs))
  return _REFERENCE[key]


def scan(impl, steps: dict[str, int] | None = None, budget_s: float = math.inf,
         **only) -> tuple[list[dict], list[str]]:
  """Every point of ``impl``'s scans (``only``: :func:`groups`' filters), as rows of
  ``SAFE_RANGE_COLUMNS``, and the scans left out once ``impl``'s own calls had taken
  ``budget_s`` seconds. A scan's first call (where a kernel compiles for its dtype and p) is
  not counted; a scan the budget runs out in is left out whole, since a range drawn from part
  of one would be wrong. The budget never leaves out a dtype's first scan (its L2 norm, see
  :func:`groups`): every dtype an implementation supports gets a range."""
  steps = {**DEFAULT_STEPS, **(steps or {})}
  spent = 0.0  # seconds in the implementation's calls
  rows, skipped = [], []
  scanned: set[str] = set()  # dtypes with a whole scan
  for dtype, op, p in groups(impl, **only):
    mine = []
    for i, e in enumerate(exponents(dtype, steps[dtype])):
      if spent > budget_s and dtype in scanned:
        break
      started = time.perf_counter()
      mine += _point(impl, op, dtype, p, e)
      spent += (time.perf_counter() - started) if i else 0.0
    else:
      rows += mine
      scanned.add(dtype)
      continue
    skipped.append(f"{op} {dtype} p={p:g}")
  return rows, skipped


def _point(impl, op: str, dtype: str, p: float, e: int) -> list[dict]:
  """The row of one point ([] where the input does not fit the dtype or does not apply)."""
  point = _reference(op, dtype, p, e)
  if point is None or not_applicable(impl, op, point[0]) is not None:
    return []
  inputs, systems, ref = point
  out = call(impl, op, inputs)
  failed, violation, rel = judge(impl, op, inputs, systems, out, ref)
  material = out.error is None and value_severity(rel, dtype) != "silent-wrong-value"
  return [{
      "impl": impl.name, "kind": impl.kind, "library": impl.library, "version": impl.version,
      "op": op, "dtype": dtype, "norm_type": STEP_NORM if op == "clip_by_max_step" else f"{p:g}",
      "log2_norm": e, "threshold": repr(float(inputs.threshold)),
      "rounding": "fail" if failed else "pass", "material": "pass" if material else "fail",
      "rel_error": repr(float(rel)), "check": failed, "observed": violation}]


def to_csv(rows: Sequence[dict]) -> str:
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=SAFE_RANGE_COLUMNS, extrasaction="ignore")
  writer.writeheader()
  writer.writerows(rows)
  return buffer.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m clipbench.conformance.safe_range",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--results", required=True, help="the CSV file to write")
  parser.add_argument("--impl", action="append", default=[],
                      help="an implementation (repeatable; default: every available one)")
  parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                      help="seconds of an implementation's calls after which its scans not "
                           "yet begun are left out "
                           f"(default {DEFAULT_BUDGET_S:g}; thorough: none)")
  parser.add_argument("--device", default="cpu", metavar="cpu[:N]|cuda[:N]",
                      help="where the calls run (default: cpu), as in the conformance suite")
  parser.add_argument("--profile", choices=("ci", "thorough"), default="ci",
                      help="thorough: every binade and every op (default: every 2nd binade "
                           "in float16, 8th in bfloat16 and float32, 64th in float64; one "
                           "global-norm op)")
  args = parser.parse_args(argv)
  from clipbench import devices, files, loading  # pylint: disable=import-outside-toplevel
  try:
    running.set_device(devices.requested(args.device))
  except ValueError as e:
    parser.error(f"--{e}")
  # The reference is what the scan compares against: it conforms everywhere by construction.
  impls = (loading.load_requested(args.impl, require_available=True) if args.impl
           else [i for i in loading.load_all(progress=False)
                 if i.available and i.kind != "reference"])
  refused = loading.mark_off_device(impls, running.device())
  if refused and args.impl:
    parser.error("; ".join(f"impl {i.name!r}: {i.reason}" for i in refused))
  impls = [i for i in impls if i.available]
  thorough = args.profile == "thorough"
  steps = {d: 1 for d in FORMATS} if thorough else {}
  rows: list[dict] = []
  for impl in impls:
    started = time.perf_counter()
    mine, skipped = scan(impl, steps, math.inf if thorough else args.budget,
                         ops=None if thorough else default_ops(impl))
    rows += mine
    left = f"; left out after {args.budget:g} s of calls: {', '.join(skipped)}" if skipped else ""
    print(f"safe range: {impl.name}: {len(mine)} points in {time.perf_counter() - started:.1f} s"
          f"{left}", flush=True)
  files.write_text(args.results, to_csv(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
