# case: conformance/test_rules.py::test_rule7_nonfinite_input_stays_in_its_system[optax.per_example_global_norm_clip-clip_by_global_norm-rule7-posinf_global]
# optax.per_example_global_norm_clip: optax.per_example_global_norm_clip(grads, c_k) per system on a batch of one example (the sum over examples has one term)
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([np.inf, 1.0]).astype(np.float32)]
segments = None
num_systems = None
threshold = 1.0
norm_type = 2.0
nonfinite = 'propagate'

# The call as optax.per_example_global_norm_clip's users write it:
try:
  import jax.numpy as jnp
  import optax
  rows = [np.arange(len(x)) if segments is None else np.flatnonzero(s == 0) for x, s in zip(leaves, segments or [None] * len(leaves))]
  example = [jnp.asarray(x)[r][None] for x, r in zip(leaves, rows)]
  c = threshold[0] if np.ndim(threshold) else threshold
  out, num_clipped = optax.per_example_global_norm_clip(example, c)
  print(out)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 7): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('optax.per_example_global_norm_clip'), 'clip_by_global_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=7)
assert problem is None, problem
