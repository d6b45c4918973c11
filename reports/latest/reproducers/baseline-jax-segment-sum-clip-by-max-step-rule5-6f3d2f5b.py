# case: conformance/test_rules.py::test_rule5_random_batches_norm_accuracy[baseline.jax-segment-sum-clip_by_max_step-rule5-hypothesis_float32]
# baseline.jax-segment-sum: plain jax.ops.segment_sum / segment_max clipping under jax.jit
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([2.0405652185559413e-39, -3.2545717353329606e-40, -9.273526990193418e-40, -1.1882590587935151e-40, 0.0, -1.3050152468410589e-40]).reshape((2, 3)).astype(np.float32), np.array([-0.11414668709039688]).astype(np.float32)]
segments = [np.array([0, 0], dtype=np.int64), np.array([0], dtype=np.int64)]
num_systems = 1
threshold = np.array([1.0]).astype(np.float64)
norm_type = 2.0
nonfinite = 'propagate'

try:
  impl = registry.load('baseline.jax-segment-sum')
  out, norms = calling.call(impl, 'clip_by_max_step', leaves, threshold, segments=segments, num_systems=num_systems)
  print(out, norms)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 5): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('baseline.jax-segment-sum'), 'clip_by_max_step', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=5)
assert problem is None, problem
