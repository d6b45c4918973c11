"""Adapters: ASE's optimizers' max-step rules (``ase.optimize``), one system per call.

ASE moves the atoms of one ``ase.Atoms`` object, so each call is one system (no ``segments``)
and the step is float64, as ASE's positions always are. Library code called, as ASE 3.29's own
``step()`` methods call it::

  opt = BFGS(atoms, maxstep=c)                 # or LBFGS(atoms, maxstep=c)
  dpos = opt.determine_step(dpos, opt.optimizable.gradient_norm(dpos))   # BFGS.step()
  dr = opt.determine_step(dr)                                            # LBFGS.step()

  atoms.calc = SinglePointCalculator(atoms, forces=step, energy=0.0)     # FIRE
  FIRE(atoms, dt=1.0, maxstep=c).step()        # first step: vel = 0 + dt*f, dr = dt*vel

Rules (ASE 3.29, ``ase/optimize/{bfgs,lbfgs,fire}.py``)::

  BFGS, LBFGS: L = max over atoms of |dr_atom| (``OptimizableAtoms.gradient_norm``:
               ``np.linalg.norm(dr.reshape(-1, 3), axis=1).max()``);
               if L >= maxstep: dr *= maxstep / L     # ties are scaled (by 1.0), no epsilon
  FIRE:        n = sqrt(vdot(dr, dr)) over the whole step;
               if n > maxstep: dr = maxstep * dr / n  # two roundings per element

So BFGS and LBFGS implement ``clip_by_max_step`` (the longest atom) and FIRE implements
``clip_by_global_norm`` of one system (the whole step's L2 norm). None returns a norm.

Mapping the canonical leaves onto atoms, without changing a number:

* max-step: every row vector (last axis) becomes one atom's displacement; a vector of fewer
  than 3 components is padded with +0.0, which adds exactly nothing to its Euclidean length
  (a 1-D leaf holds 1-vectors, a 0-d leaf one). A vector of more than 3 components has no atom
  to hold it: the adapter raises ``NotImplementedError``.
* FIRE: the elements of every leaf, in order, are the 3N degrees of freedom, padded with +0.0 to
  a multiple of 3 (the zeros come last in the sum, so the norm is unchanged).
* FIRE's positions start at -0.0, the additive identity of IEEE arithmetic, so the positions
  after the step are the step itself, bit for bit; the forces are given to ASE through its
  ``SinglePointCalculator``, as a user replaying forces would.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import numpy as np

import ase
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.optimize import BFGS, FIRE, LBFGS

from clipbench.impls.adapters import _common
from clipbench.protocol import Capabilities

_ATOM_DIM = 3

# One system per call, L2 only (FIRE) or the step norm (BFGS/LBFGS), float64 only: ASE holds
# positions and steps in float64, so no other dtype reaches these lines in ASE's own use.
# Only the fields where ASE differs from the defaults (global, L2, propagate, functional, CPU).
_CAPABILITIES = Capabilities(dtypes=("float64",), returns_norm=False, mixed_dtypes=False)


def _refuse_options(segments: Any, num_systems: Any, nonfinite: str, library: str) -> None:
  """Refuses what one ASE ``Atoms`` cannot express (the adapter's refusal, not a check)."""
  if segments is not None or num_systems not in (None, 1):
    raise NotImplementedError(
        f"segments: {library} optimizes one Atoms object (one system) per call")
  _common.require_mode(nonfinite, ("propagate",), library)


def _atoms(num_atoms: int) -> Atoms:
  """A real ``Atoms`` of ``num_atoms`` dummy atoms at -0.0 (see the module docstring)."""
  return Atoms(symbols=["X"] * num_atoms, positions=np.full((num_atoms, _ATOM_DIM), -0.0))


def _rows_as_atoms(leaves: Sequence[np.ndarray]) -> tuple[np.ndarray, list[tuple[int, ...]]]:
  """The row vectors of every leaf as (N, 3) atom displacements, zero-padded; and the shapes."""
  shapes, blocks = [], []
  for i, leaf in enumerate(leaves):
    leaf = np.asarray(leaf)
    dim = leaf.shape[-1] if leaf.ndim >= 2 else 1
    if dim > _ATOM_DIM:
      raise NotImplementedError(
          f"leaves[{i}]: ASE moves atoms in 3-D; a vector of {dim} components (shape "
          f"{leaf.shape}) is no atom's displacement")
    vectors = leaf.reshape(-1, dim)
    block = np.zeros((vectors.shape[0], _ATOM_DIM), dtype=leaf.dtype)
    block[:, :dim] = vectors
    shapes.append(leaf.shape)
    blocks.append(block)
  rows = np.concatenate(blocks) if blocks else np.zeros((0, _ATOM_DIM))
  return rows, shapes


def _atoms_as_rows(rows: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
  """Inverse of :func:`_rows_as_atoms`: drops the padding and restores each leaf's shape."""
  out, start = [], 0
  for shape in shapes:
    dim = shape[-1] if len(shape) >= 2 else 1
    count = math.prod(shape) // dim if dim else 0
    out.append(rows[start:start + count, :dim].reshape(shape).copy())
    start += count
  return out


class AseLongestAtom:
  """``BFGS`` / ``LBFGS`` ``determine_step`` on the flat step of a real ``Atoms`` object."""

  framework = "numpy"
  library = "ase"
  version = ase.__version__
  capabilities = _CAPABILITIES

  def __init__(self, optimizer: type):
    self.optimizer = optimizer
    self.name = f"ase.{optimizer.__name__}.maxstep"
    self.description = (
        f"ase.optimize.{optimizer.__name__}(atoms, maxstep).determine_step on one Atoms: "
        "scale the whole step by maxstep/longest atom when longest >= maxstep")
    call = ("opt.determine_step(dr, opt.optimizable.gradient_norm(dr))"
            if optimizer is BFGS else "opt.determine_step(dr)")
    # The library call a bug report would show (the suite's reproducer appends it).
    self.reproducer = (
        f"from ase import Atoms\nfrom ase.optimize import {optimizer.__name__}\n"
        "vectors = [x.reshape(-1, x.shape[-1] if x.ndim > 1 else 1) for x in leaves]\n"
        "dr = np.concatenate([np.pad(v, ((0, 0), (0, 3 - v.shape[1]))) for v in vectors]"
        " + [np.zeros((0, 3))]).ravel()  # short vectors padded with zeros\n"
        "atoms = Atoms(symbols=['X'] * (dr.size // 3), positions=np.zeros((dr.size // 3, 3)))\n"
        f"opt = {optimizer.__name__}(atoms, maxstep=threshold, logfile=None)\n"
        f"print({call})")

  def clip_by_max_step(self, leaves: Sequence[np.ndarray], max_step: float, *,
                       segments: Sequence[Any] | None = None, num_systems: int | None = None,
                       nonfinite: str = "propagate") -> tuple[list[np.ndarray], None]:
    _refuse_options(segments, num_systems, nonfinite, f"ase {self.optimizer.__name__}")
    rows, shapes = _rows_as_atoms(leaves)
    with warnings.catch_warnings():
      # ASE warns about a maxstep above 1 Angstrom; the suite's thresholds are not lengths.
      warnings.simplefilter("ignore", UserWarning)
      opt = self.optimizer(_atoms(rows.shape[0]), maxstep=max_step, logfile=None)
    step = rows.ravel()  # a new array (the leaves are never touched): ASE scales it in place
    if self.optimizer is BFGS:
      step = opt.determine_step(step, opt.optimizable.gradient_norm(step))
    else:
      step = opt.determine_step(step)
    return _atoms_as_rows(step.reshape(-1, _ATOM_DIM), shapes), None


class AseFireWholeStep:
  """``FIRE(atoms, dt=1, maxstep).step()`` on a real ``Atoms`` whose forces are the step."""

  framework = "numpy"
  library = "ase"
  version = ase.__version__
  name = "ase.FIRE.maxstep"
  capabilities = _CAPABILITIES
  description = ("ase.optimize.FIRE(atoms, dt=1.0, maxstep).step() with the step as forces "
                 "(first step: dr = f); rescale by maxstep/|dr| when |dr| > maxstep")
  # The library call a bug report would show (the suite's reproducer appends it).
  reproducer = (
      "from ase import Atoms\nfrom ase.calculators.singlepoint import SinglePointCalculator\n"
      "from ase.optimize import FIRE\n"
      "flat = np.concatenate([x.ravel() for x in leaves] + [np.zeros(0)])\n"
      "f = np.concatenate([flat, np.zeros(-flat.size % 3)]).reshape(-1, 3)\n"
      "atoms = Atoms(symbols=['X'] * len(f), positions=np.full(f.shape, -0.0))\n"
      "atoms.calc = SinglePointCalculator(atoms, forces=f, energy=0.0)\n"
      "FIRE(atoms, dt=1.0, maxstep=threshold, logfile=None).step()\n"
      "print(atoms.get_positions())")

  def clip_by_global_norm(self, leaves: Sequence[np.ndarray], max_norm: float, *,
                          segments: Sequence[Any] | None = None, num_systems: int | None = None,
                          norm_type: float = 2.0,
                          nonfinite: str = "propagate") -> tuple[list[np.ndarray], None]:
    _refuse_options(segments, num_systems, nonfinite, "ase FIRE")
    _common.require_l2(norm_type, "ase FIRE")
    arrays = [np.asarray(x) for x in leaves]
    flat = np.concatenate([x.ravel() for x in arrays]) if arrays else np.zeros(0)
    padded = np.zeros(-(-flat.size // _ATOM_DIM) * _ATOM_DIM, dtype=np.float64)
    padded[:flat.size] = flat
    forces = padded.reshape(-1, _ATOM_DIM)
    atoms = _atoms(forces.shape[0])
    atoms.calc = SinglePointCalculator(atoms, forces=forces, energy=0.0)
    FIRE(atoms, dt=1.0, maxstep=max_norm, logfile=None).step()
    step = atoms.get_positions().ravel()
    out, start = [], 0
    for x in arrays:
      out.append(step[start:start + x.size].reshape(x.shape).astype(x.dtype))
      start += x.size
    return out, None


bfgs_max_step = AseLongestAtom(BFGS)
lbfgs_max_step = AseLongestAtom(LBFGS)
fire_max_step = AseFireWholeStep()
