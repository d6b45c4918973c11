"""Rule checks: each ``verify_ruleN`` checks one SPEC rule on one (implementation, op, case).

A check raises :class:`Violation` (an AssertionError) with a message saying what was
observed; it returns a :class:`Finding` with the measured ulp errors for the results table.
The conformance tests are thin wrappers around these functions, and the suite's self-test
runs them on deliberately broken implementations.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import Callable

import numpy as np

from clipbench import reference
from clipbench.conformance import measure
from clipbench.conformance.cases import Case, Inputs
from clipbench.conformance.running import SESSION, CallTimeout, Outcome
from clipbench.impls.registry import Implementation
from clipbench.reference.formats import FORMATS, format_of, ulp
from clipbench.reference.norms import ExactNorm


class Violation(AssertionError):
  """An implementation departs from a rule; the message says how."""


@dataclasses.dataclass
class Finding:
  max_ulp_error: float = math.nan  # outputs against the reference, in leaf-dtype ulps
  norm_ulp_error: float = math.nan  # reported norms against the exact norms
  observed: str = "conforms"
  # measure.call_facts of the call: whether it returned, and its relative error.
  measured: dict = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------- helpers
def row_masks(op: str, inputs: Inputs, k: int) -> list[np.ndarray]:
  if op == "clip_grad_norm" or inputs.segments is None:
    return [np.ones(x.shape[0] if x.ndim else 1, bool) for x in inputs.leaves]
  return [seg == k for seg in inputs.segments]


def num_systems(op: str, inputs: Inputs) -> int:
  return 1 if op == "clip_grad_norm" or inputs.segments is None else inputs.num_systems


def rows(leaf: np.ndarray, mask: np.ndarray) -> np.ndarray:
  return leaf.reshape(1) if leaf.ndim == 0 else leaf[mask]


def blocks(leaves: list[np.ndarray], masks: list[np.ndarray]) -> list[np.ndarray]:
  return [rows(x, m) for x, m in zip(leaves, masks)]


def sanitized(block: np.ndarray) -> np.ndarray:
  return np.where(np.isfinite(block.astype(np.float64)), block, np.zeros((), block.dtype))


def threshold_of(inputs: Inputs, k: int) -> float:
  t = inputs.threshold
  return float(t[k]) if isinstance(t, np.ndarray) and t.ndim else float(t)


def is_finite_system(bl: list[np.ndarray]) -> bool:
  return all(np.isfinite(b.astype(np.float64)).all() for b in bl)


def exact_norm(op: str, inputs: Inputs, bl: list[np.ndarray]) -> ExactNorm:
  if op == "clip_by_max_step":
    return reference.system_step_norm(bl)
  return reference.system_norm(bl, inputs.norm_type)


def output_norm(op: str, inputs: Inputs, bl: list[np.ndarray]) -> ExactNorm:
  return exact_norm(op, inputs, bl)


def at_or_below(norm: ExactNorm, c: float) -> bool:
  return c == math.inf or norm.compare(Fraction(c)) <= 0


def describe(x) -> str:
  return np.array2string(np.asarray(x).ravel()[:6], precision=9, separator=", ")


@dataclasses.dataclass
class System:
  k: int
  masks: list[np.ndarray]
  inputs: list[np.ndarray]  # sanitized when nonfinite == "zero"
  raw_inputs: list[np.ndarray]
  norm: ExactNorm | None  # None for a non-finite system under "propagate"
  threshold: float

  @property
  def unchanged(self) -> bool:
    return self.norm is not None and at_or_below(self.norm, self.threshold)


def systems_of(op: str, inputs: Inputs) -> list[System]:
  out = []
  for k in range(num_systems(op, inputs)):
    masks = row_masks(op, inputs, k)
    raw = blocks(inputs.leaves, masks)
    if is_finite_system(raw):
      bl, norm = raw, exact_norm(op, inputs, raw)
    elif inputs.nonfinite == "zero":
      bl = [sanitized(b) for b in raw]
      norm = exact_norm(op, inputs, bl)
    else:
      bl, norm = raw, None
    out.append(System(k, masks, bl, raw, norm, threshold_of(inputs, k)))
  return out


def leaf_spacing(y: np.ndarray) -> np.ndarray:
  """Distance from |y| to the next float up in y's dtype (bfloat16 included), as float64."""
  fmt = format_of(y.dtype)
  a = np.abs(y.astype(np.float64))
  e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
  e = np.maximum(np.where(a > 0, e, fmt.emin), fmt.emin)
  return np.exp2(e - fmt.prec + 1)


