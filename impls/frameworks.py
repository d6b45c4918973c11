"""Moving arrays between numpy and the frameworks implementations run on.

The conformance suite and the benchmarks build inputs in numpy (bfloat16 through ml_dtypes)
and hand each implementation arrays of its own framework; results come back as numpy. Nothing
here changes a value: every conversion is exact, including bfloat16 and float16.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def import_tensorflow():
  """Imports tensorflow; triton first when present: importing triton after tensorflow crashes
  the process (segfault in triton/runtime, tensorflow 2.20 + triton 3.8)."""
  if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: F401
  import tensorflow as tf
  return tf


def to_framework(x: np.ndarray, framework: str, device: str = "cpu") -> Any:
  """Returns ``x`` as an array of ``framework`` on ``device``, bit for bit."""
  x = np.asarray(x)
  if framework == "numpy":
    return x.copy()
  if framework == "jax":
    import jax
    import jax.numpy as jnp
    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    return jax.device_put(jnp.asarray(x), dev)
  if framework == "torch":
    import torch
    if x.dtype == BFLOAT16:
      t = _torch_bf16_from_bits(x)
    else:
      t = torch.from_numpy(np.array(x, order="C", copy=True))  # keeps 0-d arrays 0-d
    return t.to(device)
  if framework == "tensorflow":
    tf = import_tensorflow()
    if x.dtype == BFLOAT16:
      return tf.cast(tf.constant(x.astype(np.float32)), tf.bfloat16)
    return tf.constant(x)
  raise ValueError(f"framework: unknown framework {framework!r}")


def copy_into(target: Any, x: np.ndarray) -> None:
  """Writes ``x`` into the mutable array ``target`` (a torch tensor or a numpy array) in place,
  bit for bit: how a benchmark gives an in-place implementation fresh values in the same arrays
  (JAX and TensorFlow arrays are immutable, and no implementation of theirs clips in place)."""
  module = type(target).__module__
  if module.startswith("torch"):
    target.copy_(to_framework(x, "torch", str(target.device)))
  elif isinstance(target, np.ndarray):
    np.copyto(target, np.asarray(x, dtype=target.dtype))
  else:
    raise TypeError(f"target: expected a torch tensor or a numpy array, got {type(target)!r}")


def _torch_bf16_from_bits(x: np.ndarray):
  import torch
  bits = np.array(x, order="C", copy=True).view(np.int16)
  return torch.from_numpy(bits).view(torch.bfloat16)


def to_numpy(x: Any) -> np.ndarray:
  """Returns a framework array (or a Python/numpy scalar) as a numpy array, bit for bit."""
  if x is None:
    return None
  if isinstance(x, np.ndarray):
    return x
  if isinstance(x, (np.generic, float, int)):
    return np.asarray(x)
  module = type(x).__module__
  if module.startswith("torch"):
    import torch
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
      return x.view(torch.int16).numpy().view(BFLOAT16).copy()
    return x.numpy().copy()
  if module.startswith("tensorflow") or hasattr(x, "numpy") and "tensorflow" in repr(type(x)):
    return np.asarray(x.numpy())
  # jax arrays and anything else exposing __array__.
  return np.asarray(x)


def block_until_ready(x: Any) -> Any:
  """Waits for asynchronous device work on ``x`` (a result tuple, list or array).

  Each CUDA device of the torch tensors in ``x`` is synchronized once: one synchronization
  per output tensor would put thousands of host round trips into a timed call (W4 returns
  10,000 tensors), on both sides of every comparison.
  """
  cuda_devices: set = set()
  loaded = sys.modules.get("torch")  # a result holds torch tensors only where torch is loaded
  _wait_for(x, cuda_devices, loaded.Tensor if loaded is not None else ())
  if cuda_devices:
    import torch
    for device in cuda_devices:
      torch.cuda.synchronize(device)
  return x


def _wait_for(x: Any, cuda_devices: set, tensor: type | tuple) -> None:
  # torch tensors are read directly, before the generic tests below (a failed attribute
  # lookup each): a timed call may return 10,000 of them (W4).
  if isinstance(x, tensor):
    if x.is_cuda:
      cuda_devices.add(x.device)
  elif isinstance(x, (list, tuple)):
    for item in x:
      if isinstance(item, tensor):
        if item.is_cuda:
          cuda_devices.add(item.device)
      else:
        _wait_for(item, cuda_devices, tensor)
  elif hasattr(x, "block_until_ready"):
    x.block_until_ready()
  elif type(x).__module__.startswith("torch") and getattr(x, "is_cuda", False):
    cuda_devices.add(x.device)


def framework_available(framework: str) -> bool:
  name = {"numpy": "numpy", "jax": "jax", "torch": "torch", "tensorflow": "tensorflow"}[framework]
  return importlib.util.find_spec(name) is not None


def cuda_available() -> bool:
  if importlib.util.find_spec("torch") is None:
    return False
  import torch
  return torch.cuda.is_available()
