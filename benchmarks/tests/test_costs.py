"""The cost counter counts what it says, and our CUDA route's counts against their budgets.

The counter's rules (``benchmarks/costs.py``) are checked on calls whose costs are known by
construction. The budgets are issue 30's: per call, a constant number of launches for our
CUDA route, as a multiple of what torch's own call dispatches on the same leaves, and one host
transfer. They are counts, exact on any machine, never timings.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")
# pylint: disable=wrong-import-position
from clipbench.benchmarks import costs, workloads
from clipbench.impls import registry


def test_operators_views_and_transfers_are_told_apart():
  x = torch.arange(12, dtype=torch.float32)
  with costs.counting() as c:
    x.add_(1.0)  # one operator
    y = x.view(3, 4)  # a view: no work
    total = y.sum()  # one operator
    total.item()  # one transfer
    x.cpu().numpy()  # one transfer: the .numpy() of the tensor .cpu() returned is the same one
    x.tolist()  # one transfer
    torch.nonzero(x)  # one operator whose size depends on the values: a transfer too
  assert (c.operators, c.transfers) == (3, 4)
  assert c.views >= 1
  assert c.launches == 0


def test_counts_stop_at_the_end_of_the_block():
  x = torch.ones(4)
  with costs.counting() as c:
    x.mul_(2.0)
  x.mul_(2.0).sum().item()
  assert (c.operators, c.transfers) == (1, 0)


def test_own_route_takes_the_accelerator_branches_inside_the_block():
  from clipbench.impls.own.torch import branches, host_route
  cpu = torch.zeros(2)
  assert host_route.applies([cpu])
  with costs.counting():
    assert not branches.on_host(cpu.device)
    assert not host_route.applies([cpu])
  assert branches.on_host(cpu.device)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1")
def test_triton_launches_are_counted_and_their_inside_is_not():
  triton = pytest.importorskip("triton")
  tl = pytest.importorskip("triton.language")

  @triton.jit
  def _double(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2, mask=mask)

  x = torch.ones(100)
  with costs.counting() as c:
    for _ in range(3):
      _double[(4,)](x, 100, BLOCK=32)
  assert c.launches == 3
  assert c.operators == 0
  assert torch.equal(x, torch.full((100,), 8.0))


def test_in_place_rounds_reuse_the_parameters_and_clip_fresh_values():
  """torch's clip_grad_norm_ is counted (and timed) on parameters built once, refilled."""
  row = costs.count_case("torch.clip_grad_norm_.foreach", "W1-model", scale=1 / 64)
  assert row.costs is not None and row.leaves == 200
  # torch's foreach path: a handful of operators for all 200 leaves, and no host transfer.
  assert row.costs.operators < 20
  assert row.costs.transfers == 0


def test_skips_say_why():
  row = costs.count_case("optax.clip_by_global_norm", "W1-model", scale=1 / 64)
  if row.costs is None:
    assert "jax" in row.skip or "unavailable" in row.skip
  else:
    pytest.fail("a JAX implementation was counted with torch's dispatcher")


def test_command_rejects_unknown_names(capsys):
  with pytest.raises(SystemExit) as info:
    costs.main(["--workload", "W9-nothing"])
  assert info.value.code == 2
  assert "workload" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- budgets
@dataclasses.dataclass(frozen=True)
class Budget:
  """Our implementation on a workload against the torch peer on the same leaves."""

  impl: str
  workload: str
  peer: str
  factor: int  # at most factor x the peer's operators ...
  decision: int  # ... plus this many launches for the decisions
  scale: float  # of the workload's stated size (both are counted at it)


# Eager torch is counted at the stated sizes. Triton's kernels run in numpy under the
# interpreter, so it is counted on a fraction of the elements (W1: the same 200 leaves; W4: 100
# leaves; W2: 100 systems); the budgets may not grow with leaves or systems, and
# ``python -m clipbench.benchmarks.costs`` counts any size.
_SCALES = {"clipbench.torch": {}, "clipbench.triton": {"W1-model": 1 / 64, "W4-many-small": 0.01,
                                                       "W2-relax": 0.05,
                                                       "W2-relax-max-step": 0.05}}
_PEERS = (("W1-model", "torch.clip_grad_norm_.foreach"),
          ("W4-many-small", "torch.clip_grad_norm_.foreach"),
          ("W2-relax", "baseline.torch-index-add"),
          ("W2-relax-max-step", "baseline.torch-index-add"))
BUDGETS: tuple[Budget, ...] = tuple(
    Budget(impl, w, peer, factor, decision, _SCALES[impl].get(w, 1.0))
    for w, peer in _PEERS
    for impl, factor, decision in (("clipbench.triton", 2, 1), ("clipbench.torch", 4, 200)))

# The redesign of issue 30 (item 3) is not done: these are the budgets the CUDA route misses
# today (its counts: docs/gpu.md, section 9). Strict, so that meeting one fails the run until
# its mark is removed.
_OVER_BUDGET_TODAY = frozenset({
    ("clipbench.triton", "W1-model"), ("clipbench.triton", "W4-many-small"),
    ("clipbench.triton", "W2-relax"), ("clipbench.triton", "W2-relax-max-step"),
    ("clipbench.torch", "W2-relax"),
    ("clipbench.torch", "W2-relax-max-step")})
_OVER_BUDGET = pytest.mark.xfail(
    strict=True, reason="issue 30: the CUDA route still dispatches per leaf and chunk and "
    "decides on the host")


def _marks(budget: Budget) -> tuple:
  return (_OVER_BUDGET,) if (budget.impl, budget.workload) in _OVER_BUDGET_TODAY else ()


def _launches(impl: str, workload: str, scale: float) -> costs.Costs:
  row = costs.count_case(impl, workload, scale=scale)
  if row.costs is None:
    pytest.skip(row.skip)
  return row.costs


@pytest.mark.parametrize(
    "budget", [pytest.param(b, id=f"{b.impl}-{b.workload}", marks=_marks(b)) for b in BUDGETS])
def test_cuda_route_launches_within_budget(budget: Budget):
  if budget.impl == "clipbench.triton" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels run on the CPU only under TRITON_INTERPRET=1")
  peer = _launches(budget.peer, budget.workload, budget.scale)
  ours = _launches(budget.impl, budget.workload, budget.scale)
  assert ours.launched <= budget.factor * peer.operators + budget.decision, (ours, peer)
  assert ours.transfers <= 1, ours


def test_budgets_name_registered_implementations_and_workloads():
  names = registry.names()
  for budget in BUDGETS:
    assert budget.impl in names and budget.peer in names
    workloads.get(budget.workload)
  assert _OVER_BUDGET_TODAY <= {(b.impl, b.workload) for b in BUDGETS}


def test_a_freed_host_copy_leaves_no_mark_on_later_tensors():
  x = torch.ones(8)
  with costs.counting() as c:
    for _ in range(50):  # each alias is freed at once: a later tensor may get its id
      x.cpu().numpy()
      torch.ones(8).numpy()
  assert c.transfers == 100
