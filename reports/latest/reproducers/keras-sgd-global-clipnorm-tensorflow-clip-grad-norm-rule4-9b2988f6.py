# case: conformance/test_rules.py::test_rule4_random_batches_strict_bound[keras.SGD.global_clipnorm.tensorflow-clip_grad_norm-rule4-hypothesis_float32]
# keras.SGD.global_clipnorm.tensorflow: keras.optimizers.SGD(learning_rate=1.0, global_clipnorm=c).apply_gradients on the tensorflow backend: scale c*min(1/n, 1/c) + (n-n), no epsilon
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([-36587642880.0]).astype(np.float32), np.array([1.1296573866647414e-27, 4.4749675592617404e-27]).astype(np.float32), np.array([5.815981632096022e+20, 4.577506512005413e+20, 8.506715635526192e+19]).astype(np.float32)]
segments = None
num_systems = None
threshold = 0.0
norm_type = 2.0
nonfinite = 'propagate'

# The call as keras.SGD.global_clipnorm.tensorflow's users write it:
try:
  import os
  os.environ['KERAS_BACKEND'] = 'tensorflow'
  from clipbench.impls import frameworks
  frameworks.import_tensorflow()  # triton first: importing it after tensorflow crashes
  import keras
  grads = [keras.ops.convert_to_tensor(x) for x in leaves]
  variables = [keras.Variable(keras.ops.negative(keras.ops.zeros_like(g)), dtype=g.dtype) for g in grads]
  opt = keras.optimizers.SGD(learning_rate=1.0, global_clipnorm=threshold)
  opt.apply_gradients(zip(grads, variables))
  print([-keras.ops.convert_to_numpy(v) for v in variables])
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 4): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('keras.SGD.global_clipnorm.tensorflow'), 'clip_grad_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=4)
assert problem is None, problem
