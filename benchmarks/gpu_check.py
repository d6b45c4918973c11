"""``make gpu-check``: what only a CUDA machine can tell about the own kernels.

``python -m clipbench.benchmarks.gpu_check [--scale S] [--jobs N] [--workdir DIR] [--output
PATH]`` runs, on a machine whose torch sees a CUDA GPU:

1. the card's copy bandwidth, measured, and its datasheet peak (``PEAK_BANDWIDTH_GBS``);
2. the CUDA benchmarks, first, on a card nothing else uses: ``clipbench bench`` on device
   ``cuda`` for every implementation the grid times there (``grid.impls_for(family,
   "cuda")``: the asv ``...Cuda`` classes' grid);
3. the conformance suite for the own torch (eager and ``torch.compile``), Triton and JAX
   (``clipbench.jax`` and its XLA-graph route ``clipbench.jax-xla``) implementations with
   their work on the GPU, ``N`` children at a time (each with its own log);

and writes one Markdown section (``results/gpu-check.md`` by default) with each benchmark's
achieved bandwidth -- the three passes over the data of the roofline (read, read, write) over
its median time -- against both. Elsewhere it prints one line saying there is no GPU and exits
0, so the target is harmless in any CI. Exit status otherwise: 0 when every conformance run
that could start passed and the benchmarks ran; 1 when not.

The conformance suite has no device option (it calls every implementation on host arrays), so
each implementation is checked through an ``OnDevice`` proxy: the suite prepares its inputs as
always, the proxy moves leaves and segments to the GPU, calls the implementation there, checks
that the outputs stayed on the GPU and hands them back to the host for the rule checks. What
that does not check on the GPU: rule 12's "inputs not modified" sees the host inputs, not the
GPU copies, and the transforms (jit, ``torch.compile``) are not declared by the proxies. The
proxies carry names of their own (``clipbench.torch@cuda``): no deviation is listed for them,
so every failure counts, as for the own implementations on the CPU.

The children run without ``TRITON_INTERPRET``: on a GPU the Triton kernels must be compiled,
not interpreted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from clipbench import child_run, files
from clipbench.benchmarks import grid, roofline, timing
from clipbench.impls import registry

DEFAULT_OUTPUT = os.path.join("results", "gpu-check.md")

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

# The children import the proxies from here: not ``__name__``, which is "__main__" under ``-m``.
MODULE = "clipbench.benchmarks.gpu_check"

# The own implementations checked on the GPU, by the attribute of this module that runs each
# there: ``clipbench conform --impl clipbench.benchmarks.gpu_check:torch_on_cuda``.
ON_CUDA: dict[str, str] = {
    "torch_on_cuda": "clipbench.torch",
    "torch_compile_on_cuda": "clipbench.torch-compile",
    "triton_on_cuda": "clipbench.triton",
    "jax_on_cuda": "clipbench.jax",
    "jax_xla_on_cuda": "clipbench.jax-xla",
}

OUTCOMES = ("pass", "deviation", "fail", "unexpected-pass", "error", "not-applicable")


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
  if not timing.cuda_device_node_present():
    return "no CUDA GPU on this machine (no /dev/nvidia* device node)"
  import torch
  if not torch.cuda.is_available():
    return "no CUDA GPU visible to torch (torch.cuda.is_available() is False)"
  return None


# --- Running an implementation on a device behind the suite's host calling convention ---


def _torch_movers(device: str) -> tuple[Callable[[Any], Any], Callable[[Any], Any],
                                        Callable[[Any], bool], Callable[[Any], bool]]:
  import torch
  target = torch.device(device)

  def to_device(x: Any) -> Any:
    return x.to(target) if isinstance(x, torch.Tensor) else x

  def to_host(x: Any) -> Any:
    return x.cpu() if isinstance(x, torch.Tensor) else x

  def on_device(x: Any) -> bool:
    return not isinstance(x, torch.Tensor) or x.device.type == target.type

  return to_device, to_host, on_device, lambda x: isinstance(x, torch.Tensor)


def _jax_movers(device: str) -> tuple[Callable[[Any], Any], Callable[[Any], Any],
                                      Callable[[Any], bool], Callable[[Any], bool]]:
  import jax
  target = jax.devices("gpu" if device == "cuda" else "cpu")[0]
  host = jax.devices("cpu")[0]

  def to_device(x: Any) -> Any:
    return jax.device_put(x, target) if isinstance(x, jax.Array) else x

  def to_host(x: Any) -> Any:
    return jax.device_put(x, host) if isinstance(x, jax.Array) else x

  def on_device(x: Any) -> bool:
    return not isinstance(x, jax.Array) or x.devices() == {target}

  return to_device, to_host, on_device, lambda x: isinstance(x, jax.Array)


# Per framework: (to the device, to the host, on the device or not an array, is an array).
_MOVERS = {"torch": _torch_movers, "jax": _jax_movers}


def _map_leaves(move: Callable[[Any], Any], leaves: Any) -> Any:
  # Bad-input cases pass things that are not sequences of arrays: those go through untouched.
  if isinstance(leaves, (list, tuple)):
    return [move(x) for x in leaves]
  return move(leaves)


class OnDevice:
  """A registered implementation called on ``device``, taking and returning host arrays.

  Args:
    impl_name: a registered implementation of the torch or JAX framework, not in place.
    device: ``"cuda"`` (the check) or ``"cpu"`` (for testing the proxy itself).
  """

  def __init__(self, impl_name: str, device: str = "cuda"):
    if device not in registry.DEVICES:
      raise ValueError(f"device: expected one of {registry.DEVICES}, got {device!r}")
    impl = registry.load(impl_name)
    if not impl.available:
      raise ValueError(f"impl_name: {impl_name} is unavailable here: {impl.reason}")
    if impl.framework not in _MOVERS:
      raise ValueError(f"impl_name: {impl_name} is a {impl.framework} implementation; only "
                       f"{'/'.join(_MOVERS)} ones run on a GPU")
    if impl.capabilities.in_place:
      raise ValueError(f"impl_name: {impl_name} clips in place; its writes would land in the "
                       "device copies the suite never sees")
    self.name = f"{impl_name}@{device}"
    self.framework = impl.framework
    self.library = impl.library
    self.version = impl.version
    self.description = f"{impl.description}, called on {device}"
    # Only this device: the sharded-input rule runs its ranks on the host (gloo processes, JAX
    # host devices), which a call moved onto one GPU cannot take part in.
    self.capabilities = dataclasses.replace(impl.capabilities, transforms=(), devices=(device,))
    self._device = device
    (self._to_device, self._to_host, self._on_device,
     self._is_array) = _MOVERS[impl.framework](device)
    for op in impl.ops:
      setattr(self, op, self._called_on_device(impl.function(op)))

  def _has_array(self, leaves: Any) -> bool:
    return any(self._is_array(x) for x in
               (leaves if isinstance(leaves, (list, tuple)) else [leaves]))

  def _called_on_device(self, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)  # keeps the signature the suite's probing reads
    def call(leaves: Any, threshold: Any, **kwargs: Any) -> Any:
      if kwargs.get("segments") is not None:
        kwargs["segments"] = _map_leaves(self._to_device, kwargs["segments"])
      result = function(_map_leaves(self._to_device, leaves), self._to_device(threshold),
                        **kwargs)
      if not (isinstance(result, tuple) and len(result) == 2):
        return result  # a broken convention: the suite's preflight reports it as it is
      out, norms = result
      returned = list(out) if isinstance(out, (list, tuple)) else [out]
      # With no array among the leaves (no leaves at all, say) nothing tells the
      # implementation which device to use: its norms may rightly be on the host.
      placed = [*returned, norms] if self._has_array(leaves) else returned
      if not all(self._on_device(x) for x in placed):
        raise RuntimeError(f"{self.name}: returned leaves or norms off {self._device}")
      return _map_leaves(self._to_host, out), self._to_host(norms)
    return call


@functools.cache
def _on_cuda(impl_name: str) -> OnDevice:
  return OnDevice(impl_name, "cuda")


def __getattr__(attr: str) -> Any:
  # The proxies load their implementation (and its framework) only when the suite asks.
  if attr in ON_CUDA:
    return _on_cuda(ON_CUDA[attr])
  raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


# --- Measurements ---


@dataclasses.dataclass(frozen=True)
class Device:
  """The card: its name, the datasheet peak (None: unknown) and the measured copy bandwidth."""

  name: str
  peak_gbs: float | None
  copy_gbs: float | None
  software: str = ""


@dataclasses.dataclass(frozen=True)
class ConformanceRun:
  """One implementation's conformance on the GPU: outcome counts, or why it did not run.

  ``exit_status``: the suite's. It also fails where the result table cannot tell (a failed
  preflight leaves no rows for the operation; a crash leaves no table); a run that could not
  start here (no JAX GPU backend) is ``not_run`` and no failure.
  """

  impl: str
  counts: dict[str, int]
  not_run: str = ""
  exit_status: int = 0

  @property
  def failures(self) -> int:
    return sum(self.counts.get(o, 0) for o in ("fail", "unexpected-pass", "error"))

  @property
  def failed(self) -> bool:
    return bool(self.failures) or self.exit_status != 0

  @property
  def verdict(self) -> str:
    if self.not_run:
      return f"not run: {self.not_run}"
    if self.failures:
      return f"{self.failures} failing"
    if self.exit_status != 0:
      return f"clipbench conform exited {self.exit_status}"
    if not self.counts.get("pass"):
      return "nothing passed"
    return "conforms"


@dataclasses.dataclass(frozen=True)
class Timing:
  """One CUDA benchmark: the median call and the bandwidth it achieved (three passes)."""

  workload: str
  impl: str
  dtype: str
  median_s: float
  achieved_gbs: float


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


def describe_device() -> Device:
  import torch
  name = torch.cuda.get_device_name(0)
  software = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
  return Device(name, peak_bandwidth_gbs(name), measure_cuda_copy_bandwidth() / 1e9, software)


def cuda_benchmarked_impls() -> list[str]:
  """Every implementation the grid times on CUDA, in registry order."""
  names = {n for f in grid.FAMILIES for n in grid.impls_for(f.name, "cuda")}
  return [e.name for e in grid.timed_entries() if e.name in names]


def _child_env() -> dict[str, str]:
  env = dict(os.environ)
  env.pop("TRITON_INTERPRET", None)
  # Children share the card (--jobs): JAX would otherwise take 75% of its memory in each.
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  return env


def jax_gpu_reason() -> str | None:
  """Why JAX cannot run on the GPU here (no CUDA plugin installed), or None."""
  try:
    import jax
    jax.devices("gpu")
  except RuntimeError as e:
    return f"jax has no GPU backend ({str(e).splitlines()[0]}); install jax[cuda13]"
  return None


def count_outcomes(results_csv: str, impl: str) -> dict[str, int]:
  # pandas, not the csv module: the reproducer column holds whole scripts, past the csv
  # module's default field limit (128 KiB).
  import pandas as pd
  table = pd.read_csv(results_csv, dtype=str, keep_default_na=False)
  return {str(k): int(v) for k, v in
          table.loc[table["impl"] == impl, "outcome"].value_counts().items()}


def conformance_command(attr: str, results_csv: str) -> list[str]:
  """The child that checks the proxy ``attr`` of this module and writes ``results_csv``."""
  return [sys.executable, "-m", "clipbench", "conform", "--impl", f"{MODULE}:{attr}",
          "--results", results_csv]


def run_conformance(workdir: str, jobs: int = 1) -> list[ConformanceRun]:
  """One ``clipbench conform`` child per own implementation, its work on the GPU, at most
  ``jobs`` at a time. Each child's output goes to ``<workdir>/conformance-<attr>.log`` and is
  printed whole when it ends, so that concurrent children do not interleave."""
  runs: dict[str, ConformanceRun] = {}
  pending: list[tuple[str, str, list[str]]] = []
  for attr, impl_name in ON_CUDA.items():
    proxy_name = f"{impl_name}@cuda"
    impl = registry.load(impl_name)
    reason = (f"{impl_name} unavailable: {impl.reason}" if not impl.available else
              jax_gpu_reason() if impl.framework == "jax" else None)
    if reason:
      runs[attr] = ConformanceRun(proxy_name, {}, reason)
      continue
    pending.append((attr, proxy_name,
                    conformance_command(attr, os.path.join(workdir, f"conformance-{attr}.csv"))))
  running: list[tuple[str, str, subprocess.Popen, Any]] = []

  def finish(attr: str, proxy_name: str, child: subprocess.Popen, log: Any) -> None:
    rc = child.wait()
    log.close()
    with open(log.name, encoding="utf-8", errors="replace") as f:
      print(f"--- {proxy_name}: exit status {rc} (log {log.name})\n{f.read()}", flush=True)
    results_csv = os.path.join(workdir, f"conformance-{attr}.csv")
    try:
      counts = count_outcomes(results_csv, proxy_name) if os.path.exists(results_csv) else {}
    except (OSError, ValueError, KeyError) as e:  # an unreadable table fails this run only
      print(f"--- {proxy_name}: result table {results_csv} unreadable: {e}", flush=True)
      counts, rc = {}, rc or 1
    runs[attr] = ConformanceRun(proxy_name, counts, exit_status=rc)

  try:
    for attr, proxy_name, cmd in pending:
      while len(running) >= jobs:
        finish(*running.pop(_first_done(running)))
      print("$ " + " ".join(cmd), flush=True)
      log = open(os.path.join(workdir, f"conformance-{attr}.log"), "w", encoding="utf-8")
      child = subprocess.Popen(cmd, env=_child_env(), stdout=log, stderr=subprocess.STDOUT)
      running.append((attr, proxy_name, child, log))
    while running:
      finish(*running.pop(_first_done(running)))
  finally:
    for _, _, child, log in running:  # interrupted: no child outlives the check
      child_run.stop_child(child)  # SIGINT first, so that its own pytest child stops too
      log.close()
  return [runs[attr] for attr in ON_CUDA]


def _first_done(running: Sequence[tuple[str, str, subprocess.Popen, Any]]) -> int:
  """The index of a child that has ended, waiting for one."""
  while True:
    for i, (_, _, child, _) in enumerate(running):
      if child.poll() is not None:
        return i
    time.sleep(0.2)


def run_benchmarks(workdir: str, scale: float) -> tuple[int, list[Timing]]:
  """``clipbench bench`` on device cuda; its exit status and the CUDA timings it wrote."""
  json_path = os.path.join(workdir, "benchmarks-cuda.json")
  cmd = [sys.executable, "-m", "clipbench", "bench", "--scale", repr(scale), "--json", json_path]
  for name in cuda_benchmarked_impls():
    cmd += ["--impl", name]
  cmd += ["--", "--bench-device", "cuda"]
  print("$ " + " ".join(cmd), flush=True)
  rc = subprocess.call(cmd, env=_child_env())
  if rc != 0 or not os.path.exists(json_path):
    return rc or 1, []
  frame = roofline.summarize(json_path)
  frame = frame[frame["device"] == "cuda"]
  return rc, [Timing(r.workload, r.impl, r.dtype, float(r.median_s), float(r.gbs))
              for r in frame.itertuples()]


# --- The report section ---


def _gbs(value: float) -> str:
  return f"{value:,.0f}"


def _share(achieved: float, of: float | None, missing: str) -> str:
  return missing if of is None or not of > 0 else f"{100.0 * achieved / of:.0f}%"


def _milliseconds(seconds: float) -> str:
  ms = seconds * 1e3
  return f"{ms:.3f} ms" if ms < 1 else f"{ms:.2f} ms" if ms < 100 else f"{ms:.0f} ms"


def report_section(device: Device, conformance: Sequence[ConformanceRun],
                   timings: Sequence[Timing], scale: float) -> str:
  """The Markdown section of one GPU check."""
  peak = ("unknown peak (the card is not in gpu_check.PEAK_BANDWIDTH_GBS)"
          if device.peak_gbs is None else f"peak {_gbs(device.peak_gbs)} GB/s (datasheet)")
  copy = ("copy bandwidth not measured" if device.copy_gbs is None else
          f"measured copy bandwidth {_gbs(device.copy_gbs)} GB/s")
  if device.copy_gbs is not None and device.peak_gbs is not None:
    copy += f" ({_share(device.copy_gbs, device.peak_gbs, '')} of peak)"
  lines = [f"## GPU check: {device.name}", ""]
  if device.software:
    lines += [f"{device.software}; {peak}; {copy}.", ""]
  else:
    lines += [f"{peak}; {copy}.", ""]
  lines += ["### Conformance on CUDA", "",
            "| implementation | verdict | " + " | ".join(OUTCOMES) + " |",
            "|---|---|" + "---:|" * len(OUTCOMES)]
  for run in conformance:
    cells = ["–" if run.not_run else str(run.counts.get(o, 0)) for o in OUTCOMES]
    lines.append(f"| {run.impl} | {run.verdict} | " + " | ".join(cells) + " |")
  lines += ["", f"### CUDA benchmarks (scale {scale:g})", "",
            "Achieved bandwidth: the three passes over the data (read, read, write) over the "
            "median call time.", ""]
  if not timings:
    lines.append("No CUDA benchmark ran.")
  else:
    lines += ["| workload | dtype | implementation | median | achieved GB/s | of peak | "
              "of measured copy |", "|---|---|---|---:|---:|---:|---:|"]
    for t in timings:
      lines.append(
          f"| {t.workload} | {t.dtype} | {t.impl} | {_milliseconds(t.median_s)} | "
          f"{_gbs(t.achieved_gbs)} | {_share(t.achieved_gbs, device.peak_gbs, 'unknown peak')} | "
          f"{_share(t.achieved_gbs, device.copy_gbs, 'not measured')} |")
  return "\n".join(lines) + "\n"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m clipbench.benchmarks.gpu_check",
      description="Conformance of the own kernels on CUDA, the CUDA benchmarks and achieved "
      "bandwidth against the card's peak; without a GPU, one line and exit 0.")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="workload scale of the benchmarks (1.0 = the stated sizes)")
  parser.add_argument("--jobs", type=int, default=1,
                      help="conformance children run at once (they share the card; the "
                      "benchmarks always run alone, before them)")
  parser.add_argument("--workdir",
                      help="keep the children's result tables and logs in this folder "
                      "(default: a temporary folder, removed afterwards)")
  parser.add_argument("--output", default=DEFAULT_OUTPUT,
                      help=f"where the Markdown section goes (default: {DEFAULT_OUTPUT})")
  args = parser.parse_args(argv)
  if not args.scale > 0:
    parser.error(f"--scale: expected a positive number, got {args.scale!r}")
  if args.jobs < 1:
    parser.error(f"--jobs: expected a positive integer, got {args.jobs!r}")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse(argv)
  reason = no_gpu_reason()
  if reason:
    print(f"gpu-check: {reason}; nothing checked")
    return 0
  device = describe_device()
  with contextlib.ExitStack() as stack:
    if args.workdir:
      os.makedirs(args.workdir, exist_ok=True)
      workdir = args.workdir
    else:
      workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-"))
    # The benchmarks first, on a card nothing else uses; then the conformance children.
    bench_rc, timings = run_benchmarks(workdir, args.scale)
    conformance = run_conformance(workdir, args.jobs)
  section = report_section(device, conformance, timings, args.scale)
  folder = os.path.dirname(args.output)
  if folder:
    os.makedirs(folder, exist_ok=True)
  files.write_text(args.output, section)
  print(section)
  print(f"gpu-check: report section written to {args.output}")
  failed = any(run.failed for run in conformance) or bench_rc != 0
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
