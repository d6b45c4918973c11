"""The import graph keeps the design's one-way data flow.

``reference`` <- ``impls`` <- ``conformance`` / ``benchmarks`` -> results tables -> ``reports``:

* nothing in ``reference/`` imports clipbench outside ``clipbench.reference`` (the spec must
  not depend on what it judges);
* nothing in ``impls/`` imports the conformance suite, the benchmarks or the reports;
* nothing imports ``clipbench.reports`` but the ``clipbench`` command (and its tests, which read
  back the tables the command wrote) and the reports' own modules and tests.

The import statements are read with ``ast`` (every statement, those inside functions too);
nothing is imported, so the test sees modules whose frameworks are missing here.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# Top-level folders and the package each one installs as (pyproject's package-dir).
PACKAGES = {
    "clipbench": "clipbench",
    "reference": "clipbench.reference",
    "impls": "clipbench.impls",
    "conformance": "clipbench.conformance",
    "benchmarks": "clipbench.benchmarks",
    "reports": "clipbench.reports",
}
CLI = "clipbench.cli"
# The clipbench command: cli.py and the modules of its subcommands.
COMMAND_MODULES = (CLI, "clipbench.conform_command", "clipbench.bench_command",
                   "clipbench.bench_table", "clipbench.report_command",
                   "clipbench.safe_range_run")
REPORT_IMPORTERS = (*COMMAND_MODULES, "clipbench.tests.test_cli")


def module_name(path: pathlib.Path) -> str:
  """The dotted name a repository file installs as (``reference/norms.py`` ->
  ``clipbench.reference.norms``; a package's ``__init__.py`` is the package)."""
  parts = list(path.relative_to(REPO).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join([PACKAGES[parts[0]], *parts[1:]])


def imported_modules(source: str, module: str, is_package: bool) -> Iterator[str]:
  """Every module an import statement of ``source`` names, relative imports resolved.

  ``from a import b`` yields both ``a`` and ``a.b`` (``b`` may be a submodule).
  """
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = module.split(".")
        anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
      yield base
      yield from (f"{base}.{alias.name}" for alias in node.names if alias.name != "*")


def _within(name: str, package: str) -> bool:
  return name == package or name.startswith(package + ".")


def violations_of(module: str, imports: list[str]) -> list[str]:
  """The rules of the module docstring that ``module`` importing ``imports`` breaks."""
  found = []
  for name in imports:
    if not _within(name, "clipbench") or name == "clipbench":
      continue
    if _within(module, "clipbench.reference") and not _within(name, "clipbench.reference"):
      found.append(f"{module} imports {name}: the reference imports nothing of the project")
    if _within(module, "clipbench.impls") and any(
        _within(name, f"clipbench.{part}") for part in ("conformance", "benchmarks", "reports")):
      found.append(f"{module} imports {name}: implementations do not depend on their judges")
    if (_within(name, "clipbench.reports") and module not in REPORT_IMPORTERS
        and not _within(module, "clipbench.reports")):
      found.append(f"{module} imports {name}: only the clipbench command imports the reports")
  return found


def project_files() -> list[pathlib.Path]:
  files = []
  for folder in PACKAGES:
    files.extend(p for p in sorted((REPO / folder).rglob("*.py"))
                 if ".venv" not in p.parts and "__pycache__" not in p.parts)
  return files


def test_project_files_are_found() -> None:
  names = {module_name(p) for p in project_files()}
  assert {"clipbench.reference", "clipbench.reference.norms", "clipbench.impls.registry",
          "clipbench.benchmarks.grid", CLI} <= names


@pytest.mark.parametrize("path", project_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_flow_one_way(path: pathlib.Path) -> None:
  module = module_name(path)
  imports = list(imported_modules(path.read_text(encoding="utf-8"), module,
                                  path.name == "__init__.py"))
  assert violations_of(module, imports) == []


@pytest.mark.parametrize("module,source,broken", [
    ("clipbench.reference", "from clipbench.protocol import Capabilities", True),
    ("clipbench.reference", "from clipbench import protocol", True),
    ("clipbench.reference.norms", "def f():\n  import clipbench.impls.registry", True),
    ("clipbench.reference", "from .clipping import clip_grad_norm", False),
    ("clipbench.reference.norms", "from ..protocol import OPS", True),
    ("clipbench.reference.norms", "from . import formats", False),
    ("clipbench.impls.calling", "from clipbench.benchmarks import workloads", True),
    ("clipbench.impls.calling", "from clipbench import reference, protocol", False),
    ("clipbench.conformance.rules", "from clipbench.reports import results", True),
    ("clipbench.cli", "from clipbench.reports import build", False),
    ("clipbench.reports.build", "from clipbench.reports.render import Cell", False),
])
def test_rules_catch_what_they_name(module: str, source: str, broken: bool) -> None:
  imports = list(imported_modules(source, module, module == "clipbench.reference"))
  assert bool(violations_of(module, imports)) is broken
