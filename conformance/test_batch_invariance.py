"""Rule 11: a system's bits depend only on its own elements — batched vs alone, bit for bit.

Every variant rebuilds the same systems in another batch (alone, permuted, interleaved, with
other values around them, with extra empty systems) and compares each system's output bits
and norm bits with the original batched call. Repeated calls must also give the same bits.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from clipbench.conformance import cases as case_table
from clipbench.conformance import running
from clipbench.conformance.cases import Inputs
from clipbench.conformance.rules import Violation, blocks, first_difference, row_masks
from clipbench.conformance.running import Outcome, call, not_applicable

VARIANTS = ("alone_segments_none", "alone_one_system", "permuted_systems", "interleaved_rows",
            "other_systems_changed", "extra_empty_systems", "repeated_call")
GLOBAL_VARIANTS = ("repeated_call",)
DTYPES = ("float32", "float64", "bfloat16")
CHECKED_SYSTEMS = 8  # systems compared one by one in the "alone" variants


def batch(dtype: str, op: str) -> Inputs:
  """40 systems of 1-40 rows, interleaved, with a per-system (3, 3) leaf."""
  inputs = case_table._random_batch(  # pylint: disable=protected-access
      77, 40, (1, 40), dtype=np.float32, threshold=2.0)
  inputs.leaves = [x.astype(case_table.BF16 if dtype == "bfloat16" else dtype)
                   for x in inputs.leaves]
  return inputs


def global_batch(dtype: str, op: str) -> Inputs:
  inputs = case_table._random_global(78, 500, np.float32, threshold=2.0)(op)  # pylint: disable=protected-access
  inputs.leaves = [x.astype(case_table.BF16 if dtype == "bfloat16" else dtype)
                   for x in inputs.leaves]
  return inputs


def variants(impl, op):
  out = []
  per_system = op != "clip_grad_norm" and impl.capabilities.per_system
  for variant in VARIANTS:
    for dtype in DTYPES:
      inputs = (batch if per_system else global_batch)(dtype, op)
      reason = not_applicable(impl, op, inputs)
      if reason is None and not per_system and variant not in GLOBAL_VARIANTS:
        reason = "not per-system"
      out.append((f"{variant}-{dtype}", (variant, inputs), reason, dtype))
  return out


def _system_bits(leaves, masks):
  return [b.tobytes() for b in blocks(leaves, masks)]


def _compare(k, base, base_masks, other, other_masks, what, base_norm=None, other_norm=None):
  a, b = _system_bits(base.leaves, base_masks), _system_bits(other.leaves, other_masks)
  if a != b:
    i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
    x, y = blocks(base.leaves, base_masks)[i], blocks(other.leaves, other_masks)[i]
    j = first_difference(x, y)
    raise Violation(f"system {k}: leaves[{i}] bits differ {what}: element {j} is "
                    f"{x.ravel()[j]!r} in the batch, {y.ravel()[j]!r} otherwise")
  if base_norm is not None and other_norm is not None:
    if np.asarray(base_norm).tobytes() != np.asarray(other_norm).tobytes():
      raise Violation(f"system {k}: norm bits differ {what}: {base_norm!r} vs {other_norm!r}")


def _norm(outcome, k):
  return None if outcome.norms is None else np.asarray(outcome.norms).ravel()[k:k + 1]


def _subset(inputs: Inputs, keep: list[int], new_ids: dict[int, int], num: int,
            order=None) -> Inputs:
  """The rows of systems ``keep`` (relabelled by ``new_ids``), in original or given order."""
  leaves, segments = [], []
  for leaf, seg in zip(inputs.leaves, inputs.segments):
    mask = np.isin(seg, keep)
    idx = np.flatnonzero(mask)
    if order is not None:
      idx = idx[order(seg[idx])]
    leaves.append(leaf[idx])
    segments.append(np.array([new_ids[int(s)] for s in seg[idx]], dtype=np.int64))
  return Inputs(leaves, inputs.threshold, segments, num)


# The batched call every variant but repeated_call compares with, per implementation, device,
# operation and batch: the variants of one dtype rebuild the same batch, and under Triton's
# interpreter a call of it costs seconds. Each entry holds its implementation's object, so
# that no other object can take its id while the entry exists.
_BATCHED: dict[tuple, tuple[object, Outcome]] = {}


def _batch_key(inputs: Inputs) -> str:
  digest = hashlib.sha256(repr((np.asarray(inputs.threshold).tolist(), inputs.num_systems,
                                inputs.norm_type, inputs.nonfinite)).encode())
  for a in inputs.leaves + (inputs.segments or []):
    digest.update(f"{a.dtype}{a.shape}".encode())
    digest.update(np.ascontiguousarray(a).tobytes())
  return digest.hexdigest()


def _batched_call(impl, op: str, inputs: Inputs) -> Outcome:
  key = (impl.name, id(impl.obj), str(running.device()), op, _batch_key(inputs))
  if key not in _BATCHED:
    _BATCHED[key] = (impl.obj, call(impl, op, inputs))
  return _BATCHED[key][1]


def verify(impl, op, variant, inputs) -> None:
  if variant == "repeated_call":
    base = call(impl, op, inputs)
    base.raise_if_error()
    again = call(impl, op, inputs)
    again.raise_if_error()
    for k in range(1 if inputs.segments is None or op == "clip_grad_norm" else
                   inputs.num_systems):
      masks = row_masks(op, inputs, k)
      _compare(k, base, masks, again, masks, "between two identical calls", _norm(base, k),
               _norm(again, k))
    return
  base = _batched_call(impl, op, inputs)
  base.raise_if_error()
  n = inputs.num_systems
  rng = np.random.default_rng(5)
  checked = list(range(min(CHECKED_SYSTEMS, n)))
  if variant in ("alone_segments_none", "alone_one_system"):
    for k in checked:
      alone = _subset(inputs, [k], {k: 0}, 1)
      if variant == "alone_segments_none":
        alone = Inputs(alone.leaves, alone.threshold, None, None)
      other = call(impl, op, alone)
      other.raise_if_error()
      _compare(k, base, row_masks(op, inputs, k), other, row_masks(op, alone, 0),
               "alone vs in the batch", _norm(base, k), _norm(other, 0))
    return
  if variant == "permuted_systems":
    perm = rng.permutation(n)
    other_inputs = _subset(inputs, list(range(n)), {k: int(perm[k]) for k in range(n)}, n)
    mapping = {k: int(perm[k]) for k in range(n)}
  elif variant == "interleaved_rows":
    # Another interleaving that keeps each system's own row order (a stable sort by system).
    other_inputs = _subset(inputs, list(range(n)), {k: k for k in range(n)}, n,
                           order=lambda s: np.argsort(s, kind="stable"))
    mapping = {k: k for k in range(n)}
  elif variant == "other_systems_changed":
    other_inputs = inputs.copy()
    for leaf, seg in zip(other_inputs.leaves, other_inputs.segments):
      others = seg >= len(checked)
      leaf[others] = (leaf[others].astype(np.float64) * 3.5 + 1.0).astype(leaf.dtype)
    mapping = {k: k for k in checked}
  elif variant == "extra_empty_systems":
    spread = {k: 3 * k + 1 for k in range(n)}
    other_inputs = _subset(inputs, list(range(n)), spread, 3 * n + 2)
    mapping = spread
  else:
    raise ValueError(f"variant: unknown {variant!r}")
  other = call(impl, op, other_inputs)
  other.raise_if_error()
  for k in checked:
    _compare(k, base, row_masks(op, inputs, k), other,
             row_masks(op, other_inputs, mapping[k]), f"({variant.replace('_', ' ')})",
             _norm(base, k), _norm(other, mapping[k]))


@pytest.mark.conformance(rule=11, cases=variants)
def test_rule11_batch_invariance(target, check):
  variant, inputs = target.payload
  check(target, lambda: verify(target.impl, target.op, variant, inputs), inputs)
