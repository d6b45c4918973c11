"""Devices in one spelling for every framework, and arrays placed on them and checked there.

A device is ``cpu[:N]`` or ``cuda[:N]`` (``N`` defaults to 0 and is left out when 0, so
``cuda:0`` reads ``cuda``). Each framework names the same device its own way: torch
``cuda:1``, JAX the second device of its ``gpu`` platform, TensorFlow ``/device:GPU:1``; the
host's ``cpu:1`` exists only in JAX, when the process was started with several host devices
(``--xla_force_host_platform_device_count``, read once when JAX starts).

The conformance suite builds its inputs on the host in numpy, converts them to the
implementation's framework (``clipbench.impls.frameworks``), then moves them here, explicitly,
to the device (:func:`put`); after the call it asks where each output is (:func:`where`).
Nothing here imports a framework until an array of it is placed or inspected.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import sys
from typing import Any

KINDS = ("cpu", "cuda")
_SPEC = re.compile(r"(?P<kind>[a-z]+)(?::(?P<index>\d+))?")
# The platform each framework calls a kind by.
_JAX_PLATFORM = {"cpu": "cpu", "cuda": "gpu"}
_TF_TYPE = {"cpu": "CPU", "cuda": "GPU"}


class DeviceUnavailable(Exception):
  """The device cannot be reached here, by this framework (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Device:
  """One device: its kind (``cpu`` or ``cuda``) and its index among the devices of that kind."""

  kind: str = "cpu"
  index: int = 0

  def __post_init__(self) -> None:
    if self.kind not in KINDS:
      raise ValueError(f"device: expected a kind in {KINDS}, got {self.kind!r}")
    if not isinstance(self.index, int) or self.index < 0:
      raise ValueError(f"device: expected an index >= 0, got {self.index!r}")

  def __str__(self) -> str:
    return self.kind if self.index == 0 else f"{self.kind}:{self.index}"

  @property
  def is_host(self) -> bool:
    return self.kind == "cpu"


HOST = Device()


def parse(spec: str | Device) -> Device:
  """``cpu``, ``cpu:1``, ``cuda``, ``cuda:0``... as a :class:`Device`.

  Raises:
    ValueError: ``spec`` is not ``cpu[:N]`` or ``cuda[:N]`` (the message names ``device``).
  """
  if isinstance(spec, Device):
    return spec
  match = _SPEC.fullmatch(spec.strip().lower()) if isinstance(spec, str) else None
  if match is None or match["kind"] not in KINDS:
    raise ValueError(f"device: expected cpu[:N] or cuda[:N], got {spec!r}")
  return Device(match["kind"], int(match["index"] or 0))


_HOST_DEVICE_COUNT = "--xla_force_host_platform_device_count"

# Frameworks sharing one card: JAX takes 75% of its memory when it starts, and TensorFlow all
# of it, unless told to grow as needed; torch's caching allocator grows as needed already.
SHARED_CARD_ENVIRONMENT = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                           "TF_FORCE_GPU_ALLOW_GROWTH": "true"}


def xla_flags_with_host_devices(flags: str, count: int) -> str:
  """``flags`` (an ``XLA_FLAGS`` value) asking JAX for ``count`` host devices, its other flags
  kept."""
  kept = [f for f in flags.split() if not f.startswith(_HOST_DEVICE_COUNT)]
  return " ".join([*kept, f"{_HOST_DEVICE_COUNT}={count}"])


def environment(device: Device, base: dict[str, str]) -> dict[str, str]:
  """The variables a process that runs on ``device`` needs set before its frameworks start,
  given its environment ``base`` (whose own settings win):

  * ``cpu:N``: JAX with N + 1 host devices (``XLA_FLAGS``, read once, when JAX starts);
  * ``cuda``: :data:`SHARED_CARD_ENVIRONMENT`, so that processes of several frameworks, or
    several processes, share one card.
  """
  if device.is_host:
    if not device.index:
      return {}
    return {"XLA_FLAGS": xla_flags_with_host_devices(base.get("XLA_FLAGS", ""),
                                                     device.index + 1)}
  return {k: v for k, v in SHARED_CARD_ENVIRONMENT.items() if k not in base}


def requested(spec: str | Device) -> Device:
  """A device asked for (``--device``), checked before anything loads.

  What the frameworks read once, when they start (:func:`environment`) is set in this
  process's environment, so that it and its children start them that way; a framework that
  started already keeps what it read.

  Raises:
    ValueError: ``spec`` is not ``cpu[:N]`` or ``cuda[:N]``, or it is ``cuda`` on a machine
      without an NVIDIA device node (the message names ``device``).
  """
  device = parse(spec)
  if device.kind == "cuda" and not cuda_device_node_present():
    raise ValueError(f"device {device}: no CUDA GPU on this machine (no /dev/nvidia* device "
                     "node)")
  if "jax" not in sys.modules:
    os.environ.update(environment(device, dict(os.environ)))
  return device


def cuda_device_node_present() -> bool:
  """A cheap, import-free test for an NVIDIA GPU, checked before loading any framework."""
  return os.path.exists("/dev/nvidiactl") or bool(glob.glob("/dev/nvidia[0-9]*"))