def first_difference(x: np.ndarray, y: np.ndarray) -> int:
  """Index (flat) of the first element whose bits differ; 0 when shapes or dtypes differ."""
  if x.shape != y.shape or x.dtype != y.dtype or not x.size:
    return 0
  bits = f"u{x.dtype.itemsize}"
  diff = np.flatnonzero(x.view(bits).ravel() != y.view(bits).ravel())
  return int(diff[0]) if diff.size else 0


def ulp_distance(y: np.ndarray, ref: np.ndarray) -> float:
  """Largest |y - ref| in ulps of ref's dtype at ref (NaN-aware: NaN vs NaN is 0)."""
  if y.size == 0:
    return 0.0
  a, b = y.astype(np.float64), ref.astype(np.float64)
  both_nan = np.isnan(a) & np.isnan(b)
  same = (a == b) | both_nan
  if same.all():
    return 0.0
  if (~np.isfinite(a) & ~same).any() or (~np.isfinite(b) & ~same).any():
    return math.inf
  d = np.abs(a - b) / leaf_spacing(ref)
  return float(np.max(np.where(same, 0.0, d)))


# ------------------------------------------------------------------------------ the checks
def expect_result(outcome: Outcome) -> None:
  outcome.raise_if_error()


def check_structure(inputs: Inputs, out: Outcome, op: str, impl: Implementation) -> None:
  """Rule 9: same number, shapes and dtypes of leaves; norms of the right shape and dtype."""
  if len(out.leaves) != len(inputs.leaves):
    raise Violation(f"returned {len(out.leaves)} leaves for {len(inputs.leaves)}")
  for i, (x, y) in enumerate(zip(inputs.leaves, out.leaves)):
    if y.shape != x.shape or y.dtype != x.dtype:
      raise Violation(f"leaves[{i}]: {x.dtype.name}{list(x.shape)} returned as "
                      f"{y.dtype.name}{list(y.shape)}")
  if out.norms is None or not impl.capabilities.returns_norm:
    return
  expected_shape = () if op == "clip_grad_norm" else (num_systems(op, inputs),)
  if out.norms.shape != expected_shape and out.norms.size != int(np.prod(expected_shape)):
    raise Violation(f"norms of shape {out.norms.shape}, expected {expected_shape}")


def check_norm_dtype(inputs: Inputs, out: Outcome, op: str, impl: Implementation) -> None:
  """Rule 9 (canonical API): norms in float32, or float64 when any leaf is float64."""
  if out.norms is None or not impl.capabilities.returns_norm:
    return
  fmt = reference.norm_format(inputs.leaves)
  if out.norms.dtype != fmt.dtype:
    raise Violation(f"norm dtype {out.norms.dtype.name}, expected {fmt.name} (the norm dtype "
                    f"for {'/'.join(sorted(inputs.dtypes)) or 'no leaves'})")


def check_unchanged(op, inputs, out: Outcome, systems: list[System]) -> None:
  """Rule 3: systems whose exact norm is <= threshold come back bitwise unchanged."""
  for s in systems:
    if not s.unchanged:
      continue
    got = blocks(out.leaves, s.masks)
    for i, (x, y) in enumerate(zip(s.inputs, got)):
      if x.tobytes() != y.tobytes():
        if x.shape == y.shape and x.dtype == y.dtype and x.size:
          j = first_difference(x, y)
          change = f"{x.ravel()[j]!r} -> {y.ravel()[j]!r}"
        else:
          change = f"{x.dtype.name}{list(x.shape)} -> {y.dtype.name}{list(y.shape)}"
        raise Violation(
            f"system {s.k}: exact norm {float(s.norm.approximate()):.9g} <= max "
            f"{s.threshold:.9g} but leaves[{i}] changed: {change}")


def _clipped_outputs(out: Outcome, systems: list[System]):
  for s in systems:
    if s.norm is None or s.unchanged:
      continue
    got = blocks(out.leaves, s.masks)
    for i, y in enumerate(got):
      if not np.isfinite(y.astype(np.float64)).all():
        raise Violation(f"system {s.k}: finite input clipped to non-finite output in "
                        f"leaves[{i}]: {describe(y)}")
    yield s, got


