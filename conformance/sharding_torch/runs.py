"""The rows of every announced torch case, run together: one process group per world size.

Starting a gloo group costs seconds (torch imported in every rank), so the suite announces its
cases while collecting (:meth:`TorchRuns.expect`) and the first check of a world size runs all
of that size's calls in one group; later checks read the cached rows.
"""

from __future__ import annotations

from clipbench.conformance.sharding_torch import launch
from clipbench.conformance.sharding_torch import layouts
from clipbench.impls.registry import Implementation

# Seconds one call may go without a result before its group counts as hung (a first call
# compiles numba or inductor kernels in every rank, on 2 cores).
CASE_TIMEOUT_S = 180.0


class TorchRuns:
  """Rows by (impl, op, case), computed on first request per world size."""

  def __init__(self) -> None:
    self._pending: dict[tuple[str, str, str], str] = {}  # (impl, op, case) -> load spec
    self._rows: dict[tuple[str, str, str], dict] = {}

  def expect(self, impl: Implementation, op: str, case: str) -> None:
    key = (impl.name, op, case)
    if key not in self._rows:
      self._pending[key] = impl.target if impl.kind == "outside" else ""

  def row(self, impl: Implementation, op: str, case: str) -> dict:
    key = (impl.name, op, case)
    if key not in self._rows:
      self.expect(impl, op, case)
      world = layouts.case_named(case).layout.devices
      group = {k: spec for k, spec in self._pending.items()
               if layouts.case_named(k[2]).layout.devices == world}
      for k in group:
        del self._pending[k]
      calls = [{"impl": i, "op": o, "case": c, "spec": spec} for (i, o, c), spec in group.items()]
      for call in calls:
        self._rows[(call["impl"], call["op"], call["case"])] = {
            **call, "status": "error", "error": "no row from the process group"}
      for row in launch.run(world, calls, CASE_TIMEOUT_S).values():
        self._rows[(row["impl"], row["op"], row["case"])] = row
    return self._rows[key]


RUNS = TorchRuns()
