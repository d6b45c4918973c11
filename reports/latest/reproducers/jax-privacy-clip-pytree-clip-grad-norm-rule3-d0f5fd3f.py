# case: conformance/test_rules.py::test_rule3_random_batches_below_threshold_unchanged[jax_privacy.clip_pytree-clip_grad_norm-rule3-hypothesis_float16]
# jax_privacy.clip_pytree: jax_privacy.clipping.clip_pytree(leaves, clip_norm, nan_safe=True)
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([14.8046875, 0.0, -75.0625, 0.0, 87.6875, 8.8671875]).astype(np.float16), np.array([-423.0, 124.1875, -32.6875, -48.3125, 165.625]).astype(np.float16)]
segments = None
num_systems = None
threshold = 7.603954968866706e+37
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

# What SPEC.md expects (rule 3): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('jax_privacy.clip_pytree'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=3)
assert problem is None, problem
