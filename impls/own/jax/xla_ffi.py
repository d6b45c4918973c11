"""A Python function as an XLA FFI handler on the CPU: how a jitted graph calls the numba kernels.

Why a handler of our own rather than ``jax.pure_callback``: a callback's results are copied
from the NumPy arrays it returns into XLA's result buffers, one more pass over every output
(about half the kernel's own time on W1), and its operands may be copied too. An XLA FFI
custom call hands the handler XLA's own operand and result buffers, so the numba kernels read
the leaves in place and write the outputs straight into XLA's results (``buffers.writing_into``).

The handler is a ``ctypes`` callback (it takes the GIL while it parses the call frame; the
kernels release it again). It speaks the typed XLA FFI C API (``xla/ffi/api/c_api.h``, shipped
with jaxlib under ``jax.ffi.include_dir()``): it answers the metadata query XLA makes when the
target is registered (API version), ignores the stages other than execute, and turns a Python
exception into an XLA error, which JAX raises to the caller with its message. Only the struct
fields read here are declared; their offsets are fixed by the C API (ABI-stable within major
version 0, checked by ``test_xla_ffi``).

Per call the handler needs only the operands' and results' data addresses: shapes and dtypes
were fixed when the call was traced and are looked up by the key each call carries as its first
operand (a compiled loop reads the addresses, so a call with hundreds of leaves costs
microseconds, not a Python loop over ctypes structs).
"""

from __future__ import annotations

import ctypes
import threading
import traceback
from typing import Any, Callable

import jax
import numpy as np
from numba import njit

from clipbench.impls.own.numba.buffers import array_at
from clipbench.impls.own.numba.cache_guard import cache_dir_of, clear_if_stale
from clipbench.impls.own.numba.intrinsics import JIT, ptr_i64

API_MAJOR, API_MINOR = 0, 5  # the FFI version this handler speaks (c_api.h XLA_FFI_API_*)
_METADATA_EXTENSION = 1  # XLA_FFI_Extension_Metadata
_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_INVALID_ARGUMENT = 3  # XLA_FFI_Error_Code_INVALID_ARGUMENT
_BUFFER_DATA_OFFSET = 24  # offsetof(XLA_FFI_Buffer, data)
_ERROR_CREATE_OFFSET = 48  # offsetof(XLA_FFI_Api, XLA_FFI_Error_Create)


class _Extension(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
              ("next", ctypes.c_void_p)]


class _ApiVersion(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
              ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class _Metadata(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion),
              ("traits", ctypes.c_uint32), ("state_type_id", ctypes.c_int64)]


class _MetadataExtension(ctypes.Structure):
  _fields_ = [("extension_base", _Extension), ("metadata", ctypes.POINTER(_Metadata))]


class _List(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets
  _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
              ("size", ctypes.c_int64), ("types", ctypes.c_void_p), ("items", ctypes.c_void_p)]


class _Attrs(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
              ("size", ctypes.c_int64), ("types", ctypes.c_void_p), ("names", ctypes.c_void_p),
              ("attrs", ctypes.c_void_p)]


class _CallFrame(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.POINTER(_Extension)),
              ("api", ctypes.c_void_p), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
              ("args", _List), ("rets", _List), ("attrs", _Attrs), ("future", ctypes.c_void_p)]


class _ErrorCreateArgs(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
              ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))
_ERROR_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorCreateArgs))


@njit(**JIT)
def _data_addresses(items, n, out):
  """out[i] = the data address of the i-th XLA_FFI_Buffer of a ``void**`` list at ``items``."""
  buffers = ptr_i64(items)
  for i in range(n):
    out[i] = ptr_i64(buffers[i] + _BUFFER_DATA_OFFSET)[0]


clear_if_stale(cache_dir_of(_data_addresses))  # it inlines ptr_i64 of another module


def data_addresses(items: int, n: int) -> np.ndarray:
  out = np.empty(n, dtype=np.int64)
  if n:
    _data_addresses(items, n, out)
  return out


def _error(api: int, message: str) -> int:
  """A new XLA_FFI_Error (XLA takes ownership) carrying ``message``."""
  create = _ERROR_CREATE(ctypes.c_void_p.from_address(api + _ERROR_CREATE_OFFSET).value)
  args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None,
                          message.encode("utf-8", "replace"), _INVALID_ARGUMENT)
  return create(ctypes.byref(args)) or 0


Body = Callable[[int, np.ndarray, np.ndarray], None]
"""body(key, operand addresses (past the key), result addresses): fills the results."""


def _handler(body: Body):
  def handle(frame_pointer):
    frame = frame_pointer.contents
    if frame.extension_start:
      ext = frame.extension_start.contents
      if ext.type == _METADATA_EXTENSION:
        metadata = ctypes.cast(frame.extension_start,
                               ctypes.POINTER(_MetadataExtension)).contents.metadata.contents
        metadata.api_version.major_version = API_MAJOR
        metadata.api_version.minor_version = API_MINOR
        metadata.traits = 0
        return 0
    if frame.stage != _EXECUTE:
      return 0
    try:
      args = data_addresses(frame.args.items, frame.args.size)
      rets = data_addresses(frame.rets.items, frame.rets.size)
      key = int(array_at(int(args[0]), (), np.dtype(np.int32), True))
      body(key, args[1:], rets)
      return 0
    except BaseException as e:  # noqa: BLE001 -- nothing may escape a C callback
      message = f"{type(e).__name__}: {e}"
      if not isinstance(e, (ValueError, TypeError)):
        message += "\n" + traceback.format_exc()
      return _error(frame.api, message)
  return _HANDLER(handle)


_REGISTERED: dict[str, Any] = {}  # name -> the ctypes callback (kept alive for the process)
_LOCK = threading.Lock()


def register(name: str, body: Body) -> None:
  """Registers ``body`` as the CPU FFI target ``name`` (once per process)."""
  with _LOCK:
    if name in _REGISTERED:
      return
    callback = _handler(body)
    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype = ctypes.py_object
    capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = capsule_new(ctypes.cast(callback, ctypes.c_void_p).value,
                          b"xla._CUSTOM_CALL_TARGET", None)
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _REGISTERED[name] = callback
