"""Rule 14 on torch.distributed: DTensor leaves on 2 and 4 gloo processes give the unsharded bits.

Each case of the shared grid (``conformance/sharding/layouts.py``) and torch's own layouts
(``sharding_torch/layouts.py``: two meshes, FSDP2 gradients, leaves split by columns, a 2-D
mesh of FSDP and tensor parallelism) runs in a group of gloo processes on the CPU that the
test starts itself (``sharding_torch/launch.py``): the call on DTensors (``Shard(0)`` /
``Replicate()`` on a 1-D ``DeviceMesh``; ``Shard(1)``; ``[Shard(0), Shard(1)]`` on a 2 x 2
mesh), the outputs gathered, and rank 0's unsharded call of the same implementation,
compared bit for bit.

Implementations: our own (``clipbench.torch``; ``clipbench.torch-compile`` in ``thorough``),
``torch.nn.utils.clip_grad_norm_`` (foreach=False; foreach=True and ``clip_grads_with_norm_``
in ``thorough``) and outside torch implementations. The other torch adapters (Triton kernels,
declearn, Keras, DeepSpeed, torch-sim) are not handed DTensors by their users and get no case.
"""

from __future__ import annotations

import hypothesis
import pytest

from clipbench.conformance.running import not_applicable
from clipbench.conformance.sharding import checks
from clipbench.conformance.sharding_torch import layouts
from clipbench.conformance.sharding_torch.runs import RUNS
from clipbench.schema import SHARDING_RULE

CI_IMPLS = ("clipbench.torch", "torch.clip_grad_norm_")
THOROUGH_IMPLS = CI_IMPLS + ("clipbench.torch-compile", "torch.clip_grad_norm_.foreach",
                             "torch.clip_grads_with_norm_")


def profile() -> str:
  """The session's profile (the plugin loads it into hypothesis): ``ci`` unless ``thorough``."""
  return "thorough" if hypothesis.settings.get_current_profile_name() == "thorough" else "ci"


def sharding_cases(impl, op):
  if impl.framework != "torch" or (
      impl.kind != "outside" and impl.name not in (
          THOROUGH_IMPLS if profile() == "thorough" else CI_IMPLS)):
    return []
  out = []
  for case in layouts.cases(profile()):
    if not case.applies_to(op):
      continue
    reason = (layouts.ON_DEVICE_NOTE if not case.expressible else
              checks.device_reason(impl, case.layout.devices) or
              not_applicable(impl, op, case.build(op)))
    if reason is None:
      RUNS.expect(impl, op, case.name)
    out.append((case.name, case, reason, case.variant.dtype))
  return out


def verify(impl, op, case_name: str, record=None):
  """Rule 14 for one case; ``record(key, value)`` receives the measured ulp differences."""
  return checks.outcome(RUNS.row(impl, op, case_name), record)


@pytest.mark.conformance(rule=SHARDING_RULE, cases=sharding_cases)
def test_rule14_dtensor_leaves_give_the_unsharded_bits(target, check, request):
  def record(key, value):
    request.node.user_properties.append((key, value))

  def run():
    try:
      return verify(target.impl, target.op, target.case, record)
    except checks.NotApplicable as e:
      pytest.skip(str(e))

  check(target, run)


def test_own_torch_dtensor_contract(request):
  """Outputs placed like the inputs, a plain norm, clear errors, partials not leaves (three gloo
  ranks: a middle rank has two boundaries per leaf, and rows that are not DTensor's chunks can
  be one rank's alone)."""
  chosen = request.config.getoption("--impl")
  if chosen and "clipbench.torch" not in chosen:
    pytest.skip("checks clipbench.torch, which --impl leaves out")
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from clipbench.conformance.sharding_torch import launch  # pylint: disable=import-outside-toplevel
  ranks = 3
  env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(launch.free_port()),
             WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "clipbench.conformance.sharding_torch.own_contract"],
      env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for r in range(ranks)]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=300))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for r, (proc, (out, err)) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f"rank {r}:\n{out}\n{err[-2000:]}"
