# case: conformance/test_rules.py::test_rule5_norm_accuracy_without_overflow_or_underflow[jax_privacy.clip_pytree.nan_unsafe-clip_grad_norm-rule5-float16_300]
# jax_privacy.clip_pytree.nan_unsafe: jax_privacy.clipping.clip_pytree(leaves, clip_norm, nan_safe=False)
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([300.0, 400.0]).astype(np.float16)]
segments = None
num_systems = None
threshold = 1.0
norm_type = 2.0
nonfinite = 'propagate'

# The call as jax_privacy.clip_pytree.nan_unsafe's users write it:
try:
  import jax.numpy as jnp
  from jax_privacy import clipping
  out, norm = clipping.clip_pytree([jnp.asarray(x) for x in leaves], threshold, nan_safe=False)
  print(out, norm)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 5): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('jax_privacy.clip_pytree.nan_unsafe'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=5)
assert problem is None, problem
