"""The three clipping operations in JAX, exact and batch-invariant, fast inside ``jax.jit``.

Two routes (:mod:`.api` picks one per call):

* **CPU: the numba kernels** (:mod:`.host_route`). Called on concrete arrays, the kernels read
  the leaves in place and nothing is compiled, so a process that sees thousands of shapes (a
  batched relaxation whose converged systems leave the batch) does not grow; under tracing
  (``jax.jit``, ``jax.vmap``, ``jax.grad``) the call is one XLA FFI custom call whose result
  buffers the kernels fill (:mod:`.xla_ffi`, a ``ctypes`` handler of the typed FFI C API), so
  clipping inside a user's jitted step costs what the kernels cost. Why not the graph below on
  the CPU: XLA:CPU runs the exact arithmetic's multi-output float64 reductions, scatters and
  gathers at several times the memory roofline, and compiles an executable per shape (about a
  hundred memory mappings each; a process died after ~640 shapes). Why not
  ``jax.pure_callback``: it copies every output once more. Bits: the numba kernels'.
* **Other backends: the exact XLA graph** described below (registered on the CPU too, as
  ``clipbench.jax-xla`` = :data:`xla_graph`, so that it stays under test without a GPU).

Numerical design of the graph (SPEC rules 3-5 and 11 by construction, not by XLA's choices):

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
  :class:`.config.Config` (:mod:`.api`). Called on its own it runs on rows padded to a power of
  two, so it compiles per shape bucket, not per shape (:mod:`.buckets`). Inside an enclosing
  ``jax.jit`` the graph is lowered with x64 off; the ops used here lower correctly then
  (``jnp.frexp`` does not, so frexp is done on the bits, :mod:`.formats`).
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
  host by a ``jax.pure_callback``, only when one exists (:mod:`.exact_fallback`; integer
  arithmetic, since the callback thread flushes subnormals too): for p = 1, 2 from exact
  integer limb sums per exponent that the device makes (one tie system per round of a
  ``lax.while_loop``; on sharded leaves XLA all-reduces them, no leaf moves), for max-step
  from the element bits of the few vectors that can decide it, one per system and round
  (:mod:`.step_ties`; where the leaves may be sharded), for other p from every element's
  bits (p = +-inf has no near-tie: its norm is an element, exactly). The factor is the largest
  s with ``s n_up <= c``, cut to 29 bits without float64 leaves, so ``x * s`` is exact in
  float64 and one truncation of its bits is the exact RTZ value: the output norm is
  ``<= s n <= c`` (:mod:`.apply`). Kept systems are selected bitwise (never multiplied by 1.0,
  which XLA would flush).
* **Max-step** sums each vector's squares in a fixed pairwise tree over the last axis
  (elementwise adds: deterministic, :mod:`.pairwise`), then takes float maxima (exact).

Speed of the graph: on CPU XLA runs multi-output reductions of fused float64 work, scatters
and gathers slowly, and the exact sums need two passes over the data (max, then pieces) plus
the apply pass: several times the roofline, hence the CPU route above.

Transforms (:mod:`.gradient`; on both routes): ``jax.jit`` (concrete arguments are validated on the host
first; under tracing the value checks on segments are skipped and a traced threshold is
clamped to ``max(c, 0)``), ``jax.vmap``, ``jax.grad`` (a custom JVP: the identity where a
system is kept, the derivative of ``x c / n(x)`` where it is clipped for finite p, the factor
held fixed for p = +-inf and max-step, zero for NaN-filled systems; finite at a zero input).
On the CPU route the primal comes from the kernels and the tangent's coefficients from the
graph's decisions (the same exact decisions). ``jax.vmap`` of the custom call runs the kernels
once per batch element. Verified by ``conformance/test_transforms.py`` and
``impls/tests/test_host_routes.py``.
"""

from clipbench.impls.own.jax.api import (capabilities, clip_by_global_norm, clip_by_max_step,
                                         clip_grad_norm, description, framework,
                                         implementation, version, xla_graph)

__all__ = ["capabilities", "clip_by_global_norm", "clip_by_max_step", "clip_grad_norm",
           "description", "framework", "implementation", "version", "xla_graph"]
