"""Our torch implementation on CPU DTensors exchanges partials, not leaves (two gloo ranks).

The bits themselves are rule 14's (``conformance/test_sharding_torch.py``, the whole layout
grid); this checks the way there: no call gathers, what each rank sends is bounded by block
results, outputs keep their placements, and a bad argument on one rank is every rank's error.
The checks run in ``torch_sharded_ranks`` (one process per rank).
"""

from __future__ import annotations

import os
import subprocess
import sys

from clipbench.conformance.sharding_torch import launch

RANKS = 2


def test_two_ranks_exchange_partials_not_leaves():
  env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(launch.free_port()),
             WORLD_SIZE=str(RANKS), OMP_NUM_THREADS="1")
  procs = [subprocess.Popen([sys.executable, "-m", "clipbench.impls.tests.torch_sharded_ranks"],
                            env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for r in range(RANKS)]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=300))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for r, (proc, (out, err)) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f"rank {r}:\n{out}\n{err[-3000:]}"
