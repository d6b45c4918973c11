# case: conformance/test_rules.py::test_rule4_random_batches_strict_bound[baseline.jax-segment-sum-clip_by_max_step-rule4-hypothesis_float32]
# baseline.jax-segment-sum: plain jax.ops.segment_sum / segment_max clipping under jax.jit
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([]).astype(np.float32), np.array([]).astype(np.float32), np.array([]).reshape((0, 3)).astype(np.float32)]
segments = [np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([], dtype=np.int64)]
num_systems = 0
threshold = np.array([]).astype(np.float64)
norm_type = 2.0
nonfinite = 'propagate'

try:
  impl = registry.load('baseline.jax-segment-sum')
  out, norms = calling.call(impl, 'clip_by_max_step', leaves, threshold, segments=segments, num_systems=num_systems)
  print(out, norms)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 4): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('baseline.jax-segment-sum'), 'clip_by_max_step', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=4)
assert problem is None, problem
