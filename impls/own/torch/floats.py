"""Exact float64 operations on torch tensors that numpy has and torch lacks or rounds.

``torch.ldexp`` multiplies by ``torch.pow(2, e)``, which is float32 for integer ``e`` (so
``2**-200`` is 0): every power of two here is built from its bits instead, exactly. The
decisions (:mod:`.certified`) and the certified bounds (:mod:`.measure`) run on these, on any
device, vectorized over systems.
"""

from __future__ import annotations

import torch

U64 = 2.0 ** -53  # unit roundoff of float64


def pow2_normal(e: torch.Tensor) -> torch.Tensor:
  """2.0**e for integer e in [-1022, 1023] (the normal range), from its bits."""
  return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def pow2(e: torch.Tensor) -> torch.Tensor:
  """2.0**e as float64 for integer tensors e: exact down to 2**-1074, 0 below, inf past 1023."""
  e = e.to(torch.int64)
  first = e.clamp(-1022, 1023)
  rest = (e - first).clamp(-1022, 1023)  # in [-52, 0] down to the subnormal range
  return pow2_normal(first) * pow2_normal(rest)


def ldexp(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
  """x * 2**e in two exact halves (one rounding at most, where the result is subnormal)."""
  e = e.to(torch.int64)
  half = torch.div(e, 2, rounding_mode="floor")
  return x * pow2(half) * pow2(e - half)


def exponent(v: torch.Tensor) -> torch.Tensor:
  """e with v in [2**(e-1), 2**e) for finite v > 0 (``frexp``'s exponent), int64."""
  return torch.frexp(v)[1].to(torch.int64)


def grid_step(prec: int | torch.Tensor) -> int | torch.Tensor:
  """The bit pattern's step between neighbours of a ``prec``-bit grid (2**(53 - prec))."""
  if isinstance(prec, int):
    return 1 << (53 - prec)
  return torch.where(prec == 24, 1 << 29, 1)


def truncate_to_grid(q: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
  """Normal q > 0 rounded down onto the grid of pattern step ``step`` (low bits cleared)."""
  return (q.view(torch.int64) & -step).view(torch.float64)


def on_grid(v: torch.Tensor, step: int | torch.Tensor, steps) -> torch.Tensor:
  """The float ``steps`` grid neighbours above (or, negative, below) a normal v > 0 on the grid.

  Adding to the bit pattern walks the grid, across binades too: below a power of two the
  spacing halves, as the pattern's carry says. ``steps`` may be a tensor of offsets that
  broadcasts against v.
  """
  return (v.view(torch.int64) + step * steps).view(torch.float64)


def spacing_up(v: torch.Tensor) -> torch.Tensor:
  """The distance from v to the next float64 above it (numpy's ``spacing`` for v > 0)."""
  return torch.nextafter(v, torch.full_like(v, torch.inf)) - v


def gamma(depth: torch.Tensor | int):
  """gamma_m = m u / (1 - m u): relative error bound of any float64 sum of m >= 0 terms.

  A depth known on the host (a Python number) gives a Python float: no device operator."""
  d = depth.to(torch.float64) if isinstance(depth, torch.Tensor) else float(depth)
  return d * U64 / (1 - d * U64)
