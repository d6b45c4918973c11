#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one command, on a lent card without network (section 7):
# issue 30's timed targets, where the Triton route's host time goes (its launcher among
# it), and the GPU report.
#
#   benchmarks/lent_gpu_run.sh WHEELS_DIR OUT_DIR
#
# WHEELS_DIR holds clipbench's wheel and the pinned pure-Python tools (`pip wheel --no-deps .`,
# `pip download --no-deps hypothesis pytest pytest-benchmark rich ...`); the machine's own
# torch, Triton and JAX are used. Everything runs from /tmp: the tree's clipbench/ folder would
# shadow the installed package. Each step has its own time limit, so one that hangs leaves the
# others their time; OUT_DIR receives the logs, the targets table and the report as one archive.
set -uo pipefail
wheels=$(realpath "${1:?WHEELS_DIR}")
out=$(realpath "${2:?OUT_DIR}")
site=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" "$wheels"/*.whl || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd /tmp || exit 1
nvidia-smi >"$out/nvidia-smi.txt" 2>&1

echo "== targets"
timeout "${TARGETS_SECONDS:-240}" python3 -m clipbench.benchmarks.gpu_targets \
  --gpu-scale "${GPU_SCALE:-1}" --output "$out/targets.csv" 2>&1 | tee "$out/targets.log" \
  | grep -v "^{'workload'"

echo "== host profile"
timeout "${PROFILE_SECONDS:-60}" python3 - >"$out/host-profile.txt" 2>&1 <<'EOF'
"""Where a Triton call's wall time goes on the card: the call timed alone, then cProfile."""
import cProfile, io, pstats, statistics, time
import torch
from clipbench.benchmarks import timing, workloads
for name in ("W2-relax", "W4-many-small", "W1-model"):
  workload = workloads.get(name)
  inputs = workload.build(1.0, "float32")
  impl, _, reason = timing.load_case("clipbench.triton", name, "float32", "cuda")
  prepared = timing.prepare(impl, workload, inputs, "cuda")
  run = timing.timed_runner(impl, prepared)
  for _ in range(3):
    run(prepared)
  walls = []
  for _ in range(30):
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(prepared)
    walls.append(time.perf_counter() - start)
  profiler = cProfile.Profile()
  profiler.enable()
  for _ in range(30):
    run(prepared)
  profiler.disable()
  text = io.StringIO()
  pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
  pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
  print(f"===== {name} clipbench.triton: median wall {statistics.median(walls) * 1e3:.3f} ms "
        f"(30 calls); profile of 30 calls below")
  print(text.getvalue())
EOF
grep "=====" "$out/host-profile.txt"

echo "== Triton's launcher on this host (section 14)"
timeout "${LAUNCHER_SECONDS:-60}" python3 -m clipbench.benchmarks.triton_launcher \
  --output "$out/launcher.csv" 2>&1 | tail -6

echo "== GPU report"
timeout "${REPORT_SECONDS:-270}" python3 -m clipbench.benchmarks.gpu_check --out /tmp/gpu-report \
  --results-dir /tmp/gpu-results --jobs 12 --budget "${BUDGET:-90}" --timeout 60 \
  >"$out/report.log" 2>&1
echo "report exit $?"
tail -15 "$out/report.log"
tar czf "$out/gpu-report.tgz" -C /tmp gpu-report gpu-results 2>/dev/null
ls -la "$out"
