# case: conformance/test_rules.py::test_rule3_random_batches_below_threshold_unchanged[mlx.clip_grad_norm-clip_grad_norm-rule3-hypothesis_bfloat16]
# mlx.clip_grad_norm: mlx.optimizers.clip_grad_norm(grads, max_norm) on the CPU: scale min(max/(norm+1e-6), 1), float16 squares summed in float32
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([-8.752622934009915e+26, -1.431368170423721e+27, -4.932417344027687e+26, 3.501049173603966e+27]).astype(ml_dtypes.bfloat16), np.array([843055104.0]).astype(ml_dtypes.bfloat16)]
segments = None
num_systems = None
threshold = math.inf
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

# What SPEC.md expects (rule 3): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('mlx.clip_grad_norm'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=3)
assert problem is None, problem
