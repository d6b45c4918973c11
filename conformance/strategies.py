"""Hypothesis strategies for conformance inputs: batches of systems across the exponent range.

Sizes include zero (no systems, empty systems, zero-row leaves); magnitudes span each dtype's
whole exponent range (subnormal to near-overflow); thresholds are scalars or per system, drawn
relative to the systems' norms so that both sides of the threshold are exercised.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from clipbench.conformance.cases import Inputs
from clipbench.reference.formats import format_of

DTYPE_NAMES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
               "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}


@st.composite
def leaf_values(draw, shape, dtype):
  """Values of one leaf: normal draws times a power of two spanning the dtype's range."""
  fmt = format_of(dtype)
  seed = draw(st.integers(0, 2 ** 32 - 1))
  rng = np.random.default_rng(seed)
  # Stay a few binades inside the range so the sum of a leaf's squares is still finite
  # in exact arithmetic (the exact norm is always finite; the norm *dtype* may overflow).
  exponent = draw(st.integers(fmt.emin - fmt.prec + 2, fmt.emax - 4))
  values = rng.standard_normal(shape) * 2.0 ** exponent
  zero_fraction = draw(st.sampled_from([0.0, 0.0, 0.2]))
  values[rng.random(shape) < zero_fraction] = 0.0
  return values.astype(dtype)


@st.composite
def batches(draw, dtypes, per_system: bool, max_step: bool, max_systems: int = 12,
            max_rows: int = 6, per_system_max: bool = False, norm_types=(2.0,),
            nonfinite=("propagate",)):
  """Inputs for one canonical call."""
  num_systems = draw(st.integers(0 if per_system else 1, max_systems)) if per_system else 1
  num_leaves = draw(st.integers(0 if per_system else 1, 3))
  leaves, segments = [], []
  for _ in range(num_leaves):
    dtype = DTYPE_NAMES[draw(st.sampled_from(sorted(dtypes)))]
    rows = draw(st.integers(0, max_rows * max(num_systems, 1)))
    trailing = draw(st.sampled_from([(3,), (), (2, 2)] if not max_step else [(3,), ()]))
    leaves.append(draw(leaf_values((rows,) + trailing, dtype)))
    if per_system:
      ids = draw(st.lists(st.integers(0, max(num_systems - 1, 0)), min_size=rows,
                          max_size=rows)) if num_systems else []
      segments.append(np.array(ids, dtype=np.int64))
  if per_system and num_systems == 0:
    leaves = [x[:0] for x in leaves]
    segments = [s[:0] for s in segments]
  threshold = draw(thresholds(per_system_max and per_system, num_systems))
  norm_type = draw(st.sampled_from(norm_types)) if not max_step else 2.0
  return Inputs(leaves, threshold, segments if per_system else None,
                num_systems if per_system else None, norm_type,
                draw(st.sampled_from(nonfinite)))


@st.composite
def thresholds(draw, per_system: bool, num_systems: int):
  one = st.one_of(
      st.floats(min_value=2.0 ** -149, max_value=3e38, allow_nan=False).map(
          lambda v: float(np.float32(v))),
      st.sampled_from([0.0, 1.0, math.inf]))
  if per_system and draw(st.booleans()):
    return np.array(draw(st.lists(one, min_size=num_systems, max_size=num_systems)),
                    dtype=np.float64)
  return draw(one)
