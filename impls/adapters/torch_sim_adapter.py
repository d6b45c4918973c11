"""Adapter: torch-sim's ASE-style FIRE step, per-system whole-step clipping in one batch.

torch-sim (``torch_sim``, the torch-sim-atomistic distribution) relaxes many systems at once in
one ``SimState``. Its ``ase_fire`` flavour of FIRE caps each system's whole step, the rule
ASE's FIRE applies to one system. Library calls, as a torch-sim user writes them::

  state = ts.optimizers.fire_init(sim_state, model, dt_start=1.0, fire_flavor="ase_fire")
  state = ts.optimizers.fire_step(state, model, max_step=c, fire_flavor="ase_fire")

Rule (torch-sim 0.6.2, ``torch_sim/optimizers/fire.py``, ``_ase_fire_step``; first step)::

  v    = nan_to_num(NaN velocities) + f * dt       # first step: v = 0 + f
  dr   = v * dt
  n_k  = sqrt(batched_vdot(dr, dr, system_idx))    # scatter_add of per-atom sums, state dtype
  dr   = where(n_k > max_step, max_step * dr / (n_k + eps), dr)   # eps 1e-8 (float32),
                                                                  # 1e-16 (float64)
  positions = positions + dr

With ``dt_start = 1.0`` (``f * 1`` and ``v * 1`` are exact) the step is the forces, which a stub
model (``ModelInterface``) returns; positions start at -0.0, the additive identity, so the
positions after the step are the clipped step bit for bit. It is ``clip_by_global_norm`` per
system (L2 over the system's whole step). ``max_step`` becomes a tensor of the state dtype
(a float64 threshold is rounded to float32 for a float32 state); a per-system ``max_step``
does not broadcast against the per-atom norms, so the threshold is one float.

Mapping the canonical leaves onto atoms, without changing a number: each row of each leaf (a
0-d leaf is one row) is split into atoms of 3 components, the last padded with +0.0 (which
adds exactly nothing to a sum of squares), every atom in its row's system. torch-sim requires
each system's atoms to be consecutive and numbered without gaps, so the atoms are stably sorted
by system (a system's rows keep their order), the systems that hold rows are renumbered
0..m-1, and the step is scattered back to the rows afterwards. Systems with no rows do not
exist in a ``SimState`` and have nothing to change. Since that mapping is the adapter's, bad
``segments`` are refused by the spec's own check (rule 13 says nothing about torch-sim here).
The cell-filter states (``CellFireState``, whose cell step joins the norm) are not used: the
cell would be a fixed 3x3 leaf per system.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

import torch_sim as ts
from torch_sim.models.interface import ModelInterface

from clipbench.impls.adapters import _common
from clipbench.protocol import Capabilities
from clipbench.reference import validation

_ATOM_DIM = 3
_LIBRARY = "torch-sim fire_step(fire_flavor='ase_fire')"


class _ForcesModel(ModelInterface):
  """A stub model whose forces are fixed (the step to clip) and whose energy is zero."""

  def __init__(self, forces: torch.Tensor, n_systems: int):
    super().__init__()
    self._device = forces.device
    self._dtype = forces.dtype
    self._compute_stress = False
    self._compute_forces = True
    self._forces = forces
    self._n_systems = n_systems

  def forward(self, state: ts.SimState, **kwargs: Any) -> dict[str, torch.Tensor]:
    # A copy each call: torch-sim stores and may update the forces it is given.
    return {"energy": torch.zeros(self._n_systems, dtype=self._dtype, device=self._device),
            "forces": self._forces.clone()}


def _atoms_per_row(leaf: torch.Tensor) -> tuple[int, int, int]:
  """(rows, elements per row, atoms per row) of a leaf; a 0-d leaf is one row."""
  rows = leaf.shape[0] if leaf.dim() else 1
  width = math.prod(leaf.shape[1:]) if leaf.dim() else 1
  return rows, width, -(-width // _ATOM_DIM)


def _as_atoms(leaves: Sequence[torch.Tensor],
              segments: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
  """Every row of every leaf as (N, 3) atoms, zero-padded, and each atom's system id."""
  forces, systems = [], []
  for i, leaf in enumerate(leaves):
    rows, width, atoms = _atoms_per_row(leaf)
    padded = leaf.new_zeros((rows, atoms * _ATOM_DIM))
    padded[:, :width] = leaf.reshape(rows, width)
    forces.append(padded.reshape(rows * atoms, _ATOM_DIM))
    ids = (torch.zeros(rows, dtype=torch.int64, device=leaf.device) if segments is None
           else torch.as_tensor(segments[i], device=leaf.device).to(torch.int64))
    systems.append(ids.repeat_interleave(atoms))
  if not forces:  # no leaves: a state of no atoms (what torch-sim makes of it is its own)
    return (torch.zeros((0, _ATOM_DIM), dtype=torch.get_default_dtype()),
            torch.zeros(0, dtype=torch.int64))
  return torch.cat(forces), torch.cat(systems)


