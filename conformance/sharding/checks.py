"""Rule-14 checks from the pytest process: the JAX runner started once, its rows as findings.

JAX fixes its device count when it starts and the suite's own process has one CPU device, so
every JAX case runs in one child process (``jax_runner``) started with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``. The suite collects its cases first and
announces them (:meth:`JaxRuns.expect`); the first check starts one child for all of them
(JAX and each compiled function load once), and later checks read the cached rows.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

from clipbench import devices
from clipbench.conformance import running
from clipbench.conformance.rules import Finding, Violation
from clipbench.conformance.sharding import host_devices
from clipbench.impls.registry import Implementation
from clipbench.schema import SHARDING_BOUND_BROKEN, SHARDING_DECISION_CHANGED

RUNNER = "clipbench.conformance.sharding.jax_runner"
# Seconds the child may run: the ci grid takes well under a minute here, thorough several.
CHILD_TIMEOUT_S = 1800


def off_host_reason(impl: Implementation) -> str | None:
  """Why the sharded runs cannot check ``impl``: they run their ranks on the host (JAX host
  devices, gloo processes), so an implementation declared for other devices only gets none."""
  devices = impl.capabilities.devices
  if "cpu" in devices:
    return None
  return (f"runs on {'/'.join(devices)} only; the sharded runs use host ranks (JAX host "
          "devices, torch gloo processes)")


def device_reason(impl: Implementation, mesh_devices: int) -> str | None:
  """Why a case on a mesh of ``mesh_devices`` devices cannot run on the session's device
  (``--device``). On the host, the sharded runs make their own meshes (JAX host devices, gloo
  processes). On a GPU, a mesh needs that many GPUs; with one, a sharded call is the unsharded
  call."""
  device = running.device()
  if device.is_host:
    return off_host_reason(impl)
  found = devices.count(device.kind, impl.framework)
  if found < mesh_devices:
    return (f"on {device}: a mesh of {mesh_devices} needs {mesh_devices} {device.kind} "
            f"devices; {impl.framework} sees {found}")
  return (f"on {device}: the sharded runs place their ranks on host devices (JAX host "
          f"devices, gloo processes); meshes of {device.kind} devices are not run")


class NotApplicable(Exception):
  """The layout cannot be given to this implementation on this engine (the reason)."""


def run_child(calls: list[dict], specs: dict[str, str]) -> list[dict]:
  """Runs ``calls`` (``{"impl", "op", "case"}``) in one JAX child process; returns its rows."""
  with tempfile.TemporaryDirectory(prefix="clipbench-sharding-") as folder:
    request, out = os.path.join(folder, "request.json"), os.path.join(folder, "rows.json")
    with open(request, "w", encoding="utf-8") as f:
      json.dump({"calls": calls, "specs": specs}, f)
    env = dict(os.environ, **host_devices.environment())
    done = subprocess.run([sys.executable, "-m", RUNNER, "--request", request, "--out", out],
                          env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          check=False)
    if done.returncode != 0 or not os.path.exists(out):
      raise RuntimeError(f"the JAX sharding runner exited with {done.returncode}:\n"
                         f"{done.stderr[-4000:]}")
    with open(out, encoding="utf-8") as f:
      return json.load(f)


class JaxRuns:
  """The rows of every announced JAX case, run together on the first request."""

  def __init__(self) -> None:
    self._pending: dict[tuple[str, str, str], str] = {}  # (impl, op, case) -> load spec
    self._rows: dict[tuple[str, str, str], dict] = {}

  def expect(self, impl: Implementation, op: str, case: str) -> None:
    key = (impl.name, op, case)
    if key not in self._rows:
      self._pending[key] = impl.name if impl.kind != "outside" else impl.target

  def row(self, impl: Implementation, op: str, case: str) -> dict:
    key = (impl.name, op, case)
    if key not in self._rows:
      self.expect(impl, op, case)
      calls = [{"impl": i, "op": o, "case": c} for i, o, c in self._pending]
      specs = {i: spec for (i, _, _), spec in self._pending.items()}
      self._pending.clear()
      for row in run_child(calls, specs):
        self._rows[(row["impl"], row["op"], row["case"])] = row
    return self._rows[key]


RUNS = JaxRuns()


def _ulp(value) -> str:
  return "inf" if value is None or value == math.inf else f"{float(value):g}"


def describe(row: dict) -> str:
  """One line: how far a sharded result is from the unsharded one, and what it changed."""
  found = row["comparison"]
  norm = found["norm_ulp"]
  norm_text = "no norm returned" if norm is None or (isinstance(norm, float) and
                                                     math.isnan(norm)) else (
      f"norms by {_ulp(norm)} ulp")
  decision = SHARDING_DECISION_CHANGED if found["decision_changed"] else "decision kept"
  bound = SHARDING_BOUND_BROKEN if found["bound_broken"] else "bound held"
  replicated = "" if row.get("norm_replicated", True) else "; norm not replicated"
  return (f"sharded vs unsharded ({row.get('how', '')}): outputs differ by up to "
          f"{_ulp(found['max_ulp'])} ulp, {norm_text}; {decision}; {bound}{replicated} "
          f"({found['detail']})")


def verdict(row: dict) -> Finding:
  """A runner's row as a finding: identical bits pass; anything else raises.

  Raises:
    Violation: the sharded result differs from the unsharded one (the message says by how
      much, and whether a decision or the bound changed).
    AssertionError: a call raised (the message names which).
    NotApplicable: the engine cannot express the layout for this implementation.
  """
  status = row["status"]
  if status == "not-applicable":
    raise NotApplicable(row["note"])
  if status == "error":
    raise AssertionError(row["error"])
  found = row["comparison"]
  if status == "identical":
    norm = found["norm_ulp"]
    return Finding(0.0, norm if norm is not None else math.nan,
                   f"identical bits sharded and unsharded ({row.get('how', '')})")
  raise Violation(describe(row))


def differences(row: dict) -> tuple[float, float]:
  """The (outputs, norms) ulp differences of a row that ran (NaN where not measured)."""
  found = row.get("comparison") or {}
  values = []
  for key in ("max_ulp", "norm_ulp"):
    v = found.get(key)
    values.append(math.nan if v is None else (math.inf if v == "inf" else float(v)))
  return values[0], values[1]


def outcome(row: dict, record=None) -> Finding:
  """A row's finding, after handing ``record(key, value)`` its ulp differences (JAX and torch)."""
  if record is not None and row.get("comparison"):
    outputs, norms = differences(row)
    record("max_ulp_error", outputs)
    record("norm_ulp_error", norms)
  return verdict(row)
