# case: conformance/test_rules.py::test_rule5_random_batches_norm_accuracy[ase.FIRE.maxstep-clip_by_global_norm-rule5-hypothesis_float64]
# ase.FIRE.maxstep: ase.optimize.FIRE(atoms, dt=1.0, maxstep).step() with the step as forces (first step: dr = f); rescale by maxstep/|dr| when |dr| > maxstep
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([0.0, 3.89359303843037e+64, 0.0, -7.594324592733205e+64, 4.0164307341069704e+65, 6.890233529453685e+64]).reshape((2, 3)).astype(np.float64), np.array([-1.4362638153726089e+305]).astype(np.float64)]
segments = None
num_systems = None
threshold = 1.0
norm_type = 2.0
nonfinite = 'propagate'

# The call as ase.FIRE.maxstep's users write it:
try:
  from ase import Atoms
  from ase.calculators.singlepoint import SinglePointCalculator
  from ase.optimize import FIRE
  flat = np.concatenate([x.ravel() for x in leaves] + [np.zeros(0)])
  f = np.concatenate([flat, np.zeros(-flat.size % 3)]).reshape(-1, 3)
  atoms = Atoms(symbols=['X'] * len(f), positions=np.full(f.shape, -0.0))
  atoms.calc = SinglePointCalculator(atoms, forces=f, energy=0.0)
  FIRE(atoms, dt=1.0, maxstep=threshold, logfile=None).step()
  print(atoms.get_positions())
except Exception as e:  # pylint: disable=broad-except
  print(type(e).__name__, e)

# What SPEC.md expects (rule 5): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('ase.FIRE.maxstep'), 'clip_by_global_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=5)
assert problem is None, problem
