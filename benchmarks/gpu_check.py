"""``make gpu-check``: the GPU report, ``clipbench report --device cuda``, sized for a short run.

``python -m clipbench.benchmarks.gpu_check [--present] [REPORT OPTIONS]`` runs, on a machine
whose torch sees a CUDA GPU, ``clipbench report --device cuda`` for every implementation with a
GPU path (every torch, JAX and TensorFlow one that loads there: the conformance suite, the
safe-range scan and the benchmarks on the card), written to ``reports/latest-gpu/`` from raw
results in ``results/gpu/``. The benchmarks record the card's name, its datasheet peak
bandwidth (``PEAK_BANDWIDTH_GBS``) and its measured copy bandwidth; the report's GPU section
puts each benchmark's achieved bandwidth beside both. The defaults (:data:`REPORT_DEFAULTS`:
the implementations side by side, one process per CPU core, each one's tests bounded by a
budget, the benchmarks at ``--quick`` scale) keep the run within minutes; any report option
given replaces its default.

Elsewhere it prints one line saying there is no GPU and exits 0, so the target is harmless in
any CI; ``--present`` only asks (exit 0 with a GPU, else that line and exit 1: the Makefile
installs JAX's CUDA plugin only where there is a GPU). Otherwise the exit status is the
report's.

The report runs without ``TRITON_INTERPRET`` (on a GPU the Triton kernels are compiled), with
each framework's memory growing as it needs on the shared card (``devices.environment``).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from typing import Sequence

from clipbench import devices

# Datasheet memory bandwidth in GB/s (NVIDIA's product pages), by the name
# ``torch.cuda.get_device_name`` reports. The first pattern found in the name wins, so the
# variants come before the bare model; a name matching none has an unknown peak (a bare
# "A100" is 1,555 or 2,039 GB/s depending on its memory, so it is not guessed).
PEAK_BANDWIDTH_GBS: tuple[tuple[str, float], ...] = (
    (r"\bH200\b", 4800.0),               # H200 SXM and H200 NVL, 141 GB HBM3e
    (r"\bH100 NVL\b", 3900.0),           # 94 GB HBM3
    (r"\bH100 PCIe\b", 2000.0),          # 80 GB HBM2e
    (r"\bH100\b", 3350.0),               # SXM5, 80 GB HBM3 ("NVIDIA H100 80GB HBM3")
    (r"\bA100-SXM4-80GB\b", 2039.0),
    (r"\bA100 80GB PCIe\b", 1935.0),
    (r"\bA100-SXM4-40GB\b", 1555.0),
    (r"\bA100-PCIE-40GB\b", 1555.0),
)

# The GPU report's own options; a report option on the command line replaces its default.
REPORT_DEFAULTS: dict[str, str | None] = {
    "--latest": "latest-gpu",          # reports/latest-gpu/, beside the CPU's reports/latest/
    "--results-dir": os.path.join("results", "gpu"),
    "--jobs": str(os.cpu_count() or 1),
    "--budget": "120",                 # seconds of tests per implementation
    "--timeout": "120",                # seconds per call
    "--quick": None,                   # the ci profile, the benchmarks at scale 0.02
}


def peak_bandwidth_gbs(device_name: str) -> float | None:
  """The datasheet memory bandwidth of the card named ``device_name``, or None if unknown."""
  for pattern, gbs in PEAK_BANDWIDTH_GBS:
    if re.search(pattern, device_name, re.IGNORECASE):
      return gbs
  return None


def no_gpu_reason() -> str | None:
  """Why there is no CUDA GPU to check, or None when torch sees one.

  The device node is looked for first, so a machine without one never imports torch.
  """
  if not devices.cuda_device_node_present():
    return "no CUDA GPU on this machine (no /dev/nvidia* device node)"
  import torch
  if not torch.cuda.is_available():
    return "no CUDA GPU visible to torch (torch.cuda.is_available() is False)"
  return None


def measure_cuda_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> float:
  """Best device-to-device copy bandwidth (bytes read plus written per second) on the GPU,
  timed with CUDA events over ``repeats`` copies of an ``nbytes`` buffer."""
  import torch
  src = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device="cuda")
  dst = torch.empty_like(src)
  dst.copy_(src)  # first touch, untimed
  torch.cuda.synchronize()
  best = math.inf
  for _ in range(repeats):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    best = min(best, start.elapsed_time(end) / 1e3)
  return 2.0 * src.nbytes / max(best, 1e-9)


def card_facts() -> dict[str, object]:
  """The card the CUDA benchmarks run on: its name, datasheet peak (GB/s, None when unknown)
  and the software that drives it, as the benchmark JSON records them."""
  import torch
  name = torch.cuda.get_device_name(0)
  return {"name": name, "peak_gbs": peak_bandwidth_gbs(name),
          "software": f"torch {torch.__version__}, CUDA {torch.version.cuda}"}


def report_command(argv: Sequence[str]) -> list[str]:
  """``clipbench report --device cuda`` with :data:`REPORT_DEFAULTS` under ``argv``."""
  given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
  cmd = [sys.executable, "-m", "clipbench", "report", "--device", "cuda"]
  for option, value in REPORT_DEFAULTS.items():
    if option in given or (option == "--quick" and given & {"--scale", "--profile"}):
      continue
    cmd += [option] if value is None else [option, value]
  return cmd + list(argv)


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  asked_only = "--present" in argv
  reason = no_gpu_reason()
  if reason:
    print(f"gpu-check: {reason}; nothing checked")
    return 1 if asked_only else 0
  if asked_only:
    return 0
  cmd = report_command(argv)
  print("$ " + " ".join(cmd), flush=True)
  env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
  try:
    return subprocess.call(cmd, env=env)
  except KeyboardInterrupt:
    return 130


if __name__ == "__main__":
  sys.exit(main())
