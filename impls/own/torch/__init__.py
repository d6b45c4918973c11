"""Our own torch implementations of the three clipping operations: eager and ``torch.compile``.

On the CPU both run the numba kernels on the tensors' memory, as the custom operator
``clipbench::numba_clip`` (:mod:`.host_route`: the torch passes below reach several times the
memory roofline on the CPU, the kernels reach it; one opaque node in a user's
``torch.compile`` graph, no recompilation when row counts change). What follows is the CUDA
route (torch passes, compiled passes or Triton kernels), whose bits are the torch canonical
definition below; the CPU route's bits are the numba kernels' (each conforming).

Every rule of SPEC.md holds with no deviation. The design makes every output bit a function of
the *exact* values of a system's elements, so batch invariance (rule 11) holds by
construction, whatever the summation order of the kernels that do the work.

Canonical definitions (per system: exact norm ``n`` (p-norm or step norm), threshold ``c``)
-------------------------------------------------------------------------------------------
* clipped iff ``n > c`` exactly (rule 3); the reported norm is ``n`` correctly rounded to
  nearest in the norm dtype (0 ulp; +inf past its range, rule 5);
* the factor is ``s = max{s in F_P : s * n * (1 + w_P) <= c}``, ``F_P`` the P-bit binary floats
  (unbounded exponent): P = 24, ``w = 5 * 2**-26`` when the system has an element in a
  float32/bfloat16/float16 leaf, else P = 53, ``w = 5 * 2**-55``. So ``s`` lies within
  ``3.25 u`` below ``c/n`` (rule 4 allows 4u of the coarsest dtype);
* float32 leaves: ``x * s`` in float32, rounded to nearest (one fast multiply). Since
  ``s (1 + u32) n <= c / (1 + 2**-26)``, the output norm stays ``<= c`` even counting
  subnormal roundings, provided ``s >= 2**-126`` and ``c >= count * 2**-123`` (checked per
  system; otherwise its elements are rounded toward zero as below). float64 leaves: the same
  in float64 (``s >= 2**-1022``, ``c >= count * 2**-1019``, otherwise an exact host
  computation). bfloat16/float16 leaves: ``x * s`` is exact in float64 and is rounded toward
  zero into the leaf dtype. Each output is within 1 ulp of ``x * s``, and the exact output
  norm is ``<= c`` for every p and for the step norm.

Computing them fast: certified approximations, exact near-ties
----------------------------------------------------------------
The kernels compute each system's power sum with a *rigorous* error bound; each decision
above is taken from the certified interval when the interval decides it (the rule for random
data); near-ties (what a ``norm == max`` test builds) recompute that system alone exactly.
Both routes compute the same exact function, so they give the same bits: unsorted
(``index_add_``) and sorted (``segment_reduce`` on offsets, the contiguous fast path) segments,
the global and per-system paths, eager, compiled and the Triton kernels all agree bit for bit.

* float16/bfloat16/float32 leaves (norm dtype float32): squares and |x| are exact in float64,
  and any float64 summation tree of m nonnegative terms is within ``gamma_m = m u / (1 - m u)``
  (u = 2**-53) of the exact sum, so a bound needs only the depth: the largest leaf's element
  count for one system (one float64 ``_foreach_norm`` per leaf), the system's count per
  system; about 2**-32 for W1's leaves against decision grids of 2**-24..2**-26.
* float64 leaves (norm dtype float64, ~2**-60 needed): a per-system power-of-two scaling (no
  overflow, no underflow), an exact split ``y = yh + yl`` (26-bit ``yh``), and error-free
  extraction (Rump, Ogita, Oishi: ``q = (t + sigma) - sigma`` with a per-system power of two
  ``sigma``): the large parts sum exactly in any order, only tiny remainders round. Decisions
  are made in double-double, vectorized over systems, on the device.
* p = +-inf: exact maxima/minima. General p: per-system power-of-two scaling by the largest
  magnitude, ``pow`` with a per-term error bound, the same certification (float64 leaves with
  a non-integer p always take the exact path).
* Exact path: int64 limb sums of ``m**2`` (or ``m``) per (system, exponent) bucket
  (``exact_power_sums``, order-independent), Python rationals for the decisions, mpmath
  interval enclosures for non-integer p.

Non-finite input (rule 7): "propagate" gives the system norm NaN (any NaN) else +inf and an
all-NaN output; "zero" replaces non-finite elements by +0.0 before anything else.

On a GPU a call is a fixed set of operators whatever its leaves and systems, and one host
transfer: the passes leave per-system tensors on the device, the decisions are tensor
operations there (``certified``), and the host reads, once, what it must see (``host_read``:
the argument checks that need device values, the count of open systems, which output
branches are needed); only a near-tie makes it read more.

Modules, in the order a call runs through them: ``arguments`` (adapters over the shared
checks), ``layout`` (leaves as row matrices), ``eager_passes`` / ``compiled_passes`` (the
per-element passes), ``measure`` (certified bounds), ``floats`` and ``certified`` (the
decisions as tensor operations), ``host_read`` and ``decisions`` (the one host read, the plan,
the exact path), ``oracles`` and ``formats`` (the exact path's arithmetic), ``apply`` (the
outputs), ``api`` (the canonical functions). What was counted and measured is in
``docs/gpu.md``.
"""

from clipbench.impls.own.torch.api import TorchClipping, eager
from clipbench.impls.own.torch.compiled_passes import compiled

__all__ = ["TorchClipping", "compiled", "eager"]
