"""Running pytest in a child process: a progress bar at a terminal, its output otherwise.

At a terminal the child's whole output goes to a log file while a progress bar (fed by
:mod:`clipbench.progress_plugin`) runs; the end of the log is then printed as a short summary
(:func:`summary_tail`). Piped, the child's output is passed through as it comes. Either way
Ctrl-C stops the child and waits for it (:func:`stop_child`), so nothing it writes outlives the
clean-up of the run's temporary files. :func:`run_side_by_side` runs several children at once
(many cores, one card), each with its own log, printed in summary as it ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from clipbench import terminal
from clipbench.progress_plugin import PROGRESS_ENV

# After Ctrl-C: how long the pytest child gets to stop by itself (the terminal sent it the same
# SIGINT), then after our own SIGINT, then after SIGTERM, before it is killed.
CHILD_STOP_GRACE_S = (3.0, 20.0, 5.0)
SUMMARY_LINES = 60
# Sections of pytest's output that repeat each failure at length; the log keeps them.
LONG_SECTIONS = ("FAILURES", "ERRORS", "warnings summary", "PASSES", "XFAILURES", "XPASSES")
# A section's separator: pytest's own are "=" lines, a plugin's "-" lines; "_" lines (one per
# failing test) and "- Captured ... -" lines sit within a section.
_SEPARATOR = re.compile(r"^(?P<rule>[=-])(?P=rule){2,} (?P<title>.+?) (?P=rule){3,}$")


def child_env(defaults: dict[str, str] | None = None) -> dict[str, str]:
  """The environment of a pytest run: the working directory on PYTHONPATH (outside impls),
  and ``defaults`` where the caller's environment does not set them."""
  env = {**(defaults or {}), **os.environ}
  paths = [os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
  return env


def summary_tail(log: str, limit: int = SUMMARY_LINES) -> str:
  """The end of a pytest log as a terminal summary: the sections from the first ``=== ... ===``
  separator on (the conformance plugin's one-line-per-failure summary, pytest's short summary,
  the final counts), without the sections that print every failure at length (the log has
  them); at most ``limit`` lines, the last ones."""
  lines = log.rstrip().splitlines()
  kept: list[str] = []
  skipping = False
  seen_separator = False
  for line in lines:
    match = _SEPARATOR.match(line)
    if match and not match["title"].startswith("Captured "):
      seen_separator = True
      skipping = match["title"].strip() in LONG_SECTIONS
    if seen_separator and not skipping:
      kept.append(line)
  kept = kept or lines
  if len(kept) > limit:
    kept = [f"... ({len(kept) - limit} more lines in the log)", *kept[-limit:]]
  return "\n".join(kept)


def stop_child(proc: subprocess.Popen) -> None:
  """Ends a pytest run after Ctrl-C and waits for its exit, so that nothing it writes outlives
  the clean-up of its temporary files.

  Ctrl-C at a terminal reaches the child too; pytest then stops after the current test. A SIGINT
  sent to this process alone is passed on. A child that still runs is terminated, then killed;
  a second Ctrl-C kills it at once.
  """
  escalation = (None, signal.SIGINT, signal.SIGTERM)
  try:
    for sig, grace in zip(escalation, CHILD_STOP_GRACE_S):
      if proc.poll() is not None:
        return
      if sig is not None:
        proc.send_signal(sig)
      with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def _wait(proc: subprocess.Popen, on_tick: Callable[[], None] | None = None) -> int:
  """The child's exit status once it ended, calling ``on_tick()`` every 0.2 s meanwhile."""
  try:
    while True:
      try:
        rc = proc.wait(0.2)
      except subprocess.TimeoutExpired:
        rc = None
      if on_tick is not None:
        on_tick()
      if rc is not None:
        return rc
  except BaseException:
    stop_child(proc)
    raise


def _relay(proc: subprocess.Popen, shown_paths: dict[str, str]) -> int:
  """Copies the child's output to ours line by line, naming paths as ``shown_paths`` says."""
  assert proc.stdout is not None
  try:
    for line in proc.stdout:
      sys.stdout.write(_show_paths(line, shown_paths))
      sys.stdout.flush()
    return proc.wait()
  except BaseException:
    proc.stdout.close()  # a child blocked writing to a full pipe would never stop
    stop_child(proc)
    raise


def _show_paths(text: str, shown_paths: dict[str, str]) -> str:
  for staged, final in shown_paths.items():
    text = text.replace(staged, final)
  return text


def run_pytest(cmd: Sequence[str], label: str, log_path: str, *,
               progress: bool | None = None, env_defaults: dict[str, str] | None = None,
               shown_paths: dict[str, str] | None = None) -> int:
  """Runs ``cmd``; with a terminal, behind a progress bar (full output to ``log_path``).

  ``env_defaults`` are set in the run's environment unless the caller's already sets them.
  ``shown_paths`` maps paths the run writes to what the user should read in their place (a
  staged results file to its final path) in what is printed.
  """
  progress = terminal.interactive() if progress is None else progress
  env = child_env(env_defaults)
  shown_paths = shown_paths or {}
  if not progress:
    print("$ " + shlex.join(cmd), flush=True)
    if not shown_paths:
      return _wait(subprocess.Popen(cmd, env=env))
    return _relay(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace"),
                  shown_paths)
  rc = _run_behind_progress_bar([*cmd, "-p", "clipbench.progress_plugin"], label, log_path, env)
  with open(log_path, encoding="utf-8", errors="replace") as f:
    print(_show_paths(summary_tail(f.read()), shown_paths))
  print(f"full output: {log_path}")
  return rc


def _run_behind_progress_bar(cmd: Sequence[str], label: str, log_path: str,
                             env: dict[str, str]) -> int:
  """Runs ``cmd`` with its output to ``log_path`` while a bar counts its finished tests."""
  from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                             TextColumn, TimeElapsedColumn)
  os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    events = os.path.join(tmp, "progress")
    env = {**env, PROGRESS_ENV: events}
    with open(log_path, "w", encoding="utf-8") as log, Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), transient=False) as bar:
      task = bar.add_task(f"{label} (collecting)", total=None)
      log.write("$ " + shlex.join(cmd) + "\n")
      log.flush()
      proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
      offset = 0

      def tick() -> None:
        nonlocal offset
        offset = _advance(bar, task, label, events, offset)

      return _wait(proc, tick)


