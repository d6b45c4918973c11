"""The per-element passes in eager torch: per-system float64 results, left on the device.

Each pass reads the leaves once and returns device tensors of shape (K,) for the decisions
(:mod:`.certified`), which stay on the device too. The number of operators a pass dispatches
does not grow with the systems or the elements: per-system passes take each leaf whole (rows
reduced, then added into their systems by ``index_add_``); one-system passes take every leaf
of a dtype at once (``_foreach_norm``, or one concatenated buffer). Only past
:data:`BLOCK_ELEMS` elements is a leaf cut, so that no float64 temporary outgrows that.
"""

from __future__ import annotations

import math

import torch

from clipbench.impls.own import validation
from clipbench.impls.own.torch.arguments import Threshold
from clipbench.impls.own.torch.certified import Pieces
from clipbench.impls.own.torch.decisions import Plan, decide
from clipbench.impls.own.torch.floats import U64, exponent, gamma, pow2
from clipbench.impls.own.torch.layout import Batch, Leaf, gather
from clipbench.impls.own.torch.measure import measure

# The largest float64 temporary one operator makes (512 MiB): a bound on memory, not a tuning.
BLOCK_ELEMS = 1 << 26
_SIGN_OFF = (1 << 63) - 1  # float64 bits & this = the bits of |x| (NaN made positive)
_INF_BITS = 0x7FF0000000000000  # the bits of +inf: every finite magnitude's are below, NaN's above


def flat_blocks(xs: list[torch.Tensor]) -> list[torch.Tensor]:
  """The elements of ``xs`` (one dtype) as flat blocks of at most BLOCK_ELEMS elements.

  Small tensors are concatenated into one block (one copy, one operator); a tensor past the
  limit is cut. A single tensor that fits is its own block, uncopied.
  """
  blocks, pending, filled, limit = [], [], 0, BLOCK_ELEMS

  def flush():
    nonlocal pending, filled
    if pending:
      blocks.append(pending[0] if len(pending) == 1 else torch.cat(pending))
    pending, filled = [], 0

  for x in xs:
    flat = x.reshape(-1)
    start = 0
    while start < flat.numel():
      take = min(limit - filled, flat.numel() - start)
      pending.append(flat[start:start + take])
      filled += take
      start += take
      if filled == limit:
        flush()
  flush()
  return blocks


def by_dtype(leaves: list[Leaf]) -> dict[torch.dtype, list[Leaf]]:
  """The nonempty leaves grouped by dtype, in call order."""
  groups: dict[torch.dtype, list[Leaf]] = {}
  for leaf in leaves:
    if leaf.numel:
      groups.setdefault(leaf.x.dtype, []).append(leaf)
  return groups


