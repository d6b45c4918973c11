"""The three clipping operations in JAX (jit-compiled XLA), exact and batch-invariant.

Numerical design (SPEC rules 3-5 and 11 by construction, not by XLA's choices):

* **Order-free exact sums (rule 11)** (:mod:`.power_sums`). XLA picks its own reduction and
  scatter orders, which change with shapes and fusion, so no fixed summation order can be
  imposed. Instead every per-system sum is exact: each term ``t = (|x| / 2**(K+1))**p <= 1``
  (K the exponent of the system's max |x|, found in a first pass) is split by
  ``q = (t + sigma) - sigma`` into pieces on two per-system grids ``g1 = 2**(L+1-52)``,
  ``g2 = g1 2**(L-52)`` (``n < 2**L`` elements; a third grid above 2**25 elements), on which any
  sum of n pieces is exact in float64. Sums of exact values are independent of order,
  association, scatter, fusion, row interleaving, leaf split and batch composition, so a
  system's bits depend only on its own elements, for the segmented, sorted and
  ``segments=None`` paths alike (:mod:`.systems`). The dropped remainder (below
  ``n g_last / 2``) joins a rigorous error bound.
* **Float64 without global x64.** The core runs under ``jax.enable_x64(True)`` (scoped, so
  callers keep x64 off) and is cached by ``jax.jit`` on shapes and the static
  :class:`.config.Config` (:mod:`.api`). Inside an enclosing ``jax.jit`` the graph is lowered
  with x64 off; the ops used here lower correctly then (``jnp.frexp`` does not, so frexp is
  done on the bits, :mod:`.formats`).
* **XLA flushes subnormals** in every float operation on CPU. Leaves of at most 32 bits are
  widened with exact float conversions, subnormals rebuilt from their integer fraction field
  (:mod:`.narrow`); results are rounded into bits with integer operations (:mod:`.rounding`).
  Canonical rule: a system whose max is at least 2**-60 leaves out elements below 2**-126 (at
  most ``n (2**-66)**p`` relative, inside the error bound), a smaller one keeps them exactly,
  so the bits never depend on which pass the batch selected. Float64 leaves (x64 on) take a
  slower route (:mod:`.wide`): integer keys for maxima, Dekker two-products, double-double
  ``exp``/``log`` for non-integer p, four grids.
* **Decision and factor**: ``decision.finalize`` (shared with the numba kernels): double-double
  root, threshold against an interval around the norm; a near-tie is settled exactly on the
  host by a ``jax.pure_callback`` under ``lax.cond`` (:mod:`.exact_fallback`; only when one
  exists; integer arithmetic, since the callback thread flushes subnormals too). The factor is
  the largest s with ``s n_up <= c``, cut to 29 bits without float64 leaves, so ``x * s`` is
  exact in float64 and one truncation of its bits is the exact RTZ value: the output norm is
  ``<= s n <= c`` (:mod:`.apply`). Kept systems are selected bitwise (never multiplied by 1.0,
  which XLA would flush).
* **Max-step** sums each vector's squares in a fixed pairwise tree over the last axis
  (elementwise adds: deterministic, :mod:`.pairwise`), then takes float maxima (exact).

Speed: on CPU XLA runs multi-output reductions of fused float64 work, scatters and gathers
slowly, and the exact sums need two passes over the data (max, then pieces) plus the apply
pass; expect several times the roofline (the numba kernels are the fast CPU implementation).

Transforms (:mod:`.gradient`): ``jax.jit`` (concrete arguments are validated on the host
first; under tracing the value checks on segments are skipped and a traced threshold is
clamped to ``max(c, 0)``), ``jax.vmap``, ``jax.grad`` (a custom JVP: the identity where a
system is kept, the derivative of ``x c / n(x)`` where it is clipped for finite p, the factor
held fixed for p = +-inf and max-step, zero for NaN-filled systems; finite at a zero input).
Verified by ``conformance/test_transforms.py``.
"""

from clipbench.impls.own.jax.api import (capabilities, clip_by_global_norm, clip_by_max_step,
                                         clip_grad_norm, description, framework,
                                         implementation, version)

__all__ = ["capabilities", "clip_by_global_norm", "clip_by_max_step", "clip_grad_norm",
           "description", "framework", "implementation", "version"]
