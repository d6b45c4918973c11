"""Generated cases draw the same examples whatever else the process has imported."""

from __future__ import annotations

import importlib
import sys

import hypothesis
import pytest
from hypothesis import strategies as st

from clipbench.conformance import generation

# Sized so that Hypothesis's own provider draws some of a new module's literals for certain:
# about 1,600 integer draws, of which it takes a literal from its local pool for about one in
# forty, and our literals are most of that pool's integers in range.
DRAWS = st.lists(st.integers(0, 2 ** 62), min_size=200, max_size=200)
DERANDOMIZED = hypothesis.settings(max_examples=8, derandomize=True, database=None,
                                   deadline=None, phases=(hypothesis.Phase.generate,))
LITERALS = [10 ** 15 + 12345 + 7919 * k for k in range(1000)]  # Hypothesis keeps 1,024 a module


def _suite_examples() -> list[list[int]]:
  seen: list[list[int]] = []
  generation.check_generated(DRAWS, seen.append, settings=DERANDOMIZED)
  return seen


def _hypothesis_examples() -> list[list[int]]:
  seen: list[list[int]] = []

  @DERANDOMIZED
  @hypothesis.given(data=st.data())
  def run(data):
    seen.append(data.draw(DRAWS, label="inputs"))

  run()
  return seen


@pytest.fixture
def import_literals(tmp_path, monkeypatch):
  """Imports, when called, a local module (outside site-packages) full of new integer
  literals, as loading another implementation's adapter would."""
  name = "clipbench_generation_literals"
  folder = tmp_path / "elsewhere"
  folder.mkdir()
  (folder / f"{name}.py").write_text(f"LITERALS = {tuple(LITERALS)!r}\n")
  monkeypatch.syspath_prepend(str(folder))
  monkeypatch.delitem(sys.modules, name, raising=False)
  return lambda: importlib.import_module(name)


def _drawn_literals(examples) -> set[int]:
  return set(LITERALS).intersection(value for example in examples for value in example)


def test_suite_examples_do_not_depend_on_the_modules_imported(import_literals):
  before = _suite_examples()
  import_literals()
  after = _suite_examples()
  assert not _drawn_literals(after)
  assert after == before


def test_hypothesis_alone_draws_literals_of_modules_imported(import_literals):
  """Why ``generation.SuiteProvider`` exists: if this fails, Hypothesis no longer draws from
  imported modules' literals, and the override can go."""
  import_literals()
  assert _drawn_literals(_hypothesis_examples())


def test_the_suite_provider_is_installed_only_while_a_generated_check_runs():
  inside = []
  generation.check_generated(st.just(0), lambda _: inside.append(
      generation.providers.AVAILABLE_PROVIDERS["hypothesis"]), settings=DERANDOMIZED)
  assert inside and all(provider is generation.SuiteProvider for provider in inside)
  assert generation.providers.AVAILABLE_PROVIDERS["hypothesis"] is not generation.SuiteProvider
