"""The per-element passes in eager torch: power sums, extremes, step sums, extracted pieces.

Each pass reads the leaves once and returns per-system numpy arrays for the host-side
decisions. On CPU they run on chunks below torch's parallel grain (32768 elements), on the
calling thread: on a loaded machine torch's OpenMP regions cost milliseconds per op (every op
waits for every thread), so whole-tensor ops were several times slower than chunked ones (the
measurements are in ``docs/gpu.md``); BLAS (``dot``, ``mv``) is avoided for the same reason.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from clipbench.impls.own.decision import U64
from clipbench.impls.own.torch import branches
from clipbench.impls.own.torch.apply import Plan, apply_global, apply_leaf
from clipbench.impls.own.torch.layout import Batch, Leaf, gather
from clipbench.impls.own.torch.measure import gamma


class EagerKernels:
  """The per-element passes in eager torch. Each returns per-system numpy arrays.

  Leaves are read in chunks of at most ``CHUNK`` elements copied into one float64 scratch
  buffer: the float64 work stays in cache, and chunks below torch's parallel grain run
  without thread synchronisation (which costs milliseconds per call on a busy machine). No
  BLAS call is used: MKL's threaded ``dot``/``gemv`` stall the same way.
  """

  CHUNK = (1 << 15) - 64  # below torch's parallel grain (32768): runs on the calling thread
  # Error of one scaled term (|x| * 2**-e)**p <= 1 of a general p: torch.pow on float64 is
  # within 1 ulp (Sleef u10 / libm); taken as 2**-50 relative, plus underflow below 2**-1074.
  POW_REL_ERR = 2.0 ** -50
  POW_ABS_ERR = 2.0 ** -1074

  # ---------------------------------------------------------------- approximate power sums
  def power_sums(self, batch: Batch, p: float,
                 scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """sum (|x| * scale_k)**p per system in float64 (scale None: 1) and a depth bound.

    The exact sum of the computed terms lies within gamma_depth of the returned value.
    """
    K = batch.num_systems
    if not batch.per_system:
      total, depth = self._global_power_sum(batch, p, None if scale is None else float(scale[0]))
      return np.full(K, total), np.full(K, depth, np.int64)
    sums = torch.zeros(K, dtype=torch.float64, device=batch.device)
    scale_t = None if scale is None else torch.as_tensor(scale, device=batch.device)
    buf = torch.empty(self.CHUNK, dtype=torch.float64, device=batch.device)
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      row = self._row_power_sums(leaf, p, scale_t, buf)
      sums += self._system_sums(row, leaf, K)
    depth = batch.counts + len(batch.leaves) + 2
    return sums.cpu().numpy(), depth

  def _global_power_sum(self, batch: Batch, p: float, scale: float | None) -> tuple[float, int]:
    parts, roots = [], []  # chunk sums, and chunk norms (p-th roots of chunk sums)
    plain = scale is None and p in (1.0, 2.0)
    # An accelerator reads every leaf in one foreach norm (one launch for all of them); the
    # host reads large leaves by chunks, on the calling thread.
    whole = plain and not branches.on_host(batch.device)
    small = [leaf.x for leaf in batch.leaves
             if 0 < leaf.numel and (whole or leaf.numel <= self.CHUNK)] if plain else []
    if small:
      # One float64 norm per leaf, all in one operator.
      roots.append(torch.stack(torch._foreach_norm(small, p, dtype=torch.float64)))  # pylint: disable=protected-access
    buf = torch.empty(self.CHUNK, dtype=torch.float64, device=batch.device)
    pending, filled = [], 0

    def flush():
      nonlocal pending, filled
      b = buf[:filled]
      if len(pending) == 1:
        b.copy_(pending[0])
      else:
        torch.cat(pending, out=b)
      if plain:
        roots.append(torch.linalg.vector_norm(b, p).reshape(1))
      else:
        b.abs_()
        b.mul_(scale)
        b.pow_(p)
        parts.append(b.sum().reshape(1))
      pending, filled = [], 0

    for leaf in batch.leaves:
      if leaf.numel == 0 or (plain and (whole or leaf.numel <= self.CHUNK)):
        continue
      flat = leaf.x.reshape(-1)
      n, i = flat.numel(), 0
      while i < n:
        k = min(self.CHUNK - filled, n - i)
        pending.append(flat[i:i + k])
        filled += k
        i += k
        if filled == self.CHUNK:
          flush()
    if filled:
      flush()
    values = torch.cat(parts).cpu().tolist() if parts else []
    for r in (torch.cat(roots).cpu().tolist() if roots else []):
      values.append(r * r if p == 2 else r)  # the square adds two roundings: depth + 2
    if not values:
      return 0.0, 1
    if not all(math.isfinite(v) for v in values):
      return sum(values), 1
    # Each value sums at most max(CHUNK, the largest leaf read whole) terms in float64 (a norm
    # squared back adds two roundings), and fsum adds one: any tree of that depth, + 4.
    return math.fsum(values), max([self.CHUNK, *(x.numel() for x in small)]) + 4

  def _row_power_sums(self, leaf: Leaf, p: float, scale: torch.Tensor | None,
                      buf: torch.Tensor) -> torch.Tensor:
    """Per-row float64 sums of (|x| * scale[seg])**p for one leaf."""
    m = leaf.matrix()
    out = torch.empty(leaf.rows, dtype=torch.float64, device=m.device)
    width = leaf.width
    step = max(1, self.CHUNK // width)
    for r0 in range(0, leaf.rows, step):
      r1 = min(leaf.rows, r0 + step)
      b = load_block(buf, m[r0:r1])
      if p == 2 and scale is None:
        b.square_()
      else:
        b.abs_()
        if scale is not None:
          b.mul_(gather(scale, leaf.seg[r0:r1]).unsqueeze(1))
        if p != 1:
          b.pow_(p)
      row_sums(b, out[r0:r1])
    return out

  @staticmethod
  def _system_sums(row: torch.Tensor, leaf: Leaf, K: int) -> torch.Tensor:
    if leaf.sorted:
      # The contiguous layout: sum each system's run of rows by its offsets.
      return torch.segment_reduce(row, "sum", lengths=leaf.counts, unsafe=True)
    return torch.zeros(K, dtype=torch.float64, device=row.device).index_add_(0, leaf.seg, row)

  # ------------------------------------------------------------------------ maxima, minima
  def extremes(self, batch: Batch, want_min: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Exact max |x| (NaN if any NaN) and, if asked, min |x| per system (0 when empty)."""
    K = batch.num_systems
    dev = batch.device
    big = torch.zeros(K, dtype=torch.float64, device=dev)
    small = torch.full((K,), math.inf, dtype=torch.float64, device=dev) if want_min else None
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      m = leaf.matrix()
      host = branches.on_host(dev)
      step = max(1, self.CHUNK // max(leaf.width, 1)) if host else leaf.rows
      if leaf.seg is None:
        flat = leaf.x.reshape(-1)
        size = self.CHUNK if host else flat.numel()
        for a in range(0, flat.numel(), size):
          b = flat[a:a + size]
          big[0] = torch.maximum(big[0], torch.linalg.vector_norm(b, math.inf).double())
          if want_min:
            small[0] = torch.minimum(small[0], torch.linalg.vector_norm(b, -math.inf).double())
        continue
      hi = torch.empty(leaf.rows, dtype=torch.float64, device=dev)
      lo = torch.empty(leaf.rows, dtype=torch.float64, device=dev) if want_min else None
      for r0 in range(0, leaf.rows, step):
        b = m[r0:r0 + step]
        hi[r0:r0 + step] = torch.linalg.vector_norm(b, math.inf, dim=1)
        if want_min:
          lo[r0:r0 + step] = torch.linalg.vector_norm(b, -math.inf, dim=1)
      big.scatter_reduce_(0, leaf.seg, hi, "amax")
      if want_min:
        small.scatter_reduce_(0, leaf.seg, lo, "amin")
    big = big.cpu().numpy()
    if want_min:
      small = small.cpu().numpy()
      small[batch.counts == 0] = 0.0
    return big, small

  # ----------------------------------------------------------------------------- step norms
  def step_sums(self, batch: Batch) -> tuple[np.ndarray, int]:
    """Largest float64 sum of squares of a step vector per system; and the vector length."""
    K = batch.num_systems
    dev = batch.device
    best = torch.zeros(K, dtype=torch.float64, device=dev)
    buf = torch.empty(self.CHUNK, dtype=torch.float64, device=dev)
    longest = 1
    for leaf in batch.leaves:
      if leaf.numel == 0 or leaf.vec == 0:
        continue
      longest = max(longest, leaf.vec)
      row = self._row_step_sums(leaf, buf)
      if leaf.seg is None:
        best[0] = torch.maximum(best[0], row.max())
      else:
        best.scatter_reduce_(0, leaf.seg, row, "amax")
    return best.cpu().numpy(), longest

  def _row_step_sums(self, leaf: Leaf, buf: torch.Tensor) -> torch.Tensor:
    m = leaf.matrix()
    vec, per_row = leaf.vec, leaf.width // leaf.vec
    out = torch.empty(leaf.rows, dtype=torch.float64, device=m.device)
    step = max(1, self.CHUNK // leaf.width)
    for r0 in range(0, leaf.rows, step):
      r1 = min(leaf.rows, r0 + step)
      b = load_block(buf, m[r0:r1]).square_()
      v = b.reshape(-1, vec)
      if per_row == 1:
        row_sums(v, out[r0:r1])
      else:
        sq = torch.empty(v.shape[0], dtype=torch.float64, device=m.device)
        row_sums(v, sq)
        torch.amax(sq.reshape(r1 - r0, per_row), 1, out=out[r0:r1])
    return out

  # ---------------------------------------------------- float64: sums by error-free extraction
  def accurate_sums(self, batch: Batch, p: int,
                    scale: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-system pieces of sum (|x| * a_k * b_k)**p (p = 1, 2; every term <= 1).

    ``q1, q2, qt`` are exact sums (extracted parts on a grid fixed by a per-system power of
    two, so any order is exact); ``rest`` is a plain float64 sum of small remainders whose
    error is bounded by ``bound`` (absolute).
    """
    K = batch.num_systems
    dev = batch.device
    n = np.maximum(batch.counts, 1)
    grow = np.ldexp(1.0, np.array([int(v).bit_length() + 2 for v in n], dtype=np.int64))
    sig1 = grow  # terms <= 1
    sig2 = sig1 * U64 * grow
    sigt = 2.0 ** -24 * grow
    params = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=dev) for v in
                          (scale[0], scale[1], sig1, sig2, sigt)], 1)  # (K, 5)
    acc, depth = self._accumulate_pieces(batch, p, params)
    out = dict(zip(("q1", "q2", "qt", "rest"), acc.T))
    # |rest| per element: remainder bounds plus the tail yl**2 <= 2**-50 y**2.
    per_elem = U64 * sig2 + (U64 * sigt if p == 2 else 0.0)
    tail = 2.0 ** -50 * (out["q1"] + out["q2"] + out["qt"] + 1.0) if p == 2 else 0.0
    total_abs = n * per_elem * (1 + 4 * U64) + tail
    out["bound"] = (gamma(depth) * total_abs + n * 2 * U64 * per_elem
                    + n * 2.0 ** -100 + n * 2.0 ** -1070)
    return out

  def _accumulate_pieces(self, batch: Batch, p: int,
                         params: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(K, 4) sums of the pieces per system, and the depth bound of the ``rest`` sums."""
    K = batch.num_systems
    acc = torch.zeros(K, 4, dtype=torch.float64, device=batch.device)
    rows_total = 0
    for leaf in batch.leaves:
      if leaf.numel == 0:
        continue
      if leaf.seg is None:
        for block in global_blocks(leaf.x.reshape(-1), self.CHUNK):
          for part in self._row_blocks(block):
            rows = self._piece_row_sums(part, p, params[0].expand(part.shape[0], 5))
            acc[0] += rows.sum(0)
          rows_total += block.shape[0]
      else:
        m = leaf.matrix()
        for part, r0 in zip(self._row_blocks(m), range(0, leaf.rows, self._rows_per_block(m))):
          seg = leaf.seg[r0:r0 + part.shape[0]]
          rows = self._piece_row_sums(part, p, gather(params, seg))
          # One flat index_add_ (the (rows, 4) form adds slice by slice: much slower on CPU).
          flat_index = (seg.unsqueeze(1) * 4 + torch.arange(4, device=seg.device)).reshape(-1)
          acc.view(-1).index_add_(0, flat_index, rows.reshape(-1))
    if batch.per_system:
      depth = batch.counts + len(batch.leaves) + 4
    else:
      depth = np.full(K, self.CHUNK + rows_total + len(batch.leaves) + 4)
    return acc.cpu().numpy(), depth

  def _piece_row_sums(self, m: torch.Tensor, p: int, params: torch.Tensor) -> torch.Tensor:
    """(rows, 4) row sums of the extracted pieces q1, q2, qt, rest of one block."""
    return piece_row_sums(m, params, p)

  def _rows_per_block(self, m: torch.Tensor) -> int:
    """Rows per block: blocks below the parallel grain on CPU, everything at once elsewhere."""
    if not branches.on_host(m.device):
      return max(1, m.shape[0])
    return max(1, self.CHUNK // max(m.shape[1], 1))

  def _row_blocks(self, m: torch.Tensor) -> list[torch.Tensor]:
    step = self._rows_per_block(m)
    return [m[r0:r0 + step] for r0 in range(0, m.shape[0], step)]

  # --------------------------------------------------------------------------------- apply
  def apply(self, batch: Batch, plan: Plan) -> list[torch.Tensor]:
    if not batch.per_system:
      return apply_global(batch.leaves, plan, self.CHUNK)
    return [apply_leaf(leaf, plan, self.CHUNK) for leaf in batch.leaves]



def load_block(buf: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
  """block (rows, width) copied into the float64 scratch buffer."""
  b = buf[:block.numel()].view(block.shape)
  b.copy_(block)
  return b


def row_sums(b: torch.Tensor, out: torch.Tensor) -> None:
  """out = b.sum(1); narrow rows are added column by column (torch's inner reduction is slow)."""
  width = b.shape[1]
  if width > 4:
    torch.sum(b, 1, out=out)
    return
  out.copy_(b[:, 0])
  for j in range(1, width):
    out.add_(b[:, j])


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


def global_blocks(flat: torch.Tensor, chunk: int) -> list[torch.Tensor]:
  """A flat leaf as (rows, chunk) plus a one-row tail: sums of depth <= chunk + rows."""
  m = (flat.numel() // chunk) * chunk
  blocks = [flat[:m].reshape(-1, chunk)] if m else []
  if m < flat.numel():
    blocks.append(flat[m:].reshape(1, -1))
  return blocks
