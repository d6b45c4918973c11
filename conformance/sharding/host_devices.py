"""How a JAX process gets several CPU devices: XLA's host-platform device count, set before
JAX starts (JAX reads ``XLA_FLAGS`` once, when its backend initializes)."""

from __future__ import annotations

import os

from clipbench import devices

DEVICES = 4  # the largest mesh of the rule-14 layouts
FLAG = devices.xla_flags_with_host_devices("", DEVICES)


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
  """``XLA_FLAGS`` and ``JAX_PLATFORMS`` for a JAX process with :data:`DEVICES` CPU devices,
  keeping any other XLA flags of ``base`` (default: this process's environment)."""
  base = os.environ if base is None else base
  return {"XLA_FLAGS": devices.xla_flags_with_host_devices(base.get("XLA_FLAGS", ""), DEVICES),
          "JAX_PLATFORMS": "cpu"}
