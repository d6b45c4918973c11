"""How the suite draws its generated inputs: examples that depend on the test, not on the process.

Under the ``ci`` profile a generated case is derandomized: its examples are a function of the
test, the implementation's declared capabilities and the profile, so a case that passes or
deviates in the report does so again when a maintainer runs ``--impl theirs`` alone.

Hypothesis's own provider breaks that on its own: some draws (5-15%) take a literal from a
pool that it collects from every *local* module (any file outside site-packages and the
standard library) already imported, and the pool grows as the process imports more. The
suite's package is such a module when installed editable, as are a maintainer's adapter and
every implementation module loaded before the test; so the same test drew other examples with
21 libraries loaded than with one, and ten library cases changed outcome between ``make test``
and ``make report``. :class:`SuiteProvider` is Hypothesis's provider with only its built-in
literals (zeros, powers of two, infinities, ...), installed for the suite's own generated tests
only, for as long as each runs (:func:`check_generated`), so a maintainer's own Hypothesis
tests in the same session keep Hypothesis's behaviour.

The override uses Hypothesis internals (``hypothesis`` is pinned in ``constraints.txt``);
``conformance/tests/test_generation.py`` fails if they move.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import hypothesis
from hypothesis.internal.conjecture import providers
from hypothesis.internal.conjecture.choice import choice_constraints_key, choice_permitted

# Hypothesis's name for its default backend, the one the engine treats as its own.
_DEFAULT_BACKEND = "hypothesis"


class SuiteProvider(providers.HypothesisProvider):
  """Hypothesis's provider, drawing literals from its built-in pool only."""

  # (choice type, constraints) -> the built-in literals those constraints permit.
  _permitted: dict[tuple, tuple] = {}

  def _maybe_draw_constant(self, choice_type, constraints, *, p: float = 0.05):
    if self._random.random() > p:
      return None
    key = (choice_type, choice_constraints_key(choice_type, constraints))
    pool = self._permitted.get(key)
    if pool is None:
      pool = tuple(choice for choice in providers.GLOBAL_CONSTANTS.set_for_type(choice_type)
                   if choice_permitted(choice, constraints))
      self._permitted[key] = pool
    return self._random.choice(pool) if pool else None


@contextlib.contextmanager
def suite_provider():
  """Hypothesis's default backend is :class:`SuiteProvider` inside the block (the engine picks
  its provider when a test starts)."""
  registry = providers.AVAILABLE_PROVIDERS
  before = registry[_DEFAULT_BACKEND]
  registry[_DEFAULT_BACKEND] = SuiteProvider
  try:
    yield
  finally:
    registry[_DEFAULT_BACKEND] = before


def check_generated(strategy: hypothesis.strategies.SearchStrategy, check: Callable[[Any], None],
                    settings: hypothesis.settings | None = None) -> None:
  """Run ``check`` on the examples drawn from ``strategy`` under ``settings`` (default: the
  session's profile)."""

  @hypothesis.given(data=hypothesis.strategies.data())
  def run(data):
    check(data.draw(strategy, label="inputs"))

  if settings is not None:
    run = settings(run)
  with suite_provider():
    run()
