# case: conformance/test_rules.py::test_rule4_random_batches_strict_bound[jax_privacy.clip_pytree-clip_grad_norm-rule4-hypothesis_float32]
# jax_privacy.clip_pytree: jax_privacy.clipping.clip_pytree(leaves, clip_norm, nan_safe=True)
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
nonfinite = 'zero'

# The call as jax_privacy.clip_pytree's users write it:
try:
  import jax.numpy as jnp
  from jax_privacy import clipping
  out, norm = clipping.clip_pytree([jnp.asarray(x) for x in leaves], threshold, nan_safe=True)
  print(out, norm)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 4): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('jax_privacy.clip_pytree'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=4)
assert problem is None, problem
