"""How a JAX process gets several CPU devices: XLA's host-platform device count, set before
JAX starts (JAX reads ``XLA_FLAGS`` once, when its backend initializes)."""

from __future__ import annotations

import os

DEVICES = 4  # the largest mesh of the rule-14 layouts
FLAG = f"--xla_force_host_platform_device_count={DEVICES}"


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
  """``XLA_FLAGS`` and ``JAX_PLATFORMS`` for a JAX process with :data:`DEVICES` CPU devices,
  keeping any other XLA flags of ``base`` (default: this process's environment)."""
  base = os.environ if base is None else base
  flags = " ".join(f for f in base.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_force_host_platform_device_count"))
  return {"XLA_FLAGS": f"{flags} {FLAG}".strip(), "JAX_PLATFORMS": "cpu"}
