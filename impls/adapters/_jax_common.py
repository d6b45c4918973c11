"""Pieces shared by the adapters over JAX libraries (optax, kups, brainstate, jax_privacy).

Nothing here touches a value: the adapters hand the leaves to the library exactly as given
(numpy or JAX arrays, any dtype) and return what the library returns. The helpers only state
what the adapters can express (dtypes JAX can hold in this process, the L2-only and
single-mode restrictions of the libraries) and refuse, with ``NotImplementedError``, a request
the wrapped library has no way to honour. Such a refusal is the adapter's, never a validation of
the inputs on the library's behalf: values are never checked here.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from clipbench.protocol import DTYPES, Capabilities

# Every wrapped function is plain JAX code; each adapter's module docstring records the check
# that jit, vmap and grad run through it as its users would call it.
JAX_TRANSFORMS: tuple[str, ...] = ("jit", "vmap", "grad")


def x64_enabled() -> bool:
  """Whether JAX holds float64 arrays in this process (read once, when an adapter is imported)."""
  return bool(jax.config.jax_enable_x64)


def supported_dtypes() -> tuple[str, ...]:
  """Leaf dtypes JAX keeps as given: float64 only with ``jax_enable_x64`` on.

  With x64 off JAX silently turns float64 into float32, so float64 is not declared.
  """
  if x64_enabled():
    return DTYPES
  return tuple(d for d in DTYPES if d != "float64")


def capabilities(**declared: Any) -> Capabilities:
  """A JAX library adapter's declaration: the dtypes JAX holds here, jit/vmap/grad, and
  ``declared``, the fields where the library differs from ``Capabilities``' defaults (global,
  L2 only, non-finite values propagated, functional, mixed dtypes, CPU)."""
  return Capabilities(dtypes=supported_dtypes(), transforms=JAX_TRANSFORMS, **declared)


def require_l2(norm_type: float, library: str) -> None:
  """Refuses a p the library cannot compute (it has no ``norm_type`` argument)."""
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
