# case: conformance/test_rules.py::test_rule5_random_batches_norm_accuracy[kups.MaxStepSize-clip_by_max_step-rule5-hypothesis_float16]
# kups.MaxStepSize: kups.relaxation.transforms.MaxStepSize(max_step_size).update with Index.integer(segments[i], n=num_systems) per leaf (None without segments)
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = []
segments = []
num_systems = 0
threshold = 1.401298464324817e-45
norm_type = 2.0
nonfinite = 'propagate'

# The call as kups.MaxStepSize's users write it:
try:
  import jax.numpy as jnp
  from kups.core.data.index import Index
  from kups.relaxation import transforms
  updates = [jnp.asarray(x) for x in leaves]
  prefix = None if segments is None else [Index.integer(s, n=num_systems) for s in segments]
  opt = transforms.MaxStepSize(max_step_size=threshold)
  out, _ = opt.update(updates, opt.init(updates, prefix))
  print(out)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 5): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('kups.MaxStepSize'), 'clip_by_max_step', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=5)
assert problem is None, problem
