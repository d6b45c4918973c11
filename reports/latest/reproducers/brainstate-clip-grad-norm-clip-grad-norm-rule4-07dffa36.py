# case: conformance/test_rules.py::test_rule4_random_batches_strict_bound[brainstate.clip_grad_norm-clip_grad_norm-rule4-hypothesis_float16]
# brainstate.clip_grad_norm: brainstate.nn.clip_grad_norm(leaves, max_norm, norm_type=p, return_norm=True)
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([-1.1622905731201172e-05, -4.172325134277344e-07, -6.258487701416016e-06, -4.76837158203125e-06]).reshape((1, 2, 2)).astype(np.float16), np.array([-0.49853515625, -0.07989501953125, -0.251953125, -0.9794921875, -0.169189453125, 0.54248046875, -0.468505859375, 0.494140625, -0.214111328125, -0.29345703125, 1.4091796875, -0.042205810546875, 0.1907958984375, 0.0100555419921875, -0.360107421875, -0.221435546875, 0.07867431640625, 0.533203125, -0.0257415771484375, -1.0498046875, -0.499267578125, 1.16796875, -0.1749267578125, 0.472412109375]).reshape((6, 2, 2)).astype(np.float16)]
segments = None
num_systems = None
threshold = 1.0
norm_type = 1.0
nonfinite = 'propagate'

# The call as brainstate.clip_grad_norm's users write it:
try:
  import brainstate
  import jax.numpy as jnp
  out, norm = brainstate.nn.clip_grad_norm([jnp.asarray(x) for x in leaves], threshold, norm_type=norm_type, return_norm=True)
  print(out, norm)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 4): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('brainstate.clip_grad_norm'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=4)
assert problem is None, problem
