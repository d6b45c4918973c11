# case: conformance/test_rules.py::test_rule7_nonfinite_input_stays_in_its_system[torch.clip_grads_with_norm_-clip_grad_norm-rule7-posinf_global]
# torch.clip_grads_with_norm_: torch.nn.utils.get_total_norm(grads) + clip_grads_with_norm_(params, max, norm) (defaults: foreach=None, error_if_nonfinite=False; in place)
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

# The call as torch.clip_grads_with_norm_'s users write it:
try:
  import torch
  torch.set_printoptions(precision=10)
  grads = [torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16) if x.dtype.name == 'bfloat16' else torch.from_numpy(x.copy()) for x in leaves]
  params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
  for p, g in zip(params, grads):
    p.grad = g
  norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=norm_type)
  torch.nn.utils.clip_grads_with_norm_(params, threshold, norm)
  print([p.grad for p in params], norm)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 7): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('torch.clip_grads_with_norm_'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=7)
assert problem is None, problem
