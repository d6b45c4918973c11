# case: conformance/test_rules.py::test_rule8_empty_inputs_are_valid[deepspeed.clip_tensors_by_global_norm-clip_grad_norm-rule8-no_leaves]
# deepspeed.clip_tensors_by_global_norm: deepspeed.runtime.utils.clip_tensors_by_global_norm (in place; L2; scaled by max/(norm+1e-6) only when below 1; a non-finite norm returned as -1)
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = []
segments = None
num_systems = None
threshold = 1.0
norm_type = 2.0
nonfinite = 'propagate'

# The call as deepspeed.clip_tensors_by_global_norm's users write it:
try:
  import torch
  torch.set_printoptions(precision=10)
  grads = [torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16) if x.dtype.name == 'bfloat16' else torch.from_numpy(x.copy()) for x in leaves]
  import os
  os.environ.setdefault('DS_ACCELERATOR', 'cpu')
  from deepspeed.runtime.utils import clip_tensors_by_global_norm
  norm = clip_tensors_by_global_norm(grads, threshold)
  print(grads, norm)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 8): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('deepspeed.clip_tensors_by_global_norm'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=8)
assert problem is None, problem
