"""Output memory: one aligned buffer per dtype, recycled, and leaf data addresses.

Outputs are new arrays, views of one buffer per dtype. Leaves long enough to be streamed
start on 64-byte boundaries (so do all their blocks: the apply pass streams them); the others
follow, packed. Large buffers are recycled once every view of an earlier result is gone,
because first-touch page faults on fresh memory cost about one more pass.
"""

from __future__ import annotations

import contextlib
import functools
import contextvars
import sys
import threading
from typing import Any

import numpy as np
from numba import njit

from clipbench.impls.own.numba.decode import DTYPES, ITEMSIZE
from clipbench.impls.own.numba.streaming import STREAM_MIN


class BufferPool:
  """Recycles large output buffers once no output view of them is alive.

  A fresh multi-megabyte buffer costs the kernel a page fault and a zero fill per page, about
  one more pass over the data. A buffer handed out earlier is reused only when its reference
  count shows that nothing but this pool holds it, so a returned leaf never shares memory
  with another live result; it behaves like any allocator's free list (torch's caching
  allocator works the same way). ``release_buffers()`` empties it.
  """

  MIN_BYTES = 1 << 20
  MAX_FREE_PER_SIZE = 2
  MAX_BYTES = 1 << 31

  def __init__(self):
    self._lock = threading.Lock()
    self._buffers: dict[tuple[np.dtype, int], list[np.ndarray]] = {}

  def empty(self, n: int, dtype: np.dtype) -> np.ndarray:
    """An array of n elements of ``dtype`` that no live result shares."""
    if n * dtype.itemsize < self.MIN_BYTES:
      return np.empty(n, dtype=dtype)
    key = (dtype, n)
    with self._lock:
      entries = self._buffers.setdefault(key, [])
      # Held by the list and by getrefcount's argument only: every view of it is gone.
      free = [i for i in range(len(entries)) if sys.getrefcount(entries[i]) == 2]
      if free:
        return entries[free[0]]
      buf = np.empty(n, dtype=dtype)
      if self._total() + buf.nbytes <= self.MAX_BYTES:
        entries.append(buf)
      return buf

  def _total(self) -> int:
    # Entries whose views are all gone beyond MAX_FREE_PER_SIZE per size are dropped first.
    for entries in self._buffers.values():
      free = [i for i in range(len(entries)) if sys.getrefcount(entries[i]) == 2]
      for i in reversed(free[self.MAX_FREE_PER_SIZE:]):
        del entries[i]
    return sum(b.nbytes for v in self._buffers.values() for b in v)

  def clear(self) -> None:
    with self._lock:
      self._buffers.clear()


_BUFFERS = BufferPool()


def release_buffers() -> None:
  """Drops the recycled output buffers (memory of live results is unaffected)."""
  _BUFFERS.clear()


@njit(nogil=True, cache=True)
def _data_address(x):
  return x.ctypes.data


_NUMBA_TYPED = frozenset((np.dtype(np.float32), np.dtype(np.float64)))


def address(x: np.ndarray) -> int:
  """The data address of an array."""
  # A compiled call is several times cheaper than the array interface, and W1 asks for
  # hundreds of addresses per call; numba does not type bfloat16 (nor, fully, float16).
  if x.dtype in _NUMBA_TYPED:
    return _data_address(x)
  return x.__array_interface__["data"][0]


class _ArrayAt:
  """An object whose array interface is memory at an address (NumPy wraps it without a copy)."""

  __slots__ = ("__array_interface__",)

  def __init__(self, address: int, shape: tuple[int, ...], dtype: np.dtype, readonly: bool):
    self.__array_interface__ = {"data": (address, readonly), "shape": shape,
                                "typestr": dtype.str, "version": 3}


def array_at(address: int, shape: tuple[int, ...], dtype: np.dtype, readonly: bool) -> np.ndarray:
  """The C-contiguous array of ``shape`` and ``dtype`` at ``address`` (no copy)."""
  if 0 in shape:
    return np.empty(shape, dtype=dtype)
  return np.asarray(_ArrayAt(address, shape, dtype, readonly)).view(dtype)


class LeavesAt:
  """C-contiguous leaves known by data address, shape and dtype (XLA's operand and result
  buffers on the JAX FFI route): a sequence whose arrays are made only where one is indexed.
  The kernels read ``addresses`` directly; making hundreds of arrays per call (W1's 200
  leaves) cost about 0.3-0.5 ms."""

  def __init__(self, addresses: np.ndarray, shapes: tuple, dtypes: tuple, readonly: bool):
    self.addresses = np.ascontiguousarray(addresses, dtype=np.int64)
    self.shapes = shapes
    self.dtypes = dtypes
    self._readonly = readonly

  def __len__(self) -> int:
    return len(self.addresses)

  def __getitem__(self, i: int) -> np.ndarray:
    return array_at(int(self.addresses[i]), self.shapes[i], self.dtypes[i], self._readonly)

  def __iter__(self):
    return (self[i] for i in range(len(self)))


