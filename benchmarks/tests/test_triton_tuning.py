"""The Triton tuning run: its configurations apply and restore, and every one gives the eager
CUDA route's bits (a smoke run on CPU tensors under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from clipbench.benchmarks import triton_tuning


def test_a_configuration_applies_and_is_restored_and_unknown_names_are_refused():
  from clipbench.impls.own.triton import passes, tables
  before = (tables.MIN_ITEM_UNITS, passes.SYSTEM_BLOCK, passes.ROW_UNITS)
  with triton_tuning.configured({"MIN_ITEM_UNITS": 1 << 16, "SYSTEM_BLOCK": 256,
                                 "ROW_UNITS": 0}):
    assert (tables.MIN_ITEM_UNITS, passes.SYSTEM_BLOCK, passes.ROW_UNITS) == (1 << 16, 256, 0)
    assert tables.item_units(10) == 1 << 16
  assert (tables.MIN_ITEM_UNITS, passes.SYSTEM_BLOCK, passes.ROW_UNITS) == before
  with pytest.raises(ValueError, match="settings: unknown constants"):
    with triton_tuning.configured({"BLOKC": 1}):
      pass
  for settings in triton_tuning.CONFIGS.values():
    with triton_tuning.configured(settings):
      pass


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1")
def test_every_configuration_gives_the_eager_bits_in_a_smoke_run(tmp_path):
  out = tmp_path / "tuning.csv"
  assert triton_tuning.main(["--device", "cpu", "--scale", "0.002", "--workload", "W2-relax",
                             "--config", "default", "--config", "elements",
                             "--output", str(out)]) == 0
  frame = pd.read_csv(out)
  assert list(frame["config"]) == [triton_tuning.EAGER, "default", "elements"]
  assert frame["same_bits"].all() and (frame["ms"] > 0).all()
