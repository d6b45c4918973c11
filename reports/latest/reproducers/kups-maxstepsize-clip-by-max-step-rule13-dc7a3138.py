# case: conformance/test_bad_input.py::test_rule13_bad_segments_raise_value_error_naming_the_leaf[kups.MaxStepSize-clip_by_max_step-rule13-segments_wrong_length]
# kups.MaxStepSize: kups.relaxation.transforms.MaxStepSize(max_step_size).update with Index.integer(segments[i], n=num_systems) per leaf (None without segments)
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([2.040919065475464, -2.5556650161743164, 0.4180988371372223, -0.5677695870399475, -0.4526492953300476, -0.21559716761112213, -2.019986152648926, -0.2319323718547821, -0.8652130961418152, 3.3229994773864746, 0.22578661143779755, -0.3526307940483093, -0.28128743171691895, -0.6680463552474976, -1.0551505088806152, -0.39080098271369934, 0.4819453954696655, -0.23855361342430115]).reshape((6, 3)).astype(np.float32)]
segments = [np.array([0, 1, 0, 2, 1], dtype=np.int64)]
num_systems = 3
threshold = 1.0
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

# What SPEC.md expects (rule 13): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('kups.MaxStepSize'), 'clip_by_max_step', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=13)
assert problem is None, problem
