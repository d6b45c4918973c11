# case: conformance/test_rules.py::test_rule8_empty_inputs_are_valid[ase.LBFGS.maxstep-clip_by_max_step-rule8-no_leaves]
# ase.LBFGS.maxstep: ase.optimize.LBFGS(atoms, maxstep).determine_step on one Atoms: scale the whole step by maxstep/longest atom when longest >= maxstep
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

# The call as ase.LBFGS.maxstep's users write it:
try:
  from ase import Atoms
  from ase.optimize import LBFGS
  vectors = [x.reshape(-1, x.shape[-1] if x.ndim > 1 else 1) for x in leaves]
  dr = np.concatenate([np.pad(v, ((0, 0), (0, 3 - v.shape[1]))) for v in vectors] + [np.zeros((0, 3))]).ravel()  # short vectors padded with zeros
  atoms = Atoms(symbols=['X'] * (dr.size // 3), positions=np.zeros((dr.size // 3, 3)))
  opt = LBFGS(atoms, maxstep=threshold, logfile=None)
  print(opt.determine_step(dr))
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 8): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('ase.LBFGS.maxstep'), 'clip_by_max_step', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=8)
assert problem is None, problem
