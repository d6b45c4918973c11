"""The pytest plugin behind the progress bar of a ``clipbench`` run.

The pytest runs the command starts at a terminal load this module (``-p
clipbench.progress_plugin``); its hooks append one line per collected session (``total N``) and
per finished test (``done NODEID``) to the file named by ``CLIPBENCH_PROGRESS_FILE``, which the
parent (:mod:`clipbench.child_run`) turns into a progress bar. Inert without that variable.
"""

from __future__ import annotations

import os
from typing import Any

PROGRESS_ENV = "CLIPBENCH_PROGRESS_FILE"


def _progress_line(line: str) -> None:
  path = os.environ.get(PROGRESS_ENV)
  if path:
    with open(path, "a", encoding="utf-8") as f:
      f.write(line + "\n")


def pytest_collection_finish(session: Any) -> None:
  _progress_line(f"total {len(session.items)}")


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:  # pylint: disable=unused-argument
  _progress_line("done " + nodeid)