@functools.cache
def framework_device(device: Device, framework: str) -> Any:
  """What ``framework`` calls ``device`` (None for numpy, which has the host only).

  Cached: a process's devices do not change once its framework has started.

  Raises:
    DeviceUnavailable: the framework cannot reach the device here (no GPU, no CUDA backend,
      fewer devices of that kind than the index).
  """
  if framework == "numpy":
    if device != HOST:
      raise DeviceUnavailable(f"numpy arrays live on the host (cpu) only, not on {device}")
    return None
  if framework == "torch":
    return _torch_device(device)
  if framework == "jax":
    return _jax_device(device)
  if framework == "tensorflow":
    return _tensorflow_device(device)
  raise ValueError(f"framework: unknown framework {framework!r}")


def _torch_device(device: Device) -> Any:
  import torch
  if device.is_host:
    if device.index:
      raise DeviceUnavailable(f"torch has one host device (cpu), not {device}")
    return torch.device("cpu")
  count = torch.cuda.device_count() if torch.cuda.is_available() else 0
  if device.index >= count:
    raise DeviceUnavailable(f"torch sees {count} CUDA device(s); {device} is not one")
  return torch.device("cuda", device.index)


def _jax_device(device: Device) -> Any:
  import jax
  platform = _JAX_PLATFORM[device.kind]
  try:
    found = jax.devices(platform)
  except RuntimeError as e:
    hint = (" (JAX's CUDA plugin is not installed: pip install 'clipbench[cuda]')"
            if device.kind == "cuda" else "")
    raise DeviceUnavailable(f"jax has no {platform} backend{hint}: "
                            f"{str(e).splitlines()[0]}") from None
  if device.index >= len(found):
    hint = (f"; start the process with XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{device.index + 1} (read once, when JAX starts)" if device.is_host else "")
    raise DeviceUnavailable(f"jax has {len(found)} {platform} device(s); {device} is not "
                            f"one{hint}")
  return found[device.index]


def _tensorflow_device(device: Device) -> str:
  from clipbench.impls import frameworks
  tf = frameworks.import_tensorflow()
  kind = _TF_TYPE[device.kind]
  found = tf.config.list_logical_devices(kind)
  if device.index >= len(found):
    raise DeviceUnavailable(f"tensorflow has {len(found)} {kind} device(s); {device} is not "
                            "one")
  # TensorFlow places an op on another device, silently, when the named one is missing: the
  # count above is what makes the name a promise.
  return f"/device:{kind}:{device.index}"


def count(kind: str, framework: str) -> int:
  """How many devices of ``kind`` ``framework`` reaches in this process (0: none)."""
  found = 0
  while True:
    try:
      framework_device(Device(kind, found), framework)
    except DeviceUnavailable:
      return found
    found += 1


def put(x: Any, device: Device, framework: str) -> Any:
  """``x`` (an array of ``framework``) on ``device``; anything else unchanged.

  Raises:
    DeviceUnavailable: as :func:`framework_device`.
  """
  target = framework_device(device, framework)
  if framework == "torch":
    import torch
    return x.to(target) if isinstance(x, torch.Tensor) else x
  if framework == "jax":
    import jax
    return jax.device_put(x, target) if isinstance(x, jax.Array) else x
  if framework == "tensorflow":
    from clipbench.impls import frameworks
    tf = frameworks.import_tensorflow()
    if not tf.is_tensor(x):
      return x
    with tf.device(target):
      return tf.identity(x)
  return x


DELETED = "deleted"


def where(x: Any, framework: str) -> str | None:
  """The device an array of ``framework`` lives on, in this module's spelling (``cuda:1``;
  several devices of a sharded array joined by ``+``; :data:`DELETED` for a JAX array whose
  buffer is gone); None for anything else (a host scalar, None, an array of another
  framework)."""
  if framework == "torch":
    import torch
    if not isinstance(x, torch.Tensor):
      return None
    return _spelled(x.device.type, x.device.index or 0)
  if framework == "jax":
    import jax
    if not isinstance(x, jax.Array):
      return None
    if x.is_deleted():  # donated to a computation (``donate_argnums``), or deleted
      return DELETED
    placed = sorted(x.devices(), key=lambda d: (d.platform, d.id))
    return "+".join(_spelled(d.platform, jax.devices(d.platform).index(d)) for d in placed)
  if framework == "tensorflow":
    if "tensorflow" not in type(x).__module__ or not hasattr(x, "device"):
      return None
    match = re.search(r"device:(?P<kind>[A-Za-z]+):(?P<index>\d+)$", x.device or "")
    return _spelled(match["kind"], int(match["index"])) if match else (x.device or "unplaced")
  if framework == "numpy":
    import numpy as np
    return str(HOST) if isinstance(x, np.ndarray) else None
  return None


def _spelled(kind: str, index: int) -> str:
  """A framework's name of a device kind and index, as this module spells devices."""
  kind = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}.get(kind.lower(), kind.lower())
  return kind if index == 0 else f"{kind}:{index}"


def is_on(x: Any, device: Device, framework: str) -> bool:
  """Whether ``x`` is an array of ``framework`` on ``device`` (and on it alone)."""
  return where(x, framework) == str(device)
