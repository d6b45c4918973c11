"""Regenerates the recorded results the report tests run on (run from anywhere, once).

The files are hand-made, not measured: a conformance table with every outcome and severity
class that matters to the summary (including a multi-line reproducer with quotes and commas,
and a mixed-dtype error within rule 4's allowance; one library failing only at the range's
edge, one on everyday float16 input), a safe-range scan of those two, a pytest-benchmark JSON
file with two problem sizes per workload family, and an asv results folder with two commits
written through asv's own ``Results`` class (so the format is asv's). Numbers are plausible,
not real.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import shutil

from clipbench.schema import CONFORMANCE_COLUMNS, SAFE_RANGE_COLUMNS

HERE = os.path.dirname(os.path.abspath(__file__))

COLUMNS = list(CONFORMANCE_COLUMNS)
RULES = [str(i) for i in range(1, 14)]

IMPLS = {
    "reference": ("reference", "clipbench", "0.1.0", "numpy"),
    "clipbench.jax": ("own", "jax", "0.12.0", "jax"),
    "optax.clip_by_global_norm": ("library", "optax", "0.2.8", "jax"),
    "torch.clip_grad_norm_": ("library", "torch", "2.14.1", "torch"),
    "kups.MaxStepSize": ("library", "kups", "1.0.8", "jax"),
    "tensorflow.clip_by_global_norm": ("library", "tensorflow-cpu", "2.20.0", "tensorflow"),
    "tmpmod:impl": ("outside", "tmpmod", "", "numpy"),
}

REPRO_OPTAX = '''import numpy as np
import optax
g = [np.zeros(3, np.float32)]
tx = optax.clip_by_global_norm(0.0)
out, _ = tx.update(g, tx.init(g))
print(out)  # expected [0., 0., 0.] (rule 3: 0 == 0 is unchanged), got "nan, nan, nan"'''

REPRO_TORCH = '''import torch
p = torch.nn.Parameter(torch.zeros(2))
p.grad = torch.tensor([3.0, 4.0])
torch.nn.utils.clip_grad_norm_([p], 5.0)
print(p.grad)  # expected [3., 4.] unchanged (norm == max), got [2.9999993, 3.999999]'''

REPRO_TMP = '''import numpy as np, tmpmod
x = [np.arange(6, dtype=np.float32).reshape(3, 2)]
print(tmpmod.impl.clip_grad_norm(x, 1.0))'''


# What the suite records of a case's inputs: (smallest, largest nonzero |x|, smallest, largest
# nonzero exact norm). ORDINARY is a random case's; the others are the edge-case table's.
ORDINARY = (1e-3, 3.0, 5.0, 5.0)
FLOAT16_300 = (300.0, 300.0, 519.6, 519.6)  # float16's sum of squares overflows: everyday
FLOAT32_1E20 = (1e20, 1e20, 1.7e20, 1.7e20)  # beyond float16's range: the range's edge
SMALL_NORM = (1e-3, 8e-3, 0.01, 0.01)  # an epsilon of 1e-6 in max / (norm + eps): 1e-4 off


def row(impl, op, rule, case, dtype, outcome, ulp="", observed="", reason="", repro="",
        norm_ulp=None, severity="", extents=ORDINARY, rel=None, input_class="finite",
        result="returned"):
  kind, library, version, framework = IMPLS[impl]
  label = f"rule{rule}" if rule.isdigit() else rule
  test_id = f"conformance/test_rules.py::test_{label}[{impl}-{op}-{label}-{case}]"
  norm_ulp = ulp if norm_ulp is None else norm_ulp
  if rel is None:
    rel = 0.0 if outcome == "pass" else ""
  measured = outcome != "not-applicable"
  return {"impl": impl, "kind": kind, "library": library, "version": version,
          "framework": framework, "op": op, "rule": rule, "case": case, "dtype": dtype,
          "outcome": outcome, "severity": severity, "max_ulp_error": ulp,
          "norm_ulp_error": norm_ulp, "input_class": input_class if measured else "",
          "result": result if measured else "",
          **dict(zip(("input_min_abs", "input_max_abs", "norm_min", "norm_max"),
                     extents if measured else ("",) * 4)),
          "rel_error": rel, "observed": observed, "reason": reason,
          "reproducer": repro, "test_id": test_id, "duration_s": "0.01"}


def conformance_rows():
  rows = []
  for impl in ("reference", "clipbench.jax"):
    for op in ("clip_by_global_norm", "clip_by_max_step", "clip_grad_norm"):
      for rule in RULES:
        for dtype in ("float16", "float32", "float64"):
          ulp = "0" if impl == "reference" else ("0.5" if rule in ("4", "5") else "")
          rows.append(row(impl, op, rule, "random", dtype, "pass", ulp))
    rows.append(row(impl, "clip_grad_norm", "transform", "jit", "float32",
                    "pass" if impl != "reference" else "not-applicable",
                    reason="" if impl != "reference" else "declares no transforms"))
    # A float64 leaf sharing a system with a float32 leaf: rule 4 lets the factor sit 4
    # float32 roundoffs low, about 2**31 float64 ulps (the reference itself has none).
    rows.append(row(impl, "clip_by_global_norm", "4", "mixed_float32_float64", "float32+float64",
                    "pass", "0" if impl == "reference" else "1.5e+09", norm_ulp="0"))
  lib = "optax.clip_by_global_norm"
  for rule in RULES:
    if rule in ("2", "11", "13"):
      rows.append(row(lib, "clip_grad_norm", rule, "per_system", "float32", "not-applicable",
                      reason="not per-system"))
    elif rule == "10":
      rows.append(row(lib, "clip_grad_norm", rule, "p3", "float32", "not-applicable",
                      reason="L2 only"))
    else:
      rows.append(row(lib, "clip_grad_norm", rule, "random", "float32", "pass", "1"))
  rows.append(row(lib, "clip_grad_norm", "3", "zero_eq_zero", "float32", "deviation",
                  observed="NaN output", reason="0/0 when norm == max == 0 gives NaN",
                  repro=REPRO_OPTAX, severity="silent-wrong-value", extents=("",) * 4,
                  rel="inf"))
  rows.append(row(lib, "clip_grad_norm", "4", "strict_bound", "float32", "deviation", "0.5",
                  norm_ulp="2.4",
                  observed="norm of output exceeds max by 2.4 ulp",
                  reason="scales by t / norm * max, rounding may overshoot",
                  severity="rounding-level", rel=2.4 * 2.0 ** -24))
  # Everyday: float16 gradients of 300, whose float16 sum of squares overflows.
  rows.append(row(lib, "clip_grad_norm", "5", "float16_300", "float16", "deviation", "inf",
                  observed="norm inf", reason="squares in float16 before any upcast",
                  severity="silent-wrong-value", extents=FLOAT16_300, rel="inf"))
  # Only at the range's edge: float32 entries of 1e20, whose float32 sum of squares overflows.
  lib = "tensorflow.clip_by_global_norm"
  for rule in RULES:
    rows.append(row(lib, "clip_grad_norm", rule, "random", "float32", "pass", "1"))
    rows.append(row(lib, "clip_grad_norm", rule, "float16_300", "float16", "pass", "1",
                    extents=FLOAT16_300))
  rows.append(row(lib, "clip_grad_norm", "5", "float32_1e20", "float32", "deviation", "inf",
                  observed="norm inf", reason="squares in the leaf dtype overflow",
                  severity="silent-wrong-value", extents=FLOAT32_1E20, rel="inf"))
  lib = "torch.clip_grad_norm_"
  for rule in RULES:
    if rule in ("2", "11", "13"):
      rows.append(row(lib, "clip_grad_norm", rule, "per_system", "float32", "not-applicable",
                      reason="not per-system"))
    else:
      rows.append(row(lib, "clip_grad_norm", rule, "random", "bfloat16", "pass", "1"))
  rows.append(row(lib, "clip_grad_norm", "3", "norm_eq_max", "float32", "deviation",
                  observed="[2.9999993, 3.999999]",
                  reason="scales by max / (norm + 1e-6), so a norm at max is still scaled",
                  repro=REPRO_TORCH, severity="rounding-level", rel=2e-7))
  # The same epsilon at a norm of 0.01: 1e-4 off, beyond rounding, within 1e-3.
  rows.append(row(lib, "clip_grad_norm", "4", "small_norm", "float32", "deviation", "1700",
                  observed="factor 1e-4 below max/norm",
                  reason="scales by max / (norm + 1e-6)", severity="rounding-level",
                  extents=SMALL_NORM, rel=1e-4))
  lib = "kups.MaxStepSize"
  for rule in RULES:
    rows.append(row(lib, "clip_by_max_step", rule, "random", "float32", "pass", "0.5"))
  rows.append(row(lib, "clip_by_max_step", "6", "max_negative", "float32", "unexpected-pass",
                  reason="negative max flips the sign of the step",
                  severity="invalid-input-accepted", input_class="invalid"))
  impl = "tmpmod:impl"
  for rule in RULES:
    rows.append(row(impl, "clip_grad_norm", rule, "random", "float64", "pass", "0"))
  rows.append(row(impl, "clip_grad_norm", "11", "permuted", "float32", "fail", "3",
                  observed="norm bits differ when systems are permuted", repro=REPRO_TMP))
  rows.append(row(impl, "clip_grad_norm", "12", "no_mutation", "float32", "error",
                  observed="TypeError: unhashable type: 'list'", result="raised"))
  return rows


def write_conformance():
  with open(os.path.join(HERE, "conformance.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, COLUMNS)
    writer.writeheader()
    writer.writerows(conformance_rows())


# The safe-range scan: (impl, dtype) -> the log2 norms where it fails, with the failing check
# and relative error. TensorFlow's float32 sum of squares overflows from elements of ~1e19
# (a norm of 2**66 and above: the range's edge); optax's float16 one from gradients of ~300
# (a norm of 2**9 and above: everyday); optax's float32 at the same place as TensorFlow's.
SCAN_EXPONENTS = {"float16": range(-23, 16, 2), "float32": range(-146, 128, 4)}
SCAN_FAILURES = {
    ("tensorflow.clip_by_global_norm", "float16"): (lambda e: False, "", 0.0),
    ("tensorflow.clip_by_global_norm", "float32"): (lambda e: e >= 66, "norm", math.inf),
    ("optax.clip_by_global_norm", "float16"): (lambda e: e >= 9, "finite-outputs", 1.0),
    ("optax.clip_by_global_norm", "float32"): (lambda e: e >= 66, "norm", math.inf),
}


def safe_range_rows():
  rows = []
  for (impl, dtype), (fails, check, rel) in SCAN_FAILURES.items():
    kind, library, version, _ = IMPLS[impl]
    for e in SCAN_EXPONENTS[dtype]:
      bad = fails(e)
      rows.append({"impl": impl, "kind": kind, "library": library, "version": version,
                   "op": "clip_grad_norm", "dtype": dtype, "norm_type": "2", "log2_norm": e,
                   "threshold": repr(2.0 ** (e - 1)), "rounding": "fail" if bad else "pass",
                   "material": "fail" if bad else "pass", "rel_error": repr(rel if bad else 0.0),
                   "check": check if bad else "",
                   "observed": f"system 0: {check} check failed" if bad else ""})
  return rows


def write_safe_range():
  with open(os.path.join(HERE, "safe_range.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, list(SAFE_RANGE_COLUMNS))
    writer.writeheader()
    writer.writerows(safe_range_rows())


# workload -> (bytes moved per dtype byte, impls with their seconds per GB moved)
BENCHES = {
    "W1-model": (3 * 2**24, {"clipbench.jax": 0.16, "optax.clip_by_global_norm": 0.45,
                              "torch.clip_grad_norm_": 0.30, "clipbench.numba": 0.12}),
    "W4-many-small": (3 * 10**6, {"clipbench.jax": 0.9, "optax.clip_by_global_norm": 4.0,
                                  "torch.clip_grad_norm_": 6.0, "clipbench.numba": 0.3}),
    "W2-relax": (3 * 1_548_000, {"clipbench.jax": 0.5, "kups.ClipByGlobalNorm": 1.5,
                                 "clipbench.numba": 0.2}),
    "W3-relax-large": (3 * 15_480_000, {"clipbench.jax": 0.2, "kups.ClipByGlobalNorm": 0.8,
                                        "clipbench.numba": 0.13}),
}
BANDWIDTH_GBS = 9.6


def write_benchmarks():
  benchmarks = []
  for workload, (elements3, impls) in BENCHES.items():
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
      nbytes = elements3 * size
      for impl, s_per_gb in impls.items():
        if dtype == "bfloat16" and impl == "clipbench.numba":
          continue  # skipped cases do not appear in pytest-benchmark output
        median = nbytes / 1e9 * s_per_gb
        benchmarks.append({
            "group": workload,
            "name": f"test_workload[{impl}-{workload}-{dtype}]",
            "fullname": f"benchmarks/bench_workloads.py::test_workload[{impl}-{workload}-{dtype}]",
            "params": {"impl": impl, "workload": workload, "dtype": dtype},
            "param": f"{impl}-{workload}-{dtype}",
            "extra_info": {"impl": impl, "kind": "", "version": "", "workload": workload,
                           "op": "", "dtype": dtype, "device": "cpu", "scale": 1.0,
                           "bytes_moved": nbytes, "bandwidth_gbs": BANDWIDTH_GBS,
                           "roofline_seconds": nbytes / (BANDWIDTH_GBS * 1e9)},
            "options": {"disable_gc": False, "timer": "perf_counter", "min_rounds": 5,
                        "max_time": 1.0, "min_time": 5e-06, "warmup": False},
            "stats": {"min": median * 0.97, "max": median * 1.2, "mean": median * 1.02,
                      "stddev": median * 0.03, "rounds": 11, "median": median,
                      "iqr": median * 0.02, "q1": median * 0.99, "q3": median * 1.01,
                      "iqr_outliers": 0, "stddev_outliers": 1, "outliers": "1;0",
                      "ld15iqr": median * 0.97, "hd15iqr": median * 1.1,
                      "ops": 1 / median, "total": median * 11, "iterations": 1},
        })
  data = {
      "machine_info": {"node": "fixture", "processor": "", "machine": "x86_64",
                       "python_version": "3.12.1", "release": "6.1.0", "system": "Linux",
                       "cpu": {"brand_raw": "Fixture CPU @ 2.60GHz", "count": 2,
                               "arch": "X86_64"}},
      "commit_info": {"id": "0123456789abcdef", "dirty": False, "project": "clipbench"},
      "benchmarks": benchmarks,
      "datetime": "2026-11-22T00:00:00.000000+00:00",
      "version": "5.3.1",
  }
  with open(os.path.join(HERE, "benchmarks.json"), "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1)


def write_asv():
  from asv import results as asv_results
  from asv.runner import BenchmarkResult
  root = os.path.join(HERE, "asv_results")
  shutil.rmtree(root, ignore_errors=True)
  machine = "fixture-machine"
  os.makedirs(os.path.join(root, machine))
  with open(os.path.join(root, machine, "machine.json"), "w") as f:
    json.dump({"machine": machine, "arch": "x86_64", "cpu": "Fixture CPU", "num_cpu": "2",
               "os": "Linux", "ram": "8GB", "version": 1}, f)
  params = [["'clipbench.jax'", "'optax.clip_by_global_norm'"], ["'W1-model'", "'W4-many-small'"],
            ["'float32'"], ["'cpu'", "'cuda'"]]
  names = ["impl", "workload", "dtype", "device"]
  benches = {
      "bench_clipping.Clip.time_clip": {"name": "bench_clipping.Clip.time_clip",
                                        "version": "1", "params": params, "param_names": names,
                                        "type": "time", "unit": "seconds"},
      "bench_clipping.Roofline.track_roofline_ratio": {
          "name": "bench_clipping.Roofline.track_roofline_ratio", "version": "1",
          "params": params, "param_names": names, "type": "track", "unit": "unit"},
      "bench_clipping.Accuracy.track_max_ulp_error": {
          "name": "bench_clipping.Accuracy.track_max_ulp_error", "version": "1",
          "params": params, "param_names": names, "type": "track", "unit": "ulp"},
      "bench_clipping.Machine.track_bandwidth_gbs": {
          "name": "bench_clipping.Machine.track_bandwidth_gbs", "version": "1", "params": [],
          "param_names": [], "type": "track", "unit": "GB/s"},
  }
  with open(os.path.join(root, "benchmarks.json"), "w") as f:
    json.dump({**benches, "version": 2}, f)
  nan = float("nan")
  for i, (commit, day) in enumerate((("a" * 40, 20), ("b" * 40, 21))):
    date = int(datetime.datetime(2026, 11, day, tzinfo=datetime.timezone.utc).timestamp() * 1000)
    res = asv_results.Results({"machine": machine, "python": "3.12"}, {}, commit, date, "3.12",
                              "existing-py", {})
    speed = 1.0 - 0.2 * i
    values = {
        "bench_clipping.Clip.time_clip": [0.02 * speed, nan, 0.004 * speed, nan,
                                          0.05, nan, 0.02, nan],
        "bench_clipping.Roofline.track_roofline_ratio": [1.6 * speed, nan, 9.0 * speed, nan,
                                                         4.5, nan, 40.0, nan],
        "bench_clipping.Accuracy.track_max_ulp_error": [0.5, nan, 0.5, nan, 1.0, nan, 1.0, nan],
    }
    values["bench_clipping.Machine.track_bandwidth_gbs"] = [9.6 + i]  # not parametrized
    for name, result in values.items():
      n = len(result)
      res.add_result(benches[name], BenchmarkResult(result, [None] * n, [None] * n, 0, "", None))
    res.save(root)


if __name__ == "__main__":
  write_conformance()
  write_safe_range()
  write_benchmarks()
  write_asv()
