# case: conformance/test_rules.py::test_rule6_threshold_zero_and_inf[brainstate.clip_grad_norm-clip_grad_norm-rule6-max_inf_huge_values]
# brainstate.clip_grad_norm: brainstate.nn.clip_grad_norm(leaves, max_norm, norm_type=p, return_norm=True)
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([3.0000000054977558e+38, 3.0000000054977558e+38]).astype(np.float32)]
segments = None
num_systems = None
threshold = math.inf
norm_type = 2.0
nonfinite = 'propagate'

# The call as brainstate.clip_grad_norm's users write it:
try:
  import brainstate
  import jax.numpy as jnp
  out, norm = brainstate.nn.clip_grad_norm([jnp.asarray(x) for x in leaves], threshold, norm_type=norm_type, return_norm=True)
  print(out, norm)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 6): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('brainstate.clip_grad_norm'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=6)
assert problem is None, problem