def check_bound(op, inputs, out: Outcome, systems: list[System]) -> None:
  """Rule 4: the exactly computed norm of a clipped system's output is <= its threshold."""
  fmt = reference.norm_format(inputs.leaves)
  for s, got in _clipped_outputs(out, systems):
    out_norm = output_norm(op, inputs, got)
    if out_norm.compare(Fraction(s.threshold)) > 0:
      excess = (out_norm.approximate() - Fraction(s.threshold)) / ulp(Fraction(s.threshold), fmt)
      raise Violation(
          f"system {s.k}: output norm {float(out_norm.approximate()):.12g} > max "
          f"{s.threshold:.12g} (by {float(excess):.3g} ulp): strict bound broken")


def check_factor(op, inputs, out: Outcome, systems: list[System]) -> None:
  """Rule 4: one factor s per system, within 4u below max/norm, explains every output."""
  for s, got in _clipped_outputs(out, systems):
    _check_one_factor(s, got)


def check_factor_matches_norm(op, inputs, out: Outcome, systems: list[System]) -> None:
  """Rules 1, 2, 10: the system was scaled by max/norm of *this* norm (its domain, its p),
  within 8u either side; rule 4 alone judges the exact placement of s below max/norm."""
  for s, got in _clipped_outputs(out, systems):
    _check_one_factor(s, got, window=8)


def _check_one_factor(s: System, got: list[np.ndarray], window: int = 0) -> None:
  """Is there one s in [r(1-4u), r], r = c/n, with every |y| within 1 ulp of |x| s?

  With ``window`` > 0 the interval is [r(1 - window u), r(1 + window u)] instead.
  """
  ratio = Fraction(s.threshold) / s.norm.approximate()
  u = max(format_of(x.dtype).unit_roundoff for x in s.inputs) if s.inputs else 0
  lo, hi = (ratio * (1 - 4 * u), ratio) if not window else (ratio * (1 - window * u),
                                                            ratio * (1 + window * u))
  for x, y in zip(s.inputs, got):
    if x.size == 0:
      continue
    x, y = x.ravel(), y.ravel()
    xa = np.abs(x.astype(np.float64)).ravel()
    ya = np.abs(y.astype(np.float64)).ravel()
    if np.any((np.signbit(x.astype(np.float64)) != np.signbit(y.astype(np.float64))) &
              (ya != 0)):
      raise Violation(f"system {s.k}: output changes sign: {describe(x)} -> {describe(y)}")
    nonzero = xa != 0
    if np.any(ya[~nonzero] != 0):
      raise Violation(f"system {s.k}: a zero input became nonzero")
    sp = leaf_spacing(y).ravel()[nonzero]
    xa, ya = xa[nonzero], ya[nonzero]
    if not xa.size:
      continue
    if x.dtype == np.float64:
      lows = [(Fraction(b) - Fraction(d)) / Fraction(a) for a, b, d in zip(xa, ya, sp)]
      highs = [(Fraction(b) + Fraction(d)) / Fraction(a) for a, b, d in zip(xa, ya, sp)]
      lo, hi = max([lo] + lows), min([hi] + highs)
    else:
      # Exact enough in float64: the tolerances are float32 ulps, 2^29 times coarser.
      margin = 2.0 ** -50
      lo = max(lo, Fraction(float(np.max((ya - sp) / xa)) * (1 - margin)))
      hi = min(hi, Fraction(float(np.min((ya + sp) / xa)) * (1 + margin)))
    if lo > hi:
      raise Violation(
          f"system {s.k}: no single factor s within 4u below max/norm = {float(ratio):.12g} "
          f"explains the output (leaf {x.dtype.name}: {describe(x)} -> {describe(y)})")


def check_norms(op, inputs, out: Outcome, systems: list[System], impl) -> float:
  """Rule 5: reported norms within 2 ulp of the exact norm; +inf beyond the norm dtype."""
  if out.norms is None or not impl.capabilities.returns_norm:
    return math.nan
  reported = np.asarray(out.norms, dtype=np.float64).ravel()
  fmt = reference.norm_format(inputs.leaves)
  worst = 0.0
  for s in systems:
    if s.norm is None:
      continue
    r = reported[s.k]
    exact = s.norm.approximate()
    if exact >= fmt.overflow_threshold:
      if r != math.inf:
        raise Violation(f"system {s.k}: norm {r!r} reported for an exact norm "
                        f"{float(exact):.9g} beyond {fmt.name}: expected +inf")
      continue
    if not math.isfinite(r):
      raise Violation(f"system {s.k}: norm {r!r} reported for the finite exact norm "
                      f"{float(exact):.9g} (overflow or underflow on the way)")
    err = float(abs(Fraction(r) - exact) / ulp(exact, fmt))
    worst = max(worst, err)
    if err > 2:
      raise Violation(f"system {s.k}: norm {r!r} is {err:.3g} ulp from the exact "
                      f"{float(exact):.12g} (limit 2 ulp)")
  return worst


