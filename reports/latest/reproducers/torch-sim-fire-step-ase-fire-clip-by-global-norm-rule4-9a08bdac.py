# case: conformance/test_rules.py::test_rule4_random_batches_strict_bound[torch_sim.fire_step.ase_fire-clip_by_global_norm-rule4-hypothesis_float32]
# torch_sim.fire_step.ase_fire: torch_sim fire_step(max_step, fire_flavor='ase_fire'), first step with dt=1 on a SimState of many systems: scale max/(norm+eps) when norm > max
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

# The call as torch_sim.fire_step.ase_fire's users write it:
try:
  import torch, torch_sim as ts
  from clipbench.impls.adapters.torch_sim_adapter import TorchSimAseFire
  # the SimState, the stub model and the atom layout: TorchSimAseFire.clip_by_global_norm
  out, _ = TorchSimAseFire().clip_by_global_norm([torch.from_numpy(x) for x in leaves], threshold, segments=None if segments is None else [torch.from_numpy(s) for s in segments], num_systems=num_systems)
  print(out)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 4): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('torch_sim.fire_step.ase_fire'), 'clip_by_global_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=4)
assert problem is None, problem
