# case: conformance/test_rules.py::test_rule6_threshold_zero_and_inf[optax.clip_by_global_norm-clip_grad_norm-rule6-tie_zero_zero]
# optax.clip_by_global_norm: optax.clip_by_global_norm(max_norm).update(leaves, init(leaves))
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([0.0, 0.0]).astype(np.float32)]
segments = None
num_systems = None
threshold = 0.0
norm_type = 2.0
nonfinite = 'propagate'

# The call as optax.clip_by_global_norm's users write it:
try:
  import jax.numpy as jnp
  import optax
  updates = [jnp.asarray(x) for x in leaves]
  tx = optax.clip_by_global_norm(threshold)
  out, _ = tx.update(updates, tx.init(updates))
  print(out)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 6): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('optax.clip_by_global_norm'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=6)
assert problem is None, problem
