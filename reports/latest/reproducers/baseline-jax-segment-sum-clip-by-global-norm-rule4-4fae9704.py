# case: conformance/test_rules.py::test_rule4_one_factor_and_strict_bound[baseline.jax-segment-sum-clip_by_global_norm-rule4-clip_3_4_to_1]
# baseline.jax-segment-sum: plain jax.ops.segment_sum / segment_max clipping under jax.jit
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([3.0, 4.0]).astype(np.float32)]
segments = None
num_systems = None
threshold = 1.0
norm_type = 2.0
nonfinite = 'propagate'

try:
  impl = registry.load('baseline.jax-segment-sum')
  out, norms = calling.call(impl, 'clip_by_global_norm', leaves, threshold)
  print(out, norms)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 4): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('baseline.jax-segment-sum'), 'clip_by_global_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=4)
assert problem is None, problem