def _advance(bar: Any, task: Any, label: str, events: str, offset: int) -> int:
  """Moves the bar by the events written since byte ``offset``; returns the new offset."""
  try:
    with open(events, "rb") as f:
      f.seek(offset)
      chunk = f.read()
  except FileNotFoundError:
    return offset
  complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits for next time
  for line in complete.decode("utf-8", errors="replace").splitlines():
    kind, _, value = line.partition(" ")
    if kind == "total":
      bar.update(task, total=int(value), description=label)
    elif kind == "done":
      bar.advance(task)
  return offset + len(complete)


def run_side_by_side(cmds: Sequence[Sequence[str]], log_paths: Sequence[str], jobs: int, *,
                     env_defaults: dict[str, str] | None = None,
                     shown_paths: dict[str, str] | None = None) -> list[int]:
  """Runs ``cmds``, at most ``jobs`` at a time, each with its whole output in its log (the
  same index of ``log_paths``); the end of each log is printed as a summary when its child
  ends, so that children running together do not interleave. Returns their exit statuses, in
  the order of ``cmds``. Ctrl-C, or any error, stops every child still running."""
  env = child_env(env_defaults)
  shown_paths = shown_paths or {}
  statuses: dict[int, int] = {}
  running: list[tuple[int, subprocess.Popen, Any]] = []

  def finish(k: int) -> None:
    index, proc, log = running.pop(k)
    statuses[index] = proc.wait()
    log.close()
    with open(log_paths[index], encoding="utf-8", errors="replace") as f:
      tail = _show_paths(summary_tail(f.read()), shown_paths)
    print(f"--- exit status {statuses[index]}: {shlex.join(cmds[index])}\n{tail}\n"
          f"full output: {log_paths[index]}", flush=True)

  try:
    for index, cmd in enumerate(cmds):
      while len(running) >= jobs:
        finish(_first_ended(running))
      print("$ " + _show_paths(shlex.join(cmd), shown_paths), flush=True)
      os.makedirs(os.path.dirname(os.path.abspath(log_paths[index])), exist_ok=True)
      log = open(log_paths[index], "w", encoding="utf-8")  # pylint: disable=consider-using-with
      running.append((index, subprocess.Popen(cmd, env=env, stdout=log,
                                              stderr=subprocess.STDOUT), log))
    while running:
      finish(_first_ended(running))
  finally:
    for _, proc, log in running:
      stop_child(proc)
      log.close()
  return [statuses[i] for i in range(len(cmds))]


def _first_ended(running: Sequence[tuple[int, subprocess.Popen, Any]]) -> int:
  """The position in ``running`` of a child that has ended, waiting for one."""
  while True:
    for k, (_, proc, _) in enumerate(running):
      if proc.poll() is not None:
        return k
    time.sleep(0.2)
