# case: conformance/test_bad_input.py::test_rule10_p_below_one_or_nan_raises_value_error[deepspeed.clip_grad_norm_-clip_grad_norm-rule10-norm_type_0]
# deepspeed.clip_grad_norm_: deepspeed.runtime.utils.clip_grad_norm_ on the .grad of parameters, one gloo process (in place; min(1, max/(norm+1e-6)); float32 norm of norms)
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([2.040919065475464, -2.5556650161743164, 0.4180988371372223, -0.5677695870399475, -0.4526492953300476, -0.21559716761112213, -2.019986152648926, -0.2319323718547821, -0.8652130961418152, 3.3229994773864746, 0.22578661143779755, -0.3526307940483093, -0.28128743171691895, -0.6680463552474976, -1.0551505088806152, -0.39080098271369934, 0.4819453954696655, -0.23855361342430115]).astype(np.float32)]
segments = None
num_systems = None
threshold = 1.0
norm_type = 0.0
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

# What SPEC.md expects (rule 10): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('deepspeed.clip_grad_norm_'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=10)
assert problem is None, problem
