# case: conformance/test_rules.py::test_rule3_random_batches_below_threshold_unchanged[declearn.L2GlobalClipping.torch-clip_grad_norm-rule3-hypothesis_float16]
# declearn.L2GlobalClipping.torch: declearn L2GlobalClipping on a TorchVector: scale min((norm/max)**-1, 1), norm = (sum of per-leaf sums of squares) ** 0.5; no norm returned
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([]).reshape((0, 3)).astype(np.float16)]
segments = None
num_systems = None
threshold = 1.401298464324817e-45
norm_type = 2.0
nonfinite = 'propagate'

# The call as declearn.L2GlobalClipping.torch's users write it:
try:
  import torch
  from declearn.model.torch import TorchVector
  from declearn.optimizer.modules import L2GlobalClipping
  vector = TorchVector({f'leaf{i}': torch.from_numpy(x.copy()) for i, x in enumerate(leaves)})
  print(L2GlobalClipping(threshold).run(vector).coefs)
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 3): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('declearn.L2GlobalClipping.torch'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=3)
assert problem is None, problem
