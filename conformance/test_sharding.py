"""Rule 14 on JAX: sharded leaves give the bits of the unsharded call.

Each JAX implementation runs every case of the profile (``conformance/sharding/layouts.py``:
``ci`` a few layouts, ``thorough`` the full grid) in one child process with 4 host CPU
devices (``sharding/jax_runner.py``), on meshes of 2 and 4 devices, under ``jax.jit`` as its
users call it, against the same call on one device. Torch implementations are checked by
``test_sharding_torch.py``; numpy and TensorFlow leaves are not sharded (no case).
"""

from __future__ import annotations

import hypothesis
import pytest

from clipbench.conformance.running import not_applicable
from clipbench.conformance.sharding import checks, layouts
from clipbench.schema import SHARDING_RULE


def profile() -> str:
  """The session's profile (the plugin loads it into hypothesis): ``ci`` unless ``thorough``."""
  return "thorough" if hypothesis.settings.get_current_profile_name() == "thorough" else "ci"


def sharding_cases(impl, op):
  if impl.framework != "jax":
    return []
  out = []
  for case in layouts.cases(profile(), op):
    reason = (checks.device_reason(impl, case.layout.devices) or
              not_applicable(impl, op, case.build(op)))
    if reason is None:
      checks.RUNS.expect(impl, op, case.name)
    out.append((case.name, case, reason, case.variant.dtype))
  return out


def verify(impl, op, case_name: str, record=None):
  """Rule 14 for one case; ``record(key, value)`` receives the measured ulp differences."""
  return checks.outcome(checks.RUNS.row(impl, op, case_name), record)


@pytest.mark.conformance(rule=SHARDING_RULE, cases=sharding_cases)
def test_rule14_sharded_leaves_give_the_unsharded_bits(target, check, request):
  def record(key, value):
    request.node.user_properties.append((key, value))

  def run():
    try:
      return verify(target.impl, target.op, target.case, record)
    except checks.NotApplicable as e:
      pytest.skip(str(e))

  check(target, run)
