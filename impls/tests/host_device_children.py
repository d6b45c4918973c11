"""Tests that need several JAX host devices run their cases in a child process of their own.

JAX fixes its device count (``XLA_FLAGS``) when it starts, and the test process has one CPU
device. A child module calls :func:`use_host_devices` before it imports JAX and prints one
JSON line per case; the test reads them with :func:`child_rows`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from clipbench import devices

DEVICES = 4


def use_host_devices() -> None:
  """Asks for ``DEVICES`` host CPU devices (in a child, before JAX is imported)."""
  if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = devices.xla_flags_with_host_devices(
        os.environ.get("XLA_FLAGS", ""), DEVICES)
    os.environ["JAX_PLATFORMS"] = "cpu"


def child_rows(module: str, timeout_s: float) -> list[dict]:
  """The JSON lines ``python -m module`` prints; an error naming its stderr if it fails."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the child sets its own device count
  done = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True,
                        text=True, timeout=timeout_s, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"{module} exited with {done.returncode}:\n{done.stderr[-4000:]}")
  return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
