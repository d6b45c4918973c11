"""Starts groups of gloo processes on this machine and collects rank 0's records.

Each rank is ``python -m clipbench.conformance.sharding_torch.worker`` with torchrun's
environment, in a session of its own so that it and anything it starts are killed as one. A
case that makes no progress within ``case_timeout_s`` (a collective some rank never joins) is
recorded as hung, the group is killed, and a new group goes on with the cases after it.
Nothing outlives ``run``: every rank is killed on the way out, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


STARTUP_S = 90.0  # starting torch and the gloo group in 4 processes on 2 cores
# A rank that raised inside a call while the others wait in the call's collective: how long
# the others get to finish before the group counts as deadlocked.
RAISED_GRACE_S = 5.0


def key(call: dict) -> str:
  """A call's key: ``impl|op|case``."""
  return f"{call['impl']}|{call['op']}|{call['case']}"


class GroupFailed(RuntimeError):
  """A group could not start, or a rank failed outside any case."""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _kill(procs: list[subprocess.Popen]) -> None:
  for proc in procs:
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for proc in procs:
    proc.wait()


def _read(path: str) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return f.read()
  except OSError:
    return ""


def _records(path: str) -> dict[str, dict]:
  lines = [line for line in _read(path).splitlines() if line.endswith("}")]
  return {record["key"]: record for record in map(json.loads, lines)}


def _started(log: str) -> str | None:
  """The key of the last case rank 0 started, from its log."""
  keys = [line.removeprefix("started ") for line in log.splitlines()
          if line.startswith("started ")]
  return keys[-1] if keys else None


def _raised(logs: list[str], current: str | None) -> str | None:
  """``rank R raised ...`` when a rank reported an error in the current call."""
  if current is None:
    return None
  for rank, path in enumerate(logs):
    for line in _read(path).splitlines():
      if line.startswith(f"raised {current}: "):
        return f"rank {rank} {line.removeprefix(f'raised {current}: ')}"
  return None


def _group(world: int, calls: list[dict], case_timeout_s: float,
           folder: str) -> tuple[dict[str, dict], str, str | None]:
  """(rows by key, rank 0's log, why it stopped early or None) of one group over ``calls``."""
  results = os.path.join(folder, f"records-{time.monotonic_ns()}.jsonl")
  spec_path = results + ".spec.json"
  with open(spec_path, "w", encoding="utf-8") as f:
    json.dump({"calls": calls, "results": results,
               "timeout_s": case_timeout_s}, f)
  port, procs, logs = free_port(), [], []
  try:
    for rank in range(world):
      env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                 WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                 OMP_NUM_THREADS="1")
      logs.append(f"{results}.rank{rank}.log")
      with open(logs[-1], "w", encoding="utf-8") as log:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "clipbench.conformance.sharding_torch.worker", spec_path],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    done, deadline, raised_at = 0, time.monotonic() + STARTUP_S + case_timeout_s, None
    while any(p.poll() is None for p in procs):
      failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
      if failed:
        return _records(results), _read(logs[0]), (
            f"rank {failed[0]} exited with {procs[failed[0]].returncode}: "
            f"{_read(logs[failed[0]])[-1500:]}")
      count = len(_records(results))
      if count != done:
        done, deadline, raised_at = count, time.monotonic() + case_timeout_s, None
      raised = _raised(logs, _started(_read(logs[0])))
      if raised and raised_at is None:
        raised_at = time.monotonic()
      if raised and time.monotonic() > raised_at + RAISED_GRACE_S:
        return _records(results), _read(logs[0]), (
            f"deadlock: {raised}, while the other ranks waited in a collective of the call "
            "(the group was killed)")
      if time.monotonic() > deadline:
        return _records(results), _read(logs[0]), (
            f"no result within {case_timeout_s:g} s: a collective hung (some rank never "
            "joined it); the group was killed")
      time.sleep(0.05)
    if procs[0].returncode != 0:
      return _records(results), _read(logs[0]), f"rank 0 exited with {procs[0].returncode}"
    return _records(results), _read(logs[0]), None
  finally:
    _kill(procs)


def run(world: int, calls: list[dict], case_timeout_s: float = 60.0) -> dict[str, dict]:
  """Rank 0's rows by key (:func:`key`) for ``calls`` ({"impl", "op", "case"}, all cases
  of ``world`` ranks).

  A call that hangs or crashes its group gets an ``error`` row saying so; a group that fails
  before its first call is retried once, then :class:`GroupFailed` is raised.
  """
  if not isinstance(world, int) or world < 1:
    raise ValueError(f"world: expected a number of processes >= 1, got {world!r}")
  if not case_timeout_s > 0:
    raise ValueError(f"case_timeout_s: expected seconds > 0, got {case_timeout_s!r}")
  records: dict[str, dict] = {}
  remaining, retried = list(calls), False
  with tempfile.TemporaryDirectory(prefix="clipbench-sharding-") as folder:
    while remaining:
      found, log, failure = _group(world, remaining, case_timeout_s, folder)
      records.update(found)
      remaining = [c for c in remaining if key(c) not in records]
      if failure is None or not remaining:
        break
      stuck = _started(log)
      if stuck not in {key(c) for c in remaining}:
        if retried:
          raise GroupFailed(f"{world} ranks: the group failed before its first case: "
                            f"{failure}\nrank 0's log:\n{log[-1500:]}")
        retried = True
        continue
      impl, op, case = stuck.split("|")
      records[stuck] = {"key": stuck, "impl": impl, "op": op, "case": case, "status": "error",
                        "error": failure.splitlines()[0][:300]}
      remaining = [c for c in remaining if key(c) != stuck]
  return records
