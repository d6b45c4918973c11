# case: conformance/test_rules.py::test_rule3_random_batches_below_threshold_unchanged[tensorflow.clip_by_global_norm-clip_grad_norm-rule3-hypothesis_float64]
# tensorflow.clip_by_global_norm: tf.clip_by_global_norm(t_list, clip_norm): scale clip_norm*min(1/norm, 1/clip_norm) + (norm-norm), norm in the leaf dtype
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([2.8766863694988954e+24, -5.11843987731808e+24, 4.172195341865992e+24, 3.26252774647324e+24, -6.830633179374822e+24]).astype(np.float64)]
segments = None
num_systems = None
threshold = math.inf
norm_type = 2.0
nonfinite = 'propagate'

# The call as tensorflow.clip_by_global_norm's users write it:
try:
  import tensorflow as tf
  t_list = [tf.cast(tf.constant(x.astype(np.float32)), tf.bfloat16) if x.dtype.name == 'bfloat16' else tf.constant(x) for x in leaves]
  out, norm = tf.clip_by_global_norm(t_list, threshold)
  print(out, norm)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 3): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('tensorflow.clip_by_global_norm'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=3)
assert problem is None, problem