def check_finite_outputs(op, inputs, out: Outcome, systems: list[System],
                         ref: Outcome) -> None:
  """Rule 5: finite input never yields NaN or inf, nor zeros where the reference has none."""
  for s in systems:
    if s.norm is None:
      continue
    got = blocks(out.leaves, s.masks)
    for i, y in enumerate(got):
      if not np.isfinite(y.astype(np.float64)).all():
        raise Violation(f"system {s.k}: finite input gave {describe(y)} in leaves[{i}]")
    expected = blocks(ref.leaves, s.masks)
    for i, (y, r) in enumerate(zip(got, expected)):
      # Within 1 ulp of the smallest subnormal a zero is an allowed rounding (rule 4).
      smallest = float(ulp(Fraction(0), format_of(r.dtype)))
      lost = (y.astype(np.float64) == 0) & (np.abs(r.astype(np.float64)) > 2 * smallest)
      if lost.any():
        raise Violation(f"system {s.k}: leaves[{i}] element {r.ravel()[np.flatnonzero(lost.ravel())[0]]!r} "
                        f"of the exact result came back as zero: {describe(y)}")


# ---------------------------------------------------------------------- per-rule verify
def _prepare(impl, op, case):
  inputs = SESSION.inputs(case, op)
  out = SESSION.result(impl, case, op)
  expect_result(out)
  check_structure(inputs, out, op, impl)
  return inputs, out, systems_of(op, inputs)


def _values(impl, op, case, out) -> float:
  ref = SESSION.reference(case, op)
  return max((ulp_distance(y, r) for y, r in zip(out.leaves, ref.leaves)), default=0.0)


def verify_values(impl, op, case, checks) -> Finding:
  inputs, out, systems = _prepare(impl, op, case)
  finding = Finding()
  for check in checks:
    if check is check_norms:
      finding.norm_ulp_error = check_norms(op, inputs, out, systems, impl)
    elif check is check_finite_outputs:
      check(op, inputs, out, systems, SESSION.reference(case, op))
    else:
      check(op, inputs, out, systems)
  finding.max_ulp_error = _values(impl, op, case, out)
  return finding


def verify_rule1(impl, op, case) -> Finding:
  return verify_values(impl, op, case, [check_norms, check_unchanged, check_factor_matches_norm])


def verify_rule2(impl, op, case) -> Finding:
  return verify_values(impl, op, case, [check_norms, check_unchanged, check_factor_matches_norm])


def verify_rule3(impl, op, case) -> Finding:
  return verify_values(impl, op, case, [check_unchanged])


def verify_rule4(impl, op, case) -> Finding:
  return verify_values(impl, op, case, [check_bound, check_factor])


def verify_rule5(impl, op, case) -> Finding:
  return verify_values(impl, op, case, [check_finite_outputs, check_norms])


def verify_rule6(impl, op, case) -> Finding:
  finding = verify_values(impl, op, case, [check_unchanged])
  inputs, out, systems = _prepare(impl, op, case)
  for s in systems:
    if s.threshold == 0 and s.norm is not None and not s.norm.is_zero:
      got = blocks(out.leaves, s.masks)
      if any(np.any(y.astype(np.float64) != 0) for y in got):
        raise Violation(f"system {s.k}: max 0 must zero the system, got "
                        f"{describe(np.concatenate([g.ravel() for g in got]))}")
  return finding


