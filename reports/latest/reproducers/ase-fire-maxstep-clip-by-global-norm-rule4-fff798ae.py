# case: conformance/test_rules.py::test_rule4_random_batches_strict_bound[ase.FIRE.maxstep-clip_by_global_norm-rule4-hypothesis_float64]
# ase.FIRE.maxstep: ase.optimize.FIRE(atoms, dt=1.0, maxstep).step() with the step as forces (first step: dr = f); rescale by maxstep/|dr| when |dr| > maxstep
import math
import ml_dtypes
import numpy as np

from clipbench.conformance.reproducer import departure_from_reference
from clipbench.impls import calling, registry

leaves = [np.array([1.4655590336614065e-227, -2.337474968473805e-228, -6.660363015442375e-228, -8.534214225178047e-229, 0.0, -9.372812891342225e-229]).reshape((2, 3)).astype(np.float64), np.array([0.0, 0.0, -1.2836212153316685e+96, 5.02779944440012e+97, 1.4308978112487235e+97, 0.0, -2.8487822954283617e+97, 0.0, 0.0, -3.0635347780199904e+97, -2.5436055787226886e+97, 5.486016427643247e+96, 6.349434459088787e+97, 3.0087269060689932e+97, -8.287008542086866e+97]).reshape((5, 3)).astype(np.float64), np.array([-0.0, 0.0, -1e-323, -2e-323, -0.0, 1.5e-323, 0.0, 0.0, -1.5e-323, -5e-324, 5e-324, 1e-323]).reshape((3, 2, 2)).astype(np.float64)]
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

# What SPEC.md expects (rule 4): the same call through clipbench, checked
# against the exact reference. Fails while the deviation stands.
problem = departure_from_reference(registry.load('ase.FIRE.maxstep'), 'clip_by_global_norm', leaves, threshold, segments=segments, num_systems=num_systems, norm_type=norm_type, nonfinite=nonfinite, rule=4)
assert problem is None, problem