def row_blocks(leaf: Leaf) -> list[tuple[torch.Tensor, torch.Tensor]]:
  """A per-system leaf as (rows, width) blocks of at most BLOCK_ELEMS elements, with their ids."""
  m = leaf.matrix()
  step = max(1, BLOCK_ELEMS // max(leaf.width, 1))
  return [(m[r:r + step], leaf.seg[r:r + step]) for r in range(0, leaf.rows, step)]


def check_no_rows(batch: Batch) -> None:
  """With no systems no leaf may have a row: the first one's id is out of range (read here,
  on the way to the error)."""
  for i, leaf in enumerate(batch.leaves):
    if leaf.rows:
      lo, hi = (int(v) for v in torch.aminmax(leaf.seg))
      validation.check_segment_range(i, lo, hi, 0)


def _abs_bits(values: torch.Tensor) -> torch.Tensor:
  """float64 values as the int64 bits of their magnitudes: ordered like them, NaN above inf."""
  return values.view(torch.int64) & _SIGN_OFF


class EagerKernels:
  """The per-element passes in eager torch. Each returns per-system device tensors."""

  # Error of one scaled term (|x| * 2**-e)**p <= 1 of a general p: torch.pow on float64 is
  # within 1 ulp (Sleef u10 / libm) or 2 (CUDA); taken as 2**-50 relative, plus underflow.
  POW_REL_ERR = 2.0 ** -50
  POW_ABS_ERR = 2.0 ** -1074

  # ------------------------------------------------------------------------------ the call
  def plan(self, batch: Batch, kind: str, p: float, threshold: Threshold,
           certified: bool = True) -> Plan:
    """The passes for ``kind`` ("sum", "max", "min", "step"), then the decisions."""
    measured = measure(self, batch, kind, p)
    return decide(batch, measured, threshold, threshold.on(batch.device), kind, p, certified)

  # -------------------------------------------------------------------------------- layout
  def prepare(self, batch: Batch) -> Batch:
    """Fills in the batch's per-system facts and clamps the ids into range, on the device.

    Ids outside [0, K) are reported through ``seg_range`` (read with the call's one host
    transfer, which then raises); until then they are clamped so that no pass indexes out of
    bounds.
    """
    K, dev = batch.num_systems, batch.device
    low_leaves = [leaf for leaf in batch.leaves if leaf.low and leaf.numel]
    if K == 0:
      check_no_rows(batch)
    if not batch.per_system:
      batch.counts = torch.full((1,), float(batch.numel), dtype=torch.float64, device=dev)
      batch.prec = 24 if low_leaves or not batch.norm64 else 53
      return batch
    counts = torch.zeros(K, dtype=torch.float64, device=dev)
    has_low = (torch.zeros(K, dtype=torch.bool, device=dev)
               if batch.norm64 and low_leaves else None)
    most_rows = max((leaf.rows for leaf in batch.leaves), default=0)
    ones = torch.ones(most_rows, dtype=torch.float64, device=dev) if most_rows else None
    ranges = []
    for leaf in batch.leaves:
      if leaf.rows == 0:
        continue
      ranges.append(torch.stack(torch.aminmax(leaf.seg)))
      leaf.seg = leaf.seg.clamp(0, K - 1)
      counts.index_add_(0, leaf.seg, ones[:leaf.rows], alpha=leaf.width)
      if has_low is not None and leaf.low and leaf.width:
        has_low.index_fill_(0, leaf.seg, True)
    batch.counts = counts
    batch.seg_range = torch.stack(ranges) if ranges else None
    if has_low is not None:
      batch.prec = torch.where(has_low, 24, 53)
    else:
      batch.prec = 53 if batch.norm64 else 24
    return batch

  # ---------------------------------------------------------------- approximate power sums
  def power_sums(self, batch: Batch, p: float, scale: torch.Tensor | None = None):
    """sum (|x| * scale_k)**p per system in float64 (scale None: 1), and a depth bound.

    The exact sum of the computed terms lies within gamma_depth of the returned value. The
    depth is a device tensor (per system) or, for one system, a Python number.
    """
    if not batch.per_system:
      return self._global_power_sum(batch, p, scale)
    sums = torch.zeros(batch.num_systems, dtype=torch.float64, device=batch.device)
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      for m, seg in row_blocks(leaf):
        sums.index_add_(0, seg, self.row_power_sums(m, p, None if scale is None else
                                                    gather(scale, seg)))
    return sums, batch.counts + len(batch.leaves) + 2

  def row_power_sums(self, m: torch.Tensor, p: float,
                     scale_rows: torch.Tensor | None) -> torch.Tensor:
    """Per-row float64 sums of (|x| * scale_row)**p of a (rows, width) block."""
    if p == 2 and scale_rows is None:
      return m.to(torch.float64).square().sum(1)
    b = m.to(torch.float64).abs()
    if scale_rows is not None:
      b.mul_(scale_rows.unsqueeze(1))
    if p != 1:
      b.pow_(p)
    return b.sum(1)

  def _global_power_sum(self, batch: Batch, p: float, scale: torch.Tensor | None):
    groups = by_dtype(batch.leaves)
    parts, depth = [], 1
    if scale is None and p in (1.0, 2.0):
      # One float64 norm per leaf (float64 accumulation on every device), one operator per
      # dtype; a norm squared back adds two roundings.
      for leaves in groups.values():
        roots = torch.stack(torch._foreach_norm([leaf.x for leaf in leaves], p,  # pylint: disable=protected-access
                                                dtype=torch.float64))
        parts.append(roots.square() if p == 2 else roots)
        depth = max(depth, max(leaf.numel for leaf in leaves) + 2)
    else:
      for leaves in groups.values():
        for block in flat_blocks([leaf.x for leaf in leaves]):
          b = block.to(torch.float64).abs()
          if scale is not None:
            b.mul_(scale)
          parts.append(b.pow_(p).sum().reshape(1))
          depth = max(depth, block.numel())
    if not parts:
      return torch.zeros(1, dtype=torch.float64, device=batch.device), 1
    values = torch.cat(parts) if len(parts) > 1 else parts[0]
    return values.sum().reshape(1), depth + values.numel() + 2

  # ------------------------------------------------------------------------ maxima, minima
  def extremes(self, batch: Batch, want_min: bool):
    """Exact max |x| per system (NaN if any NaN) and, if asked, min |x| (0 when empty)."""
    K, dev = batch.num_systems, batch.device
    if not batch.per_system:
      bigs, smalls = [], []
      for leaves in by_dtype(batch.leaves).values():
        xs = [leaf.x for leaf in leaves]
        bigs.append(torch.stack(torch._foreach_norm(xs, math.inf, dtype=torch.float64)))  # pylint: disable=protected-access
        if want_min:
          smalls.append(torch.stack(torch._foreach_norm(xs, -math.inf, dtype=torch.float64)))  # pylint: disable=protected-access
      if not bigs:
        zero = torch.zeros(1, dtype=torch.float64, device=dev)
        return zero, (zero if want_min else None)
      big = torch.cat(bigs).amax().reshape(1)  # NaN if any leaf's is
      small = torch.cat(smalls).amin().reshape(1) if want_min else None
      return big, small
    big = torch.zeros(K, dtype=torch.int64, device=dev)
    small = torch.full((K,), _INF_BITS, dtype=torch.int64, device=dev) if want_min else None
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      for m, seg in row_blocks(leaf):
        bits = _abs_bits(m.to(torch.float64))
        big.scatter_reduce_(0, seg, bits.amax(1), "amax")
        if want_min:
          small.scatter_reduce_(0, seg, bits.clamp(max=_INF_BITS).amin(1), "amin")  # no NaN
    small_values = None
    if want_min:
      small_values = torch.where(batch.counts > 0, small.view(torch.float64), 0.0)
    return big.view(torch.float64), small_values

  # ----------------------------------------------------------------------------- step norms
  def step_sums(self, batch: Batch):
    """Largest float64 sum of squares of a step vector per system (NaN if any NaN), and the
    vector length."""
    K, dev = batch.num_systems, batch.device
    best = torch.zeros(K, dtype=torch.int64, device=dev)
    longest = 1
    for leaf in batch.leaves:
      if leaf.numel == 0 or leaf.vec == 0:
        continue
      longest = max(longest, leaf.vec)
      for m, seg in ([(leaf.matrix(), None)] if leaf.seg is None else row_blocks(leaf)):
        row = _abs_bits(self.row_step_sums(m, leaf.vec))
        if seg is None:
          best = torch.maximum(best, row.amax().reshape(1))
        else:
          best.scatter_reduce_(0, seg, row, "amax")
    return best.view(torch.float64), longest

  def row_step_sums(self, m: torch.Tensor, vec: int) -> torch.Tensor:
    """Per row of a (rows, width) block, the largest float64 sum of squares of a step vector
    (NaN if any)."""
    return m.to(torch.float64).square().reshape(m.shape[0], -1, vec).sum(2).amax(1)

  # ---------------------------------------------------- float64: sums by error-free extraction
  def accurate_sums(self, batch: Batch, p: int, e: torch.Tensor) -> Pieces:
    """Per-system pieces of sum (|x| 2**-e_k)**p (p = 1, 2; every term <= 1).

    ``q1, q2, qt`` are exact sums (extracted parts on a grid fixed by a per-system power of
    two, so any order is exact); ``rest`` is a plain float64 sum of small remainders whose
    error is bounded by ``bound`` (absolute).
    """
    n = batch.counts.clamp(min=1.0)
    grow = pow2(exponent(n) + 2)
    half = torch.div(-e, 2, rounding_mode="floor")
    sig1 = grow  # terms <= 1
    params = torch.stack([pow2(half), pow2(-e - half), sig1, sig1 * U64 * grow,
                          2.0 ** -24 * grow], 1)  # (K, 5): a * b = 2**-e, the sigmas
    acc, depth = self._accumulate_pieces(batch, p, params)
    q1, q2, qt, rest = acc.unbind(1)
    # |rest| per element: remainder bounds plus the tail yl**2 <= 2**-50 y**2.
    per_elem = U64 * params[:, 3] + (U64 * params[:, 4] if p == 2 else 0.0)
    tail = 2.0 ** -50 * (q1 + q2 + qt + 1.0) if p == 2 else 0.0
    total_abs = n * per_elem * (1 + 4 * U64) + tail
    bound = (gamma(depth) * total_abs + n * 2 * U64 * per_elem + n * 2.0 ** -100
             + n * 2.0 ** -1070)
    pieces = Pieces(q1, q2, qt, rest, bound, e)
    extra = self.pieces_sharing_error(pieces, n, params, total_abs)
    return pieces if extra is None else pieces._replace(bound=bound + extra)

  def pieces_sharing_error(self, pieces: Pieces, n: torch.Tensor, params: torch.Tensor,
                           total_abs: torch.Tensor) -> torch.Tensor | None:
    """What adding the pieces' sums across devices adds to their error bound (``n``, the counts;
    ``params``, the extraction's; ``total_abs``, the bound of ``rest``'s magnitude): none on one
    device."""
    del pieces, n, params, total_abs
    return None

  def _accumulate_pieces(self, batch: Batch, p: int, params: torch.Tensor):
    """(K, 4) sums of the pieces per system, and the depth bound of the ``rest`` sums."""
    K = batch.num_systems
    acc = torch.zeros(K, 4, dtype=torch.float64, device=batch.device)
    if not batch.per_system:
      largest, count = 1, 0
      for leaves in by_dtype(batch.leaves).values():
        for block in flat_blocks([leaf.x for leaf in leaves]):
          acc += self.row_pieces(block.reshape(1, -1), params, p)
          largest, count = max(largest, block.numel()), count + 1
      return acc, largest + count + len(batch.leaves) + 4
    columns = torch.arange(4, device=batch.device)
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      for m, seg in row_blocks(leaf):
        rows = self.row_pieces(m, gather(params, seg), p)
        # One flat index_add_ (the (rows, 4) form adds slice by slice: much slower on CPU).
        acc.view(-1).index_add_(0, (seg.unsqueeze(1) * 4 + columns).reshape(-1),
                                rows.reshape(-1))
    return acc, batch.counts + len(batch.leaves) + 4

  def row_pieces(self, m: torch.Tensor, params_rows: torch.Tensor, p: int) -> torch.Tensor:
    """(rows, 4) row sums of the extracted pieces q1, q2, qt, rest of a (rows, width) block."""
    return piece_row_sums(m, params_rows, p)

  # --------------------------------------------------------------------------------- apply
  def apply(self, batch: Batch, plan) -> list[torch.Tensor]:
    # pylint: disable-next=import-outside-toplevel
    from clipbench.impls.own.torch.apply import apply_global, apply_leaf
    if not batch.per_system:
      return apply_global(batch.leaves, plan)
    return [apply_leaf(leaf, plan) for leaf in batch.leaves]


def piece_row_sums(m: torch.Tensor, params: torch.Tensor, p: int) -> torch.Tensor:
  """Error-free extraction of y = |x| a b (p = 1) or y**2 (p = 2) into exactly summable parts.

  ``params`` holds per row (a, b, sigma1, sigma2, sigma_t): a * b is the system's power-of-two
  scale (two factors, each a normal float); ``q = (t + sigma) - sigma`` is exact and lands on
  the grid of ``sigma``, so sums of q are exact in any order (Rump, Ogita, Oishi 2008).
  """
  y = m.to(torch.float64).abs()
  y = (y * params[:, 0:1]) * params[:, 1:2]
  s1, s2 = params[:, 2:3], params[:, 3:4]
  if p == 2:
    yh = (y.view(torch.int64) & -(1 << 27)).view(torch.float64)  # 26 leading bits
    yl = y - yh
    t1 = yh * yh
    t2 = 2.0 * (yh * yl)
    t3 = yl * yl
  else:
    t1 = y
  q1 = (t1 + s1) - s1
  r1 = t1 - q1
  q2 = (r1 + s2) - s2
  rest = r1 - q2
  if p == 2:
    st = params[:, 4:5]
    qt = (t2 + st) - st
    rest = rest + (t2 - qt) + t3
  else:
    qt = torch.zeros_like(q1)
  return torch.stack([q1.sum(1), q2.sum(1), qt.sum(1), rest.sum(1)], 1)