def verify_rule7(impl, op, case) -> Finding:
  inputs, out, systems = _prepare(impl, op, case)
  if inputs.nonfinite == "zero":
    return verify_values(impl, op, case, [check_unchanged, check_factor_matches_norm,
                                        check_norms])
  poisoned = [s for s in systems if s.norm is None]
  for s in poisoned:
    got = blocks(out.leaves, s.masks)
    values = np.concatenate([g.astype(np.float64).ravel() for g in got])
    if not np.isnan(values).all():
      raise Violation(f"system {s.k} holds a non-finite input ({describe(np.concatenate([b.ravel() for b in s.raw_inputs]))}) "
                      f"but its output is not all NaN: {describe(values)}")
    if out.norms is not None and impl.capabilities.returns_norm:
      r = float(np.asarray(out.norms, np.float64).ravel()[s.k])
      has_nan = any(np.isnan(b.astype(np.float64)).any() for b in s.raw_inputs)
      if has_nan and not math.isnan(r):
        raise Violation(f"system {s.k}: contains NaN, reported norm {r!r} (expected NaN)")
      if not has_nan and r != math.inf:
        raise Violation(f"system {s.k}: contains +-inf and no NaN, reported norm {r!r} "
                        f"(expected +inf)")
  healthy = [s for s in systems if s.norm is not None]
  if healthy and poisoned:
    _check_others_untouched(impl, op, case, inputs, out, poisoned)
  return Finding(max_ulp_error=_values(impl, op, case, out))


def _check_others_untouched(impl, op, case, inputs, out, poisoned):
  """Other systems' bits must equal those of the same call with the poisoned system finite."""
  from clipbench.conformance.running import call  # pylint: disable=import-outside-toplevel
  clean = inputs.copy()
  for s in poisoned:
    for leaf, mask in zip(clean.leaves, s.masks):
      block = rows(leaf, mask)
      fixed = np.where(np.isfinite(block.astype(np.float64)), block,
                       np.asarray(0.5, block.dtype))
      if leaf.ndim:
        leaf[mask] = fixed
  other = call(impl, op, clean)
  other.raise_if_error()
  bad = {s.k for s in poisoned}
  for k in range(num_systems(op, inputs)):
    if k in bad:
      continue
    masks = row_masks(op, inputs, k)
    for i, (a, b) in enumerate(zip(blocks(out.leaves, masks), blocks(other.leaves, masks))):
      if a.tobytes() != b.tobytes():
        raise Violation(f"system {k} changed because another system holds a non-finite "
                        f"value: leaves[{i}] {describe(b)} -> {describe(a)}")


def verify_rule8(impl, op, case) -> Finding:
  finding = verify_values(impl, op, case, [check_unchanged, check_norms])
  inputs, out, systems = _prepare(impl, op, case)
  if out.norms is not None and impl.capabilities.returns_norm:
    reported = np.asarray(out.norms, np.float64).ravel()
    for s in systems:
      if all(b.size == 0 for b in s.inputs) and reported[s.k] != 0:
        raise Violation(f"system {s.k} has no elements but reported norm {reported[s.k]!r}")
  return finding


def verify_rule9(impl, op, case) -> Finding:
  inputs, out, _ = _prepare(impl, op, case)
  check_norm_dtype(inputs, out, op, impl)
  return Finding(max_ulp_error=_values(impl, op, case, out))


def verify_rule10(impl, op, case) -> Finding:
  return verify_values(impl, op, case, [check_unchanged, check_factor_matches_norm,
                                        check_norms])


def measured(verify: Callable[[Implementation, str, Case], Finding]):
  """``verify`` with the call's :func:`measure.call_facts` on its Finding, or on the
  AssertionError it raises (attribute ``measured``), so a failing case records how far off
  it was as well as a passing one."""

  @functools.wraps(verify)
  def run(impl: Implementation, op: str, case: Case) -> Finding:
    try:
      finding = verify(impl, op, case)
    except CallTimeout:
      raise
    except AssertionError as e:
      e.measured = _call_facts(impl, op, case)
      raise
    finding.measured = _call_facts(impl, op, case)
    return finding

  return run


def _call_facts(impl: Implementation, op: str, case: Case) -> dict:
  out = SESSION.result(impl, case, op)
  try:
    ref = SESSION.reference(case, op) if out.error is None else None
  except (ValueError, TypeError):
    ref = None  # an argument the reference refuses: there is nothing to measure against
  return measure.call_facts(op, SESSION.inputs(case, op), out, ref,
                            impl.capabilities.returns_norm)


VERIFY: dict[int, Callable[[Implementation, str, Case], Finding]] = {
    rule: measured(verify) for rule, verify in (
        (1, verify_rule1), (2, verify_rule2), (3, verify_rule3), (4, verify_rule4),
        (5, verify_rule5), (6, verify_rule6), (7, verify_rule7), (8, verify_rule8),
        (9, verify_rule9), (10, verify_rule10))}
