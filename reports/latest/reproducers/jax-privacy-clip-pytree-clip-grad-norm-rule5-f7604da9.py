# case: conformance/test_rules.py::test_rule5_random_batches_norm_accuracy[jax_privacy.clip_pytree-clip_grad_norm-rule5-hypothesis_float32]
# jax_privacy.clip_pytree: jax_privacy.clipping.clip_pytree(leaves, clip_norm, nan_safe=True)
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([-36587642880.0]).astype(np.float32), np.array([1.1296573866647414e-27, 4.4749675592617404e-27]).astype(np.float32), np.array([5.815981632096022e+20, 4.577506512005413e+20, 8.506715635526192e+19]).astype(np.float32)]
segments = None
num_systems = None
threshold = 0.0
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

# What SPEC.md expects (rule 5): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('jax_privacy.clip_pytree'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=5)
assert problem is None, problem