def _as_leaves(step: torch.Tensor, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
  """Inverse of :func:`_as_atoms`: drops the padding and restores each leaf's shape."""
  out, start = [], 0
  for leaf in leaves:
    rows, width, atoms = _atoms_per_row(leaf)
    block = step[start:start + rows * atoms].reshape(rows, atoms * _ATOM_DIM)
    out.append(block[:, :width].reshape(leaf.shape).clone())
    start += rows * atoms
  return out


def _shape_only(leaf: torch.Tensor) -> np.ndarray:
  """A zero-stride stand-in of the leaf's shape for the rule-13 check (no copy)."""
  return np.broadcast_to(np.float64(0.0), tuple(leaf.shape))


class TorchSimAseFire:
  """``fire_init`` + ``fire_step(max_step=c, fire_flavor="ase_fire")`` on a batched state."""

  framework = "torch"
  library = "torch-sim-atomistic"
  version = ts.__version__
  name = "torch_sim.fire_step.ase_fire"
  description = ("torch_sim fire_step(max_step, fire_flavor='ase_fire'), first step with "
                 "dt=1 on a SimState of many systems: scale max/(norm+eps) when norm > max")
  # Per-system L2 over each system's whole step; one threshold for the batch; the state is
  # float32 or float64 (one dtype per state, so no mixing).
  capabilities = Capabilities(per_system=True, dtypes=("float32", "float64"),
                              returns_norm=False, mixed_dtypes=False)
  # The library call a bug report would show (the suite's reproducer appends it).
  reproducer = (
      "import torch, torch_sim as ts\n"
      "from clipbench.impls.adapters.torch_sim_adapter import TorchSimAseFire\n"
      "# the SimState, the stub model and the atom layout: TorchSimAseFire.clip_by_global_norm\n"
      "out, _ = TorchSimAseFire().clip_by_global_norm([torch.from_numpy(x) for x in leaves], "
      "threshold, segments=None if segments is None else [torch.from_numpy(s) for s in "
      "segments], num_systems=num_systems)\nprint(out)")

  def clip_by_global_norm(self, leaves: Sequence[torch.Tensor], max_norm: float, *,
                          segments: Sequence[torch.Tensor] | None = None,
                          num_systems: int | None = None, norm_type: float = 2.0,
                          nonfinite: str = "propagate") -> tuple[list[torch.Tensor], None]:
    # Neither option exists in torch-sim's FIRE: refuse instead of emulating.
    _common.require_l2_propagate(norm_type, nonfinite, _LIBRARY)
    leaves = list(leaves)
    if segments is not None:
      # The mapping of rows to torch-sim's consecutive system_idx is the adapter's, so the
      # adapter checks segments with the spec's own rule-13 check: rule 13 describes it.
      validation.check_segments([_shape_only(x) for x in leaves],
                                [s.cpu().numpy() if torch.is_tensor(s) else s for s in segments],
                                num_systems)
    forces, systems = _as_atoms(leaves, segments)
    order = torch.argsort(systems, stable=True)
    _, system_idx = torch.unique_consecutive(systems[order], return_inverse=True)
    n_systems = int(system_idx.max()) + 1 if system_idx.numel() else 0
    dtype, device = forces.dtype, forces.device
    state = ts.SimState(
        positions=torch.full_like(forces, -0.0),
        masses=torch.ones(forces.shape[0], dtype=dtype, device=device),
        cell=torch.eye(_ATOM_DIM, dtype=dtype, device=device).repeat(n_systems, 1, 1),
        pbc=False,
        atomic_numbers=torch.ones(forces.shape[0], dtype=torch.int64, device=device),
        system_idx=system_idx,
    )
    model = _ForcesModel(forces[order], n_systems)
    fire_state = ts.optimizers.fire_init(state, model, dt_start=1.0, fire_flavor="ase_fire")
    fire_state = ts.optimizers.fire_step(fire_state, model, max_step=max_norm,
                                         fire_flavor="ase_fire")
    step = torch.empty_like(forces)
    step[order] = fire_state.positions
    return _as_leaves(step, leaves), None


ase_fire = TorchSimAseFire()
