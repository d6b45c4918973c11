"""Pieces shared by the adapters over JAX libraries (optax, kups, brainstate, jax_privacy).

Nothing here touches a value: the helpers only state what the adapters can express (the dtypes
JAX holds in this process, jit/vmap/grad). Refusing an option a library cannot express is every
adapter's concern, in ``_common``.
"""

from __future__ import annotations

from typing import Any

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
