# case: conformance/test_rules.py::test_rule6_threshold_zero_and_inf[deepspeed.clip_grad_norm_-clip_grad_norm-rule6-max_inf_huge_values]
# deepspeed.clip_grad_norm_: deepspeed.runtime.utils.clip_grad_norm_ on the .grad of parameters, one gloo process (in place; min(1, max/(norm+1e-6)); float32 norm of norms)
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

# The call as deepspeed.clip_grad_norm_'s users write it:
try:
  import torch
  torch.set_printoptions(precision=10)
  grads = [torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16) if x.dtype.name == 'bfloat16' else torch.from_numpy(x.copy()) for x in leaves]
  import os, tempfile
  os.environ.setdefault('DS_ACCELERATOR', 'cpu')
  import deepspeed
  from deepspeed.runtime.utils import clip_grad_norm_
  deepspeed.init_distributed(dist_backend='gloo', auto_mpi_discovery=False, init_method='file://' + tempfile.mkdtemp() + '/rendezvous', rank=0, world_size=1)
  params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
  for p, g in zip(params, grads):
    p.grad = g
  norm = clip_grad_norm_(params, threshold, norm_type=norm_type)
  print([p.grad for p in params], norm)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 6): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('deepspeed.clip_grad_norm_'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=6)
assert problem is None, problem
