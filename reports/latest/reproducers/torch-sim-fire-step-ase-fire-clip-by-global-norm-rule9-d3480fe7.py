# case: conformance/test_bad_input.py::test_rule9_non_float_leaf_raises_type_error[torch_sim.fire_step.ase_fire-clip_by_global_norm-rule9-integer_leaf]
# torch_sim.fire_step.ase_fire: torch_sim fire_step(max_step, fire_flavor='ase_fire'), first step with dt=1 on a SimState of many systems: scale max/(norm+eps) when norm > max
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([2.040919065475464, -2.5556650161743164, 0.4180988371372223, -0.5677695870399475, -0.4526492953300476, -0.21559716761112213, -2.019986152648926, -0.2319323718547821, -0.8652130961418152, 3.3229994773864746, 0.22578661143779755, -0.3526307940483093, -0.28128743171691895, -0.6680463552474976, -1.0551505088806152, -0.39080098271369934, 0.4819453954696655, -0.23855361342430115]).reshape((6, 3)).astype(np.float32), np.array([[1, 2, 3]], dtype=np.int32)]
segments = [np.array([0, 1, 0, 2, 1, 2], dtype=np.int64), np.array([0], dtype=np.int64)]
num_systems = 3
threshold = 1.0
norm_type = 2.0
nonfinite = 'propagate'

# The call as torch_sim.fire_step.ase_fire's users write it:
try:
  import torch, torch_sim as ts
  from clipbench.impls.adapters.torch_sim_adapter import TorchSimAseFire
  # the SimState, the stub model and the atom layout: TorchSimAseFire.clip_by_global_norm
  out, _ = TorchSimAseFire().clip_by_global_norm([torch.from_numpy(x) for x in leaves], threshold, segments=None if segments is None else [torch.from_numpy(s) for s in segments], num_systems=num_systems)
  print(out)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 9): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('torch_sim.fire_step.ase_fire'), 'clip_by_global_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=9)
assert problem is None, problem
