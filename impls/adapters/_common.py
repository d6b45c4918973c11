"""Refusals shared by every adapter, whatever its framework.

An adapter hands the leaves to its library exactly as given. When a caller asks for an option
the library has no way to express (a p other than 2, a non-finite mode other than its own), the
adapter refuses with ``NotImplementedError`` instead of emulating it: the refusal is the
adapter's, never a validation of the inputs on the library's behalf.
"""

from __future__ import annotations

from typing import Sequence


def require_l2(norm_type: float, library: str) -> None:
  """Refuses a p the library cannot compute (it clips by the L2 norm only)."""
  if norm_type != 2.0:
    raise NotImplementedError(
        f"norm_type: {library} clips by the L2 norm only; norm_type={norm_type!r} is not "
        "expressible through its API")


def require_mode(nonfinite: str, modes: Sequence[str], library: str) -> None:
  """Refuses a non-finite mode other than the one the library (as called) implements."""
  if nonfinite not in modes:
    raise NotImplementedError(
        f"nonfinite: {library} implements {'/'.join(modes)} only; nonfinite={nonfinite!r} is "
        "not expressible through its API")


def require_l2_propagate(norm_type: float, nonfinite: str, library: str) -> None:
  """The refusals of a library that clips by the L2 norm and lets non-finite values through."""
  require_l2(norm_type, library)
  require_mode(nonfinite, ("propagate",), library)
