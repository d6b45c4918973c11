"""Compiled CPU kernels (numba, parallel over blocks of systems) for the three operations.

Numerical design (SPEC rules 3-5 exactly, at memory speed):

* **Norm pass.** For float16/bfloat16/float32 leaves every ``|x|**p`` with ``p <= 6`` is
  formed in float64 (exact for p = 1, 2) and summed in float64, where no such value can
  overflow or underflow: one read suffices (:mod:`.power_sums`). Larger p, and any call with
  a float64 leaf, first take each system's max |x| (exact, :mod:`.extremes`), scale by a
  power of two and accumulate double-double sums (:mod:`.scaled_sums`, TwoProd via a fused
  multiply-add). Max-step takes each block's largest vector sum (:mod:`.max_step`).
* **Reduction order (rule 11, by construction).** Each system's run of rows in a leaf is cut
  into fixed blocks counted from the run's start (:mod:`.layout`); a block is summed as
  256-element sub-blocks, each by one compiled loop whose order is a fixed function of its
  length, their sums added in order, and a system's block sums are added in leaf order, then
  block order (:mod:`.combine`). Nothing depends on other
  systems, on where the run sits in memory, or on the thread that ran it; sorted ids (row
  offsets from the validation scan, :mod:`.segments`) and unsorted ids (a gathered copy) sum
  the same blocks, so they give the same bits. Max-step and p = inf take maxima (exact).
* **Decision and factor** (:mod:`.finalize`, the compiled twin of ``decision.finalize``): the
  norm is known within a rigorous bound; a threshold inside it is a near-tie settled exactly
  on the host (:mod:`.ties`, integer arithmetic); the factor s is the largest float with
  ``s * n_up <= c``. For calls without float64 leaves s keeps 24 bits (a float32, within
  rule 4's 4u); with float64 leaves 53 bits.
* **Apply pass** (:mod:`.apply`). Kept systems are copied bit for bit, NaN-poisoned ones
  filled with NaN, the others scaled with the exact round-toward-zero product on every route,
  so the output norm is <= s * n <= c. Outputs are new arrays: views of one buffer per dtype,
  recycled once every view of an earlier result is gone (:mod:`.buffers`); long float32 runs
  are written with streaming stores (:mod:`.streaming`), the same bits lane by lane.
* **Fused route** (:mod:`.fused`; sorted segments, float32, L2 and max-step). The layout of
  batched simulations (each leaf's ids sorted, a system a few KB) takes one pass over each
  chunk of contiguous systems: it scans each run's ids (:mod:`.run_scan`, which validates
  them), sums the run with the same block function in the same block order, finalizes the
  system and scales the run while it is still in L1, so the leaves come from memory once.
  It gives the general route's bits (:mod:`.general`); unsorted or out-of-range ids and
  non-finite elements in zero mode hand the call to the general route, which raises the same
  errors. A system's decision takes and returns scalars (:mod:`.fused_decision`); chunks of
  tiny systems (a few atoms each: per-system work, not bandwidth) go up to 2,048 systems at
  a time, their run ends found a window of ids at a time, short runs summed in a fixed tree
  (:mod:`.short_sums`), decided together in vector lanes (:mod:`.lane_decisions`) and
  applied in masked vector steps (:mod:`.masked_apply`), each lane with the one-system code's
  bits; each run's leaf and output are prefetched a fixed distance ahead, which the hardware
  prefetchers do not do for such short runs. A call whose
  largest system would leave a thread idle (one giant system) takes :mod:`.long_runs`
  instead: the general route's blocks on every thread, ids checked and sums taken in one
  pass, then decided and applied, the same sums in the same order.

* **Sharded calls** (:mod:`.sharded`, rule 14): every rank reduces the blocks and
  sub-blocks it holds whole, the elements across shard boundaries travel, and every rank folds
  all results in the order above, so it reaches the unsharded call's sums and decisions
  without holding more than its rows.

Execution (:mod:`.api`): validation (rules 6, 9, 10, 13; the shared checks of
``clipbench.impls.own.validation``) runs before any other kernel; its one pass over each
segment array also records the system row offsets of sorted ids. Kernels are serial, release
the GIL and run over contiguous ranges of blocks on a small thread pool (:mod:`.threads`,
rather than OpenMP regions); they read leaves in place through their data pointers
(:mod:`.intrinsics`, :mod:`.decode`; hundreds of small leaves packed with one C-level
concatenate) and are compiled once (``cache=True``) per argument types, grouped into the
named tuples of :mod:`.records`; a cache that may hold kernels of older sources is cleared at
import (:mod:`.cache_guard`). Float64 leaves and p > 6 take the slower scaled
double-double path (correct, not tuned). Measurements behind these choices are in
``docs/cpu-kernels.md``.
"""

from clipbench.impls.own.numba import cache_guard as _cache_guard, fused as _fused
from clipbench.impls.own.numba.api import (capabilities, clip_by_global_norm, clip_by_max_step,
                                           clip_grad_norm, description, framework,
                                           implementation, version)
from clipbench.impls.own.numba.buffers import release_buffers

# Before any kernel runs: numba would load kernels compiled from older sources of the modules
# they inline (cache_guard).
_cache_guard.clear_if_stale(_cache_guard.cache_dir_of(_fused._in_groups))

__all__ = ["capabilities", "clip_by_global_norm", "clip_by_max_step", "clip_grad_norm",
           "description", "framework", "implementation", "release_buffers", "version"]
