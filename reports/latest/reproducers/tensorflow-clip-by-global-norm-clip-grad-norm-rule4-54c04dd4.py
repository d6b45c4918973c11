# case: conformance/test_rules.py::test_rule4_random_batches_strict_bound[tensorflow.clip_by_global_norm-clip_grad_norm-rule4-hypothesis_float64]
# tensorflow.clip_by_global_norm: tf.clip_by_global_norm(t_list, clip_norm): scale clip_norm*min(1/norm, 1/clip_norm) + (norm-norm), norm in the leaf dtype
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([0.0, 3.89359303843037e+64, 0.0, -7.594324592733205e+64, 4.0164307341069704e+65, 6.890233529453685e+64]).reshape((2, 3)).astype(np.float64), np.array([-1.4362638153726089e+305]).astype(np.float64)]
segments = None
num_systems = None
threshold = 1.0
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

# What SPEC.md expects (rule 4): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('tensorflow.clip_by_global_norm'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=4)
assert problem is None, problem
