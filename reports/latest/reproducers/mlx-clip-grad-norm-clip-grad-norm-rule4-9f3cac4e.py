# case: conformance/test_rules.py::test_rule4_random_batches_strict_bound[mlx.clip_grad_norm-clip_grad_norm-rule4-hypothesis_float32]
# mlx.clip_grad_norm: mlx.optimizers.clip_grad_norm(grads, max_norm) on the CPU: scale min(max/(norm+1e-6), 1), float16 squares summed in float32
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([0.0, 50813759488.0, 0.0, -99110559744.0, 524168658944.0, 89921740800.0]).reshape((2, 3)).astype(np.float32), np.array([-2.7186801304966933e+35]).astype(np.float32)]
segments = None
num_systems = None
threshold = 1.0
norm_type = 2.0
nonfinite = 'propagate'

# The call as mlx.clip_grad_norm's users write it:
try:
  import mlx.core as mx
  from mlx.optimizers import clip_grad_norm
  grads = [mx.array(x, dtype=mx.float64) if x.dtype == np.float64 else mx.array(x) for x in leaves]
  out, norm = clip_grad_norm(grads, threshold)
  print(out, norm)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 4): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('mlx.clip_grad_norm'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=4)
assert problem is None, problem