_DESTINATION: contextvars.ContextVar[list[np.ndarray] | None] = contextvars.ContextVar(
    "clipbench_numba_destination", default=None)


@contextlib.contextmanager
def writing_into(outputs: list[np.ndarray]):
  """Within it, the kernels write their output leaves into ``outputs`` (C-contiguous arrays of
  the leaves' shapes and dtypes, not overlapping the inputs) instead of new buffers: how XLA's
  result buffers (the JAX FFI route) are filled without a copy. A sequence with an
  ``addresses`` attribute (int64 data addresses) need not make its arrays until indexed."""
  token = _DESTINATION.set(outputs if hasattr(outputs, "addresses") else list(outputs))
  try:
    yield
  finally:
    _DESTINATION.reset(token)


def new_outputs(codes: np.ndarray, sizes: np.ndarray,
                shapes: list[tuple[int, ...]]) -> tuple[list[np.ndarray], np.ndarray]:
  """Fresh output leaves (views of one buffer per dtype) and their data addresses, or the
  destination of an enclosing :func:`writing_into`."""
  destination = _DESTINATION.get()
  if destination is not None:
    if len(destination) != codes.size:
      raise ValueError(f"writing_into: {len(destination)} outputs for {codes.size} leaves")
    addresses = getattr(destination, "addresses", None)  # known without making the arrays
    if addresses is None:
      addresses = np.array([address(o) if o.size else 0 for o in destination], dtype=np.int64)
    return destination, addresses
  outs: list[Any] = [None] * codes.size
  out_addrs = np.zeros(codes.size, dtype=np.int64)
  for code, idx, starts, code_sizes, where, byte_starts, elements in _output_plan(
      np.asarray(codes, dtype=np.int8).tobytes(), np.asarray(sizes, dtype=np.int64).tobytes()):
    itemsize = int(ITEMSIZE[code])
    raw = _BUFFERS.empty(elements + 64 // itemsize, DTYPES[code])
    buf = raw[(-address(raw) % 64) // itemsize:]
    out_addrs[where] = address(buf) + byte_starts
    _split_views(buf, idx, starts, code_sizes, shapes, outs)
  return outs, out_addrs


@functools.lru_cache(maxsize=64)
def _output_plan(codes: bytes, sizes: bytes) -> tuple[tuple[Any, ...], ...]:
  """Where each leaf's output goes in its dtype's buffer, for leaves of these int8 dtype codes
  and int64 sizes (as bytes): per dtype code present, (code, leaf indices, their starts and
  sizes in elements (lists), the indices and starts in bytes (arrays), buffer elements).
  Calls in a loop repeat their layout, which then costs a lookup instead of a dozen array
  operations per dtype."""
  code_of = np.frombuffer(codes, dtype=np.int8)
  size_of = np.frombuffer(sizes, dtype=np.int64)
  plan = []
  for code in range(4):
    idx = np.flatnonzero(code_of == code)
    if not idx.size:
      continue
    # Leaves long enough to be streamed come first, each starting on a 64-byte boundary
    # (so are all their blocks); the others follow, packed.
    code_sizes = size_of[idx]
    large = code_sizes >= STREAM_MIN
    idx = np.concatenate([idx[large], idx[~large]])
    code_sizes = np.concatenate([code_sizes[large], code_sizes[~large]])
    align = 64 // int(ITEMSIZE[code])
    slots = np.where(np.arange(code_sizes.size) < np.count_nonzero(large),
                     -(-code_sizes // align) * align, code_sizes)
    starts = np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(np.int64)
    byte_starts = starts * ITEMSIZE[code]
    idx.flags.writeable = byte_starts.flags.writeable = False  # shared by every call
    plan.append((code, idx.tolist(), starts.tolist(), code_sizes.tolist(), idx, byte_starts,
                 int(slots.sum())))
  return tuple(plan)


def _split_views(buf, idx, starts, sizes, shapes, outs) -> None:
  """outs[i] = buf[start:start+size].reshape(shape); a run of equal shapes is cut at C speed."""
  j = 0
  n = len(idx)
  while j < n:
    shape = shapes[idx[j]]
    k = j + 1
    while k < n and shapes[idx[k]] == shape and starts[k] == starts[k - 1] + sizes[k - 1]:
      k += 1
    if k - j > 1 and len(shape) >= 1:
      block = buf[starts[j]:starts[j] + sizes[j] * (k - j)].reshape((k - j,) + shape)
      for i, view in zip(idx[j:k], block):
        outs[i] = view
    else:
      for t in range(j, k):
        outs[idx[t]] = buf[starts[t]:starts[t] + sizes[t]].reshape(shapes[idx[t]])
    j = k
